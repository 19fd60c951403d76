// The CPU engine's op entries, declared extern: the extension's registration units
// (csrc/cpu/register*.cpp) instantiate them, and the tests link those objects (or
// compile those sources, tests/cpp/CMakeLists.txt), so a test that calls an entry on
// the CPU engine does not compile it, and every kernel under it, a second time.
#pragma once

#include "cpu/engine.h"
#include "ops/all.h"

// Entry `name` on engine E, for an explicit instantiation: `template MP_ENTRY(E, name);`
// makes it, `extern template MP_ENTRY(E, name);` declares it made elsewhere.
#define MP_ENTRY(E, name) decltype(mixedprec::entry::name<E>) mixedprec::entry::name<E>
#define MP_EXTERN_CPU_ENTRY(name) extern template MP_ENTRY(mixedprec::cpu::CpuEngine, name);

MP_EXTERN_CPU_ENTRY(update_loss_scale_)
MP_EXTERN_CPU_ENTRY(multi_tensor_unscale_)
MP_EXTERN_CPU_ENTRY(multi_tensor_unscale_to_)
MP_EXTERN_CPU_ENTRY(multi_tensor_check_finite_)
MP_EXTERN_CPU_ENTRY(multi_tensor_copy_)
MP_EXTERN_CPU_ENTRY(multi_tensor_l2norm)
MP_EXTERN_CPU_ENTRY(fused_sgd_)
MP_EXTERN_CPU_ENTRY(fused_adam_)
MP_EXTERN_CPU_ENTRY(fused_lamb_)
MP_EXTERN_CPU_ENTRY(fused_adagrad_)
MP_EXTERN_CPU_ENTRY(fused_novograd_)
MP_EXTERN_CPU_ENTRY(sum_fp32)

#undef MP_EXTERN_CPU_ENTRY
