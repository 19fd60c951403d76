// The entry of Adam/AdamW, fused_adam_ (its per-element math is in
// csrc/pointwise_adam.h): it checks its arguments before anything is written, makes the
// data's device current, and runs on the engine. The signature follows the schema in
// csrc/ops.cpp. A family of its own, the largest: the backends compile it as a unit of
// its own (ops/unit.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "../dispatch.h"
#include "../pointwise_adam.h"
#include "kernel.h"

namespace mixedprec {
namespace entry {

// The step counter is incremented (on the device, unless found_inf is set) before
// the update, which reads it. lr_tensor, when given, holds the learning rate on the
// device (read there, so that it can change between replays of a CUDA graph) and
// replaces `lr`. sr_seed, when given, turns on stochastic rounding of the bf16 params
// (pointwise.h), keyed by the seed and the step, with one salt per param (sr_salts).
// maximize negates the unscaled gradient; max_exp_avg_sqs, when given, turns on
// amsgrad (one per param, of its exp_avg_sq's dtype); unscale_grads writes
// grad * inv_scale back into the grads (nothing without an inv_scale); remainders as
// in fused_sgd_. exp_avg_scales and exp_avg_sq_scales, given together, make the
// moments 8-bit (as momentum_scales in fused_sgd_), exp_avg_sqs then holding the
// square roots of the second moments (AdamOp's `root`); amsgrad is refused with them.
// state_seed, with 8-bit state, rounds its codes stochastically (lanes.h) with Philox
// bits keyed as sr_seed's (the same sr_salts, the step) but by state_seed.
// precision_tallies, when given, one contiguous float64 tensor of 4 words per param, turn
// on the precision report (AdamOp's `report`): the step adds to them the number of
// elements whose update was lost, the sums of squares of the lost and of the applied
// parts, and the number of elements stepped. Not with fp16 params without masters.
template <class Engine>
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool decoupled_weight_decay, bool bias_correction,
                 const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& lr_tensor = std::nullopt,
                 std::optional<at::TensorList> kahan_comps = std::nullopt,
                 std::optional<at::TensorList> sr_salts = std::nullopt,
                 std::optional<int64_t> sr_seed = std::nullopt, bool maximize = false,
                 std::optional<at::TensorList> max_exp_avg_sqs = std::nullopt,
                 bool unscale_grads = false,
                 std::optional<at::TensorList> remainders = std::nullopt,
                 std::optional<at::TensorList> exp_avg_scales = std::nullopt,
                 std::optional<at::TensorList> exp_avg_sq_scales = std::nullopt,
                 std::optional<int64_t> state_seed = std::nullopt,
                 std::optional<at::TensorList> precision_tallies = std::nullopt) {
  const at::TensorList comps = kahan_comps.value_or(at::TensorList{});
  const at::TensorList salts = sr_salts.value_or(at::TensorList{});
  const at::TensorList rems = remainders.value_or(at::TensorList{});
  const at::TensorList max_sqs = max_exp_avg_sqs.value_or(at::TensorList{});
  const at::TensorList tallies = precision_tallies.value_or(at::TensorList{});
  Checker c("fused_adam_");
  c.scalar(step, "step", at::kFloat, Access::kWrite);
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  c.optional_scalar(lr_tensor, "lr_tensor");
  check_params(c, params, grads, model_params, unscale_grads ? Access::kWrite : Access::kRead);
  check_kahan_comps(c, params, model_params, comps);
  check_stochastic(c, "fused_adam_", params, model_params, comps, salts, sr_seed.has_value(),
                   state_seed.has_value());
  TORCH_CHECK_VALUE(!state_seed.has_value() || exp_avg_scales.has_value(),
                    "fused_adam_: state_seed (stochastic rounding of 8-bit moments) expected "
                    "exp_avg_scales and exp_avg_sq_scales");
  check_remainders(c, params, model_params, comps, rems, sr_seed.has_value());
  TORCH_CHECK_VALUE(exp_avg_scales.has_value() == exp_avg_sq_scales.has_value(),
                    "fused_adam_: expected exp_avg_scales and exp_avg_sq_scales together (8-bit "
                    "moments) or neither, got only ",
                    exp_avg_scales.has_value() ? "exp_avg_scales" : "exp_avg_sq_scales");
  TORCH_CHECK_VALUE(!exp_avg_scales.has_value() || !max_exp_avg_sqs.has_value(),
                    "fused_adam_: max_exp_avg_sqs (amsgrad) is not supported with 8-bit moments "
                    "(exp_avg_scales); keep fp32 or bf16 moments with amsgrad");
  check_state_scales(c, exp_avgs, "exp_avgs", exp_avg_scales, "exp_avg_scales");
  c.paired(params, "params", exp_avgs, "exp_avgs");
  check_state_scales(c, exp_avg_sqs, "exp_avg_sqs", exp_avg_sq_scales, "exp_avg_sq_scales");
  c.paired(params, "params", exp_avg_sqs, "exp_avg_sqs");
  c.same_dtypes(exp_avgs, "exp_avgs", exp_avg_sqs, "exp_avg_sqs");
  if (max_exp_avg_sqs.has_value()) {
    c.list(max_sqs, "max_exp_avg_sqs", kF32 | kBF16, Access::kWrite);
    c.paired(params, "params", max_sqs, "max_exp_avg_sqs");
    c.same_dtypes(exp_avg_sqs, "exp_avg_sqs", max_sqs, "max_exp_avg_sqs");
  }
  check_adam_hyperparameters(c, lr, beta1, beta2, eps, weight_decay);
  check_tallies(c, "fused_adam_", precision_tallies, AdamOp::kTallies + 1, params, model_params);
  c.no_overlap();
  if (params.empty()) return;

  const typename Engine::Guard guard(step.device());
  Engine::template run_single<IncrementStep>(step.data_ptr<float>(), optional_ptr(found_inf));
  AdamOp op;
  op.lr = lr;
  op.beta1 = beta1;
  op.beta2 = beta2;
  op.eps = eps;
  op.weight_decay = weight_decay;
  op.decoupled_weight_decay = decoupled_weight_decay;
  op.bias_correction = bias_correction;
  op.maximize = maximize;
  op.amsgrad = !max_sqs.empty();
  op.step_ptr = step.data_ptr<float>();
  op.inv_scale_ptr = optional_ptr(inv_scale);
  op.lr_ptr = optional_ptr(lr_tensor);
  op.kahan = !comps.empty();
  op.remainder = !rems.empty();
  op.stochastic = sr_seed.has_value();
  op.seed = static_cast<uint64_t>(sr_seed.value_or(0));
  op.root = exp_avg_scales.has_value();
  op.state_stochastic = state_seed.has_value();
  op.state_seed = static_cast<uint64_t>(state_seed.value_or(0));
  op.report = precision_tallies.has_value();
  const at::TensorList unscaled = unscale_grads && inv_scale.has_value() ? grads : at::TensorList{};
  run_optimizer<Engine, AdamOp>(
      {params, grads, exp_avgs, exp_avg_sqs, model_params, op.remainder ? rems : comps, salts,
       max_sqs, unscaled, exp_avg_scales.value_or(at::TensorList{}),
       exp_avg_sq_scales.value_or(at::TensorList{}), tallies},
      op, optional_ptr(found_inf));
}

}  // namespace entry

template <class Engine>
void register_adam_ops(torch::Library& m) {
  m.impl("fused_adam_", kernel<&entry::fused_adam_<Engine>>());
}

}  // namespace mixedprec
