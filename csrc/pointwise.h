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
// A functor may also declare `kTallyList` and `kTallies`: a per-tensor list stored as
// float64 (x[k] reads 0 there) of kTallies + 1 sums per tensor that the call adds to,
// such as AdamOp's precision report. The engines then call apply(x, index, tally), with
// `tally` their running sums of apply's value type (zeroed per CPU pass and per CUDA
// thread), or null when the list is absent; apply adds its element's kTallies values
// to tally[0..kTallies-1] when it is not null. The engine adds the sums (fp32 within a
// CPU pass or a CUDA thread, then float64) to the tensor's words 0..kTallies-1, and the
// number of elements it applied op to to word kTallies: a CPU call's chunks in order,
// a CUDA block's warps by atomicAdd. A skipped call tallies nothing. Both engines run a
// tallying call in a counting copy of its Fixed mode, or in the functor's generic code
// (in_counted_mode, below), so that the loops and kernels of its FixedModes hold none of
// it.
//
// A functor that declares `kNeedsIndex = true` gets apply(x, index) instead, where
// index is the element's position within its tensor (for a CPU vector, that of its
// first lane, a multiple of the vector's width; lane j is index + j): stochastic
// rounding draws its bits from it (a CPU vector, 8 lanes per Philox call). It does
// not depend on how an engine splits the tensor into chunks or threads. (The CUDA
// engine's Fixed kernels of stochastic rounding pass a DrawnBits instead, the bits it
// drew for the element with its whole vector: apply takes the index's type
// as a template parameter and hands it on to Lanes<float>::round_bf16_stochastic.)
//
// Such a functor may also declare `FixedModes`, a TypeList of its common modes (see
// AdamOp::Mode): both engines compile it once per mode, with the mode's flags as
// constants and its lists known present or absent (Fixed, below; the CPU engine's
// vector loops, the CUDA engine's kernels), and keep the generic code for the other
// modes. The bits are the same.
//
// The functors are in pointwise_lists.h (the list ops: unscale, finite check, copy),
// pointwise_adam.h (AdamOp) and pointwise_optimizers.h (SGD, LAMB, Adagrad, NovoGrad),
// each included by the registration units of its family only (csrc/ops/unit.h): an edit
// of one rebuilds those units, not every one.
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

// Op::kTallyList and Op::kTallies (see above), or -1 and 0 when Op does not tally.
template <typename Op, typename = void>
struct Tallies {
  static constexpr int list = -1;
  static constexpr int count = 0;
};
template <typename Op>
struct Tallies<Op, std::void_t<decltype(Op::kTallyList)>> {
  static constexpr int list = Op::kTallyList;
  static constexpr int count = Op::kTallies;
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

// x / d, for a d that is the same for every element (a bias correction, a clip factor):
// on the CPU without the division where d is exactly 1, which leaves x as it is. A bias
// correction 1 - beta^step rounds to 1 in float from step 165 at beta 0.9 and 17,321 at
// 0.999 (its square root, Adam's and NovoGrad's, from 16,628), and is 1 without bias
// correction; a clip factor is 1 where nothing is clipped. The CPU loops are bound by
// the divider there (Zen 3: 3.8 cycles a vdivps; bench/README.md, "A long run's
// steps"); the GPU's step is bound by memory, and its kernels divide as before.
template <typename V>
MP_HD V divided(const V& x, float d) {
#if !defined(__CUDA_ARCH__)
  if (d == 1.f) return x;
#endif
  return x / d;
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
// `index` may also be a DrawnBits (philox.h): the element's stochastic rounding bits,
// drawn by the CUDA engine for a vector at once (DrawsPerVector below), or the CPU's
// DrawnVector (cpu/vec_pair.h); the functor hands it on to Lanes<V>.
template <typename Op, typename V, typename Index>
MP_HD auto apply_at(const Op& op, V* x, Index index) {
  if constexpr (NeedsIndex<Op>::value) {
    return op.apply(x, index);
  } else {
    (void)index;
    return op.apply(x);
  }
}

// op.apply on x with the engine's running sums `tally` (null: not tallying) where Op
// tallies (see above); else as above, without them.
template <typename Op, typename V, typename Index>
MP_HD auto apply_at(const Op& op, V* x, Index index, V* tally) {
  if constexpr (Tallies<Op>::count > 0) {
    return op.apply(x, index, tally);
  } else {
    (void)tally;
    return apply_at(op, x, index);
  }
}

// Whether list K of Op is a per-tensor list.
template <typename Op, size_t K>
constexpr bool kPerTensorList = ((per_tensor_mask<Op>() >> K) & 1u) != 0;

// Whether list K of Op may be stored as T: any type for a list of elements, fp32 or
// int64 for a per-tensor list, float64 for the tally list (see above).
template <typename Op, size_t K, typename T>
constexpr bool kPerTensorStorageOk =
    !kPerTensorList<Op, K> || std::is_same<T, float>::value || std::is_same<T, int64_t>::value ||
    (static_cast<int>(K) == Tallies<Op>::list && std::is_same<T, double>::value);

// Op in mode M, one of Op::FixedModes (see above): M's flags are constants in apply,
// so that the compiler drops what the other modes do, and the engines neither load
// nor store the lists outside M::kLists and M::kMaybe. The CPU engine's vector passes
// also skip the null tests of the lists in kPresent (cpu/engine.h); the CUDA engine
// launches one kernel per mode (cuda/multi_tensor_apply.cuh), whose absent lists and
// other modes' paths then take no registers and no instructions.
//
// Fixed<Op, M, true> is the same with the precision report's counting (the tallies
// above): the CUDA engine's kernel for a counted call in mode M (the kernels of
// Fixed<Op, M> hold none of it; multi_tensor_block.cuh's launch_as).
template <typename Op, typename M, bool Counting = false>
struct Fixed : Op {
  using Mode = M;
  static constexpr unsigned kReads = Op::kReads & (M::kLists | M::kMaybe | per_tensor_mask<Op>());
  static constexpr unsigned kWrites = Op::kWrites & (M::kLists | M::kMaybe);
  static constexpr unsigned kPresent = M::kLists & ~per_tensor_mask<Op>();
  static constexpr int kMinBlocks = Counting ? M::kCountingMinBlocks : M::kMinBlocks;
  explicit Fixed(const Op& op) : Op(op) {}
  template <typename V, typename Index>
  MP_HD auto apply(V* x, Index index) const {
    Op op = *this;
    M::fix(op);
    return op.apply(x, index);
  }
  template <typename V, typename Index>
  MP_HD auto apply(V* x, Index index, V* tally) const {
    Op op = *this;
    M::fix(op);
    return op.apply(x, index, tally);
  }
};

// Whether Op is a Fixed<Op, M>.
template <typename Op>
struct IsFixed : std::false_type {};
template <typename Op, typename M, bool Counting>
struct IsFixed<Fixed<Op, M, Counting>> : std::true_type {};
// Whether Op is a counting Fixed<Op, M, true>.
template <typename Op>
struct IsCounting : std::false_type {};
template <typename Op, typename M>
struct IsCounting<Fixed<Op, M, true>> : std::true_type {};

// Whether Op is a Fixed mode whose params round stochastically (LeanMode's
// kStochastic: AdamW's and SGD's "stochastic"): the CUDA engine then draws the bits of
// a vector's elements at once (multi_tensor_block.cuh's apply_vector, lanes.h's
// vector_bits), one Philox call per vector where the functor's own rounding_bits makes
// one per element, and hands each element its bits (DrawnBits); the CPU engine's
// AVX-512 and AVX2 passes draw several vectors' bits per call (two on AVX-512, eight on
// AVX2, in its 8-bit block pass too: cpu/vec_pair.h's PairedDraws, cpu/engine.h's
// apply_drawn).
template <typename Op, typename = void>
struct DrawsPerVector : std::false_type {};
template <typename Op>
struct DrawsPerVector<Op, std::enable_if_t<IsFixed<Op>::value>>
    : std::bool_constant<Op::Mode::kStochastic> {};

// Whether Op declares FixedModes.
template <typename Op, typename = void>
struct HasFixedModes : std::false_type {};
template <typename Op>
struct HasFixedModes<Op, std::void_t<typename Op::FixedModes>> : std::true_type {};

// The common modes of the optimizers with lean precision, AdamOp and SgdOp (their
// FixedModes, each Op::Mode an alias of LeanMode<Op, ...>): no master (Model false) or
// fp32 masters with a model copy (Model true); kahan, remainder or stochastic; fp32 or
// bf16 state, or 8-bit state (Eight: the op's 8-bit flags, as the optimizers give
// them) with its block scales; the unscaled grads written back or not; all without
// maximize and without what Op::plain refuses (AdamOp's amsgrad). Op declares the
// lists each mode has (kStateLists: params, grads and the state), the model copy's,
// the comps', the 8-bit scales' (kEightLists) and the unscaled grads' (kUnscaledList),
// plain/make_plain for its own flags, and fixed_min_blocks.
// fits<Ts...>() says whether storage Ts (Storage's order) can be in the mode: the
// gradients as autograd gives them, of the params' dtype, or with fp32 masters of the
// model copy's or fp32 (master gradients). fp32 gradients of bf16 or fp16 params take
// the generic code: the same bits, slower (other dtypes are not built at all:
// run_optimizer widens them to fp32, dispatch.h's kStoredGrad). It also leaves out the
// storage a call in the mode cannot have, so that neither engine compiles a loop that
// never runs (42 of 243 CUDA kernels per architecture did): a mode without masters has
// no model copy (run_optimizer's Model type is then float, a placeholder), fp32 masters
// are of a narrower model copy (fp32 model params run the generic code), and Kahan
// compensations are bf16, of bf16 params (validate.cpp's check_kahan_comps).
template <typename Op, bool Model, bool Kahan, bool Remainder, bool Stochastic, bool Eight>
struct LeanMode {
  static constexpr unsigned kLists = Op::kStateLists | (Model ? 1u << Op::kModelList : 0u) |
                                     (Kahan || Remainder ? 1u << Op::kCompList : 0u) |
                                     (Eight ? Op::kEightLists : 0u);
  static constexpr unsigned kMaybe = 1u << Op::kUnscaledList;
  static constexpr bool kStochastic = Stochastic;
  // The functor leaves the params (list 0) rounded to their bf16 storage already ("remainder",
  // "stochastic"): the CPU engine's AVX2 passes store them without rounding them again
  // (cpu/engine.h's stored_rounded).
  static constexpr bool kRoundedParams = Remainder || Stochastic;
  // CUDA: blocks of 512 threads per SM that the mode's kernel, and its counting kernel
  // (counts, below), are compiled for: two at most 64 registers a thread, one where
  // that would spill (Op::fixed_min_blocks says which).
  static constexpr int kMinBlocks = Op::fixed_min_blocks(false, Kahan, Stochastic, Eight);
  static constexpr int kCountingMinBlocks = Op::fixed_min_blocks(true, Kahan, Stochastic, Eight);
  template <typename... Ts>
  static constexpr bool fits() {
    using Param = std::tuple_element_t<0, std::tuple<Ts...>>;
    using Grad = std::tuple_element_t<1, std::tuple<Ts...>>;
    using State = std::tuple_element_t<2, std::tuple<Ts...>>;
    using Copy = std::tuple_element_t<Op::kModelList, std::tuple<Ts...>>;
    using Comp = std::tuple_element_t<Op::kCompList, std::tuple<Ts...>>;
    return Model != std::is_same_v<Copy, float> &&
           (Model ? std::is_same_v<Grad, Copy> || std::is_same_v<Grad, float>
                  : std::is_same_v<Grad, Param>) &&
           (!Model || std::is_same_v<Param, float>) &&
           (!(Kahan || Stochastic) || std::is_same_v<Param, c10::BFloat16>) &&
           (Remainder == std::is_same_v<Comp, int16_t>) && (Eight == std::is_same_v<State, E4m3>);
  }
  // Whether a counted call (the precision report) in this mode on storage Ts runs a
  // CUDA kernel of its own (Fixed<Op, Mode, true>, multi_tensor_block.cuh's launch_as)
  // rather than the generic kernel: bf16 params without masters or remainders, whose
  // updates the report is for (the other modes lose none and count in the generic
  // kernel).
  template <typename... Ts>
  static constexpr bool counts() {
    using Param = std::tuple_element_t<0, std::tuple<Ts...>>;
    return !Model && !Remainder && std::is_same_v<Param, c10::BFloat16>;
  }
  MP_HD static bool holds(const Op& op) {
    return op.kahan == Kahan && op.remainder == Remainder && op.stochastic == Stochastic &&
           op.state_stochastic == Eight && !op.maximize && Op::plain(op, Eight);
  }
  MP_HD static void fix(Op& op) {
    op.kahan = Kahan;
    op.remainder = Remainder;
    op.stochastic = Stochastic;
    op.state_stochastic = Eight;
    op.maximize = false;
    Op::make_plain(op, Eight);
  }
};

// The ten FixedModes of an optimizer with lean precision: no master, fp32 masters,
// kahan, remainder and stochastic rounding, each with fp32 or bf16 state and with
// 8-bit state.
template <template <bool, bool, bool, bool, bool> class Mode>
using LeanModes =
    TypeList<Mode<false, false, false, false, false>, Mode<true, false, false, false, false>,
             Mode<false, true, false, false, false>, Mode<false, false, true, false, false>,
             Mode<false, false, false, true, false>, Mode<false, false, false, false, true>,
             Mode<true, false, false, false, true>, Mode<false, true, false, false, true>,
             Mode<false, false, true, false, true>, Mode<false, false, false, true, true>>;

// bad = f(Fixed<Op, M>(op)) when storage Ts fit mode M, op holds it and the lists
// present (mask `lists`) are M's, M::kMaybe aside; whether it did.
template <typename M, typename... Ts, typename Op, typename F>
bool try_mode(const Op& op, unsigned lists, F& f, int& bad) {
  if constexpr (M::template fits<Ts...>()) {
    if (M::holds(op) && (lists & ~M::kMaybe) == Fixed<Op, M>::kPresent) {
      bad = f(Fixed<Op, M>(op));
      return true;
    }
  }
  return false;
}

template <typename... Ts, typename Op, typename F, typename... M>
int first_mode(const Op& op, unsigned lists, F& f, TypeList<M...>) {
  lists &= ~per_tensor_mask<Op>();
  int bad = 0;
  return (try_mode<M, Ts...>(op, lists, f, bad) || ...) ? bad : f(op);
}

// f(op) as a Fixed in the first of Op's FixedModes that it is in (storage Ts, its
// flags, and `lists`, the mask of the lists present), else f(op): one loop or kernel
// per common mode, without the tests of the others. f returns an int (the CPU
// engine's "saw a non-finite input"), returned.
template <typename... Ts, typename Op, typename F>
int in_fixed_mode(const Op& op, unsigned lists, F&& f) {
  if constexpr (HasFixedModes<Op>::value) {
    return first_mode<Ts...>(op, lists, f, typename Op::FixedModes{});
  } else {
    (void)lists;
    return f(op);
  }
}

// Whether the loop of Op sums its tallies: Op tallies and is its generic code or a
// counting Fixed<Op, M, true> (in_counted_mode); a Fixed<Op, M> holds none of it.
template <typename Op>
constexpr bool kTallied = Tallies<Op>::count > 0 && (!IsFixed<Op>::value || IsCounting<Op>::value);

// f(functor) for what a call of op runs as, both engines: in_fixed_mode's choice, but
// a call that tallies (`counted`: the precision report) runs Fixed<Op, M, true> where
// M::counts<Ts...>(), else op itself, whose generic loop counts. So the loops and
// kernels of Fixed<Op, M>, which the calls without the report run, hold none of the
// counting (on Zen 3, AdamW's CPU step in the lean modes 3-10% faster:
// bench/README.md).
template <typename... Ts, typename Op, typename F>
int in_counted_mode(const Op& op, unsigned lists, bool counted, F&& f) {
  return in_fixed_mode<Ts...>(op, lists, [&](const auto& functor) {
    using Functor = std::decay_t<decltype(functor)>;
    if constexpr (IsFixed<Functor>::value) {
      using M = typename Functor::Mode;
      if (counted) {
        if constexpr (M::template counts<Ts...>()) return f(Fixed<Op, M, true>(op));
        return f(op);
      }
    }
    return f(functor);
  });
}

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

// The precision report, an option of SgdOp and AdamOp (their `report`: pointwise.h's
// tallies, kTallies = 3): one element's part, added to tally[0..2]: 1 when its update
// was lost (the value the next step reads back, `kept`, equals `start`, the value the
// step started from, though the fp32 result p differs), the square of the lost part
// (p - kept) and that of the applied part (kept - start). kept is p rounded to bf16
// (`rounds`: bf16 params without remainders), the stochastically rounded param
// (`stochastic`: `param`, as stored), the bf16 param plus its bf16 compensation
// (`kahan`: the new compensation `comp`, rounded as stored), or p itself (fp32 params,
// masters, remainders: nothing is lost).
template <typename V>
MP_HD void tally_update(V* tally, const V& start, const V& p, const V& param, const V& comp,
                        bool stochastic, bool kahan, bool rounds) {
  V kept = p;
  if (stochastic) {
    kept = param;
  } else if (kahan) {
    kept = Lanes<V>::round_bf16(p) + Lanes<V>::round_bf16(comp);
  } else if (rounds) {
    kept = Lanes<V>::round_bf16(p);
  }
  const V lost = p - kept, applied = kept - start;
  tally[0] = Lanes<V>::count_zero_nonzero(tally[0], applied, lost);
  tally[1] = Lanes<V>::mul_add(lost, lost, tally[1]);
  tally[2] = Lanes<V>::mul_add(applied, applied, tally[2]);
}

// Options shared by SgdOp and AdamOp, as torch.optim has them:
// - maximize: the gradient is negated after the unscale, before anything else uses it.
// - the unscaled gradient (grad * inv_scale, not negated) is written to the last
//   list, when present: the grads themselves, so that they hold what torch's fused
//   optimizers leave in p.grad after a GradScaler step (unscale_grads).
// - the learning rate is `lr`, or the float at lr_ptr (a device tensor, read by
//   resolve()) when set, so that a captured CUDA graph follows a scheduler.

// The optimizers' step counter: incremented once per call, unless skipped. A
// one-thread function (Engine::run_single); the loss scale's is in pointwise_lists.h.
struct IncrementStep {
  MP_HD static void apply(float* step, const float* found_inf) {
    if (found_inf == nullptr || *found_inf == 0.f) *step += 1.f;
  }
};

}  // namespace mixedprec
