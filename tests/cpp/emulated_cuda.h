// The CUDA engine's block code (csrc/cuda/multi_tensor_block.cuh) compiled as host
// code, with an Engine (csrc/dispatch.h) that runs a launch block by block and, in a
// block, thread by thread (the 8-bit kernels: a warp per call, whose lanes the block
// code loops over on the host), on CPU tensors: test_cuda_blocks.cpp compares it with
// the CPU engine, test_memory_traffic.cpp records its memory accesses. Include it
// before anything else of csrc/ (CUDA's index variables must be declared first).
//
// The op entries on this engine, and every kernel under them, are compiled once, in
// emulated_cuda.cpp, and declared extern below: the two test files used to compile
// them each (the engine was a type of each file's own), two thirds of each file's
// time.
#pragma once

#include <ATen/ATen.h>

// CUDA's built-in index variables, for the host build of the block code: one set for
// the whole test program (inline variables, not a set per file). The block code's
// templates instantiated for the same types in two test files are one function after
// linking, so with a set per file whichever copy the linker kept read the other
// file's indices: hidden at -O3, where the calls were inlined, an endless launch at -O1.
struct EmulatedDim3 {
  unsigned x = 0;
};
inline EmulatedDim3 threadIdx, blockIdx, blockDim;

#include "cpu/engine.h"
#include "cpu_entries.h"
#include "cuda/multi_tensor_block.cuh"
#include "ops/all.h"

namespace mixedprec::cuda {

inline int g_launches = 0;  // launches of the emulated engine

// The Engine (csrc/dispatch.h) with CudaEngine's block code, on the host. It keeps
// the CPU engine's Guard and run_single: CUDA's one-thread kernel calls the same
// F::apply.
struct EmulatedCudaEngine : mixedprec::cpu::CpuEngine {
  template <typename Op, typename... Ts>
  static void run(const Lists<sizeof...(Ts)>& lists, const Op& op, const float* skip,
                  float* found_inf) {
    constexpr int D = sizeof...(Ts);
    // (the kernels as CudaEngine::run picks them: launch_as)
    auto launch = [&](const auto& fixed) {
      using F = std::decay_t<decltype(fixed)>;
      for_each_launch<D>(lists, [&](const TensorListMeta<D>& meta, int num_blocks, int64_t) {
        ++g_launches;
        blockDim.x = kBlockSize;
        for (int64_t b = 0; b < grid_blocks<kBlocksPerChunk>(num_blocks); ++b) {
          blockIdx.x = static_cast<unsigned>(b);
          constexpr int kThreadsPerCall = (kBlocked<Ts> || ...) ? kWarpSize : 1;
          for (int t = 0; t < kBlockSize; t += kThreadsPerCall) {
            threadIdx.x = static_cast<unsigned>(t);
            pointwise_block<F, Ts...>(meta, fixed, skip, found_inf,
                                      std::index_sequence_for<Ts...>{});
          }
        }
      });
      return 0;
    };
    launch_as<Ts...>(op, lists, launch);
  }
};

}  // namespace mixedprec::cuda

// The entries the tests run on it (the L2 norm's second and third stages are warp
// reductions the host does not run: EmulatedCudaEngine keeps the CPU engine's l2norm).
#define MP_EMULATED_ENTRIES(X)  \
  X(multi_tensor_unscale_)      \
  X(multi_tensor_unscale_to_)   \
  X(multi_tensor_check_finite_) \
  X(multi_tensor_copy_)         \
  X(fused_sgd_)                 \
  X(fused_adam_)                \
  X(fused_lamb_)                \
  X(fused_adagrad_)             \
  X(fused_novograd_)
#define MP_EXTERN_EMULATED_ENTRY(name) \
  extern template MP_ENTRY(mixedprec::cuda::EmulatedCudaEngine, name);
MP_EMULATED_ENTRIES(MP_EXTERN_EMULATED_ENTRY)
#undef MP_EXTERN_EMULATED_ENTRY
