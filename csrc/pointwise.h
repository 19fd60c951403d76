// The per-element math of every multi-tensor op, written once for the CPU and
// CUDA engines. All math is fp32 whatever the storage type.
//
// A functor works on `kDepth` parallel lists. For one element index it gets
// x[k], the value of list k as float (for the lists in kReads), updates x[k] for
// the lists in kWrites, and returns true when it saw a non-finite input that the
// op reports in found_inf. apply() is a template over the value type V: float here
// (CUDA, and single elements on the CPU), a vector of floats in the CPU engine
// (cpu/engine.h), where each lane sees the same operations as a float would.
// resolve() runs once per block (CUDA) or call (CPU), on the device that holds the
// data, to read device-side scalars such as inv_scale and step.
//
// A functor may declare `kPerTensor`, a mask of per-tensor lists: list k in it holds,
// for tensor i of the other lists, one fp32 value (a one-element tensor), which
// apply() sees in x[k] for every element of tensor i. Such lists are read, never
// written (in kReads, not in kWrites). Functors without the member have none. A
// per-tensor list stored as int64 (its Storage type) holds words that x[k] does not
// carry (it reads 0 there): the functor reads them in at_tensor(ptrs), which, when
// declared, the engines call on their copy of the functor before it works on any
// element of tensor i (once per CPU chunk, once per CUDA block), with ptrs[k] the
// address of tensor i's words for per-tensor list k (null when the list is absent).
//
// A functor that declares `kNeedsIndex = true` gets apply(x, index) instead, where
// index is the element's position within its tensor (for a CPU vector, that of its
// first lane, a multiple of the vector's width; lane j is index + j): stochastic
// rounding draws its bits from it (a CPU vector, 8 lanes per Philox call). It does
// not depend on how an engine splits the tensor into chunks or threads.
//
// Such a functor may also declare `FixedModes`, a TypeList of its common modes (see
// AdamOp::Mode): the CPU engine compiles its vector loops once per mode, with the
// mode's flags as constants and its lists known present or absent (cpu/engine.h's
// Fixed), and keeps the generic loop for the other modes. The bits are the same.
#pragma once

#include <c10/util/Half.h>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "lanes.h"

namespace mixedprec {

template <typename... Ts>
struct TypeList {};

// Op::kPerTensor, or 0 when Op does not declare it.
template <typename Op, typename = void>
struct PerTensorMask {
  static constexpr unsigned value = 0;
};
template <typename Op>
struct PerTensorMask<Op, std::void_t<decltype(Op::kPerTensor)>> {
  static constexpr unsigned value = Op::kPerTensor;
};
template <typename Op>
constexpr unsigned per_tensor_mask() {
  static_assert((PerTensorMask<Op>::value & Op::kWrites) == 0, "per-tensor lists are read-only");
  static_assert((PerTensorMask<Op>::value & ~Op::kReads) == 0, "per-tensor lists are read");
  return PerTensorMask<Op>::value;
}
// Op::kNeedsIndex, or false when Op does not declare it.
template <typename Op, typename = void>
struct NeedsIndex {
  static constexpr bool value = false;
};
template <typename Op>
struct NeedsIndex<Op, std::void_t<decltype(Op::kNeedsIndex)>> {
  static constexpr bool value = Op::kNeedsIndex;
};

// beta^step for the bias corrections, in double: the same bits on the CPU and on CUDA.
// A step count (a whole number below 2^53) is raised by squaring in double-double
// arithmetic (Dekker's exact products: plain IEEE adds and multiplies, never
// contracted into FMAs: -ffp-contract=off and nvcc -fmad=false), then rounded once:
// within about 2^-97 of the exact power, so it rounds as a correctly rounded pow does
// but in vanishingly rare cases. The libraries' pow differ (CUDA's is within 2 ulps,
// glibc's 1), and torch.optim uses glibc's: with 16 betas in (0.1, 0.99999) and every
// step up to 10^6, the float bias corrections and step sizes made from this and from
// glibc's pow are all equal (tests/cpp/test_pow_step.cpp checks a part). Other
// exponents take pow.
MP_HD void two_product(double a, double b, double& product, double& error) {
  constexpr double kSplit = 134217729.0;  // 2^27 + 1: Veltkamp's split into 26-bit halves
  product = a * b;
  double t = kSplit * a;
  const double a_hi = t - (t - a), a_lo = a - a_hi;
  t = kSplit * b;
  const double b_hi = t - (t - b), b_lo = b - b_hi;
  error = ((a_hi * b_hi - product) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo;
}
MP_HD void mul_double_double(double& hi, double& lo, double other_hi, double other_lo) {
  double product, error;
  two_product(hi, other_hi, product, error);
  error += hi * other_lo + lo * other_hi;
  hi = product + error;
  lo = error - (hi - product);
}
MP_HD double pow_step(double base, double step) {
  if (!(step >= 0.0 && step < 9007199254740992.0) || step != floor(step)) return pow(base, step);
  double hi = 1.0, lo = 0.0, square_hi = base, square_lo = 0.0;
  for (uint64_t n = static_cast<uint64_t>(step); n != 0;) {
    if (n & 1) mul_double_double(hi, lo, square_hi, square_lo);
    n >>= 1;
    if (n != 0) mul_double_double(square_hi, square_lo, square_hi, square_lo);
  }
  const double power = hi + lo;
  return power - power == 0.0 ? power : pow(base, step);  // (not finite: pow's inf or 0)
}

// Whether Op declares at_tensor (see above).
template <typename Op, typename = void>
struct HasAtTensor {
  static constexpr bool value = false;
};
template <typename Op>
struct HasAtTensor<Op, std::void_t<decltype(&Op::at_tensor)>> {
  static constexpr bool value = true;
};

// op.at_tensor(ptrs) where Op declares it (see above); else nothing.
template <typename Op>
MP_HD void at_tensor(Op& op, const void* const* ptrs) {
  if constexpr (HasAtTensor<Op>::value) {
    op.at_tensor(ptrs);
  } else {
    (void)op;
    (void)ptrs;
  }
}

// The value x[k] holds of per-tensor list k stored as T at p (see above): an fp32
// list's value; 0 for an int64 list (read by at_tensor) or an absent one.
template <typename T>
MP_HD float per_tensor_value(const void* p) {
  if constexpr (std::is_same<T, float>::value) {
    return p != nullptr ? *static_cast<const float*>(p) : 0.f;
  } else {
    (void)p;
    return 0.f;
  }
}

// op.apply on x, the element(s) from `index` on, as the functor asks (see above).
template <typename Op, typename V>
MP_HD auto apply_at(const Op& op, V* x, int64_t index) {
  if constexpr (NeedsIndex<Op>::value) {
    return op.apply(x, index);
  } else {
    (void)index;
    return op.apply(x);
  }
}

// Whether list K of Op is a per-tensor list.
template <typename Op, size_t K>
constexpr bool kPerTensorList = ((per_tensor_mask<Op>() >> K) & 1u) != 0;

// Whether list K of Op may be stored as T: any type for a list of elements, fp32 or
// int64 for a per-tensor list (see above).
template <typename Op, size_t K, typename T>
constexpr bool kPerTensorStorageOk =
    !kPerTensorList<Op, K> || std::is_same<T, float>::value || std::is_same<T, int64_t>::value;

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

// The optimizers' lists as run_optimizer (dispatch.h) stores them: list 2 is the
// first state list (fp32, or bf16 where the op has kLeanState), kModelList the model
// copy (absent without masters). Ops with kahan read and write a compensation list
// (bf16, beside bf16 params, no masters): the update starts from p + comp and
// leaves comp = new - round_bf16(new), the part of the new value that bf16 params
// cannot hold (Kahan summation); without compensations p is used as it is. With
// `remainder`, that list (kCompList) holds int16 remainders (bf16 params, no masters):
// the update starts from the master joined from both and splits the new one back.
// With `stochastic` (bf16 params, no masters), the new value is rounded to bf16
// stochastically, with Philox bits keyed by (seed, step) and counted by the element's
// global index (one Philox call per 8 elements: philox.h's rounding_bits) and its
// tensor's salt. Both come from the per-tensor list after the compensations, one int64
// tensor of 4 words per tensor (read by at_tensor): (salt, offset, run, stride), the
// salt being the tensor's position in its param group and the rest the map of its
// local elements onto the full tensor's (philox.h's RoundingKey::global; 0, 0, 0 for
// a whole tensor).
struct RoundingWords {
  RoundingKey key{};  // seed and step filled by the functor, the rest by read()

  static constexpr int kWords = 4;
  MP_HD void read(const void* words) {
    const int64_t* w = static_cast<const int64_t*>(words);
    key.salt = static_cast<uint32_t>(w[0]);
    key.offset = w[1];
    key.run = w[2];
    key.stride = w[3];
  }
};

// torch.maximum: the larger of a and b, NaN where either is (per lane).
template <typename V>
MP_HD V maximum(V a, V b) {
  return Lanes<V>::select(a != a, a, Lanes<V>::select(a >= b, a, b));
}

// Options shared by SgdOp and AdamOp, as torch.optim has them:
// - maximize: the gradient is negated after the unscale, before anything else uses it.
// - the unscaled gradient (grad * inv_scale, not negated) is written to the last
//   list, when present: the grads themselves, so that they hold what torch's fused
//   optimizers leave in p.grad after a GradScaler step (unscale_grads).
// - the learning rate is `lr`, or the float at lr_ptr (a device tensor, read by
//   resolve()) when set, so that a captured CUDA graph follows a scheduler.

// torch.optim.SGD on fp32 math, with the unscale of the gradient folded in.
// wd_after_momentum (Apex's option) adds the weight decay to the step after the
// momentum update instead of to the gradient before it.
struct SgdOp {
  // params, grads, momentum_buffers, model_params, comps (or remainders), salts (per
  // tensor), unscaled grads (the grads again, written), the momentum buffers' block
  // scales (8-bit buffers: the engines read and write them, lanes.h)
  static constexpr int kDepth = 8;
  static constexpr unsigned kReads = 0b00110111;
  static constexpr unsigned kWrites = 0b01011101;
  static constexpr unsigned kPerTensor = 0b00100000;
  static constexpr bool kNeedsIndex = true;
  static constexpr int kModelList = 3;
  static constexpr int kCompList = 4;
  static constexpr int kScaleList = 7;
  static constexpr bool kLeanState = true;
  template <typename Param, typename Grad, typename Model, typename State,
            typename Comp = c10::BFloat16>
  using Storage = TypeList<Param, Grad, State, Model, Comp, int64_t, Grad, uint8_t>;

  float lr, momentum, weight_decay;
  float grad_weight;  // 1 - dampening, rounded from double as torch.optim does
  bool nesterov, first_run;
  bool wd_after_momentum = false;
  bool maximize = false;
  bool kahan = false;
  bool remainder = false;
  bool stochastic = false;
  bool state_stochastic = false;  // 8-bit buffers rounded stochastically (lanes.h)
  uint64_t seed = 0, state_seed = 0;
  const float* step_ptr = nullptr;  // read with stochastic or state_stochastic only
  const float* inv_scale_ptr = nullptr;
  const float* lr_ptr = nullptr;
  float inv_scale = 1.f;
  RoundingWords rounding;   // filled by resolve() and at_tensor()
  RoundingKey state_key{};  // the 8-bit buffers' bits: rounding's, with state_seed

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
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x, int64_t index) const {
    V p = x[0];
    if (kahan) p = p + x[4];
    if (remainder) p = Lanes<V>::join_bf16(x[0], x[4]);
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
    return Lanes<V>::none();
  }
};

// torch.optim.Adam (adamw false) and AdamW (adamw true) on fp32 math. `step`
// has already been incremented on the device when resolve() reads it. With amsgrad
// (max_exp_avg_sqs given), torch's: max_exp_avg_sq = maximum(max_exp_avg_sq,
// exp_avg_sq), and the denominator takes its square root instead of exp_avg_sq's. With
// `root` (8-bit state, amsgrad refused), list 3 holds sqrt(exp_avg_sq): it is squared
// when read (exactly: an e4m3 value times a power of two) and the new root, which the
// denominator takes anyway, is what is stored.
struct AdamOp {
  // params, grads, exp_avgs, exp_avg_sqs, model_params, comps (or remainders), salts (per
  // tensor), max_exp_avg_sqs, unscaled grads (the grads again, written), the block
  // scales of 8-bit exp_avgs and exp_avg_sqs (the engines read and write them, lanes.h)
  static constexpr int kDepth = 11;
  static constexpr unsigned kReads = 0b00011101111;
  static constexpr unsigned kWrites = 0b00110111101;
  static constexpr unsigned kPerTensor = 0b00001000000;
  static constexpr bool kNeedsIndex = true;
  static constexpr int kModelList = 4;
  static constexpr int kCompList = 5;
  static constexpr int kScaleList = 9;
  static constexpr bool kLeanState = true;
  template <typename Param, typename Grad, typename Model, typename State,
            typename Comp = c10::BFloat16>
  using Storage =
      TypeList<Param, Grad, State, State, Model, Comp, int64_t, State, Grad, uint8_t, uint8_t>;

  double lr, beta1, beta2, eps, weight_decay;
  bool adamw, bias_correction;
  bool maximize = false;
  bool amsgrad = false;
  bool kahan = false;
  bool remainder = false;
  bool stochastic = false;
  bool root = false;              // exp_avg_sqs hold the second moments' square roots (8-bit state)
  bool state_stochastic = false;  // 8-bit moments rounded stochastically (lanes.h)
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

  // The common modes, which the CPU engine compiles once each with their flags as
  // constants, the lists kLists known present and the others absent but for kMaybe
  // (engine.h's Fixed): no master (Model false) or fp32 masters with a model copy
  // (Model true); kahan, remainder or stochastic; fp32 or bf16 moments, or 8-bit ones
  // (Eight: root and state_stochastic, as the optimizers give them) with their
  // scales; the unscaled grads written back or not; all without maximize or amsgrad.
  // fits<Ts...>() says whether storage Ts (Storage's order) can be in the mode.
  template <bool Model, bool Kahan, bool Remainder, bool Stochastic, bool Eight>
  struct Mode {
    static constexpr unsigned kLists = 0b1111u | (Model ? 1u << kModelList : 0u) |
                                       (Kahan || Remainder ? 1u << kCompList : 0u) |
                                       (Eight ? 0b11u << kScaleList : 0u);
    static constexpr unsigned kMaybe = 1u << 8;
    // Rounds params stochastically: the AVX2 loop then takes 32 lanes a step
    // (engine.h, kWideRounding), for two Philox chains at once.
    static constexpr bool kWideRounding = Stochastic && !Eight;
    template <typename... Ts>
    static constexpr bool fits() {
      using Param = std::tuple_element_t<0, std::tuple<Ts...>>;
      using State = std::tuple_element_t<2, std::tuple<Ts...>>;
      using Comp = std::tuple_element_t<kCompList, std::tuple<Ts...>>;
      return (!Model || std::is_same_v<Param, float>) &&
             (!Stochastic || std::is_same_v<Param, c10::BFloat16>) &&
             (Remainder == std::is_same_v<Comp, int16_t>) && (Eight == std::is_same_v<State, E4m3>);
    }
    static bool holds(const AdamOp& op) {
      return op.kahan == Kahan && op.remainder == Remainder && op.stochastic == Stochastic &&
             op.root == Eight && op.state_stochastic == Eight && !op.maximize && !op.amsgrad;
    }
    static void fix(AdamOp& op) {
      op.kahan = Kahan;
      op.remainder = Remainder;
      op.stochastic = Stochastic;
      op.root = op.state_stochastic = Eight;
      op.maximize = op.amsgrad = false;
    }
  };
  using FixedModes =
      TypeList<Mode<false, false, false, false, false>, Mode<true, false, false, false, false>,
               Mode<false, true, false, false, false>, Mode<false, false, true, false, false>,
               Mode<false, false, false, true, false>, Mode<false, false, false, false, true>,
               Mode<true, false, false, false, true>, Mode<false, true, false, false, true>,
               Mode<false, false, true, false, true>, Mode<false, false, false, true, true>>;

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
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x, int64_t index) const {
    V p = x[0];
    if (kahan) p = p + x[5];
    if (remainder) p = Lanes<V>::join_bf16(x[0], x[5]);
    V g = x[1] * inv_scale;
    x[8] = g;
    if (maximize) g = -g;
    if (wd_f != 0.f) {
      if (adamw) {
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
    const V denom = root_v / bias_correction2_sqrt + eps_f;
    p = p - step_size * (m / denom);
    x[0] = p;
    x[2] = m;
    x[3] = root ? root_v : v;
    x[4] = p;
    if (kahan) x[5] = p - Lanes<V>::round_bf16(p);
    if (remainder) x[0] = Lanes<V>::split_bf16(p, x[5]);
    if (stochastic) x[0] = Lanes<V>::round_bf16_stochastic(p, rounding.key, index);
    return Lanes<V>::none();
  }
};

// LAMB's first stage (Apex's multi_tensor_lamb): the moments and the update u, whose
// norm, with the parameter's, gives the trust ratio of the second stage. The
// gradient is unscaled, then divided by the global clip factor; adamw false adds the
// L2 term to the gradient, true adds weight_decay * p to the update. `step` has
// already been incremented on the device when resolve() reads it.
struct LambStage1Op {
  static constexpr int kDepth = 5;  // params, grads, exp_avgs, exp_avg_sqs, updates
  static constexpr unsigned kReads = 0b01111;
  static constexpr unsigned kWrites = 0b11100;

  double beta1, beta2, eps, weight_decay, max_grad_norm;
  bool adamw, bias_correction, grad_averaging;
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
    V g = x[1] * inv_scale / clip;
    if (!adamw) g = g + wd_f * p;
    const V m = x[2] * beta1_f + avg_weight * g;
    const V v = x[3] * beta2_f + sq_weight * (g * g);
    V u = (m / bias_correction1) / (Lanes<V>::sqrt(v / bias_correction2) + eps_f);
    if (adamw) u = u + wd_f * p;
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
      const auto both_nonzero = (x[3] != 0.f) & (x[4] != 0.f);
      ratio = Lanes<V>::select(both_nonzero, lr * (x[3] / x[4]), ratio);
    }
    const V p = x[0] - ratio * x[1];
    x[0] = p;
    x[2] = p;
    return Lanes<V>::none();
  }
};

// Adagrad on fp32 math, as Apex's FusedAdagrad: sum += g * g, then
// p -= lr * g / (sqrt(sum) + eps). The weight decay is added to the gradient (L2,
// torch.optim.Adagrad's) or, with adagrad_w_mode, to the step (lr * weight_decay * p).
struct AdagradOp {
  static constexpr int kDepth = 4;  // params, grads, state_sums, model_params
  static constexpr unsigned kReads = 0b0111;
  static constexpr unsigned kWrites = 0b1101;
  static constexpr int kModelList = 3;
  static constexpr bool kLeanState = false;
  template <typename Param, typename Grad, typename Model, typename State>
  using Storage = TypeList<Param, Grad, float, Model>;

  float lr, eps, weight_decay;
  bool adagrad_w_mode;
  const float* inv_scale_ptr = nullptr;
  float inv_scale = 1.f;

  MP_HD void resolve() {
    if (inv_scale_ptr != nullptr) inv_scale = *inv_scale_ptr;
  }
  template <typename V>
  MP_HD typename Lanes<V>::Flag apply(V* x) const {
    V p = x[0];
    V g = x[1] * inv_scale;
    if (weight_decay != 0.f && !adagrad_w_mode) g = g + weight_decay * p;
    const V sum = x[2] + g * g;
    V update = g / (Lanes<V>::sqrt(sum) + eps);
    if (weight_decay != 0.f && adagrad_w_mode) update = update + weight_decay * p;
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
    const V denom = x[3] / bias_correction2 + eps;
    V m;
    if (reg_inside_moment) {
      g = g / denom + weight_decay * p;
      m = x[2] * beta1_f + grad_weight * g;
      p = p - lr * (m / bias_correction1);
    } else {
      m = x[2] * beta1_f + grad_weight * g;
      p = p - lr * ((m / bias_correction1) / denom + weight_decay * p);
    }
    x[0] = p;
    x[2] = m;
    x[4] = p;
    return Lanes<V>::none();
  }
};

// fused_adam_'s step counter: incremented once per call, unless skipped.
MP_HD void increment_step(float* step, const float* found_inf) {
  if (found_inf == nullptr || *found_inf == 0.f) *step += 1.f;
}

struct LossScaleArgs {
  double growth_factor, backoff_factor, min_scale, max_scale;
  int32_t growth_interval, hysteresis;
};

// Dynamic loss scaling with hysteresis, a floor and a ceiling. Products are formed
// in double and rounded once to float, as torch's _amp_update_scale_ does.
MP_HD void update_loss_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
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

}  // namespace mixedprec
