// The CUDA kernels of Adam: one of the registration units
// (csrc/ops/all.h, MP_REGISTER_UNIT), compiled on its own.
#include <torch/library.h>

#include "../ops/all.h"
#include "multi_tensor_apply.cuh"

MP_REGISTER_UNIT(register_adam_ops, mixedprec::cuda::CudaEngine, CUDA, SparseCUDA, SparseCsrCUDA)
