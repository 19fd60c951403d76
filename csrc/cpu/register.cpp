// The CPU kernels: every op's entry (csrc/ops/) on the CPU engine.
#include <torch/library.h>

#include "../ops/all.h"
#include "engine.h"

namespace mixedprec::cpu {

TORCH_LIBRARY_IMPL(mixedprec, CPU, m) { register_kernels<CpuEngine>(m); }
// Sparse tensors (COO; CSR, CSC, BSR, BSC) reach the same kernels, whose validation
// rejects them by name.
TORCH_LIBRARY_IMPL(mixedprec, SparseCPU, m) { register_kernels<CpuEngine>(m); }
TORCH_LIBRARY_IMPL(mixedprec, SparseCsrCPU, m) { register_kernels<CpuEngine>(m); }

}  // namespace mixedprec::cpu
