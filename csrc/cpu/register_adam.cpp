// The CPU kernels of Adam but its 8-bit moments': one of the registration units
// (csrc/ops/unit.h, MP_REGISTER_UNIT), compiled on its own.
#include <torch/library.h>

#include "../ops/adam.h"
#include "../ops/unit.h"
#include "engine.h"

// (the 8-bit moments' kernels are register_adam8.cpp's)
MP_ADAM_8BIT(extern, mixedprec::cpu::CpuEngine)

MP_REGISTER_UNIT(register_adam_ops, mixedprec::cpu::CpuEngine, CPU, SparseCPU, SparseCsrCPU)
