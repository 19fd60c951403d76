// The CPU runner of the pointwise functors: the chunks of the shared plan are
// spread over threads with at::parallel_for; each chunk is a tight loop over its
// elements.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../dispatch.h"
#include "../multi_tensor_plan.h"

namespace mixedprec::cpu {

struct CpuEngine {
  struct Guard {  // one CPU device: nothing to set
    explicit Guard(const at::Device&) {}
  };

  static void increment_step(float* step, const float* found_inf) {
    mixedprec::increment_step(step, found_inf);
  }

  static void update_loss_scale(float* scale, int32_t* growth_tracker,
                                int32_t* hysteresis_tracker, const float* found_inf,
                                const LossScaleArgs& args) {
    mixedprec::update_loss_scale(scale, growth_tracker, hysteresis_tracker, found_inf, args);
  }

  template <typename Op, typename... Ts>
  static void run(const Lists<sizeof...(Ts)>& lists, const Op& op, const float* skip,
                  float* found_inf) {
    run_lists<Op, Ts...>(lists, op, skip, found_inf, std::index_sequence_for<Ts...>{});
  }

 private:
  template <typename Op, typename... Ts, size_t... K>
  static void run_lists(const Lists<sizeof...(Ts)>& lists, const Op& op_in, const float* skip,
                        float* found_inf, std::index_sequence<K...>) {
    constexpr int D = sizeof...(Ts);
    if (skip != nullptr && *skip != 0.f) return;
    Op op = op_in;
    op.resolve();
    std::vector<int64_t> numels;
    for (const auto& t : lists[0]) numels.push_back(t.numel());
    const auto plans = plan_launches(numels, 0, 0);
    if (plans.empty()) return;
    const LaunchPlan& plan = plans.front();
    const int64_t num_chunks = static_cast<int64_t>(plan.block_slot.size());
    std::vector<char> bad(num_chunks, 0);
    at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int t = plan.tensors[plan.block_slot[b]];
        const int64_t begin = static_cast<int64_t>(plan.block_chunk[b]) * kChunkSize;
        const int64_t end = std::min(numels[t], begin + kChunkSize);
        const void* in[D] = {((Op::kReads >> K) & 1u) && !lists[K].empty()
                                 ? lists[K][t].data_ptr()
                                 : nullptr...};
        void* out[D] = {((Op::kWrites >> K) & 1u) && !lists[K].empty()
                            ? lists[K][t].data_ptr()
                            : nullptr...};
        bool any = false;
        for (int64_t i = begin; i < end; ++i) {
          float x[D] = {};
          (load_element<Ts>(in[K], i, x[K]), ...);
          any |= op.apply(x);
          (store_element<Ts>(out[K], i, x[K]), ...);
        }
        bad[b] = any;
      }
    });
    if (found_inf != nullptr && std::any_of(bad.begin(), bad.end(), [](char c) { return c; })) {
      *found_inf = 1.f;
    }
  }
};

}  // namespace mixedprec::cpu
