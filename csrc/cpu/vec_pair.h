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

// A pair of vectors, lanes 0..W-1 in a and W..2W-1 in b, with the operations of
// pointwise.h's functors done on each half (Pair<VecF16>: 32 floats on AVX-512;
// Pair<VecF8>: 16 on AVX2).
template <typename H>
struct Pair {
  H a, b;
};
template <typename H>
struct PairFlag {  // per-lane flags (Lanes<Pair<H>>::Flag), one per half
  typename Lanes<H>::Flag a, b;
  inline PairFlag& operator|=(PairFlag o) {
    a |= o.a;
    b |= o.b;
    return *this;
  }
};
using VecF32 = Pair<VecF16>;
using VecF8x2 = Pair<VecF8>;

#define MP_PAIR_OP(OP)                               \
  template <typename H>                              \
  inline Pair<H> operator OP(Pair<H> x, Pair<H> y) { \
    return {x.a OP y.a, x.b OP y.b};                 \
  }                                                  \
  template <typename H>                              \
  inline Pair<H> operator OP(Pair<H> x, float y) {   \
    return {x.a OP y, x.b OP y};                     \
  }                                                  \
  template <typename H>                              \
  inline Pair<H> operator OP(float x, Pair<H> y) {   \
    return {x OP y.a, x OP y.b};                     \
  }
MP_PAIR_OP(+)
MP_PAIR_OP(-)
MP_PAIR_OP(*)
MP_PAIR_OP(/)
#undef MP_PAIR_OP
#define MP_PAIR_CMP(OP)                                  \
  template <typename H>                                  \
  inline PairFlag<H> operator OP(Pair<H> x, Pair<H> y) { \
    return {x.a OP y.a, x.b OP y.b};                     \
  }
MP_PAIR_CMP(==)
MP_PAIR_CMP(!=)
MP_PAIR_CMP(<)
MP_PAIR_CMP(<=)
MP_PAIR_CMP(>)
MP_PAIR_CMP(>=)
#undef MP_PAIR_CMP
template <typename H>
inline Pair<H> operator-(Pair<H> x) {
  return {-x.a, -x.b};
}

// Lanes<Pair<H>>: each half as Lanes<H> does, but for the stochastic rounding's bits
// (below, per instruction set).
template <typename H>
struct PairLanes {
  using Flag = PairFlag<H>;
  using L = Lanes<H>;
  static inline Pair<H> sqrt(Pair<H> x) { return {L::sqrt(x.a), L::sqrt(x.b)}; }
  static inline Flag not_finite(Pair<H> x) { return {L::not_finite(x.a), L::not_finite(x.b)}; }
  static inline Flag none() { return {L::none(), L::none()}; }
  static inline Pair<H> select(Flag c, Pair<H> x, Pair<H> y) {
    return {L::select(c.a, x.a, y.a), L::select(c.b, x.b, y.b)};
  }
  static inline Pair<H> ones(Flag c) { return {L::ones(c.a), L::ones(c.b)}; }
  static inline Pair<H> round_bf16(Pair<H> x) { return {L::round_bf16(x.a), L::round_bf16(x.b)}; }
  static inline Pair<H> join_bf16(Pair<H> param, Pair<H> remainder) {
    return {L::join_bf16(param.a, remainder.a), L::join_bf16(param.b, remainder.b)};
  }
  static inline Pair<H> split_bf16(Pair<H> master, Pair<H>& remainder) {
    return {L::split_bf16(master.a, remainder.a), L::split_bf16(master.b, remainder.b)};
  }
  static inline Pair<H> mul_add(Pair<H> a, Pair<H> b, Pair<H> c) {
    return {L::mul_add(a.a, b.a, c.a), L::mul_add(a.b, b.b, c.b)};
  }
  static inline Pair<H> count_zero_nonzero(Pair<H> count, Pair<H> a, Pair<H> b) {
    return {L::count_zero_nonzero(count.a, a.a, b.a), L::count_zero_nonzero(count.b, a.b, b.b)};
  }
};

// The rounding bits of a vector's elements, drawn by the pass (PairedDraws): the
// Philox blocks of its lanes (a 32-lane pair's four, a 16-lane AVX2 pair's two) as
// 16-bit halves in lane order, in a vector of Bits (VecU16, VecU8: a GCC vector type,
// whose attribute a template argument keeps, where __m512i's would be dropped). Functors that round
// stochastically take it in place of the index, as philox.h's DrawnBits on CUDA.
template <typename Bits>
struct DrawnVector {
  Bits bits;
};

template <>
struct Lanes<VecF32> : PairLanes<VecF16> {
  // Blocks g / 8 .. g / 8 + 3 in one call when the 32 lanes' global indices are
  // g .. g + 31 with g % 8 == 0 (a whole tensor, as the passes' vectors start); else
  // each half as the 16-float vector does.
  MP_AVX512 static VecF32 round_bf16_stochastic(VecF32 x, const RoundingKey& key, int64_t index) {
    const int64_t g = key.global(index);
    if (g % 8 != 0 || !key.consecutive(index, 32)) {
      return {L::round_bf16_stochastic(x.a, key, index),
              L::round_bf16_stochastic(x.b, key, index + 16)};
    }
    return with_bits(x, philox_avx512::rounding_blocks<__m512i>(key, static_cast<uint64_t>(g) / 8));
  }
  // With the bits the pass drew for the vector (PairedDraws below).
  MP_AVX512 static VecF32 round_bf16_stochastic(VecF32 x, const RoundingKey&,
                                                DrawnVector<VecU16> drawn) {
    return with_bits(x, (__m512i)drawn.bits);
  }
  // x rounded with the halves of out (rounding_blocks' four blocks) in lane order.
  MP_AVX512 static VecF32 with_bits(VecF32 x, __m512i out) {
    const __m256i low = _mm512_maskz_extracti64x4_epi64(0xf, out, 0);
    const __m256i high = _mm512_maskz_extracti64x4_epi64(0xf, out, 1);
    const VecU16 bits_a = (VecU16)_mm512_maskz_cvtepu16_epi32(cpu::avx512::kAll16, low);
    const VecU16 bits_b = (VecU16)_mm512_maskz_cvtepu16_epi32(cpu::avx512::kAll16, high);
    if (_kortestz_mask16_u8(L::nan_or_inf(x.a), L::nan_or_inf(x.b))) {  // (the usual case)
      return {round_bf16_stochastic_finite(x.a, bits_a), round_bf16_stochastic_finite(x.b, bits_b)};
    }
    return {round_bf16_stochastic_lanes<VecF16>(x.a, bits_a),
            round_bf16_stochastic_lanes<VecF16>(x.b, bits_b)};
  }
};

// What the even/odd pass (avx2x2_even_odd below) hands a functor that rounds
// stochastically in place of the index: the bits it drew for the vector (EvenOddDraws),
// or, for a vector it drew none for, its first element's index. Its pair holds elements
// 0, 2, .., 14 in a and 1, 3, .., 15 in b, which these tell Lanes<VecF8x2> apart.
struct EvenOddDrawn {
  VecU8 bits;  // the 16 elements' halves in element order, as DrawnVector's
};
struct EvenOddIndex {
  int64_t index;
};

#define MP_AVX2 __attribute__((target(MP_AVX2_TARGET))) inline
template <>
struct Lanes<VecF8x2> : PairLanes<VecF8> {
  MP_AVX2 static VecF8x2 round_bf16_stochastic(VecF8x2 x, const RoundingKey& key, int64_t index) {
    return with_bits(x, halves(key, index));
  }
  // The halves of local elements index .. index + 15 in element order: blocks g / 8
  // and g / 8 + 1 from one rounding_blocks2 call (the single AVX2 vector uses only its
  // first) when their global indices are g .. g + 15 with g % 8 == 0; else
  // consecutive_bits, or lane by lane where a run ends among them.
  MP_AVX2 static __m256i halves(const RoundingKey& key, int64_t index) {
    const int64_t g = key.global(index);
    if (g % 8 == 0 && key.consecutive(index, 16)) {
      return rounding_blocks2(key, static_cast<uint64_t>(g) / 8);
    }
    uint16_t out[16];
    if (key.consecutive(index, 16)) {
      consecutive_bits<16>(key, g, out);
    } else {
      uint32_t lanes[16];
      lane_bits(key, index, 16, lanes);
      for (int j = 0; j < 16; ++j) out[j] = static_cast<uint16_t>(lanes[j]);
    }
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out));
  }
  // With the bits the pass drew for the vector (PairedDraws below).
  MP_AVX2 static VecF8x2 round_bf16_stochastic(VecF8x2 x, const RoundingKey&,
                                               DrawnVector<VecU8> drawn) {
    return with_bits(x, (__m256i)drawn.bits);
  }
  // split_bf16 without its NaN selects where no lane of the 16 is NaN.
  MP_AVX2 static VecF8x2 split_bf16(VecF8x2 master, VecF8x2& remainder) {
    if (cpu::avx2::any_nan(master.a, master.b)) {
      return PairLanes<VecF8>::split_bf16(master, remainder);
    }
    return {split_bf16_unless_nan<VecF8, VecU8>(master.a, remainder.a),
            split_bf16_unless_nan<VecF8, VecU8>(master.b, remainder.b)};
  }
  // The even/odd pass's pair (EvenOddDrawn, EvenOddIndex above): the halves of its 16
  // elements in element order, a 32-bit lane holding those of elements 2k and 2k + 1,
  // are the even elements' bits in the low words and the odd's in the high: one and and
  // one shift where the pair in element order widens each half.
  MP_AVX2 static VecF8x2 round_bf16_stochastic(VecF8x2 x, const RoundingKey&, EvenOddDrawn drawn) {
    return with_bits_even_odd(x, (__m256i)drawn.bits);
  }
  MP_AVX2 static VecF8x2 round_bf16_stochastic(VecF8x2 x, const RoundingKey& key, EvenOddIndex at) {
    return with_bits_even_odd(x, halves(key, at.index));
  }
  MP_AVX2 static VecF8x2 with_bits_even_odd(VecF8x2 x, __m256i out) {
    return with_bits(x, (VecU8)_mm256_and_si256(out, _mm256_set1_epi32(0xffff)),
                     (VecU8)_mm256_srli_epi32(out, 16));
  }
  // x rounded with the halves of out (two blocks) in lane order: by
  // round_bf16_stochastic_finite alone where no lane is inf or NaN (x - x is NaN just
  // there: one test of both halves), as the AVX-512 passes do.
  MP_AVX2 static VecF8x2 with_bits(VecF8x2 x, __m256i out) {
    return with_bits(x, (VecU8)_mm256_cvtepu16_epi32(_mm256_castsi256_si128(out)),
                     (VecU8)_mm256_cvtepu16_epi32(_mm256_extracti128_si256(out, 1)));
  }
  MP_AVX2 static VecF8x2 with_bits(VecF8x2 x, VecU8 a, VecU8 b) {  // (each lane's bits)
    if (!cpu::avx2::any_nan(x.a - x.a, x.b - x.b)) {
      return {round_bf16_stochastic_finite(x.a, a), round_bf16_stochastic_finite(x.b, b)};
    }
    return {round_bf16_stochastic_lanes<VecF8>(x.a, a), round_bf16_stochastic_lanes<VecF8>(x.b, b)};
  }
};

// Whether the pass over vectors V draws the stochastic rounding bits of several vectors
// at once (Fixed modes that round params stochastically, pointwise.h's DrawsPerVector):
// draw(key, index, end, out) gives the bits of the next kAhead vectors (or of two, near
// `end`) from one call of as many interleaved Philox chains, and returns how many, when
// those elements from local element index (W lanes a vector: 32 on AVX-512, 16 on AVX2)
// are consecutive from a multiple of 8 in the whole tensor; else 0 (the pass then hands
// the functor the index, as ever). One chain is ten dependent rounds, a few cycles
// each, which the update's own chain cannot hide; side by side, the chains run at the
// multiplier's and the shuffles' throughput. Eight on both: 256 elements a call on
// AVX-512 (two until 2026-12-04: eight made "stochastic" 6-9% faster on Zen 4), 128 on
// AVX2 (bench/README.md, "Philox bits drawn ahead", "Eight chains on AVX-512 too").
// index(i): what the pass hands the functor for a vector it drew no bits for. (A pass
// that draws none: engine.h's NoDraws.)
template <typename V>
struct PairedDraws;
template <>
struct PairedDraws<VecF32> {
  static constexpr bool value = true;
  static constexpr int kAhead = 8;
  using Drawn = DrawnVector<VecU16>;
  template <int N>
  MP_AVX512 static int draw_n(const RoundingKey& key, int64_t index, Drawn* out) {
    const int64_t g = key.global(index);
    if (g % 8 != 0 || !key.consecutive(index, 32 * N)) return 0;
    __m512i bits[N];
    philox_avx512::rounding_blocks<N>(key, static_cast<uint64_t>(g) / 8, bits);
    for (int j = 0; j < N; ++j) out[j].bits = (VecU16)bits[j];
    return N;
  }
  MP_AVX512 static int draw(const RoundingKey& key, int64_t index, int64_t end,
                            Drawn (&out)[kAhead]) {
    if (index + 32 * kAhead <= end) {
      if (const int n = draw_n<kAhead>(key, index, out)) return n;
    }
    return index + 64 <= end ? draw_n<2>(key, index, out) : 0;
  }
  static int64_t index(int64_t i) { return i; }
};
template <>
struct PairedDraws<VecF8x2> {
  static constexpr bool value = true;
  static constexpr int kAhead = 8;
  using Drawn = DrawnVector<VecU8>;
  // The bits of N vectors (a chain each) when they are consecutive from a multiple of 8.
  template <int N>
  MP_AVX2 static int draw_n(const RoundingKey& key, int64_t index, Drawn* out) {
    const int64_t g = key.global(index);
    if (g % 8 != 0 || !key.consecutive(index, 16 * N)) return 0;
    __m256i bits[N];
    rounding_blocks_avx2<N>(key, static_cast<uint64_t>(g) / 8, bits);
    for (int j = 0; j < N; ++j) out[j].bits = (VecU8)bits[j];
    return N;
  }
  MP_AVX2 static int draw(const RoundingKey& key, int64_t index, int64_t end,
                          Drawn (&out)[kAhead]) {
    if (index + 16 * kAhead <= end) {
      if (const int n = draw_n<kAhead>(key, index, out)) return n;
    }
    return index + 32 <= end ? draw_n<2>(key, index, out) : 0;
  }
  static int64_t index(int64_t i) { return i; }
};
// The same draws for the even/odd pass, in its own types (EvenOddDrawn, EvenOddIndex).
struct EvenOddDraws {
  static constexpr bool value = true;
  static constexpr int kAhead = PairedDraws<VecF8x2>::kAhead;
  using Drawn = EvenOddDrawn;
  MP_AVX2 static int draw(const RoundingKey& key, int64_t index, int64_t end,
                          Drawn (&out)[kAhead]) {
    PairedDraws<VecF8x2>::Drawn drawn[kAhead];
    const int n = PairedDraws<VecF8x2>::draw(key, index, end, drawn);
    for (int j = 0; j < n; ++j) out[j].bits = drawn[j].bits;
    return n;
  }
  static EvenOddIndex index(int64_t i) { return {i}; }
};

template <>
MP_AVX512 VecF32 maximum<VecF32>(VecF32 a, VecF32 b) {
  return {maximum(a.a, b.a), maximum(a.b, b.b)};
}
template <>
MP_AVX2 VecF8x2 maximum<VecF8x2>(VecF8x2 a, VecF8x2 b) {
  return {maximum(a.a, b.a), maximum(a.b, b.b)};
}

namespace cpu::avx512x2 {
using Vec = VecF32;
MP_AVX512 Vec broadcast(float v) { return {avx512::broadcast(v), avx512::broadcast(v)}; }
template <typename T>
MP_AVX512 Vec load(const T* p) {
  return {avx512::load(p), avx512::load(p + 16)};
}
// A block of 8-bit state: with VBMI through byte tables (avx512::e4m3_values_vbmi).
MP_AVX512 Vec load(const E4m3* p) {
  if (!avx512_vbmi) return {avx512::load(p), avx512::load(p + 16)};
  Vec x;
  avx512::e4m3_values_vbmi(p, x.a, x.b);
  return x;
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
MP_AVX512 void store(int16_t* p, Vec x) {  // as avx512::store(int16_t*): the low words
  _mm512_storeu_si512(p, words((__m512i)x.a, (__m512i)x.b, 0));
}
MP_AVX512 bool any(PairFlag<VecF16> flags) { return avx512::any(flags.a | flags.b); }
// 8-bit state (the engine's block pass, a block one pair): its rounding bits and its
// blocks' stores as avx512's.
using avx512::block_bits;
using avx512::BlockBits;
using avx512::blocks_bits;
using avx512::kBlocksAhead;
// A group of kGroup blocks (the engine's block pass) of list k, n of them filled, x[q]
// block q's pair: each block's largest |value| as bits (integer order: NaN above inf
// above the finite values, in every version), all the group's at once: the halves'
// maxima side by side, reduced across the blocks in four steps of two-source shuffles,
// so that lane q holds block q's; then their scales (e8m0_scale_bits, lanes.h) in the
// same lanes, the n scale bytes in one masked store, and each block's codes
// (avx512::store_block_codes). Where a block's scale took one reduction, a trip
// through a general register and back, and its scalar arithmetic in turn, the group's
// take a few vector operations a block, and no block's codes wait on a chain of its
// own (bench/README.md, "The 8-bit block pass in groups of blocks").
constexpr int kGroup = 8;
MP_AVX512 __m512i max_u32(__m512i a, __m512i b) {
  return _mm512_maskz_max_epu32(avx512::kAll16, a, b);
}
static_assert(kBlocksAhead == kGroup, "a group's rounding bits are drawn at once");
template <int G, int J, int D, typename T>
MP_AVX512 void store_blocks(T*, uint8_t*, const Vec (&)[G][J][D], int, const uint32_t*, bool, int) {
}
template <int G, int J, int D>
MP_AVX512 void store_blocks(E4m3* p, uint8_t* scale, const Vec (&x)[G][J][D], int k,
                            const uint32_t* random, bool rotate, int n) {
  static_assert(G == 8 && J == 1, "a group is eight blocks of one pair");
  // (the masked forms of the intrinsics, as in vec.h: GCC 12 warns of the plain ones)
  constexpr __mmask16 kAll16 = avx512::kAll16;
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i m[G];  // block q's 16 maxima of its halves' magnitudes (0 past n)
  for (int q = 0; q < G; ++q) {
    m[q] = _mm512_setzero_si512();
    if (q < n) {
      m[q] = max_u32(_mm512_and_si512((__m512i)x[q][0][k].a, magnitude),
                     _mm512_and_si512((__m512i)x[q][0][k].b, magnitude));
    }
  }
  // t[h]: 128-bit lanes 0, 1 block 2h's (8 maxima), 2, 3 block 2h + 1's
  __m512i t[4];
  for (int h = 0; h < 4; ++h) {
    t[h] = max_u32(
        _mm512_maskz_shuffle_i32x4(kAll16, m[2 * h], m[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_maskz_shuffle_i32x4(kAll16, m[2 * h], m[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // u[h]: 128-bit lane c block 4h + c's (4 maxima)
  __m512i u[2];
  for (int h = 0; h < 2; ++h) {
    u[h] = max_u32(
        _mm512_maskz_shuffle_i32x4(kAll16, t[2 * h], t[2 * h + 1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_maskz_shuffle_i32x4(kAll16, t[2 * h], t[2 * h + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // 128-bit lane c: block c's 2 maxima, then block c + 4's; then each its largest, twice
  __m512i w = max_u32(_mm512_maskz_unpacklo_epi64(avx512::kAll8, u[0], u[1]),
                      _mm512_maskz_unpackhi_epi64(avx512::kAll8, u[0], u[1]));
  w = max_u32(w, _mm512_maskz_shuffle_epi32(kAll16, w, _MM_PERM_CDAB));
  // lane q: block q's largest magnitude
  const __m512i a = _mm512_maskz_permutexvar_epi32(
      kAll16, _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), w);
  const __m512i bits = (__m512i)e8m0_scale_bits_lanes<VecF16, VecI16, VecU16>((VecU16)a);
  // the blocks whose largest magnitude is finite (so is every value of theirs)
  const __mmask16 finite = _mm512_cmple_epu32_mask(a, _mm512_set1_epi32(0x7f7fffff));
  _mm512_mask_cvtepi32_storeu_epi8(scale, static_cast<__mmask16>((1u << n) - 1u), bits);
  alignas(64) float inverse[16];  // e8m0_inverse: 2^(127 - bits)
  _mm512_store_si512(
      inverse, _mm512_maskz_slli_epi32(kAll16, _mm512_sub_epi32(_mm512_set1_epi32(254), bits), 23));
  for (int q = 0; q < n; ++q) {
    avx512::store_block_codes(
        p + q * kQuantBlock, x[q][0][k].a * inverse[q], x[q][0][k].b * inverse[q],
        random == nullptr ? nullptr : random + q * kQuantBlock, rotate, ((finite >> q) & 1u) != 0);
  }
}
// (vcvtne2ps2bf16 leaves nothing to gain from a value already rounded: stored as any
// other.)
template <typename T>
MP_AVX512 void store_rounded(T* p, Vec x) {
  store(p, x);
}
}  // namespace cpu::avx512x2

namespace cpu::avx2x2 {
using Vec = VecF8x2;
MP_AVX2 Vec broadcast(float v) { return {avx2::broadcast(v), avx2::broadcast(v)}; }
template <typename T>
MP_AVX2 Vec load(const T* p) {
  return {avx2::load(p), avx2::load(p + 8)};
}
template <typename T>
MP_AVX2 void store(T* p, Vec x) {
  avx2::store(p, x.a);
  avx2::store(p + 8, x.b);
}
// bf16 and int16: both halves' words by one pack and one permute, in one 32-byte store;
// bf16's NaN test one comparison for both halves, and bf16_words' blends only where a
// lane is NaN (2026-11-30: AdamW with bf16 moments 17% faster with the AVX2 paths
// forced on Zen 5, bench/README.md).
MP_AVX2 void store(c10::BFloat16* p, Vec x) {
  __m256i bits;
  if (avx2::any_nan(x.a, x.b)) {
    bits = avx2::words(avx2::bf16_words(x.a), avx2::bf16_words(x.b));
  } else {
    bits = avx2::words(avx2::bf16_words_unless_nan(x.a), avx2::bf16_words_unless_nan(x.b));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
}
// bf16 values already rounded (engine.h's stored_rounded): their top halves, unless a
// lane is NaN, which c10 stores as 0x7fc0 (2026-11-30: AdamW "remainder" 12% faster
// with the AVX2 paths forced on Zen 5).
MP_AVX2 void store_rounded(c10::BFloat16* p, Vec x) {
  if (avx2::any_nan(x.a, x.b)) return store(p, x);
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(p),
      avx2::words(_mm256_srli_epi32((__m256i)x.a, 16), _mm256_srli_epi32((__m256i)x.b, 16)));
}
MP_AVX2 void store(int16_t* p, Vec x) {  // as avx2::store(int16_t*): the words (in range)
  const __m256i words = _mm256_packs_epi32((__m256i)x.a, (__m256i)x.b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(words, 0b11011000));
}
MP_AVX2 bool any(PairFlag<VecF8> flags) { return avx2::any(flags.a | flags.b); }
// A block's rounding bits as 16-bit halves (lanes.h's block_bits' values): 4 Philox
// blocks in two interleaved chains (rounding_blocks_avx2), whose output is already the halves in
// element order, when the block's elements are consecutive from a multiple of 8 in the whole tensor
// (as a whole tensor's and a Shard(0) shard's are), else lanes.h's. blocks_bits: those of
// kBlocksAhead blocks in eight chains side by side (PairedDraws above says why).
using BlockBits = uint16_t[kQuantBlock];
constexpr int kBlocksAhead = 4;
MP_AVX2 void block_bits(const RoundingKey& key, int64_t index, uint16_t (&out)[kQuantBlock]) {
  const int64_t g = key.global(index);
  if (g % 8 != 0 || !key.consecutive(index, kQuantBlock)) {
    uint32_t wide[kQuantBlock];
    mixedprec::block_bits(key, index, wide);
    for (int j = 0; j < kQuantBlock; ++j) out[j] = static_cast<uint16_t>(wide[j]);
    return;
  }
  __m256i bits[2];
  rounding_blocks_avx2<2>(key, static_cast<uint64_t>(g) / 8, bits);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bits[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), bits[1]);
}
MP_AVX2 void blocks_bits(const RoundingKey& key, int64_t index, int64_t end,
                         BlockBits (&out)[kBlocksAhead]) {
  constexpr int kVectors = 2 * kBlocksAhead;  // (16 elements a vector, a chain each)
  PairedDraws<VecF8x2>::Drawn drawn[kVectors];
  if (index + kBlocksAhead * kQuantBlock <= end &&
      PairedDraws<VecF8x2>::draw_n<kVectors>(key, index, drawn)) {
    for (int j = 0; j < kVectors; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[j / 2] + 16 * (j % 2)),
                          (__m256i)drawn[j].bits);
    return;
  }
  for (int b = 0; b < kBlocksAhead && index + b * kQuantBlock < end; ++b)
    block_bits(key, index + b * kQuantBlock, out[b]);
}
// 8-bit state (lanes.h) through fp16: an e4m3fn code's sign and magnitude bits,
// shifted, are the fp16 bits of its value / 2^8 (fp16's subnormals are e4m3's; the
// NaN codes made fp16 NaNs), and a value rounded to the e4m3 grid, / 2^8, converts to
// fp16 exactly. So a decode is one widening, three word operations and F16C's
// conversion; an encode rounds to the e4m3 grid in fp32 (to nearest even: adding and
// subtracting 2^20 ulps of the value's exponent, at least 2^14, the subnormal codes'
// step 2^-9 in those units), converts, and takes the codes from the fp16 words, the
// same codes as e4m3_code in every case (tested over all floats).
// 16 codes decoded.
MP_AVX2 Vec load(const E4m3* p) {
  const __m256i h = e4m3_fp16_words(p);  // (vec.h)
  return {(VecF8)_mm256_cvtph_ps(_mm256_castsi256_si128(h)) * 256.f,
          (VecF8)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)) * 256.f};
}
// The fp16 words of y / 2^8 rounded to the e4m3 grid (|y| above 448, inf included,
// taken as 448; NaN stays NaN), sign kept.
MP_AVX2 __m128i e4m3_half_words(VecF8 y) {
  const __m256i u = _mm256_castps_si256((__m256)y);
  const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)));
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(448.f), a);  // (NaN: the second operand)
  const __m256i exponent =
      _mm256_and_si256(_mm256_castps_si256(clamped), _mm256_set1_epi32(0x7f800000));
  const __m256 step =
      _mm256_max_ps(_mm256_castsi256_ps(_mm256_add_epi32(exponent, _mm256_set1_epi32(20 << 23))),
                    _mm256_set1_ps(16384.f));
  const __m256 rounded = _mm256_sub_ps(_mm256_add_ps(clamped, step), step);
  const __m256 with_sign = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_castps_si256(rounded), _mm256_and_si256(u, _mm256_set1_epi32(0x80000000))));
  return _mm256_cvtps_ph(_mm256_mul_ps(with_sign, _mm256_set1_ps(0.00390625f)),
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// The codes (in 16-bit lanes) of 16 such words: magnitude (NaN: 0x7f) and sign.
MP_AVX2 __m256i e4m3_codes_of_words(__m256i h) {
  const __m256i magnitude =
      _mm256_min_epu16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
  return _mm256_or_si256(_mm256_srli_epi16(magnitude, 7),
                         _mm256_and_si256(_mm256_srli_epi16(h, 8), _mm256_set1_epi16(0x80)));
}
MP_AVX2 __m256i e4m3_codes(Vec y) {
  return e4m3_codes_of_words(_mm256_inserti128_si256(_mm256_castsi128_si256(e4m3_half_words(y.a)),
                                                     e4m3_half_words(y.b), 1));
}
// 16 values' codes (|y| <= 448), rounded to nearest even.
MP_AVX2 void store(E4m3* p, Vec y) {
  const __m256i codes = _mm256_permute4x64_epi64(
      _mm256_packus_epi16(e4m3_codes(y), _mm256_setzero_si256()), 0b11011000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(codes));
}
// Whether any lane of y is below 2^-6 in magnitude (e4m3's subnormal codes; NaN not).
MP_AVX2 bool any_small(VecF8 y) {
  const __m256 a = _mm256_and_ps((__m256)y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ)) != 0;
}
// The codes of a block (J = 2 pairs, 32 elements) of list k whose scale's inverse is
// `inv`, in one 32-byte store: rounded to nearest even, or stochastically (as avx2's
// lanes, then packed; `finite`: the block's values are, as e4m3_code_stochastic_lanes
// takes it).
template <int J, int D>
MP_AVX2 void store_block_codes(E4m3* p, const Vec (&x)[J][D], int k, float inv,
                               const uint16_t* random, bool rotate, bool finite) {
  static_assert(J == 2, "a block is two pairs");
  __m256i codes;
  if (random == nullptr) {
    // Words of elements 0..15 and 16..31; packus interleaves the 128-bit halves.
    codes = _mm256_packus_epi16(e4m3_codes(x[0][k] * inv), e4m3_codes(x[1][k] * inv));
    codes = _mm256_permute4x64_epi64(codes, 0b11011000);
  } else {
    // The second 8-bit list's bits byte-swapped (rotate_bytes), one vpshufb per 16.
    const __m256i swap = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 1,
                                          0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    __m256i c[4];
    for (int j = 0; j < 2; ++j) {
      __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(random + 16 * j));
      if (rotate) r = _mm256_shuffle_epi8(r, swap);
      const VecF8 ya = x[j][k].a * inv, yb = x[j][k].b * inv;
      c[2 * j] = (__m256i)e4m3_code_stochastic_lanes<VecF8, VecI8, VecU8>(
          ya, (VecU8)_mm256_cvtepu16_epi32(_mm256_castsi256_si128(r)), any_small(ya), finite);
      c[2 * j + 1] = (__m256i)e4m3_code_stochastic_lanes<VecF8, VecI8, VecU8>(
          yb, (VecU8)_mm256_cvtepu16_epi32(_mm256_extracti128_si256(r, 1)), any_small(yb), finite);
    }
    // Dwords to bytes; per 128-bit half the 4-byte groups come as q = 0..3 of that
    // half's elements, put in order by one dword permutation.
    codes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    codes = _mm256_permutevar8x32_epi32(codes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), codes);
}
// A group of kGroup blocks (the engine's block pass; the kBlocksAhead whose bits are
// drawn at once) of list k, n of them filled, as avx512x2's store_blocks: each block's
// largest |value| as bits (integer order), all the group's together (three steps of
// shuffles across the blocks' maxima), their scales in the same lanes, then each
// block's codes.
constexpr int kGroup = 4;
static_assert(kBlocksAhead == kGroup, "a group's rounding bits are drawn at once");
template <int G, int J, int D, typename T>
MP_AVX2 void store_blocks(T*, uint8_t*, const Vec (&)[G][J][D], int, const uint16_t*, bool, int) {}
template <int G, int J, int D>
MP_AVX2 void store_blocks(E4m3* p, uint8_t* scale, const Vec (&x)[G][J][D], int k,
                          const uint16_t* random, bool rotate, int n) {
  static_assert(G == 4 && J == 2, "a group is four blocks of two pairs");
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i m[G];  // block q's 8 maxima of its four vectors' magnitudes (0 past n)
  for (int q = 0; q < G; ++q) {
    m[q] = _mm256_setzero_si256();
    if (q < n) {
      m[q] = _mm256_max_epu32(_mm256_max_epu32(_mm256_and_si256((__m256i)x[q][0][k].a, magnitude),
                                               _mm256_and_si256((__m256i)x[q][0][k].b, magnitude)),
                              _mm256_max_epu32(_mm256_and_si256((__m256i)x[q][1][k].a, magnitude),
                                               _mm256_and_si256((__m256i)x[q][1][k].b, magnitude)));
    }
  }
  // t[h]: 128-bit half 0 block 2h's 4 maxima, half 1 block 2h + 1's
  __m256i t[2];
  for (int h = 0; h < 2; ++h) {
    t[h] = _mm256_max_epu32(_mm256_permute2x128_si256(m[2 * h], m[2 * h + 1], 0x20),
                            _mm256_permute2x128_si256(m[2 * h], m[2 * h + 1], 0x31));
  }
  // half h: block h's 2 maxima, then block h + 2's; then each its largest, twice
  __m256i w =
      _mm256_max_epu32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
  w = _mm256_max_epu32(w, _mm256_shuffle_epi32(w, _MM_SHUFFLE(2, 3, 0, 1)));
  // lane q: block q's largest magnitude (q < 4)
  const __m256i a = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 2, 6, 0, 0, 0, 0));
  const __m256i bits = (__m256i)e8m0_scale_bits_lanes<VecF8, VecI8, VecU8>((VecU8)a);
  // the blocks whose largest magnitude is finite (so is every value of theirs)
  const int finite =
      _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), a)));
  alignas(32) uint32_t bytes[8];
  alignas(32) float inverse[8];  // e8m0_inverse: 2^(127 - bits)
  _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), bits);
  _mm256_store_si256(reinterpret_cast<__m256i*>(inverse),
                     _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(254), bits), 23));
  for (int q = 0; q < n; ++q) {
    scale[q] = static_cast<uint8_t>(bytes[q]);
    store_block_codes<J, D>(p + q * kQuantBlock, x[q], k, inverse[q],
                            random == nullptr ? nullptr : random + q * kQuantBlock, rotate,
                            ((finite >> q) & 1) != 0);
  }
}
// (other storage: stored as any other value)
template <typename T>
MP_AVX2 void store_rounded(T* p, Vec x) {
  store(p, x);
}
}  // namespace cpu::avx2x2

// The AVX2 pair pass of the Fixed modes whose every streamed list is 16 bits wide (bf16
// or int16): a pair holds its 16 elements even and odd, a = elements 0, 2, .., 14 and
// b = 1, 3, .., 15, which every lane's math leaves as it is (stochastic rounding's bits,
// the one thing told by the index, come in that order too: EvenOddDraws). Then a load
// is one 32-byte load and two word operations, with no widening, and a store one word
// blend, with no pack and no lane-crossing permute: on Zen 3, where two FP pipes take
// the pair pass's shifts, shuffles and divisions, AdamW "none", "kahan" and "remainder"
// with bf16 moments 8-15% faster (bench/README.md, "Zen 3, natively"). engine.h's
// kEvenOddPass picks it.
namespace cpu::avx2x2_even_odd {
using Vec = VecF8x2;
using avx2x2::any;
using avx2x2::broadcast;
MP_AVX2 __m256i bits(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
MP_AVX2 void put(void* p, __m256i even, __m256i odd) {  // the even lanes' low words, the odd's high
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_blend_epi16(even, odd, 0b10101010));
}
MP_AVX2 Vec load(const c10::BFloat16* p) {
  const __m256i w = bits(p);
  return {(VecF8)_mm256_slli_epi32(w, 16), (VecF8)_mm256_and_si256(w, _mm256_set1_epi32(-65536))};
}
MP_AVX2 Vec load(const int16_t* p) {  // the words sign-extended (join_bf16_lanes)
  const __m256i w = bits(p);
  return {(VecF8)_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16), (VecF8)_mm256_srai_epi32(w, 16)};
}
// Rounded to nearest even, NaN as 0x7fc0, as avx2x2's store.
MP_AVX2 void store(c10::BFloat16* p, Vec x) {
  if (avx2::any_nan(x.a, x.b)) {
    return put(p, avx2::bf16_words(x.a), _mm256_slli_epi32(avx2::bf16_words(x.b), 16));
  }
  put(p, avx2::bf16_words_unless_nan(x.a), avx2::bf16_rounded_unless_nan(x.b));
}
MP_AVX2 void store_rounded(c10::BFloat16* p, Vec x) {  // as avx2x2's: top halves
  if (avx2::any_nan(x.a, x.b)) return store(p, x);
  put(p, _mm256_srli_epi32((__m256i)x.a, 16), (__m256i)x.b);
}
MP_AVX2 void store(int16_t* p, Vec x) {  // as avx2x2's: the low words
  put(p, (__m256i)x.a, _mm256_slli_epi32((__m256i)x.b, 16));
}
// Other storage is never streamed here (kEvenOddPass); these only make the pass's
// expressions for its absent lists compile.
template <typename T>
MP_AVX2 Vec load(const T*) {
  return Vec{};
}
template <typename T>
MP_AVX2 void store(T*, Vec) {}
// (other storage, int16 among it: stored as any other value)
template <typename T>
MP_AVX2 void store_rounded(T* p, Vec x) {
  store(p, x);
}
}  // namespace cpu::avx2x2_even_odd

#undef MP_AVX2
#undef MP_AVX512
}  // namespace mixedprec
#endif
