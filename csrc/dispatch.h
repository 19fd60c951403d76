// The op entries shared by both backends, and the host-side driving of the
// pointwise functors: split the lists into groups of equal dtypes, pick the
// storage types, and hand each group to the backend's engine.
//
// An Engine provides
//   template <typename Op, typename... Ts>
//   static void run(const Lists<sizeof...(Ts)>& lists, const Op& op,
//                   const float* skip, float* found_inf);
// which applies `op` to every element (list k stored as Ts[k]; an empty list is
// absent), writes nothing when *skip != 0, and sets *found_inf = 1 when any
// apply() reported a non-finite input; increment_step and update_loss_scale,
// which run the functions of pointwise.h of that name on the device; and Guard,
// which makes a device current.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <tuple>
#include <type_traits>
#include <vector>

#include "pointwise.h"
#include "validate.h"

namespace mixedprec {

template <int D>
using Lists = std::array<std::vector<at::Tensor>, D>;

#define MP_DISPATCH_FLOATS(TYPE, NAME, ALIAS, ...)                             \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                               \
                     AT_PRIVATE_CASE_TYPE_USING_HINT(at::kFloat, ALIAS, __VA_ARGS__) \
                     AT_PRIVATE_CASE_TYPE_USING_HINT(at::kHalf, ALIAS, __VA_ARGS__)  \
                     AT_PRIVATE_CASE_TYPE_USING_HINT(at::kBFloat16, ALIAS, __VA_ARGS__))

// Splits parallel lists into groups whose tensors share a dtype per list (the
// order within a group is kept). Lists may be empty (absent); the first is not.
template <int D>
std::vector<Lists<D>> group_by_dtype(const std::array<at::TensorList, D>& lists) {
  std::map<std::array<int, D>, Lists<D>> groups;
  for (size_t i = 0; i < lists[0].size(); ++i) {
    std::array<int, D> key{};
    for (int k = 0; k < D; ++k) {
      key[k] = lists[k].empty() ? -1 : static_cast<int>(lists[k][i].scalar_type());
    }
    Lists<D>& group = groups[key];
    for (int k = 0; k < D; ++k) {
      if (!lists[k].empty()) group[k].push_back(lists[k][i]);
    }
  }
  std::vector<Lists<D>> out;
  for (auto& entry : groups) out.push_back(std::move(entry.second));
  return out;
}

template <class Engine>
void run_scale(at::TensorList src, at::TensorList dst, const float* inv_scale,
               float* found_inf) {
  ScaleOp op;
  op.inv_scale_ptr = inv_scale;
  for (const auto& g : group_by_dtype<2>({src, dst})) {
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "multi_tensor_scale", src_t, [&] {
      MP_DISPATCH_FLOATS(g[1][0].scalar_type(), "multi_tensor_scale", dst_t, [&] {
        Engine::template run<ScaleOp, src_t, dst_t>(g, op, nullptr, found_inf);
      });
    });
  }
}

template <class Engine>
void run_check_finite(at::TensorList tensors, float* found_inf) {
  for (const auto& g : group_by_dtype<1>({tensors})) {
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "multi_tensor_check_finite_", scalar_t, [&] {
      Engine::template run<CheckFiniteOp, scalar_t>(g, CheckFiniteOp{}, nullptr, found_inf);
    });
  }
}

template <class Engine, typename Op, typename... Ts>
void run_types(TypeList<Ts...>, const Lists<sizeof...(Ts)>& lists, const Op& op,
               const float* skip) {
  Engine::template run<Op, Ts...>(lists, op, skip, nullptr);
}

// Optimizers: params and grads in any float type; the state lists in fp32, or all
// in bf16 where Op::kLeanState (validated before; list 2 tells which); the model copy,
// when present (list Op::kModelList), in any float type, and params are then fp32
// masters (validated before).
template <class Engine, typename Op>
void run_optimizer(const std::array<at::TensorList, Op::kDepth>& lists, const Op& op,
                   const float* skip) {
  constexpr int D = Op::kDepth;
  for (const auto& g : group_by_dtype<D>(lists)) {
    const bool has_model = !g[Op::kModelList].empty();
    const bool bf16_state = !g[2].empty() && g[2][0].scalar_type() == at::kBFloat16;
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "mixedprec optimizer", param_t, [&] {
      MP_DISPATCH_FLOATS(g[1][0].scalar_type(), "mixedprec optimizer", grad_t, [&] {
        auto run = [&](auto state_tag) {
          using state_t = decltype(state_tag);
          if (!has_model) {
            using Types = typename Op::template Storage<param_t, grad_t, float, state_t>;
            run_types<Engine>(Types{}, g, op, skip);
            return;
          }
          MP_DISPATCH_FLOATS(g[Op::kModelList][0].scalar_type(), "mixedprec optimizer",
                             model_t, [&] {
            if constexpr (std::is_same_v<param_t, float>) {
              using Types = typename Op::template Storage<float, grad_t, model_t, state_t>;
              run_types<Engine>(Types{}, g, op, skip);
            }
          });
        };
        if constexpr (Op::kLeanState) {
          if (bf16_state) return run(c10::BFloat16{});
        }
        run(float{});
      });
    });
  }
}

// LAMB's stages (pointwise.h). Stage 1 reads params and grads in any float type and
// writes fp32 moments and updates; stage 2 writes the params and, when present, the
// model copy (params are then fp32 masters, validated before).
template <class Engine>
void run_lamb_stage1(const std::array<at::TensorList, 5>& lists, const LambStage1Op& op,
                     const float* skip) {
  for (const auto& g : group_by_dtype<5>(lists)) {
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "fused_lamb_", param_t, [&] {
      MP_DISPATCH_FLOATS(g[1][0].scalar_type(), "fused_lamb_", grad_t, [&] {
        Engine::template run<LambStage1Op, param_t, grad_t, float, float, float>(g, op, skip,
                                                                                nullptr);
      });
    });
  }
}

template <class Engine>
void run_lamb_stage2(const std::array<at::TensorList, 5>& lists, const LambStage2Op& op,
                     const float* skip) {
  for (const auto& g : group_by_dtype<5>(lists)) {
    const bool has_model = !g[2].empty();
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "fused_lamb_", param_t, [&] {
      if (!has_model) {
        Engine::template run<LambStage2Op, param_t, float, float, float, float>(g, op, skip,
                                                                               nullptr);
        return;
      }
      MP_DISPATCH_FLOATS(g[2][0].scalar_type(), "fused_lamb_", model_t, [&] {
        if constexpr (std::is_same_v<param_t, float>) {
          Engine::template run<LambStage2Op, float, float, model_t, float, float>(g, op, skip,
                                                                                 nullptr);
        }
      });
    });
  }
}

// Stochastic rounding (sr_seed given) writes bf16 params directly: no masters, no
// kahan_comps; its salts are one fp32 value per param (an integer below 2^24, so
// that the counter word it fills is exact: the caller's to keep, as the values are
// on the device). Without it, no salts.
inline void check_stochastic(Checker& c, const char* op, at::TensorList params,
                             at::TensorList model_params, at::TensorList kahan_comps,
                             at::TensorList salts, bool stochastic) {
  if (!stochastic) {
    TORCH_CHECK_VALUE(salts.empty(), op, ": expected sr_salts to be empty without sr_seed, "
                      "got ", salts.size(), " tensors");
    return;
  }
  c.per_tensor(salts, "sr_salts", params, "params");
  TORCH_CHECK_VALUE(kahan_comps.empty() && model_params.empty(), op,
                    ": sr_seed: stochastic rounding writes bf16 params directly, expected no "
                    "model_params and no kahan_comps, got ", model_params.size(), " and ",
                    kahan_comps.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_TYPE(params[i].scalar_type() == at::kBFloat16, op,
                     ": sr_seed: stochastic rounding expected bfloat16 params, got ",
                     params[i].scalar_type(), " at params[", i, "]");
  }
}

// --- The op entries --------------------------------------------------------------
// Each checks its arguments before anything is written, makes the data's device
// current, and runs on the engine. Signatures follow the schemas in ops.cpp.
namespace entry {

template <class Engine>
void multi_tensor_unscale_(at::TensorList tensors, const at::Tensor& found_inf,
                           const at::Tensor& inv_scale) {
  Checker c("multi_tensor_unscale_");
  c.scalar(found_inf, "found_inf", at::kFloat, Access::kWrite);
  c.scalar(inv_scale, "inv_scale", at::kFloat);
  c.list(tensors, "tensors", kFloats, Access::kWrite);
  c.no_overlap();
  const typename Engine::Guard guard(found_inf.device());
  run_scale<Engine>(tensors, tensors, inv_scale.const_data_ptr<float>(),
                    found_inf.data_ptr<float>());
}

template <class Engine>
void multi_tensor_unscale_to_(at::TensorList src, at::TensorList dst,
                              const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  Checker c("multi_tensor_unscale_to_");
  c.scalar(found_inf, "found_inf", at::kFloat, Access::kWrite);
  c.scalar(inv_scale, "inv_scale", at::kFloat);
  c.list(src, "src", kFloats, Access::kRead, /*twins=*/dst);
  c.list(dst, "dst", kFloats, Access::kWrite);
  c.paired(src, "src", dst, "dst");
  c.no_overlap();
  const typename Engine::Guard guard(found_inf.device());
  run_scale<Engine>(src, dst, inv_scale.const_data_ptr<float>(), found_inf.data_ptr<float>());
}

template <class Engine>
void multi_tensor_check_finite_(at::TensorList tensors, const at::Tensor& found_inf) {
  Checker c("multi_tensor_check_finite_");
  c.scalar(found_inf, "found_inf", at::kFloat, Access::kWrite);
  c.list(tensors, "tensors", kFloats);
  c.no_overlap();
  const typename Engine::Guard guard(found_inf.device());
  run_check_finite<Engine>(tensors, found_inf.data_ptr<float>());
}

template <class Engine>
void multi_tensor_copy_(at::TensorList src, at::TensorList dst) {
  Checker c("multi_tensor_copy_");
  c.list(src, "src", kFloats, Access::kRead, /*twins=*/dst);
  c.list(dst, "dst", kFloats, Access::kWrite);
  c.paired(src, "src", dst, "dst");
  c.no_overlap();
  if (src.empty()) return;
  const typename Engine::Guard guard(src[0].device());
  run_scale<Engine>(src, dst, nullptr, nullptr);
}

template <class Engine>
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors,
                                                       const std::optional<at::Tensor>& inv_scale,
                                                       bool per_tensor) {
  Checker c("multi_tensor_l2norm");
  c.optional_scalar(inv_scale, "inv_scale");
  c.list(tensors, "tensors", kFloats);
  if (tensors.empty() && !inv_scale.has_value()) {
    // No tensor to take a device from (the dispatcher sends this call to the
    // CompositeExplicitAutograd kernel): the norm of nothing, on the CPU.
    const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
    return {at::zeros({1}, options), at::empty({0}, options)};
  }
  const at::Device device = tensors.empty() ? inv_scale->device() : tensors[0].device();
  const typename Engine::Guard guard(device);
  return Engine::l2norm(tensors, optional_ptr(inv_scale), per_tensor, device);
}

// sr_seed, when given, turns on stochastic rounding of the bf16 params (pointwise.h),
// keyed by the seed and `step`, a device step count then required, read (the caller
// advances it: one optimizer step may take two calls), with one salt per param.
// maximize negates the unscaled gradient; lr_tensor, when given, holds the learning
// rate on the device and replaces `lr`; unscale_grads writes grad * inv_scale back
// into the grads (nothing without an inv_scale: they are unscaled already).
template <class Engine>
void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList model_params, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool first_run,
                const std::optional<at::Tensor>& inv_scale,
                const std::optional<at::Tensor>& found_inf, bool wd_after_momentum = false,
                std::optional<at::TensorList> kahan_comps = std::nullopt,
                std::optional<at::TensorList> sr_salts = std::nullopt,
                std::optional<int64_t> sr_seed = std::nullopt,
                const std::optional<at::Tensor>& step = std::nullopt, bool maximize = false,
                const std::optional<at::Tensor>& lr_tensor = std::nullopt,
                bool unscale_grads = false) {
  const at::TensorList comps = kahan_comps.value_or(at::TensorList{});
  const at::TensorList salts = sr_salts.value_or(at::TensorList{});
  Checker c("fused_sgd_");
  c.optional_scalar(step, "step");
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  c.optional_scalar(lr_tensor, "lr_tensor");
  check_params(c, params, grads, model_params, unscale_grads ? Access::kWrite : Access::kRead);
  check_kahan_comps(c, params, model_params, comps);
  check_stochastic(c, "fused_sgd_", params, model_params, comps, salts,
                   sr_seed.has_value());
  TORCH_CHECK_VALUE(!sr_seed.has_value() || step.has_value(),
                    "fused_sgd_: expected a step tensor with sr_seed (stochastic rounding "
                    "keys its bits by the step), got None");
  if (momentum != 0) {
    c.list(momentum_buffers, "momentum_buffers", kF32 | kBF16, Access::kWrite);
    c.paired(params, "params", momentum_buffers, "momentum_buffers");
  } else {
    TORCH_CHECK_VALUE(momentum_buffers.empty(),
                      "fused_sgd_: expected momentum_buffers to be empty when momentum is 0, "
                      "got ", momentum_buffers.size(), " tensors");
  }
  c.value(lr >= 0 && std::isfinite(lr), "lr", "a finite number >= 0", lr);
  c.value(momentum >= 0 && std::isfinite(momentum), "momentum", "a finite number >= 0",
          momentum);
  c.value(std::isfinite(dampening), "dampening", "a finite number", dampening);
  c.value(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay",
          "a finite number >= 0", weight_decay);
  if (nesterov) {
    c.value(momentum > 0, "momentum", "> 0 with nesterov=True", momentum);
    c.value(dampening == 0, "dampening", "0 with nesterov=True", dampening);
  }
  c.no_overlap();
  if (params.empty()) return;

  const typename Engine::Guard guard(params[0].device());
  SgdOp op;
  op.lr = static_cast<float>(lr);
  op.momentum = static_cast<float>(momentum);
  op.grad_weight = static_cast<float>(1.0 - dampening);
  op.weight_decay = static_cast<float>(weight_decay);
  op.nesterov = nesterov;
  op.first_run = first_run;
  op.wd_after_momentum = wd_after_momentum;
  op.maximize = maximize;
  op.kahan = !comps.empty();
  op.stochastic = sr_seed.has_value();
  op.seed = static_cast<uint64_t>(sr_seed.value_or(0));
  op.step_ptr = optional_ptr(step);
  op.inv_scale_ptr = optional_ptr(inv_scale);
  op.lr_ptr = optional_ptr(lr_tensor);
  const at::TensorList unscaled =
      unscale_grads && inv_scale.has_value() ? grads : at::TensorList{};
  run_optimizer<Engine, SgdOp>(
      {params, grads, momentum_buffers, model_params, comps, salts, unscaled}, op,
      optional_ptr(found_inf));
}

// The step counter is incremented (on the device, unless found_inf is set) before
// the update, which reads it. lr_tensor, when given, holds the learning rate on the
// device (read there, so that it can change between replays of a CUDA graph) and
// replaces `lr`. sr_seed, when given, turns on stochastic rounding of the bf16 params
// (pointwise.h), keyed by the seed and the step, with one salt per param (sr_salts).
// maximize negates the unscaled gradient; max_exp_avg_sqs, when given, turns on
// amsgrad (one per param, of its exp_avg_sq's dtype); unscale_grads writes
// grad * inv_scale back into the grads (nothing without an inv_scale).
template <class Engine>
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool adamw, bool bias_correction, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& lr_tensor = std::nullopt,
                 std::optional<at::TensorList> kahan_comps = std::nullopt,
                 std::optional<at::TensorList> sr_salts = std::nullopt,
                 std::optional<int64_t> sr_seed = std::nullopt, bool maximize = false,
                 std::optional<at::TensorList> max_exp_avg_sqs = std::nullopt,
                 bool unscale_grads = false) {
  const at::TensorList comps = kahan_comps.value_or(at::TensorList{});
  const at::TensorList salts = sr_salts.value_or(at::TensorList{});
  const at::TensorList max_sqs = max_exp_avg_sqs.value_or(at::TensorList{});
  Checker c("fused_adam_");
  c.scalar(step, "step", at::kFloat, Access::kWrite);
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  c.optional_scalar(lr_tensor, "lr_tensor");
  check_params(c, params, grads, model_params, unscale_grads ? Access::kWrite : Access::kRead);
  check_kahan_comps(c, params, model_params, comps);
  check_stochastic(c, "fused_adam_", params, model_params, comps, salts,
                   sr_seed.has_value());
  c.list(exp_avgs, "exp_avgs", kF32 | kBF16, Access::kWrite);
  c.paired(params, "params", exp_avgs, "exp_avgs");
  c.list(exp_avg_sqs, "exp_avg_sqs", kF32 | kBF16, Access::kWrite);
  c.paired(params, "params", exp_avg_sqs, "exp_avg_sqs");
  c.same_dtypes(exp_avgs, "exp_avgs", exp_avg_sqs, "exp_avg_sqs");
  if (max_exp_avg_sqs.has_value()) {
    c.list(max_sqs, "max_exp_avg_sqs", kF32 | kBF16, Access::kWrite);
    c.paired(params, "params", max_sqs, "max_exp_avg_sqs");
    c.same_dtypes(exp_avg_sqs, "exp_avg_sqs", max_sqs, "max_exp_avg_sqs");
  }
  check_adam_hyperparameters(c, lr, beta1, beta2, eps, weight_decay);
  c.no_overlap();
  if (params.empty()) return;

  const typename Engine::Guard guard(step.device());
  Engine::increment_step(step.data_ptr<float>(), optional_ptr(found_inf));
  AdamOp op;
  op.lr = lr;
  op.beta1 = beta1;
  op.beta2 = beta2;
  op.eps = eps;
  op.weight_decay = weight_decay;
  op.adamw = adamw;
  op.bias_correction = bias_correction;
  op.maximize = maximize;
  op.amsgrad = !max_sqs.empty();
  op.step_ptr = step.data_ptr<float>();
  op.inv_scale_ptr = optional_ptr(inv_scale);
  op.lr_ptr = optional_ptr(lr_tensor);
  op.kahan = !comps.empty();
  op.stochastic = sr_seed.has_value();
  op.seed = static_cast<uint64_t>(sr_seed.value_or(0));
  const at::TensorList unscaled =
      unscale_grads && inv_scale.has_value() ? grads : at::TensorList{};
  run_optimizer<Engine, AdamOp>({params, grads, exp_avgs, exp_avg_sqs, model_params,
                                 comps, salts, max_sqs, unscaled},
                                op, optional_ptr(found_inf));
}

// Two pointwise passes around one L2 norm: stage 1 writes the moments and each
// tensor's update into an fp32 scratch buffer (one allocation, a view per tensor, each
// starting on a 64-byte boundary); the engine's l2norm gives every param's and every
// update's norm; stage 2 applies the updates with the trust ratios (per-tensor lists).
// The step counter is incremented (on the device, unless found_inf is set) first.
template <class Engine>
void fused_lamb_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool adamw, bool bias_correction, bool grad_averaging, bool use_nvlamb,
                 const std::optional<at::Tensor>& global_grad_norm, double max_grad_norm,
                 const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf) {
  Checker c("fused_lamb_");
  c.scalar(step, "step", at::kFloat, Access::kWrite);
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  c.optional_scalar(global_grad_norm, "global_grad_norm");
  check_params(c, params, grads, model_params);
  c.list(exp_avgs, "exp_avgs", kF32, Access::kWrite);
  c.paired(params, "params", exp_avgs, "exp_avgs");
  c.list(exp_avg_sqs, "exp_avg_sqs", kF32, Access::kWrite);
  c.paired(params, "params", exp_avg_sqs, "exp_avg_sqs");
  check_adam_hyperparameters(c, lr, beta1, beta2, eps, weight_decay);
  if (global_grad_norm.has_value()) {
    c.value(max_grad_norm > 0 && std::isfinite(max_grad_norm), "max_grad_norm",
            "a finite number > 0 with a global_grad_norm", max_grad_norm);
  }
  c.no_overlap();
  if (params.empty()) return;

  const at::Device device = step.device();
  const typename Engine::Guard guard(device);
  const float* skip = optional_ptr(found_inf);
  Engine::increment_step(step.data_ptr<float>(), skip);

  constexpr int64_t kAlign = 16;  // floats: 64 bytes
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto& p : params) {
    offsets.push_back(total);
    total += (p.numel() + kAlign - 1) / kAlign * kAlign;
  }
  const at::Tensor scratch =
      at::empty({total}, at::TensorOptions().dtype(at::kFloat).device(device));
  std::vector<at::Tensor> updates;
  for (size_t i = 0; i < params.size(); ++i) {
    updates.push_back(scratch.narrow(0, offsets[i], params[i].numel()));
  }

  LambStage1Op op1;
  op1.beta1 = beta1;
  op1.beta2 = beta2;
  op1.eps = eps;
  op1.weight_decay = weight_decay;
  op1.max_grad_norm = max_grad_norm;
  op1.adamw = adamw;
  op1.bias_correction = bias_correction;
  op1.grad_averaging = grad_averaging;
  op1.step_ptr = step.data_ptr<float>();
  op1.inv_scale_ptr = optional_ptr(inv_scale);
  op1.grad_norm_ptr = optional_ptr(global_grad_norm);
  run_lamb_stage1<Engine>({params, grads, exp_avgs, exp_avg_sqs, updates}, op1, skip);

  // Params' and updates' norms in one call: tensors 0..n-1 and n..2n-1.
  std::vector<at::Tensor> both(params.begin(), params.end());
  both.insert(both.end(), updates.begin(), updates.end());
  const std::vector<at::Tensor> norms =
      std::get<1>(Engine::l2norm(both, nullptr, /*per_tensor=*/true, device)).unbind(0);
  const auto n = static_cast<std::ptrdiff_t>(params.size());
  const std::vector<at::Tensor> param_norms(norms.begin(), norms.begin() + n);
  const std::vector<at::Tensor> update_norms(norms.begin() + n, norms.end());

  LambStage2Op op2;
  op2.lr = static_cast<float>(lr);
  op2.adaptive = use_nvlamb || weight_decay != 0;
  run_lamb_stage2<Engine>({params, updates, model_params, param_norms, update_norms}, op2, skip);
}

template <class Engine>
void fused_adagrad_(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                    at::TensorList model_params, double lr, double eps, double weight_decay,
                    bool adagrad_w_mode, const std::optional<at::Tensor>& inv_scale,
                    const std::optional<at::Tensor>& found_inf) {
  Checker c("fused_adagrad_");
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  check_params(c, params, grads, model_params);
  c.list(state_sums, "state_sums", kF32, Access::kWrite);
  c.paired(params, "params", state_sums, "state_sums");
  c.value(lr >= 0 && std::isfinite(lr), "lr", "a finite number >= 0", lr);
  c.value(eps >= 0 && std::isfinite(eps), "eps", "a finite number >= 0", eps);
  c.value(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay",
          "a finite number >= 0", weight_decay);
  c.no_overlap();
  if (params.empty()) return;

  const typename Engine::Guard guard(params[0].device());
  AdagradOp op;
  op.lr = static_cast<float>(lr);
  op.eps = static_cast<float>(eps);
  op.weight_decay = static_cast<float>(weight_decay);
  op.adagrad_w_mode = adagrad_w_mode;
  op.inv_scale_ptr = optional_ptr(inv_scale);
  run_optimizer<Engine, AdagradOp>({params, grads, state_sums, model_params}, op,
                                   optional_ptr(found_inf));
}

// NovoGrad: the per-tensor second moment exp_avg_sq (fp32, one value per param) is
// updated first, with ATen ops on the device, from each gradient's norm n (unscaled):
// L2 (norm_type 2) sqrt(beta2 * v^2 + (1 - beta2) * n^2), inf-norm (0)
// beta2 * v + (1 - beta2) * n; on the group's first step (step 0 before the call),
// unless init_zero, v = n. Then step is incremented and the pointwise update reads
// v per tensor. found_inf set: nothing changes, the step included.
template <class Engine>
void fused_novograd_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList model_params, const at::Tensor& exp_avg_sq,
                     const at::Tensor& step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool bias_correction, bool grad_averaging,
                     bool reg_inside_moment, int64_t norm_type, bool init_zero,
                     const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf) {
  Checker c("fused_novograd_");
  c.scalar(step, "step", at::kFloat, Access::kWrite);
  c.tensor(exp_avg_sq, "exp_avg_sq", kF32, Access::kWrite);
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  check_params(c, params, grads, model_params);
  c.list(exp_avgs, "exp_avgs", kF32, Access::kWrite);
  c.paired(params, "params", exp_avgs, "exp_avgs");
  TORCH_CHECK_VALUE(exp_avg_sq.dim() == 1 && exp_avg_sq.numel() ==
                        static_cast<int64_t>(params.size()),
                    "fused_novograd_: expected exp_avg_sq to be a vector of one value for each "
                    "of the ", params.size(), " params, got shape ", exp_avg_sq.sizes());
  check_adam_hyperparameters(c, lr, beta1, beta2, eps, weight_decay);
  c.value(norm_type == 0 || norm_type == 2, "norm_type", "0 (inf-norm) or 2 (L2)",
          static_cast<double>(norm_type));
  c.no_overlap();
  if (params.empty()) return;

  const typename Engine::Guard guard(step.device());
  at::Tensor norms;
  if (norm_type == 2) {
    norms = std::get<1>(Engine::l2norm(grads, optional_ptr(inv_scale), true, step.device()));
  } else {
    std::vector<at::Tensor> maxima;
    for (const at::Tensor& g : grads) {
      maxima.push_back(g.numel() == 0 ? at::zeros({}, g.options().dtype(at::kFloat))
                                      : g.abs().amax().to(at::kFloat));
    }
    norms = at::stack(maxima);
    if (inv_scale.has_value()) norms = norms * *inv_scale;
  }
  at::Tensor blended = norm_type == 2
                           ? (exp_avg_sq.square() * beta2 + norms.square() * (1.0 - beta2)).sqrt()
                           : exp_avg_sq * beta2 + norms * (1.0 - beta2);
  if (!init_zero) blended = at::where(step.eq(0), norms, blended);
  if (found_inf.has_value()) blended = at::where(found_inf->ne(0), exp_avg_sq, blended);
  exp_avg_sq.copy_(blended);
  Engine::increment_step(step.data_ptr<float>(), optional_ptr(found_inf));

  std::vector<at::Tensor> per_tensor;
  for (int64_t i = 0; i < exp_avg_sq.numel(); ++i) per_tensor.push_back(exp_avg_sq.narrow(0, i, 1));
  NovoGradOp op;
  op.beta1 = beta1;
  op.beta2 = beta2;
  op.lr = static_cast<float>(lr);
  op.grad_weight = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.f;
  op.eps = static_cast<float>(eps);
  op.weight_decay = static_cast<float>(weight_decay);
  op.bias_correction = bias_correction;
  op.reg_inside_moment = reg_inside_moment;
  op.step_ptr = step.data_ptr<float>();
  op.inv_scale_ptr = optional_ptr(inv_scale);
  run_optimizer<Engine, NovoGradOp>({params, grads, exp_avgs, per_tensor, model_params}, op,
                                    optional_ptr(found_inf));
}

template <class Engine>
at::Tensor sum_fp32(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim) {
  Checker c("sum_fp32");
  c.tensor(self, "self", kFloats | kF64);
  const typename Engine::Guard guard(self.device());
  // ATen's reduction reads the input in its own dtype and accumulates and writes in
  // the requested one (on CUDA without an fp32 copy of the input).
  const auto out_dtype = self.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::sum(self, dim, keepdim, out_dtype);
}

template <class Engine>
void update_loss_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale) {
  Checker c("update_loss_scale_");
  c.scalar(scale, "scale", at::kFloat, Access::kWrite);
  c.scalar(growth_tracker, "growth_tracker", at::kInt, Access::kWrite);
  c.scalar(hysteresis_tracker, "hysteresis_tracker", at::kInt, Access::kWrite);
  c.scalar(found_inf, "found_inf", at::kFloat);
  c.value(growth_factor >= 1 && std::isfinite(growth_factor), "growth_factor",
          "a finite number >= 1", growth_factor);
  c.value(backoff_factor > 0 && backoff_factor <= 1, "backoff_factor", "in (0, 1]",
          backoff_factor);
  c.value(growth_interval >= 1 && growth_interval <= INT32_MAX, "growth_interval",
          "in [1, 2**31 - 1]", static_cast<double>(growth_interval));
  c.value(hysteresis >= 1 && hysteresis <= INT32_MAX, "hysteresis", "in [1, 2**31 - 1]",
          static_cast<double>(hysteresis));
  // max_scale first, so that a NaN there is not blamed on min_scale's comparison.
  c.value(max_scale > 0, "max_scale", "> 0 (inf for no ceiling)", max_scale);
  c.value(min_scale >= 0 && min_scale <= max_scale, "min_scale", ">= 0 and <= max_scale",
          min_scale);
  c.no_overlap();

  const typename Engine::Guard guard(scale.device());
  LossScaleArgs args;
  args.growth_factor = growth_factor;
  args.backoff_factor = backoff_factor;
  args.min_scale = min_scale;
  args.max_scale = max_scale;
  args.growth_interval = static_cast<int32_t>(growth_interval);
  args.hysteresis = static_cast<int32_t>(hysteresis);
  Engine::update_loss_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                            hysteresis_tracker.data_ptr<int32_t>(),
                            found_inf.const_data_ptr<float>(), args);
}

}  // namespace entry

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
  static std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList, const float*, bool,
                                                   at::Device) {
    unsupported();
  }
  static void increment_step(float*, const float*) { unsupported(); }
  static void update_loss_scale(float*, int32_t*, int32_t*, const float*,
                                const LossScaleArgs&) {
    unsupported();
  }
};

// Every op's entry on one engine: a backend registers them for its dispatch keys.
template <class Engine>
void register_kernels(torch::Library& m) {
  m.impl("multi_tensor_unscale_", &entry::multi_tensor_unscale_<Engine>);
  m.impl("multi_tensor_unscale_to_", &entry::multi_tensor_unscale_to_<Engine>);
  m.impl("multi_tensor_check_finite_", &entry::multi_tensor_check_finite_<Engine>);
  m.impl("multi_tensor_copy_", &entry::multi_tensor_copy_<Engine>);
  m.impl("multi_tensor_l2norm", &entry::multi_tensor_l2norm<Engine>);
  m.impl("fused_sgd_", &entry::fused_sgd_<Engine>);
  m.impl("fused_adam_", &entry::fused_adam_<Engine>);
  m.impl("fused_lamb_", &entry::fused_lamb_<Engine>);
  m.impl("sum_fp32", &entry::sum_fp32<Engine>);
  m.impl("update_loss_scale_", &entry::update_loss_scale_<Engine>);
  m.impl("fused_adagrad_", &entry::fused_adagrad_<Engine>);
  m.impl("fused_novograd_", &entry::fused_novograd_<Engine>);
}

}  // namespace mixedprec
