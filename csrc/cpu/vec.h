// Vectors of floats for the CPU engine, their loads from and stores to fp32, fp16,
// bf16 and int16 storage, the broadcast of one float, and the choice of instruction
// set at run time.
//
// The engine's loops are compiled for AVX-512 (16 floats), AVX2 (8) and baseline
// x86-64 (one float at a time, through c10's scalar conversions; the only version
// elsewhere), and run the widest that both the CPU has and torch's own CPU kernels use
// (torch.backends.cpu.get_cpu_capability(), which ATEN_CPU_CAPABILITY can lower). The
// vector conversions round as c10's do (fp32 -> fp16 and -> bf16 to nearest even), so
// every version gives the same bits, but for the payloads of NaNs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "../pointwise.h"

namespace mixedprec::cpu {

enum class Isa { kBaseline, kAvx2, kAvx512 };
Isa cpu_isa();
// Whether the AVX-512 passes may round fp32 to bf16 with AVX512_BF16's vcvtne2ps2bf16
// (cpu_isa() is kAvx512 and the CPU has it; vec_pair.h), set once at load.
extern const bool avx512_bf16_stores;
// Whether the AVX-512 passes may use AVX512_VBMI's byte permutations (cpu_isa() is
// kAvx512 and the CPU has VBMI: the 8-bit state's decode and code stores, vec.h).
extern const bool avx512_vbmi;

}  // namespace mixedprec::cpu

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MP_X86_ISA 1
#include <immintrin.h>

namespace mixedprec::cpu {
// The vector loops prefetch each stream this far ahead: one thread then streams about
// 20% faster than with the hardware prefetcher alone (measured on a Xeon with AVX-512,
// L2 norm and copy of 25M elements), as fast as torch's own kernels.
constexpr int kPrefetchBytes = 4096;

// Whether the vector loops prefetch (prefetch_ahead), set once at load (vec.cpp): not
// on AMD's cores with AVX-512, where the hardware prefetcher alone streamed faster (Zen
// 4: the list ops 10-30% and AdamW's memory-bound modes 2-15%; bench/README.md,
// "Software prefetch on AMD's AVX-512 cores"), else on; MIXEDPREC_CPU_PREFETCH=0 or 1
// sets it. The same bits either way: a prefetch only moves cache lines.
extern const bool software_prefetch;

// Asks for the cache line kPrefetchBytes past p.
inline void prefetch_ahead(const void* p) {
  if (software_prefetch) _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}
}  // namespace mixedprec::cpu

#define MP_AVX512_TARGET "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"
#define MP_AVX2_TARGET "avx2,fma,f16c"

namespace mixedprec {

// GCC's vector extensions: + - * / work lane by lane, with scalars broadcast.
typedef float VecF16 __attribute__((vector_size(64)));
typedef int32_t VecI16 __attribute__((vector_size(64)));
typedef uint32_t VecU16 __attribute__((vector_size(64)));
typedef float VecF8 __attribute__((vector_size(32)));
typedef int32_t VecI8 __attribute__((vector_size(32)));
typedef uint32_t VecU8 __attribute__((vector_size(32)));

// Philox4x32-10 (philox.h) of stochastic rounding's blocks `block` .. `block` + 2N - 1
// in N vectors, block + 2j and block + 2j + 1 in out[j]: its 32-bit lanes are
// rounding_block(key, block + 2j)'s v[0..3], then the next block's; as 16-bit lanes,
// half h of each block in order, the bits of elements 8 * (block + 2j) on (x86 is
// little-endian). Each round is one vpmuludq for all four products of a vector (the
// scalar form takes four 64-bit multiplies, which share one port); the N chains of
// dependent rounds run interleaved, sharing the round keys and constants, and the
// counters are one 64-bit add to a constant each. (AVX-512 machines take
// philox_avx512 below.)
template <int N>
__attribute__((target(MP_AVX2_TARGET))) inline void rounding_blocks_avx2(const RoundingKey& key,
                                                                         uint64_t block,
                                                                         __m256i (&out)[N]) {
  constexpr uint32_t kM0 = kPhiloxM0, kM1 = kPhiloxM1, kW0 = kPhiloxW0, kW1 = kPhiloxW1;
  const long long tail = static_cast<long long>(uint64_t{key.salt} | uint64_t{key.step} << 32);
  const __m256i first =
      _mm256_add_epi64(_mm256_setr_epi64x(0, tail, 1, tail),
                       _mm256_and_si256(_mm256_set1_epi64x(static_cast<long long>(block)),
                                        _mm256_setr_epi64x(-1, 0, -1, 0)));
  for (int j = 0; j < N; ++j)
    out[j] = _mm256_add_epi64(first, _mm256_setr_epi64x(2 * j, 0, 2 * j, 0));
  const uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  __m256i k = _mm256_setr_epi32(static_cast<int>(k0), 0, static_cast<int>(k1), 0,
                                static_cast<int>(k0), 0, static_cast<int>(k1), 0);
  const __m256i w = _mm256_setr_epi32(static_cast<int>(kW0), 0, static_cast<int>(kW1), 0,
                                      static_cast<int>(kW0), 0, static_cast<int>(kW1), 0);
  const __m256i m = _mm256_setr_epi32(static_cast<int>(kM0), 0, static_cast<int>(kM1), 0,
                                      static_cast<int>(kM0), 0, static_cast<int>(kM1), 0);
  // Bytes (per 128-bit half) that move v[1] and v[3] to words 0 and 2, words 1 and 3
  // zero (index -128).
  const __m256i odd_words =
      _mm256_setr_epi8(4, 5, 6, 7, -128, -128, -128, -128, 12, 13, 14, 15, -128, -128, -128, -128,
                       4, 5, 6, 7, -128, -128, -128, -128, 12, 13, 14, 15, -128, -128, -128, -128);
  for (int r = 0; r < 10; ++r) {
    if (r > 0) k = _mm256_add_epi32(k, w);
    // Per block: products (lo0, hi0, lo1, hi1) of M0 * v[0] and M1 * v[2]; the new
    // words are (hi1 ^ v[1] ^ k0, lo1, hi0 ^ v[3] ^ k1, lo0).
    for (int j = 0; j < N; ++j) {
      const __m256i p = _mm256_mul_epu32(out[j], m);
      const __m256i odd = _mm256_shuffle_epi8(out[j], odd_words);  // (v[1], 0, v[3], 0)
      out[j] = _mm256_xor_si256(_mm256_shuffle_epi32(p, _MM_SHUFFLE(0, 1, 2, 3)),
                                _mm256_xor_si256(odd, k));
    }
  }
}
// Blocks `block` and `block + 1` (rounding_blocks_avx2's first vector). The 8-float
// AVX2 vector uses the first block only: half the width costs the same instructions.
__attribute__((target(MP_AVX2_TARGET))) inline __m256i rounding_blocks2(const RoundingKey& key,
                                                                        uint64_t block) {
  __m256i out[1];
  rounding_blocks_avx2<1>(key, block, out);
  return out[0];
}

// The same rounds for AVX-512 machines, 4 blocks (`block` .. `block + 3`) in 512-bit
// vectors or 2 in 256-bit ones (as rounding_blocks2), in the same output layout. V:
// __m512i or __m256i, through the helpers below. Between the rounds a block's words
// are kept as (v[0], v[3], v[2], v[1]): v[0] and v[2] in the even words, which
// vpmuludq multiplies, and v[3] and v[1] in the odd words where the products' high
// halves land, so that one vpternlogd, merging into the products under an odd-word
// mask, forms both xors in place, and one vpshufd takes the words back to that order:
// three instructions a round (one vpmuludq, one vpternlogd, one vpshufd), where the
// plain order takes a vpsrlq more (2026-12-02, 1 thread: "stochastic" with bf16 moments
// 5-7% faster, with 8-bit moments 5%). The round keys are each the first key plus a
// constant (no chain of adds), the counters two masked broadcasts and one masked
// 64-bit add, put in that order and out of it by one vpshufd each.
namespace philox_avx512 {
#define MP_AVX512_FN __attribute__((target(MP_AVX512_TARGET))) inline
// 64-bit lanes: the block (in the even lanes) plus (j, salt | step << 32) per block j.
MP_AVX512_FN __m512i counters(const RoundingKey& key, uint64_t block, __m512i) {
  const long long tail = static_cast<long long>(uint64_t{key.salt} | uint64_t{key.step} << 32);
  // (j, tail) per block from a constant and one masked broadcast (a vector of runtime
  // lanes would be built lane by lane), then the block added to the even lanes.
  const __m512i lanes =
      _mm512_mask_set1_epi64(_mm512_setr_epi64(0, 0, 1, 0, 2, 0, 3, 0), 0xaa, tail);
  return _mm512_mask_add_epi64(lanes, 0x55, lanes,
                               _mm512_set1_epi64(static_cast<long long>(block)));
}
MP_AVX512_FN __m256i counters(const RoundingKey& key, uint64_t block, __m256i) {
  const long long tail = static_cast<long long>(uint64_t{key.salt} | uint64_t{key.step} << 32);
  const __m256i lanes = _mm256_mask_set1_epi64(_mm256_setr_epi64x(0, 0, 1, 0), 0xa, tail);
  return _mm256_mask_add_epi64(lanes, 0x5, lanes,
                               _mm256_set1_epi64x(static_cast<long long>(block)));
}
// Words (a, 0, b, 0) in every 128-bit lane.
MP_AVX512_FN __m512i pairs(uint32_t a, uint32_t b, __m512i) {
  return _mm512_set4_epi32(0, static_cast<int>(b), 0, static_cast<int>(a));
}
MP_AVX512_FN __m256i pairs(uint32_t a, uint32_t b, __m256i) {
  return _mm256_setr_epi32(static_cast<int>(a), 0, static_cast<int>(b), 0, static_cast<int>(a), 0,
                           static_cast<int>(b), 0);
}
// Words (0, a, 0, b) from (a, 0, b, 0): the round keys' layout. (Built from pairs: a
// vector of runtime words in odd lanes GCC builds word by word.)
MP_AVX512_FN __m512i odd(__m512i x) { return _mm512_maskz_slli_epi64(0xff, x, 32); }
MP_AVX512_FN __m256i odd(__m256i x) { return _mm256_slli_epi64(x, 32); }
MP_AVX512_FN __m512i add(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
MP_AVX512_FN __m256i add(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
MP_AVX512_FN __m512i mul(__m512i a, __m512i b) { return _mm512_maskz_mul_epu32(0xff, a, b); }
MP_AVX512_FN __m256i mul(__m256i a, __m256i b) { return _mm256_mul_epu32(a, b); }
// Words 1 and 3 of each block swapped: (v0, v1, v2, v3) <-> (v0, v3, v2, v1).
constexpr int kSwapOdd = _MM_SHUFFLE(1, 2, 3, 0);
MP_AVX512_FN __m512i swap_odd(__m512i x) {
  return _mm512_maskz_shuffle_epi32(0xffff, x, static_cast<_MM_PERM_ENUM>(kSwapOdd));
}
MP_AVX512_FN __m256i swap_odd(__m256i x) { return _mm256_shuffle_epi32(x, kSwapOdd); }
// One round on the kept order: from the products p = (lo0, hi0, lo1, hi1) (of M0 * v0
// and M1 * v2), the state c = (v0, v3, v2, v1) and the round key k = (0, k1, 0, k0), the
// new words (n0, n1, n2, n3) = (hi1 ^ v1 ^ k0, lo1, hi0 ^ v3 ^ k1, lo0): the xors of the
// odd words give (lo0, n2, lo1, n0) = (n3, n2, n1, n0), rotated by one word to
// (n0, n3, n2, n1).
constexpr int kRotate = _MM_SHUFFLE(2, 1, 0, 3);
MP_AVX512_FN __m512i mix(__m512i p, __m512i c, __m512i k) {
  return _mm512_maskz_shuffle_epi32(0xffff, _mm512_mask_ternarylogic_epi32(p, 0xaaaa, c, k, 0x96),
                                    static_cast<_MM_PERM_ENUM>(kRotate));
}
MP_AVX512_FN __m256i mix(__m256i p, __m256i c, __m256i k) {
  return _mm256_shuffle_epi32(_mm256_mask_ternarylogic_epi32(p, 0xaa, c, k, 0x96), kRotate);
}
// In N vectors, out[j] the blocks from block + j * (the blocks one V holds) on: the N
// chains of rounds interleaved (each is a chain of dependent instructions).
template <int N, typename V>
MP_AVX512_FN void rounding_blocks(const RoundingKey& key, uint64_t block, V (&out)[N]) {
  constexpr uint64_t kPerVector = sizeof(V) / 16;  // (a block's four words: 16 bytes)
  const V k =
      odd(pairs(static_cast<uint32_t>(key.seed >> 32), static_cast<uint32_t>(key.seed), V{}));
  const V m = pairs(kPhiloxM0, kPhiloxM1, V{});
  for (int j = 0; j < N; ++j) out[j] = swap_odd(counters(key, block + j * kPerVector, V{}));
  for (uint32_t r = 0; r < 10; ++r) {
    const V round_key = add(k, odd(pairs(r * kPhiloxW1, r * kPhiloxW0, V{})));
    for (int j = 0; j < N; ++j) out[j] = mix(mul(out[j], m), out[j], round_key);
  }
  for (int j = 0; j < N; ++j) out[j] = swap_odd(out[j]);
}
template <typename V>
MP_AVX512_FN V rounding_blocks(const RoundingKey& key, uint64_t block) {
  V out[1];
  rounding_blocks<1>(key, block, out);
  return out[0];
}
#undef MP_AVX512_FN
}  // namespace philox_avx512

// The bits of local elements index .. index + n - 1 (lanes.h's element_bits), for
// vectors whose lanes are not consecutive in the full tensor (they cross the end of a
// run, RoundingKey): out of line, to keep the vector path inlined.
__attribute__((noinline, cold)) inline void lane_bits(const RoundingKey& key, int64_t index, int n,
                                                      uint32_t* out) {
  element_bits(key, index, n, out);
}

// The bits of N consecutive global elements from g on (N = 8 or 16) as 16-bit halves:
// Philox blocks g / 8 on, two per rounding_blocks2; when g % 8 != 0 (a shard that
// starts off a multiple of 8), one call more and the window of N halves from g % 8.
template <int N>
__attribute__((target(MP_AVX2_TARGET))) inline void consecutive_bits(const RoundingKey& key,
                                                                     int64_t g, uint16_t* out) {
  const uint64_t block = static_cast<uint64_t>(g) / 8;
  const int shift = static_cast<int>(g % 8);
  uint16_t halves[32];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves), rounding_blocks2(key, block));
  if (shift + N > 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves + 16), rounding_blocks2(key, block + 2));
  }
  memcpy(out, halves + shift, N * sizeof(uint16_t));
}

// round_bf16_stochastic (pointwise.h) on every lane, lane j with bits[j] (< 2^16):
// finite lanes get (bits(x) + bits) & 0xffff0000 (round_bf16_stochastic_finite, all a
// vector takes when it has no other lane); inf stays inf; NaN becomes c10's bf16 NaN
// (0x7fc0), as c10::BFloat16(x) gives in the scalar path.
template <typename U>
inline U round_bf16_stochastic_bits(U u, U bits) {
  return (u + bits) & 0xffff0000u;
}
template <typename F, typename U>
inline F round_bf16_stochastic_finite(F x, U bits) {
  return (F)round_bf16_stochastic_bits((U)x, bits);
}
template <typename F, typename U>
inline F round_bf16_stochastic_lanes(F x, U bits) {
  const U u = (U)x;
  const auto finite = (F)(u & 0x7fffffffu) <= 3.40282347e+38f;
  const U other = x != x ? U{} + 0x7fc00000u : u;
  return (F)(finite ? round_bf16_stochastic_bits(u, bits) : other);
}

// join_bf16_remainder and split_bf16_remainder (lanes.h) on every lane, in the bits
// (F: the float vector; I, U: the int32 and uint32 vectors of its width). The vector
// passes carry an int16 list (the remainders) as its words sign-extended to 32 bits,
// those bits in a float vector's lanes, not as the floats of their values (as the
// scalar code does): loads and stores then convert nothing, and the join and the split
// are integer operations alone, two conversions fewer on each side of the update's
// chain (2026-11-30, Zen 3: AdamW "remainder" 11-18% faster, bench/README.md).
template <typename F, typename U>
inline F join_bf16_lanes(F param, F remainder) {
  return (F)((U)param + (U)remainder);
}
template <typename F, typename U>
inline F split_bf16_unless_nan(F master, F& remainder) {  // (for lanes that are not NaN)
  const U u = (U)master;
  const U high = (u + 0x8000u) & 0xffff0000u;
  remainder = (F)(u - high);
  return (F)high;
}
template <typename F, typename I, typename U>
inline F split_bf16_lanes(F master, F& remainder) {
  const I nan = master != master;
  const F high = split_bf16_unless_nan<F, U>(master, remainder);
  remainder = nan ? F{} : remainder;
  return nan ? master : high;
}

// e8m0_scale_bits (lanes.h) on every lane: the scale bytes of blocks whose largest
// magnitudes' bits are a (sign clear; the engines' group stores, vec_pair.h), 127 for 0
// and NaN, in 32-bit lanes (F: the float vector; I, U: the int32 and uint32 vectors of
// its width).
template <typename F, typename I, typename U>
inline U e8m0_scale_bits_lanes(U a) {
  // (the comparison is -1 where the mantissa is above 0x600000: e = E - 127 - 7 there)
  I e = (I)(a >> 23) - 8 - (I)((a & 0x7fffffu) > 0x600000u);
  e = e < 1 ? I{} + 1 : e;
  e = e > 253 ? I{} + 253 : e;
  return (U)((F)a > 0.f ? e : I{} + 127);
}

// e4m3_code (lanes.h) on every lane, codes in 32-bit lanes (F: the float vector; I, U:
// the int32 and uint32 vectors of its width). (The decode: e4m3_fp16_words.)
template <typename F, typename I, typename U>
inline U e4m3_code_lanes(F y) {
  const U u = (U)y;
  const U abs_bits = u & 0x7fffffffu;
  const F a = (F)abs_bits;
  const U sub = (U)(a * 512.f + 12582912.f) - 0x4b400000u;
  const U normal = ((abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20) - 960u;
  U code = a < 0.015625f ? sub : normal;
  code = code > 0x7eu ? U{} + 0x7eu : code;
  code = a != a ? U{} + 0x7fu : code;
  return ((u >> 24) & 0x80u) | code;
}

// e4m3_code_stochastic on every lane, with r's bits per lane (each r < 2^16: the
// engines' draws). The normal codes' bias is folded into one add (exact: their
// magnitudes' bits are at least 968 << 20). `small`: whether any lane may be below
// 2^-6 (the subnormal codes, zero included), whose float arithmetic the caller skips
// when it knows none is (a NaN lane is not small); `finite`: whether the caller knows
// every lane finite, hence at most 448 (a block's values over its scale, when the
// block's largest is finite), whose codes then need no saturation and no NaN code:
// a value of 448 or less rounds to 0x7e or less.
template <typename F, typename I, typename U>
inline U e4m3_code_stochastic_lanes(F y, U r, bool small = true, bool finite = false) {
  const U u = (U)y;
  const U abs_bits = u & 0x7fffffffu;
  const F a = (F)abs_bits;
  U code = (abs_bits + (r << 4) + (8u - (960u << 20))) >> 20;
  if (small) {
    const U sub = (U) __builtin_convertvector(
        a * 512.f + (__builtin_convertvector((I)r, F) + 0.5f) * 1.52587890625e-5f, I);
    code = a < 0.015625f ? sub : code;
  }
  if (!finite) {
    code = code > 0x7eu ? U{} + 0x7eu : code;
    code = a != a ? U{} + 0x7fu : code;
  }
  return ((u >> 24) & 0x80u) | code;
}

// |x| <= FLT_MAX is false for inf and NaN, as std::isfinite. (The masked forms of
// the AVX-512 intrinsics: the plain ones pass GCC 12 an "undefined" operand that it
// then reports as maybe uninitialized.)
template <>
struct Lanes<VecF16> {
  using Flag = VecI16;
  __attribute__((target(MP_AVX512_TARGET))) static inline VecF16 sqrt(VecF16 x) {
    return (VecF16)_mm512_mask_sqrt_ps((__m512)x, static_cast<__mmask16>(-1), (__m512)x);
  }
  static inline VecI16 not_finite(VecF16 x) {
    return !((VecF16)((VecU16)x & 0x7fffffffu) <= 3.40282347e+38f);
  }
  static inline VecI16 none() { return VecI16{}; }
  static inline VecF16 select(VecI16 cond, VecF16 a, VecF16 b) { return cond ? a : b; }
  static inline VecF16 ones(VecI16 cond) { return (VecF16)(cond & (VecI16)(VecF16{} + 1.f)); }
  __attribute__((target(MP_AVX512_TARGET))) static inline VecF16 mul_add(VecF16 a, VecF16 b,
                                                                         VecF16 c) {
    return (VecF16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
  }
  // One compare, one compare under its mask and one masked add (GCC would lower the
  // generic form's & of two comparisons lane by lane).
  __attribute__((target(MP_AVX512_TARGET))) static inline VecF16 count_zero_nonzero(VecF16 count,
                                                                                    VecF16 a,
                                                                                    VecF16 b) {
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 both = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask((__m512)a, zero, _CMP_EQ_OQ),
                                                   (__m512)b, zero, _CMP_NEQ_UQ);
    return (VecF16)_mm512_mask_add_ps((__m512)count, both, (__m512)count, _mm512_set1_ps(1.f));
  }
  // Round to nearest even in the bits (NaN may come out as inf: only the Kahan
  // compensation reads it, which is then NaN as with c10's rounding).
  static inline VecF16 round_bf16(VecF16 x) {
    const VecU16 u = (VecU16)x;
    return (VecF16)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  }
  // Philox for blocks g / 8 and g / 8 + 1 in vector lanes when the lanes' global
  // indices are g .. g + 15 with g % 8 == 0 (a whole tensor, as the engine's vectors
  // start); for other consecutive ones, blocks g / 8 .. g / 8 + 3 in one 512-bit
  // vector and a permutation of its halves; else lane by lane.
  __attribute__((target(MP_AVX512_TARGET))) static inline VecF16 round_bf16_stochastic(
      VecF16 x, const RoundingKey& key, int64_t index) {
    typedef uint16_t Halves __attribute__((vector_size(32)));
    VecU16 bits;
    const int64_t g = key.global(index);
    if (g % 8 == 0 && key.consecutive(index, 16)) {
      const __m256i out =
          philox_avx512::rounding_blocks<__m256i>(key, static_cast<uint64_t>(g) / 8);
      bits = __builtin_convertvector((Halves)out, VecU16);
    } else if (key.consecutive(index, 16)) {
      // Blocks g / 8 .. g / 8 + 3 (the 16 halves from g % 8 on lie in the first 3):
      // 32-bit lane j takes half g % 8 + j, zero-extended (16-bit lanes 2j + 1 zero).
      typedef int16_t Shorts32 __attribute__((vector_size(64)));
      const Shorts32 first = {0, 0, 1, 1, 2,  2,  3,  3,  4,  4,  5,  5,  6,  6,  7,  7,
                              8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
      const __m512i out =
          philox_avx512::rounding_blocks<__m512i>(key, static_cast<uint64_t>(g) / 8);
      bits = (VecU16)_mm512_maskz_permutexvar_epi16(
          0x55555555u, (__m512i)(first + static_cast<int16_t>(g % 8)), out);
    } else {
      uint32_t lanes[16];
      lane_bits(key, index, 16, lanes);
      memcpy(&bits, lanes, sizeof(bits));
    }
    return nan_or_inf(x) == 0 ? round_bf16_stochastic_finite(x, bits)
                              : round_bf16_stochastic_lanes<VecF16>(x, bits);
  }
  // The lanes that are NaN or inf, as a mask (one vfpclassps): a vector without any is
  // rounded by round_bf16_stochastic_finite alone, an add and an and where the whole
  // takes seven operations, the same bits (the 32-lane pass tests both of its halves at
  // once, vec_pair.h).
  __attribute__((target(MP_AVX512_TARGET))) static inline __mmask16 nan_or_inf(VecF16 x) {
    return _mm512_fpclass_ps_mask((__m512)x, 0x01 | 0x08 | 0x10 | 0x80);  // qNaN, ±inf, sNaN
  }
  static inline VecF16 join_bf16(VecF16 param, VecF16 remainder) {
    return join_bf16_lanes<VecF16, VecU16>(param, remainder);
  }
  static inline VecF16 split_bf16(VecF16 master, VecF16& remainder) {
    return split_bf16_lanes<VecF16, VecI16, VecU16>(master, remainder);
  }
};

// maximum (pointwise.h, AdamOp's amsgrad) on the vectors: a where a >= b or a is NaN,
// else b, in one mask and one blend (GCC lowers the generic form's `a >= b` on these
// vectors to a scalar compare per lane).
template <>
__attribute__((target(MP_AVX512_TARGET))) inline VecF16 maximum<VecF16>(VecF16 a, VecF16 b) {
  const __mmask16 keep = _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GE_OQ) |
                         _mm512_cmp_ps_mask((__m512)a, (__m512)a, _CMP_UNORD_Q);
  return (VecF16)_mm512_mask_blend_ps(keep, (__m512)b, (__m512)a);
}

template <>
struct Lanes<VecF8> {
  using Flag = VecI8;
  __attribute__((target(MP_AVX2_TARGET))) static inline VecF8 sqrt(VecF8 x) {
    return (VecF8)_mm256_sqrt_ps((__m256)x);
  }
  static inline VecI8 not_finite(VecF8 x) {
    return !((VecF8)((VecU8)x & 0x7fffffffu) <= 3.40282347e+38f);
  }
  static inline VecI8 none() { return VecI8{}; }
  static inline VecF8 select(VecI8 cond, VecF8 a, VecF8 b) { return cond ? a : b; }
  static inline VecF8 ones(VecI8 cond) { return (VecF8)(cond & (VecI8)(VecF8{} + 1.f)); }
  __attribute__((target(MP_AVX2_TARGET))) static inline VecF8 mul_add(VecF8 a, VecF8 b, VecF8 c) {
    return (VecF8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
  }
  // (256-bit comparisons and their & stay vector code: test_cpu_vectorised)
  static inline VecF8 count_zero_nonzero(VecF8 count, VecF8 a, VecF8 b) {
    return count + (VecF8)((a == VecF8{}) & (b != VecF8{}) & (VecI8)(VecF8{} + 1.f));
  }
  // Round to nearest even in the bits (NaN may come out as inf: only the Kahan
  // compensation reads it, which is then NaN as with c10's rounding).
  static inline VecF8 round_bf16(VecF8 x) {  // (as avx2::bf16_rounded_unless_nan: no shift)
    const VecU8 u = (VecU8)x;
    return (VecF8)((u + 0x8000u + (VecU8)((u & 0x1ffffu) == 0x8000u)) & 0xffff0000u);
  }
  // Philox for block g / 8 in vector lanes when the lanes' global indices are
  // g .. g + 7 with g % 8 == 0 (a whole tensor, as the engine's vectors start);
  // consecutive_bits for other consecutive ones; else lane by lane.
  __attribute__((target(MP_AVX2_TARGET))) static inline VecF8 round_bf16_stochastic(
      VecF8 x, const RoundingKey& key, int64_t index) {
    typedef uint16_t Halves __attribute__((vector_size(16)));
    VecU8 bits;
    const int64_t g = key.global(index);
    if (g % 8 == 0 && key.consecutive(index, 8)) {
      const __m256i out = rounding_blocks2(key, static_cast<uint64_t>(g) / 8);
      bits = __builtin_convertvector((Halves)_mm256_castsi256_si128(out), VecU8);
    } else if (key.consecutive(index, 8)) {
      Halves halves;
      consecutive_bits<8>(key, g, reinterpret_cast<uint16_t*>(&halves));
      bits = __builtin_convertvector(halves, VecU8);
    } else {
      uint32_t lanes[8];
      lane_bits(key, index, 8, lanes);
      memcpy(&bits, lanes, sizeof(bits));
    }
    return round_bf16_stochastic_lanes<VecF8>(x, bits);
  }
  static inline VecF8 join_bf16(VecF8 param, VecF8 remainder) {
    return join_bf16_lanes<VecF8, VecU8>(param, remainder);
  }
  static inline VecF8 split_bf16(VecF8 master, VecF8& remainder) {
    return split_bf16_lanes<VecF8, VecI8, VecU8>(master, remainder);
  }
};

template <>
__attribute__((target(MP_AVX2_TARGET))) inline VecF8 maximum<VecF8>(VecF8 a, VecF8 b) {
  const __m256 keep = _mm256_or_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_GE_OQ),
                                   _mm256_cmp_ps((__m256)a, (__m256)a, _CMP_UNORD_Q));
  return (VecF8)_mm256_blendv_ps((__m256)b, (__m256)a, keep);
}

namespace cpu {

#define MP_AVX512 __attribute__((target(MP_AVX512_TARGET))) inline
#define MP_AVX2 __attribute__((target(MP_AVX2_TARGET))) inline

// The fp16 words of 16 e4m3 codes' values / 2^8 (the 8-bit state's decode, AVX2's and
// AVX-512's): a code's sign and magnitude bits, shifted, are those words, e4m3's
// subnormals fp16's, and the NaN codes are made fp16 NaNs. F16C's conversion of them
// is exact and does not flush the subnormal halves (MXCSR's DAZ is not consulted:
// tested).
MP_AVX2 __m256i e4m3_fp16_words(const E4m3* p) {
  const __m256i sign_extended =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(sign_extended, 7),
                                     _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
  const __m256i nan =
      _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
  return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
}

namespace avx512 {
using Vec = VecF16;
// All lanes, for the masked (maskz) forms of the intrinsics used here: their plain
// forms pass GCC 12 an "undefined" operand that it reports as maybe uninitialized.
constexpr __mmask16 kAll16 = 0xffff;
constexpr __mmask8 kAll8 = 0xff;
MP_AVX512 Vec broadcast(float v) { return (Vec)_mm512_set1_ps(v); }
MP_AVX512 Vec load(const float* p) { return (Vec)_mm512_loadu_ps(p); }
MP_AVX512 Vec load(const c10::Half* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (Vec)_mm512_mask_cvtph_ps(_mm512_setzero_ps(), static_cast<__mmask16>(-1), h);
}
MP_AVX512 Vec load(const c10::BFloat16* p) {  // bf16 is fp32's top half
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_maskz_cvtepu16_epi32(kAll16, b);
  return (Vec)_mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll16, wide, 16));
}
MP_AVX512 void store(float* p, Vec x) { _mm512_storeu_ps(p, (__m512)x); }
MP_AVX512 void store(c10::Half* p, Vec x) {
  const __m256i h = _mm512_mask_cvtps_ph(_mm256_setzero_si256(), static_cast<__mmask16>(-1),
                                         (__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
MP_AVX512 void store(c10::BFloat16* p, Vec x) {
  const __m512i u = _mm512_castps_si512((__m512)x);
  const __m512i lsb =
      _mm512_and_si512(_mm512_maskz_srli_epi32(kAll16, u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_maskz_srli_epi32(
      kAll16, _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q);
  const __m512i bits = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(kAll16, bits));
}
// int16 (master="remainder"'s remainders): the words sign-extended, in the lanes' bits
// (join_bf16_lanes), and back.
typedef int16_t Shorts __attribute__((vector_size(32)));
MP_AVX512 Vec load(const int16_t* p) {  // one vpmovsxwd from memory
  const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (Vec)_mm512_maskz_cvtepi16_epi32(kAll16, s);
}
MP_AVX512 void store(int16_t* p, Vec x) {
  const Shorts s = __builtin_convertvector((VecI16)x, Shorts);
  memcpy(p, &s, sizeof(s));
}
MP_AVX512 bool any(VecI16 flags) {
  return _mm512_test_epi32_mask((__m512i)flags, (__m512i)flags) != 0;
}
// Block scales' lists (uint8, read and written by the block pass only): never loaded
// or stored element by element; these overloads only let the passes compile.
MP_AVX512 Vec load(const uint8_t*) { return Vec{}; }
MP_AVX512 void store(uint8_t*, Vec) {}
// The 16 random bits of each element of a block (lanes.h's block_bits): 4 Philox
// blocks in one call when the block's elements are consecutive from a multiple of 8 in
// the whole tensor (as a whole tensor's and a Shard(0) shard's are), else lanes.h's.
using BlockBits = uint32_t[kQuantBlock];
MP_AVX512 void block_bits(const RoundingKey& key, int64_t index, uint32_t (&out)[kQuantBlock]) {
  const int64_t g = key.global(index);
  if (g % 8 != 0 || !key.consecutive(index, kQuantBlock))
    return mixedprec::block_bits(key, index, out);
  const __m512i v = philox_avx512::rounding_blocks<__m512i>(key, static_cast<uint64_t>(g) / 8);
  // (The zero-masked extract of the low half rather than _mm512_castsi512_si256, which
  // GCC 12 builds from an extract with an undefined operand, warned of as uninitialized.)
  _mm512_storeu_si512(
      out, _mm512_maskz_cvtepu16_epi32(kAll16, _mm512_maskz_extracti64x4_epi64(kAll8, v, 0)));
  _mm512_storeu_si512(
      out + 16, _mm512_maskz_cvtepu16_epi32(kAll16, _mm512_maskz_extracti64x4_epi64(kAll8, v, 1)));
}
// The bits of the next kBlocksAhead blocks (the engine's block pass: a group of
// vec_pair.h's kGroup blocks), of those before `end`: in kBlocksAhead chains of
// Philox rounds side by side when the blocks' elements are consecutive from a multiple
// of 8 in the whole tensor, else a block at a time.
constexpr int kBlocksAhead = 8;
MP_AVX512 void blocks_bits(const RoundingKey& key, int64_t index, int64_t end,
                           BlockBits (&out)[kBlocksAhead]) {
  const int64_t g = key.global(index);
  if (g % 8 != 0 || index + kBlocksAhead * kQuantBlock > end ||
      !key.consecutive(index, kBlocksAhead * kQuantBlock)) {
    for (int b = 0; b < kBlocksAhead && index + b * kQuantBlock < end; ++b)
      avx512::block_bits(key, index + b * kQuantBlock, out[b]);
    return;
  }
  __m512i v[kBlocksAhead];
  philox_avx512::rounding_blocks<kBlocksAhead>(key, static_cast<uint64_t>(g) / 8, v);
  for (int b = 0; b < kBlocksAhead; ++b) {
    _mm512_storeu_si512(out[b], _mm512_maskz_cvtepu16_epi32(
                                    kAll16, _mm512_maskz_extracti64x4_epi64(kAll8, v[b], 0)));
    _mm512_storeu_si512(out[b] + 16, _mm512_maskz_cvtepu16_epi32(
                                         kAll16, _mm512_maskz_extracti64x4_epi64(kAll8, v[b], 1)));
  }
}
// 8-bit state (lanes.h): 16 e4m3 codes, decoded (through fp16: e4m3_fp16_words); the
// codes of 16 values (|y| <= 448); a block of J vectors of list k stored with its
// scale (the engine's block pass).
MP_AVX512 Vec load(const E4m3* p) {
  return (Vec)_mm512_maskz_cvtph_ps(kAll16, e4m3_fp16_words(p)) * 256.f;
}
MP_AVX512 void store(E4m3* p, Vec y) {
  const VecU16 c = e4m3_code_lanes<Vec, VecI16, VecU16>(y);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_maskz_cvtepi32_epi8(kAll16, (__m512i)c));
}
// 16 codes (in 32-bit lanes) stored as bytes.
MP_AVX512 void store_codes(E4m3* p, __m512i codes) {
  _mm512_mask_cvtepi32_storeu_epi8(p, kAll16, codes);
}

// AVX512_VBMI's byte permutation of two tables (vpermt2b), as inline assembly: the
// passes are compiled for AVX-512 without VBMI, which Skylake's and Cascade Lake's
// Xeons lack, so that GCC puts no VBMI instruction anywhere else in them; they run it
// only where avx512_vbmi holds. Byte i of the result is a's byte index[i] & 63 where
// bit 6 of index[i] is clear, else b's; `keep`'s clear bits zero their bytes.
MP_AVX512 __m512i permute_bytes(__m512i a, __m512i index, __m512i b) {
  asm("vpermt2b %2, %1, %0" : "+v"(a) : "v"(index), "vm"(b));
  return a;
}
MP_AVX512 __m512i permute_bytes(__mmask64 keep, __m512i a, __m512i index, __m512i b) {
  asm("vpermt2b %3, %2, %0%{%1%}%{z%}" : "+v"(a) : "Yk"(keep), "v"(index), "vm"(b));
  return a;
}
// The high halves of the float bits of e4m3's 128 magnitudes (each e4m3 value is a
// bf16 value: its float's low half is 0), their low bytes in `low`, high in `high`; the
// NaN code 0x7f as e4m3_fp16_words' NaN converted (0x7ff0), so that both decodes give
// the same bits.
struct E4m3Tables {
  alignas(64) uint8_t low[128];
  alignas(64) uint8_t high[128];
};
constexpr uint32_t e4m3_magnitude_high_half(uint32_t m) {
  if (m == 0x7fu) return 0x7ff0u;
  if (m >= 8u) return (m + 960u) << 4;  // lanes.h's e4m3_value: (m + 960) << 20
  if (m == 0u) return 0u;
  uint32_t f = m, e = 121u;  // m * 2^-9 = (f / 8) * 2^(e - 127) once f is in [8, 16)
  while (f < 8u) f <<= 1, --e;
  return (e << 7) | ((f - 8u) << 4);
}
constexpr E4m3Tables make_e4m3_tables() {
  E4m3Tables t{};
  for (uint32_t m = 0; m < 128u; ++m) {
    t.low[m] = static_cast<uint8_t>(e4m3_magnitude_high_half(m) & 0xffu);
    t.high[m] = static_cast<uint8_t>(e4m3_magnitude_high_half(m) >> 8);
  }
  return t;
}
inline constexpr E4m3Tables kE4m3Tables = make_e4m3_tables();
// The values of 32 e4m3 codes, lo (codes 0-15) and hi (16-31), with VBMI (the caller
// checks avx512_vbmi): each code's magnitude looks up its value's two high bytes (two
// 128-byte tables), the code's sign goes into the high byte, and two permutations
// place the bytes in the top halves of 16 lanes each. The same bits as load(const
// E4m3*) (tested), in five vector operations where that takes about nine per 16 codes.
MP_AVX512 void e4m3_values_vbmi(const E4m3* p, Vec& lo, Vec& hi) {
  const __m512i codes = _mm512_maskz_loadu_epi8(0xffffffffull, p);  // 32 bytes, the rest 0
  const __m512i* low = reinterpret_cast<const __m512i*>(kE4m3Tables.low);
  const __m512i* high = reinterpret_cast<const __m512i*>(kE4m3Tables.high);
  const __m512i low_bytes =
      permute_bytes(_mm512_load_si512(low), codes, _mm512_load_si512(low + 1));
  // the high bytes, the codes' signs or-ed in: a | (b & c)
  const __m512i high_bytes = _mm512_ternarylogic_epi32(
      permute_bytes(_mm512_load_si512(high), codes, _mm512_load_si512(high + 1)), codes,
      _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
  typedef char Bytes64 __attribute__((vector_size(64)));
  // lane i: bytes 2, 3 the low and high bytes of code i (bytes 0, 1 zeroed)
  constexpr Bytes64 index = {0, 0, 0,  64, 0, 0, 1,  65, 0, 0, 2,  66, 0, 0, 3,  67,
                             0, 0, 4,  68, 0, 0, 5,  69, 0, 0, 6,  70, 0, 0, 7,  71,
                             0, 0, 8,  72, 0, 0, 9,  73, 0, 0, 10, 74, 0, 0, 11, 75,
                             0, 0, 12, 76, 0, 0, 13, 77, 0, 0, 14, 78, 0, 0, 15, 79};
  constexpr __mmask64 kHighHalves = 0xccccccccccccccccull;
  lo = (Vec)permute_bytes(kHighHalves, low_bytes, (__m512i)index, high_bytes);
  hi = (Vec)permute_bytes(kHighHalves, low_bytes, (__m512i)(index + 16), high_bytes);
}
// The codes of 32 values, two vectors of 16 in 32-bit lanes, stored as bytes: with VBMI
// one permutation and one 32-byte store, else two narrowing stores.
MP_AVX512 void store_codes(E4m3* p, __m512i lo, __m512i hi) {
  if (!avx512_vbmi) {
    store_codes(p, lo);
    store_codes(p + 16, hi);
    return;
  }
  typedef char Bytes64 __attribute__((vector_size(64)));
  constexpr Bytes64 index = {0,  4,  8,  12, 16, 20, 24, 28, 32, 36,  40,  44,  48,  52,  56,  60,
                             64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, 108, 112, 116, 120, 124};
  _mm512_mask_storeu_epi8(p, 0xffffffffull, permute_bytes(lo, (__m512i)index, hi));
}
// e4m3_code_stochastic_lanes of 16 values with their bits (< 2^16), its subnormal
// arithmetic only where a lane is below 2^-6. (flatten: the generic lanes function,
// which carries no target, is inlined here at any optimisation level; an out-of-line
// copy would take its 512-bit vectors by another calling convention.)
__attribute__((target(MP_AVX512_TARGET), flatten)) inline __m512i stochastic_codes(
    Vec y, __m512i r, bool finite = false) {
  const bool small =
      _mm512_cmp_ps_mask(_mm512_abs_ps((__m512)y), _mm512_set1_ps(0.015625f), _CMP_LT_OQ) != 0;
  return (__m512i)e4m3_code_stochastic_lanes<Vec, VecI16, VecU16>(y, (VecU16)r, small, finite);
}
// The codes of 32 values of an 8-bit list, lo and hi, already divided by their block's
// scale (y: |y| <= 448): to nearest even, or stochastically with `random` (byte-swapped
// when `rotate`; `finite`: the block's values are, as e4m3_code_stochastic_lanes takes
// it). (The block's scale: vec_pair.h's store_blocks.)
MP_AVX512 void store_block_codes(E4m3* p, Vec lo, Vec hi, const uint32_t* random, bool rotate,
                                 bool finite) {
  const Vec y[2] = {lo, hi};
  // the second 8-bit list's bits byte-swapped (rotate_bytes): bytes 1, 0 of each dword
  const __m512i swap = _mm512_set4_epi32(0x80800c0d, 0x80800809, 0x80800405, 0x80800001);
  __m512i codes[2];
  for (int j = 0; j < 2; ++j) {
    if (random == nullptr) {
      codes[j] = (__m512i)e4m3_code_lanes<Vec, VecI16, VecU16>(y[j]);
      continue;
    }
    __m512i r = _mm512_loadu_si512(random + 16 * j);
    if (rotate) r = _mm512_shuffle_epi8(r, swap);
    codes[j] = stochastic_codes(y[j], r, finite);
  }
  store_codes(p, codes[0], codes[1]);
}
// A value already rounded to T (engine.h's stored_rounded): stored as any other here.
template <typename T>
MP_AVX512 void store_rounded(T* p, Vec x) {
  store(p, x);
}
}  // namespace avx512

namespace avx2 {
using Vec = VecF8;
MP_AVX2 Vec broadcast(float v) { return (Vec)_mm256_set1_ps(v); }
MP_AVX2 Vec load(const float* p) { return (Vec)_mm256_loadu_ps(p); }
MP_AVX2 Vec load(const c10::Half* p) {
  return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// The 8 words in both 128-bit halves (vbroadcasti128, a load), each moved by one
// vpshufb to the high half of its lane: one shuffle, where a widening load and a shift
// took two operations (three pipe cycles in llvm-mca's Zen 3 model) on the two pipes
// that Zen 3 gives shifts and shuffles.
MP_AVX2 Vec load(const c10::BFloat16* p) {
  const __m256i b =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i to_high =
      _mm256_setr_epi8(-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7, -128,
                       -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128, -128, 14, 15);
  return (Vec)_mm256_shuffle_epi8(b, to_high);
}
MP_AVX2 void store(float* p, Vec x) { _mm256_storeu_ps(p, (__m256)x); }
MP_AVX2 void store(c10::Half* p, Vec x) {
  const __m128i h = _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
// x's bf16 bits, rounded to nearest even, in the high half of each 32-bit lane (the
// low half holds what rounding left there): for lanes that are not NaN. x + 0x8000,
// less one where the low half is a tie (0x8000) below an even word, which then stays:
// x + 0x7fff + bit 16 of x without its shift (Zen 3 runs shifts on two of its four FP
// pipes, with the shuffles; an and, a compare and integer adds on all four).
MP_AVX2 __m256i bf16_rounded_unless_nan(Vec x) {
  const __m256i u = _mm256_castps_si256((__m256)x);
  const __m256i tie_to_even = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x1ffff)),
                                                 _mm256_set1_epi32(0x8000));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), tie_to_even);
}
// The same in the low half of each 32-bit lane (bf16_words: every lane).
MP_AVX2 __m256i bf16_words_unless_nan(Vec x) {
  return _mm256_srli_epi32(bf16_rounded_unless_nan(x), 16);
}
// x's bf16 bits, rounded to nearest even, NaN as 0x7fc0, in the low half of each
// 32-bit lane.
MP_AVX2 __m256i bf16_words(Vec x) {
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps((__m256)x, (__m256)x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(bf16_words_unless_nan(x), _mm256_set1_epi32(0x7fc0), nan);
}
// Whether a lane of a or b is NaN (one comparison for both).
MP_AVX2 bool any_nan(Vec a, Vec b) {
  const __m256 nan = _mm256_cmp_ps((__m256)a, (__m256)b, _CMP_UNORD_Q);
  return !_mm256_testz_ps(nan, nan);
}
// The 16-bit words of a's and b's 32-bit lanes (each < 2^16), in order: packus works
// per 128-bit half, hence the permute.
MP_AVX2 __m256i words(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0b11011000);
}
MP_AVX2 void store(c10::BFloat16* p, Vec x) {
  const __m256i bits = bf16_words(x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words(bits, bits)));
}
typedef int16_t Shorts __attribute__((vector_size(16)));
MP_AVX2 Vec load(const int16_t* p) {  // one vpmovsxwd from memory (join_bf16_lanes)
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (Vec)_mm256_cvtepi16_epi32(s);
}
MP_AVX2 void store(int16_t* p, Vec x) {
  const Shorts s = __builtin_convertvector((VecI8)x, Shorts);
  memcpy(p, &s, sizeof(s));
}
MP_AVX2 bool any(VecI8 flags) { return !_mm256_testz_si256((__m256i)flags, (__m256i)flags); }
MP_AVX2 Vec load(const uint8_t*) { return Vec{}; }
MP_AVX2 void store(uint8_t*, Vec) {}
// A value already rounded to T (engine.h's stored_rounded): stored as any other here.
template <typename T>
MP_AVX2 void store_rounded(T* p, Vec x) {
  store(p, x);
}
}  // namespace avx2

#undef MP_AVX512
#undef MP_AVX2

}  // namespace cpu
}  // namespace mixedprec
#endif

namespace mixedprec::cpu::scalar {

// One float at a time, as the block pass of the baseline build runs (engine.h):
// c10's conversions, and the 8-bit state's codes as lanes.h gives them.
using Vec = float;
inline float broadcast(float v) { return v; }
template <typename T>
inline float load(const T* p) {
  return static_cast<float>(*p);
}
inline float load(const E4m3* p) { return e4m3_value(p->bits); }
template <typename T>
inline void store(T* p, float x) {
  *p = static_cast<T>(x);
}
inline void store(E4m3* p, float y) { p->bits = static_cast<uint8_t>(e4m3_code(y)); }
template <typename T>
inline void store_rounded(T* p, float x) {
  store(p, x);
}
inline bool any(bool flag) { return flag; }
using BlockBits = uint32_t[kQuantBlock];
inline void block_bits(const RoundingKey& key, int64_t index, uint32_t (&out)[kQuantBlock]) {
  mixedprec::block_bits(key, index, out);
}
constexpr int kBlocksAhead = 1;
inline void blocks_bits(const RoundingKey& key, int64_t index, int64_t,
                        BlockBits (&out)[kBlocksAhead]) {
  scalar::block_bits(key, index, out[0]);
}
// A group of kGroup blocks (the engine's block pass): one.
constexpr int kGroup = 1;
template <int G, int J, int D, typename T>
inline void store_blocks(T*, uint8_t*, const float (&)[G][J][D], int, const uint32_t*, bool, int) {}
template <int G, int J, int D>
inline void store_blocks(E4m3* p, uint8_t* scale, const float (&x)[G][J][D], int k,
                         const uint32_t* random, bool rotate, int) {
  static_assert(G == 1 && J == kQuantBlock, "one float a time: a block is kQuantBlock steps");
  store_block_of<D>(p, scale, x[0], k, random, rotate);
}

}  // namespace mixedprec::cpu::scalar
