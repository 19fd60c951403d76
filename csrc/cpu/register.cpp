// The CPU kernels of the list ops (unscale, finite check, copy, L2 norm,
// sum, loss scale): one of the registration units (csrc/ops/unit.h, MP_REGISTER_UNIT),
// compiled on its own.
#include <torch/library.h>

#include "../ops/lists.h"
#include "../ops/unit.h"
#include "engine.h"

MP_REGISTER_UNIT(register_list_ops, mixedprec::cpu::CpuEngine, CPU, SparseCPU, SparseCsrCPU)
MP_REGISTER_NO_TENSOR_UNIT(register_list_ops)
