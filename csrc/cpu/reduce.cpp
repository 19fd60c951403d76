// CPU kernels of the reduction and loss-scale family: sum_fp32, update_loss_scale_.
#include <torch/library.h>

#include "engine.h"
#include "kernels.h"

namespace mixedprec::cpu {

at::Tensor sum_fp32(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim) {
  return entry::sum_fp32<CpuEngine>(self, dim, keepdim);
}

void update_loss_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale) {
  entry::update_loss_scale_<CpuEngine>(scale, growth_tracker, hysteresis_tracker, found_inf,
                                       growth_factor, backoff_factor, growth_interval,
                                       hysteresis, min_scale, max_scale);
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
