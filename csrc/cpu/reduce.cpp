// CPU kernels of the reduction and loss-scale family: sum_fp32, update_loss_scale_.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../dispatch.h"
#include "../validate.h"
#include "kernels.h"

namespace mixedprec::cpu {

at::Tensor sum_fp32(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim) {
  check_sum_fp32(self);
  // ATen's reduction reads the input in its own dtype and accumulates and writes
  // in the requested one.
  const auto out_dtype = self.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::sum(self, dim, keepdim, out_dtype);
}

void update_loss_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale) {
  check_update_loss_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  update_loss_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                    hysteresis_tracker.data_ptr<int32_t>(), found_inf.const_data_ptr<float>(),
                    loss_scale_args(growth_factor, backoff_factor, growth_interval, hysteresis,
                                    min_scale, max_scale));
}

namespace {

void register_kernels(torch::Library& m) {
  m.impl("sum_fp32", &sum_fp32);
  m.impl("update_loss_scale_", &update_loss_scale_);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixedprec, CPU, m) { register_kernels(m); }
// Sparse tensors reach the same kernels, whose validation rejects them by name.
TORCH_LIBRARY_IMPL(mixedprec, SparseCPU, m) { register_kernels(m); }

}  // namespace mixedprec::cpu
