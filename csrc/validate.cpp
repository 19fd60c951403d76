#include "validate.h"

#include <c10/util/Exception.h>

#include <string>

namespace mixedprec {
namespace {

unsigned bit(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kDouble: return kF64;
    case at::kInt: return kI32;
    default: return 0;
  }
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "Float32";
    case at::kHalf: return "Float16";
    case at::kBFloat16: return "BFloat16";
    case at::kDouble: return "Float64";
    case at::kInt: return "Int32";
    default: return c10::toString(t);
  }
}

std::string dtype_names(unsigned set) {
  std::string out;
  const at::ScalarType all[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kInt};
  for (auto t : all) {
    if (!(set & bit(t))) continue;
    out += (out.empty() ? "" : ", ") + dtype_name(t);
  }
  return out;
}

}  // namespace

std::ostream& operator<<(std::ostream& out, const ArgName& arg) {
  out << arg.name;
  if (arg.index >= 0) out << "[" << arg.index << "]";
  return out;
}

void Checker::check(const at::Tensor& t, ArgName name, unsigned dtypes) {
  TORCH_CHECK_TYPE(t.defined(), op_, ": expected ", name, " to be a tensor, got None");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, op_, ": expected ", name,
                   " to be a dense (strided) tensor, got layout ", t.layout());
  if (device_name_.has_value()) {
    TORCH_CHECK(t.device() == device_, op_, ": expected ", name, " on ", device_,
                " (the device of ", *device_name_, "), got ", t.device());
  } else {
    device_ = t.device();
    device_name_ = name;
  }
  TORCH_CHECK_TYPE(bit(t.scalar_type()) & dtypes, op_, ": expected ", name, " to have dtype ",
                   dtype_names(dtypes), ", got ", dtype_name(t.scalar_type()));
}

void Checker::tensor(const at::Tensor& t, const char* name, unsigned dtypes) {
  check(t, ArgName{name, -1}, dtypes);
}

void Checker::scalar(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  check(t, ArgName{name, -1}, bit(dtype));
  TORCH_CHECK_VALUE(t.numel() == 1, op_, ": expected ", name,
                    " to have exactly one element, got ", t.numel());
}

void Checker::optional_scalar(const std::optional<at::Tensor>& t, const char* name) {
  if (t.has_value()) scalar(*t, name, at::kFloat);
}

void Checker::list(at::TensorList l, const char* name, unsigned dtypes) {
  for (size_t i = 0; i < l.size(); ++i) {
    const ArgName n{name, static_cast<int64_t>(i)};
    check(l[i], n, dtypes);
    TORCH_CHECK_VALUE(l[i].is_non_overlapping_and_dense(), op_, ": expected ", n,
                      " to be dense and non-overlapping (contiguous or a permutation "
                      "such as channels_last), got sizes ",
                      l[i].sizes(), " and strides ", l[i].strides());
  }
}

void Checker::paired(at::TensorList a, const char* a_name, at::TensorList b,
                     const char* b_name) {
  TORCH_CHECK_VALUE(a.size() == b.size(), op_, ": expected ", b_name,
                    " to hold as many tensors as ", a_name, " (", a.size(), "), got ",
                    b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const ArgName an{a_name, static_cast<int64_t>(i)}, bn{b_name, static_cast<int64_t>(i)};
    TORCH_CHECK_VALUE(a[i].numel() == b[i].numel(), op_, ": expected ", bn, " to have ",
                      a[i].numel(), " elements like ", an, ", got ", b[i].numel());
    const bool same_order =
        (a[i].is_contiguous() && b[i].is_contiguous()) ||
        (a[i].sizes() == b[i].sizes() && a[i].strides() == b[i].strides());
    TORCH_CHECK_VALUE(same_order, op_, ": expected ", bn, " to have the memory layout of ", an,
                      " (strides ", a[i].strides(), "), got sizes ", b[i].sizes(),
                      " and strides ", b[i].strides());
  }
}

void Checker::value(bool ok, const char* name, const char* expected, double got) {
  TORCH_CHECK_VALUE(ok, op_, ": expected ", name, " to be ", expected, ", got ", got);
}

void check_params(Checker& c, at::TensorList params, at::TensorList grads,
                  at::TensorList model_params) {
  if (model_params.empty()) {
    c.list(params, "params", kFloats);
  } else {
    c.list(params, "params", kF32);
  }
  c.list(grads, "grads", kFloats);
  c.paired(params, "params", grads, "grads");
  if (!model_params.empty()) {
    c.list(model_params, "model_params", kFloats);
    c.paired(params, "params", model_params, "model_params");
  }
}

}  // namespace mixedprec
