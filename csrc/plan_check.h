// A param group's plan check in one native pass (mixedprec/optim/plans.py): whether the
// group's params and gradients are as they were when the plan was made, and then those
// gradients. The Python check reads six attributes per parameter, each a map over the
// list (~150 us a step on ResNet-50's 161 tensors on a slow core); this reads them from
// the tensors themselves. Not an operator: it reads autograd's .grad, which no op
// schema can describe, so it is a TorchScript class (torch.classes.mixedprec.PlanCheck,
// registered in ops.cpp), built once per plan and called once per step.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace mixedprec {

struct PlanCheck : torch::CustomClassHolder {
  // What the plan was made from: the group's params in order, each one's gradient as
  // the update read it (None: the parameter did not step), the masters the plan holds
  // (a master's .grad, set since, is read instead of its parameter's: the answer is
  // then Python's), and whether the params' versions count (a write outside a step).
  PlanCheck(const c10::List<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& grads,
            c10::List<at::Tensor> masters, bool versions);

  // The gradients of the params that stepped when `params` (the group's list now) have
  // the storage addresses and (with versions) versions they had, no master has a
  // gradient, and each parameter that stepped has a dense gradient of the dtype it had,
  // in its parameter's memory order as then (contiguous, or the strides it had); those
  // that did not step have none. Else nullopt: the caller then checks in Python, which
  // also tells a plan that no longer holds from one that needs a check per gradient.
  std::optional<std::vector<at::Tensor>> gradients(const c10::List<at::Tensor>& params) const;

 private:
  struct Planned {
    const void* data;
    int64_t version;  // -1: not compared
    // the gradient's dtype; nullopt: the parameter had no gradient
    std::optional<at::ScalarType> grad_dtype;
    bool contiguous;               // the parameter was contiguous
    std::vector<int64_t> strides;  // else its strides
  };
  std::vector<Planned> planned_;
  std::vector<at::Tensor> masters_;
  int64_t stepped_ = 0;
};

}  // namespace mixedprec
