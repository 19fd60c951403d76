// pointwise.h's pow_step, the bias corrections' power: the float values the optimizers
// make from it (step size, bias corrections and the root of the second's) equal those
// made from glibc's pow, which torch.optim uses, over many betas and steps; and the
// exponents it does not raise by squaring go to pow.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "pointwise.h"

namespace mixedprec {
namespace {

TEST(PowStep, FloatResultsEqualGlibcPow) {
  const double betas[] = {0.9, 0.99, 0.999, 0.95, 0.98, 0.5, 0.9999, 0.997};
  const double rates[] = {1e-3, 3e-4, 0.1, 1.0};
  long mismatches = 0;
  for (double beta : betas) {
    for (long step = 1; step <= 100000; ++step) {
      const double ours = 1.0 - pow_step(beta, static_cast<double>(step));
      const double glibc = 1.0 - std::pow(beta, static_cast<double>(step));
      bool same = static_cast<float>(ours) == static_cast<float>(glibc) &&
                  static_cast<float>(std::sqrt(ours)) == static_cast<float>(std::sqrt(glibc));
      for (double rate : rates) {
        same = same && static_cast<float>(rate / ours) == static_cast<float>(rate / glibc);
      }
      if (!same && ++mismatches <= 5) {
        ADD_FAILURE() << "beta " << beta << " step " << step << ": " << ours << " vs " << glibc;
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(PowStep, WholePowersAreNearlyExact) {
  // Exact in double: powers of two and small integers.
  EXPECT_EQ(pow_step(0.5, 10.0), 1.0 / 1024.0);
  EXPECT_EQ(pow_step(3.0, 20.0), 3486784401.0);
  EXPECT_EQ(pow_step(0.9, 0.0), 1.0);
  EXPECT_EQ(pow_step(0.0, 0.0), 1.0);
  EXPECT_EQ(pow_step(0.0, 5.0), 0.0);
  EXPECT_EQ(pow_step(-0.5, 3.0), -0.125);
  // (the double nearest 0.9)^10, as long double's 64-bit pow rounds it.
  EXPECT_EQ(pow_step(0.9, 10.0), static_cast<double>(std::pow(static_cast<long double>(0.9), 10)));
}

TEST(PowStep, OtherExponentsTakePow) {
  EXPECT_EQ(pow_step(0.9, 1.5), std::pow(0.9, 1.5));
  EXPECT_EQ(pow_step(0.9, -2.0), std::pow(0.9, -2.0));
  EXPECT_EQ(pow_step(0.9, 1e300), std::pow(0.9, 1e300));
  EXPECT_TRUE(std::isnan(pow_step(0.9, std::numeric_limits<double>::quiet_NaN())));
  EXPECT_EQ(pow_step(2.0, 2000.0), std::numeric_limits<double>::infinity());  // overflow
  EXPECT_EQ(pow_step(0.9, 1e9), 0.0);                                         // underflow
}

}  // namespace
}  // namespace mixedprec
