// How every entry is registered with the dispatcher: kernel<&entry::foo_<Engine>>()
// in the families' register_*_ops. The entry is called as torch's boxed-from-unboxed
// wrapper would call it, with two differences, both for the step's fixed cost on many
// small tensors (bench/README.md, "The op call's tensor references"):
//
// - A Tensor[] argument reaches the entry as a TensorList of the stack's own tensors,
//   borrowed: no copy of the list and no reference count touched per tensor (torch's
//   wrapper copies each list into a std::vector, one increment and one decrement per
//   tensor: 644 of them in fused_sgd_ on ResNet-50's 161 params with masters).
// - The call's arguments are released afterwards holding Python's GIL once, where
//   torch would take it once per tensor. In torch 2.11 (c10/util/intrusive_ptr.h;
//   older releases are left as they were, below) a tensor that Python alone owns (a
//   parameter, a state tensor) gets a C++ reference from a call through torch.ops,
//   and releasing that reference (its count going from 2 to 1) gives its Python object
//   back, taking the GIL, which torch.ops released for the call.
#pragma once

#include <ATen/core/boxing/impl/make_boxed_from_unboxed_functor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

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

// A Tensor[] argument as the entry's TensorList: the stack's tensors, borrowed (each
// pointer taken without an increment and given back without a decrement; the stack
// holds them for the call).
class BorrowedList {
 public:
  explicit BorrowedList(const c10::IValue& list) {
    const auto items = list.toListRef();
    tensors_.reserve(items.size());
    for (const c10::IValue& item : items) {
      tensors_.emplace_back(c10::intrusive_ptr<at::TensorImpl, c10::UndefinedTensorImpl>::reclaim(
          item.unsafeToTensorImpl()));
    }
  }
  BorrowedList(const BorrowedList&) = delete;
  BorrowedList& operator=(const BorrowedList&) = delete;
  ~BorrowedList() {
    for (at::Tensor& t : tensors_) (void)t.unsafeReleaseTensorImpl();
  }
  at::TensorList get() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

// An argument of the entry's parameter type T, read from the stack: Tensor[] and
// Tensor[]? borrowed, anything else converted as torch's wrapper converts it (from a
// copy of the value, so that the stack keeps its references until they are released).
template <class T>
struct Arg {
  using Value = std::decay_t<decltype(c10::impl::ivalue_to_arg<T, false>::call(
      std::declval<c10::IValue&>()))>;
  explicit Arg(const c10::IValue& v) : value(convert(v)) {}
  static Value convert(c10::IValue v) { return c10::impl::ivalue_to_arg<T, false>::call(v); }
  Value& get() { return value; }
  Value value;
};

template <>
struct Arg<at::TensorList> {
  explicit Arg(const c10::IValue& v) : list(v) {}
  at::TensorList get() const { return list.get(); }
  BorrowedList list;
};

template <>
struct Arg<std::optional<at::TensorList>> {
  explicit Arg(const c10::IValue& v) {
    if (!v.isNone()) list.emplace(v);
  }
  std::optional<at::TensorList> get() const {
    return list.has_value() ? std::optional<at::TensorList>(list->get()) : std::nullopt;
  }
  std::optional<BorrowedList> list;
};

template <class T>
using ArgOf = Arg<std::remove_cv_t<std::remove_reference_t<T>>>;

// fn(args...) with each argument read from `inputs`; its outputs pushed onto `stack`.
template <auto fn, class... Params, size_t... I>
void call_with(const torch::jit::Stack& inputs, torch::jit::Stack* stack,
               c10::guts::typelist::typelist<Params...>* /*params: a null tag*/,
               std::index_sequence<I...> /*indices*/) {
  // (Through a pointer read at run time, so that each unit emits the entry it
  // registers: the C++ tests link those instantiations, tests/cpp/cpu_entries.h.)
  static decltype(fn) volatile entry = fn;
  std::tuple<ArgOf<Params>...> args(inputs[I]...);  // (each Arg built in place)
  using Return = typename c10::guts::infer_function_traits_t<decltype(fn)>::return_type;
  if constexpr (std::is_void_v<Return>) {
    entry(std::get<I>(args).get()...);
  } else {
    c10::impl::push_outputs<Return, false>::call(entry(std::get<I>(args).get()...), stack);
  }
}

template <auto fn>
void call(const c10::OperatorHandle& op, c10::DispatchKeySet /*keys*/, torch::jit::Stack* stack) {
  using Traits = c10::guts::infer_function_traits_t<decltype(fn)>;
  const auto n = static_cast<std::ptrdiff_t>(op.schema().arguments().size());
  TORCH_INTERNAL_ASSERT(n == static_cast<std::ptrdiff_t>(Traits::number_of_parameters));
  torch::jit::Stack inputs(std::make_move_iterator(stack->end() - n),
                           std::make_move_iterator(stack->end()));
  stack->erase(stack->end() - n, stack->end());
  // (typelist is never constructed: its default constructor is deleted, which C++20,
  // torch 2.15's standard, no longer lets `{}` pass as an aggregate's initialization)
  call_with<fn>(inputs, stack, static_cast<typename Traits::parameter_types*>(nullptr),
                std::make_index_sequence<Traits::number_of_parameters>());
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
