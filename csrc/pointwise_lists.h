// The list ops' per-element math (csrc/ops/multi_tensor.h: unscale, the finite check,
// the cast copy), for both engines; what a functor is and declares: csrc/pointwise.h.
#pragma once

#include "pointwise.h"

namespace mixedprec {

// dst = src * inv_scale (inv_scale may be absent: a plain cast copy). Reports
// non-finite inputs when the engine is given a found_inf.
struct ScaleOp {
  static constexpr int kDepth = 2;  // src, dst
  static constexpr unsigned kReads = 0b01;
  static constexpr unsigned kWrites = 0b10;

  const float* inv_scale_ptr = nullptr;
  float inv_scale = 1.f;

  MP_HD void resolve() {
    if (inv_scale_ptr != nullptr) inv_scale = *inv_scale_ptr;
  }
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x) const {
    x[1] = x[0] * inv_scale;
    return Lanes<V>::not_finite(x[0]);
  }
};

// A read-only overflow check: reports non-finite elements, writes nothing else.
struct CheckFiniteOp {
  static constexpr int kDepth = 1;
  static constexpr unsigned kReads = 0b1;
  static constexpr unsigned kWrites = 0b0;

  MP_HD void resolve() {}
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(const V* x) const {
    return Lanes<V>::not_finite(x[0]);
  }
};

struct LossScaleArgs {
  double growth_factor, backoff_factor, min_scale, max_scale;
  int32_t growth_interval, hysteresis;
};

// Dynamic loss scaling with hysteresis, a floor and a ceiling (update_loss_scale_,
// csrc/ops/loss_scale.h), a one-thread function (Engine::run_single). Products are
// formed in double and rounded once to float, as torch's _amp_update_scale_ does.
struct UpdateLossScale {
  MP_HD static void apply(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                          const float* found_inf, const LossScaleArgs& a) {
    if (*found_inf != 0.f) {
      *hysteresis_tracker -= 1;
      if (*hysteresis_tracker <= 0) {
        const double backed_off = static_cast<double>(*scale) * a.backoff_factor;
        *scale = static_cast<float>(backed_off > a.min_scale ? backed_off : a.min_scale);
      }
      *growth_tracker = 0;
      return;
    }
    *hysteresis_tracker = a.hysteresis;
    *growth_tracker += 1;
    if (*growth_tracker >= a.growth_interval) {
      const double grown = static_cast<double>(*scale) * a.growth_factor;
      const float capped = static_cast<float>(grown < a.max_scale ? grown : a.max_scale);
      if (is_finite(capped)) *scale = capped;
      *growth_tracker = 0;
    }
  }
};

}  // namespace mixedprec
