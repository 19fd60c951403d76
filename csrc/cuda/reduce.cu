// CUDA kernels of the reduction and loss-scale family: sum_fp32, update_loss_scale_.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../dispatch.h"
#include "../validate.h"

namespace mixedprec::cuda {
namespace {

at::Tensor sum_fp32(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim) {
  check_sum_fp32(self);
  const c10::cuda::CUDAGuard guard(self.device());
  // ATen's CUDA reduction loads the input in its own dtype and accumulates and
  // writes in the requested one: no fp32 copy of the input is made.
  const auto out_dtype = self.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::sum(self, dim, keepdim, out_dtype);
}

__global__ void update_loss_scale_kernel(float* scale, int32_t* growth_tracker,
                                         int32_t* hysteresis_tracker, const float* found_inf,
                                         LossScaleArgs args) {
  update_loss_scale(scale, growth_tracker, hysteresis_tracker, found_inf, args);
}

void update_loss_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale) {
  check_update_loss_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  const c10::cuda::CUDAGuard guard(scale.device());
  update_loss_scale_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.const_data_ptr<float>(),
      loss_scale_args(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
                      max_scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void register_kernels(torch::Library& m) {
  m.impl("sum_fp32", &sum_fp32);
  m.impl("update_loss_scale_", &update_loss_scale_);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixedprec, CUDA, m) { register_kernels(m); }
// Sparse tensors reach the same kernels, whose validation rejects them by name.
TORCH_LIBRARY_IMPL(mixedprec, SparseCUDA, m) { register_kernels(m); }

}  // namespace mixedprec::cuda
