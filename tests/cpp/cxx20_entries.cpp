// Compiled as C++20 (CMakeLists.txt's mixedprec_cxx20_check, beside the suite's own
// objects), never run: the extension builds as C++17 against torch up to 2.11 and as
// C++20 against torch 2.15 (torch's BuildExtension picks the standard; setup.py), and
// CI's pinned torch builds it as C++17 only. This unit builds every op family's entries
// and their boxed kernels (ops/kernel.h) in C++20 on NoTensorEngine (dispatch.h), which
// runs no functor: what differs between the standards is the entries' C++, not the
// kernels'. (2026-12-02: kernel.h built a c10 typelist, whose default constructor is
// deleted, with `{}`, which C++17 takes as an aggregate's initialization and C++20
// refuses; the extension did not build against torch 2.15.)
#include "ops/all.h"

static_assert(__cplusplus >= 202002L, "this unit checks the C++20 build");

namespace mixedprec {
template void register_list_ops<NoTensorEngine>(torch::Library&);
template void register_adam_ops<NoTensorEngine>(torch::Library&);
template void register_other_optimizer_ops<NoTensorEngine>(torch::Library&);
}  // namespace mixedprec
