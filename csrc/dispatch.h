// Host-side driving of the pointwise functors, shared by both backends: split
// the lists into groups of equal dtypes, pick the storage types, and hand each
// group to the backend's engine.
//
// An Engine provides
//   template <typename Op, typename... Ts>
//   static void run(const Lists<sizeof...(Ts)>& lists, const Op& op,
//                   const float* skip, float* found_inf);
// which applies `op` to every element (list k stored as Ts[k]; an empty list is
// absent), writes nothing when *skip != 0, and sets *found_inf = 1 when any
// apply() reported a non-finite input.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <array>
#include <map>
#include <type_traits>
#include <vector>

#include "pointwise.h"

namespace mixedprec {

template <int D>
using Lists = std::array<std::vector<at::Tensor>, D>;

#define MP_DISPATCH_FLOATS(TYPE, NAME, ALIAS, ...)                             \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                               \
                     AT_PRIVATE_CASE_TYPE_USING_HINT(at::kFloat, ALIAS, __VA_ARGS__) \
                     AT_PRIVATE_CASE_TYPE_USING_HINT(at::kHalf, ALIAS, __VA_ARGS__)  \
                     AT_PRIVATE_CASE_TYPE_USING_HINT(at::kBFloat16, ALIAS, __VA_ARGS__))

// Splits parallel lists into groups whose tensors share a dtype per list (the
// order within a group is kept). Lists may be empty (absent); the first is not.
template <int D>
std::vector<Lists<D>> group_by_dtype(const std::array<at::TensorList, D>& lists) {
  std::map<std::array<int, D>, Lists<D>> groups;
  for (size_t i = 0; i < lists[0].size(); ++i) {
    std::array<int, D> key{};
    for (int k = 0; k < D; ++k) {
      key[k] = lists[k].empty() ? -1 : static_cast<int>(lists[k][i].scalar_type());
    }
    Lists<D>& group = groups[key];
    for (int k = 0; k < D; ++k) {
      if (!lists[k].empty()) group[k].push_back(lists[k][i]);
    }
  }
  std::vector<Lists<D>> out;
  for (auto& entry : groups) out.push_back(std::move(entry.second));
  return out;
}

template <class Engine>
void run_scale(at::TensorList src, at::TensorList dst, const float* inv_scale,
               float* found_inf) {
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

template <class Engine, typename Op, typename... Ts>
void run_types(TypeList<Ts...>, const Lists<sizeof...(Ts)>& lists, const Op& op,
               const float* skip) {
  Engine::template run<Op, Ts...>(lists, op, skip, nullptr);
}

// Optimizers: params and grads in any float type, state in fp32 (Op::Storage),
// and the model copy, when present (the last list), in any float type; params
// are then fp32 masters (validated before).
template <class Engine, typename Op>
void run_optimizer(const std::array<at::TensorList, Op::kDepth>& lists, const Op& op,
                   const float* skip) {
  constexpr int D = Op::kDepth;
  for (const auto& g : group_by_dtype<D>(lists)) {
    const bool has_model = !g[D - 1].empty();
    MP_DISPATCH_FLOATS(g[0][0].scalar_type(), "mixedprec optimizer", param_t, [&] {
      MP_DISPATCH_FLOATS(g[1][0].scalar_type(), "mixedprec optimizer", grad_t, [&] {
        if (!has_model) {
          using Types = typename Op::template Storage<param_t, grad_t, float>;
          run_types<Engine>(Types{}, g, op, skip);
          return;
        }
        MP_DISPATCH_FLOATS(g[D - 1][0].scalar_type(), "mixedprec optimizer", model_t, [&] {
          if constexpr (std::is_same_v<param_t, float>) {
            using Types = typename Op::template Storage<float, grad_t, model_t>;
            run_types<Engine>(Types{}, g, op, skip);
          }
        });
      });
    });
  }
}

template <class Engine>
void run_fused_sgd(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList model_params, double lr, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool first_run, const float* inv_scale,
                   const float* found_inf) {
  SgdOp op;
  op.lr = static_cast<float>(lr);
  op.momentum = static_cast<float>(momentum);
  op.grad_weight = static_cast<float>(1.0 - dampening);
  op.weight_decay = static_cast<float>(weight_decay);
  op.nesterov = nesterov;
  op.first_run = first_run;
  op.inv_scale_ptr = inv_scale;
  run_optimizer<Engine, SgdOp>({params, grads, momentum_buffers, model_params}, op, found_inf);
}

// Engine::increment_step(step, found_inf) runs before the update, on the device.
template <class Engine>
void run_fused_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList model_params, float* step,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool adamw, bool bias_correction, const float* inv_scale,
                    const float* found_inf) {
  Engine::increment_step(step, found_inf);
  AdamOp op;
  op.lr = lr;
  op.beta1 = beta1;
  op.beta2 = beta2;
  op.eps = eps;
  op.weight_decay = weight_decay;
  op.adamw = adamw;
  op.bias_correction = bias_correction;
  op.step_ptr = step;
  op.inv_scale_ptr = inv_scale;
  run_optimizer<Engine, AdamOp>({params, grads, exp_avgs, exp_avg_sqs, model_params}, op,
                                found_inf);
}

inline LossScaleArgs loss_scale_args(double growth_factor, double backoff_factor,
                                     int64_t growth_interval, int64_t hysteresis,
                                     double min_scale, double max_scale) {
  LossScaleArgs a;
  a.growth_factor = growth_factor;
  a.backoff_factor = backoff_factor;
  a.min_scale = min_scale;
  a.max_scale = max_scale;
  a.growth_interval = static_cast<int32_t>(growth_interval);
  a.hysteresis = static_cast<int32_t>(hysteresis);
  return a;
}

}  // namespace mixedprec
