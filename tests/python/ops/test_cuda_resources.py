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
    assert gate.violations(records) == []


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
