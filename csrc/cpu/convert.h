// Conversions between the storage types and fp32 for the CPU engine, over runs of
// elements, and the choice of instruction set for its loops. The conversions use AVX2
// (and F16C for fp16) when torch's own CPU kernels do
// (torch.backends.cpu.get_cpu_capability() is AVX2 or AVX512, which
// ATEN_CPU_CAPABILITY=default turns off), and c10's scalar conversions otherwise.
// Both round to nearest even and give the same bits, but for the payload of NaNs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace mixedprec::cpu {

void to_float(const float* src, float* dst, int64_t n);
void to_float(const c10::Half* src, float* dst, int64_t n);
void to_float(const c10::BFloat16* src, float* dst, int64_t n);

void from_float(const float* src, float* dst, int64_t n);
void from_float(const float* src, c10::Half* dst, int64_t n);
void from_float(const float* src, c10::BFloat16* dst, int64_t n);

// Whether the SIMD conversions are in use (for the tests).
bool simd_conversions();

// The instruction sets the CPU engine's loops are compiled for, picked at run time:
// the widest that both the CPU has and torch's own CPU kernels use
// (torch.backends.cpu.get_cpu_capability(), which ATEN_CPU_CAPABILITY can lower).
enum class Isa { kBaseline, kAvx2, kAvx512 };
Isa cpu_isa();

}  // namespace mixedprec::cpu

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MP_X86_ISA 1
#define MP_AVX512_TARGET "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"
#endif

namespace mixedprec::cpu {

}  // namespace mixedprec::cpu
