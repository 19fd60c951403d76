// A registration unit: a backend's source file that registers one part of the ops
// (register_list_ops, ops/lists.h; register_adam_ops, ops/adam.h;
// register_other_optimizer_ops, ops/optimizers.h) on its engine. Each unit includes
// only its part's header, so the units build in parallel and an edit of one part's
// entry or functor rebuilds its units only (csrc/README.md lists them).
#pragma once

#include <torch/library.h>

// `family` on `engine` for the backend's dense and sparse dispatch keys (sparse tensors
// reach the same kernels, whose validation rejects them by name).
#define MP_REGISTER_UNIT(family, engine, dense, sparse, sparse_csr)          \
  TORCH_LIBRARY_IMPL(mixedprec, dense, m) { mixedprec::family<engine>(m); }  \
  TORCH_LIBRARY_IMPL(mixedprec, sparse, m) { mixedprec::family<engine>(m); } \
  TORCH_LIBRARY_IMPL(mixedprec, sparse_csr, m) { mixedprec::family<engine>(m); }

// `family` on NoTensorEngine (dispatch.h) for the calls that hold no tensor at all, which
// have no dispatch key: the dispatcher sends them to the CompositeExplicitAutograd
// kernel. Registered by the CPU's units, which every build has.
#define MP_REGISTER_NO_TENSOR_UNIT(family)                      \
  TORCH_LIBRARY_IMPL(mixedprec, CompositeExplicitAutograd, m) { \
    mixedprec::family<mixedprec::NoTensorEngine>(m);            \
  }
