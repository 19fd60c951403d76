"""Builds the one extension, mixedprec._C.

Environment variables:
  MIXEDPREC_CUDA=0        build the CPU kernels only (default: CUDA kernels are built
                          whenever the CUDA toolkit and a CUDA build of torch are
                          present; no GPU is needed to build them).
  TORCH_CUDA_ARCH_LIST    GPU architectures to build for (default: DEFAULT_ARCH_LIST).
  MAX_JOBS                parallel compile jobs (torch.utils.cpp_extension).
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

# Ampere and Hopper machine code, plus PTX of the newest for later GPUs to JIT.
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"


def want_cuda():
    if os.environ.get("MIXEDPREC_CUDA", "1") == "0":
        return False
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # -fno-math-errno: sqrtf may not set errno, so loops with it vectorise.
    # -ffp-contract=off: no FMA contraction, so every instruction set the CPU loops are
    # built for (csrc/cpu/engine.h) gives the same bits. -fopenmp: at::parallel_for
    # runs on torch's OpenMP threads (torch's own libgomp, already loaded).
    # -Wno-psabi: the functors are instantiated for AVX vector types, always inlined
    # into functions built for those instruction sets; GCC's note on the calling
    # convention of an out-of-line copy does not apply.
    cxx = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-fopenmp",
           "-Wno-psabi"]
    link = ["-fopenmp"]
    if not want_cuda():
        return cpp_extension.CppExtension(
            "mixedprec._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link,
            py_limited_api=True,
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc = ["-O3", "-std=c++17", "-lineinfo"]
    return cpp_extension.CUDAExtension(
        "mixedprec._C",
        sources,
        extra_compile_args={"cxx": cxx + ["-DMIXEDPREC_WITH_CUDA"], "nvcc": nvcc},
        extra_link_args=link,
        py_limited_api=True,
    )


setup(
    packages=find_packages(include=["mixedprec", "mixedprec.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
