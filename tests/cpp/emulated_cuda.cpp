// The op entries on the emulated CUDA engine (emulated_cuda.h), instantiated once for
// test_cuda_blocks.cpp and test_memory_traffic.cpp, which declare them extern.
#include "emulated_cuda.h"

#define MP_EMULATED_ENTRY(name) template MP_ENTRY(mixedprec::cuda::EmulatedCudaEngine, name);
MP_EMULATED_ENTRIES(MP_EMULATED_ENTRY)
#undef MP_EMULATED_ENTRY
