// The CPU engine's L2 norm (multi_tensor_l2norm): squares summed in double.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "engine.h"

namespace mixedprec::cpu {
namespace {

// acc[e % kLanes] += (x[e] * scale)^2 for e < n, the square in double: kLanes running
// sums in a fixed order. x * scale is rounded to float, then widened; a float's square
// is exact in double, so a fused multiply-add (the AVX versions) gives the same bits as
// multiplying, then adding (the baseline). Every version keeps element e in lane
// e % kLanes, so all give the same sums.
constexpr int kLanes = 32;  // four AVX-512 (eight AVX2) accumulators: no waiting on one add chain
static_assert(kChunkSize % kLanes == 0, "chunks keep each element in its lane");

template <typename T>
void sum_squares_tail(const T* x, int64_t e, int64_t n, float scale, double* acc) {
  for (; e < n; ++e) {
    const double v = static_cast<float>(x[e]) * scale;
    acc[e % kLanes] += v * v;
  }
}

template <typename T>
void sum_squares_baseline(const T* x, int64_t n, float scale, double* acc) {
  sum_squares_tail(x, 0, n, scale, acc);
}

#if defined(MP_X86_ISA)
// Sixteen floats a load (vec.h converts fp16 and bf16 in registers), widened to two
// vectors of eight doubles: 32 elements feed the four accumulators in lane order.
template <bool kScaled, typename T>
__attribute__((target(MP_AVX512_TARGET))) void sum_squares_avx512(const T* x, int64_t n,
                                                                  float scale, double* acc) {
  const __m512 s = _mm512_set1_ps(scale);
  __m512d a[4];
  for (int k = 0; k < 4; ++k) a[k] = _mm512_loadu_pd(acc + 8 * k);
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    for (size_t line = 0; line < kLanes * sizeof(T); line += 64) {
      prefetch_ahead(reinterpret_cast<const char*>(x + e) + line);
    }
    for (int h = 0; h < 2; ++h) {
      __m512 v = (__m512)avx512::load(x + e + 16 * h);
      if (kScaled) v = _mm512_mul_ps(v, s);
      const __m512d pairs = _mm512_castps_pd(v);
      const __m256 lower = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(avx512::kAll8, pairs, 0));
      const __m256 upper = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(avx512::kAll8, pairs, 1));
      const __m512d lo = _mm512_maskz_cvtps_pd(avx512::kAll8, lower);
      const __m512d hi = _mm512_maskz_cvtps_pd(avx512::kAll8, upper);
      a[2 * h] = _mm512_fmadd_pd(lo, lo, a[2 * h]);
      a[2 * h + 1] = _mm512_fmadd_pd(hi, hi, a[2 * h + 1]);
    }
  }
  for (int k = 0; k < 4; ++k) _mm512_storeu_pd(acc + 8 * k, a[k]);
  sum_squares_tail(x, e, n, scale, acc);
}

// Eight floats a load, widened to two vectors of four doubles.
template <bool kScaled, typename T>
__attribute__((target(MP_AVX2_TARGET))) void sum_squares_avx2(const T* x, int64_t n, float scale,
                                                              double* acc) {
  const __m256 s = _mm256_set1_ps(scale);
  __m256d a[8];
  for (int k = 0; k < 8; ++k) a[k] = _mm256_loadu_pd(acc + 4 * k);
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    for (size_t line = 0; line < kLanes * sizeof(T); line += 64) {
      prefetch_ahead(reinterpret_cast<const char*>(x + e) + line);
    }
    for (int q = 0; q < 4; ++q) {
      __m256 v = (__m256)avx2::load(x + e + 8 * q);
      if (kScaled) v = _mm256_mul_ps(v, s);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      a[2 * q] = _mm256_fmadd_pd(lo, lo, a[2 * q]);
      a[2 * q + 1] = _mm256_fmadd_pd(hi, hi, a[2 * q + 1]);
    }
  }
  for (int k = 0; k < 8; ++k) _mm256_storeu_pd(acc + 4 * k, a[k]);
  sum_squares_tail(x, e, n, scale, acc);
}
#endif

template <typename T>
void sum_squares(const T* x, int64_t n, float scale, double* acc) {
#if defined(MP_X86_ISA)
  switch (cpu_isa()) {
    case Isa::kAvx512:
      // x * 1 is x: without a scale the multiply is left out, with the same bits.
      return scale == 1.f ? sum_squares_avx512<false>(x, n, scale, acc)
                          : sum_squares_avx512<true>(x, n, scale, acc);
    case Isa::kAvx2:
      return scale == 1.f ? sum_squares_avx2<false>(x, n, scale, acc)
                          : sum_squares_avx2<true>(x, n, scale, acc);
    default: break;
  }
#endif
  sum_squares_baseline(x, n, scale, acc);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> CpuEngine::l2norm(at::TensorList tensors, const float* inv_scale,
                                                     bool per_tensor, at::Device) {
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
