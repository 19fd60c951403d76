#include "multi_tensor_plan.h"

#include <stdexcept>

namespace mixedprec {

std::vector<LaunchPlan> plan_launches(const std::vector<int64_t>& numels, int max_tensors,
                                      int max_blocks) {
  std::vector<LaunchPlan> plans;
  LaunchPlan current;
  auto full_tensors = [&] {
    return max_tensors > 0 && static_cast<int>(current.tensors.size()) >= max_tensors;
  };
  auto full_blocks = [&] {
    return max_blocks > 0 && static_cast<int>(current.block_slot.size()) >= max_blocks;
  };
  auto flush = [&] {
    if (!current.block_slot.empty()) plans.push_back(std::move(current));
    current = LaunchPlan{};
  };
  for (size_t t = 0; t < numels.size(); ++t) {
    if (numels[t] < 0) throw std::invalid_argument("plan_launches: negative numel");
    const int64_t chunks = num_chunks(numels[t]);
    if (chunks == 0) continue;
    if (chunks > INT32_MAX) throw std::invalid_argument("plan_launches: tensor too large");
    if (full_tensors() || full_blocks()) flush();
    current.tensors.push_back(static_cast<int>(t));
    for (int64_t c = 0; c < chunks; ++c) {
      if (full_blocks()) {
        flush();
        current.tensors.push_back(static_cast<int>(t));
      }
      current.block_slot.push_back(static_cast<int>(current.tensors.size()) - 1);
      current.block_chunk.push_back(static_cast<int>(c));
    }
  }
  flush();
  return plans;
}

}  // namespace mixedprec
