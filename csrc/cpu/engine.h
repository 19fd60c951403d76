// The CPU runner of the pointwise functors: the chunks of the shared plan are
// spread over threads with at::parallel_for; each chunk is worked through in tiles
// of kTile elements: the lists the functor reads are converted to fp32 (SIMD where
// the CPU has it, convert.h), the functor runs over the tile, and the lists it
// writes are converted back.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../dispatch.h"
#include "../multi_tensor_plan.h"
#include "convert.h"

namespace mixedprec::cpu {

constexpr int64_t kTile = 512;

// n elements of a list from element i on, as fp32 (zeros for an absent list).
template <typename T>
void load_tile(const void* p, int64_t i, int64_t n, float* out) {
  if (p == nullptr) {
    std::fill(out, out + n, 0.f);
  } else {
    to_float(static_cast<const T*>(p) + i, out, n);
  }
}

template <typename T>
void store_tile(void* p, int64_t i, int64_t n, const float* in) {
  if (p != nullptr) from_float(in, static_cast<T*>(p) + i, n);
}

struct CpuEngine {
  struct Guard {  // one CPU device: nothing to set
    explicit Guard(const at::Device&) {}
  };

  static void increment_step(float* step, const float* found_inf) {
    mixedprec::increment_step(step, found_inf);
  }

  static void update_loss_scale(float* scale, int32_t* growth_tracker,
                                int32_t* hysteresis_tracker, const float* found_inf,
                                const LossScaleArgs& args) {
    mixedprec::update_loss_scale(scale, growth_tracker, hysteresis_tracker, found_inf, args);
  }

  template <typename Op, typename... Ts>
  static void run(const Lists<sizeof...(Ts)>& lists, const Op& op, const float* skip,
                  float* found_inf) {
    run_lists<Op, Ts...>(lists, op, skip, found_inf, std::index_sequence_for<Ts...>{});
  }

 private:
  // op over the first n columns of the tile (row k: list k as fp32); returns 1 when
  // op reported a non-finite input. op comes by value, so that its fields are
  // loop invariants the compiler can hoist and unswitch on, and the result is an int
  // (a bool reduction keeps GCC from vectorising the loop).
  template <typename Op, int D, size_t... K>
  static int apply_tile(const Op op, float (&tile)[D][kTile], int64_t n) {
    int any = 0;
    for (int64_t e = 0; e < n; ++e) {
      float x[D] = {tile[K][e]...};
      any |= static_cast<int>(op.apply(x));
      ((tile[K][e] = x[K]), ...);
    }
    return any;
  }

  template <typename Op, typename... Ts, size_t... K>
  static void run_lists(const Lists<sizeof...(Ts)>& lists, const Op& op_in, const float* skip,
                        float* found_inf, std::index_sequence<K...>) {
    constexpr int D = sizeof...(Ts);
    if (skip != nullptr && *skip != 0.f) return;
    Op op = op_in;
    op.resolve();
    std::vector<int64_t> numels;
    for (const auto& t : lists[0]) numels.push_back(t.numel());
    const auto plans = plan_launches(numels, 0, 0);
    if (plans.empty()) return;
    const LaunchPlan& plan = plans.front();
    const int64_t num_chunks = static_cast<int64_t>(plan.block_slot.size());
    std::vector<char> bad(num_chunks, 0);
    at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int t = plan.tensors[plan.block_slot[b]];
        const int64_t begin = static_cast<int64_t>(plan.block_chunk[b]) * kChunkSize;
        const int64_t end = std::min(numels[t], begin + kChunkSize);
        const void* in[D] = {((Op::kReads >> K) & 1u) && !lists[K].empty()
                                 ? lists[K][t].data_ptr()
                                 : nullptr...};
        void* out[D] = {((Op::kWrites >> K) & 1u) && !lists[K].empty()
                            ? lists[K][t].data_ptr()
                            : nullptr...};
        int any = 0;
        float tile[D][kTile];
        for (int64_t i = begin; i < end; i += kTile) {
          const int64_t n = std::min(kTile, end - i);
          (load_tile<Ts>(in[K], i, n, tile[K]), ...);
          any |= apply_tile<Op, D, K...>(op, tile, n);
          (store_tile<Ts>(out[K], i, n, tile[K]), ...);
        }
        bad[b] = any != 0;
      }
    });
    if (found_inf != nullptr && std::any_of(bad.begin(), bad.end(), [](char c) { return c; })) {
      *found_inf = 1.f;
    }
  }
};

}  // namespace mixedprec::cpu
