// The CPU kernels, declared for their registration and for direct calls from
// the C++ tests. Signatures follow the schemas in csrc/ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace mixedprec::cpu {

void multi_tensor_unscale_(at::TensorList tensors, const at::Tensor& found_inf,
                           const at::Tensor& inv_scale);
void multi_tensor_unscale_to_(at::TensorList src, at::TensorList dst, const at::Tensor& found_inf,
                              const at::Tensor& inv_scale);
void multi_tensor_check_finite_(at::TensorList tensors, const at::Tensor& found_inf);
void multi_tensor_copy_(at::TensorList src, at::TensorList dst);
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors,
                                                       const std::optional<at::Tensor>& inv_scale,
                                                       bool per_tensor);
void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList model_params, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool first_run,
                const std::optional<at::Tensor>& inv_scale,
                const std::optional<at::Tensor>& found_inf);
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool adamw, bool bias_correction, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf);
at::Tensor sum_fp32(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim);
void update_loss_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale);

}  // namespace mixedprec::cpu
