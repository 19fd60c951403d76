// CUDA kernels of the optimizer family: fused SGD and Adam/AdamW, on the engine.
#include <torch/library.h>

#include "multi_tensor_apply.cuh"

namespace mixedprec::cuda {
namespace {

void register_kernels(torch::Library& m) {
  m.impl("fused_sgd_", &entry::fused_sgd_<CudaEngine>);
  m.impl("fused_adam_", &entry::fused_adam_<CudaEngine>);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixedprec, CUDA, m) { register_kernels(m); }
// Sparse tensors reach the same kernels, whose validation rejects them by name.
TORCH_LIBRARY_IMPL(mixedprec, SparseCUDA, m) { register_kernels(m); }

}  // namespace mixedprec::cuda
