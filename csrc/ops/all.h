// Every op family (one header each in csrc/ops/) and register_kernels, which the
// backends call to register every op's entry on their engine for their dispatch keys
// (csrc/cpu/register.cpp, csrc/cuda/register.cu; csrc/ops.cpp for calls without tensors).
#pragma once

#include <torch/library.h>

#include "loss_scale.h"
#include "multi_tensor.h"
#include "optimizers.h"
#include "sum.h"

namespace mixedprec {

// Every op's entry on one engine: a backend registers them for its dispatch keys.
template <class Engine>
void register_kernels(torch::Library& m) {
  register_multi_tensor_ops<Engine>(m);
  register_optimizer_ops<Engine>(m);
  register_sum_ops<Engine>(m);
  register_loss_scale_ops<Engine>(m);
}

}  // namespace mixedprec
