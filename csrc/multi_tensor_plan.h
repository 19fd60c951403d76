// Host-side planning of the multi-tensor engine, free of CUDA so that the CPU
// backend and the GoogleTest suite use (and test) the same plan as the GPU.
//
// A list of tensors is cut into chunks of kChunkSize elements. A launch holds
// at most `max_tensors` tensors and `max_blocks` chunks (one CUDA block each);
// a tensor whose chunks do not fit in one launch continues in the next. Chunks
// are emitted in tensor-major order, so the i-th block over all launches is the
// i-th chunk of the whole list: reductions rely on that to order partial sums.
#pragma once

#include <cstdint>
#include <vector>

namespace mixedprec {

constexpr int64_t kChunkSize = 65536;

// Launch capacity by list depth, sized so that the kernel parameter struct
// (pointers, sizes and the block table) stays under 16 KiB: within the 32 KiB
// that CUDA 12.1+ allows on Volta and newer, and small enough to copy cheaply.
constexpr int kMaxBlocksPerLaunch = 1024;
constexpr int max_tensors_per_launch(int depth) {
  // Per tensor: `depth` pointers and a size; per block: a 2-byte slot and a 4-byte chunk.
  const int fit = (16384 - kMaxBlocksPerLaunch * 6) / (8 * (depth + 1));
  return fit < 256 ? fit : 256;
}

struct LaunchPlan {
  std::vector<int> tensors;      // indices into the caller's list
  std::vector<int> block_slot;   // per block: position in `tensors`
  std::vector<int> block_chunk;  // per block: chunk index within its tensor
};

inline int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// Plans launches over tensors of the given sizes. Zero-size tensors get no
// blocks and no slot. Limits <= 0 mean "unlimited" (the CPU backend's flat
// chunk list).
std::vector<LaunchPlan> plan_launches(const std::vector<int64_t>& numels, int max_tensors,
                                      int max_blocks);

}  // namespace mixedprec
