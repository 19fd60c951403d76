"""Builds the one extension, mixedprec._C, against the torch installed here.

Install with `pip install --no-build-isolation .` (see the README). Before compiling,
scripts/build_checks.py stops the build with a one-line message naming the cause and
the fix when a build tool is missing, when pip's build isolation brought its own
torch, or when nvcc's CUDA major version differs from torch's.

Environment variables:
  MIXEDPREC_CUDA=0        build the CPU kernels only (default: CUDA kernels are built
                          whenever the CUDA toolkit and a CUDA build of torch are
                          present; no GPU is needed to build them).
  TORCH_CUDA_ARCH_LIST    GPU architectures to build for, as torch reads it (default:
                          DEFAULT_GENCODE, Ampere's and Hopper's machine code from one
                          PTX).
  MAX_JOBS                parallel compile jobs (default: what the cores and the memory
                          allow, build_checks.default_max_jobs).
"""

import glob
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
import build_checks  # noqa: E402

try:
    build_checks.check_not_isolated_early()
    build_checks.check_build_tools()
except build_checks.BuildError as e:
    sys.exit(f"error: {e}")

from setuptools import find_packages, setup  # noqa: E402
import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

# The GPU code when TORCH_CUDA_ARCH_LIST is not set: Ampere's (sm_80) and Hopper's
# (sm_90) machine code, both compiled by ptxas from one compute_80 PTX, and that PTX for
# later GPUs to JIT. nvcc's front end (cicc) runs once per virtual architecture, a
# quarter of a CUDA unit's time (`nvcc --time` on csrc/cuda/register_adam.cu,
# 2026-12-02: cicc 51-52 s for each of compute_80 and compute_90, ptxas 41-47 s per
# architecture, the host side 28 s), so "8.0;9.0+PTX" ran it twice for code the
# kernels do not need: they use nothing that compute_90's PTX adds. ptxas still
# schedules and allocates sm_90's code for Hopper. Against sm_90 code from compute_90
# PTX (2026-12-02, the Adam and SGD units): no stack frame and no spill in either,
# registers within 4 either way, and per element (scripts/sass_per_element.py) fewer
# instructions in 114 of the 158 modes, as many in 43, and 4.6% more in one (SGD,
# kahan with 8-bit state: bf16 widened by byte permutes where compute_90 converts).
# The four CUDA units alone, on the 2-core Xeon: 258 s (480 s of a core) before,
# 163-178 s (295-327) after. A kernel that needs compute_90's PTX (TMA, clusters) needs
# a unit built for sm_90 alone. TORCH_CUDA_ARCH_LIST, when set, is read as torch reads
# it ("8.0;9.0+PTX": a PTX, and a front-end pass, per architecture).
DEFAULT_GENCODE = "-gencode=arch=compute_80,code=[sm_80,sm_90,compute_80]"
HERE = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    try:
        build_checks.check_not_isolated(torch.__file__)
        build_checks.check_torch_version(torch.__version__)
        return build_checks.want_cuda(torch_cuda=torch.version.cuda,
                                      torch_version=torch.__version__,
                                      cuda_home=cpp_extension.CUDA_HOME)
    except build_checks.BuildError as e:
        sys.exit(f"error: {e}")


def write_build_info(cuda: bool) -> None:
    """mixedprec/_build_info.py: the torch this build is for, checked at import, and
    the CUDA architectures it compiled (TORCH_CUDA_ARCH_LIST; "" for DEFAULT_GENCODE,
    whose sm_90 code comes from compute_80 PTX: test_sass_budget reads which of the
    8-bit decodes that code has)."""
    with open(os.path.join(HERE, "mixedprec", "_build_info.py"), "w") as f:
        f.write("# Written by setup.py: the torch the extension was built against.\n"
                f"TORCH_VERSION = {torch.__version__!r}\nWITH_CUDA = {cuda!r}\n"
                f"CUDA_ARCH_LIST = {arch_list() if cuda else ''!r}\n")


# -fmad=false: no FMA contraction on CUDA either, so that the CUDA kernels give the CPU
# engine's bits (IEEE adds, multiplies, divisions and square roots in the same order;
# pointwise.h's pow_step for the bias corrections); tests/python/ops/test_cuda_bits.py
# checks the PTX. The step is bound by memory traffic, not by its few more instructions.
# --resource-usage: ptxas prints each kernel's registers, stack frame and spills, which
# `make build` keeps (scripts/cuda_resources.py) and tests/python/ops/test_cuda_resources.py
# gates. --diag-error 20011,20014: a __host__ function called from device code is an
# error, not a warning: nvcc otherwise compiles the caller's path away (an empty kernel).
# --threads=2: a unit's independent steps run side by side (its host compilation beside
# cicc, then ptxas for each architecture: with cicc, nine tenths of a CUDA unit's time),
# so an edit that rebuilds one family's units (its CUDA unit the longest) takes both
# cores; in a full build ninja's jobs fill the cores already, and the extra threads
# share them. nvcc prints each architecture's ptxas lines together, which
# scripts/cuda_resources.py relies on.
NVCC_FLAGS = ["-O3", "-lineinfo", "-fmad=false", "--resource-usage",
              "--diag-error=20011,20014", "--threads=2"]


def extension(cuda: bool):
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # -fno-math-errno: sqrtf may not set errno, so loops with it vectorise.
    # -ffp-contract=off: no FMA contraction, so every instruction set the CPU loops are
    # built for (csrc/cpu/engine.h) gives the same bits. -fopenmp: at::parallel_for
    # runs on torch's OpenMP threads (torch's own libgomp, already loaded).
    # -Wno-psabi: the functors are instantiated for AVX vector types, always inlined
    # into functions built for those instruction sets; GCC's note on the calling
    # convention of an out-of-line copy does not apply.
    # No -std: torch's BuildExtension adds the standard its headers need (C++17 up to
    # torch 2.11, C++20 in 2.15, whose ATen.h stops a C++17 build); the sources are
    # C++17 and build as either (CI's torch builds them as C++17; the GoogleTest build
    # compiles the op entries as C++20 too: tests/cpp/cxx20_entries.cpp).
    # -g0: no debug information (Python's CFLAGS ask for -g): the same machine code,
    # objects a fifteenth the size, and a build that spends its time compiling, not
    # writing DWARF for torch's headers.
    cxx = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-Wno-psabi", "-g0"]
    link = ["-fopenmp"]
    if not cuda:
        return cpp_extension.CppExtension(
            "mixedprec._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link,
            py_limited_api=True,
        )
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    return cpp_extension.CUDAExtension(
        "mixedprec._C",
        sources,
        extra_compile_args={"cxx": cxx + ["-DMIXEDPREC_WITH_CUDA"],
                            "nvcc": NVCC_FLAGS + ([] if arch_list() else [DEFAULT_GENCODE])},
        extra_link_args=link,
        py_limited_api=True,
    )


# The units that take longest, in the order ninja is to start them (csrc/README.md):
# distutils sorts the sources by name, which starts the CPU units first and leaves the
# CUDA Adam unit, the longest, running alone at the end of a clean build.
LONGEST_FIRST = ("csrc/cuda/register_adam.cu", "csrc/cuda/register_optimizers.cu",
                 "csrc/cpu/register_adam.cpp", "csrc/cpu/register_optimizers.cpp")


def longest_first(sources):
    """The indices of `sources` in LONGEST_FIRST's order, the others after in theirs."""
    def rank(i):
        name = os.path.relpath(sources[i]).replace(os.sep, "/")
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    return sorted(range(len(sources)), key=rank)


class BuildExtension(cpp_extension.BuildExtension):
    """torch's, with ninja's build file listing the sources longest first
    (LONGEST_FIRST); the objects are linked in distutils' order, as before."""

    def build_extension(self, ext):
        compile_sources = self.compiler.compile

        def compile_longest_first(sources, *args, **kwargs):
            order = longest_first(sources)
            objects = compile_sources([sources[i] for i in order], *args, **kwargs)
            linked = [None] * len(sources)
            for position, i in enumerate(order):
                linked[i] = objects[position]
            return linked

        self.compiler.compile = compile_longest_first
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_sources


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST, "" when it is not set (torch reads an empty one so too)."""
    return os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()


def announce(cuda: bool) -> None:
    """What is built, how, and with how many jobs, in the build output."""
    os.environ.setdefault("MAX_JOBS", str(build_checks.default_max_jobs(cuda=cuda)))
    archs = (f"TORCH_CUDA_ARCH_LIST={arch_list()}" if arch_list()
             else "sm_80 and sm_90 from compute_80 PTX")
    what = f"CPU and CUDA kernels for {archs}" if cuda else "CPU kernels only"
    print(f"mixedprec: building {what} against torch {torch.__version__}, "
          f"MAX_JOBS={os.environ['MAX_JOBS']}", file=sys.stderr)
    if shutil.which("ninja") is None:
        print(f"mixedprec: ninja is not installed, so the sources compile one after "
              f"another (much slower): `{build_checks.PIP} ninja`", file=sys.stderr)


CUDA = want_cuda()
announce(CUDA)
write_build_info(CUDA)

setup(
    packages=find_packages(include=["mixedprec", "mixedprec.*"]),
    ext_modules=[extension(CUDA)],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    # pip then refuses to install the wheel next to another torch release, rather
    # than the import failing on a missing C++ symbol.
    install_requires=[build_checks.torch_requirement(torch.__version__)],
)
