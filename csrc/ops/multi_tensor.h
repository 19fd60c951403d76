// The multi-tensor ops' entries: unscale (in place and into other tensors), the
// finite check, the cast copy and the L2 norm. Each checks its arguments before
// anything is written, makes the data's device current, and runs on the engine.
// Signatures follow the schemas in csrc/ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../dispatch.h"
#include "../pointwise_lists.h"
#include "kernel.h"

namespace mixedprec {

// The drivers of the list ops' functors (pointwise_lists.h): each group of equal dtypes
// onto the engine.
template <class Engine>
void run_scale(at::TensorList src, at::TensorList dst, const float* inv_scale, float* found_inf) {
  ScaleOp op;
  op.inv_scale_ptr = inv_scale;
  for (const auto& g : group_by_dtype<2>({src, dst})) {
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "multi_tensor_scale", src_t, [&] {
      MP_DISPATCH_FLOATS(g[1][0].scalar_type(), "multi_tensor_scale", dst_t, [&] {
        Engine::template run<ScaleOp, src_t, dst_t>(g, op, nullptr, found_inf);
      });
    });
  }
}

template <class Engine>
void run_check_finite(at::TensorList tensors, float* found_inf) {
  for (const auto& g : group_by_dtype<1>({tensors})) {
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "multi_tensor_check_finite_", scalar_t, [&] {
      Engine::template run<CheckFiniteOp, scalar_t>(g, CheckFiniteOp{}, nullptr, found_inf);
    });
  }
}

namespace entry {

template <class Engine>
void multi_tensor_unscale_(at::TensorList tensors, const at::Tensor& found_inf,
                           const at::Tensor& inv_scale) {
  Checker c("multi_tensor_unscale_");
  c.scalar(found_inf, "found_inf", at::kFloat, Access::kWrite);
  c.scalar(inv_scale, "inv_scale", at::kFloat);
  c.list(tensors, "tensors", kFloats, Access::kWrite);
  c.no_overlap();
  const typename Engine::Guard guard(found_inf.device());
  run_scale<Engine>(tensors, tensors, inv_scale.const_data_ptr<float>(),
                    found_inf.data_ptr<float>());
}

template <class Engine>
void multi_tensor_unscale_to_(at::TensorList src, at::TensorList dst, const at::Tensor& found_inf,
                              const at::Tensor& inv_scale) {
  Checker c("multi_tensor_unscale_to_");
  c.scalar(found_inf, "found_inf", at::kFloat, Access::kWrite);
  c.scalar(inv_scale, "inv_scale", at::kFloat);
  c.list(src, "src", kFloats, Access::kRead, /*twins=*/dst);
  c.list(dst, "dst", kFloats, Access::kWrite);
  c.paired(src, "src", dst, "dst");
  c.no_overlap();
  const typename Engine::Guard guard(found_inf.device());
  run_scale<Engine>(src, dst, inv_scale.const_data_ptr<float>(), found_inf.data_ptr<float>());
}

template <class Engine>
void multi_tensor_check_finite_(at::TensorList tensors, const at::Tensor& found_inf) {
  Checker c("multi_tensor_check_finite_");
  c.scalar(found_inf, "found_inf", at::kFloat, Access::kWrite);
  c.list(tensors, "tensors", kFloats);
  c.no_overlap();
  const typename Engine::Guard guard(found_inf.device());
  run_check_finite<Engine>(tensors, found_inf.data_ptr<float>());
}

template <class Engine>
void multi_tensor_copy_(at::TensorList src, at::TensorList dst) {
  Checker c("multi_tensor_copy_");
  c.list(src, "src", kFloats, Access::kRead, /*twins=*/dst);
  c.list(dst, "dst", kFloats, Access::kWrite);
  c.paired(src, "src", dst, "dst");
  c.no_overlap();
  if (src.empty()) return;
  const typename Engine::Guard guard(src[0].device());
  run_scale<Engine>(src, dst, nullptr, nullptr);
}

template <class Engine>
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors,
                                                       const std::optional<at::Tensor>& inv_scale,
                                                       bool per_tensor) {
  Checker c("multi_tensor_l2norm");
  c.optional_scalar(inv_scale, "inv_scale");
  c.list(tensors, "tensors", kFloats);
  if (tensors.empty() && !inv_scale.has_value()) {
    // No tensor to take a device from (the dispatcher sends this call to the
    // CompositeExplicitAutograd kernel): the norm of nothing, on the CPU.
    const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
    return {at::zeros({1}, options), at::empty({0}, options)};
  }
  const at::Device device = tensors.empty() ? inv_scale->device() : tensors[0].device();
  const typename Engine::Guard guard(device);
  return Engine::l2norm(tensors, optional_ptr(inv_scale), per_tensor, device);
}

}  // namespace entry

// This family's entries on one engine (register_list_ops, ops/lists.h).
template <class Engine>
void register_multi_tensor_ops(torch::Library& m) {
  m.impl("multi_tensor_unscale_", kernel<&entry::multi_tensor_unscale_<Engine>>());
  m.impl("multi_tensor_unscale_to_", kernel<&entry::multi_tensor_unscale_to_<Engine>>());
  m.impl("multi_tensor_check_finite_", kernel<&entry::multi_tensor_check_finite_<Engine>>());
  m.impl("multi_tensor_copy_", kernel<&entry::multi_tensor_copy_<Engine>>());
  m.impl("multi_tensor_l2norm", kernel<&entry::multi_tensor_l2norm<Engine>>());
}

}  // namespace mixedprec
