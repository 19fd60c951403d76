// The CUDA kernels of Adam with 8-bit moments (ops/adam.h, run_adam_8bit): a
// registration unit's share of Adam, compiled on its own beside register_adam.cu.
#include "../ops/adam.h"
#include "multi_tensor_apply.cuh"

MP_ADAM_8BIT(, mixedprec::cuda::CudaEngine)
