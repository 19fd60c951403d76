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

// bf16 -> fp32 is the 16 bits shifted up; fp32 -> bf16 rounds to nearest even as c10
// does (bits + 0x7fff + the lowest kept bit, then the top half), and turns every NaN
// into c10's 0x7fc0.
__attribute__((target("avx2"))) void bfloat16_to_float_avx2(const c10::BFloat16* src, float* dst,
                                                             int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
  }
  to_float_scalar(src + i, dst + i, n - i);
}

__attribute__((target("avx2"))) void float_to_bfloat16_avx2(const float* src, c10::BFloat16* dst,
                                                             int64_t n) {
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i nan = _mm256_set1_epi32(0x7fc0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i half[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 f = _mm256_loadu_ps(src + i + 8 * h);
      const __m256i u = _mm256_castps_si256(f);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(u, bias), lsb);
      const __m256i rounded = _mm256_srli_epi32(sum, 16);
      const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
      half[h] = _mm256_blendv_epi8(rounded, nan, is_nan);
    }
    // Pack the two sets of eight 32-bit values (each < 2^16) into sixteen 16-bit ones,
    // in order (packus works per 128-bit lane, hence the permute).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]),
                                                    0b11011000);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  from_float_scalar(src + i, dst + i, n - i);
}

bool detect_simd() {
  const std::string capability = at::get_cpu_capability();
  return (capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("f16c");
}

Isa detect_isa() {
  const std::string capability = at::get_cpu_capability();
  if (capability == "AVX512" && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    return Isa::kAvx512;
  }
  if ((capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma")) {
    return Isa::kAvx2;
  }
  return Isa::kBaseline;
}
#else
bool detect_simd() { return false; }
Isa detect_isa() { return Isa::kBaseline; }
#endif

}  // namespace

bool simd_conversions() {
  static const bool simd = detect_simd();
  return simd;
}

Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
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
