"""The CUDA kernels' resources from ptxas (scripts/cuda_resources.py): no kernel spills,
no multi-tensor kernel keeps a stack frame (local memory), registers within the launch
bound. `make py-test` points MIXEDPREC_CUDA_RESOURCES at what `make build` recorded
(the CUDA build runs on the CPU machines too); without it the gate's test skips. The
gate refuses a planted spill and a planted stack frame, compiled here with nvcc."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import load_script

NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


gate = load_script("scripts/cuda_resources.py")


def test_every_kernel_of_the_build_passes_the_gate():
    path = os.environ.get("MIXEDPREC_CUDA_RESOURCES")
    if not path:
        pytest.skip("no CUDA build recorded here (make py-test sets MIXEDPREC_CUDA_RESOURCES)")
    records = json.loads(Path(path).read_text())
    multi = [r for r in records if gate.is_multi_tensor(r)]
    # (not vacuous: every op's instantiations, 8-bit and stochastic ones among them)
    assert len(multi) >= 100, f"only {len(multi)} multi-tensor kernels recorded in {path}"
    assert any("AdamOp" in r["demangled"] and "E4m3" in r["demangled"] for r in multi)
    assert any("SgdOp" in r["demangled"] and "E4m3" in r["demangled"] for r in multi)
    assert all(r["registers"] is not None for r in records)
    # the occupancy rule reads every multi-tensor kernel's name (none escapes it), and
    # each Fixed mode in ONE_BLOCK is built
    signatures = [gate.kernel_signature(r["demangled"]) for r in multi]
    assert all(signatures)
    built = {(op, tuple(mode[:5]), mode.counting) for op, _, mode in signatures if mode}
    assert gate.ONE_BLOCK <= built
    assert gate.violations(records) == []


def _record(demangled, registers):
    return dict(name=demangled, demangled=demangled, arch="sm_90", registers=registers,
                stack=0, spill_stores=0, spill_loads=0, source="register_optimizers.cu")


ADAGRAD = ("void mixedprec::cuda::pointwise_kernel<mixedprec::AdagradOp, float, float, float, "
           "float>(mixedprec::cuda::TensorListMeta<4>, mixedprec::AdagradOp, float const*, "
           "float*)")


def _sgd_fixed(flags, counting=False):
    mode = ", ".join("true" if f else "false" for f in flags)
    functor = (f"mixedprec::Fixed<mixedprec::SgdOp, mixedprec::LeanMode<mixedprec::SgdOp, "
               f"{mode}>, {'true' if counting else 'false'}>")
    return (f"void mixedprec::cuda::pointwise_kernel<{functor}, c10::BFloat16, c10::BFloat16, "
            f"c10::BFloat16, float, c10::BFloat16, long, c10::BFloat16, unsigned char, "
            f"double>(mixedprec::cuda::TensorListMeta<9>, {functor}, float const*, float*)")


def test_blocks_per_sm_from_the_registers():
    """Registers are given out 8 a thread; an SM holds 65536 of them and 2048 threads."""
    assert [gate.blocks_per_sm(r) for r in (16, 32, 33, 40, 64, 65, 72, 128)] == [
        4, 4, 3, 3, 2, 1, 1, 1]


def test_the_gate_refuses_a_kernel_that_holds_fewer_blocks_than_recorded():
    """What the H200 of 2026-11-29 found on the GPU (the generic SGD kernel from two
    blocks per SM to one, unseen by the tests), refused on the CPU: a kernel of a functor
    without fixed modes under its GENERIC_FLOOR, a Fixed kernel at one block where
    ONE_BLOCK does not say so, and one at two where it does."""
    none_bf16 = (False, False, False, False, False)
    stochastic_8bit = (False, False, False, True, True)
    passing = [_record(ADAGRAD, 44), _record(_sgd_fixed(none_bf16), 63),
               _record(_sgd_fixed(stochastic_8bit), 100),
               _record(_sgd_fixed(stochastic_8bit, counting=True), 113)]
    assert gate.violations(passing) == []
    for planted, words in [(_record(ADAGRAD, 72), "fewer than its 2"),
                           (_record(_sgd_fixed(none_bf16), 72), "ONE_BLOCK says two"),
                           (_record(_sgd_fixed(none_bf16, counting=True), 80),
                            "ONE_BLOCK says two"),
                           (_record(_sgd_fixed(stochastic_8bit), 64), "ONE_BLOCK says one")]:
        (found,) = gate.violations([planted])
        assert words in found and "block(s) of 512 threads per SM" in found, found


PLANTED = r"""
namespace planted {
// Spills: more live values than -maxrregcount allows.
__global__ void spilling_kernel(float* out, const float* in) {
  float a[48];
#pragma unroll
  for (int i = 0; i < 48; ++i) a[i] = in[threadIdx.x + 32 * i];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 48; ++i) s += a[i] * a[(7 * i + 3) % 48];
  out[threadIdx.x] = s;
}
// A stack frame: an array indexed by values known at run time only, in a loop.
__global__ void pointwise_kernel(float* out, const float* in, int k) {
  float a[64];
  for (int i = 0; i < 64; ++i) a[i] = in[threadIdx.x + 32 * i];
  for (int i = 0; i < k; ++i) a[(7 * i + k) & 63] += a[i & 63];
  out[threadIdx.x] = a[k & 63];
}
}
"""


@pytest.mark.skipif(not os.path.exists(NVCC), reason="nvcc is not installed")
def test_the_gate_refuses_a_planted_spill_and_a_planted_stack_frame(tmp_path):
    source = tmp_path / "planted.cu"
    source.write_text(PLANTED)
    proc = subprocess.run([NVCC, "-c", "-arch=sm_90", "--resource-usage", "-maxrregcount=16",
                           str(source), "-o", str(tmp_path / "planted.o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    log = f"[1/1] nvcc -c {source}\n" + proc.stdout + proc.stderr
    records = gate.parse(log.splitlines())
    assert {r["demangled"].split("(")[0] for r in records} == {
        "planted::spilling_kernel", "planted::pointwise_kernel"}
    assert all(r["source"] == "planted.cu" for r in records)
    found = gate.violations(records)
    assert any("spilling_kernel" in line and "spills" in line for line in found), found
    assert any("pointwise_kernel" in line and "stack frame" in line for line in found), found


def test_a_build_that_recompiles_one_file_keeps_the_other_files_records(tmp_path):
    """The records of a .cu file that a build did not recompile stay (ninja rebuilds
    only what changed)."""
    def log(source, name, registers):
        return (f"[1/2] /usr/local/cuda/bin/nvcc -MD -c /x/csrc/cuda/{source} -o y.o\n"
                f"ptxas info    : Compiling entry function '{name}' for 'sm_90'\n"
                f"ptxas info    : Function properties for {name}\n"
                "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                f"ptxas info    : Used {registers} registers, used 0 barriers\n")
    out = tmp_path / "resources.json"
    first = tmp_path / "first.log"
    first.write_text(log("register.cu", "_Z1av", 40) + log("l2norm.cu", "_Z1bv", 30))
    assert gate.main(["cuda_resources.py", str(first), str(out)]) == 0
    second = tmp_path / "second.log"
    second.write_text(log("l2norm.cu", "_Z1bv", 31))
    assert gate.main(["cuda_resources.py", str(second), str(out)]) == 0
    records = {r["name"]: r for r in json.loads(out.read_text())}
    assert records["_Z1av"]["registers"] == 40 and records["_Z1bv"]["registers"] == 31
    nothing = tmp_path / "nothing.log"
    nothing.write_text("ninja: no work to do.\n")
    assert gate.main(["cuda_resources.py", str(nothing), str(out)]) == 0
    assert len(json.loads(out.read_text())) == 2


def test_the_default_build_compiles_both_architectures_from_one_ptx(tmp_path):
    """setup.py's DEFAULT_GENCODE: sm_80 and sm_90 machine code in every CUDA unit, from
    one compute_80 PTX that the extension also carries for later GPUs (one cicc pass a
    unit). A build that fell back to torch's own flags (a PTX and a front-end pass per
    architecture), or lost an architecture, fails here."""
    if os.environ.get("MIXEDPREC_EXPECT_CUDA") != "1":
        pytest.skip("no CUDA build expected here (make py-test sets MIXEDPREC_EXPECT_CUDA)")
    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
        pytest.skip("TORCH_CUDA_ARCH_LIST is set: the build followed it, not the default")
    spe = load_script("scripts/sass_per_element.py")
    tool, so = spe.find_cuobjdump(), spe.default_so()
    if tool is None or so is None:
        pytest.skip("no cuobjdump, or no built extension")
    copy = tmp_path / Path(so).name  # (a build may relink the .so meanwhile)
    shutil.copyfile(so, copy)

    def listed(kind):
        out = subprocess.run([tool, f"--list-{kind}", str(copy)], capture_output=True,
                             text=True, check=True).stdout
        return sorted(line.split(".")[-2] for line in out.splitlines() if line.strip())

    elf, ptx = listed("elf"), listed("ptx")
    units = len(ptx)
    assert units >= 4, ptx  # the CUDA units (csrc/cuda/*.cu), each with kernels
    assert elf == ["sm_80"] * units + ["sm_90"] * units
    assert ptx == ["sm_80"] * units  # (cuobjdump names a PTX by its virtual architecture)
