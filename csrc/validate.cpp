#include "validate.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "lanes.h"

namespace mixedprec {
namespace {

unsigned bit(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kDouble: return kF64;
    case at::kInt: return kI32;
    case at::kLong: return kI64;
    case at::kShort: return kI16;
    case at::kFloat8_e4m3fn: return kF8E4M3;
    case at::kFloat8_e8m0fnu: return kE8M0;
    case at::kByte: return kU8;
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
    case at::kLong: return "Int64";
    case at::kShort: return "Int16";
    default: return c10::toString(t);
  }
}

std::string dtype_names(unsigned set) {
  std::string out;
  const at::ScalarType all[] = {
      at::kFloat, at::kHalf,  at::kBFloat16,      at::kDouble,         at::kInt,
      at::kLong,  at::kShort, at::kFloat8_e4m3fn, at::kFloat8_e8m0fnu, at::kByte};
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

void Checker::check(const at::Tensor& t, ArgName name, unsigned dtypes, Access access) {
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
  // Its bytes, for no_overlap(). const_data_ptr: no copy-on-write materialisation.
  // Empty tensors and tensors without data (meta) hold no bytes.
  if (t.numel() == 0) return;
  const void* data = t.const_data_ptr();
  if (data == nullptr) return;
  int64_t span = 1;  // elements from the first to the last one, inclusive
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) span += (sizes[d] - 1) * strides[d];
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const auto end = begin + static_cast<uintptr_t>(span) * t.element_size();
  ranges_.push_back(Range{begin, end, name, ranges_.size(), access == Access::kWrite});
  any_written_ = any_written_ || access == Access::kWrite;
}

void Checker::tensor(const at::Tensor& t, const char* name, unsigned dtypes, Access access) {
  check(t, ArgName{name, -1}, dtypes, access);
}

void Checker::scalar(const at::Tensor& t, const char* name, at::ScalarType dtype, Access access) {
  check(t, ArgName{name, -1}, bit(dtype), access);
  TORCH_CHECK_VALUE(t.numel() == 1, op_, ": expected ", name, " to have exactly one element, got ",
                    t.numel());
}

void Checker::optional_scalar(const std::optional<at::Tensor>& t, const char* name) {
  if (t.has_value()) scalar(*t, name, at::kFloat);
}

namespace {

// The same view of the same memory: what an in-place call passes twice.
// a is validated (strided); b, of a list checked later, may be anything.
bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return b.defined() && b.layout() == at::kStrided && a.const_data_ptr() == b.const_data_ptr() &&
         a.dtype() == b.dtype() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace

void Checker::list(at::TensorList l, const char* name, unsigned dtypes, Access access,
                   at::TensorList twins) {
  for (size_t i = 0; i < l.size(); ++i) {
    const ArgName n{name, static_cast<int64_t>(i)};
    const size_t ranges_before = ranges_.size();
    check(l[i], n, dtypes, access);
    // An element that is its (written) twin adds no range: any overlap with it is one
    // with the twin, which is checked.
    if (i < twins.size() && same_view(l[i], twins[i])) {
      ranges_.resize(ranges_before);
    }
    TORCH_CHECK_VALUE(l[i].is_non_overlapping_and_dense(), op_, ": expected ", n,
                      " to be dense and non-overlapping (contiguous or a permutation "
                      "such as channels_last), got sizes ",
                      l[i].sizes(), " and strides ", l[i].strides());
  }
}

void Checker::paired(at::TensorList a, const char* a_name, at::TensorList b, const char* b_name) {
  TORCH_CHECK_VALUE(a.size() == b.size(), op_, ": expected ", b_name,
                    " to hold as many tensors as ", a_name, " (", a.size(), "), got ", b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const ArgName an{a_name, static_cast<int64_t>(i)}, bn{b_name, static_cast<int64_t>(i)};
    TORCH_CHECK_VALUE(a[i].numel() == b[i].numel(), op_, ": expected ", bn, " to have ",
                      a[i].numel(), " elements like ", an, ", got ", b[i].numel());
    const bool same_order = (a[i].is_contiguous() && b[i].is_contiguous()) ||
                            (a[i].sizes() == b[i].sizes() && a[i].strides() == b[i].strides());
    TORCH_CHECK_VALUE(same_order, op_, ": expected ", bn, " to have the memory layout of ", an,
                      " (strides ", a[i].strides(), "), got sizes ", b[i].sizes(), " and strides ",
                      b[i].strides());
  }
}

void Checker::same_dtypes(at::TensorList a, const char* a_name, at::TensorList b,
                          const char* b_name) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const ArgName an{a_name, static_cast<int64_t>(i)}, bn{b_name, static_cast<int64_t>(i)};
    TORCH_CHECK_TYPE(a[i].scalar_type() == b[i].scalar_type(), op_, ": expected ", bn,
                     " to have the dtype of ", an, " (", a[i].scalar_type(), "), got ",
                     b[i].scalar_type());
  }
}

void Checker::per_tensor(at::TensorList l, const char* name, at::TensorList of, const char* of_name,
                         int64_t words, unsigned word_dtypes, Access access) {
  TORCH_CHECK_VALUE(l.size() == of.size(), op_, ": expected ", name,
                    " to hold one tensor for each of the ", of.size(), " tensors of ", of_name,
                    ", got ", l.size(), " tensors");
  for (size_t i = 0; i < l.size(); ++i) {
    const ArgName n{name, static_cast<int64_t>(i)};
    check(l[i], n, words > 0 ? word_dtypes : kF32, access);
    if (words == 0) {
      TORCH_CHECK_VALUE(l[i].numel() == 1, op_, ": expected ", n,
                        " to have exactly one element, got ", l[i].numel());
    } else {
      TORCH_CHECK_VALUE(l[i].numel() == words && l[i].is_contiguous(), op_, ": expected ", n,
                        " to be a contiguous tensor of ", words, " elements, got ", l[i].numel(),
                        " elements", l[i].is_contiguous() ? "" : ", not contiguous");
    }
  }
}

void Checker::value(bool ok, const char* name, const char* expected, double got) {
  TORCH_CHECK_VALUE(ok, op_, ": expected ", name, " to be ", expected, ", got ", got);
}

void Checker::no_overlap() {
  if (!any_written_) return;  // reads may share memory
  std::sort(ranges_.begin(), ranges_.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  // Sweep in address order, keeping the range that reaches furthest and the written
  // one that does. A range that starts before either ends overlaps it; every
  // overlapping pair with a written member is caught so, at its later-starting one.
  const Range* reach = nullptr;
  const Range* reach_written = nullptr;
  for (const Range& r : ranges_) {
    const Range* hit = nullptr;
    if (r.written && reach != nullptr && r.begin < reach->end) hit = reach;
    if (!r.written && reach_written != nullptr && r.begin < reach_written->end) {
      hit = reach_written;
    }
    if (hit != nullptr) {
      const Range& first = hit->order < r.order ? *hit : r;
      const Range& second = hit->order < r.order ? r : *hit;
      TORCH_CHECK_VALUE(false, op_, ": ", first.name, " overlaps ", second.name,
                        " in memory, and the op writes ", first.written ? first.name : second.name,
                        ": expected tensors that share no memory");
    }
    if (reach == nullptr || r.end > reach->end) reach = &r;
    if (r.written && (reach_written == nullptr || r.end > reach_written->end)) {
      reach_written = &r;
    }
  }
}

void check_params(Checker& c, at::TensorList params, at::TensorList grads,
                  at::TensorList model_params, Access grads_access) {
  c.list(params, "params", model_params.empty() ? kFloats : kF32, Access::kWrite);
  c.list(grads, "grads", kFloats, grads_access);
  c.paired(params, "params", grads, "grads");
  if (!model_params.empty()) {
    c.list(model_params, "model_params", kFloats, Access::kWrite, /*twins=*/params);
    c.paired(params, "params", model_params, "model_params");
  }
}

void check_adam_hyperparameters(Checker& c, double lr, double beta1, double beta2, double eps,
                                double weight_decay) {
  c.value(lr >= 0 && std::isfinite(lr), "lr", "a finite number >= 0", lr);
  c.value(beta1 >= 0 && beta1 < 1, "beta1", "in [0, 1)", beta1);
  c.value(beta2 >= 0 && beta2 < 1, "beta2", "in [0, 1)", beta2);
  c.value(eps >= 0 && std::isfinite(eps), "eps", "a finite number >= 0", eps);
  c.value(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay", "a finite number >= 0",
          weight_decay);
}

void check_kahan_comps(Checker& c, at::TensorList params, at::TensorList model_params,
                       at::TensorList kahan_comps) {
  if (kahan_comps.empty()) return;
  TORCH_CHECK_VALUE(model_params.empty(), c.op(),
                    ": expected model_params to be empty with "
                    "kahan_comps (Kahan summation updates bf16 params, no masters), got ",
                    model_params.size(), " tensors");
  c.list(kahan_comps, "kahan_comps", kBF16, Access::kWrite);
  c.paired(params, "params", kahan_comps, "kahan_comps");
  c.same_dtypes(kahan_comps, "kahan_comps", params, "params");
}

void check_remainders(Checker& c, at::TensorList params, at::TensorList model_params,
                      at::TensorList kahan_comps, at::TensorList remainders, bool stochastic) {
  if (remainders.empty()) return;
  TORCH_CHECK_VALUE(model_params.empty() && kahan_comps.empty() && !stochastic, c.op(),
                    ": remainders (master='remainder': bf16 params with the low halves of "
                    "their fp32 masters) expected no model_params, no kahan_comps and no "
                    "sr_seed, got ",
                    model_params.size(), " and ", kahan_comps.size(), " tensors and ",
                    stochastic ? "an sr_seed" : "no sr_seed");
  c.list(remainders, "remainders", kI16, Access::kWrite);
  c.paired(params, "params", remainders, "remainders");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_TYPE(params[i].scalar_type() == at::kBFloat16, c.op(),
                     ": remainders expected bfloat16 params, got ", params[i].scalar_type(),
                     " at params[", i, "]");
  }
}

void check_state_scales(Checker& c, at::TensorList states, const char* states_name,
                        const std::optional<at::TensorList>& scales, const char* scales_name) {
  if (!scales.has_value()) {
    c.list(states, states_name, kF32 | kBF16, Access::kWrite);
    return;
  }
  c.list(states, states_name, kF8E4M3, Access::kWrite);
  c.list(*scales, scales_name, kE8M0 | kU8, Access::kWrite);
  TORCH_CHECK_VALUE(scales->size() == states.size(), c.op(), ": expected ", states.size(), " ",
                    scales_name, " (one per tensor of ", states_name, "), got ", scales->size());
  for (size_t i = 0; i < states.size(); ++i) {
    const int64_t n = states[i].numel();
    TORCH_CHECK_VALUE(states[i].is_contiguous() && n % kQuantBlock == 0, c.op(), ": expected ",
                      ArgName{states_name, static_cast<int64_t>(i)}, " (8-bit, in blocks of ",
                      kQuantBlock, " elements) to be contiguous with a multiple of ", kQuantBlock,
                      " elements, got ", n, states[i].is_contiguous() ? "" : ", not contiguous");
    const at::Tensor& s = (*scales)[i];
    TORCH_CHECK_VALUE(s.is_contiguous() && s.numel() == n / kQuantBlock, c.op(), ": expected ",
                      ArgName{scales_name, static_cast<int64_t>(i)},
                      " to be contiguous with one scale per block of ", kQuantBlock, " elements (",
                      n / kQuantBlock, "), got ", s.numel(),
                      s.is_contiguous() ? "" : ", not contiguous");
  }
}

}  // namespace mixedprec
