// The CPU runner of the pointwise functors: the chunks of the shared plan are
// spread over threads with at::parallel_for (OpenMP); each chunk is one pass over its
// elements, a vector of floats at a time (vec.h): every list is loaded as fp32 (fp16
// and bf16 converted in registers), the functor runs on the vectors (apply() is a
// template over its value type, pointwise.h), and the lists it writes are stored
// back, converted. The last elements of a chunk go one at a time, as floats, through
// c10's conversions; so does everything in the baseline x86-64 build (and elsewhere).
// Each element sees the same fp32 operations in the same order in every version (no
// FMA contraction: -ffp-contract=off), so every version gives the same bits.
// Functors with FixedModes (pointwise.h; AdamW's and SGD's common modes) get one vector loop
// per mode that they are in (Fixed, in_counted_mode): without the tests of absent lists
// and of the other modes' flags in every step (a fifth to a half of an AdamW step's
// time on AVX2: bench/README.md, "Fixed modes").
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dispatch.h"
#include "../multi_tensor_plan.h"
#include "vec.h"
#include "vec_pair.h"

namespace mixedprec::cpu {

// Whether list k of Op is loaded element by element (read, and not per tensor: a
// per-tensor list's one value is read at p[0] and broadcast, never offset by i).
template <typename Op, size_t K>
constexpr bool loaded_list() {
  return ((Op::kReads >> K) & 1u) && !kPerTensorList<Op, K>;
}

// Whether list k of Op is streamed by the vector passes (read or written element by
// element): those are prefetched.
template <typename Op, size_t K>
constexpr bool streamed_list() {
  return (((Op::kReads | Op::kWrites) >> K) & 1u) && !kPerTensorList<Op, K>;
}

// Whether list k of Op holds values already rounded to its storage when stored (NS::
// store_rounded): the params of the Fixed modes whose functor rounds them
// (pointwise.h's LeanMode::kRoundedParams).
template <typename Op, size_t K>
constexpr bool stored_rounded() {
  if constexpr (IsFixed<Op>::value) return K == 0 && Op::Mode::kRoundedParams;
  return false;
}

// Whether Op on storage Ts runs the AVX2 pair pass with its elements even and odd
// (vec_pair.h's avx2x2_even_odd): a Fixed mode, every streamed list bf16 or int16.
template <typename Op, typename... Ts, size_t... K>
constexpr bool even_odd_pass(std::index_sequence<K...>) {
  if constexpr (IsFixed<Op>::value) {
    return ((!streamed_list<Op, K>() || std::is_same_v<Ts, c10::BFloat16> ||
             std::is_same_v<Ts, int16_t>) &&
            ...);
  }
  return false;
}
template <typename Op, typename... Ts>
constexpr bool kEvenOddPass = even_odd_pass<Op, Ts...>(std::index_sequence_for<Ts...>{});

// The sum of a vector's lanes (the tallies' running sums, pointwise.h), in lane order.
inline float lane_sum(const float& v) { return v; }
template <typename V>
inline float lane_sum(const V& v) {
  float sum = 0.f;
  for (size_t l = 0; l < sizeof(V) / sizeof(float); ++l) sum += v[l];
  return sum;
}
template <typename H>
inline float lane_sum(const Pair<H>& v) {
  return lane_sum(v.a) + lane_sum(v.b);
}

// Where a pass keeps Op's running tallies (pointwise.h): `sums` when its loop sums them
// (kTallied: whether a call does is the functor's flag, set with the list given), else
// null.
template <typename Op, typename V>
inline V* tally_sums(V* sums) {
  if constexpr (kTallied<Op>) {
    return sums;
  } else {
    (void)sums;
    return nullptr;
  }
}

// Adds a pass's tallies (sums, over `elements` elements) to its chunk's words, when
// its tally list is given (data: the chunk's words, run_lists).
template <typename Op, typename V>
inline void add_tallies(void* const* data, const V* sums, int64_t elements) {
  if constexpr (kTallied<Op>) {
    double* words = static_cast<double*>(data[Tallies<Op>::list]);
    if (words == nullptr) return;
    for (int t = 0; t < Tallies<Op>::count; ++t) words[t] += lane_sum(sums[t]);
    words[Tallies<Op>::count] += static_cast<double>(elements);
  } else {
    (void)data;
    (void)sums;
    (void)elements;
  }
}

// op over elements i..end-1 of the lists at p (list k stored as Ts[k]; null:
// absent, read as zeros), one float at a time; 1 when op reported a non-finite input.
template <typename Op, typename... Ts, size_t... K>
__attribute__((noinline)) int elementwise(const Op& op, const std::tuple<Ts*...>& p, int64_t i,
                                          int64_t end, std::index_sequence<K...>) {
  constexpr int D = sizeof...(K);
  static_assert((kPerTensorStorageOk<Op, K, Ts> && ...),
                "per-tensor lists are fp32 or int64, tallies float64");
  const float per[D] = {(kPerTensorList<Op, K> ? per_tensor_value<Ts>(std::get<K>(p)) : 0.f)...};
  void* const data[D] = {static_cast<void*>(std::get<K>(p))...};
  float sums[Tallies<Op>::count + 1] = {};
  float* const tally = tally_sums<Op>(sums);
  const int64_t first = i;
  int any = 0;
  for (; i < end; ++i) {
    float x[D] = {(kPerTensorList<Op, K> ? per[K]
                   : loaded_list<Op, K>() && std::get<K>(p) != nullptr
                       ? static_cast<float>(std::get<K>(p)[i])
                       : 0.f)...};
    any |= static_cast<int>(apply_at(op, x, i, tally));
    ((((Op::kWrites >> K) & 1u) && std::get<K>(p) != nullptr
          ? (void)(std::get<K>(p)[i] = static_cast<Ts>(x[K]))
          : void()),
     ...);
  }
  add_tallies<Op>(data, sums, end - first);
  return any;
}

// Op::kPresent, the lists known present (not null), or 0 when Op does not declare it.
template <typename Op, typename = void>
struct KnownPresent {
  static constexpr unsigned value = 0;
};
template <typename Op>
struct KnownPresent<Op, std::void_t<decltype(Op::kPresent)>> {
  static constexpr unsigned value = Op::kPresent;
};

// Whether list K of Op, at p, is present: known so, or not null.
template <typename Op, size_t K, typename T>
inline bool present(const T* p) {
  return ((KnownPresent<Op>::value >> K) & 1u) != 0 || p != nullptr;
}

// f(functor) for what the chunk's call of op runs as (pointwise.h's in_counted_mode):
// the lists present, and whether it counts (its tally list given), read from the
// chunk's pointers.
template <typename... Ts, typename Op, typename F>
int in_counted_mode(const Op& op, void* const* data, F&& f) {
  unsigned lists = 0;
  for (int k = 0; k < Op::kDepth; ++k) lists |= data[k] != nullptr ? 1u << k : 0u;
  bool counted = false;
  if constexpr (Tallies<Op>::count > 0) counted = data[Tallies<Op>::list] != nullptr;
  return mixedprec::in_counted_mode<Ts...>(op, lists, counted, f);
}

// The type the vector passes take list K as: its storage, or float for a per-tensor
// list, which they never load or store per element (its value is broadcast, or read by
// at_tensor): an int64 one then needs no vector load.
template <typename Op, size_t K, typename T>
using VecStorage = std::conditional_t<kPerTensorList<Op, K>, float, T>;

// The DRAWS of a pass that draws no rounding bits ahead (the functor draws its own).
struct NoDraws {
  static constexpr bool value = false;
  static constexpr int kAhead = 1;
  using Drawn = int64_t;  // (unused)
};

// op.apply_at on vector x of element i, where the pass draws rounding bits ahead
// (DRAWS, in a Fixed mode that rounds stochastically: DrawsPerVector) with those it drew
// for x: drawn[next .. count - 1] are the next vectors', and when none is left it draws
// up to DRAWS::kAhead more (of those before `end`), or hands op the index.
template <typename DRAWS, typename Op, typename V, typename T>
inline auto apply_drawn(const Op& op, V* x, int64_t i, int64_t end, T* tally,
                        typename DRAWS::Drawn (&drawn)[DRAWS::kAhead], int& next, int& count) {
  if constexpr (DRAWS::value && DrawsPerVector<Op>::value) {
    if (next < count) return apply_at(op, x, drawn[next++], tally);
    if ((count = DRAWS::draw(op.rounding.key, i, end, drawn)) > 0) {
      next = 1;
      return apply_at(op, x, drawn[0], tally);
    }
    return apply_at(op, x, DRAWS::index(i), tally);
  } else {
    (void)end, (void)drawn, (void)next, (void)count;
    return apply_at(op, x, i, tally);
  }
}

// The lists that a pass which delays its stores (MP_PASS's DELAY) stores one vector
// late, after the next vector's op.apply: in a Fixed mode (pointwise.h), the params or
// the model copy when held narrower than fp32, unless the mode writes a compensation
// (kahan, remainder). Those lists are the last the functor computes, at the end of the
// vector's chain of square root and divisions: their conversion (about a dozen
// instructions a pair for a bf16 store on AVX2) would otherwise wait there, ahead of
// the next vector's loads and math in the reorder buffer. In kahan and remainder,
// delaying the params, with their compensation or without, ranged from 3% faster to 5%
// slower (bench/README.md, "Stores one vector late").
template <typename... Ts, size_t... K>
constexpr unsigned narrow_lists(std::index_sequence<K...>) {
  return ((!std::is_same_v<Ts, float> ? 1u << K : 0u) | ... | 0u);
}
template <typename Op, typename... Ts>
constexpr unsigned delayed_lists() {
  if constexpr (IsFixed<Op>::value) {
    if constexpr (((Op::kPresent >> Op::kCompList) & 1u) != 0) return 0u;
    return Op::kPresent & Op::kWrites & (1u | 1u << Op::kModelList) &
           narrow_lists<Ts...>(std::index_sequence_for<Ts...>{});
  }
  return 0u;
}
// (MP_PASS, MP_BLOCK_PASS) the lists of MASK that are present, from vectors X, stored at
// element AT
#define MP_STORE_LISTS(NS, MASK, AT, X)                                               \
  (((((MASK) >> K) & 1u) && present<Op, K>(std::get<K>(v))                            \
        ? (stored_rounded<Op, K>() ? NS::store_rounded(std::get<K>(v) + (AT), (X)[K]) \
                                   : NS::store(std::get<K>(v) + (AT), (X)[K]))        \
        : void()),                                                                    \
   ...)

// fn(op, data, begin, end): op over elements begin..end-1, a vector at a time, then
// the rest one at a time. op comes by value, so that its fields are loop invariants.
// A per-tensor list is broadcast once, before the loop. `flatten` inlines the calls
// of the loop (op.apply and, through it, the Lanes functions that carry a target
// attribute, such as sqrt, which GCC would not inline into apply, a function without
// one: they were calls through the PLT, per vector); elementwise stays a call. DRAWS:
// how a stochastic Fixed mode gets its rounding bits, several vectors' at once, up to
// DRAWS::kAhead (apply_drawn; vec_pair.h's PairedDraws of the pass's vector, or
// EvenOddDraws for the pass whose pair holds its elements even and odd).
// DELAY: the lists of delayed_lists are stored one vector late, after the next vector's
// op.apply (see there; the AVX2 pair passes).
#define MP_PASS(NAME, TARGET, NS, DRAWS, DELAY)                                             \
  template <typename Op, typename... Ts, size_t... K>                                       \
  TARGET int NAME(const Op op, void* const* data, int64_t begin, int64_t end,               \
                  std::index_sequence<K...> seq) {                                          \
    using Vec = NS::Vec;                                                                    \
    constexpr int64_t W = sizeof(Vec) / sizeof(float);                                      \
    constexpr int D = sizeof...(K);                                                         \
    const std::tuple<Ts*...> p{static_cast<Ts*>(data[K])...};                               \
    const std::tuple<VecStorage<Op, K, Ts>*...> v{                                          \
        static_cast<VecStorage<Op, K, Ts>*>(data[K])...};                                   \
    const Vec per[D] = {                                                                    \
        (kPerTensorList<Op, K> ? NS::broadcast(per_tensor_value<Ts>(data[K])) : Vec{})...}; \
    typename Lanes<Vec>::Flag bad = Lanes<Vec>::none();                                     \
    Vec sums[Tallies<Op>::count + 1] = {};                                                  \
    Vec* const tally = tally_sums<Op>(sums);                                                \
    [[maybe_unused]] typename DRAWS::Drawn drawn[DRAWS::kAhead];                            \
    /* drawn[drawn_next .. drawn_count - 1]: the next vectors' bits */                      \
    [[maybe_unused]] int drawn_next = 0, drawn_count = 0;                                   \
    constexpr unsigned kDelayed = DELAY ? delayed_lists<Op, Ts...>() : 0u;                  \
    [[maybe_unused]] Vec held[D] = {}; /* vector i - W's lists of kDelayed */               \
    int64_t i = begin;                                                                      \
    for (; i + W <= end; i += W) {                                                          \
      ((streamed_list<Op, K>() && present<Op, K>(std::get<K>(v))                            \
            ? prefetch_ahead(std::get<K>(v) + i)                                            \
            : void()),                                                                      \
       ...);                                                                                \
      if constexpr (W > 16) { /* a line per 64 bytes of a stream: 16 fp32 lanes */          \
        ((streamed_list<Op, K>() && sizeof(VecStorage<Op, K, Ts>) * W > 64 &&               \
                  present<Op, K>(std::get<K>(v))                                            \
              ? prefetch_ahead(std::get<K>(v) + i + 16)                                     \
              : void()),                                                                    \
         ...);                                                                              \
      }                                                                                     \
      Vec x[D] = {(kPerTensorList<Op, K> ? per[K]                                           \
                   : loaded_list<Op, K>() && present<Op, K>(std::get<K>(v))                 \
                       ? NS::load(std::get<K>(v) + i)                                       \
                       : Vec{})...};                                                        \
      bad |= apply_drawn<DRAWS>(op, x, i, end, tally, drawn, drawn_next, drawn_count);      \
      MP_STORE_LISTS(NS, Op::kWrites & ~kDelayed, i, x);                                    \
      if constexpr (kDelayed != 0) {                                                        \
        if (i > begin) MP_STORE_LISTS(NS, kDelayed, i - W, held);                           \
        ((((kDelayed >> K) & 1u) ? (void)(held[K] = x[K]) : void()), ...);                  \
      }                                                                                     \
    }                                                                                       \
    if (kDelayed != 0 && i > begin) MP_STORE_LISTS(NS, kDelayed, i - W, held);              \
    add_tallies<Op>(data, sums, i - begin);                                                 \
    return NS::any(bad) | elementwise(op, p, i, end, seq);                                  \
  }

#if defined(MP_X86_ISA)
MP_PASS(pass_avx2, __attribute__((target(MP_AVX2_TARGET), flatten)), avx2, NoDraws, false)
MP_PASS(pass_avx512, __attribute__((target(MP_AVX512_TARGET), flatten)), avx512, NoDraws, false)
MP_PASS(pass_avx512x2, __attribute__((target(MP_AVX512_TARGET ",avx512bf16"), flatten)), avx512x2,
        PairedDraws<VecF32>, false)
MP_PASS(pass_avx2x2, __attribute__((target(MP_AVX2_TARGET), flatten)), avx2x2, PairedDraws<VecF8x2>,
        true)
MP_PASS(pass_avx2x2_even_odd, __attribute__((target(MP_AVX2_TARGET), flatten)), avx2x2_even_odd,
        EvenOddDraws, true)
#endif
#undef MP_PASS

// The cache lines kPrefetchBytes ahead of a block of kQuantBlock elements of storage T
// (one line for each 64 bytes of it; an 8-bit list's 32 bytes: on every other block).
template <typename T>
inline void block_prefetch(const T* p) {
  constexpr size_t bytes = sizeof(T) * kQuantBlock;
  if constexpr (bytes < 64) {
    if ((reinterpret_cast<uintptr_t>(p) & 63u) < bytes) prefetch_ahead(p);
  } else {
    for (size_t at = 0; at < bytes; at += 64) prefetch_ahead(reinterpret_cast<const char*>(p) + at);
  }
}

// fn(op, data, begin, end) for functors with 8-bit lists: a block of kQuantBlock
// elements at a time (begin and end are multiples of it: validated), J vectors
// of W lanes each, in groups of NS::kGroup blocks. An 8-bit list is loaded as its
// codes' values times the block's scale; the functor runs on each vector (its lists in
// registers, as in MP_PASS); the other lists it writes are stored at once, the 8-bit
// ones kept until the whole group is known: each block's largest magnitude gives its
// new scale, then the codes (NS::store_blocks, the group's blocks together). The scale
// lists are not offset by the element index: block i / kQuantBlock of each is read and
// written. NS::BlockBits holds a block's rounding bits in the form NS::store_blocks
// takes them; NS::blocks_bits draws those of the next NS::kBlocksAhead blocks at once
// (of those before `end`; a whole number of groups). DRAWS: the params' rounding bits,
// as MP_PASS's (eight vectors' at once: four blocks on AVX2, eight on AVX-512; the
// scalar pass's per element, in the functor).
#define MP_BLOCK_PASS(NAME, TARGET, NS, DRAWS)                                                    \
  template <typename Op, typename... Ts, size_t... K>                                             \
  TARGET int NAME(const Op op, void* const* data, int64_t begin, int64_t end,                     \
                  std::index_sequence<K...>) {                                                    \
    using Vec = NS::Vec;                                                                          \
    constexpr int64_t W = sizeof(Vec) / sizeof(float);                                            \
    constexpr int J = static_cast<int>(kQuantBlock / W);                                          \
    constexpr int D = sizeof...(K);                                                               \
    constexpr int NB = kBlockedLists<Ts...>;                                                      \
    /* the lists written but not 8-bit: stored at once */                                         \
    constexpr unsigned kStoredAtOnce = Op::kWrites & ~((kBlocked<Ts> ? 1u << K : 0u) | ... | 0u); \
    constexpr int G = NS::kGroup;                                                                 \
    static_assert(NS::kBlocksAhead % G == 0, "the bits of whole groups are drawn at once");       \
    const std::tuple<VecStorage<Op, K, Ts>*...> v{                                                \
        static_cast<VecStorage<Op, K, Ts>*>(data[K])...};                                         \
    const Vec per[D] = {                                                                          \
        (kPerTensorList<Op, K> ? NS::broadcast(per_tensor_value<Ts>(data[K])) : Vec{})...};       \
    typename Lanes<Vec>::Flag bad = Lanes<Vec>::none();                                           \
    Vec sums[Tallies<Op>::count + 1] = {};                                                        \
    Vec* const tally = tally_sums<Op>(sums);                                                      \
    NS::BlockBits random[NS::kBlocksAhead];                                                       \
    int next_bits = NS::kBlocksAhead; /* random[next_bits]: the next group's bits */              \
    [[maybe_unused]] typename DRAWS::Drawn drawn[DRAWS::kAhead]; /* the params' (MP_PASS) */      \
    [[maybe_unused]] int drawn_next = 0, drawn_count = 0;                                         \
    for (int64_t first = begin; first < end; first += G * kQuantBlock) {                          \
      const int n = static_cast<int>(std::min<int64_t>(G, (end - first) / kQuantBlock));          \
      decltype(&random[0][0]) bits = nullptr; /* the 8-bit lists' rounding bits, if stochastic */ \
      if (op.state_stochastic) {                                                                  \
        if (next_bits == NS::kBlocksAhead) {                                                      \
          NS::blocks_bits(op.state_key, first, end, random);                                      \
          next_bits = 0;                                                                          \
        }                                                                                         \
        bits = random[next_bits];                                                                 \
        next_bits += G;                                                                           \
      }                                                                                           \
      Vec kept[G][J][NB];                                                                         \
      for (int q = 0; q < n; ++q) {                                                               \
        const int64_t i = first + q * kQuantBlock;                                                \
        const int64_t b = i / kQuantBlock;                                                        \
        ((streamed_list<Op, K>() && present<Op, K>(std::get<K>(v))                                \
              ? block_prefetch<VecStorage<Op, K, Ts>>(std::get<K>(v) + i)                         \
              : void()),                                                                          \
         ...);                                                                                    \
        const float scale[D] = {                                                                  \
            (kBlocked<Ts> && present<Op, K>(std::get<K>(v))                                       \
                 ? e8m0_value(static_cast<const uint8_t*>(data[scale_list<Op, K, Ts...>()])[b])   \
                 : 1.f)...};                                                                      \
        for (int j = 0; j < J; ++j) {                                                             \
          const int64_t at = i + j * W;                                                           \
          Vec x[D] = {(kPerTensorList<Op, K> ? per[K]                                             \
                       : loaded_list<Op, K>() && present<Op, K>(std::get<K>(v))                   \
                           ? (kBlocked<Ts> ? NS::load(std::get<K>(v) + at) * scale[K]             \
                                           : NS::load(std::get<K>(v) + at))                       \
                           : Vec{})...};                                                          \
          bad |= apply_drawn<DRAWS>(op, x, at, end, tally, drawn, drawn_next, drawn_count);       \
          MP_STORE_LISTS(NS, kStoredAtOnce, at, x);                                               \
          ((kBlocked<Ts> ? (void)(kept[q][j][block_rank<K, Ts...>()] = x[K]) : void()), ...);     \
        }                                                                                         \
      }                                                                                           \
      ((((Op::kWrites >> K) & 1u) && kBlocked<Ts> && present<Op, K>(std::get<K>(v))               \
            ? NS::store_blocks<G, J, NB>(                                                         \
                  std::get<K>(v) + first,                                                         \
                  static_cast<uint8_t*>(data[scale_list<Op, K, Ts...>()]) + first / kQuantBlock,  \
                  kept, block_rank<K, Ts...>(), bits, block_rank<K, Ts...>() != 0, n)             \
            : void()),                                                                            \
       ...);                                                                                      \
    }                                                                                             \
    add_tallies<Op>(data, sums, end - begin);                                                     \
    return NS::any(bad) ? 1 : 0;                                                                  \
  }

#if defined(MP_X86_ISA)
MP_BLOCK_PASS(block_pass_avx2x2, __attribute__((target(MP_AVX2_TARGET), flatten)), avx2x2,
              PairedDraws<VecF8x2>)
MP_BLOCK_PASS(block_pass_avx512x2, __attribute__((target(MP_AVX512_TARGET ",avx512bf16"), flatten)),
              avx512x2, PairedDraws<VecF32>)
#endif
MP_BLOCK_PASS(block_pass_scalar, , scalar, NoDraws)
#undef MP_BLOCK_PASS
#undef MP_STORE_LISTS

template <typename Op, typename... Ts, size_t... K>
int pass(const Op& op, void* const* data, int64_t begin, int64_t end,
         std::index_sequence<K...> seq) {
  if constexpr ((kBlocked<Ts> || ...)) {
#if defined(MP_X86_ISA)
    switch (cpu_isa()) {
      case Isa::kAvx512:
        // A block is one pair of 16-float vectors (vec_pair.h): bf16 params rounded by
        // vcvtne2ps2bf16 where the CPU has AVX512_BF16, master="stochastic"'s bits 32
        // per Philox call; 11-27% faster than 16 lanes a step (bench/README.md).
        return in_counted_mode<Ts...>(op, data, [&](const auto& o) {
          return block_pass_avx512x2<std::decay_t<decltype(o)>, Ts...>(o, data, begin, end, seq);
        });
      case Isa::kAvx2:
        return in_counted_mode<Ts...>(op, data, [&](const auto& o) {
          return block_pass_avx2x2<std::decay_t<decltype(o)>, Ts...>(o, data, begin, end, seq);
        });
      default: break;
    }
#endif
    return block_pass_scalar<Op, Ts...>(op, data, begin, end, seq);
  } else {
    const std::tuple<Ts*...> p{static_cast<Ts*>(data[K])...};
    // Fewer elements than the narrowest vector (a bias, a norm's weight, a scalar): the
    // vector passes would load no vector and end in elementwise, as this does at once.
    if (end - begin < 8) return elementwise(op, p, begin, end, seq);
#if defined(MP_X86_ISA)
    switch (cpu_isa()) {
      case Isa::kAvx512:
        // The optimizers: 32 lanes a step (vec_pair.h), which halves the loop's fixed
        // work per element (its tests of absent lists and of the modes, the prefetches,
        // the pointer steps) and gives stochastic rounding 4 Philox blocks per call (8,
        // two vectors' in two chains, in the stochastic Fixed modes: PairedDraws); the
        // last (fewer than 32) elements 16 lanes a step. Same bits: every lane sees the
        // same operations, and the rounding bits depend on the element index only.
        if constexpr (NeedsIndex<Op>::value) {
          const int64_t mid = begin + (end - begin) / 32 * 32;
          const int bad = in_counted_mode<Ts...>(op, data, [&](const auto& o) {
            return pass_avx512x2<std::decay_t<decltype(o)>, Ts...>(o, data, begin, mid, seq);
          });
          return bad | pass_avx512<Op, Ts...>(op, data, mid, end, seq);
        }
        return pass_avx512<Op, Ts...>(op, data, begin, end, seq);
      case Isa::kAvx2:
        // The same for AVX2: 16 lanes a step (two 8-float vectors), and 2 Philox
        // blocks per call (in the stochastic Fixed modes two vectors' 4 per call:
        // PairedDraws, vec_pair.h); the last (fewer than 16) elements 8 at a time.
        if constexpr (NeedsIndex<Op>::value) {
          const int64_t mid = begin + (end - begin) / 16 * 16;
          const int bad = in_counted_mode<Ts...>(op, data, [&](const auto& o) {
            using Mode = std::decay_t<decltype(o)>;  // a Fixed<Op, M>, or Op in no mode
            if constexpr (kEvenOddPass<Mode, Ts...>) {
              return pass_avx2x2_even_odd<Mode, Ts...>(o, data, begin, mid, seq);
            } else {
              return pass_avx2x2<Mode, Ts...>(o, data, begin, mid, seq);
            }
          });
          return bad | pass_avx2<Op, Ts...>(op, data, mid, end, seq);
        }
        return pass_avx2<Op, Ts...>(op, data, begin, end, seq);
      default: break;
    }
#endif
    return elementwise(op, p, begin, end, seq);
  }
}

struct CpuEngine {
  struct Guard {  // one CPU device: nothing to set
    explicit Guard(const at::Device&) {}
  };

  template <typename F, typename... Args>
  static void run_single(Args... args) {
    F::apply(args...);
  }

  // In l2norm.cpp.
  static std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors, const float* inv_scale,
                                                   bool per_tensor, at::Device device);

  template <typename Op, typename... Ts>
  static void run(const Lists<sizeof...(Ts)>& lists, const Op& op, const float* skip,
                  float* found_inf) {
    run_lists<Op, Ts...>(lists, op, skip, found_inf, std::index_sequence_for<Ts...>{});
  }

 private:
  template <typename Op, typename... Ts, size_t... K>
  static void run_lists(const Lists<sizeof...(Ts)>& lists, const Op& op_in, const float* skip,
                        float* found_inf, std::index_sequence<K...> seq) {
    constexpr int D = sizeof...(Ts);
    if (skip != nullptr && *skip != 0.f) return;
    Op op = op_in;
    op.resolve();
    std::vector<int64_t> numels;
    numels.reserve(lists[0].size());
    int64_t total = 0;
    for (const auto& t : lists[0]) total += numels.emplace_back(t.numel());
    const auto plans = plan_launches(numels, 0, 0);
    if (plans.empty()) return;
    const LaunchPlan& plan = plans.front();
    const int64_t num_chunks = static_cast<int64_t>(plan.block_slot.size());
    // Chunks per thread, at least: a thread gets about a chunk's worth of elements or
    // none (many small tensors, a chunk each, run on the calling thread: waking the
    // others costs more than their work).
    const int64_t grain = (kChunkSize * num_chunks + total - 1) / std::max<int64_t>(total, 1);
    std::vector<char> bad(num_chunks, 0);
    // Tallies (pointwise.h): each chunk sums into words of its own, added to its
    // tensor's in chunk order after the passes (the same sums whatever the threads).
    constexpr int kTallyList = Tallies<Op>::list;
    constexpr int kWords = Tallies<Op>::count + 1;
    const bool tallies = tallying<Op>(lists);
    std::vector<double> words(tallies ? num_chunks * kWords : 0, 0.0);
    at::parallel_for(0, num_chunks, grain, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int t = plan.tensors[plan.block_slot[b]];
        const int64_t begin = static_cast<int64_t>(plan.block_chunk[b]) * kChunkSize;
        const int64_t end = std::min(numels[t], begin + kChunkSize);
        void* data[D] = {lists[K].empty() ? nullptr : lists[K][t].data_ptr()...};
        if constexpr (kTallyList >= 0) {
          if (tallies) data[kTallyList] = words.data() + b * kWords;
        }
        Op tensor_op = op;
        at_tensor(tensor_op, data);
        bad[b] = pass<Op, Ts...>(tensor_op, data, begin, end, seq) != 0;
      }
    });
    if (found_inf != nullptr && std::any_of(bad.begin(), bad.end(), [](char c) { return c; })) {
      *found_inf = 1.f;
    }
    if constexpr (kTallyList >= 0) {
      for (int64_t b = 0; tallies && b < num_chunks; ++b) {
        double* out =
            lists[kTallyList][plan.tensors[plan.block_slot[b]]].template data_ptr<double>();
        for (int w = 0; w < kWords; ++w) out[w] += words[b * kWords + w];
      }
    }
  }
};

}  // namespace mixedprec::cpu
