// The drivers shared by every op entry (csrc/ops/*.h): the host-side driving of the
// pointwise functors (split the lists into groups of equal dtypes, pick the storage
// types, hand each group to the backend's engine: the run_* helpers), the argument
// checks the optimizers share, and the engine of calls without tensors.
//
// An Engine provides
//   template <typename Op, typename... Ts>
//   static void run(const Lists<sizeof...(Ts)>& lists, const Op& op,
//                   const float* skip, float* found_inf);
// which applies `op` to every element (list k stored as Ts[k]; an empty list is
// absent), writes nothing when *skip != 0, and sets *found_inf = 1 when any
// apply() reported a non-finite input; l2norm (the engine's own, not pointwise);
//   template <typename F, typename... Args>
//   static void run_single(Args... args);
// which runs F::apply(args...) once, in one thread on the device (the step counter's
// IncrementStep, the loss scale's UpdateLossScale); and Guard, which makes a device
// current.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pointwise.h"
#include "validate.h"

namespace mixedprec {

// An engine's lists: views of the call's lists (an op's Tensor[] arguments), or of
// tensors a driver holds (Groups: a split by dtype; widen_grads' copies).
template <int D>
using Lists = std::array<at::TensorList, D>;

// The groups of group_by_dtype: views, and the tensors of the groups a split made.
template <int D>
struct Groups {
  std::vector<Lists<D>> lists;
  std::deque<std::array<std::vector<at::Tensor>, D>> held;  // (a deque: views stay valid)
  auto begin() { return lists.begin(); }
  auto end() { return lists.end(); }
};

// Whether list storage T holds 8-bit codes with one scale per block (lanes.h's E4m3).
template <typename T>
constexpr bool kBlocked = std::is_same<T, E4m3>::value;

// How many of the lists stored as Ts are 8-bit.
template <typename... Ts>
constexpr int kBlockedLists = (static_cast<int>(kBlocked<Ts>) + ... + 0);

// The rank of list K among the 8-bit lists of Ts (0 for the others): where the CPU
// block pass keeps its values, and which scale list is its (scale_list).
template <size_t K, typename... Ts>
constexpr int block_rank() {
  constexpr bool blocked[] = {kBlocked<Ts>...};
  int rank = 0;
  for (size_t k = 0; k != K; ++k) rank += blocked[k] ? 1 : 0;
  return blocked[K] ? rank : 0;
}

// The list that holds the block scales of list K (8-bit, stored as Ts[K]):
// Op::kScaleList plus its rank among the 8-bit lists.
template <typename Op, size_t K, typename... Ts>
constexpr int scale_list() {
  return Op::kScaleList + block_rank<K, Ts...>();
}

// Whether a call tallies (pointwise.h): Op has a tally list and it is given.
template <typename Op, size_t D>
bool tallying(const std::array<at::TensorList, D>& lists) {
  return Tallies<Op>::list >= 0 && !lists[Tallies<Op>::list < 0 ? 0 : Tallies<Op>::list].empty();
}

#define MP_DISPATCH_FLOATS(TYPE, NAME, ALIAS, ...)                                      \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                        \
                     AT_PRIVATE_CASE_TYPE_USING_HINT(at::kFloat, ALIAS, __VA_ARGS__)    \
                         AT_PRIVATE_CASE_TYPE_USING_HINT(at::kHalf, ALIAS, __VA_ARGS__) \
                             AT_PRIVATE_CASE_TYPE_USING_HINT(at::kBFloat16, ALIAS, __VA_ARGS__))

// Splits parallel lists into groups whose tensors share a dtype per list (the
// order within a group is kept). Lists may be empty (absent); an empty first list gives
// no group. The usual call, one dtype per list, is one group of views of the lists
// themselves: no tensor is copied (nor its reference count touched).
template <int D>
Groups<D> group_by_dtype(const std::array<at::TensorList, D>& lists) {
  Groups<D> out;
  if (lists[0].empty()) return out;
  // The usual call, one dtype per list: one group, without a lookup per tensor.
  bool uniform = true;
  for (int k = 0; k < D && uniform; ++k) {
    for (const at::Tensor& t : lists[k]) {
      if (t.scalar_type() != lists[k][0].scalar_type()) {
        uniform = false;
        break;
      }
    }
  }
  if (uniform) {
    out.lists.push_back(lists);
    return out;
  }
  std::map<std::array<int, D>, std::array<std::vector<at::Tensor>, D>> groups;
  for (size_t i = 0; i < lists[0].size(); ++i) {
    std::array<int, D> key{};
    for (int k = 0; k < D; ++k) {
      key[k] = lists[k].empty() ? -1 : static_cast<int>(lists[k][i].scalar_type());
    }
    auto& group = groups[key];
    for (int k = 0; k < D; ++k) {
      if (!lists[k].empty()) group[k].push_back(lists[k][i]);
    }
  }
  for (auto& entry : groups) {
    const auto& held = out.held.emplace_back(std::move(entry.second));
    Lists<D>& views = out.lists.emplace_back();
    for (int k = 0; k < D; ++k) views[k] = held[k];
  }
  return out;
}

// Runs op on lists stored as Ts. A tallying functor (pointwise.h) learns here whether
// its params (list 0) are bf16: its `rounds_bf16`.
template <class Engine, typename Op, typename... Ts>
void run_types(TypeList<Ts...>, const Lists<sizeof...(Ts)>& lists, const Op& op,
               const float* skip) {
  if constexpr (Tallies<Op>::count > 0) {
    Op typed = op;
    typed.rounds_bf16 = std::is_same_v<std::tuple_element_t<0, std::tuple<Ts...>>, c10::BFloat16>;
    Engine::template run<Op, Ts...>(lists, typed, skip, nullptr);
  } else {
    Engine::template run<Op, Ts...>(lists, op, skip, nullptr);
  }
}

// The gradients' storage types the optimizers' kernels are built for: those autograd
// gives, of the dtype of `Own` (the params, or with fp32 masters the model copy), and
// fp32 (master gradients). Another dtype (gradients written by hand) runs as an fp32
// copy, which holds its values exactly: the same bits for one more pass over those
// gradients, and 174 CUDA kernels per architecture instead of 228.
template <typename Own, typename Grad>
constexpr bool kStoredGrad = std::is_same_v<Grad, Own> || std::is_same_v<Grad, float>;

// Makes group g's gradients fp32 copies (held in `copies`) where their dtype is not a
// stored one (kStoredGrad; `own`, the dtype of the params or of the model copy), and
// every list that holds the same tensors (the unscaled gradients, written) those copies
// too. Returns what the caller copies back once the kernel ran: (given, copy) pairs of
// the written gradients.
template <int D>
std::vector<std::pair<at::Tensor, at::Tensor>> widen_grads(Lists<D>& g, at::ScalarType own,
                                                           std::vector<at::Tensor>& copies) {
  std::vector<std::pair<at::Tensor, at::Tensor>> written;
  const at::ScalarType grad = g[1][0].scalar_type();
  if (grad == own || grad == at::kFloat) return written;
  const at::TensorList given = g[1];
  copies.reserve(given.size());
  for (const auto& t : given) copies.push_back(t.to(at::kFloat));
  for (int k = 2; k < D; ++k) {
    if (g[k].empty() || !g[k][0].is_same(given[0])) continue;
    for (size_t i = 0; i < g[k].size(); ++i) written.emplace_back(given[i], copies[i]);
    g[k] = copies;
  }
  g[1] = copies;
  return written;
}

// Optimizers: params in any float type and grads as kStoredGrad says (others are
// widened first); the state lists in fp32, or all in bf16 or all 8-bit (E4m3 codes
// with block scales from list Op::kScaleList on, lanes.h) where Op::kLeanState
// (validated before; list 2 tells which); the model copy, when present (list
// Op::kModelList), in any float type, and params are then fp32 masters (validated
// before). Where Op::kLeanState, list Op::kCompList holds bf16 Kahan compensations or
// int16 remainders (bf16 params, no model copy: validated).
template <class Engine, typename Op>
void run_optimizer(const std::array<at::TensorList, Op::kDepth>& lists, const Op& op,
                   const float* skip) {
  constexpr int D = Op::kDepth;
  for (auto& g : group_by_dtype<D>(lists)) {
    const bool has_model = !g[Op::kModelList].empty();
    std::vector<at::Tensor> widened;  // (the fp32 copies the group then views)
    const auto written =
        widen_grads<D>(g, (has_model ? g[Op::kModelList][0] : g[0][0]).scalar_type(), widened);
    const bool bf16_state = !g[2].empty() && g[2][0].scalar_type() == at::kBFloat16;
    const bool fp8_state = !g[2].empty() && g[2][0].scalar_type() == at::kFloat8_e4m3fn;
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "mixedprec optimizer", param_t, [&] {
      MP_DISPATCH_FLOATS(g[1][0].scalar_type(), "mixedprec optimizer", grad_t, [&] {
        auto run = [&](auto state_tag) {
          using state_t = decltype(state_tag);
          if (!has_model) {
            if constexpr (kStoredGrad<param_t, grad_t>) {
              using Types = typename Op::template Storage<param_t, grad_t, float, state_t>;
              run_types<Engine>(Types{}, g, op, skip);
            }
            return;
          }
          MP_DISPATCH_FLOATS(
              g[Op::kModelList][0].scalar_type(), "mixedprec optimizer", model_t, [&] {
                if constexpr (std::is_same_v<param_t, float> && kStoredGrad<model_t, grad_t>) {
                  using Types = typename Op::template Storage<float, grad_t, model_t, state_t>;
                  run_types<Engine>(Types{}, g, op, skip);
                }
              });
        };
        if constexpr (Op::kLeanState) {
          const auto& comps = g[Op::kCompList];
          if (!comps.empty() && comps[0].scalar_type() == at::kShort) {
            if constexpr (std::is_same_v<param_t, c10::BFloat16> && kStoredGrad<param_t, grad_t>) {
              auto run_remainders = [&](auto state_tag) {
                using Types = typename Op::template Storage<param_t, grad_t, float,
                                                            decltype(state_tag), int16_t>;
                run_types<Engine>(Types{}, g, op, skip);
              };
              if (fp8_state) return run_remainders(E4m3{});
              if (bf16_state) return run_remainders(c10::BFloat16{});
              run_remainders(float{});
            }
            return;
          }
          if (fp8_state) return run(E4m3{});
          if (bf16_state) return run(c10::BFloat16{});
        }
        run(float{});
      });
    });
    for (const auto& [given, copy] : written) given.copy_(copy);
  }
}

// Stochastic rounding (sr_seed given) writes bf16 params directly: no masters, no
// kahan_comps; its salts are one contiguous int64 tensor of 4 words per param (salt,
// offset, run, stride: pointwise.h's RoundingWords; the salt below 2^32, offset >= 0,
// run and stride 0 or > 0: the caller's to keep, as the values are on the device).
// Without it, no salts. Stochastic rounding of 8-bit state (state_seed given:
// state_stochastic) takes the same salts, with any params.
inline void check_stochastic(Checker& c, const char* op, at::TensorList params,
                             at::TensorList model_params, at::TensorList kahan_comps,
                             at::TensorList salts, bool stochastic, bool state_stochastic = false) {
  if (!stochastic && !state_stochastic) {
    TORCH_CHECK_VALUE(salts.empty(), op,
                      ": expected sr_salts to be empty without sr_seed (or state_seed), "
                      "got ",
                      salts.size(), " tensors");
    return;
  }
  c.per_tensor(salts, "sr_salts", params, "params", RoundingWords::kWords);
  if (!stochastic) return;
  TORCH_CHECK_VALUE(kahan_comps.empty() && model_params.empty(), op,
                    ": sr_seed: stochastic rounding writes bf16 params directly, expected no "
                    "model_params and no kahan_comps, got ",
                    model_params.size(), " and ", kahan_comps.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_TYPE(params[i].scalar_type() == at::kBFloat16, op,
                     ": sr_seed: stochastic rounding expected bfloat16 params, got ",
                     params[i].scalar_type(), " at params[", i, "]");
  }
}

// The precision report's tallies (pointwise.h): none, or for each param one contiguous
// float64 tensor of `words` elements, written; fp16 params without masters are refused
// (the report knows the rounding of bf16 params, fp32 ones and masters only).
inline void check_tallies(Checker& c, const char* op, const std::optional<at::TensorList>& tallies,
                          int64_t words, at::TensorList params, at::TensorList model_params) {
  if (!tallies.has_value()) return;
  c.per_tensor(*tallies, "precision_tallies", params, "params", words, kF64, Access::kWrite);
  for (size_t i = 0; model_params.empty() && i < params.size(); ++i) {
    TORCH_CHECK_TYPE(params[i].scalar_type() != at::kHalf, op,
                     ": precision_tallies: the precision report expected bfloat16 or float32 "
                     "params (or fp32 masters with model_params), got float16 at params[",
                     i, "]");
  }
}

// The engine of calls that hold no tensor at all (empty lists, optional tensors
// absent), which the dispatcher sends to the CompositeExplicitAutograd kernel: such
// calls are validated and have nothing to run. That kernel also stands in for any
// backend without a kernel of its own; data there is refused, not touched.
struct NoTensorEngine {
  struct Guard {
    explicit Guard(const at::Device&) {}
  };

  [[noreturn]] static void unsupported() {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "mixedprec: no kernel for this device (CPU, CUDA)");
  }
  template <typename Op, typename... Ts>
  static void run(const Lists<sizeof...(Ts)>&, const Op&, const float*, float*) {
    unsupported();
  }
  static std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList, const float*, bool, at::Device) {
    unsupported();
  }
  template <typename F, typename... Args>
  static void run_single(Args...) {
    unsupported();
  }
};

}  // namespace mixedprec
