// The instruction set of the CPU engine's loops (vec.h), chosen once per process.
#include "vec.h"

#include <ATen/Version.h>

#include <cstdlib>
#include <string>

namespace mixedprec::cpu {
namespace {

Isa detect_isa() {
#if defined(MP_X86_ISA)
  const std::string capability = at::get_cpu_capability();
  if (capability == "AVX512" && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::kAvx512;
  }
  if ((capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kBaseline;
}

}  // namespace

Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

#if defined(MP_X86_ISA)
namespace {
// (vec.h's software_prefetch; another value of the variable is ignored)
bool choose_software_prefetch() {
  const char* env = std::getenv("MIXEDPREC_CPU_PREFETCH");
  const std::string set = env == nullptr ? "" : env;
  if (set == "0" || set == "1") return set == "1";
  return !(__builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f"));
}
}  // namespace
const bool software_prefetch = choose_software_prefetch();
const bool avx512_bf16_stores = cpu_isa() == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16");
const bool avx512_vbmi = cpu_isa() == Isa::kAvx512 && __builtin_cpu_supports("avx512vbmi");
#else
const bool avx512_bf16_stores = false;
const bool avx512_vbmi = false;
#endif

}  // namespace mixedprec::cpu
