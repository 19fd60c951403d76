// The CUDA kernels of Adam: one of the registration units
// (csrc/ops/unit.h, MP_REGISTER_UNIT), compiled on its own.
#include <torch/library.h>

#include "../ops/adam.h"
#include "../ops/unit.h"
#include "multi_tensor_apply.cuh"

MP_REGISTER_UNIT(register_adam_ops, mixedprec::cuda::CudaEngine, CUDA, SparseCUDA, SparseCsrCUDA)
