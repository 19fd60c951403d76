// Every op family (one header each in csrc/ops/) and every entry on one engine:
// ops.cpp registers them all for calls without tensors, and the tests call them. The
// backends register them in units (ops/unit.h): csrc/cpu/register*.cpp,
// csrc/cuda/register*.cu.
#pragma once

#include <torch/library.h>

#include "adam.h"
#include "lists.h"
#include "optimizers.h"
#include "unit.h"

namespace mixedprec {

// Every op's entry on one engine (ops.cpp's, for calls without tensors).
template <class Engine>
void register_kernels(torch::Library& m) {
  register_list_ops<Engine>(m);
  register_adam_ops<Engine>(m);
  register_other_optimizer_ops<Engine>(m);
}

}  // namespace mixedprec
