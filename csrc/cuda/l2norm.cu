// The CUDA engine's L2 norm (multi_tensor_l2norm): three fixed-order float32 stages.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "multi_tensor_apply.cuh"

namespace mixedprec::cuda {
namespace {

// A fixed-order block reduction (warp shuffles, then the first warp): the same
// inputs give the same bits on every run. The result is valid in thread 0.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// Stage 1: the sum of squares of each chunk, at partial[first_block + block].
template <typename T>
__global__ void __launch_bounds__(kBlockSize)
    l2norm_chunks_kernel(const __grid_constant__ TensorListMeta<1> meta, const float* inv_scale,
                         float* partial, int64_t first_block) {
  const float scale = inv_scale != nullptr ? *inv_scale : 1.f;
  const float acc = block_sum(chunk_sum_of_squares<T>(meta, scale));
  if (threadIdx.x == 0) partial[first_block + blockIdx.x] = acc;
}

// Stage 2: per tensor, the sum of its chunks' partials (a contiguous range).
constexpr int kRangesPerLaunch = 1024;
struct Ranges {
  int64_t begin[kRangesPerLaunch];
  int32_t count[kRangesPerLaunch];
};

__global__ void l2norm_tensors_kernel(const __grid_constant__ Ranges ranges, const float* partial,
                                      float* squares) {
  const int64_t begin = ranges.begin[blockIdx.x];
  float acc = 0.f;
  for (int i = threadIdx.x; i < ranges.count[blockIdx.x]; i += blockDim.x) {
    acc += partial[begin + i];
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) squares[blockIdx.x] = acc;
}

// Stage 3: the global norm, and the per-tensor norms when asked for.
__global__ void l2norm_total_kernel(const float* squares, int64_t n, float* norm,
                                    float* per_tensor) {
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    acc += squares[i];
    if (per_tensor != nullptr) per_tensor[i] = sqrtf(squares[i]);
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) *norm = sqrtf(acc);
}

}  // namespace

// The entry has made `device` current.
std::tuple<at::Tensor, at::Tensor> CudaEngine::l2norm(at::TensorList tensors,
                                                      const float* inv_scale, bool per_tensor,
                                                      at::Device device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t n = static_cast<int64_t>(tensors.size());

  const L2NormLayout layout = l2norm_layout(tensors);
  at::Tensor partial = at::empty({std::max<int64_t>(layout.total_chunks, 1)}, options);
  for (const auto& group : layout.groups) {
    MP_DISPATCH_FLOATS(group.dtype, "multi_tensor_l2norm", scalar_t, [&] {
      for_each_launch<1>(
          group.lists(), [&](const TensorListMeta<1>& meta, int num_blocks, int64_t first_block) {
            l2norm_chunks_kernel<scalar_t><<<num_blocks, kBlockSize, 0, stream>>>(
                meta, inv_scale, partial.data_ptr<float>(), group.first_partial + first_block);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
    });
  }

  at::Tensor squares = at::empty({std::max<int64_t>(n, 1)}, options);
  for (int64_t first = 0; first < n; first += kRangesPerLaunch) {
    const int64_t count = std::min<int64_t>(kRangesPerLaunch, n - first);
    Ranges ranges{};
    for (int64_t i = 0; i < count; ++i) {
      ranges.begin[i] = layout.first_partial[first + i];
      ranges.count[i] = static_cast<int32_t>(num_chunks(tensors[first + i].numel()));
    }
    l2norm_tensors_kernel<<<static_cast<int>(count), 256, 0, stream>>>(
        ranges, partial.data_ptr<float>(), squares.data_ptr<float>() + first);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  at::Tensor norm = at::empty({1}, options);
  at::Tensor per = at::empty({per_tensor ? n : 0}, options);
  l2norm_total_kernel<<<1, 1024, 0, stream>>>(squares.data_ptr<float>(), n, norm.data_ptr<float>(),
                                              per_tensor ? per.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {norm, per};
}

}  // namespace mixedprec::cuda
