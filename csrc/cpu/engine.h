// The CPU runner of the pointwise functors: the chunks of the shared plan are
// spread over threads with at::parallel_for (OpenMP); each chunk is worked through
// in tiles of kTile elements. An fp32 list is read and written where it lies; an
// fp16/bf16 list is converted to fp32 into a tile buffer (SIMD where the CPU has
// it, convert.h) when the functor reads it, and back when it writes it. The loop
// over a tile is compiled three times, for AVX-512, AVX2 and baseline x86-64 (or
// once elsewhere), and the one the CPU and torch's ATEN_CPU_CAPABILITY allow is
// picked at run time (cpu_isa()). Each element sees the same fp32 operations in the
// same order in every version (no FMA contraction: -ffp-contract=off), so they give
// the same bits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dispatch.h"
#include "../multi_tensor_plan.h"
#include "convert.h"

namespace mixedprec::cpu {

constexpr int64_t kTile = 1024;

// fn(op, ptrs, n): op over elements 0..n-1 of the lists at ptrs (fp32, one pointer
// per list, read where Op::kReads and written where Op::kWrites has its bit); 1
// when op reported a non-finite input. op comes by value, so that its fields are
// loop invariants the compiler can hoist and unswitch on, and the result is an int
// (a bool reduction keeps GCC from vectorising the loop). The lists never overlap
// (ivdep).
#define MP_TILE_LOOP(NAME, TARGET)                                                      \
  template <typename Op, size_t... K>                                                   \
  TARGET int NAME(const Op op, float* const* ptrs, int64_t n, std::index_sequence<K...>) { \
    constexpr int D = sizeof...(K);                                                     \
    float* p[D] = {ptrs[K]...};                                                         \
    int any = 0;                                                                        \
    _Pragma("GCC ivdep") for (int64_t e = 0; e < n; ++e) {                              \
      float x[D] = {(((Op::kReads >> K) & 1u) ? p[K][e] : 0.f)...};                    \
      any |= static_cast<int>(op.apply(x));                                             \
      ((((Op::kWrites >> K) & 1u) ? (void)(p[K][e] = x[K]) : (void)0), ...);            \
    }                                                                                   \
    return any;                                                                         \
  }

MP_TILE_LOOP(tile_loop_baseline, )
#if defined(MP_X86_ISA)
MP_TILE_LOOP(tile_loop_avx2, __attribute__((target("avx2,fma"))))
MP_TILE_LOOP(tile_loop_avx512, __attribute__((target(MP_AVX512_TARGET))))
#endif
#undef MP_TILE_LOOP

template <typename Op, size_t... K>
int tile_loop(const Op& op, float* const* ptrs, int64_t n, std::index_sequence<K...> seq) {
#if defined(MP_X86_ISA)
  switch (cpu_isa()) {
    case Isa::kAvx512:
      return tile_loop_avx512<Op>(op, ptrs, n, seq);
    case Isa::kAvx2:
      return tile_loop_avx2<Op>(op, ptrs, n, seq);
    default:
      break;
  }
#endif
  return tile_loop_baseline<Op>(op, ptrs, n, seq);
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
  // Where the tile loop reads and writes list k (stored as T) for elements i..i+n-1
  // of the chunk's tensor at `data` (null: the list is absent): the tensor itself for
  // fp32, else `tile` after converting in what the functor reads.
  template <typename Op, typename T, size_t K>
  static float* tile_of(void* data, int64_t i, int64_t n, float* tile) {
    if (data == nullptr) return tile;  // absent: scratch, zeros where read
    if constexpr (std::is_same_v<T, float>) {
      return static_cast<float*>(data) + i;
    } else {
      if ((Op::kReads >> K) & 1u) to_float(static_cast<const T*>(data) + i, tile, n);
      return tile;
    }
  }

  template <typename Op, typename T, size_t K>
  static void write_back(void* data, int64_t i, int64_t n, const float* tile) {
    if constexpr (!std::is_same_v<T, float>) {
      if (data != nullptr && ((Op::kWrites >> K) & 1u)) {
        from_float(tile, static_cast<T*>(data) + i, n);
      }
    }
  }

  template <typename Op, typename... Ts, size_t... K>
  static void run_lists(const Lists<sizeof...(Ts)>& lists, const Op& op_in, const float* skip,
                        float* found_inf, std::index_sequence<K...> seq) {
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
      float tile[D][kTile];
      // Absent lists read zeros (once; the functor does not use what it writes there).
      ((lists[K].empty() ? std::fill(tile[K], tile[K] + kTile, 0.f) : void()), ...);
      for (int64_t b = first; b < last; ++b) {
        const int t = plan.tensors[plan.block_slot[b]];
        const int64_t begin = static_cast<int64_t>(plan.block_chunk[b]) * kChunkSize;
        const int64_t end = std::min(numels[t], begin + kChunkSize);
        void* data[D] = {lists[K].empty() ? nullptr : lists[K][t].data_ptr()...};
        int any = 0;
        for (int64_t i = begin; i < end; i += kTile) {
          const int64_t n = std::min(kTile, end - i);
          float* const ptrs[D] = {tile_of<Op, Ts, K>(data[K], i, n, tile[K])...};
          any |= tile_loop(op, ptrs, n, seq);
          (write_back<Op, Ts, K>(data[K], i, n, tile[K]), ...);
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
