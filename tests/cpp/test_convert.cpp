// The CPU engine's run conversions (csrc/cpu/convert.h) against c10's scalar
// conversions: every fp16 and bf16 value, and fp32 values around every rounding
// boundary, overflow and the subnormals. With SIMD in use the bits must agree,
// but for NaN payloads (both must then be NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <vector>

#include "cpu/convert.h"

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

// Every 16-bit pattern, at odd lengths and offsets so that the SIMD loops' tails run.
template <typename T>
void check_every_16_bit_value() {
  std::vector<T> src(65536 + 3);
  for (uint32_t i = 0; i < src.size(); ++i) src[i].x = static_cast<uint16_t>(i);
  std::vector<float> got(src.size());
  to_float(src.data() + 1, got.data() + 1, 65536 + 1);
  for (size_t i = 1; i < src.size() - 1; ++i) {
    const float want = static_cast<float>(src[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << "bits " << src[i].x;
    } else {
      EXPECT_EQ(bits(got[i]), bits(want)) << "bits " << src[i].x;
    }
  }
}

// fp32 values that stress rounding to T: each 16-bit value's neighbours and the
// midpoints between them (ties), +-1 ulp around those, plus random floats.
template <typename T>
std::vector<float> hard_floats() {
  std::vector<float> out = {0.f, -0.f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::denorm_min(), 65504.f, 65520.f, 65519.99f};
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
  return out;
}

template <typename T>
void check_from_float() {
  const std::vector<float> src = hard_floats<T>();
  std::vector<T> got(src.size());
  from_float(src.data(), got.data(), static_cast<int64_t>(src.size()));
  int64_t mismatches = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const T want = static_cast<T>(src[i]);
    const bool both_nan = std::isnan(static_cast<float>(want)) && std::isnan(static_cast<float>(got[i]));
    if (!both_nan && got[i].x != want.x && ++mismatches <= 10) {
      ADD_FAILURE() << "from_float(" << src[i] << ", bits " << bits(src[i]) << ") gave bits "
                    << got[i].x << ", c10 gives " << want.x;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Convert, HalfToFloatEveryValue) {
  std::cout << "SIMD conversions in use: " << (simd_conversions() ? "yes" : "no") << "\n";
  check_every_16_bit_value<c10::Half>();
}
TEST(Convert, BFloat16ToFloatEveryValue) { check_every_16_bit_value<c10::BFloat16>(); }
TEST(Convert, FloatToHalfRoundsLikeC10) { check_from_float<c10::Half>(); }
TEST(Convert, FloatToBFloat16RoundsLikeC10) { check_from_float<c10::BFloat16>(); }

TEST(Convert, FloatIsACopyAndEmptyRunsAreNoOps) {
  const std::vector<float> src = {1.f, -2.5f, 3e38f};
  std::vector<float> dst(3, 0.f);
  to_float(src.data(), dst.data(), 3);
  EXPECT_EQ(dst, src);
  std::vector<float> back(3, 0.f);
  from_float(dst.data(), back.data(), 3);
  EXPECT_EQ(back, src);
  from_float(src.data(), static_cast<c10::Half*>(nullptr), 0);
  to_float(static_cast<const c10::BFloat16*>(nullptr), dst.data(), 0);
}

}  // namespace
}  // namespace mixedprec::cpu
