// Argument validation, shared by the CPU and CUDA backends so both reject exactly
// the same inputs, before any tensor is written. Each op entry (csrc/ops/) runs its
// arguments through one Checker, in order, and ends with no_overlap().
//
// Tensors in the lists must be dense and non-overlapping (contiguous, or a
// permutation such as channels_last); tensors paired across lists must have the
// same number of elements and the same memory order. A tensor the op writes must
// not share memory with any other argument. Anything else is rejected.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

namespace mixedprec {

// The supported dtypes, as a bit set; every other dtype is rejected by name.
enum DTypeSet : unsigned {
  kF32 = 1u,
  kF16 = 2u,
  kBF16 = 4u,
  kF64 = 8u,
  kI32 = 16u,
  kI64 = 32u,
  kI16 = 64u,
  kF8E4M3 = 128u,  // float8_e4m3fn: 8-bit optimizer state's codes (lanes.h)
  kE8M0 = 256u,    // float8_e8m0fnu: their block scales
  kU8 = 512u,      // uint8: the same scales as their bytes (optimizer state holds those:
                   // torch.compile's inductor has no float8_e8m0fnu)
  kFloats = kF32 | kF16 | kBF16,
};

// Whether the op writes an argument (a `!` in its schema).
enum class Access { kRead, kWrite };

// An argument's name as messages print it: `found_inf`, or `tensors[3]` (index >= 0).
// Built only when a message is, so that valid calls make no strings.
struct ArgName {
  const char* name;
  int64_t index;
};
std::ostream& operator<<(std::ostream& out, const ArgName& arg);

// Checks arguments in order; the first tensor seen fixes the device that every
// later tensor must be on. Messages name the argument and what was expected.
class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  void tensor(const at::Tensor& t, const char* name, unsigned dtypes,
              Access access = Access::kRead);
  // A one-element tensor of the given dtype.
  void scalar(const at::Tensor& t, const char* name, at::ScalarType dtype,
              Access access = Access::kRead);
  void optional_scalar(const std::optional<at::Tensor>& t, const char* name);
  // Dense, non-overlapping tensors. An element that is the very view (data pointer,
  // sizes, strides, dtype) of the element at the same index of `twins`, a written
  // list, may alias it: the op reads each element before it writes the element of
  // the same index, so src[i] == dst[i] works in place; and a list written with the
  // values of its twin (model_params[i] == params[i], an fp32 param as its own
  // master) gets them once more.
  void list(at::TensorList l, const char* name, unsigned dtypes, Access access = Access::kRead,
            at::TensorList twins = {});
  // b pairs element-wise with a: same length, same numel, same memory order.
  void paired(at::TensorList a, const char* a_name, at::TensorList b, const char* b_name);
  // b[i] has the dtype of a[i] (lists of equal length: checked before).
  void same_dtypes(at::TensorList a, const char* a_name, at::TensorList b, const char* b_name);
  const char* op() const { return op_; }
  // A per-tensor list (pointwise.h), read: for each tensor of `of`, one float32
  // tensor of one element, or with `words`, one contiguous tensor of that many
  // (int64, or of `word_dtypes`; written with `access` kWrite).
  void per_tensor(at::TensorList l, const char* name, at::TensorList of, const char* of_name,
                  int64_t words = 0, unsigned word_dtypes = kI64, Access access = Access::kRead);
  void value(bool ok, const char* name, const char* expected, double got);
  // Last, before anything is written: no written argument shares a byte with another
  // argument (ValueError naming both). O(n log n) in the number of tensors.
  void no_overlap();

 private:
  void check(const at::Tensor& t, ArgName name, unsigned dtypes, Access access);

  // The bytes [begin, end) an argument spans (all on one device: checked before).
  struct Range {
    uintptr_t begin, end;
    ArgName name;
    size_t order;  // position among the arguments, to name the earlier one first
    bool written;
  };

  const char* op_;
  at::Device device_{at::kCPU};
  std::optional<ArgName> device_name_;
  std::vector<Range> ranges_;
  bool any_written_ = false;
};

// Lists of an optimizer: params are fp32 masters when model_params is given. The grads
// are read, or also written (grads_access kWrite: the op writes them back unscaled).
void check_params(Checker& c, at::TensorList params, at::TensorList grads,
                  at::TensorList model_params, Access grads_access = Access::kRead);

// lr, beta1, beta2, eps and weight_decay of the Adam family (Adam, LAMB, NovoGrad).
void check_adam_hyperparameters(Checker& c, double lr, double beta1, double beta2, double eps,
                                double weight_decay);

// Kahan compensations of an optimizer (pointwise.h), kahan_comps: none, or one bf16
// tensor per param, the params then bf16 and without masters (model_params empty).
void check_kahan_comps(Checker& c, at::TensorList params, at::TensorList model_params,
                       at::TensorList kahan_comps);

// The remainders of master="remainder" (pointwise.h): none, or one int16 tensor per
// param, the params then bf16, without masters, Kahan compensations or stochastic
// rounding.
void check_remainders(Checker& c, at::TensorList params, at::TensorList model_params,
                      at::TensorList kahan_comps, at::TensorList remainders, bool stochastic);

// The dtype of an optimizer's state lists (moments, momentum buffers): fp32 or bf16
// (states, named states_name), or 8-bit (float8_e4m3fn codes, lanes.h) when `scales`
// are given, one float8_e8m0fnu or uint8 tensor per state tensor (block scales, named
// scales_name); 8-bit states and their scales are contiguous, the states of a number
// of elements divisible by kQuantBlock, their scales of one element per block.
void check_state_scales(Checker& c, at::TensorList states, const char* states_name,
                        const std::optional<at::TensorList>& scales, const char* scales_name);

// The value of an optional 1-element float32 tensor's storage, or nullptr.
inline const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<float>() : nullptr;
}

}  // namespace mixedprec
