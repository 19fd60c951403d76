// CUDA kernels of the reduction and loss-scale family: sum_fp32, update_loss_scale_.
#include <torch/library.h>

#include "multi_tensor_apply.cuh"

namespace mixedprec::cuda {
namespace {

void register_kernels(torch::Library& m) {
  m.impl("sum_fp32", &entry::sum_fp32<CudaEngine>);
  m.impl("update_loss_scale_", &entry::update_loss_scale_<CudaEngine>);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixedprec, CUDA, m) { register_kernels(m); }
// Sparse tensors reach the same kernels, whose validation rejects them by name.
TORCH_LIBRARY_IMPL(mixedprec, SparseCUDA, m) { register_kernels(m); }

}  // namespace mixedprec::cuda
