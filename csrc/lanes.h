// What the functors of pointwise.h compute with: the value type V's operations
// (Lanes<V>), here for float (CUDA, and single elements on the CPU; cpu/vec.h adds the
// CPU's vector types), and the ways an fp32 value is stored in bf16: rounded to
// nearest even, stochastically (philox.h's bits), or split into a bf16 value and an
// int16 remainder that together are the fp32 value exactly.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MP_HD __host__ __device__ __forceinline__
#else
#define MP_HD inline
#endif

#include "philox.h"

namespace mixedprec {

MP_HD bool is_finite(float x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

// Stochastic rounding of a float to bf16 (the value, as a float, that bf16 holds
// exactly): `bits`, 16 uniform random bits, are added to the low half of x's bits,
// which are then cut off. x rounds away from zero (in magnitude, up one bf16 unit)
// with probability (low half of x) / 2^16, so E[result] = x (unbiased). inf and NaN
// are rounded to nearest instead (inf stays inf, NaN stays NaN: adding bits could
// turn a NaN whose payload lies in the low half into inf). A finite x beyond bf16's
// largest finite value rounds to it or to inf, as the same construction gives.
MP_HD float round_bf16_stochastic(float x, uint32_t bits) {
  if (!is_finite(x)) return static_cast<float>(c10::BFloat16(x));
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  u = (u + (bits & 0xffffu)) & 0xffff0000u;
  float out;
  memcpy(&out, &u, sizeof(out));
  return out;
}

// master="remainder": an fp32 master kept as its bf16 param and an int16 remainder,
// bits(master) = (bits(param) << 16) + remainder (mod 2^32). The split takes the high
// half as (bits + 0x8000) >> 16: to nearest, ties away from zero (bits are sign and
// magnitude), so each bf16 value has exactly 2^16 preimages, the remainder lies in
// [-0x8000, 0x7fff] and the pair is the master bit for bit. The param differs from
// round_bf16(master) only at exact ties (low half 0x8000 on an even high half). inf
// splits into (inf, 0); a finite master past bf16's range into (inf, remainder < 0),
// exact too; NaN into (NaN, 0), payload and sign not kept. The remainder travels
// between the engines' loads and stores as a float (an exact integer) in scalar code,
// and as its sign-extended bits in the CPU's vector lanes (cpu/vec.h's
// join_bf16_lanes): a functor hands it to Lanes' join_bf16 and split_bf16 only.
MP_HD float join_bf16_remainder(float param, float remainder) {
  uint32_t u;
  memcpy(&u, &param, sizeof(u));
  u += static_cast<uint32_t>(static_cast<int32_t>(remainder));
  float out;
  memcpy(&out, &u, sizeof(out));
  return out;
}
MP_HD float split_bf16_remainder(float master, float& remainder) {
  if (master != master) {
    remainder = 0.f;
    return master;
  }
  uint32_t u;
  memcpy(&u, &master, sizeof(u));
  const uint32_t high = (u + 0x8000u) & 0xffff0000u;
  remainder = static_cast<float>(static_cast<int32_t>(u - high));
  float out;
  memcpy(&out, &high, sizeof(out));
  return out;
}

// 8-bit optimizer state (state_dtype=float8_e4m3fn): each list element is an fp8
// e4m3fn code (E4m3, the storage tag), and each block of kQuantBlock consecutive
// elements has one power-of-two scale, stored as an e8m0 byte (the biased exponent:
// 127 is 1.0), in a list of its own. value = e4m3_value(code) * 2^(byte - 127). The
// engines decode a block on load, and on store pick the block's scale from its new
// largest magnitude A (e8m0_scale_bits: the smallest 2^e with A / 2^e <= 448, e4m3's
// largest finite value) and encode value / 2^e, rounded to nearest even (e4m3_code),
// as torch's cast to float8_e4m3fn rounds. Power-of-two scales keep the values exact
// through a decode and an encode with the same blocks.
struct E4m3 {
  uint8_t bits;
};
constexpr int kQuantBlock = 32;

// The scale byte of a block whose largest magnitude is absmax (127, 1.0, for 0 and
// NaN); bytes stay in [1, 253], so that both 2^e and 2^-e are normal floats.
MP_HD uint32_t e8m0_scale_bits(float absmax) {
  if (!(absmax > 0.f)) return 127u;
  uint32_t u;
  memcpy(&u, &absmax, sizeof(u));
  // absmax = m * 2^(E - 127), m in [1, 2): A / 2^e lands in [256, 448] for m <= 1.75
  // (e = E - 127 - 8), in (224, 256) above (e = E - 127 - 7).
  const int e = static_cast<int>(u >> 23) - ((u & 0x7fffffu) <= 0x600000u ? 8 : 7);
  return static_cast<uint32_t>(e < 1 ? 1 : e > 253 ? 253 : e);
}
// The float whose bits are u.
MP_HD float bits_float(uint32_t u) {
  float out;
  memcpy(&out, &u, sizeof(out));
  return out;
}
// 2^(bits - 127) and 2^(127 - bits), for scale bytes in [1, 253].
MP_HD float e8m0_value(uint32_t bits) { return bits_float(bits << 23); }
MP_HD float e8m0_inverse(uint32_t bits) { return e8m0_value(254u - bits); }

// An e4m3fn code's value: codes with exponent field 0 are multiples of 2^-9; the
// others are fp32 bits (code + (120 << 3)) << 20 (bias 7 against fp32's 127); 0x7f and
// 0xff are NaN.
MP_HD float e4m3_value(uint32_t code) {
  const uint32_t mag = code & 0x7fu;
  float v;
  if (mag >= 8u) {
    const uint32_t u = (mag + 960u) << 20;
    memcpy(&v, &u, sizeof(v));
  } else {
    v = static_cast<float>(mag) * 0.001953125f;
  }
  if (mag == 0x7fu) v = NAN;
  return (code & 0x80u) != 0 ? -v : v;
}
// A magnitude's code from the integer path (abs_bits: the value's bits without the
// sign, NaN and inf included, whose integer path stays below 2^32): saturated at 0x7e,
// 0x7f for NaN. Selects, not a branch: the CUDA kernels issue a NaN test, its branch
// and their reconvergence for every code otherwise (about 6 instructions a code).
MP_HD uint32_t e4m3_clamped(uint32_t code, uint32_t abs_bits) {
  code = code > 0x7eu ? 0x7eu : code;
  return abs_bits > 0x7f800000u ? 0x7fu : code;
}
// The e4m3fn code of y, |y| <= 448 (or NaN: 0x7f with y's sign), to nearest even:
// below 2^-6 (subnormal codes) y * 2^9 rounded to an integer (adding 1.5 * 2^23 rounds
// it), else fp32's mantissa rounded to 3 bits. Past 448 it saturates (never reached:
// the scale keeps |y| <= 448).
MP_HD uint32_t e4m3_code(float y) {
  uint32_t u;
  memcpy(&u, &y, sizeof(u));
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs_bits = u & 0x7fffffffu;
  float a;
  memcpy(&a, &abs_bits, sizeof(a));
  uint32_t code;
  if (a < 0.015625f) {
    const float t = a * 512.f + 12582912.f;
    uint32_t tb;
    memcpy(&tb, &t, sizeof(tb));
    code = tb - 0x4b400000u;
  } else {
    code = ((abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20) - 960u;
  }
  return sign | e4m3_clamped(code, abs_bits);
}

// e4m3_code rounded stochastically: r's low 16 bits (uniform) plus one half are added
// below the kept bits (in units of 2^-16 of a code step) before they are cut, so that
// the code rounds away from zero with the probability of the dropped fraction (to
// 2^-17 of a step): the stored value is y on average. Round to nearest freezes a
// state whose per-step change is below half a code step (Adam's second moment with
// beta2 = 0.999: bench/results/q8-formats-cpu.md); 8 random bits were measured to
// leave a drift of ~1% over 200 such steps (tests/python/optim/test_state8.py).
MP_HD uint32_t e4m3_code_stochastic(float y, uint32_t r) {
  uint32_t u;
  memcpy(&u, &y, sizeof(u));
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs_bits = u & 0x7fffffffu;
  float a;
  memcpy(&a, &abs_bits, sizeof(a));
  r &= 0xffffu;
  uint32_t code;
  if (a < 0.015625f) {
    code = static_cast<uint32_t>(a * 512.f + (static_cast<float>(r) + 0.5f) * 1.52587890625e-5f);
  } else {
    code = ((abs_bits + (r << 4) + 0x8u) >> 20) - 960u;
  }
  return sign | e4m3_clamped(code, abs_bits);
}

// The 16 random bits of local elements index .. index + n - 1 (rounding_bits of each
// one's global index, philox.h): one Philox call per block of 8 consecutive global
// elements, taken again by the elements that fall in the block before. The CPU's
// scalar and out-of-line vector paths and CUDA's lanes call it (block_bits: a block
// of kQuantBlock).
MP_HD void element_bits(const RoundingKey& key, int64_t index, int n, uint32_t* out) {
  uint64_t block = ~uint64_t{0};
  Philox4x32 bits{};
  for (int j = 0; j < n; ++j) {
    const uint64_t g = static_cast<uint64_t>(key.global(index + j));
    if (g >> 3 != block) {
      block = g >> 3;
      bits = rounding_block(key, block);
    }
    out[j] = bits.half(static_cast<uint32_t>(g & 7));
  }
}

// element_bits of N elements (N divides 8) where they lie in one block of 8 consecutive
// global elements, as every aligned vector of a whole tensor does: one Philox call, its
// halves picked without a test per element (the CUDA engine's vectors: apply_vector,
// state_bits). Else element_bits itself, or with kByElement a call per element
// (rounding_bits), which takes fewer registers: the 64-register CUDA kernels of
// stochastic params spilled 8-48 bytes with element_bits there (ptxas, 2026-11-30).
template <bool kByElement, int N>
MP_HD void vector_bits(const RoundingKey& key, int64_t index, uint32_t (&bits)[N]) {
  static_assert(8 % N == 0, "a vector within one Philox block");
  const int64_t g = key.global(index);
  if (g % N == 0 && key.consecutive(index, N)) {
    const Philox4x32 out = rounding_block(key, static_cast<uint64_t>(g) >> 3);
    // (g % N == 0: the mask tells the compiler so, and half()'s selects on j go)
    const uint32_t h = static_cast<uint32_t>(g & 7) & ~static_cast<uint32_t>(N - 1);
    for (int j = 0; j < N; ++j) bits[j] = out.half(h | static_cast<uint32_t>(j));
  } else if constexpr (kByElement) {
    for (int j = 0; j < N; ++j) bits[j] = rounding_bits(key, key.global(index + j));
  } else {
    element_bits(key, index, N, bits);
  }
}

// The bits of each element of the block from local element `index` on. The 8-bit
// state's codes round with them: the first 8-bit list of an op with these bits, the
// second with their bytes swapped (rotate_bytes), so that the high bits, which decide
// most roundings, are independent between the two.
MP_HD uint32_t rotate_bytes(uint32_t r) { return ((r << 8) | (r >> 8)) & 0xffffu; }
MP_HD void block_bits(const RoundingKey& key, int64_t index, uint32_t (&out)[kQuantBlock]) {
  element_bits(key, index, kQuantBlock, out);
}

// The scale byte and codes of one block whose values are x[j][k], j < kQuantBlock (the
// CPU's scalar block pass and the CUDA block path; the vector passes do the same in
// lanes): the largest magnitude as bits (integer order: NaN above inf above the
// finite values, the same in every version), its scale, then the codes, rounded to
// nearest even, or stochastically with `random` (byte-swapped when `rotate`).
template <int N>
MP_HD void store_block_of(E4m3* p, uint8_t* scale, const float (&x)[kQuantBlock][N], int k,
                          const uint32_t* random, bool rotate) {
  uint32_t m = 0;
  for (int j = 0; j < kQuantBlock; ++j) {
    uint32_t a;
    memcpy(&a, &x[j][k], sizeof(a));
    a &= 0x7fffffffu;
    m = a > m ? a : m;
  }
  const uint32_t bits = e8m0_scale_bits(bits_float(m));
  const float inv = e8m0_inverse(bits);
  for (int j = 0; j < kQuantBlock; ++j) {
    p[j].bits = static_cast<uint8_t>(
        random == nullptr
            ? e4m3_code(x[j][k] * inv)
            : e4m3_code_stochastic(x[j][k] * inv, rotate ? rotate_bytes(random[j]) : random[j]));
  }
  *scale = static_cast<uint8_t>(bits);
}

// What the functors need of their value type V beyond + - * /: a square root, a
// flag (per lane) for non-finite values, a choice per lane (select: a where the
// condition holds, else b; the condition is a comparison of Vs), ones: 1 in the lanes
// where a flag holds, else 0 (the flag's bits and those of 1.f), round_bf16: the
// value bf16 storage would hold (round to nearest even, as every bf16 store here),
// round_bf16_stochastic: each lane j rounded stochastically with the bits of local
// element index + j (rounding_bits of key.global(index + j), philox.h), and
// join_bf16/split_bf16: join_bf16_remainder and split_bf16_remainder per lane,
// mul_add: a * b + c rounded once (fma), and count_zero_nonzero: count + 1 in the lanes
// where a == 0 and b != 0 (NaN is not 0; the precision report's count, pointwise.h).
// The CPU engine adds its vector types.
template <typename V>
struct Lanes;

template <>
struct Lanes<float> {
  using Flag = bool;
  static MP_HD float sqrt(float x) { return sqrtf(x); }
  static MP_HD bool not_finite(float x) { return !is_finite(x); }
  static MP_HD bool none() { return false; }
  static MP_HD float select(bool cond, float a, float b) { return cond ? a : b; }
  static MP_HD float ones(bool cond) { return cond ? 1.f : 0.f; }
  static MP_HD float round_bf16(float x) { return static_cast<float>(c10::BFloat16(x)); }
  static MP_HD float round_bf16_stochastic(float x, const RoundingKey& key, int64_t index) {
    return mixedprec::round_bf16_stochastic(x, rounding_bits(key, key.global(index)));
  }
  static MP_HD float round_bf16_stochastic(float x, const RoundingKey&, DrawnBits drawn) {
    return mixedprec::round_bf16_stochastic(x, drawn.bits);
  }
  static MP_HD float join_bf16(float param, float remainder) {
    return join_bf16_remainder(param, remainder);
  }
  static MP_HD float split_bf16(float master, float& remainder) {
    return split_bf16_remainder(master, remainder);
  }
  static MP_HD float mul_add(float a, float b, float c) { return fmaf(a, b, c); }
  static MP_HD float count_zero_nonzero(float count, float a, float b) {
    return a == 0.f && b != 0.f ? count + 1.f : count;
  }
};

}  // namespace mixedprec
