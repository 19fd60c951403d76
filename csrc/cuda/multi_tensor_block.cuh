// The per-block half of the CUDA multi-tensor engine: the kernel parameters, their
// packing on the host, and what one block does with its chunk. It uses no CUDA
// headers or launch syntax, so tests/cpp/test_cuda_blocks.cpp can compile it as
// host code and run a launch block by block, one thread at a time, on CPU tensors.
// (Under nvcc, threadIdx, blockIdx and blockDim are CUDA's; the host build declares
// them before including this file.)
//
// A launch's table lists chunks of kChunkSize elements. A pointwise launch runs
// kBlocksPerChunk blocks per chunk, each on one slice of it; the L2 norm's first
// stage runs one block per chunk, whose sum is that chunk's partial. Indices are
// 64-bit, so tensors over 2^31 elements are fine. A block uses 4-element vector
// accesses when all its pointers are aligned for them, kUnroll of them in flight per
// thread, and a plain strided loop otherwise (any size, alignment or storage
// offset). A per-tensor list's value is read once per thread and broadcast.
// Skipping on overflow reads the flag on the device.
//
// The tuning constants below were measured on an H100 (bench/README.md); each can be
// overridden at compile time (-DMIXEDPREC_UNROLL=1 ...) to measure another choice.
#pragma once

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dispatch.h"
#include "../multi_tensor_plan.h"

#if defined(__CUDACC__)
#define MP_DEVICE __device__ __forceinline__
#define MP_TRACE(...) \
  do {                \
  } while (0)
#else
#define MP_DEVICE inline
// Host builds only: every global-memory access of the element lists (list k, or
// D + k for the scale bytes of 8-bit list k), by which lane of its warp, where, how
// many bytes, and whether it stores; tests/cpp/test_cuda_blocks.cpp's memory-traffic
// model sets g_trace.
#define MP_TRACE(...)                                                    \
  do {                                                                   \
    if (mixedprec::cuda::g_trace) mixedprec::cuda::g_trace(__VA_ARGS__); \
  } while (0)
#endif

namespace mixedprec::cuda {

#if !defined(__CUDACC__)
inline void (*g_trace)(int list, int lane, const void* address, int bytes, bool store) = nullptr;
#endif

#ifndef MIXEDPREC_UNROLL
#define MIXEDPREC_UNROLL 2
#endif
#ifndef MIXEDPREC_BLOCKS_PER_CHUNK
#define MIXEDPREC_BLOCKS_PER_CHUNK 4
#endif

constexpr int kBlockSize = 512;
constexpr int kWarpSize = 32;
constexpr int kILP = 4;  // elements per vector access
// Vector accesses per thread issued before any is used: more bytes in flight.
constexpr int kUnroll = MIXEDPREC_UNROLL;
// Blocks per chunk in a pointwise launch: shorter blocks, so the end of a launch,
// where blocks finish unevenly and SMs idle, costs less.
constexpr int kBlocksPerChunk = MIXEDPREC_BLOCKS_PER_CHUNK;
static_assert(kChunkSize % (kBlocksPerChunk * kILP) == 0, "slices of whole vectors");
static_assert(kUnroll >= 1, "at least one access in flight");

template <int D>
struct TensorListMeta {
  static constexpr int kMaxTensors = max_tensors_per_launch(D);
  void* ptrs[D][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t block_chunk[kMaxBlocksPerLaunch];
  uint16_t block_slot[kMaxBlocksPerLaunch];
};
static_assert(sizeof(TensorListMeta<5>) <= 16384, "kernel parameters over budget");

// Plans the launches over `lists` (list 0 gives the sizes; an empty list is
// absent and gets null pointers) and calls launch(meta, num_blocks, first_block)
// for each, where first_block counts the blocks of the launches before it.
template <int D, typename LaunchFn>
void for_each_launch(const Lists<D>& lists, LaunchFn&& launch) {
  std::vector<int64_t> numels;
  for (const auto& t : lists[0]) numels.push_back(t.numel());
  int64_t first_block = 0;
  for (const LaunchPlan& plan :
       plan_launches(numels, TensorListMeta<D>::kMaxTensors, kMaxBlocksPerLaunch)) {
    TensorListMeta<D> meta{};
    for (size_t s = 0; s < plan.tensors.size(); ++s) {
      const int t = plan.tensors[s];
      for (int k = 0; k < D; ++k) {
        meta.ptrs[k][s] = lists[k].empty() ? nullptr : lists[k][t].data_ptr();
      }
      meta.numel[s] = numels[t];
    }
    const int num_blocks = static_cast<int>(plan.block_slot.size());
    for (int b = 0; b < num_blocks; ++b) {
      meta.block_chunk[b] = plan.block_chunk[b];
      meta.block_slot[b] = static_cast<uint16_t>(plan.block_slot[b]);
    }
    launch(meta, num_blocks, first_block);
    first_block += num_blocks;
  }
}

// The mask of the lists given (not empty): which a FixedMode's must match.
template <size_t D>
unsigned present_lists(const std::array<at::TensorList, D>& lists) {
  unsigned mask = 0;
  for (size_t k = 0; k < D; ++k) mask |= lists[k].empty() ? 0u : 1u << k;
  return mask;
}

// launch(functor) with op as a CUDA call runs it (CudaEngine::run; the host tests'
// emulated engine): a Fixed<Op, M> in the first of Op's FixedModes that holds
// (pointwise.h), else op's generic kernel; a call that tallies (the precision report)
// as pointwise.h's in_counted_mode says, so that the kernels of Fixed<Op, M> hold
// none of the counting.
template <typename... Ts, typename Op, typename F>
void launch_as(const Op& op, const Lists<sizeof...(Ts)>& lists, F&& launch) {
  in_counted_mode<Ts...>(op, present_lists(lists), tallying<Op>(lists), launch);
}

// The part of a chunk a block owns: its tensor slot, first element and length.
struct Chunk {
  int slot;
  int64_t start;
  int64_t size;
};

// Blocks of a launch whose table holds `table_blocks` chunks, Parts blocks per chunk.
template <int Parts>
constexpr int64_t grid_blocks(int table_blocks) {
  return static_cast<int64_t>(table_blocks) * Parts;
}

// The slice of its chunk that this block owns when each chunk has Parts blocks (a
// slice past the end of a short last chunk is empty).
template <int Parts, int D>
MP_DEVICE Chunk block_chunk(const TensorListMeta<D>& meta) {
  constexpr int64_t kSlice = kChunkSize / Parts;
  const int entry = static_cast<int>(blockIdx.x / Parts);
  const int part = static_cast<int>(blockIdx.x % Parts);
  const int slot = meta.block_slot[entry];
  const int64_t start = static_cast<int64_t>(meta.block_chunk[entry]) * kChunkSize + part * kSlice;
  const int64_t rest = meta.numel[slot] - start;
  return {slot, start, rest <= 0 ? 0 : rest < kSlice ? rest : kSlice};
}

template <typename T>
struct alignas(sizeof(T) * kILP) Vec {
  T v[kILP];
};

template <typename T>
MP_DEVICE bool vector_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Vec<T>) == 0;
}

template <typename T>
MP_DEVICE void* offset(void* p, int64_t start) {
  return p == nullptr ? nullptr : static_cast<T*>(p) + start;
}

// One element of a list as fp32, and back; a null pointer is an absent list (or
// one the functor does not read or write) and is skipped.
// (k, the list, and lane, the thread's lane in its warp, are for MP_TRACE only.)
template <typename T>
MP_DEVICE void load_element(const void* p, int64_t i, float& out, int k, int lane) {
  if (p == nullptr) return;
  MP_TRACE(k, lane, static_cast<const T*>(p) + i, static_cast<int>(sizeof(T)), false);
  out = static_cast<float>(static_cast<const T*>(p)[i]);
}

template <typename T>
MP_DEVICE void store_element(void* p, int64_t i, float value, int k, int lane) {
  if (p == nullptr) return;
  MP_TRACE(k, lane, static_cast<T*>(p) + i, static_cast<int>(sizeof(T)), true);
  static_cast<T*>(p)[i] = static_cast<T>(value);
}

template <typename T, int D>
MP_DEVICE void load_vector(const void* p, int64_t i, float (&x)[kILP][D], int k, int lane) {
  if (p == nullptr) return;
  MP_TRACE(k, lane, static_cast<const T*>(p) + i, static_cast<int>(sizeof(Vec<T>)), false);
  const Vec<T> v = *reinterpret_cast<const Vec<T>*>(static_cast<const T*>(p) + i);
#pragma unroll
  for (int j = 0; j < kILP; ++j) x[j][k] = static_cast<float>(v.v[j]);
}

template <typename T, int D>
MP_DEVICE void store_vector(void* p, int64_t i, const float (&x)[kILP][D], int k, int lane) {
  if (p == nullptr) return;
  Vec<T> v;
#pragma unroll
  for (int j = 0; j < kILP; ++j) v.v[j] = static_cast<T>(x[j][k]);
  MP_TRACE(k, lane, static_cast<T*>(p) + i, static_cast<int>(sizeof(Vec<T>)), true);
  *reinterpret_cast<Vec<T>*>(static_cast<T*>(p) + i) = v;
}

// Adds every thread's N tallies to the tensor's words: a sum per warp (a shuffle
// reduction), the warps' sums added up per block in shared memory (in float64, in
// warp order), and the block's N sums and its `elements` added to the words by its
// first N + 1 threads: N + 1 float64 atomics per block. (The 16 warps' own atomics,
// 49 a block, all onto the same few words of a tensor while the whole grid works on
// it, are the suspected cause of the report's cost on the H200 of 2026-11-29, a
// quarter of an AdamW step: docs/lean-precision.md.) Under the host build each call
// adds its own sums. Every thread of the block calls it (the block's chunk and the
// tally list are the block's, so none has left before: __syncthreads).
template <int N>
MP_DEVICE void add_tallies(double* words, const float* sums, int64_t elements) {
#if defined(__CUDACC__)
  constexpr int kWarps = kBlockSize / kWarpSize;
  __shared__ float warp_sums[N][kWarps];
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
#pragma unroll
  for (int t = 0; t < N; ++t) {
    float sum = sums[t];
#pragma unroll
    for (int d = kWarpSize / 2; d > 0; d >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, d);
    if (threadIdx.x % kWarpSize == 0) warp_sums[t][warp] = sum;
  }
  __syncthreads();
  if (threadIdx.x < N) {
    double sum = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += static_cast<double>(warp_sums[threadIdx.x][w]);
    if (sum != 0.0) atomicAdd(words + threadIdx.x, sum);
  } else if (threadIdx.x == N) {
    atomicAdd(words + N, static_cast<double>(elements));
  }
#else
#pragma unroll
  for (int t = 0; t < N; ++t) words[t] += static_cast<double>(sums[t]);
  if (threadIdx.x == 0) words[N] += static_cast<double>(elements);
#endif
}

// op on the kILP elements of a vector, local elements index.. of their tensor (their
// tallies to `tally` as apply_at's); returns whether one was non-finite. A Fixed mode
// that rounds its params stochastically gets their bits drawn for the vector at once
// (pointwise.h's DrawsPerVector); the generic kernels, which run only the modes outside
// FixedModes (amsgrad, maximize, other gradient dtypes), leave the draw per element
// to the functor.
template <typename Op, int D>
MP_DEVICE bool apply_vector(const Op& op, float (&x)[kILP][D], int64_t index, float* tally) {
  bool bad = false;
  if constexpr (DrawsPerVector<Op>::value) {
    uint32_t bits[kILP];
    // (misaligned vectors: a call per element in the kernels held to 64 registers, which
    // spill with element_bits' block tracking; element_bits in the others)
    vector_bits<(Op::kMinBlocks > 1)>(op.rounding.key, index, bits);
#pragma unroll
    for (int j = 0; j < kILP; ++j) bad |= apply_at(op, x[j], DrawnBits{bits[j]}, tally);
  } else {
#pragma unroll
    for (int j = 0; j < kILP; ++j) bad |= apply_at(op, x[j], index + j, tally);
  }
  return bad;
}

// Applies `op` to the n elements at ptrs (list k stored as Ts[k]; a per-tensor list
// points at its value), elements first..first+n-1 of their tensors; returns whether
// this thread saw a non-finite input that op reports. Its tallies, when `tally` is
// not null, go there.
template <typename Op, typename... Ts, size_t... K>
MP_DEVICE bool apply_chunk(const Op& op, void* const (&ptrs)[sizeof...(Ts)], int64_t first,
                           int64_t n, float* tally, std::index_sequence<K...>) {
  constexpr int D = sizeof...(Ts);
  const void* in[D] = {(((Op::kReads >> K) & 1u) && !kPerTensorList<Op, K>) ? ptrs[K] : nullptr...};
  void* out[D] = {((Op::kWrites >> K) & 1u) ? ptrs[K] : nullptr...};
  // The per-tensor values, loaded once; zeros elsewhere.
  static_assert((kPerTensorStorageOk<Op, K, Ts> && ...), "per-tensor lists are fp32 or int64");
  const float per[D] = {(kPerTensorList<Op, K> ? per_tensor_value<Ts>(ptrs[K]) : 0.f)...};
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  bool bad = false;
  int64_t done = 0;
  if (((kPerTensorList<Op, K> || vector_aligned<Ts>(ptrs[K])) && ...)) {
    // Each pass: kUnroll vectors, one blockDim.x * kILP apart (each access is
    // coalesced across the warp), all loaded before any is computed or stored.
    done = n / kILP * kILP;
    const int64_t stride = static_cast<int64_t>(blockDim.x) * kILP;
    for (int64_t base = static_cast<int64_t>(threadIdx.x) * kILP; base < done;
         base += stride * kUnroll) {
      float x[kUnroll][kILP][D];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kILP; ++j) {
#pragma unroll
          for (int k = 0; k < D; ++k) x[u][j][k] = per[k];
        }
        const int64_t i = base + u * stride;
        if (i < done) (load_vector<Ts, D>(in[K], i, x[u], K, lane), ...);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * stride;
        if (i >= done) continue;
        bad |= apply_vector(op, x[u], first + i, tally);
        (store_vector<Ts, D>(out[K], i, x[u], K, lane), ...);
      }
    }
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    float x[D];
#pragma unroll
    for (int k = 0; k < D; ++k) x[k] = per[k];
    (load_element<Ts>(in[K], i, x[K], K, lane), ...);
    bad |= apply_at(op, x, first + i, tally);
    (store_element<Ts>(out[K], i, x[K], K, lane), ...);
  }
  return bad;
}

// Functors with 8-bit lists (E4m3 storage, lanes.h; their block scales in the lists
// from Op::kScaleList on, one per 8-bit list in order) run warp by warp: a warp takes
// kWarpSpan consecutive elements at a time (kUnroll spans in flight), each lane kILP
// consecutive ones, so every list's access is one coalesced vector access per lane, as
// in apply_chunk, and kLanesPerBlock lanes hold one block of kQuantBlock elements. An
// 8-bit list is read as its codes' values times the block's scale (one byte, read by
// the block's lanes at once); the other lists the functor writes are stored at once,
// the 8-bit ones when the block's largest magnitude is known: a reduction over its
// lanes (as bits, NaN above all), then each lane encodes its elements and the block's
// first lane stores the scale. Elements first.. on (first and n are multiples of
// kQuantBlock: validated and planned; base holds the tensors' own pointers). Under
// nvcc a thread is one lane; the host build (tests/cpp/test_cuda_blocks.cpp) runs a
// whole warp in one call, its lanes one after another between the reductions (the
// 8-bit lists: dispatch.h's kBlocked, block_rank and scale_list).
constexpr int kWarpSpan = kWarpSize * kILP;
constexpr int kLanesPerBlock = kQuantBlock / kILP;
static_assert(kQuantBlock % kILP == 0 && kWarpSpan % kQuantBlock == 0, "whole blocks per span");
static_assert(kBlockSize % kWarpSize == 0, "whole warps");
#if defined(__CUDACC__)
constexpr int kHostLanes = 1;  // the lanes one call runs: a CUDA thread is one lane
MP_DEVICE int lane_of(int) { return static_cast<int>(threadIdx.x % kWarpSize); }
#else
constexpr int kHostLanes = kWarpSize;
MP_DEVICE int lane_of(int l) { return l; }
#endif

// Each lane's m becomes the largest m of its block's kLanesPerBlock lanes. Every lane
// of the warp calls it (under nvcc: a shuffle reduction over the whole warp's mask).
MP_DEVICE void block_max(uint32_t (&m)[kHostLanes]) {
#if defined(__CUDACC__)
#pragma unroll
  for (int d = 1; d < kLanesPerBlock; d <<= 1) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, m[0], d);
    m[0] = other > m[0] ? other : m[0];
  }
#else
  for (int g = 0; g < kHostLanes; g += kLanesPerBlock) {
    uint32_t best = 0;
    for (int l = g; l < g + kLanesPerBlock; ++l) best = m[l] > best ? m[l] : best;
    for (int l = g; l < g + kLanesPerBlock; ++l) m[l] = best;
  }
#endif
}

// The scale bytes of list K's blocks (an 8-bit list's; null for the others).
template <typename Op, size_t K, typename... Ts>
MP_DEVICE uint8_t* scales_of(void* const (&base)[sizeof...(Ts)]) {
  using T = std::tuple_element_t<K, std::tuple<Ts...>>;
  if constexpr (kBlocked<T>) {
    return base[K] == nullptr ? nullptr : static_cast<uint8_t*>(base[scale_list<Op, K, Ts...>()]);
  } else {
    return nullptr;
  }
}

// A lane's kILP codes (word: code j in byte j) as their values times their block's
// scale, into x[j][k], as e4m3_value(code) * scale gives them, bit for bit. From sm_89
// on (compute_89 PTX or later: TORCH_CUDA_ARCH_LIST=9.0, not setup.py's default, whose
// sm_90 code comes from compute_80 PTX) through the hardware's conversion of two e4m3
// codes to two fp16 values (cvt.rn.f16x2.e4m3x2), then to fp32: exact, as every e4m3
// value is an fp16 one, 3 instructions per two codes. A NaN code (0x7f, 0xff) gives a
// NaN, and its product with the scale is CUDA's canonical NaN, as e4m3_value's is.
// Otherwise (and on the host, where the C++ tests run it) in integer and float
// arithmetic without a branch, about 8 instructions a code where e4m3_value took 12:
// a code's magnitude bits placed as a float's (mag << 20) are its value times 2^-120,
// a denormal float for the subnormal codes, which a product with +-2^120 (the code's
// sign) makes exact; the NaN code's bits are e4m3_value's NaN. (Not e4m3_value's own
// form: the CPU engine's scalar loads may run under DAZ (torch.set_flush_denormal),
// which would zero those denormals; CUDA keeps them, setup.py's nvcc flags having no
// -ftz.)
template <int D>
MP_DEVICE void e4m3_lane_values(uint32_t word, float scale, float (&x)[kILP][D], int k) {
  static_assert(kILP == 4, "a lane's codes in one 32-bit word");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t pairs[2];
  asm("{.reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; "
      "cvt.rn.f16x2.e4m3x2 %1, b;}"
      : "=r"(pairs[0]), "=r"(pairs[1])
      : "r"(word));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float lo, hi;
    asm("{.reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi)
        : "r"(pairs[h]));
    x[2 * h][k] = lo * scale;
    x[2 * h + 1][k] = hi * scale;
  }
#else
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    const uint32_t code = word >> (8 * j);
    const uint32_t mag = (code << 20) & 0x07f00000u, sign = (code << 24) & 0x80000000u;
    const float value = mag == 0x07f00000u ? bits_float(sign | 0x7fc00000u)
                                           : bits_float(mag) * bits_float(sign | 0x7b800000u);
    x[j][k] = value * scale;
  }
#endif
}

// kILP elements from i on into x[j][k]: a vector access when `vec`, else one by one;
// an 8-bit list as its codes' values times its block's scale (read here; the codes
// loaded either way, then decoded by one code path).
template <typename T, int D>
MP_DEVICE void load_lane(const void* p, const uint8_t* scales, int64_t i, bool vec, int lane,
                         float (&x)[kILP][D], int k) {
  if (p == nullptr) return;
  if constexpr (kBlocked<T>) {
    MP_TRACE(k + D, lane, scales + i / kQuantBlock, 1, false);
    const float scale = e8m0_value(scales[i / kQuantBlock]);
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(static_cast<const T*>(p) + i);
    uint32_t word = 0;
    if (vec) {
      MP_TRACE(k, lane, static_cast<const T*>(p) + i, kILP, false);
#if defined(__CUDACC__)
      word = *reinterpret_cast<const uint32_t*>(codes);  // (a struct's load is re-packed)
#else
      memcpy(&word, codes, sizeof(word));
#endif
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        MP_TRACE(k, lane, static_cast<const T*>(p) + i + j, 1, false);
        word |= static_cast<uint32_t>(codes[j]) << (8 * j);
      }
    }
    e4m3_lane_values(word, scale, x, k);
  } else if (vec) {
    load_vector<T, D>(p, i, x, k, lane);
  } else {
#pragma unroll
    for (int j = 0; j < kILP; ++j) load_element<T>(p, i + j, x[j][k], k, lane);
  }
}

// x[j][k] into the kILP elements from i on (not an 8-bit list's: store_codes).
template <typename T, int D>
MP_DEVICE void store_lane(void* p, int64_t i, bool vec, int lane, const float (&x)[kILP][D],
                          int k) {
  if constexpr (!kBlocked<T>) {
    if (vec) {
      store_vector<T, D>(p, i, x, k, lane);
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j) store_element<T>(p, i + j, x[j][k], k, lane);
    }
  }
}

// The 8-bit state's rounding bits of a lane's kILP elements from local element i on:
// in the Fixed kernels one Philox call where they lie in one Philox block of 8
// (lanes.h's vector_bits, as apply_vector's), in the generic ones element_bits (a
// call per block it meets, found element by element).
template <typename Op>
MP_DEVICE void state_bits(const Op& op, int64_t i, uint32_t (&random)[kILP]) {
  if constexpr (IsFixed<Op>::value) {
    vector_bits<false>(op.state_key, i, random);
  } else {
    element_bits(op.state_key, i, kILP, random);
  }
}

// 8-bit list k's codes and scales of spans u0..u1-1 from the lanes' values
// x[l][u][j][k] (every lane of the warp calls it, for the reduction; `at[l][u]` is the
// element index of lane l's span u, -1 when it holds none). With op.state_stochastic
// they round with the lanes' elements' bits (state_bits): `shared[l]`'s when
// kShared (drawn once for all of an op's 8-bit lists, one span at a time), else drawn
// here. rank: the list's place among the 8-bit lists (the second rounds with its bits'
// bytes swapped, lanes.h).
template <typename Op, int D, bool kShared>
MP_DEVICE void store_codes(const Op& op, E4m3* p, uint8_t* scales,
                           const float (&x)[kHostLanes][kUnroll][kILP][D],
                           const int64_t (&at)[kHostLanes][kUnroll], int u0, int u1,
                           const uint32_t (&shared)[kHostLanes][kILP], int k, int rank) {
  if (p == nullptr) return;
#pragma unroll
  for (int u = u0; u < u1; ++u) {
    uint32_t m[kHostLanes];
    for (int l = 0; l < kHostLanes; ++l) {
      m[l] = 0;
      if (at[l][u] < 0) continue;
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        uint32_t a;
        memcpy(&a, &x[l][u][j][k], sizeof(a));
        a &= 0x7fffffffu;
        m[l] = a > m[l] ? a : m[l];
      }
    }
    block_max(m);
    for (int l = 0; l < kHostLanes; ++l) {
      const int64_t i = at[l][u];
      if (i < 0) continue;
      const int lane = lane_of(l);
      const uint32_t bits = e8m0_scale_bits(bits_float(m[l]));
      const float inv = e8m0_inverse(bits);
      uint32_t random[kILP];
      if constexpr (kShared) {
#pragma unroll
        for (int j = 0; j < kILP; ++j) random[j] = shared[l][j];
      } else {
        if (op.state_stochastic) state_bits(op, i, random);
      }
      Vec<E4m3> codes;
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const float y = x[l][u][j][k] * inv;
        codes.v[j].bits = static_cast<uint8_t>(
            op.state_stochastic
                ? e4m3_code_stochastic(y, rank != 0 ? rotate_bytes(random[j]) : random[j])
                : e4m3_code(y));
      }
      MP_TRACE(k, lane, p + i, kILP, true);
      *reinterpret_cast<Vec<E4m3>*>(p + i) = codes;
      if (lane % kLanesPerBlock == 0) {
        MP_TRACE(k + D, lane, scales + i / kQuantBlock, 1, true);
        scales[i / kQuantBlock] = static_cast<uint8_t>(bits);
      }
    }
  }
}

template <typename Op, typename... Ts, size_t... K>
MP_DEVICE bool apply_blocks(const Op& op, void* const (&base)[sizeof...(Ts)], int64_t first,
                            int64_t n, float* tally, std::index_sequence<K...>) {
  constexpr int D = sizeof...(Ts);
  const void* in[D] = {(((Op::kReads >> K) & 1u) && !kPerTensorList<Op, K>) ? base[K] : nullptr...};
  void* out[D] = {((Op::kWrites >> K) & 1u) ? base[K] : nullptr...};
  uint8_t* scales[D] = {scales_of<Op, K, Ts...>(base)...};
  const float per[D] = {(kPerTensorList<Op, K> ? per_tensor_value<Ts>(base[K]) : 0.f)...};
  // (first is a multiple of kQuantBlock, so each list is vector-aligned at every lane's
  // first element when it is at the tensor's start)
  const bool aligned = ((kPerTensorList<Op, K> || vector_aligned<Ts>(base[K])) && ...);
  const int64_t warp = threadIdx.x / kWarpSize;
  const int64_t step = static_cast<int64_t>(blockDim.x / kWarpSize) * kWarpSpan * kUnroll;
  // With two 8-bit lists (AdamW's moments) the loop twice, `vec` a constant in each:
  // the vector loads and stores, or the element ones, without the other path's issued
  // predicated off (a tenth of Adam's 8-bit instructions). SGD's one-list kernels keep
  // one loop: two copies made ptxas spill 56-152 bytes in its 64-register ones. So do
  // the generic kernels (the modes no Fixed kernel runs: amsgrad, maximize, gradients
  // written by hand, a counted call in a mode that loses no update): their loop holds
  // every mode's code, and its two copies (four with the tallying ones) were half of
  // ptxas's time and a quarter of cicc's in the CUDA Adam unit (csrc/README.md).
  constexpr bool kTwoLists = kBlockedLists<Ts...> > 1;
  constexpr bool kTwoLoops = kTwoLists && IsFixed<Op>::value;
  auto spans = [&](auto vec_value) {
    const bool vec = static_cast<bool>(vec_value);
    bool bad = false;
    // (the bound is the same for every lane of a warp: all of them reach block_max)
    for (int64_t span = warp * kWarpSpan * kUnroll; span < n; span += step) {
      float x[kHostLanes][kUnroll][kILP][D];
      int64_t at[kHostLanes][kUnroll];  // each lane's first element per span, -1 for none
      for (int l = 0; l < kHostLanes; ++l) {
        const int lane = lane_of(l);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t e = span + u * kWarpSpan + lane * kILP;
          at[l][u] = e < n ? first + e : -1;
#pragma unroll
          for (int j = 0; j < kILP; ++j) {
#pragma unroll
            for (int k = 0; k < D; ++k) x[l][u][j][k] = per[k];
          }
          if (at[l][u] >= 0) {
            (load_lane<Ts, D>(in[K], scales[K], at[l][u], vec, lane, x[l][u], K), ...);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (at[l][u] < 0) continue;
          bad |= apply_vector(op, x[l][u], at[l][u], tally);
          (store_lane<Ts, D>(out[K], at[l][u], vec, lane, x[l][u], K), ...);
        }
      }
      if constexpr (kTwoLists) {
        // Span by span, the lanes' rounding bits once for all the 8-bit lists (AdamW's two
        // moments share them, the second's bytes swapped): one Philox call per lane and
        // span, where a call per list drew each twice.
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          uint32_t random[kHostLanes][kILP] = {};
          for (int l = 0; l < kHostLanes; ++l) {
            if (op.state_stochastic && at[l][u] >= 0) {
              state_bits(op, at[l][u], random[l]);
            }
          }
          ((kBlocked<Ts> ? store_codes<Op, D, true>(op, static_cast<E4m3*>(out[K]), scales[K], x,
                                                    at, u, u + 1, random, K, block_rank<K, Ts...>())
                         : void()),
           ...);
        }
      } else {
        const uint32_t none[kHostLanes][kILP] = {};
        ((kBlocked<Ts> ? store_codes<Op, D, false>(op, static_cast<E4m3*>(out[K]), scales[K], x, at,
                                                   0, kUnroll, none, K, block_rank<K, Ts...>())
                       : void()),
         ...);
      }
    }
    return bad;
  };
  if constexpr (kTwoLoops) {
    return aligned ? spans(std::true_type{}) : spans(std::false_type{});
  } else {
    return spans(aligned);
  }
}

// One thread's part of a pointwise launch over lists stored as Ts: nothing when
// *skip != 0, else `op` over its share of the block's chunk; a non-finite input
// that op reports sets *found_inf. Per-tensor lists are not offset by the chunk.
template <typename Op, typename... Ts, size_t... K>
MP_DEVICE void pointwise_block(const TensorListMeta<sizeof...(Ts)>& meta, Op op, const float* skip,
                               float* found_inf, std::index_sequence<K...> seq) {
  if (skip != nullptr && *skip != 0.f) return;
  op.resolve();
  const Chunk c = block_chunk<kBlocksPerChunk>(meta);
  if (c.size == 0) return;
  bool bad = false;
  void* const base[sizeof...(Ts)] = {meta.ptrs[K][c.slot]...};
  // The thread's running tallies (pointwise.h). In the generic kernel a call that
  // tallies and one that does not take two copies of the loop, the second without any
  // tally code: each copy's `tally` is a constant (a choice between the two pointers
  // would also put the sums in local memory). A counting Fixed kernel runs counted
  // calls only (launch_as): its one copy tallies.
  float sums[Tallies<Op>::count + 1] = {};
  bool tallying = false;
  if constexpr (kTallied<Op>) {
    tallying = IsCounting<Op>::value || base[Tallies<Op>::list] != nullptr;
  }
  if constexpr ((kBlocked<Ts> || ...)) {
    at_tensor(op, base);
    bad = !tallying ? apply_blocks<Op, Ts...>(op, base, c.start, c.size, nullptr, seq)
                    : apply_blocks<Op, Ts...>(op, base, c.start, c.size, sums, seq);
  } else {
    void* const ptrs[sizeof...(Ts)] = {kPerTensorList<Op, K>
                                           ? meta.ptrs[K][c.slot]
                                           : offset<Ts>(meta.ptrs[K][c.slot], c.start)...};
    at_tensor(op, ptrs);
    bad = !tallying ? apply_chunk<Op, Ts...>(op, ptrs, c.start, c.size, nullptr, seq)
                    : apply_chunk<Op, Ts...>(op, ptrs, c.start, c.size, sums, seq);
  }
  if constexpr (kTallied<Op>) {
    if (tallying) {
      add_tallies<Tallies<Op>::count>(static_cast<double*>(base[Tallies<Op>::list]), sums, c.size);
    }
  }
  if (bad && found_inf != nullptr) *found_inf = 1.f;
}

// Where the L2 norm's stage 1 puts each chunk's partial sum: the tensors are grouped
// by dtype (fp32, fp16, bf16; list order within a group), each group is one series
// of launches writing from its first_partial on, so every tensor's chunks form one
// contiguous range of the partials, from first_partial[tensor] on.
struct L2NormLayout {
  struct Group {
    at::ScalarType dtype;
    std::vector<at::Tensor> tensors;
    int64_t first_partial;
    Lists<1> lists() const { return {tensors}; }
  };
  std::vector<Group> groups;
  std::vector<int64_t> first_partial;  // per tensor
  int64_t total_chunks = 0;
};

inline L2NormLayout l2norm_layout(at::TensorList tensors) {
  L2NormLayout layout;
  layout.first_partial.assign(tensors.size(), 0);
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    L2NormLayout::Group group{dtype, {}, layout.total_chunks};
    for (size_t t = 0; t < tensors.size(); ++t) {
      if (tensors[t].scalar_type() != dtype) continue;
      group.tensors.push_back(tensors[t]);
      layout.first_partial[t] = layout.total_chunks;
      layout.total_chunks += num_chunks(tensors[t].numel());
    }
    if (!group.tensors.empty()) layout.groups.push_back(std::move(group));
  }
  return layout;
}

// One thread's part of the sum of squares of its block's chunk (of the one list; one
// block per chunk), each element first multiplied by `scale`.
template <typename T>
MP_DEVICE float chunk_sum_of_squares(const TensorListMeta<1>& meta, float scale) {
  const Chunk c = block_chunk<1>(meta);
  const T* data = static_cast<const T*>(meta.ptrs[0][c.slot]) + c.start;
  float acc = 0.f;
  int64_t done = 0;
  if (vector_aligned<T>(data)) {
    done = c.size / kILP * kILP;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kILP; i < done;
         i += static_cast<int64_t>(blockDim.x) * kILP) {
      const Vec<T> v = *reinterpret_cast<const Vec<T>*>(data + i);
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const float x = static_cast<float>(v.v[j]) * scale;
        acc += x * x;
      }
    }
  }
  for (int64_t i = done + threadIdx.x; i < c.size; i += blockDim.x) {
    const float x = static_cast<float>(data[i]) * scale;
    acc += x * x;
  }
  return acc;
}

}  // namespace mixedprec::cuda
