// Two AVX-512 vectors as one value of 32 floats, for the optimizers' passes with
// stochastic rounding (engine.h): their Philox bits then come from one 512-bit
// Philox4x32-10 call per 32 elements (four blocks, philox_avx512 in vec.h) instead of
// one 256-bit call per 16. The ten rounds are a chain of dependent instructions
// (about 5 cycles each), so a call's cost is its latency more than its instruction
// count: four blocks per chain give twice the bits per cycle of two. Everything else
// is the 16-float vector's code on each half, so the bits and values are those of
// the 16-float (and AVX2, and baseline) passes.
#pragma once

#include "vec.h"

#if defined(MP_X86_ISA)
namespace mixedprec {

#define MP_AVX512 __attribute__((target(MP_AVX512_TARGET))) inline

// Lanes 0..15 in a, 16..31 in b.
struct VecF32 {
  VecF16 a, b;
};
struct FlagF32 {  // per-lane flags (Lanes<VecF32>::Flag), as two VecI16
  VecI16 a, b;
  MP_AVX512 FlagF32& operator|=(FlagF32 o) {
    a |= o.a;
    b |= o.b;
    return *this;
  }
};

#define MP_PAIR_OP(OP)                                                                  \
  MP_AVX512 VecF32 operator OP(VecF32 x, VecF32 y) { return {x.a OP y.a, x.b OP y.b}; } \
  MP_AVX512 VecF32 operator OP(VecF32 x, float y) { return {x.a OP y, x.b OP y}; }      \
  MP_AVX512 VecF32 operator OP(float x, VecF32 y) { return {x OP y.a, x OP y.b}; }
MP_PAIR_OP(+)
MP_PAIR_OP(-)
MP_PAIR_OP(*)
MP_PAIR_OP(/)
#undef MP_PAIR_OP
#define MP_PAIR_CMP(OP) \
  MP_AVX512 FlagF32 operator OP(VecF32 x, VecF32 y) { return {x.a OP y.a, x.b OP y.b}; }
MP_PAIR_CMP(==)
MP_PAIR_CMP(!=)
MP_PAIR_CMP(<)
MP_PAIR_CMP(<=)
MP_PAIR_CMP(>)
MP_PAIR_CMP(>=)
#undef MP_PAIR_CMP
MP_AVX512 VecF32 operator-(VecF32 x) { return {-x.a, -x.b}; }

template <>
struct Lanes<VecF32> {
  using Flag = FlagF32;
  using H = Lanes<VecF16>;
  MP_AVX512 static VecF32 sqrt(VecF32 x) { return {H::sqrt(x.a), H::sqrt(x.b)}; }
  MP_AVX512 static FlagF32 not_finite(VecF32 x) { return {H::not_finite(x.a), H::not_finite(x.b)}; }
  MP_AVX512 static FlagF32 none() { return {VecI16{}, VecI16{}}; }
  MP_AVX512 static VecF32 select(FlagF32 c, VecF32 x, VecF32 y) {
    return {H::select(c.a, x.a, y.a), H::select(c.b, x.b, y.b)};
  }
  MP_AVX512 static VecF32 round_bf16(VecF32 x) { return {H::round_bf16(x.a), H::round_bf16(x.b)}; }
  // Blocks g / 8 .. g / 8 + 3 in one call when the 32 lanes' global indices are
  // g .. g + 31 with g % 8 == 0 (a whole tensor, as the passes' vectors start); else
  // each half as the 16-float vector does.
  MP_AVX512 static VecF32 round_bf16_stochastic(VecF32 x, const RoundingKey& key, int64_t index) {
    const int64_t g = key.global(index);
    if (g % 8 != 0 || !key.consecutive(index, 32)) {
      return {H::round_bf16_stochastic(x.a, key, index),
              H::round_bf16_stochastic(x.b, key, index + 16)};
    }
    const __m512i out = philox_avx512::rounding_blocks<__m512i>(key, static_cast<uint64_t>(g) / 8);
    const __m256i low = _mm512_maskz_extracti64x4_epi64(0xf, out, 0);
    const __m256i high = _mm512_maskz_extracti64x4_epi64(0xf, out, 1);
    return {round_bf16_stochastic_lanes<VecF16>(
                x.a, (VecU16)_mm512_maskz_cvtepu16_epi32(cpu::avx512::kAll16, low)),
            round_bf16_stochastic_lanes<VecF16>(
                x.b, (VecU16)_mm512_maskz_cvtepu16_epi32(cpu::avx512::kAll16, high))};
  }
  MP_AVX512 static VecF32 join_bf16(VecF32 param, VecF32 remainder) {
    return {H::join_bf16(param.a, remainder.a), H::join_bf16(param.b, remainder.b)};
  }
  MP_AVX512 static VecF32 split_bf16(VecF32 master, VecF32& remainder) {
    return {H::split_bf16(master.a, remainder.a), H::split_bf16(master.b, remainder.b)};
  }
};

template <>
MP_AVX512 VecF32 maximum<VecF32>(VecF32 a, VecF32 b) {
  return {maximum(a.a, b.a), maximum(a.b, b.b)};
}

namespace cpu::avx512x2 {
using Vec = VecF32;
MP_AVX512 Vec broadcast(float v) { return {avx512::broadcast(v), avx512::broadcast(v)}; }
template <typename T>
MP_AVX512 Vec load(const T* p) {
  return {avx512::load(p), avx512::load(p + 16)};
}
template <typename T>
MP_AVX512 void store(T* p, Vec x) {
  avx512::store(p, x.a);
  avx512::store(p + 16, x.b);
}
// bf16 and int16: both halves' 32-bit results, then their high (bf16) or low (int16)
// words in lane order by one two-source word permutation and one 64-byte store, where
// the 16-lane stores narrow each half on its own (vpmovdw) and store it.
MP_AVX512 __m512i words(__m512i a, __m512i b, int16_t first) {
  typedef int16_t Shorts32 __attribute__((vector_size(64)));
  const Shorts32 index = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                          32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  return _mm512_permutex2var_epi16(a, (__m512i)(index + first), b);
}
// Rounded to nearest even as avx512::store(BFloat16*) does, NaN as 0x7fc0, in the
// high half of each 32-bit lane.
MP_AVX512 __m512i bf16_high(VecF16 x) {
  const __m512i u = _mm512_castps_si512((__m512)x);
  const __m512i lsb =
      _mm512_and_si512(_mm512_maskz_srli_epi32(avx512::kAll16, u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc00000));
}
// With AVX512_BF16 (avx512_bf16_stores), one vcvtne2ps2bf16 rounds all 32 lanes when
// none is NaN or subnormal: it rounds to nearest even as c10 does, but takes subnormal
// inputs as zero and keeps NaN payloads (c10: 0x7fc0), so those vectors (one
// vfpclassps per half finds them) take the integer path. The passes that inline this
// carry the avx512bf16 target (engine.h) and run only where avx512_bf16_stores holds
// it available.
#define MP_AVX512_BF16 __attribute__((target(MP_AVX512_TARGET ",avx512bf16"))) inline
MP_AVX512_BF16 void store(c10::BFloat16* p, Vec x) {
  if (avx512_bf16_stores) {
    constexpr int kNanOrSubnormal = 0x01 | 0x20 | 0x80;  // quiet NaN, subnormal, signaling NaN
    const __mmask16 special = _mm512_fpclass_ps_mask((__m512)x.a, kNanOrSubnormal) |
                              _mm512_fpclass_ps_mask((__m512)x.b, kNanOrSubnormal);
    if (special == 0) {
      _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh((__m512)x.b, (__m512)x.a));
      return;
    }
  }
  _mm512_storeu_si512(p, words(bf16_high(x.a), bf16_high(x.b), 1));
}
#undef MP_AVX512_BF16
MP_AVX512 void store(int16_t* p, Vec x) {  // as avx512::store(int16_t*): truncated, low words
  const __m512i a = (__m512i) __builtin_convertvector(x.a, VecI16);
  const __m512i b = (__m512i) __builtin_convertvector(x.b, VecI16);
  _mm512_storeu_si512(p, words(a, b, 0));
}
MP_AVX512 bool any(FlagF32 flags) { return avx512::any(flags.a | flags.b); }
}  // namespace cpu::avx512x2

#undef MP_AVX512
}  // namespace mixedprec
#endif
