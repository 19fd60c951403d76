// Argument validation for every op, shared by the CPU and CUDA backends so both
// reject exactly the same inputs, before any tensor is written.
//
// Tensors in the lists must be dense and non-overlapping (contiguous, or a
// permutation such as channels_last); tensors paired across lists must have the
// same number of elements and the same memory order. Anything else is rejected.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace mixedprec {

void check_multi_tensor_unscale(at::TensorList tensors, const at::Tensor& found_inf,
                                const at::Tensor& inv_scale);
void check_multi_tensor_unscale_to(at::TensorList src, at::TensorList dst,
                                   const at::Tensor& found_inf, const at::Tensor& inv_scale);
void check_multi_tensor_check_finite(at::TensorList tensors, const at::Tensor& found_inf);
void check_multi_tensor_copy(at::TensorList src, at::TensorList dst);
void check_multi_tensor_l2norm(at::TensorList tensors,
                               const std::optional<at::Tensor>& inv_scale);
void check_fused_sgd(at::TensorList params, at::TensorList grads,
                     at::TensorList momentum_buffers, at::TensorList model_params, double lr,
                     double momentum, double dampening, double weight_decay, bool nesterov,
                     const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf);
void check_fused_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList model_params,
                      const at::Tensor& step, double lr, double beta1, double beta2,
                      double eps, double weight_decay,
                      const std::optional<at::Tensor>& inv_scale,
                      const std::optional<at::Tensor>& found_inf);
void check_sum_fp32(const at::Tensor& self);
void check_update_loss_scale(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor,
                             int64_t growth_interval, int64_t hysteresis, double min_scale,
                             double max_scale);

// The value of an optional 1-element float32 tensor's storage, or nullptr.
inline const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<float>() : nullptr;
}

}  // namespace mixedprec
