// The CPU kernels of Adam with 8-bit moments (ops/adam.h, run_adam_8bit): a
// registration unit's share of Adam, compiled on its own beside register_adam.cpp.
#include "../ops/adam.h"
#include "engine.h"

MP_ADAM_8BIT(, mixedprec::cpu::CpuEngine)
