// The CUDA kernels of SGD, LAMB, Adagrad and NovoGrad: one of the registration units
// (csrc/ops/unit.h, MP_REGISTER_UNIT), compiled on its own.
#include <torch/library.h>

#include "../ops/optimizers.h"
#include "../ops/unit.h"
#include "multi_tensor_apply.cuh"

MP_REGISTER_UNIT(register_other_optimizer_ops, mixedprec::cuda::CudaEngine, CUDA, SparseCUDA,
                 SparseCsrCUDA)
