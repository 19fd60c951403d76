// The CUDA engine's block code (csrc/cuda/multi_tensor_block.cuh), compiled as
// host code and run on CPU tensors, so that machines without a GPU still test the
// parameter packing, the block -> chunk mapping, the vector and scalar paths, the
// 64-bit offsets and the device-side skip of every pointwise op.
//
// A launch is emulated block by block and, within a block, thread by thread. That
// is exact for the pointwise kernels, whose threads share nothing but found_inf; the
// 8-bit kernels, whose lanes reduce each block's largest magnitude together, run a
// warp per call (the block code loops over its lanes on the host).
// The op entries of csrc/ops/ are then run on this engine and on the CPU
// engine over the same inputs, and must give the same bits: both apply the same
// functors of csrc/pointwise.h to every element exactly once.
//
// Not covered here: the warp-shuffle reductions of the L2 norm (stages 2 and 3),
// the launches themselves and real concurrency; scripts/gpu_check.sh runs those on
// a GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "emulated_cuda.h"

namespace mixedprec::cuda {
namespace {

using at::Tensor;
using mixedprec::cpu::CpuEngine;

const float kInf = std::numeric_limits<float>::infinity();

Tensor scalar(float v) { return at::full({1}, v, at::kFloat); }

// A tensor of `numel` elements starting `offset` elements into its storage, so
// that odd offsets break the alignment of vector accesses.
Tensor make(int64_t numel, at::ScalarType dtype, int64_t offset = 0, double mean = 0.0) {
  return (at::randn({numel + offset}, at::kFloat) + mean).to(dtype).narrow(0, offset, numel);
}

// Each element of `spec` is (numel, offset); the dtypes cycle through `dtypes`.
std::vector<Tensor> make_list(const std::vector<std::pair<int64_t, int64_t>>& spec,
                              const std::vector<at::ScalarType>& dtypes, double mean = 0.0) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < spec.size(); ++i) {
    out.push_back(make(spec[i].first, dtypes[i % dtypes.size()], spec[i].second, mean));
  }
  return out;
}

std::vector<Tensor> like(const std::vector<Tensor>& ts, at::ScalarType dtype) {
  std::vector<Tensor> out;
  for (const auto& t : ts) out.push_back(make(t.numel(), dtype, t.storage_offset() % 3));
  return out;
}

std::vector<Tensor> clones(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

void expect_bitwise_equal(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                          const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].scalar_type(), want[i].scalar_type()) << what << "[" << i << "]";
    EXPECT_TRUE(at::equal(got[i], want[i])) << what << "[" << i << "] differs" << [&] {
      if (got[i].numel() != want[i].numel() || got[i].numel() == 0) return std::string();
      const auto d = at::nonzero(got[i].to(at::kFloat) != want[i].to(at::kFloat)).flatten();
      if (d.numel() == 0) return std::string(" (NaN)");
      const int64_t k = d[0].item<int64_t>();
      return " at " + std::to_string(d.numel()) + " elements, first " + std::to_string(k) + ": " +
             std::to_string(got[i].to(at::kFloat)[k].item<float>()) + " vs " +
             std::to_string(want[i].to(at::kFloat)[k].item<float>());
    }();
  }
}

// Sizes at the chunk size and the vector width, with aligned and misaligned starts.
std::vector<std::pair<int64_t, int64_t>> edge_sizes() {
  return {{0, 0},
          {1, 0},
          {3, 1},
          {4, 0},
          {5, 2},
          {4097, 3},
          {kChunkSize - 1, 0},
          {kChunkSize, 1},
          {kChunkSize + 1, 0},
          {2 * kChunkSize + 3, 2},
          {3 * kChunkSize, 0}};
}

const std::vector<at::ScalarType> kAllFloats = {at::kFloat, at::kHalf, at::kBFloat16};

TEST(CudaBlocks, UnscaleMatchesTheCpuEngine) {
  at::manual_seed(0);
  const auto tensors = make_list(edge_sizes(), kAllFloats);
  auto cpu = clones(tensors), emulated = clones(tensors);
  Tensor cpu_inf = scalar(0.f), emulated_inf = scalar(0.f);
  const Tensor inv_scale = scalar(1.f / 1024.f);
  entry::multi_tensor_unscale_<CpuEngine>(cpu, cpu_inf, inv_scale);
  entry::multi_tensor_unscale_<EmulatedCudaEngine>(emulated, emulated_inf, inv_scale);
  expect_bitwise_equal(emulated, cpu, "tensors");
  EXPECT_FALSE(at::equal(emulated.back(), tensors.back())) << "nothing was unscaled";
  EXPECT_EQ(emulated_inf.item<float>(), 0.f);
}

TEST(CudaBlocks, NonFiniteAnywhereSetsFoundInf) {
  at::manual_seed(1);
  // First, a middle and the last element of the last tensor, in the vector part and
  // the scalar tail, on aligned and misaligned data.
  for (const int64_t offset : {0, 1}) {
    const int64_t n = 2 * kChunkSize + 3;
    for (const int64_t at_index : {int64_t{0}, kChunkSize + 17, n - 4, n - 1}) {
      for (const float bad : {kInf, -kInf, std::nanf("")}) {
        auto tensors = make_list({{5, 0}, {kChunkSize, 1}, {n, offset}}, kAllFloats);
        tensors.back()[at_index] = bad;
        Tensor found_inf = scalar(0.f);
        entry::multi_tensor_unscale_<EmulatedCudaEngine>(tensors, found_inf, scalar(0.5f));
        EXPECT_EQ(found_inf.item<float>(), 1.f)
            << "offset " << offset << ", element " << at_index << ", value " << bad;
        Tensor checked = scalar(0.f);
        entry::multi_tensor_check_finite_<EmulatedCudaEngine>(tensors, checked);
        EXPECT_EQ(checked.item<float>(), 1.f) << "check_finite, element " << at_index;
      }
    }
  }
}

TEST(CudaBlocks, UnscaleToAndCopyCastLikeTheCpuEngine) {
  at::manual_seed(2);
  const auto src = make_list(edge_sizes(), kAllFloats);
  for (const auto dst_dtype : kAllFloats) {
    const auto dst = like(src, dst_dtype);
    auto cpu = clones(dst), emulated = clones(dst);
    Tensor cpu_inf = scalar(0.f), emulated_inf = scalar(0.f);
    const Tensor inv_scale = scalar(0.125f);
    entry::multi_tensor_unscale_to_<CpuEngine>(src, cpu, cpu_inf, inv_scale);
    entry::multi_tensor_unscale_to_<EmulatedCudaEngine>(src, emulated, emulated_inf, inv_scale);
    expect_bitwise_equal(emulated, cpu, "unscale_to dst");
    EXPECT_EQ(emulated_inf.item<float>(), 0.f);

    cpu = clones(dst);
    emulated = clones(dst);
    entry::multi_tensor_copy_<CpuEngine>(src, cpu);
    entry::multi_tensor_copy_<EmulatedCudaEngine>(src, emulated);
    expect_bitwise_equal(emulated, cpu, "copy dst");
    for (size_t i = 0; i < src.size(); ++i) {
      EXPECT_TRUE(at::equal(emulated[i], src[i].to(dst_dtype))) << "copy is not a cast, " << i;
    }
  }
}

TEST(CudaBlocks, MoreTensorsThanOneLaunchHolds) {
  at::manual_seed(3);
  std::vector<std::pair<int64_t, int64_t>> spec;
  for (int i = 0; i < 900; ++i) spec.emplace_back(1 + (i * 37) % 300, i % 3);
  const auto src = make_list(spec, kAllFloats);
  const auto dst = like(src, at::kHalf);
  auto cpu = clones(dst), emulated = clones(dst);
  g_launches = 0;
  entry::multi_tensor_copy_<CpuEngine>(src, cpu);
  entry::multi_tensor_copy_<EmulatedCudaEngine>(src, emulated);
  expect_bitwise_equal(emulated, cpu, "copy dst");
  // Three dtype groups of 300 tensors each, over the 256 a launch holds at depth 2:
  // two launches for each group.
  EXPECT_EQ(TensorListMeta<2>::kMaxTensors, 256);
  EXPECT_EQ(g_launches, 6);
}

TEST(CudaBlocks, TensorOfMoreChunksThanOneLaunchHolds) {
  at::manual_seed(4);
  // 1025 chunks (1024 blocks fit in a launch), starting off alignment.
  const int64_t n = (kMaxBlocksPerLaunch + 1) * kChunkSize - 5;
  const std::vector<Tensor> src = {make(n, at::kHalf, 1)};
  const std::vector<Tensor> dst = {at::zeros({n}, at::kFloat)};
  g_launches = 0;
  Tensor found_inf = scalar(0.f);
  entry::multi_tensor_unscale_to_<EmulatedCudaEngine>(src, dst, found_inf, scalar(2.f));
  EXPECT_EQ(g_launches, 2);
  EXPECT_TRUE(at::equal(dst[0], src[0].to(at::kFloat) * 2.f));
  EXPECT_EQ(found_inf.item<float>(), 0.f);
}

struct SgdCase {
  at::ScalarType param, grad, model;  // model: unused when has_model is false
  bool has_model;
  double momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(CudaBlocks, FusedSgdMatchesTheCpuEngine) {
  at::manual_seed(5);
  const std::vector<SgdCase> cases = {
      {at::kFloat, at::kHalf, at::kHalf, true, 0.9, 0.0, 1e-4, false},
      {at::kFloat, at::kBFloat16, at::kBFloat16, true, 0.9, 0.0, 0.0, true},
      {at::kFloat, at::kHalf, at::kFloat, true, 0.9, 0.1, 1e-4, false},
      {at::kFloat, at::kFloat, at::kFloat, false, 0.0, 0.0, 1e-2, false},
      {at::kHalf, at::kHalf, at::kFloat, false, 0.5, 0.0, 0.0, true},
  };
  for (const auto& c : cases) {
    const auto params = make_list(edge_sizes(), {c.param});
    const auto grads = like(params, c.grad);
    std::vector<Tensor> bufs, model;
    if (c.momentum != 0.0) bufs = like(params, at::kFloat);
    if (c.has_model) model = like(params, c.model);
    auto run = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> b, std::vector<Tensor> m,
                   const Tensor& found_inf) {
      using Engine = decltype(engine);
      for (const bool first_run : {true, false, false}) {
        entry::fused_sgd_<Engine>(p, grads, b, m, 0.01, c.momentum, c.dampening, c.weight_decay,
                                  c.nesterov, first_run, scalar(0.25f), found_inf);
      }
      std::vector<std::vector<Tensor>> out = {p, b, m};
      return out;
    };
    const auto cpu = run(CpuEngine{}, clones(params), clones(bufs), clones(model), scalar(0.f));
    const auto emulated =
        run(EmulatedCudaEngine{}, clones(params), clones(bufs), clones(model), scalar(0.f));
    expect_bitwise_equal(emulated[0], cpu[0], "params");
    expect_bitwise_equal(emulated[1], cpu[1], "momentum_buffers");
    expect_bitwise_equal(emulated[2], cpu[2], "model_params");
    EXPECT_FALSE(at::equal(emulated[0].back(), params.back())) << "no step was taken";
    if (c.has_model) {
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::equal(emulated[2][i], emulated[0][i].to(c.model))) << "model " << i;
      }
    }
    // Skipped on the device: every tensor keeps its bits.
    const auto skipped =
        run(EmulatedCudaEngine{}, clones(params), clones(bufs), clones(model), scalar(1.f));
    expect_bitwise_equal(skipped[0], params, "skipped params");
    expect_bitwise_equal(skipped[1], bufs, "skipped momentum_buffers");
    expect_bitwise_equal(skipped[2], model, "skipped model_params");
  }
}

TEST(CudaBlocks, FusedAdamMatchesTheCpuEngine) {
  at::manual_seed(6);
  struct Case {
    at::ScalarType param, grad, model;
    bool has_model, adamw;
    double weight_decay;
  };
  const std::vector<Case> cases = {
      {at::kFloat, at::kHalf, at::kHalf, true, true, 1e-2},
      {at::kFloat, at::kBFloat16, at::kBFloat16, true, false, 1e-2},
      {at::kBFloat16, at::kBFloat16, at::kFloat, false, true, 0.0},
      {at::kFloat, at::kFloat, at::kFloat, false, false, 0.0},
  };
  for (const auto& c : cases) {
    const auto params = make_list(edge_sizes(), {c.param});
    const auto grads = like(params, c.grad);
    std::vector<Tensor> exp_avgs, exp_avg_sqs, model;
    for (const auto& p : params) {
      exp_avgs.push_back(at::zeros({p.numel()}, at::kFloat));
      exp_avg_sqs.push_back(at::zeros({p.numel()}, at::kFloat));
    }
    if (c.has_model) model = like(params, c.model);
    auto run = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> m1,
                   std::vector<Tensor> m2, std::vector<Tensor> m, const Tensor& step,
                   const Tensor& found_inf) {
      using Engine = decltype(engine);
      for (int i = 0; i < 3; ++i) {
        entry::fused_adam_<Engine>(p, grads, m1, m2, m, step, 1e-3, 0.9, 0.999, 1e-8,
                                   c.weight_decay, c.adamw, true, scalar(0.5f), found_inf);
      }
      std::vector<std::vector<Tensor>> out = {p, m1, m2, m};
      return out;
    };
    const Tensor cpu_step = scalar(0.f), emulated_step = scalar(0.f);
    const auto cpu = run(CpuEngine{}, clones(params), clones(exp_avgs), clones(exp_avg_sqs),
                         clones(model), cpu_step, scalar(0.f));
    const auto emulated = run(EmulatedCudaEngine{}, clones(params), clones(exp_avgs),
                              clones(exp_avg_sqs), clones(model), emulated_step, scalar(0.f));
    expect_bitwise_equal(emulated[0], cpu[0], "params");
    expect_bitwise_equal(emulated[1], cpu[1], "exp_avgs");
    expect_bitwise_equal(emulated[2], cpu[2], "exp_avg_sqs");
    expect_bitwise_equal(emulated[3], cpu[3], "model_params");
    EXPECT_EQ(emulated_step.item<float>(), 3.f);
    EXPECT_FALSE(at::equal(emulated[0].back(), params.back())) << "no step was taken";

    const Tensor skipped_step = scalar(7.f);
    const auto skipped = run(EmulatedCudaEngine{}, clones(params), clones(exp_avgs),
                             clones(exp_avg_sqs), clones(model), skipped_step, scalar(1.f));
    expect_bitwise_equal(skipped[0], params, "skipped params");
    expect_bitwise_equal(skipped[1], exp_avgs, "skipped exp_avgs");
    expect_bitwise_equal(skipped[2], exp_avg_sqs, "skipped exp_avg_sqs");
    expect_bitwise_equal(skipped[3], model, "skipped model_params");
    EXPECT_EQ(skipped_step.item<float>(), 7.f);
  }
}

// torch.optim's options: maximize, amsgrad's maxima (fp32, and bf16 beside bf16
// moments), the learning rate read on the device, the unscaled grads written back.
TEST(CudaBlocks, OptimizerOptionsMatchTheCpuEngine) {
  at::manual_seed(7);
  const auto params = make_list(edge_sizes(), {at::kFloat});
  for (const at::ScalarType grad_type : {at::kHalf, at::kBFloat16, at::kFloat}) {
    const auto grads = like(params, grad_type);
    auto sgd = [&](auto engine, const Tensor& found_inf) {
      using Engine = decltype(engine);
      auto p = clones(params), g = clones(grads), b = like(params, at::kFloat);
      for (const bool first_run : {true, false}) {
        entry::fused_sgd_<Engine>(p, g, b, {}, 0.0, 0.9, 0.0, 1e-4, true, first_run, scalar(0.25f),
                                  found_inf, false, std::nullopt, std::nullopt, std::nullopt,
                                  std::nullopt, /*maximize=*/true, scalar(0.01f),
                                  /*unscale_grads=*/true);
      }
      std::vector<std::vector<Tensor>> out = {p, g, b};
      return out;
    };
    at::manual_seed(8);
    const auto cpu_sgd = sgd(CpuEngine{}, scalar(0.f));
    at::manual_seed(8);
    const auto emulated_sgd = sgd(EmulatedCudaEngine{}, scalar(0.f));
    for (size_t k = 0; k < cpu_sgd.size(); ++k) {
      expect_bitwise_equal(emulated_sgd[k], cpu_sgd[k], "sgd list " + std::to_string(k));
    }
    EXPECT_FALSE(at::equal(emulated_sgd[1].back(), grads.back())) << "grads not unscaled";
    at::manual_seed(8);
    const auto skipped_sgd = sgd(EmulatedCudaEngine{}, scalar(1.f));
    expect_bitwise_equal(skipped_sgd[0], params, "skipped sgd params");
    expect_bitwise_equal(skipped_sgd[1], grads, "skipped sgd grads");

    for (const at::ScalarType state_type : {at::kFloat, at::kBFloat16}) {
      auto adam = [&](auto engine, const Tensor& found_inf) {
        using Engine = decltype(engine);
        auto p = clones(params), g = clones(grads);
        auto m1 = like(params, state_type), m2 = like(params, state_type),
             vmax = like(params, state_type);
        for (auto& v : m2) v.abs_();
        for (auto& v : vmax) v.abs_();
        const Tensor step = scalar(0.f);
        for (int i = 0; i < 2; ++i) {
          entry::fused_adam_<Engine>(p, g, m1, m2, {}, step, 1e-3, 0.9, 0.999, 1e-8, 1e-2, true,
                                     true, scalar(0.5f), found_inf, std::nullopt, std::nullopt,
                                     std::nullopt, std::nullopt,
                                     /*maximize=*/true, at::TensorList(vmax),
                                     /*unscale_grads=*/true);
        }
        std::vector<std::vector<Tensor>> out = {p, g, m1, m2, vmax};
        return out;
      };
      at::manual_seed(9);
      const auto cpu_adam = adam(CpuEngine{}, scalar(0.f));
      at::manual_seed(9);
      const auto emulated_adam = adam(EmulatedCudaEngine{}, scalar(0.f));
      for (size_t k = 0; k < cpu_adam.size(); ++k) {
        expect_bitwise_equal(emulated_adam[k], cpu_adam[k], "adam list " + std::to_string(k));
      }
      at::manual_seed(9);
      const auto skipped_adam = adam(EmulatedCudaEngine{}, scalar(1.f));
      expect_bitwise_equal(skipped_adam[0], params, "skipped adam params");
      expect_bitwise_equal(skipped_adam[1], grads, "skipped adam grads");
    }
  }
}

// Stochastic rounding (master="stochastic"): the Philox bits are keyed by the element's
// global index (its index within its tensor mapped by the rounding words: offsets off
// multiples of 8, runs), which the CPU engine counts per chunk and vector lane and the
// CUDA blocks per chunk slice, 4-wide access and scalar tail; every element must get
// the same bits, so the params must be equal bit for bit.
std::vector<Tensor> salts_of(size_t n) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < n; ++i) {
    const auto k = static_cast<int64_t>(i);
    const int64_t words[3][4] = {{k, 0, 0, 0}, {k, 8 * k + 3, 0, 0}, {k, 5, 13, 40}};
    out.push_back(at::tensor(at::IntArrayRef(words[i % 3], 4), at::kLong));
  }
  return out;
}

TEST(CudaBlocks, StochasticRoundingMatchesTheCpuEngine) {
  at::manual_seed(12);
  const auto params = make_list(edge_sizes(), {at::kBFloat16});
  const auto grads = like(params, at::kBFloat16);
  const auto bufs = like(params, at::kBFloat16);
  const auto salts = salts_of(params.size());
  const int64_t seed = 0x7edcba9876543210LL;
  auto sgd = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> b) {
    using Engine = decltype(engine);
    for (const float step : {1.f, 2.f, 3.f}) {
      entry::fused_sgd_<Engine>(p, grads, b, {}, 0.01, 0.9, 0.0, 1e-4, false, step == 1.f,
                                scalar(0.5f), scalar(0.f), false, std::nullopt, salts, seed,
                                scalar(step));
    }
    return p;
  };
  const auto cpu_sgd = sgd(CpuEngine{}, clones(params), clones(bufs));
  expect_bitwise_equal(sgd(EmulatedCudaEngine{}, clones(params), clones(bufs)), cpu_sgd,
                       "sgd params");
  // Not round to nearest: the same steps without stochastic rounding differ somewhere.
  auto nearest = clones(params);
  auto nearest_bufs = clones(bufs);
  for (const bool first_run : {true, false, false}) {
    entry::fused_sgd_<CpuEngine>(nearest, grads, nearest_bufs, {}, 0.01, 0.9, 0.0, 1e-4, false,
                                 first_run, scalar(0.5f), scalar(0.f));
  }
  EXPECT_FALSE(at::equal(cpu_sgd.back(), nearest.back())) << "rounded to nearest";

  auto adam = [&](auto engine, std::vector<Tensor> p, const Tensor& found_inf) {
    using Engine = decltype(engine);
    auto m1 = like(params, at::kBFloat16), m2 = like(params, at::kBFloat16);
    for (auto& v : m2) v.abs_();
    const Tensor step = scalar(0.f);
    for (int i = 0; i < 3; ++i) {
      entry::fused_adam_<Engine>(p, grads, m1, m2, {}, step, 1e-3, 0.9, 0.999, 1e-8, 1e-2, true,
                                 true, scalar(0.5f), found_inf, std::nullopt, std::nullopt, salts,
                                 seed);
    }
    return p;
  };
  at::manual_seed(13);
  const auto cpu_adam = adam(CpuEngine{}, clones(params), scalar(0.f));
  at::manual_seed(13);
  const auto emulated_adam = adam(EmulatedCudaEngine{}, clones(params), scalar(0.f));
  expect_bitwise_equal(emulated_adam, cpu_adam, "adam params");
  EXPECT_FALSE(at::equal(emulated_adam.back(), params.back())) << "no step was taken";
  at::manual_seed(13);
  expect_bitwise_equal(adam(EmulatedCudaEngine{}, clones(params), scalar(1.f)), params,
                       "skipped params");
}

// master="remainder": bf16 params with int16 remainders (aligned and misaligned starts,
// every remainder value), SGD and Adam: the same bits as the CPU engine, for params and
// remainders; a skipped step writes neither.
TEST(CudaBlocks, RemaindersMatchTheCpuEngine) {
  at::manual_seed(14);
  const auto params = make_list(edge_sizes(), {at::kBFloat16});
  const auto grads = like(params, at::kBFloat16);
  std::vector<Tensor> rems;
  for (const auto& p : params) {
    const int64_t offset = (p.storage_offset() + 1) % 3;
    rems.push_back(
        at::randint(-32768, 32768, {p.numel() + offset}, at::kShort).narrow(0, offset, p.numel()));
  }
  auto sgd = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> r,
                 const Tensor& found_inf) {
    using Engine = decltype(engine);
    std::vector<Tensor> bufs;
    for (const auto& q : p) bufs.push_back(at::zeros({q.numel()}, at::kBFloat16));
    for (const bool first_run : {true, false, false}) {
      entry::fused_sgd_<Engine>(p, grads, bufs, {}, 0.01, 0.9, 0.0, 1e-4, true, first_run,
                                scalar(0.5f), found_inf, false, std::nullopt, std::nullopt,
                                std::nullopt, std::nullopt, true, std::nullopt, false, r);
    }
    return std::vector<std::vector<Tensor>>{p, r};
  };
  auto adam = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> r,
                  const Tensor& found_inf) {
    using Engine = decltype(engine);
    std::vector<Tensor> m1, m2;
    for (const auto& q : p) {
      m1.push_back(at::zeros({q.numel()}, at::kFloat));
      m2.push_back(at::zeros({q.numel()}, at::kFloat));
    }
    const Tensor step = scalar(0.f);
    for (int i = 0; i < 3; ++i) {
      entry::fused_adam_<Engine>(p, grads, m1, m2, {}, step, 1e-3, 0.9, 0.999, 1e-8, 1e-2, true,
                                 true, scalar(0.5f), found_inf, std::nullopt, std::nullopt,
                                 std::nullopt, std::nullopt, false, std::nullopt, false, r);
    }
    return std::vector<std::vector<Tensor>>{p, r};
  };
  const auto cpu_sgd = sgd(CpuEngine{}, clones(params), clones(rems), scalar(0.f));
  const auto emulated_sgd = sgd(EmulatedCudaEngine{}, clones(params), clones(rems), scalar(0.f));
  expect_bitwise_equal(emulated_sgd[0], cpu_sgd[0], "sgd params");
  expect_bitwise_equal(emulated_sgd[1], cpu_sgd[1], "sgd remainders");
  EXPECT_FALSE(at::equal(cpu_sgd[1].back(), rems.back())) << "no step was taken";
  const auto cpu_adam = adam(CpuEngine{}, clones(params), clones(rems), scalar(0.f));
  const auto emulated_adam = adam(EmulatedCudaEngine{}, clones(params), clones(rems), scalar(0.f));
  expect_bitwise_equal(emulated_adam[0], cpu_adam[0], "adam params");
  expect_bitwise_equal(emulated_adam[1], cpu_adam[1], "adam remainders");
  const auto skipped = adam(EmulatedCudaEngine{}, clones(params), clones(rems), scalar(1.f));
  expect_bitwise_equal(skipped[0], params, "skipped params");
  expect_bitwise_equal(skipped[1], rems, "skipped remainders");
}

// The 8-bit lists' decode of a lane's four codes (e4m3_lane_values, run here as the
// kernels built without compute_89's conversion run it) against e4m3_value(code) *
// scale, bit for bit: every code in every place of the word (NaN, subnormal and
// signed-zero codes included), at scales from 2^-126 to 2^126 and the bytes no block
// is given (0: zero, 254, 255: inf).
TEST(CudaBlocks, EightBitDecodeIsTheScalarOnesBitForBit) {
  for (const uint32_t scale_bits :
       {0u, 1u, 2u, 100u, 127u, 134u, 135u, 200u, 247u, 253u, 254u, 255u}) {
    const float scale = e8m0_value(scale_bits);
    for (uint32_t code = 0; code < 256; ++code) {
      for (int j = 0; j < kILP; ++j) {
        const uint32_t word =
            (code << (8 * j)) | (((code * 37u + 11u) & 0xffu) << (8 * ((j + 1) % kILP)));
        float x[kILP][2];
        e4m3_lane_values<2>(word, scale, x, 1);
        for (int i = 0; i < kILP; ++i) {
          const float want = e4m3_value((word >> (8 * i)) & 0xffu) * scale;
          uint32_t got_bits, want_bits;
          memcpy(&got_bits, &x[i][1], sizeof(got_bits));
          memcpy(&want_bits, &want, sizeof(want_bits));
          ASSERT_EQ(got_bits, want_bits)
              << "code " << ((word >> (8 * i)) & 0xffu) << " scale byte " << scale_bits;
        }
      }
    }
  }
}

// 8-bit state (lanes.h): float8_e4m3fn moments and momentum with float8_e8m0fnu
// block scales, beside fp32 masters with an fp16 model copy, bf16 params with
// remainders and bf16 params rounded stochastically; the emulated CUDA blocks give
// the CPU engine's bytes, and a skipped step writes nothing. Adam's run too with
// maximize, which no fixed mode holds: the generic kernel's block loop, one for both
// alignments (multi_tensor_block.cuh's apply_blocks), on aligned and misaligned starts.
TEST(CudaBlocks, EightBitStateMatchesTheCpuEngine) {
  at::manual_seed(15);
  const std::vector<std::pair<int64_t, int64_t>> sizes = {
      {0, 0}, {32, 1}, {4096, 0}, {kChunkSize, 2}, {kChunkSize + 96, 0}, {3 * kChunkSize, 1}};
  auto bytes = [](const std::vector<Tensor>& ts) {
    std::vector<Tensor> out;
    for (const auto& t : ts) out.push_back(t.view(at::kByte));
    return out;
  };
  auto codes = [&](const std::vector<Tensor>& like_these) {
    std::vector<Tensor> out;
    for (const auto& t : like_these) {
      out.push_back(
          (at::randn({t.numel()}, at::kFloat) * 100).clamp(-448, 448).to(at::kFloat8_e4m3fn));
    }
    return out;
  };
  auto scales = [&](const std::vector<Tensor>& like_these) {
    std::vector<Tensor> out;
    for (const auto& t : like_these) {
      out.push_back(
          at::randint(100, 130, {t.numel() / kQuantBlock}, at::kByte).view(at::kFloat8_e8m0fnu));
    }
    return out;
  };
  enum class Mode { kMasters, kRemainders, kStochastic };
  for (const Mode mode : {Mode::kMasters, Mode::kRemainders, Mode::kStochastic}) {
    const at::ScalarType dtype = mode == Mode::kMasters ? at::kFloat : at::kBFloat16;
    const auto params = make_list(sizes, {dtype});
    const auto grads = like(params, at::kBFloat16);
    const auto model = mode == Mode::kMasters ? like(params, at::kHalf) : std::vector<Tensor>{};
    std::vector<Tensor> rems, salts;
    for (size_t i = 0; i < params.size(); ++i) {
      if (mode == Mode::kRemainders) {
        rems.push_back(at::randint(-32768, 32768, {params[i].numel()}, at::kShort));
      }
      if (mode == Mode::kStochastic) {
        salts.push_back(
            at::tensor({static_cast<int64_t>(i), int64_t{0}, int64_t{0}, int64_t{0}}, at::kLong));
      }
    }
    const auto m1 = codes(params), m2 = codes(params), s1 = scales(params), s2 = scales(params);
    auto adam = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> m,
                    std::vector<Tensor> r, std::vector<Tensor> a, std::vector<Tensor> b,
                    std::vector<Tensor> sa, std::vector<Tensor> sb, const Tensor& found_inf,
                    bool maximize = false) {
      using Engine = decltype(engine);
      const Tensor step = scalar(0.f);
      for (int i = 0; i < 3; ++i) {
        entry::fused_adam_<Engine>(
            p, grads, a, b, m, step, 1e-3, 0.9, 0.999, 1e-8, 1e-2, true, true, scalar(0.5f),
            found_inf, std::nullopt, std::nullopt,
            salts.empty() ? std::nullopt : std::optional<at::TensorList>(salts),
            salts.empty() ? std::nullopt : std::optional<int64_t>(11), maximize, std::nullopt,
            false, r.empty() ? std::nullopt : std::optional<at::TensorList>(r),
            std::optional<at::TensorList>(sa), std::optional<at::TensorList>(sb),
            salts.empty() ? std::nullopt : std::optional<int64_t>(21));
      }
      return std::vector<std::vector<Tensor>>{p, m, r, bytes(a), bytes(b), bytes(sa), bytes(sb)};
    };
    auto sgd = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> m, std::vector<Tensor> r,
                   std::vector<Tensor> a, std::vector<Tensor> sa, const Tensor& found_inf) {
      using Engine = decltype(engine);
      const Tensor step = scalar(0.f);
      for (const bool first_run : {true, false, false}) {
        step.add_(1.f);
        entry::fused_sgd_<Engine>(
            p, grads, a, m, 0.01, 0.9, 0.0, 1e-4, false, first_run, scalar(0.5f), found_inf, false,
            std::nullopt, salts.empty() ? std::nullopt : std::optional<at::TensorList>(salts),
            salts.empty() ? std::nullopt : std::optional<int64_t>(12),
            salts.empty() ? std::nullopt : std::optional<Tensor>(step), false, std::nullopt, false,
            r.empty() ? std::nullopt : std::optional<at::TensorList>(r),
            std::optional<at::TensorList>(sa),
            salts.empty() ? std::nullopt : std::optional<int64_t>(22));
      }
      return std::vector<std::vector<Tensor>>{p, m, r, bytes(a), bytes(sa)};
    };
    const auto cpu = adam(CpuEngine{}, clones(params), clones(model), clones(rems), clones(m1),
                          clones(m2), clones(s1), clones(s2), scalar(0.f));
    const auto emulated = adam(EmulatedCudaEngine{}, clones(params), clones(model), clones(rems),
                               clones(m1), clones(m2), clones(s1), clones(s2), scalar(0.f));
    const char* names[] = {"params",      "model",          "remainders",       "exp_avgs",
                           "exp_avg_sqs", "exp_avg_scales", "exp_avg_sq_scales"};
    for (int k = 0; k < 7; ++k) {
      expect_bitwise_equal(emulated[k], cpu[k], names[k] + std::to_string(static_cast<int>(mode)));
    }
    EXPECT_FALSE(at::equal(cpu[0].back(), params.back())) << "no step was taken";
    EXPECT_FALSE(at::equal(cpu[5].back(), s1.back().view(at::kByte))) << "no scale was written";
    const auto cpu_max = adam(CpuEngine{}, clones(params), clones(model), clones(rems), clones(m1),
                              clones(m2), clones(s1), clones(s2), scalar(0.f), true);
    const auto emulated_max =
        adam(EmulatedCudaEngine{}, clones(params), clones(model), clones(rems), clones(m1),
             clones(m2), clones(s1), clones(s2), scalar(0.f), true);
    for (int k = 0; k < 7; ++k) {
      expect_bitwise_equal(
          emulated_max[k], cpu_max[k],
          std::string("maximize ") + names[k] + std::to_string(static_cast<int>(mode)));
    }
    EXPECT_FALSE(at::equal(cpu_max[0].back(), cpu[0].back())) << "maximize changed nothing";
    const auto skipped = adam(EmulatedCudaEngine{}, clones(params), clones(model), clones(rems),
                              clones(m1), clones(m2), clones(s1), clones(s2), scalar(1.f));
    expect_bitwise_equal(skipped[0], params, "skipped params");
    expect_bitwise_equal(skipped[3], bytes(m1), "skipped exp_avgs");
    expect_bitwise_equal(skipped[5], bytes(s1), "skipped exp_avg_scales");

    const auto cpu_sgd = sgd(CpuEngine{}, clones(params), clones(model), clones(rems), clones(m1),
                             clones(s1), scalar(0.f));
    const auto emulated_sgd = sgd(EmulatedCudaEngine{}, clones(params), clones(model), clones(rems),
                                  clones(m1), clones(s1), scalar(0.f));
    for (int k = 0; k < 5; ++k) {
      expect_bitwise_equal(emulated_sgd[k], cpu_sgd[k],
                           std::string("sgd ") + names[k == 4 ? 5 : k]);
    }
  }
}

TEST(CudaBlocks, FusedLambMatchesTheCpuEngine) {
  at::manual_seed(9);
  struct Case {
    at::ScalarType param, grad, model;
    bool has_model, adamw, nvlamb;
    double weight_decay;
  };
  const std::vector<Case> cases = {
      {at::kFloat, at::kHalf, at::kHalf, true, true, false, 1e-2},
      {at::kFloat, at::kBFloat16, at::kBFloat16, true, false, false, 1e-2},
      {at::kBFloat16, at::kBFloat16, at::kFloat, false, true, true, 0.0},
      {at::kFloat, at::kFloat, at::kFloat, false, false, false, 0.0},
  };
  for (const auto& c : cases) {
    const auto params = make_list(edge_sizes(), {c.param});
    const auto grads = like(params, c.grad);
    std::vector<Tensor> exp_avgs, exp_avg_sqs, model;
    for (const auto& p : params) {
      exp_avgs.push_back(at::zeros({p.numel()}, at::kFloat));
      exp_avg_sqs.push_back(at::zeros({p.numel()}, at::kFloat));
    }
    if (c.has_model) model = like(params, c.model);
    auto run = [&](auto engine, std::vector<Tensor> p, std::vector<Tensor> m1,
                   std::vector<Tensor> m2, std::vector<Tensor> m, const Tensor& step,
                   const Tensor& found_inf) {
      using Engine = decltype(engine);
      for (int i = 0; i < 3; ++i) {
        entry::fused_lamb_<Engine>(p, grads, m1, m2, m, step, 1e-2, 0.9, 0.999, 1e-6,
                                   c.weight_decay, c.adamw, true, true, c.nvlamb, scalar(40.f), 1.0,
                                   scalar(0.5f), found_inf);
      }
      std::vector<std::vector<Tensor>> out = {p, m1, m2, m};
      return out;
    };
    const Tensor cpu_step = scalar(0.f), emulated_step = scalar(0.f);
    const auto cpu = run(CpuEngine{}, clones(params), clones(exp_avgs), clones(exp_avg_sqs),
                         clones(model), cpu_step, scalar(0.f));
    const auto emulated = run(EmulatedCudaEngine{}, clones(params), clones(exp_avgs),
                              clones(exp_avg_sqs), clones(model), emulated_step, scalar(0.f));
    expect_bitwise_equal(emulated[0], cpu[0], "params");
    expect_bitwise_equal(emulated[1], cpu[1], "exp_avgs");
    expect_bitwise_equal(emulated[2], cpu[2], "exp_avg_sqs");
    expect_bitwise_equal(emulated[3], cpu[3], "model_params");
    EXPECT_EQ(emulated_step.item<float>(), 3.f);
    EXPECT_FALSE(at::equal(emulated[0].back(), params.back())) << "no step was taken";

    const Tensor skipped_step = scalar(7.f);
    const auto skipped = run(EmulatedCudaEngine{}, clones(params), clones(exp_avgs),
                             clones(exp_avg_sqs), clones(model), skipped_step, scalar(1.f));
    expect_bitwise_equal(skipped[0], params, "skipped params");
    expect_bitwise_equal(skipped[1], exp_avgs, "skipped exp_avgs");
    expect_bitwise_equal(skipped[2], exp_avg_sqs, "skipped exp_avg_sqs");
    expect_bitwise_equal(skipped[3], model, "skipped model_params");
    EXPECT_EQ(skipped_step.item<float>(), 7.f);
  }
}

// x[0] = x[0] * scale + shift with scale and shift per tensor (lists 1 and 2), which
// the block code reads unoffset and unaligned, and broadcasts.
struct AffinePerTensorOp {
  static constexpr int kDepth = 3;  // data, scale, shift
  static constexpr unsigned kReads = 0b111;
  static constexpr unsigned kWrites = 0b001;
  static constexpr unsigned kPerTensor = 0b110;
  void resolve() {}
  template <typename V>
  typename Lanes<V>::Flag apply(V* x) const {
    x[0] = x[0] * x[1] + x[2];
    return Lanes<V>::not_finite(x[1]);
  }
};

TEST(CudaBlocks, PerTensorListsMatchTheCpuEngine) {
  at::manual_seed(8);
  const auto data = make_list(edge_sizes(), {at::kHalf});
  const int64_t n = static_cast<int64_t>(data.size());
  // Values at odd offsets of their storage: per-tensor lists need no alignment.
  const Tensor scales = at::randn({2 * n}).slice(0, 1, 2 * n, 2);
  const Tensor shifts = at::randn({n + 1}).narrow(0, 1, n);
  auto run = [&](auto engine, const std::vector<Tensor>& d, const Tensor& skip) {
    using Engine = decltype(engine);
    const std::vector<Tensor> scale_list = scales.unbind(0), shift_list = shifts.unbind(0);
    const Lists<3> lists{d, scale_list, shift_list};
    const Tensor found_inf = scalar(0.f);
    Engine::template run<AffinePerTensorOp, c10::Half, float, float>(
        lists, AffinePerTensorOp{}, skip.data_ptr<float>(), found_inf.data_ptr<float>());
    return found_inf.item<float>();
  };
  const auto cpu = clones(data), emulated = clones(data), skipped = clones(data);
  EXPECT_EQ(run(CpuEngine{}, cpu, scalar(0.f)), 0.f);
  EXPECT_EQ(run(EmulatedCudaEngine{}, emulated, scalar(0.f)), 0.f);
  expect_bitwise_equal(emulated, cpu, "data");
  for (int64_t i = 0; i < n; ++i) {
    const Tensor want = (data[i].to(at::kFloat) * scales[i] + shifts[i]).to(at::kHalf);
    EXPECT_TRUE(at::equal(emulated[i], want)) << "tensor " << i;
  }
  EXPECT_EQ(run(EmulatedCudaEngine{}, skipped, scalar(1.f)), 0.f);
  expect_bitwise_equal(skipped, data, "skipped data");
  scales[n - 1].fill_(kInf);
  EXPECT_EQ(run(EmulatedCudaEngine{}, clones(data), scalar(0.f)), 1.f);
}

// Stage 1 of the L2 norm, as l2norm.cu drives it over a list of mixed dtypes:
// the partial sum of every chunk lands in its tensor's contiguous range of the
// partials, in chunk order (stage 2 sums those ranges).
TEST(CudaBlocks, L2NormPartialsOfEachTensorAreContiguous) {
  at::manual_seed(7);
  std::vector<std::pair<int64_t, int64_t>> spec = edge_sizes();
  for (int i = 0; i < 600; ++i) spec.emplace_back(1 + (i * 101) % 5000, i % 3);
  const auto tensors = make_list(spec, {at::kHalf, at::kFloat, at::kBFloat16, at::kHalf});
  const float scale = 0.5f;
  const L2NormLayout layout = l2norm_layout(tensors);
  ASSERT_EQ(layout.groups.size(), 3u);
  std::vector<double> partial(layout.total_chunks, std::nan(""));
  for (const auto& group : layout.groups) {
    for_each_launch<1>(
        group.lists(), [&](const TensorListMeta<1>& meta, int num_blocks, int64_t first_block) {
          blockDim.x = kBlockSize;
          for (int b = 0; b < num_blocks; ++b) {
            blockIdx.x = static_cast<unsigned>(b);
            double sum = 0.0;
            for (int t = 0; t < kBlockSize; ++t) {
              threadIdx.x = static_cast<unsigned>(t);
              MP_DISPATCH_FLOATS(group.dtype, "test", scalar_t,
                                 [&] { sum += chunk_sum_of_squares<scalar_t>(meta, scale); });
            }
            const int64_t at = group.first_partial + first_block + b;
            ASSERT_LT(at, layout.total_chunks);
            EXPECT_TRUE(std::isnan(partial[at])) << "partial " << at << " written twice";
            partial[at] = sum;
          }
        });
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const Tensor x = tensors[t].to(at::kDouble) * scale;
    int64_t at = layout.first_partial[t];
    for (int64_t start = 0; start < x.numel(); start += kChunkSize, ++at) {
      const int64_t n = std::min(kChunkSize, x.numel() - start);
      const double want = x.narrow(0, start, n).square().sum().item<double>();
      EXPECT_NEAR(partial[at], want, 1e-4 * want + 1e-30)
          << "tensor " << t << ", chunk at " << start;
    }
  }
  for (const double p : partial) EXPECT_FALSE(std::isnan(p)) << "a partial was not written";
}

}  // namespace
}  // namespace mixedprec::cuda
