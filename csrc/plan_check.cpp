#include "plan_check.h"

#include <utility>

namespace mixedprec {

PlanCheck::PlanCheck(const c10::List<at::Tensor>& params,
                     const c10::List<std::optional<at::Tensor>>& grads,
                     c10::List<at::Tensor> masters, bool versions)
    : masters_(masters.vec()) {
  TORCH_CHECK(params.size() == grads.size(), "PlanCheck: expected a gradient or None per ",
              "parameter, got ", grads.size(), " for ", params.size(), " parameters");
  planned_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor p = params.get(i);
    const std::optional<at::Tensor> grad = grads.get(i);
    TORCH_CHECK(p.has_storage(), "PlanCheck: params[", i, "] has no storage");
    Planned entry{p.const_data_ptr(),
                  versions ? static_cast<int64_t>(p._version()) : -1,
                  std::nullopt,
                  p.is_contiguous(),
                  {}};
    if (grad.has_value() && grad->defined()) {
      entry.grad_dtype = grad->scalar_type();
      ++stepped_;
    }
    if (!entry.contiguous) entry.strides = p.strides().vec();
    planned_.push_back(std::move(entry));
  }
}

std::optional<std::vector<at::Tensor>> PlanCheck::gradients(
    const c10::List<at::Tensor>& params) const {
  if (params.size() != planned_.size()) return std::nullopt;
  try {
    for (const at::Tensor& master : masters_) {
      if (master.grad().defined()) return std::nullopt;
    }
    std::vector<at::Tensor> grads;
    grads.reserve(stepped_);
    for (size_t i = 0; i < planned_.size(); ++i) {
      const Planned& planned = planned_[i];
      const at::Tensor& p = params.get(i);
      // (a tensor without storage, a wrapper subclass, has no address to compare)
      if (!p.has_storage() || p.const_data_ptr() != planned.data ||
          (planned.version >= 0 && static_cast<int64_t>(p._version()) != planned.version)) {
        return std::nullopt;
      }
      const at::Tensor& grad = p.grad();
      if (grad.defined() != planned.grad_dtype.has_value()) return std::nullopt;
      if (!grad.defined()) continue;
      if (grad.layout() != at::kStrided || grad.scalar_type() != *planned.grad_dtype ||
          grad.is_contiguous() != planned.contiguous ||
          (!planned.contiguous && grad.strides() != at::IntArrayRef(planned.strides))) {
        return std::nullopt;
      }
      grads.push_back(grad);
    }
    return grads;
  } catch (const c10::Error&) {  // (an inference tensor has no version: Python's answer)
    return std::nullopt;
  }
}

}  // namespace mixedprec
