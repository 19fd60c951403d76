#include "validate.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <string>

namespace mixedprec {
namespace {

// The supported dtypes, as a bit set; every other dtype is rejected by name.
enum DTypeSet : unsigned {
  kF32 = 1u,
  kF16 = 2u,
  kBF16 = 4u,
  kF64 = 8u,
  kI32 = 16u,
  kFloats = kF32 | kF16 | kBF16,
};

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

std::string item(const char* list, size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

// Checks arguments in order; the first tensor seen fixes the device that every
// later tensor must be on.
class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  void tensor(const at::Tensor& t, const std::string& name, unsigned dtypes) {
    TORCH_CHECK_TYPE(t.defined(), op_, ": expected ", name, " to be a tensor, got None");
    TORCH_CHECK_TYPE(t.layout() == at::kStrided, op_, ": expected ", name,
                     " to be a dense (strided) tensor, got layout ", t.layout());
    if (!device_name_.empty()) {
      TORCH_CHECK(t.device() == device_, op_, ": expected ", name, " on ", device_,
                  " (the device of ", device_name_, "), got ", t.device());
    } else {
      device_ = t.device();
      device_name_ = name;
    }
    TORCH_CHECK_TYPE(bit(t.scalar_type()) & dtypes, op_, ": expected ", name,
                     " to have dtype ", dtype_names(dtypes), ", got ",
                     dtype_name(t.scalar_type()));
  }

  void scalar(const at::Tensor& t, const char* name, at::ScalarType dtype) {
    tensor(t, name, bit(dtype));
    TORCH_CHECK_VALUE(t.numel() == 1, op_, ": expected ", name,
                      " to have exactly one element, got ", t.numel());
  }

  void optional_scalar(const std::optional<at::Tensor>& t, const char* name) {
    if (t.has_value()) scalar(*t, name, at::kFloat);
  }

  void list(at::TensorList l, const char* name, unsigned dtypes) {
    for (size_t i = 0; i < l.size(); ++i) {
      const std::string n = item(name, i);
      tensor(l[i], n, dtypes);
      TORCH_CHECK_VALUE(l[i].is_non_overlapping_and_dense(), op_, ": expected ", n,
                        " to be dense and non-overlapping (contiguous or a permutation "
                        "such as channels_last), got sizes ",
                        l[i].sizes(), " and strides ", l[i].strides());
    }
  }

  // b pairs element-wise with a: same length, same numel, same memory order.
  void paired(at::TensorList a, const char* a_name, at::TensorList b, const char* b_name) {
    TORCH_CHECK_VALUE(a.size() == b.size(), op_, ": expected ", b_name,
                      " to hold as many tensors as ", a_name, " (", a.size(), "), got ",
                      b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      TORCH_CHECK_VALUE(a[i].numel() == b[i].numel(), op_, ": expected ", item(b_name, i),
                        " to have ", a[i].numel(), " elements like ", item(a_name, i),
                        ", got ", b[i].numel());
      const bool same_order =
          (a[i].is_contiguous() && b[i].is_contiguous()) ||
          (a[i].sizes() == b[i].sizes() && a[i].strides() == b[i].strides());
      TORCH_CHECK_VALUE(same_order, op_, ": expected ", item(b_name, i),
                        " to have the memory layout of ", item(a_name, i), " (strides ",
                        a[i].strides(), "), got sizes ", b[i].sizes(), " and strides ",
                        b[i].strides());
    }
  }

  void value(bool ok, const char* name, const char* expected, double got) {
    TORCH_CHECK_VALUE(ok, op_, ": expected ", name, " to be ", expected, ", got ", got);
  }

 private:
  const char* op_;
  at::Device device_{at::kCPU};
  std::string device_name_;
};

// Lists of an optimizer: params are fp32 masters when model_params is given.
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

}  // namespace

void check_multi_tensor_unscale(at::TensorList tensors, const at::Tensor& found_inf,
                                const at::Tensor& inv_scale) {
  Checker c("multi_tensor_unscale_");
  c.scalar(found_inf, "found_inf", at::kFloat);
  c.scalar(inv_scale, "inv_scale", at::kFloat);
  c.list(tensors, "tensors", kFloats);
}

void check_multi_tensor_unscale_to(at::TensorList src, at::TensorList dst,
                                   const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  Checker c("multi_tensor_unscale_to_");
  c.scalar(found_inf, "found_inf", at::kFloat);
  c.scalar(inv_scale, "inv_scale", at::kFloat);
  c.list(src, "src", kFloats);
  c.list(dst, "dst", kFloats);
  c.paired(src, "src", dst, "dst");
}

void check_multi_tensor_check_finite(at::TensorList tensors, const at::Tensor& found_inf) {
  Checker c("multi_tensor_check_finite_");
  c.scalar(found_inf, "found_inf", at::kFloat);
  c.list(tensors, "tensors", kFloats);
}

void check_multi_tensor_copy(at::TensorList src, at::TensorList dst) {
  Checker c("multi_tensor_copy_");
  c.list(src, "src", kFloats);
  c.list(dst, "dst", kFloats);
  c.paired(src, "src", dst, "dst");
}

void check_multi_tensor_l2norm(at::TensorList tensors,
                               const std::optional<at::Tensor>& inv_scale) {
  Checker c("multi_tensor_l2norm");
  c.optional_scalar(inv_scale, "inv_scale");
  c.list(tensors, "tensors", kFloats);
}

void check_fused_sgd(at::TensorList params, at::TensorList grads,
                     at::TensorList momentum_buffers, at::TensorList model_params, double lr,
                     double momentum, double dampening, double weight_decay, bool nesterov,
                     const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf) {
  Checker c("fused_sgd_");
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  check_params(c, params, grads, model_params);
  if (momentum != 0) {
    c.list(momentum_buffers, "momentum_buffers", kF32);
    c.paired(params, "params", momentum_buffers, "momentum_buffers");
  } else {
    TORCH_CHECK_VALUE(momentum_buffers.empty(),
                      "fused_sgd_: expected momentum_buffers to be empty when momentum is 0, "
                      "got ", momentum_buffers.size(), " tensors");
  }
  c.value(lr >= 0 && std::isfinite(lr), "lr", "a finite number >= 0", lr);
  c.value(momentum >= 0 && std::isfinite(momentum), "momentum", "a finite number >= 0",
          momentum);
  c.value(std::isfinite(dampening), "dampening", "a finite number", dampening);
  c.value(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay",
          "a finite number >= 0", weight_decay);
  if (nesterov) {
    c.value(momentum > 0, "momentum", "> 0 with nesterov=True", momentum);
    c.value(dampening == 0, "dampening", "0 with nesterov=True", dampening);
  }
}

void check_fused_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList model_params,
                      const at::Tensor& step, double lr, double beta1, double beta2,
                      double eps, double weight_decay,
                      const std::optional<at::Tensor>& inv_scale,
                      const std::optional<at::Tensor>& found_inf) {
  Checker c("fused_adam_");
  c.scalar(step, "step", at::kFloat);
  c.optional_scalar(found_inf, "found_inf");
  c.optional_scalar(inv_scale, "inv_scale");
  check_params(c, params, grads, model_params);
  c.list(exp_avgs, "exp_avgs", kF32);
  c.paired(params, "params", exp_avgs, "exp_avgs");
  c.list(exp_avg_sqs, "exp_avg_sqs", kF32);
  c.paired(params, "params", exp_avg_sqs, "exp_avg_sqs");
  c.value(lr >= 0 && std::isfinite(lr), "lr", "a finite number >= 0", lr);
  c.value(beta1 >= 0 && beta1 < 1, "beta1", "in [0, 1)", beta1);
  c.value(beta2 >= 0 && beta2 < 1, "beta2", "in [0, 1)", beta2);
  c.value(eps >= 0 && std::isfinite(eps), "eps", "a finite number >= 0", eps);
  c.value(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay",
          "a finite number >= 0", weight_decay);
}

void check_sum_fp32(const at::Tensor& self) {
  Checker c("sum_fp32");
  c.tensor(self, "self", kFloats | kF64);
}

void check_update_loss_scale(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor,
                             int64_t growth_interval, int64_t hysteresis, double min_scale,
                             double max_scale) {
  Checker c("update_loss_scale_");
  c.scalar(scale, "scale", at::kFloat);
  c.scalar(growth_tracker, "growth_tracker", at::kInt);
  c.scalar(hysteresis_tracker, "hysteresis_tracker", at::kInt);
  c.scalar(found_inf, "found_inf", at::kFloat);
  c.value(growth_factor >= 1 && std::isfinite(growth_factor), "growth_factor",
          "a finite number >= 1", growth_factor);
  c.value(backoff_factor > 0 && backoff_factor <= 1, "backoff_factor", "in (0, 1]",
          backoff_factor);
  c.value(growth_interval >= 1 && growth_interval <= INT32_MAX, "growth_interval",
          "in [1, 2**31 - 1]", static_cast<double>(growth_interval));
  c.value(hysteresis >= 1 && hysteresis <= INT32_MAX, "hysteresis", "in [1, 2**31 - 1]",
          static_cast<double>(hysteresis));
  c.value(min_scale >= 0 && min_scale <= max_scale, "min_scale", ">= 0 and <= max_scale",
          min_scale);
  c.value(max_scale > 0, "max_scale", "> 0 (inf for no ceiling)", max_scale);
}

}  // namespace mixedprec
