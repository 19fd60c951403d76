// The CPU kernels of Adam: one of the registration units
// (csrc/ops/unit.h, MP_REGISTER_UNIT), compiled on its own.
#include <torch/library.h>

#include "../ops/adam.h"
#include "../ops/unit.h"
#include "engine.h"

MP_REGISTER_UNIT(register_adam_ops, mixedprec::cpu::CpuEngine, CPU, SparseCPU, SparseCsrCPU)
MP_REGISTER_NO_TENSOR_UNIT(register_adam_ops)
