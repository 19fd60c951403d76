// The CUDA kernels: every op's entry (csrc/ops/) on the CUDA engine.
#include <torch/library.h>

#include "../ops/all.h"
#include "multi_tensor_apply.cuh"

namespace mixedprec::cuda {

TORCH_LIBRARY_IMPL(mixedprec, CUDA, m) { register_kernels<CudaEngine>(m); }
// Sparse tensors (COO; CSR, CSC, BSR, BSC) reach the same kernels, whose validation
// rejects them by name.
TORCH_LIBRARY_IMPL(mixedprec, SparseCUDA, m) { register_kernels<CudaEngine>(m); }
TORCH_LIBRARY_IMPL(mixedprec, SparseCsrCUDA, m) { register_kernels<CudaEngine>(m); }

}  // namespace mixedprec::cuda
