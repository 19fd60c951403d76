// The list ops' families (multi_tensor.h, sum.h, loss_scale.h), registered together:
// one registration unit per backend (csrc/cpu/register.cpp, csrc/cuda/register.cu).
#pragma once

#include <torch/library.h>

#include "loss_scale.h"
#include "multi_tensor.h"
#include "sum.h"

namespace mixedprec {

template <class Engine>
void register_list_ops(torch::Library& m) {
  register_multi_tensor_ops<Engine>(m);
  register_sum_ops<Engine>(m);
  register_loss_scale_ops<Engine>(m);
}

}  // namespace mixedprec
