// How every entry is registered with the dispatcher: kernel<&entry::foo_<Engine>>()
// in the families' register_*_ops. The entry runs as torch's boxed-from-unboxed
// wrapper would run it, on a copy of the call's arguments; the arguments themselves
// are then released holding Python's GIL once, where torch would take it once per
// tensor.
//
// Why: in torch 2.11 (c10/util/intrusive_ptr.h; older releases are left as they
// were, below) a tensor that Python alone owns (a parameter, a state tensor)
// gets a C++ reference from a call through torch.ops, and releasing that reference
// (its count going from 2 to 1) gives its Python object back, taking the GIL, which
// torch.ops released for the call. On ResNet-50's 161 tensors, fused_sgd_'s 644 took
// ~33 us of a ~72 us call (bench/README.md, "The op call's tensor references"). A
// copy of the stack copies its list values, not the tensors in them, and the entry's
// own copies of the tensors never bring a count to 1.
#pragma once

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <cstddef>
#include <iterator>

#include "../python_gil.h"

namespace mixedprec {

namespace detail {

// Whether releasing t's reference in the stack gives its Python object back (the
// count then goes from 2 to 1: the stack's reference and the Python object's own).
inline bool returns_python_object(const at::Tensor& t) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
  return t.defined() && t.use_count() == 2 &&
         t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj() != nullptr;
#else
  (void)t;
  return false;
#endif
}

inline bool returns_python_object(const c10::IValue& value) {
  if (value.isTensor()) return returns_python_object(value.toTensor());
  if (value.isList()) {  // (Tensor[] and Tensor?[] alike)
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor() && returns_python_object(item.toTensor())) return true;
    }
  }
  return false;
}

inline void drop_inputs(void* arg) {
  auto* inputs = static_cast<torch::jit::Stack*>(arg);
  inputs->clear();
}

template <auto fn>
void call(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  // (From a pointer held at run time, so that each unit emits the entry it registers:
  // the C++ tests link those instantiations, tests/cpp/cpu_entries.h.)
  static const c10::KernelFunction unboxed =
      c10::KernelFunction::makeFromUnboxedRuntimeFunction(fn);
  const auto n = static_cast<std::ptrdiff_t>(op.schema().arguments().size());
  torch::jit::Stack inputs(std::make_move_iterator(stack->end() - n),
                           std::make_move_iterator(stack->end()));
  stack->erase(stack->end() - n, stack->end());
  {
    torch::jit::Stack copy(inputs.begin(), inputs.end());  // lists: their pointers only
    unboxed.callBoxed(op, keys, &copy);                    // takes the copy, leaves outputs
    stack->insert(stack->end(), std::make_move_iterator(copy.begin()),
                  std::make_move_iterator(copy.end()));
  }
  const bool python = std::any_of(inputs.begin(), inputs.end(),
                                  [](const c10::IValue& v) { return returns_python_object(v); });
  if (python && hold_python_gil != nullptr) hold_python_gil(&drop_inputs, &inputs);
}

}  // namespace detail

// An entry as the dispatcher's kernel for an m.impl line (see above).
template <auto fn>
torch::CppFunction kernel() {
  return torch::CppFunction::makeFromBoxedFunction<&detail::call<fn>>();
}

}  // namespace mixedprec
