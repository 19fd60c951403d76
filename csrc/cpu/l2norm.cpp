// The CPU engine's L2 norm (multi_tensor_l2norm): squares summed in double.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "engine.h"

namespace mixedprec::cpu {
namespace {

// acc[e % kLanes] += (x[e] * scale)^2 for e < n, the square in double: kLanes running
// sums in a fixed order that the compiler vectorises, c10's fp16 and bf16 conversions
// included. Compiled per instruction set, like the engine's loops (vec.h). A float's
// square is exact in double, so adding it with a fused multiply-add (MADD) gives the
// same bits as multiplying, then adding: the baseline build does the latter, the AVX
// builds the former.
constexpr int kLanes = 32;  // four AVX-512 (eight AVX2) accumulators: no waiting on one add chain
static_assert(kChunkSize % kLanes == 0, "chunks keep each element in its lane");
#define MP_SUM_SQUARES(NAME, TARGET, MADD)                                       \
  template <bool kScaled, typename T>                                            \
  TARGET void NAME##_loop(const T* x, int64_t n, float scale, double* acc) {    \
    int64_t e = 0;                                                               \
    for (; e + kLanes <= n; e += kLanes) {                                       \
      for (int j = 0; j < kLanes; ++j) {                                         \
        const float a = static_cast<float>(x[e + j]);                            \
        const double v = kScaled ? a * scale : a;                                \
        acc[j] = MADD(v, v, acc[j]);                                             \
      }                                                                          \
    }                                                                            \
    for (; e < n; ++e) {                                                         \
      const float a = static_cast<float>(x[e]);                                  \
      const double v = kScaled ? a * scale : a;                                  \
      acc[e % kLanes] = MADD(v, v, acc[e % kLanes]);                             \
    }                                                                            \
  }                                                                              \
  /* x * 1 is x: without a scale the multiply is left out, with the same bits. */ \
  template <typename T>                                                          \
  void NAME(const T* x, int64_t n, float scale, double* acc) {                  \
    if (scale == 1.f) return NAME##_loop<false>(x, n, scale, acc);               \
    NAME##_loop<true>(x, n, scale, acc);                                         \
  }

#define MP_MUL_ADD(a, b, c) ((c) + (a) * (b))
#define MP_FMA(a, b, c) __builtin_fma((a), (b), (c))
MP_SUM_SQUARES(sum_squares_baseline, , MP_MUL_ADD)
#if defined(MP_X86_ISA)
MP_SUM_SQUARES(sum_squares_avx2, __attribute__((target(MP_AVX2_TARGET))), MP_FMA)
MP_SUM_SQUARES(sum_squares_avx512, __attribute__((target(MP_AVX512_TARGET))), MP_FMA)
#endif
#undef MP_SUM_SQUARES
#undef MP_MUL_ADD
#undef MP_FMA

template <typename T>
void sum_squares(const T* x, int64_t n, float scale, double* acc) {
#if defined(MP_X86_ISA)
  switch (cpu_isa()) {
    case Isa::kAvx512:
      return sum_squares_avx512(x, n, scale, acc);
    case Isa::kAvx2:
      return sum_squares_avx2(x, n, scale, acc);
    default:
      break;
  }
#endif
  sum_squares_baseline(x, n, scale, acc);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> CpuEngine::l2norm(at::TensorList tensors,
                                                     const float* inv_scale, bool per_tensor,
                                                     at::Device) {
  const float scale = inv_scale != nullptr ? *inv_scale : 1.f;
  std::vector<int64_t> numels;
  for (const auto& t : tensors) numels.push_back(t.numel());
  const auto plans = plan_launches(numels, 0, 0);
  const LaunchPlan empty_plan;
  const LaunchPlan& plan = plans.empty() ? empty_plan : plans.front();
  const int64_t num_chunks = static_cast<int64_t>(plan.block_slot.size());

  // Squares are summed in double within a chunk, then per tensor in chunk order:
  // the result does not depend on the number of threads.
  std::vector<double> partial(num_chunks, 0.0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int t = plan.tensors[plan.block_slot[b]];
      const int64_t begin = static_cast<int64_t>(plan.block_chunk[b]) * kChunkSize;
      const int64_t end = std::min(numels[t], begin + kChunkSize);
      MP_DISPATCH_FLOATS(tensors[t].scalar_type(), "multi_tensor_l2norm", scalar_t, [&] {
        const scalar_t* data = tensors[t].const_data_ptr<scalar_t>();
        // kLanes running sums (element e of the chunk into lane e % kLanes), added up
        // in lane order at the end.
        double acc[kLanes] = {};
        sum_squares(data + begin, end - begin, scale, acc);
        double sum = 0.0;
        for (const double a : acc) sum += a;
        partial[b] = sum;
      });
    }
  });
  std::vector<double> squares(tensors.size(), 0.0);
  for (int64_t b = 0; b < num_chunks; ++b) squares[plan.tensors[plan.block_slot[b]]] += partial[b];

  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  at::Tensor per = at::empty({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, options);
  double total = 0.0;
  for (size_t t = 0; t < squares.size(); ++t) {
    total += squares[t];
    if (per_tensor) per.data_ptr<float>()[t] = static_cast<float>(std::sqrt(squares[t]));
  }
  at::Tensor norm = at::empty({1}, options);
  norm.data_ptr<float>()[0] = static_cast<float>(std::sqrt(total));
  return {norm, per};
}

}  // namespace mixedprec::cpu
