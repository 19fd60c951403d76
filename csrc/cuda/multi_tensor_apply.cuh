// The multi-tensor engine: every list op on CUDA runs through it.
//
// The host plans launches (csrc/multi_tensor_plan.h) and packs tensor pointers,
// sizes and the block -> (tensor, chunk) table into the kernel's parameters, so
// one launch covers hundreds of tensors. What a block does with its chunk is in
// multi_tensor_block.cuh; this file holds the kernels and their launches.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "multi_tensor_block.cuh"

namespace mixedprec::cuda {

// Op::kMinBlocks (a Fixed functor's, from its mode: pointwise.h's LeanMode), else 0: the
// blocks of kBlockSize threads per SM that ptxas must make room for (2: at most 64
// registers a thread); 0 leaves the registers to ptxas.
template <typename Op, typename = void>
struct MinBlocks : std::integral_constant<int, 0> {};
template <typename Op>
struct MinBlocks<Op, std::void_t<decltype(Op::kMinBlocks)>>
    : std::integral_constant<int, Op::kMinBlocks> {};

template <typename Op, typename... Ts>
__global__ void __launch_bounds__(kBlockSize, MinBlocks<Op>::value)
    pointwise_kernel(const __grid_constant__ TensorListMeta<sizeof...(Ts)> meta, Op op,
                     const float* skip, float* found_inf) {
  pointwise_block<Op, Ts...>(meta, op, skip, found_inf, std::index_sequence_for<Ts...>{});
}

// The one-thread kernel of run_single (the step counter, the loss scale).
template <typename F, typename... Args>
__global__ void single_thread_kernel(Args... args) {
  F::apply(args...);
}

// The Engine (csrc/dispatch.h) for CUDA: launches on the current stream of the
// current device (the entries set it with Guard).
struct CudaEngine {
  using Guard = c10::cuda::CUDAGuard;

  template <typename Op, typename... Ts>
  static void run(const Lists<sizeof...(Ts)>& lists, const Op& op, const float* skip,
                  float* found_inf) {
    constexpr int D = sizeof...(Ts);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    auto launch = [&](const auto& functor) {
      using F = std::decay_t<decltype(functor)>;
      for_each_launch<D>(lists, [&](const TensorListMeta<D>& meta, int num_blocks, int64_t) {
        const auto grid = static_cast<unsigned>(grid_blocks<kBlocksPerChunk>(num_blocks));
        pointwise_kernel<F, Ts...><<<grid, kBlockSize, 0, stream>>>(meta, functor, skip, found_inf);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      return 0;
    };
    // A functor in one of its FixedModes runs as Fixed<Op, M> (pointwise.h): a kernel
    // per mode, without the registers and instructions of the lists and flags it lacks
    // (a call that tallies: launch_as).
    launch_as<Ts...>(op, lists, launch);
  }

  // In l2norm.cu.
  static std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors, const float* inv_scale,
                                                   bool per_tensor, at::Device device);

  template <typename F, typename... Args>
  static void run_single(Args... args) {
    single_thread_kernel<F, Args...><<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace mixedprec::cuda
