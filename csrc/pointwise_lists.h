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

}  // namespace mixedprec
