// The CPU engine's vector loads and stores (csrc/cpu/vec.h) against c10's scalar
// conversions, for each instruction set the CPU has: every fp16 and bf16 value, and
// fp32 values around every rounding boundary, overflow and the subnormals. The bits
// must agree, but for NaN payloads (both must then be NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/vec.h"

namespace mixedprec::cpu {
namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if defined(MP_X86_ISA)
// Whole vectors of src converted with the loads and stores of one instruction set
// (n is a multiple of the width).
#define MP_CONVERT(NS, TARGET)                                                               \
  template <typename T>                                                                      \
  __attribute__((target(TARGET))) void NS##_to_float(const T* src, float* dst, size_t n) {   \
    constexpr size_t W = sizeof(NS::Vec) / sizeof(float);                                    \
    for (size_t i = 0; i < n; i += W) NS::store(dst + i, NS::load(src + i));                 \
  }                                                                                          \
  template <typename T>                                                                      \
  __attribute__((target(TARGET))) void NS##_from_float(const float* src, T* dst, size_t n) { \
    constexpr size_t W = sizeof(NS::Vec) / sizeof(float);                                    \
    for (size_t i = 0; i < n; i += W) NS::store(dst + i, NS::load(src + i));                 \
  }
MP_CONVERT(avx2, MP_AVX2_TARGET)
MP_CONVERT(avx512, MP_AVX512_TARGET)
#undef MP_CONVERT

bool has(const char* isa) {
  if (std::strcmp(isa, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("f16c");
  }
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

template <typename T>
void to_float(const char* isa, const T* src, float* dst, size_t n) {
  if (std::strcmp(isa, "avx512") == 0) return avx512_to_float(src, dst, n);
  avx2_to_float(src, dst, n);
}

template <typename T>
void from_float(const char* isa, const float* src, T* dst, size_t n) {
  if (std::strcmp(isa, "avx512") == 0) return avx512_from_float(src, dst, n);
  avx2_from_float(src, dst, n);
}

// Every 16-bit pattern.
template <typename T>
void check_every_16_bit_value(const char* isa) {
  std::vector<T> src(65536);
  for (uint32_t i = 0; i < src.size(); ++i) src[i].x = static_cast<uint16_t>(i);
  std::vector<float> got(src.size());
  to_float(isa, src.data(), got.data(), src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    const float want = static_cast<float>(src[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << isa << " bits " << src[i].x;
    } else {
      EXPECT_EQ(bits(got[i]), bits(want)) << isa << " bits " << src[i].x;
    }
  }
}

// fp32 values that stress rounding to T: each 16-bit value's neighbours and the
// midpoints between them (ties), +-1 ulp around those, plus random floats.
template <typename T>
std::vector<float> hard_floats() {
  std::vector<float> out = {0.f,
                            -0.f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::denorm_min(),
                            65504.f,
                            65520.f,
                            65519.99f};
  for (uint32_t i = 0; i < 65535; ++i) {
    T a, b;
    a.x = static_cast<uint16_t>(i);
    b.x = static_cast<uint16_t>(i + 1);
    const float fa = static_cast<float>(a), fb = static_cast<float>(b);
    if (!std::isfinite(fa) || !std::isfinite(fb)) continue;
    const float mid = fa + (fb - fa) / 2;
    for (const float f : {fa, mid, std::nextafter(mid, fa), std::nextafter(mid, fb)}) {
      out.push_back(f);
    }
  }
  std::mt19937 rng(0);
  for (int i = 0; i < 100000; ++i) out.push_back(from_bits(static_cast<uint32_t>(rng())));
  while (out.size() % 16 != 0) out.push_back(1.f);
  return out;
}

template <typename T>
void check_from_float(const char* isa) {
  const std::vector<float> src = hard_floats<T>();
  std::vector<T> got(src.size());
  from_float(isa, src.data(), got.data(), src.size());
  int64_t mismatches = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const T want = static_cast<T>(src[i]);
    const bool both_nan =
        std::isnan(static_cast<float>(want)) && std::isnan(static_cast<float>(got[i]));
    if (!both_nan && got[i].x != want.x && ++mismatches <= 10) {
      ADD_FAILURE() << isa << ": " << src[i] << " (bits " << bits(src[i]) << ") gave bits "
                    << got[i].x << ", c10 gives " << want.x;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

class Convert : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!has(GetParam())) GTEST_SKIP() << "the CPU has no " << GetParam();
  }
};

TEST_P(Convert, HalfToFloatEveryValue) { check_every_16_bit_value<c10::Half>(GetParam()); }
TEST_P(Convert, BFloat16ToFloatEveryValue) { check_every_16_bit_value<c10::BFloat16>(GetParam()); }
TEST_P(Convert, FloatToHalfRoundsLikeC10) { check_from_float<c10::Half>(GetParam()); }
TEST_P(Convert, FloatToBFloat16RoundsLikeC10) { check_from_float<c10::BFloat16>(GetParam()); }

TEST_P(Convert, FloatLoadsAndStoresAreCopies) {
  std::vector<float> src(16), dst(16, 0.f);
  for (int i = 0; i < 16; ++i) src[i] = from_bits(0x3f800000u + 977u * static_cast<uint32_t>(i));
  to_float(GetParam(), src.data(), dst.data(), 16);
  EXPECT_EQ(dst, src);
}

INSTANTIATE_TEST_SUITE_P(Isa, Convert, ::testing::Values("avx2", "avx512"));
#endif

}  // namespace
}  // namespace mixedprec::cpu
