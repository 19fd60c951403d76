// The dynamic loss scale's entry: the update of the scale and its trackers, on the
// device (csrc/pointwise_lists.h's UpdateLossScale). Signature: the schema in csrc/ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "../dispatch.h"
#include "../pointwise_lists.h"
#include "kernel.h"

namespace mixedprec {
namespace entry {

template <class Engine>
void update_loss_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale) {
  Checker c("update_loss_scale_");
  c.scalar(scale, "scale", at::kFloat, Access::kWrite);
  c.scalar(growth_tracker, "growth_tracker", at::kInt, Access::kWrite);
  c.scalar(hysteresis_tracker, "hysteresis_tracker", at::kInt, Access::kWrite);
  c.scalar(found_inf, "found_inf", at::kFloat);
  c.value(growth_factor >= 1 && std::isfinite(growth_factor), "growth_factor",
          "a finite number >= 1", growth_factor);
  c.value(backoff_factor > 0 && backoff_factor <= 1, "backoff_factor", "in (0, 1]", backoff_factor);
  c.value(growth_interval >= 1 && growth_interval <= INT32_MAX, "growth_interval",
          "in [1, 2**31 - 1]", static_cast<double>(growth_interval));
  c.value(hysteresis >= 1 && hysteresis <= INT32_MAX, "hysteresis", "in [1, 2**31 - 1]",
          static_cast<double>(hysteresis));
  // max_scale first, so that a NaN there is not blamed on min_scale's comparison.
  c.value(max_scale > 0, "max_scale", "> 0 (inf for no ceiling)", max_scale);
  c.value(min_scale >= 0 && min_scale <= max_scale, "min_scale", ">= 0 and <= max_scale",
          min_scale);
  c.no_overlap();

  const typename Engine::Guard guard(scale.device());
  LossScaleArgs args;
  args.growth_factor = growth_factor;
  args.backoff_factor = backoff_factor;
  args.min_scale = min_scale;
  args.max_scale = max_scale;
  args.growth_interval = static_cast<int32_t>(growth_interval);
  args.hysteresis = static_cast<int32_t>(hysteresis);
  Engine::template run_single<UpdateLossScale>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.const_data_ptr<float>(), args);
}

}  // namespace entry

// This family's entries on one engine (register_list_ops, ops/lists.h).
template <class Engine>
void register_loss_scale_ops(torch::Library& m) {
  m.impl("update_loss_scale_", kernel<&entry::update_loss_scale_<Engine>>());
}

}  // namespace mixedprec
