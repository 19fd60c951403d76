// Every op family (one header each in csrc/ops/) and how the backends register the
// entries on their engine for their dispatch keys (csrc/cpu/register*.cpp,
// csrc/cuda/register*.cu; csrc/ops.cpp for calls without tensors).
#pragma once

#include <torch/library.h>

#include "loss_scale.h"
#include "multi_tensor.h"
#include "optimizers.h"
#include "sum.h"

namespace mixedprec {

// A backend registers its kernels in three units (csrc/cpu/register*.cpp,
// csrc/cuda/register*.cu), which build in parallel, and an edit of one family's entry
// rebuilds its unit only: Adam's (register_adam_ops, optimizers.h), the other
// optimizers' (register_other_optimizer_ops) and the list ops' (this one).
template <class Engine>
void register_list_ops(torch::Library& m) {
  register_multi_tensor_ops<Engine>(m);
  register_sum_ops<Engine>(m);
  register_loss_scale_ops<Engine>(m);
}

// Every op's entry on one engine (ops.cpp's, for calls without tensors).
template <class Engine>
void register_kernels(torch::Library& m) {
  register_list_ops<Engine>(m);
  register_adam_ops<Engine>(m);
  register_other_optimizer_ops<Engine>(m);
}

}  // namespace mixedprec

// A backend unit's registration of `family` (one of the register_*_ops above) on
// `engine` for the backend's dense and sparse dispatch keys (sparse tensors reach the
// same kernels, whose validation rejects them by name).
#define MP_REGISTER_UNIT(family, engine, dense, sparse, sparse_csr)          \
  TORCH_LIBRARY_IMPL(mixedprec, dense, m) { mixedprec::family<engine>(m); }  \
  TORCH_LIBRARY_IMPL(mixedprec, sparse, m) { mixedprec::family<engine>(m); } \
  TORCH_LIBRARY_IMPL(mixedprec, sparse_csr, m) { mixedprec::family<engine>(m); }
