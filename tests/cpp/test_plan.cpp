// The launch planner of the multi-tensor engine: chunking, the limits of one
// launch, and the tensor-major block order that reductions rely on.
#include <gtest/gtest.h>

#include <stdexcept>
#include <utility>
#include <vector>

#include "multi_tensor_plan.h"

namespace mixedprec {
namespace {

// (tensor index, chunk index) of every block over all launches, in launch order.
std::vector<std::pair<int, int>> blocks(const std::vector<LaunchPlan>& plans) {
  std::vector<std::pair<int, int>> out;
  for (const auto& plan : plans) {
    EXPECT_EQ(plan.block_slot.size(), plan.block_chunk.size());
    for (size_t b = 0; b < plan.block_slot.size(); ++b) {
      out.emplace_back(plan.tensors.at(plan.block_slot[b]), plan.block_chunk[b]);
    }
  }
  return out;
}

// Every chunk of every tensor, tensor by tensor: the order the plan must follow.
std::vector<std::pair<int, int>> tensor_major(const std::vector<int64_t>& numels) {
  std::vector<std::pair<int, int>> out;
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t c = 0; c < num_chunks(numels[t]); ++c) {
      out.emplace_back(static_cast<int>(t), static_cast<int>(c));
    }
  }
  return out;
}

TEST(PlanLaunches, EmptyListHasNoLaunch) {
  EXPECT_TRUE(plan_launches({}, 8, 8).empty());
  EXPECT_TRUE(plan_launches({}, 0, 0).empty());
}

TEST(PlanLaunches, ZeroSizeTensorsGetNoSlotAndNoBlock) {
  const auto plans = plan_launches({0, 5, 0, 7, 0}, 8, 8);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].tensors, (std::vector<int>{1, 3}));
  EXPECT_EQ(plans[0].block_slot, (std::vector<int>{0, 1}));
  EXPECT_EQ(plans[0].block_chunk, (std::vector<int>{0, 0}));
  EXPECT_TRUE(plan_launches({0, 0}, 8, 8).empty());
}

TEST(PlanLaunches, ChunkCountsAtTheChunkSizeEdges) {
  EXPECT_EQ(num_chunks(0), 0);
  EXPECT_EQ(num_chunks(1), 1);
  EXPECT_EQ(num_chunks(kChunkSize - 1), 1);
  EXPECT_EQ(num_chunks(kChunkSize), 1);
  EXPECT_EQ(num_chunks(kChunkSize + 1), 2);
  const std::vector<int64_t> numels = {kChunkSize - 1, kChunkSize, kChunkSize + 1};
  const auto plans = plan_launches(numels, 0, 0);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].tensors, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(blocks(plans), (std::vector<std::pair<int, int>>{{0, 0}, {1, 0}, {2, 0}, {2, 1}}));
}

TEST(PlanLaunches, TensorLimitSplitsLaunches) {
  const auto plans = plan_launches({1, 1, 1, 1, 1}, 2, 100);
  ASSERT_EQ(plans.size(), 3u);
  EXPECT_EQ(plans[0].tensors, (std::vector<int>{0, 1}));
  EXPECT_EQ(plans[1].tensors, (std::vector<int>{2, 3}));
  EXPECT_EQ(plans[2].tensors, (std::vector<int>{4}));
  for (const auto& plan : plans) {
    EXPECT_LE(plan.tensors.size(), 2u);
  }
}

TEST(PlanLaunches, BlockLimitSplitsLaunches) {
  // Four one-chunk tensors, three blocks per launch.
  const auto plans = plan_launches({1, 1, 1, 1}, 100, 3);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].tensors, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(plans[0].block_slot, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(plans[1].tensors, (std::vector<int>{3}));
  EXPECT_EQ(plans[1].block_slot, (std::vector<int>{0}));
}

TEST(PlanLaunches, TensorContinuesInTheNextLaunch) {
  // Tensor 1 has three chunks; the first launch has room for two of them.
  const std::vector<int64_t> numels = {kChunkSize, 2 * kChunkSize + 1};
  const auto plans = plan_launches(numels, 100, 3);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].tensors, (std::vector<int>{0, 1}));
  EXPECT_EQ(plans[0].block_slot, (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(plans[0].block_chunk, (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(plans[1].tensors, (std::vector<int>{1}));
  EXPECT_EQ(plans[1].block_slot, (std::vector<int>{0}));
  EXPECT_EQ(plans[1].block_chunk, (std::vector<int>{2}));
}

TEST(PlanLaunches, EverySlotHasABlock) {
  // A launch that fills up exactly at the end of a tensor must not take the
  // next tensor as a slot without blocks.
  const std::vector<int64_t> numels = {2 * kChunkSize, kChunkSize, 3 * kChunkSize, 1};
  for (int max_blocks : {1, 2, 3, 4}) {
    for (const auto& plan : plan_launches(numels, 100, max_blocks)) {
      std::vector<bool> used(plan.tensors.size(), false);
      for (int slot : plan.block_slot) used.at(slot) = true;
      for (size_t s = 0; s < used.size(); ++s) {
        EXPECT_TRUE(used[s]) << "max_blocks=" << max_blocks << ": slot " << s << " (tensor "
                             << plan.tensors[s] << ") has no block";
      }
    }
  }
}

TEST(PlanLaunches, BlocksAreTensorMajorOverAllLaunches) {
  const std::vector<int64_t> numels = {3 * kChunkSize,     0,          1, kChunkSize + 1,
                                       5 * kChunkSize - 1, kChunkSize, 2};
  for (int max_tensors : {0, 1, 2, 3, 100}) {
    for (int max_blocks : {0, 1, 2, 4, 7, 100}) {
      const auto plans = plan_launches(numels, max_tensors, max_blocks);
      EXPECT_EQ(blocks(plans), tensor_major(numels))
          << "max_tensors=" << max_tensors << " max_blocks=" << max_blocks;
      for (const auto& plan : plans) {
        EXPECT_FALSE(plan.block_slot.empty());
        if (max_tensors > 0) EXPECT_LE(plan.tensors.size(), static_cast<size_t>(max_tensors));
        if (max_blocks > 0) EXPECT_LE(plan.block_slot.size(), static_cast<size_t>(max_blocks));
      }
    }
  }
}

TEST(PlanLaunches, NonPositiveLimitsMeanOneLaunch) {
  const std::vector<int64_t> numels(1000, 2 * kChunkSize);
  for (int limit : {0, -1}) {
    const auto plans = plan_launches(numels, limit, limit);
    ASSERT_EQ(plans.size(), 1u);
    EXPECT_EQ(plans[0].tensors.size(), 1000u);
    EXPECT_EQ(plans[0].block_slot.size(), 2000u);
  }
}

TEST(PlanLaunches, NegativeNumelThrows) {
  EXPECT_THROW(plan_launches({4, -1}, 8, 8), std::invalid_argument);
}

TEST(MaxTensorsPerLaunch, ParameterStructStaysUnder16KiB) {
  for (int depth = 1; depth <= 5; ++depth) {
    const int t = max_tensors_per_launch(depth);
    EXPECT_GE(t, 1) << "depth " << depth;
    const int bytes = 8 * (depth + 1) * t + 6 * kMaxBlocksPerLaunch;
    EXPECT_LE(bytes, 16384) << "depth " << depth << ": " << t << " tensors";
  }
  EXPECT_GE(max_tensors_per_launch(1), max_tensors_per_launch(5));
}

}  // namespace
}  // namespace mixedprec
