// The conversions of convert.h. The SIMD versions are compiled for AVX2/F16C with
// target attributes and chosen once, at run time, so the extension still runs on
// any x86-64 CPU (and builds on others, scalar only).
#include "convert.h"

#include <ATen/Version.h>

#include <cstring>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MP_X86_SIMD 1
#include <immintrin.h>
#endif

namespace mixedprec::cpu {
namespace {

template <typename T>
void to_float_scalar(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void from_float_scalar(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(MP_X86_SIMD)
__attribute__((target("avx2,f16c"))) void half_to_float_f16c(const c10::Half* src, float* dst,
                                                              int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  to_float_scalar(src + i, dst + i, n - i);
}

__attribute__((target("avx2,f16c"))) void float_to_half_f16c(const float* src, c10::Half* dst,
                                                              int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  from_float_scalar(src + i, dst + i, n - i);
}

// The same loops as the scalar ones, compiled for AVX2: the compiler vectorises
// c10's bf16 bit operations itself.
__attribute__((target("avx2"))) void bfloat16_to_float_avx2(const c10::BFloat16* src, float* dst,
                                                             int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

__attribute__((target("avx2"))) void float_to_bfloat16_avx2(const float* src, c10::BFloat16* dst,
                                                             int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

bool detect_simd() {
  const std::string capability = at::get_cpu_capability();
  return (capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("f16c");
}
#else
bool detect_simd() { return false; }
#endif

}  // namespace

bool simd_conversions() {
  static const bool simd = detect_simd();
  return simd;
}

void to_float(const float* src, float* dst, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

void from_float(const float* src, float* dst, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

void to_float(const c10::Half* src, float* dst, int64_t n) {
#if defined(MP_X86_SIMD)
  if (simd_conversions()) return half_to_float_f16c(src, dst, n);
#endif
  to_float_scalar(src, dst, n);
}

void from_float(const float* src, c10::Half* dst, int64_t n) {
#if defined(MP_X86_SIMD)
  if (simd_conversions()) return float_to_half_f16c(src, dst, n);
#endif
  from_float_scalar(src, dst, n);
}

void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
#if defined(MP_X86_SIMD)
  if (simd_conversions()) return bfloat16_to_float_avx2(src, dst, n);
#endif
  to_float_scalar(src, dst, n);
}

void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
#if defined(MP_X86_SIMD)
  if (simd_conversions()) return float_to_bfloat16_avx2(src, dst, n);
#endif
  from_float_scalar(src, dst, n);
}

}  // namespace mixedprec::cpu
