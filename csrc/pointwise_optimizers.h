// The per-element math of fused_sgd_, fused_lamb_, fused_adagrad_ and fused_novograd_
// (csrc/ops/optimizers.h), for both engines; what a functor is and declares:
// csrc/pointwise.h.
#pragma once

#include <cstdint>

#include "pointwise.h"

namespace mixedprec {

// torch.optim.SGD on fp32 math, with the unscale of the gradient folded in.
// wd_after_momentum (Apex's option) adds the weight decay to the step after the
// momentum update instead of to the gradient before it. With `report`, the precision
// report (pointwise.h's tally_update), in the tally list.
struct SgdOp {
  // params, grads, momentum_buffers, model_params, comps (or remainders), salts (per
  // tensor), unscaled grads (the grads again, written), the momentum buffers' block
  // scales (8-bit buffers: the engines read and write them, lanes.h), the precision
  // report's sums (per tensor, pointwise.h's tallies)
  static constexpr int kDepth = 9;
  static constexpr unsigned kReads = 0b100110111;
  static constexpr unsigned kWrites = 0b001011101;
  static constexpr unsigned kPerTensor = 0b100100000;
  static constexpr int kTallyList = 8;
  static constexpr int kTallies = 3;
  static constexpr bool kNeedsIndex = true;
  static constexpr int kModelList = 3;
  static constexpr int kCompList = 4;
  static constexpr int kScaleList = 7;
  static constexpr bool kLeanState = true;
  template <typename Param, typename Grad, typename Model, typename State,
            typename Comp = c10::BFloat16>
  using Storage = TypeList<Param, Grad, State, Model, Comp, int64_t, Grad, uint8_t, double>;

  float lr, momentum, weight_decay;
  float grad_weight;  // 1 - dampening, rounded from double as torch.optim does
  bool nesterov, first_run;
  bool wd_after_momentum = false;
  bool maximize = false;
  bool kahan = false;
  bool remainder = false;
  bool stochastic = false;
  bool state_stochastic = false;  // 8-bit buffers rounded stochastically (lanes.h)
  bool report = false;            // the precision report (tally_update)
  bool rounds_bf16 = false;       // the params are bf16 (set by run_types)
  uint64_t seed = 0, state_seed = 0;
  const float* step_ptr = nullptr;  // read with stochastic or state_stochastic only
  const float* inv_scale_ptr = nullptr;
  const float* lr_ptr = nullptr;
  float inv_scale = 1.f;
  RoundingWords rounding;   // filled by resolve() and at_tensor()
  RoundingKey state_key{};  // the 8-bit buffers' bits: rounding's, with state_seed

  // The lists of its common modes (pointwise.h's LeanMode): params, grads and the
  // momentum buffers (SGD without momentum has none: its generic code); the 8-bit
  // buffers' scales.
  static constexpr unsigned kStateLists = 0b111;
  static constexpr unsigned kEightLists = 0b010000000;
  static constexpr int kUnscaledList = 6;
  MP_HD static bool plain(const SgdOp&, bool) { return true; }
  MP_HD static void make_plain(SgdOp&, bool) {}
  // CUDA: two blocks of 512 threads per SM (at most 64 registers a thread, 40-64) for
  // every mode but stochastic rounding with 8-bit buffers, which would spill there and
  // takes one; for a counting kernel (the precision report), one for that mode and for
  // kahan with 8-bit buffers (both spilled at 64 registers, 2026-11-29), two for the
  // others.
  static constexpr int fixed_min_blocks(bool counting, bool kahan, bool stochastic, bool eight) {
    return eight && (stochastic || (counting && kahan)) ? 1 : 2;
  }
  template <bool Model, bool Kahan, bool Remainder, bool Stochastic, bool Eight>
  using Mode = LeanMode<SgdOp, Model, Kahan, Remainder, Stochastic, Eight>;
  using FixedModes = LeanModes<Mode>;

  MP_HD void resolve() {
    if (inv_scale_ptr != nullptr) inv_scale = *inv_scale_ptr;
    if (lr_ptr != nullptr) lr = *lr_ptr;
    if (stochastic || state_stochastic) {
      rounding.key.seed = seed;
      rounding.key.step = static_cast<uint32_t>(*step_ptr);
    }
  }
  MP_HD void at_tensor(const void* const* ptrs) {
    if (stochastic || state_stochastic) rounding.read(ptrs[5]);
    state_key = rounding.key;
    state_key.seed = state_seed;
  }
  template <typename V, typename Index = int64_t>
  MP_HD typename Lanes<V>::Flag apply(V* x, Index index, V* tally = nullptr) const {
    V p = x[0];
    if (kahan) p = p + x[4];
    if (remainder) p = Lanes<V>::join_bf16(x[0], x[4]);
    const V start = p;
    V g = x[1] * inv_scale;
    x[6] = g;
    if (maximize) g = -g;
    if (weight_decay != 0.f && !wd_after_momentum) g = g + weight_decay * p;
    if (momentum != 0.f) {
      const V buf = first_run ? g : x[2] * momentum + grad_weight * g;
      x[2] = buf;
      g = nesterov ? g + momentum * buf : buf;
    }
    if (weight_decay != 0.f && wd_after_momentum) g = g + weight_decay * p;
    p = p - lr * g;
    x[0] = p;
    x[3] = p;
    if (kahan) x[4] = p - Lanes<V>::round_bf16(p);
    if (remainder) x[0] = Lanes<V>::split_bf16(p, x[4]);
    if (stochastic) x[0] = Lanes<V>::round_bf16_stochastic(p, rounding.key, index);
    if (tally != nullptr && report) {
      tally_update(tally, start, p, x[0], x[4], stochastic, kahan, rounds_bf16 && !remainder);
    }
    return Lanes<V>::none();
  }
};

// LAMB's first stage (Apex's multi_tensor_lamb): the moments and the update u, whose
// norm, with the parameter's, gives the trust ratio of the second stage. The
// gradient is unscaled, then divided by the global clip factor; decoupled_weight_decay false adds
// the L2 term to the gradient, true adds weight_decay * p to the update. `step` has already been
// incremented on the device when resolve() reads it.
struct LambStage1Op {
  static constexpr int kDepth = 5;  // params, grads, exp_avgs, exp_avg_sqs, updates
  static constexpr unsigned kReads = 0b01111;
  static constexpr unsigned kWrites = 0b11100;

  double beta1, beta2, eps, weight_decay, max_grad_norm;
  bool decoupled_weight_decay, bias_correction, grad_averaging;
  const float* step_ptr = nullptr;
  const float* inv_scale_ptr = nullptr;
  const float* grad_norm_ptr = nullptr;  // the global gradient norm (unscaled), or null
  // Filled by resolve(); weights such as 1 - beta2 are formed in double, then rounded.
  float inv_scale = 1.f, clip = 1.f, bias_correction1 = 1.f, bias_correction2 = 1.f;
  float beta1_f = 0.f, avg_weight = 0.f, beta2_f = 0.f, sq_weight = 0.f, eps_f = 0.f, wd_f = 0.f;

  MP_HD void resolve() {
    if (inv_scale_ptr != nullptr) inv_scale = *inv_scale_ptr;
    if (grad_norm_ptr != nullptr) {
      const float norm = *grad_norm_ptr;
      const float max_norm = static_cast<float>(max_grad_norm);
      clip = norm > max_norm ? norm / max_norm : 1.f;
    }
    if (bias_correction) {
      const double step = *step_ptr;
      bias_correction1 = static_cast<float>(1.0 - pow_step(beta1, step));
      bias_correction2 = static_cast<float>(1.0 - pow_step(beta2, step));
    }
    beta1_f = static_cast<float>(beta1);
    avg_weight = static_cast<float>(grad_averaging ? 1.0 - beta1 : 1.0);
    beta2_f = static_cast<float>(beta2);
    sq_weight = static_cast<float>(1.0 - beta2);
    eps_f = static_cast<float>(eps);
    wd_f = static_cast<float>(weight_decay);
  }
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x) const {
    const V p = x[0];
    V g = divided(x[1] * inv_scale, clip);
    if (!decoupled_weight_decay) g = g + wd_f * p;
    const V m = x[2] * beta1_f + avg_weight * g;
    const V v = x[3] * beta2_f + sq_weight * (g * g);
    V u = divided(m, bias_correction1) / (Lanes<V>::sqrt(divided(v, bias_correction2)) + eps_f);
    if (decoupled_weight_decay) u = u + wd_f * p;
    x[2] = m;
    x[3] = v;
    x[4] = u;
    return Lanes<V>::none();
  }
};

// LAMB's second stage: p -= ratio * u, with the trust ratio lr * ||p|| / ||u|| of the
// tensor (per-tensor lists) where use_nvlamb or weight_decay != 0 and both norms
// are nonzero, else lr; the model copy, when present, receives p.
struct LambStage2Op {
  static constexpr int kDepth = 5;  // params, updates, model_params, param_norms, update_norms
  static constexpr unsigned kReads = 0b11011;
  static constexpr unsigned kWrites = 0b00101;
  static constexpr unsigned kPerTensor = 0b11000;

  float lr;
  bool adaptive;  // use_nvlamb or weight_decay != 0

  MP_HD void resolve() {}
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x) const {
    V ratio = V{} + lr;
    if (adaptive) {
      // both norms nonzero (a product of ones, not an & of the comparisons: see
      // pointwise.h's tally_update)
      const V both_nonzero = Lanes<V>::ones(x[3] != 0.f) * Lanes<V>::ones(x[4] != 0.f);
      ratio = Lanes<V>::select(both_nonzero != 0.f, lr * (x[3] / x[4]), ratio);
    }
    const V p = x[0] - ratio * x[1];
    x[0] = p;
    x[2] = p;
    return Lanes<V>::none();
  }
};

// Adagrad on fp32 math, as Apex's FusedAdagrad: sum += g * g, then
// p -= lr * g / (sqrt(sum) + eps). The weight decay is added to the gradient (L2,
// torch.optim.Adagrad's) or, with decoupled_weight_decay, to the step (lr * weight_decay * p).
struct AdagradOp {
  static constexpr int kDepth = 4;  // params, grads, state_sums, model_params
  static constexpr unsigned kReads = 0b0111;
  static constexpr unsigned kWrites = 0b1101;
  static constexpr int kModelList = 3;
  static constexpr bool kLeanState = false;
  template <typename Param, typename Grad, typename Model, typename State>
  using Storage = TypeList<Param, Grad, float, Model>;

  float lr, eps, weight_decay;
  bool decoupled_weight_decay;
  const float* inv_scale_ptr = nullptr;
  float inv_scale = 1.f;

  MP_HD void resolve() {
    if (inv_scale_ptr != nullptr) inv_scale = *inv_scale_ptr;
  }
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x) const {
    V p = x[0];
    V g = x[1] * inv_scale;
    if (weight_decay != 0.f && !decoupled_weight_decay) g = g + weight_decay * p;
    const V sum = x[2] + g * g;
    V update = g / (Lanes<V>::sqrt(sum) + eps);
    if (weight_decay != 0.f && decoupled_weight_decay) update = update + weight_decay * p;
    p = p - lr * update;
    x[0] = p;
    x[2] = sum;
    x[3] = p;
    return Lanes<V>::none();
  }
};

// NovoGrad's update on fp32 math, as Apex's FusedNovoGrad, after the per-tensor
// second moment v (the blended norm of each tensor's gradient) was updated: with
// denom = v / sqrt(1 - beta2^step) + eps and m_hat = m / (1 - beta1^step),
//   default:           m = beta1 * m + grad_weight * g;  p -= lr * (m_hat / denom + wd * p)
//   reg_inside_moment: m = beta1 * m + grad_weight * (g / denom + wd * p);  p -= lr * m_hat
// `step` has already been incremented on the device when resolve() reads it.
struct NovoGradOp {
  static constexpr int kDepth = 5;  // params, grads, exp_avgs, exp_avg_sq (per tensor), model
  static constexpr unsigned kReads = 0b01111;
  static constexpr unsigned kWrites = 0b10101;
  static constexpr unsigned kPerTensor = 0b01000;
  static constexpr int kModelList = 4;
  static constexpr bool kLeanState = false;
  template <typename Param, typename Grad, typename Model, typename State>
  using Storage = TypeList<Param, Grad, float, float, Model>;

  double beta1, beta2;
  float lr, grad_weight, eps, weight_decay;
  bool bias_correction, reg_inside_moment;
  const float* step_ptr = nullptr;
  const float* inv_scale_ptr = nullptr;
  // Filled by resolve().
  float inv_scale = 1.f, beta1_f = 0.f, bias_correction1 = 1.f, bias_correction2 = 1.f;

  MP_HD void resolve() {
    if (inv_scale_ptr != nullptr) inv_scale = *inv_scale_ptr;
    beta1_f = static_cast<float>(beta1);
    if (bias_correction) {
      const double step = *step_ptr;
      bias_correction1 = static_cast<float>(1.0 - pow_step(beta1, step));
      bias_correction2 = static_cast<float>(sqrt(1.0 - pow_step(beta2, step)));
    }
  }
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x) const {
    V p = x[0];
    V g = x[1] * inv_scale;
    const V denom = divided(x[3], bias_correction2) + eps;
    V m;
    if (reg_inside_moment) {
      g = g / denom + weight_decay * p;
      m = x[2] * beta1_f + grad_weight * g;
      p = p - lr * divided(m, bias_correction1);
    } else {
      m = x[2] * beta1_f + grad_weight * g;
      p = p - lr * (divided(m, bias_correction1) / denom + weight_decay * p);
    }
    x[0] = p;
    x[2] = m;
    x[4] = p;
    return Lanes<V>::none();
  }
};

}  // namespace mixedprec
