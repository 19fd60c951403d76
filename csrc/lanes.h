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
// exact too; NaN into (NaN, 0), payload and sign not kept. The remainder travels as
// a float (an exact integer) between the engine's loads and stores.
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

// What the functors need of their value type V beyond + - * /: a square root, a
// flag (per lane) for non-finite values, a choice per lane (select: a where the
// condition holds, else b; the condition is a comparison of Vs), round_bf16: the
// value bf16 storage would hold (round to nearest even, as every bf16 store here),
// round_bf16_stochastic: each lane j rounded stochastically with the bits of local
// element index + j (rounding_bits of key.global(index + j), philox.h), and
// join_bf16/split_bf16: join_bf16_remainder and split_bf16_remainder per lane.
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
  static MP_HD float round_bf16(float x) { return static_cast<float>(c10::BFloat16(x)); }
  static MP_HD float round_bf16_stochastic(float x, const RoundingKey& key, int64_t index) {
    return mixedprec::round_bf16_stochastic(x, rounding_bits(key, key.global(index)));
  }
  static MP_HD float join_bf16(float param, float remainder) {
    return join_bf16_remainder(param, remainder);
  }
  static MP_HD float split_bf16(float master, float& remainder) {
    return split_bf16_remainder(master, remainder);
  }
};

}  // namespace mixedprec
