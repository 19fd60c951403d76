// The fused optimizers' entries but Adam's (ops/adam.h): SGD, LAMB, Adagrad and
// NovoGrad (their per-element math is in csrc/pointwise_optimizers.h). Each checks its arguments
// before anything is written, makes the data's device current, and runs on the engine. Signatures
// follow the schemas in csrc/ops.cpp.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "../dispatch.h"
#include "../pointwise_optimizers.h"
#include "kernel.h"

namespace mixedprec {

// LAMB's stages (pointwise_optimizers.h). Stage 1 reads params and grads in any float type and
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

namespace entry {

// sr_seed, when given, turns on stochastic rounding of the bf16 params (pointwise.h),
// keyed by the seed and `step`, a device step count then required, read (the caller
// advances it: one optimizer step may take two calls), with one salt per param.
// maximize negates the unscaled gradient; lr_tensor, when given, holds the learning
// rate on the device and replaces `lr`; unscale_grads writes grad * inv_scale back
// into the grads (nothing without an inv_scale: they are unscaled already).
// remainders (int16, one per bf16 param) hold the low halves of fp32 masters
// (master="remainder", pointwise.h), in the list slot of kahan_comps, which they exclude.
// momentum_scales, when given, make the momentum buffers 8-bit: float8_e4m3fn codes
// with one float8_e8m0fnu scale per block of 32 elements (lanes.h). precision_tallies:
// the precision report, as in fused_adam_.
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
                bool unscale_grads = false, std::optional<at::TensorList> remainders = std::nullopt,
                std::optional<at::TensorList> momentum_scales = std::nullopt,
                std::optional<int64_t> state_seed = std::nullopt,
                std::optional<at::TensorList> precision_tallies = std::nullopt) {
  const at::TensorList comps = kahan_comps.value_or(at::TensorList{});
  const at::TensorList scales = momentum_scales.value_or(at::TensorList{});
  const at::TensorList salts = sr_salts.value_or(at::TensorList{});
  const at::TensorList rems = remainders.value_or(at::TensorList{});
  Checker c("fused_sgd_");
  c.optional_scalar(step, "step");
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  c.optional_scalar(lr_tensor, "lr_tensor");
  check_params(c, params, grads, model_params, unscale_grads ? Access::kWrite : Access::kRead);
  check_kahan_comps(c, params, model_params, comps);
  check_stochastic(c, "fused_sgd_", params, model_params, comps, salts, sr_seed.has_value(),
                   state_seed.has_value());
  TORCH_CHECK_VALUE(!state_seed.has_value() || (momentum_scales.has_value() && step.has_value()),
                    "fused_sgd_: state_seed (stochastic rounding of 8-bit momentum buffers) "
                    "expected momentum_scales and a step tensor");
  check_remainders(c, params, model_params, comps, rems, sr_seed.has_value());
  TORCH_CHECK_VALUE(!sr_seed.has_value() || step.has_value(),
                    "fused_sgd_: expected a step tensor with sr_seed (stochastic rounding "
                    "keys its bits by the step), got None");
  if (momentum != 0) {
    check_state_scales(c, momentum_buffers, "momentum_buffers", momentum_scales, "momentum_scales");
    c.paired(params, "params", momentum_buffers, "momentum_buffers");
  } else {
    TORCH_CHECK_VALUE(momentum_buffers.empty() && scales.empty(),
                      "fused_sgd_: expected momentum_buffers and momentum_scales to be empty "
                      "when momentum is 0, got ",
                      momentum_buffers.size(), " and ", scales.size(), " tensors");
  }
  c.value(lr >= 0 && std::isfinite(lr), "lr", "a finite number >= 0", lr);
  c.value(momentum >= 0 && std::isfinite(momentum), "momentum", "a finite number >= 0", momentum);
  c.value(std::isfinite(dampening), "dampening", "a finite number", dampening);
  c.value(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay", "a finite number >= 0",
          weight_decay);
  if (nesterov) {
    c.value(momentum > 0, "momentum", "> 0 with nesterov=True", momentum);
    c.value(dampening == 0, "dampening", "0 with nesterov=True", dampening);
  }
  check_tallies(c, "fused_sgd_", precision_tallies, SgdOp::kTallies + 1, params, model_params);
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
  op.remainder = !rems.empty();
  op.stochastic = sr_seed.has_value();
  op.seed = static_cast<uint64_t>(sr_seed.value_or(0));
  op.state_stochastic = state_seed.has_value();
  op.state_seed = static_cast<uint64_t>(state_seed.value_or(0));
  op.report = precision_tallies.has_value();
  op.step_ptr = optional_ptr(step);
  op.inv_scale_ptr = optional_ptr(inv_scale);
  op.lr_ptr = optional_ptr(lr_tensor);
  const at::TensorList unscaled = unscale_grads && inv_scale.has_value() ? grads : at::TensorList{};
  run_optimizer<Engine, SgdOp>(
      {params, grads, momentum_buffers, model_params, op.remainder ? rems : comps, salts, unscaled,
       scales, precision_tallies.value_or(at::TensorList{})},
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
                 bool decoupled_weight_decay, bool bias_correction, bool grad_averaging,
                 bool use_nvlamb, const std::optional<at::Tensor>& global_grad_norm,
                 double max_grad_norm, const std::optional<at::Tensor>& inv_scale,
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
  Engine::template run_single<IncrementStep>(step.data_ptr<float>(), skip);

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
  op1.decoupled_weight_decay = decoupled_weight_decay;
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
                    bool decoupled_weight_decay, const std::optional<at::Tensor>& inv_scale,
                    const std::optional<at::Tensor>& found_inf) {
  Checker c("fused_adagrad_");
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  check_params(c, params, grads, model_params);
  c.list(state_sums, "state_sums", kF32, Access::kWrite);
  c.paired(params, "params", state_sums, "state_sums");
  c.value(lr >= 0 && std::isfinite(lr), "lr", "a finite number >= 0", lr);
  c.value(eps >= 0 && std::isfinite(eps), "eps", "a finite number >= 0", eps);
  c.value(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay", "a finite number >= 0",
          weight_decay);
  c.no_overlap();
  if (params.empty()) return;

  const typename Engine::Guard guard(params[0].device());
  AdagradOp op;
  op.lr = static_cast<float>(lr);
  op.eps = static_cast<float>(eps);
  op.weight_decay = static_cast<float>(weight_decay);
  op.decoupled_weight_decay = decoupled_weight_decay;
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
  TORCH_CHECK_VALUE(
      exp_avg_sq.dim() == 1 && exp_avg_sq.numel() == static_cast<int64_t>(params.size()),
      "fused_novograd_: expected exp_avg_sq to be a vector of one value for each "
      "of the ",
      params.size(), " params, got shape ", exp_avg_sq.sizes());
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
  Engine::template run_single<IncrementStep>(step.data_ptr<float>(), optional_ptr(found_inf));

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

}  // namespace entry

// This family's entries on one engine (Adam's are in ops/adam.h, a unit of their own).
template <class Engine>
void register_other_optimizer_ops(torch::Library& m) {
  m.impl("fused_sgd_", kernel<&entry::fused_sgd_<Engine>>());
  m.impl("fused_lamb_", kernel<&entry::fused_lamb_<Engine>>());
  m.impl("fused_adagrad_", kernel<&entry::fused_adagrad_<Engine>>());
  m.impl("fused_novograd_", kernel<&entry::fused_novograd_<Engine>>());
}

}  // namespace mixedprec
