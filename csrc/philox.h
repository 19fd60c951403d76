// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011), a
// counter-based generator: the bits are a pure function of a 128-bit counter and a
// 64-bit key, so any element can draw its own, on the host or the device, in any
// order and at any thread count. Written for MP_HD (lanes.h) and plain integers
// only, so the CPU engine, the CUDA kernels and the host build of the block code
// compute the same bits. tests/python/references.py holds a Python reference.
//
// Stochastic rounding keys it as follows: key = the 64-bit seed (low word first);
// counter = (block low 32 bits, block high 32 bits, tensor salt, step), where block =
// global index / 8: one call gives the 16 bits of 8 consecutive elements (global
// index g takes 16-bit half g % 8 of the 128 output bits, see rounding_bits). The
// global index is the element's position in the whole (unsharded) tensor, which the
// local one maps to (RoundingKey::global): so a shard draws the very bits of its
// elements in the full tensor, whatever the sharding and the engine's chunks.
#pragma once

#include <cstdint>

#if !defined(MP_HD)
#if defined(__CUDACC__)
#define MP_HD __host__ __device__ __forceinline__
#else
#define MP_HD inline
#endif
#endif

namespace mixedprec {

struct Philox4x32 {
  uint32_t v[4];

  // Its 16-bit half h (0..7), low half of v[0] first (little-endian memory order):
  // picked by selects, not by a variable index, which under nvcc would put v in local
  // memory.
  MP_HD uint32_t half(uint32_t h) const {
    const uint32_t low = (h & 2u) != 0 ? v[1] : v[0];
    const uint32_t high = (h & 2u) != 0 ? v[3] : v[2];
    return (((h & 4u) != 0 ? high : low) >> (16 * (h & 1u))) & 0xffffu;
  }
};

MP_HD uint32_t mul_hi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// The multipliers and the Weyl constants (the key's increments) of Philox4x32.
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

// Ten rounds, the key bumped by the Weyl constants between rounds.
MP_HD Philox4x32 philox4x32_10(Philox4x32 c, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const uint32_t hi0 = mul_hi32(kPhiloxM0, c.v[0]), lo0 = kPhiloxM0 * c.v[0];
    const uint32_t hi1 = mul_hi32(kPhiloxM1, c.v[2]), lo1 = kPhiloxM1 * c.v[2];
    c = Philox4x32{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
  }
  return c;
}

// The key of stochastic rounding's bits at one step: everything but the element,
// and where the tensor's elements lie in the full tensor. Local element i (its
// position in the tensor's memory) is element global(i) = offset + (i / run) * stride
// + i % run of the full tensor (in the same memory order): the local tensor is runs
// of `run` consecutive elements, `stride` apart; run 0: one run (global = offset + i),
// as for a whole tensor (offset 0) or a shard along its outermost dimension.
struct RoundingKey {
  uint64_t seed;
  uint32_t salt;  // the tensor's position in its list (param group)
  uint32_t step;
  int64_t offset = 0, run = 0, stride = 0;

  MP_HD int64_t global(int64_t i) const {
    return run == 0 ? offset + i : offset + (i / run) * stride + i % run;
  }
  // Whether local elements i .. i + n - 1 are consecutive in the full tensor.
  MP_HD bool consecutive(int64_t i, int64_t n) const { return run == 0 || i % run + n <= run; }
};

// The Philox output of block `block` of stochastic rounding: the bits of elements
// 8 * block .. 8 * block + 7. Read as eight 16-bit halves in order (half h is
// v[h / 2] >> (16 * (h % 2)), low half first, which is their order in a little-endian
// memory), half h holds the bits of element 8 * block + h. The CPU engine's vector path
// takes the eight halves at once.
MP_HD Philox4x32 rounding_block(const RoundingKey& key, uint64_t block) {
  return philox4x32_10(Philox4x32{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                   key.salt, key.step}},
                       static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
}

// The 16 random bits stochastic rounding adds to the element of global index `index`
// (>= 0, see RoundingKey::global): half index % 8 of its block's output (see
// rounding_block).
MP_HD uint32_t rounding_bits(const RoundingKey& key, int64_t index) {
  const uint64_t i = static_cast<uint64_t>(index);
  const Philox4x32 out = rounding_block(key, i >> 3);
  return out.half(static_cast<uint32_t>(i & 7));
}

// The 16 bits rounding_bits gives an element, drawn by the engine for a whole vector
// of elements at once (lanes.h's vector_bits). Functors that round stochastically take
// it in place of the element's index (pointwise.h's apply_at), which they read only for
// these bits, and Lanes<float> rounds with them.
struct DrawnBits {
  uint32_t bits;
};

}  // namespace mixedprec
