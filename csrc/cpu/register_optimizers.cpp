// The CPU kernels of SGD, LAMB, Adagrad and NovoGrad: one of the registration units
// (csrc/ops/unit.h, MP_REGISTER_UNIT), compiled on its own.
#include <torch/library.h>

#include "../ops/optimizers.h"
#include "../ops/unit.h"
#include "engine.h"

MP_REGISTER_UNIT(register_other_optimizer_ops, mixedprec::cpu::CpuEngine, CPU, SparseCPU,
                 SparseCsrCPU)
MP_REGISTER_NO_TENSOR_UNIT(register_other_optimizer_ops)
