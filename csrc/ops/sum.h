// sum_fp32's entry: a sum of fp16/bf16/fp32 accumulated and returned in fp32.
// Signature: the schema in csrc/ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include "../dispatch.h"
#include "kernel.h"

namespace mixedprec {
namespace entry {

template <class Engine>
at::Tensor sum_fp32(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim) {
  Checker c("sum_fp32");
  c.tensor(self, "self", kFloats | kF64);
  const typename Engine::Guard guard(self.device());
  // ATen's reduction reads the input in its own dtype and accumulates and writes in
  // the requested one (on CUDA without an fp32 copy of the input).
  const auto out_dtype = self.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::sum(self, dim, keepdim, out_dtype);
}

}  // namespace entry

// This family's entries on one engine (register_list_ops, ops/lists.h).
template <class Engine>
void register_sum_ops(torch::Library& m) {
  m.impl("sum_fp32", kernel<&entry::sum_fp32<Engine>>());
}

}  // namespace mixedprec
