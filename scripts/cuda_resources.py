"""The CUDA kernels' resources as ptxas reports them, and the gate on them.

The extension's nvcc flags include --resource-usage (setup.py's NVCC_FLAGS), so each
kernel's registers, stack frame and spills are printed while it compiles; `make build`
keeps the build's output in build/ext-build.log and runs

    python scripts/cuda_resources.py build/ext-build.log build/cuda-resources.json

which writes one record per kernel and architecture, with the .cu file it came from
(the records of the files a build did not recompile are kept from the file's previous
content), and prints the gate's findings. tests/python/ops/test_cuda_resources.py
checks the same gate in `make test`:

* no kernel spills (spill stores or loads);
* no multi-tensor kernel (csrc/cuda/multi_tensor_apply.cuh's pointwise_kernel: every
  optimizer and list op) keeps a stack frame (local memory, each access a trip to
  memory beside the data's own) of more than 8 bytes: ptxas gives some kernels an
  8-byte frame for the subroutine of IEEE division's slow path (the return address;
  taken for operands at the ends of float's range only: 2 Adagrad kernels on sm_80,
  gone with -prec-div=false), which the rule lets through;
* registers within the launch bound: 65536 / 512 = 128 per thread, one 512-thread
  block per SM (docs/gpu-validation.md, "Registers and occupancy", says why that is
  enough bytes in flight);
* the blocks of 512 threads an SM holds at once, from the registers (blocks_per_sm), as
  recorded: every kernel of the functors without fixed modes at least its functor's
  floor (GENERIC_FLOOR), and every Fixed kernel (a mode of AdamW or SGD, and its
  counting kernel) at one block exactly where ONE_BLOCK lists its mode, else at two or
  more. A register count that halves a kernel's blocks changes no result and no test
  of the CPU machines: the H200 of 2026-11-29 found the generic SGD kernel at one
  block (72 registers) where it had had two, and 86% of the copy where it had had 95%.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List

SOURCE = re.compile(r"nvcc\S*\s(?:.*\s)?-c\s+(\S+\.cu)\b")
ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(\S+)' for '(\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
REGISTERS_PER_SM = 65536
BLOCK_THREADS = 512  # kBlockSize (csrc/cuda/multi_tensor_block.cuh)
# the multi-tensor kernels' __launch_bounds__(kBlockSize): one block per SM
MAX_REGISTERS = REGISTERS_PER_SM // BLOCK_THREADS
MAX_STACK = 8  # bytes: a subroutine's return address (see the module docstring)


def parse(lines: Iterable[str]) -> List[Dict]:
    """One record per kernel entry: name (mangled), arch, registers, stack, spill
    stores and loads, and source (the .cu file of the nvcc command before it), from
    ptxas's --resource-usage lines in order."""
    records: List[Dict] = []
    current = None
    source = None
    for line in lines:
        command = SOURCE.search(line)
        if command:
            source = os.path.basename(command.group(1))
            continue
        entry = ENTRY.search(line)
        if entry:
            current = dict(name=entry.group(1), arch=entry.group(2), registers=None, stack=0,
                           spill_stores=0, spill_loads=0, source=source)
            records.append(current)
            continue
        if current is None:
            continue
        frame = FRAME.search(line)
        if frame and current["registers"] is None:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(
                int, frame.groups())
        used = USED.search(line)
        if used and current["registers"] is None:
            current["registers"] = int(used.group(1))
    demangle(records)
    return records


def demangle(records: List[Dict]) -> None:
    """Adds each record's demangled name (c++filt, when there is one)."""
    tool = shutil.which("c++filt")
    names = [r["name"] for r in records]
    out = names
    if tool and names:
        proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
        if proc.returncode == 0 and len(proc.stdout.splitlines()) == len(names):
            out = proc.stdout.splitlines()
    for record, readable in zip(records, out):
        record["demangled"] = readable


def is_multi_tensor(record: Dict) -> bool:
    return "pointwise_kernel" in record.get("demangled", record["name"])


def blocks_per_sm(registers: int) -> int:
    """Blocks of 512 threads an SM (sm_80, sm_90) holds at once with `registers` a thread:
    registers are given out in units of 8 a thread, and an SM holds 2048 threads."""
    per_thread = -(-max(registers, 1) // 8) * 8
    return min(2048 // BLOCK_THREADS, REGISTERS_PER_SM // (per_thread * BLOCK_THREADS))


# The functors without fixed modes: the fewest blocks per SM any of their kernels may
# take (build of 2026-11-29, 28-56 registers). AdamOp's and SgdOp's generic kernels (the
# uncommon modes: maximize, amsgrad, fp32 gradients of narrower params, SGD without
# momentum) take one.
GENERIC_FLOOR = {"AdagradOp": 2, "NovoGradOp": 2, "LambStage1Op": 2, "LambStage2Op": 4,
                 "ScaleOp": 4, "CheckFiniteOp": 4}
# The Fixed kernels built for one block per SM (csrc/pointwise_adam.h's and
# pointwise_optimizers.h's fixed_min_blocks: at 64 registers ptxas spilled them), as
# (functor, (Model, Kahan, Remainder, Stochastic, Eight), counting); every other Fixed
# kernel holds two blocks or more.
ONE_BLOCK = {
    ("AdamOp", (False, True, False, False, True), False),
    ("AdamOp", (False, False, False, True, True), False),
    ("AdamOp", (False, False, False, True, False), True),
    ("AdamOp", (False, False, False, False, True), True),
    ("AdamOp", (False, True, False, False, True), True),
    ("AdamOp", (False, False, False, True, True), True),
    ("SgdOp", (False, False, False, True, True), False),
    ("SgdOp", (False, False, False, True, True), True),
    ("SgdOp", (False, True, False, False, True), True),
}


def _sass_per_element():
    """scripts/sass_per_element.py, whose kernel_signature reads a pointwise_kernel's
    functor, storage types and fixed mode from its name."""
    path = Path(__file__).with_name("sass_per_element.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernel_signature = _sass_per_element().kernel_signature


def occupancy_findings(record: Dict) -> List[str]:
    """What the occupancy rule (the module docstring) says of one kernel."""
    signature = kernel_signature(record.get("demangled", ""))
    if signature is None or record["registers"] is None:
        return []
    op, _, mode = signature
    blocks = blocks_per_sm(record["registers"])
    name = f"{record['demangled']} ({record['arch']})"
    if mode is None:
        floor = GENERIC_FLOOR.get(op, 1)
        return [] if blocks >= floor else [
            f"{name}: {record['registers']} registers, {blocks} block(s) of 512 threads per "
            f"SM, fewer than its {floor} (GENERIC_FLOOR)"]
    one = (op, tuple(mode[:5]), mode.counting) in ONE_BLOCK
    if (blocks == 1) == one:
        return []
    return [f"{name}: {record['registers']} registers, {blocks} block(s) of 512 threads per "
            f"SM, where ONE_BLOCK says {'one' if one else 'two or more'}"]


def violations(records: List[Dict]) -> List[str]:
    """What the gate refuses, one line per kernel and finding (empty: it passes)."""
    out = []
    for r in records:
        name = f"{r.get('demangled', r['name'])} ({r['arch']})"
        if r["spill_stores"] or r["spill_loads"]:
            out.append(f"{name}: spills {r['spill_stores']} bytes stored, "
                       f"{r['spill_loads']} loaded")
        if is_multi_tensor(r) and r["stack"] > MAX_STACK:
            out.append(f"{name}: {r['stack']} bytes of stack frame (local memory)")
        if is_multi_tensor(r) and (r["registers"] or 0) > MAX_REGISTERS:
            out.append(f"{name}: {r['registers']} registers, over {MAX_REGISTERS}")
        elif is_multi_tensor(r):
            out += occupancy_findings(r)
    return out


def main(argv: List[str]) -> int:
    if len(argv) != 3:
        print("usage: cuda_resources.py BUILD_LOG OUT_JSON", file=sys.stderr)
        return 2
    with open(argv[1], errors="replace") as f:
        records = parse(f)
    if not records:
        print(f"cuda_resources: no ptxas lines in {argv[1]} (nothing CUDA compiled): "
              f"{argv[2]} left as it is")
        return 0
    compiled = {r["source"] for r in records}
    if os.path.exists(argv[2]):
        with open(argv[2]) as f:
            records += [r for r in json.load(f) if r.get("source") not in compiled]
    with open(argv[2], "w") as f:
        json.dump(records, f, indent=1)
    found = violations(records)
    kernels = sum(map(is_multi_tensor, records))
    print(f"cuda_resources: {len(records)} kernels ({kernels} multi-tensor) in {argv[2]}; "
          f"most registers of a multi-tensor kernel: "
          f"{max((r['registers'] or 0) for r in records if is_multi_tensor(r)) if kernels else 0}"
          + (f"; {len(found)} gate findings:" if found else "; the gate passes"))
    for line in found:
        print(f"  {line}")
    return 0  # (the test fails on findings; the build itself goes on)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
