// CPU kernels of the optimizer family: fused SGD and Adam/AdamW.
#include <torch/library.h>

#include "engine.h"
#include "kernels.h"

namespace mixedprec::cpu {

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList model_params, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool first_run,
                const std::optional<at::Tensor>& inv_scale,
                const std::optional<at::Tensor>& found_inf) {
  entry::fused_sgd_<CpuEngine>(params, grads, momentum_buffers, model_params, lr, momentum,
                               dampening, weight_decay, nesterov, first_run, inv_scale,
                               found_inf);
}

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool adamw, bool bias_correction, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf) {
  entry::fused_adam_<CpuEngine>(params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr,
                                beta1, beta2, eps, weight_decay, adamw, bias_correction,
                                inv_scale, found_inf);
}

namespace {

void register_kernels(torch::Library& m) {
  m.impl("fused_sgd_", &fused_sgd_);
  m.impl("fused_adam_", &fused_adam_);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixedprec, CPU, m) { register_kernels(m); }
// Sparse tensors reach the same kernels, whose validation rejects them by name.
TORCH_LIBRARY_IMPL(mixedprec, SparseCPU, m) { register_kernels(m); }

}  // namespace mixedprec::cpu
