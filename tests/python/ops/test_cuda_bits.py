"""The CUDA kernels give the CPU engine's bits (docs/torch-suite.md, "CPU and CUDA"): both
builds contract no multiply-add into an FMA (g++ -ffp-contract=off, nvcc -fmad=false), use
IEEE division and square root, and compute the bias corrections with pointwise.h's
pow_step. On the CPU machines the PTX of the shared functors is checked for FMAs (nvcc
is there; a GPU is not); on a GPU machine every optimizer mode steps on both devices
from the same values and must agree bit for bit. (LAMB and NovoGrad are not in it: their
per-tensor norms are summed in another order on each device, ops.multi_tensor_l2norm.)"""

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal

import mixedprec
from mixedprec import grads, optim

REPO = Path(__file__).resolve().parents[3]
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"

# Every functor of csrc/pointwise*.h, resolved and applied to one element in a kernel.
PROBE = r"""
#include "pointwise_adam.h"
#include "pointwise_lists.h"
#include "pointwise_optimizers.h"
using namespace mixedprec;
template <class Op>
__global__ void probe(Op op, float* x, int64_t index) {
  op.resolve();
  apply_at(op, x, index);
}
template __global__ void probe<ScaleOp>(ScaleOp, float*, int64_t);
template __global__ void probe<SgdOp>(SgdOp, float*, int64_t);
template __global__ void probe<AdamOp>(AdamOp, float*, int64_t);
template __global__ void probe<LambStage1Op>(LambStage1Op, float*, int64_t);
template __global__ void probe<LambStage2Op>(LambStage2Op, float*, int64_t);
template __global__ void probe<AdagradOp>(AdagradOp, float*, int64_t);
template __global__ void probe<NovoGradOp>(NovoGradOp, float*, int64_t);
"""
FMA = re.compile(r"\bfma\.rn\.f(32|64)\b")
# A PTX function: its header's name, and its body up to the next function.
FUNCTION = re.compile(r"^\.(?:visible \.)?(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)\(",
                      re.M)


def fmas_by_function(text):
    """{function name: its fma.rn count} of a PTX module, for the functions with some,
    but libdevice's own (``__internal_*``, ``__nv_*``: its pow, which pow_step calls
    only for exponents that are not step counts, is written with fma on purpose)."""
    starts = [(m.start(), m.group(1)) for m in FUNCTION.finditer(text)]
    counts = {}
    for (start, name), (end, _) in zip(starts, starts[1:] + [(len(text), "")]):
        found = len(FMA.findall(text, start, end))
        if found and not name.startswith(("__internal_", "__nv_")):
            counts[name] = found
    return counts


def nvcc_flags():
    """setup.py's NVCC_FLAGS, read from its source (importing it would run setup())."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NVCC_FLAGS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no NVCC_FLAGS")


def ptx(tmp_path, flags):
    from torch.utils.cpp_extension import include_paths
    source = tmp_path / "probe.cu"
    source.write_text(PROBE)
    out = tmp_path / "probe.ptx"
    includes = [f"-I{p}" for p in [str(REPO / "csrc"), *include_paths()]]
    cmd = [NVCC, "-ptx", "-arch=sm_90", "-std=c++17", "-w", *flags, *includes,
           str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text()


@pytest.mark.skipif(not os.path.exists(NVCC), reason="nvcc is not installed")
def test_the_cuda_build_contracts_no_multiply_add(tmp_path):
    """No fma.rn in the functors' PTX with the extension's flags; without -fmad=false
    nvcc contracts them (the check sees FMAs where there are some)."""
    flags = nvcc_flags()
    assert "-fmad=false" in flags
    text = ptx(tmp_path, flags)
    kernels = [name for name in FUNCTION.findall(text) if "probe" in name]
    assert len(kernels) == 7 and "mul.rn.f32" in text
    assert fmas_by_function(text) == {}
    contracted = fmas_by_function(ptx(tmp_path, [f for f in flags if f != "-fmad=false"]))
    assert len([name for name in contracted if "probe" in name]) >= 5, contracted


# A host function called from device code: nvcc warns and compiles the caller's path
# away (the H200 run of 2026-11-28 met its first kernels per mode as an empty EXIT,
# because AdamOp::Mode::fix was host-only). With the extension's flags it is an error.
HOST_CALL = r"""
struct Mode {
  static void fix(float& x) { x = 1.f; }  // host only
};
template <class M>
__host__ __device__ __forceinline__ float fixed(float x) {
  M::fix(x);
  return x;
}
__global__ void kernel(float* out) { out[threadIdx.x] = fixed<Mode>(out[threadIdx.x]); }
"""


@pytest.mark.skipif(not os.path.exists(NVCC), reason="nvcc is not installed")
def test_the_cuda_build_refuses_host_code_called_from_device_code(tmp_path):
    source = tmp_path / "host_call.cu"
    source.write_text(HOST_CALL)

    def compile_with(flags):
        cmd = [NVCC, "-ptx", "-arch=sm_90", "-std=c++17", *flags, str(source), "-o",
               str(tmp_path / "host_call.ptx")]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    flags = [f for f in nvcc_flags() if f not in ("--resource-usage", "-lineinfo")]
    refused = compile_with(flags)
    assert refused.returncode != 0 and "calling a __host__ function" in refused.stderr
    # (without the flag: a warning, and a kernel that stores nothing)
    plain = compile_with([f for f in flags if not f.startswith("--diag-error")])
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "calling a __host__ function" in plain.stderr
    assert "st.global" not in (tmp_path / "host_call.ptx").read_text()


# --- on a GPU: the same steps on both devices ------------------------------------------

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
MODES = [(master, state_dtype) for master in ("fp32", "none", "kahan", "stochastic", "remainder")
         for state_dtype in (torch.float32, BF16, E4M3)]
SHAPES = ((64, 64), (37,), (5, 3))


def twins(dtype, devices=("cpu", "cuda")):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]
    # (a copy per device: v.to("cpu") would be v itself, and its twin then a non-leaf)
    return [[v.to(device, copy=True).requires_grad_() for v in values] for device in devices]


def test_the_twins_are_leaves_an_optimizer_takes():
    """(On the CPU, with "meta" for the GPU: the H200 run of 2026-11-28 found the CUDA
    twins non-leaf tensors, which every optimizer refuses.)"""
    for params in twins(BF16, ("cpu", "meta")):
        assert all(p.is_leaf and p.requires_grad for p in params)
        optim.AdamW(params)


def feed(both, step):
    gen = torch.Generator().manual_seed(100 + step)
    for i in range(len(SHAPES)):
        grad = torch.randn(both[0][i].shape, generator=gen).to(both[0][i].dtype) * 1024
        if step == 2 and i == 1:
            grad.view(-1)[:1].fill_(float("inf"))  # an overflow step, skipped on both
        for params in both:
            params[i].grad = grad.to(params[i].device)


def step_both(make, both, steps=4):
    opts = [make(params) for params in both]
    for step in range(steps):
        feed(both, step)
        for opt, params in zip(opts, both):
            opt.grad_scale = torch.full((), 1024.0, device=params[0].device)
            opt.found_inf = torch.zeros(1, device=params[0].device)
            grads.check_finite_([p.grad for p in params], opt.found_inf)
            opt.step()
    for (p_cpu, p_cuda) in zip(*both):
        assert_bitwise_equal(p_cuda.detach().cpu(), p_cpu.detach(), "param")
        cpu_state, cuda_state = opts[0].state[p_cpu], opts[1].state[p_cuda]
        assert cpu_state.keys() == cuda_state.keys()
        for key, value in cpu_state.items():
            assert_bitwise_equal(cuda_state[key].cpu(), value, key)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")


@pytest.mark.parametrize("cls, kwargs", [(optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
                                         (optim.Adam, dict(lr=1e-3, weight_decay=0.01)),
                                         (optim.SGD, dict(lr=0.01, momentum=0.9,
                                                          nesterov=True))],
                         ids=["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("master, state_dtype", MODES,
                         ids=[f"{m}-{str(d)[6:]}" for m, d in MODES])
def test_cuda_steps_give_the_cpu_bits(cuda, cls, kwargs, master, state_dtype):
    seed = 5 if master == "stochastic" or state_dtype == E4M3 else None
    step_both(lambda ps: cls(ps, master=master, state_dtype=state_dtype, seed=seed, **kwargs),
              twins(BF16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("name", ["AdamW-amsgrad-maximize", "Adagrad", "SGD-dampening"])
def test_cuda_steps_give_the_cpu_bits_in_other_options(cuda, name, dtype):
    make = {"AdamW-amsgrad-maximize": lambda ps: optim.AdamW(ps, lr=1e-3, amsgrad=True,
                                                             maximize=True),
            "Adagrad": lambda ps: mixedprec.FusedAdagrad(ps, lr=0.01, weight_decay=0.1,
                                                         master_weights=True),
            "SGD-dampening": lambda ps: optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.5,
                                                  weight_decay=0.1)}[name]
    step_both(make, twins(dtype))
