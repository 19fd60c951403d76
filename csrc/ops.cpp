// The schemas of every mixedprec operator: the single source of truth. It includes no
// op family, so that an edit of an entry or a functor does not rebuild it. The backends
// register their kernels (the entries of csrc/ops/*.h) in their units (ops/unit.h:
// csrc/cpu/register*.cpp, csrc/cuda/register*.cu), the CPU's also those of calls
// without tensors; fake (Meta) kernels and autograd live in mixedprec/ops.py. One class,
// not an op, is declared here too: the optimizers' plan check (plan_check.h).
#include <torch/library.h>

#include "plan_check.h"
#include "python_gil.h"

namespace mixedprec {
void (*hold_python_gil)(void (*f)(void*), void* arg) = nullptr;  // python_gil.h
}  // namespace mixedprec

TORCH_LIBRARY(mixedprec, m) {
  m.def(
      "multi_tensor_unscale_(Tensor(a!)[] tensors, Tensor(b!) found_inf, "
      "Tensor inv_scale) -> ()");
  m.def(
      "multi_tensor_unscale_to_(Tensor[] src, Tensor(a!)[] dst, "
      "Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  m.def("multi_tensor_check_finite_(Tensor[] tensors, Tensor(a!) found_inf) -> ()");
  m.def("multi_tensor_copy_(Tensor[] src, Tensor(a!)[] dst) -> ()");
  m.def(
      "multi_tensor_l2norm(Tensor[] tensors, Tensor? inv_scale, "
      "bool per_tensor) -> (Tensor, Tensor)");
  // grads are written (unscaled) only with unscale_grads=True.
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor(e!)[] grads, "
      "Tensor(b!)[] momentum_buffers, Tensor(c!)[] model_params, float lr, "
      "float momentum, float dampening, float weight_decay, bool nesterov, "
      "bool first_run, Tensor? inv_scale, Tensor? found_inf, "
      "bool wd_after_momentum=False, Tensor(d!)[]? kahan_comps=None, "
      "Tensor[]? sr_salts=None, int? sr_seed=None, Tensor? step=None, "
      "bool maximize=False, Tensor? lr_tensor=None, bool unscale_grads=False, "
      "Tensor(f!)[]? remainders=None, Tensor(g!)[]? momentum_scales=None, "
      "int? state_seed=None, Tensor(h!)[]? precision_tallies=None) -> ()");
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor(g!)[] grads, "
      "Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] model_params, Tensor(e!) step, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool decoupled_weight_decay, "
      "bool bias_correction, Tensor? inv_scale, Tensor? found_inf, "
      "Tensor? lr_tensor=None, Tensor(f!)[]? kahan_comps=None, "
      "Tensor[]? sr_salts=None, int? sr_seed=None, bool maximize=False, "
      "Tensor(h!)[]? max_exp_avg_sqs=None, bool unscale_grads=False, "
      "Tensor(i!)[]? remainders=None, Tensor(j!)[]? exp_avg_scales=None, "
      "Tensor(k!)[]? exp_avg_sq_scales=None, int? state_seed=None, "
      "Tensor(l!)[]? precision_tallies=None) -> ()");
  m.def(
      "fused_lamb_(Tensor(a!)[] params, Tensor[] grads, "
      "Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] model_params, Tensor(e!) step, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool decoupled_weight_decay, "
      "bool bias_correction, bool grad_averaging, bool use_nvlamb, "
      "Tensor? global_grad_norm, float max_grad_norm, Tensor? inv_scale, "
      "Tensor? found_inf) -> ()");
  m.def("sum_fp32(Tensor self, int[]? dim=None, bool keepdim=False) -> Tensor");
  m.def(
      "update_loss_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, "
      "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval, int hysteresis, "
      "float min_scale, float max_scale) -> ()");
  m.def(
      "fused_adagrad_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, "
      "Tensor(c!)[] model_params, float lr, float eps, float weight_decay, "
      "bool decoupled_weight_decay, Tensor? inv_scale, Tensor? found_inf) -> ()");
  m.def(
      "fused_novograd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] model_params, Tensor(d!) exp_avg_sq, Tensor(e!) step, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool bias_correction, "
      "bool grad_averaging, bool reg_inside_moment, int norm_type, bool init_zero, "
      "Tensor? inv_scale, Tensor? found_inf) -> ()");
  m.class_<mixedprec::PlanCheck>("PlanCheck")
      .def(torch::init<const c10::List<at::Tensor>&, const c10::List<std::optional<at::Tensor>>&,
                       c10::List<at::Tensor>, bool>())
      .def("gradients", &mixedprec::PlanCheck::gradients);
}
