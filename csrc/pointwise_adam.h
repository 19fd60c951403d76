// AdamOp, the per-element math of fused_adam_ (csrc/ops/adam.h), for both engines;
// what a functor is and declares: csrc/pointwise.h.
#pragma once

#include <cstdint>

#include "pointwise.h"

namespace mixedprec {

// torch.optim.Adam (decoupled_weight_decay false) and AdamW (decoupled_weight_decay true) on fp32
// math. `step` has already been incremented on the device when resolve() reads it. With amsgrad
// (max_exp_avg_sqs given), torch's: max_exp_avg_sq = maximum(max_exp_avg_sq,
// exp_avg_sq), and the denominator takes its square root instead of exp_avg_sq's. With
// `root` (8-bit state, amsgrad refused), list 3 holds sqrt(exp_avg_sq): it is squared
// when read (exactly: an e4m3 value times a power of two) and the new root, which the
// denominator takes anyway, is what is stored.
//
// With `report`, the precision report (pointwise.h's tally_update), in the tally list.
struct AdamOp {
  // params, grads, exp_avgs, exp_avg_sqs, model_params, comps (or remainders), salts (per
  // tensor), max_exp_avg_sqs, unscaled grads (the grads again, written), the block
  // scales of 8-bit exp_avgs and exp_avg_sqs (the engines read and write them, lanes.h),
  // the precision report's sums (float64, per tensor: lost count, lost and applied
  // squares, and the engine's element count)
  static constexpr int kDepth = 12;
  static constexpr unsigned kReads = 0b100011101111;
  static constexpr unsigned kWrites = 0b000110111101;
  static constexpr unsigned kPerTensor = 0b100001000000;
  static constexpr int kTallyList = 11;
  static constexpr int kTallies = 3;
  static constexpr bool kNeedsIndex = true;
  static constexpr int kModelList = 4;
  static constexpr int kCompList = 5;
  static constexpr int kScaleList = 9;
  static constexpr bool kLeanState = true;
  template <typename Param, typename Grad, typename Model, typename State,
            typename Comp = c10::BFloat16>
  using Storage = TypeList<Param, Grad, State, State, Model, Comp, int64_t, State, Grad, uint8_t,
                           uint8_t, double>;

  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled_weight_decay, bias_correction;
  bool maximize = false;
  bool amsgrad = false;
  bool kahan = false;
  bool remainder = false;
  bool stochastic = false;
  bool root = false;              // exp_avg_sqs hold the second moments' square roots (8-bit state)
  bool state_stochastic = false;  // 8-bit moments rounded stochastically (lanes.h)
  bool report = false;            // the precision report (tally_update)
  bool rounds_bf16 = false;       // the params are bf16 (set by run_types)
  uint64_t seed = 0, state_seed = 0;
  const float* step_ptr = nullptr;
  const float* inv_scale_ptr = nullptr;
  const float* lr_ptr = nullptr;
  // Filled by resolve(): weights such as 1 - beta2 are formed in double and then
  // rounded to float, as torch.optim does (rounding beta2 first loses digits).
  float inv_scale = 1.f, step_size = 0.f, bias_correction2_sqrt = 1.f;
  float decay = 1.f, avg_weight = 0.f, beta2_f = 0.f, sq_weight = 0.f, eps_f = 0.f, wd_f = 0.f;
  RoundingWords rounding;   // filled by resolve() and at_tensor()
  RoundingKey state_key{};  // the 8-bit moments' bits: rounding's, with state_seed

  // The lists of its common modes (pointwise.h's LeanMode): params, grads and the two
  // moments; the scales of both 8-bit moments.
  static constexpr unsigned kStateLists = 0b1111;
  static constexpr unsigned kEightLists = 0b011000000000;
  static constexpr int kUnscaledList = 8;
  // The common modes are also without amsgrad, and 8-bit moments are their roots.
  MP_HD static bool plain(const AdamOp& op, bool eight) { return op.root == eight && !op.amsgrad; }
  MP_HD static void make_plain(AdamOp& op, bool eight) {
    op.root = eight;
    op.amsgrad = false;
  }
  // CUDA: two blocks of 512 threads per SM (at most 64 registers a thread) for every
  // mode but kahan and stochastic rounding with 8-bit moments, which would spill there
  // and take one (106-108 registers); for a counting kernel (the precision report),
  // one where the stochastic ones and the 8-bit one without kahan would spill at 64
  // (104-116 registers; 2026-11-29), two for the others (57-64). ptxas alone gives the
  // remainder mode 68 registers, so one block per SM, whose loads and math then take
  // turns rather than overlap (docs/gpu-validation.md).
  static constexpr int fixed_min_blocks(bool counting, bool kahan, bool stochastic, bool eight) {
    if (counting) return stochastic || eight ? 1 : 2;
    return eight && (kahan || stochastic) ? 1 : 2;
  }
  template <bool Model, bool Kahan, bool Remainder, bool Stochastic, bool Eight>
  using Mode = LeanMode<AdamOp, Model, Kahan, Remainder, Stochastic, Eight>;
  using FixedModes = LeanModes<Mode>;

  MP_HD void resolve() {
    if (inv_scale_ptr != nullptr) inv_scale = *inv_scale_ptr;
    const double rate = lr_ptr != nullptr ? static_cast<double>(*lr_ptr) : lr;
    const double step = *step_ptr;
    rounding.key.seed = seed;
    rounding.key.step = static_cast<uint32_t>(step);
    double bc1 = 1.0, bc2 = 1.0;
    if (bias_correction) {
      bc1 = 1.0 - pow_step(beta1, step);
      bc2 = 1.0 - pow_step(beta2, step);
    }
    step_size = static_cast<float>(rate / bc1);
    bias_correction2_sqrt = static_cast<float>(sqrt(bc2));
    decay = static_cast<float>(1.0 - rate * weight_decay);
    avg_weight = static_cast<float>(1.0 - beta1);
    beta2_f = static_cast<float>(beta2);
    sq_weight = static_cast<float>(1.0 - beta2);
    eps_f = static_cast<float>(eps);
    wd_f = static_cast<float>(weight_decay);
  }
  MP_HD void at_tensor(const void* const* ptrs) {
    if (stochastic || state_stochastic) rounding.read(ptrs[6]);
    state_key = rounding.key;
    state_key.seed = state_seed;
  }
  template <typename V, typename Index = int64_t>
  MP_HD typename Lanes<V>::Flag apply(V* x, Index index, V* tally = nullptr) const {
    V p = x[0];
    if (kahan) p = p + x[5];
    if (remainder) p = Lanes<V>::join_bf16(x[0], x[5]);
    const V start = p;
    V g = x[1] * inv_scale;
    x[8] = g;
    if (maximize) g = -g;
    if (wd_f != 0.f) {
      if (decoupled_weight_decay) {
        p = p * decay;
      } else {
        g = g + wd_f * p;
      }
    }
    // exp_avg.lerp_(grad, 1 - beta1), in the form torch's lerp uses for weights < 0.5.
    const float w = avg_weight;
    const V m = w < 0.5f ? x[2] + w * (g - x[2]) : g - (g - x[2]) * (1.f - w);
    const V v_old = root ? x[3] * x[3] : x[3];
    const V v = v_old * beta2_f + sq_weight * (g * g);
    V v_denom = v;
    if (amsgrad) {
      v_denom = maximum(x[7], v);
      x[7] = v_denom;
    }
    const V root_v = Lanes<V>::sqrt(v_denom);
    // (sqrt(1 - beta2^step) rounds to 1 from step 16,628 at beta2 0.999, 325 at 0.95:
    // two of a vector pair's six divisions and square roots, 7-13% of a 16-bit mode's
    // step on Zen 3)
    const V denom = divided(root_v, bias_correction2_sqrt) + eps_f;
    p = p - step_size * (m / denom);
    x[0] = p;
    x[2] = m;
    x[3] = root ? root_v : v;
    x[4] = p;
    if (kahan) x[5] = p - Lanes<V>::round_bf16(p);
    if (remainder) x[0] = Lanes<V>::split_bf16(p, x[5]);
    if (stochastic) x[0] = Lanes<V>::round_bf16_stochastic(p, rounding.key, index);
    if (tally != nullptr && report) {
      tally_update(tally, start, p, x[0], x[5], stochastic, kahan, rounds_bf16 && !remainder);
    }
    return Lanes<V>::none();
  }
};

}  // namespace mixedprec
