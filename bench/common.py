"""Shared helpers of the mixedprec benchmarks (``bench/ops.py``, ``bench/train.py``).

* :func:`environment` -- date, device, driver, torch/CUDA/cuDNN versions for the
  result files;
* :class:`Timer` -- median time of a callable: CUDA events on a GPU (warm-up, many
  repetitions, the stream held back while the work is queued so that the events
  measure device time, the L2 cache flushed before each repetition), wall clock on
  the CPU;
* :func:`storage_bytes` -- the bytes a tensor's storage holds (the optimizer benchmarks'
  bytes per parameter and per step);
* output helpers: result directory, device slug, JSON and markdown writing.

Run as a script (``python bench/common.py``, as ``scripts/gpu_check.sh`` does for
every ``bench/*.py``), it prints the environment and exits.
"""

import contextlib
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SMOKE_DIR = RESULTS / "cpu-smoke"


def ensure_importable() -> None:
    """Makes ``import mixedprec`` work when a script is run from a checkout whose
    extension was built in place but which is not on ``sys.path``."""
    try:
        import mixedprec  # noqa: F401
    except ImportError:
        if str(ROOT) not in sys.path:
            sys.path.append(str(ROOT))


# --- environment --------------------------------------------------------------------

def _nvidia_smi(query: str) -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    lines = [line.strip() for line in out.strip().splitlines() if line.strip()]
    return lines[index] if index < len(lines) else (lines[0] if lines else None)


def environment(device: torch.device) -> Dict[str, Any]:
    """What the result files record about the machine and the software."""
    env: Dict[str, Any] = {
        # Milliseconds: the date names the run (bench/lean.py's --merge tells runs apart
        # by it), and a quick run can take less than a second.
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import mixedprec
        env["mixedprec"] = mixedprec.__version__
    except ImportError as e:  # reported, not fatal here
        env["mixedprec"] = f"not importable: {e}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            driver=_nvidia_smi("driver_version"),
            clocks=_nvidia_smi("clocks.sm,clocks.mem,clocks.max.sm,power.limit"),
        )
    else:
        env.update(device=f"CPU ({cpu_model() or env['host_cpu']}, "
                          f"{env['cpu_threads']} threads)",
                   driver=_nvidia_smi("driver_version"))
    env.update(cpu_model=cpu_model(), cpu_count=os.cpu_count(), cpu_flags=cpu_flags(),
               cpu_capability=torch.backends.cpu.get_cpu_capability())
    return env


def cpu_model() -> Optional[str]:
    """The CPU's model name (Linux: /proc/cpuinfo), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> List[str]:
    """The vector-extension flags of the CPU (Linux: /proc/cpuinfo) that the kernels
    may use."""
    wanted = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
              "avx512dq", "avx512_bf16", "avx512vbmi", "avx512_fp16", "amx_bf16")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def device_slug(env: Dict[str, Any]) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; 'cpu' on the CPU."""
    if env.get("device_type") != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-") or "gpu"


def pick_device(name: Optional[str]) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def out_dir(arg: Optional[str], smoke: bool) -> Path:
    """--out, else bench/results (a GPU run) or bench/results/cpu-smoke (a smoke run,
    kept apart so that it never reads as a result)."""
    path = Path(arg) if arg else (SMOKE_DIR if smoke else RESULTS)
    path.mkdir(parents=True, exist_ok=True)
    return path


def copy_out(paths: Sequence[Path], explicit_out: bool, smoke: bool) -> Optional[Path]:
    """On the GPU machine, scripts/gpu_check.sh keeps its log in ``$OUT``, the folder
    that comes back from that machine; a GPU run without ``--out`` also copies its
    result files to ``$OUT/bench/`` so that they come back with the log. Returns the
    folder, or None when nothing was copied."""
    target = os.environ.get("OUT")
    if explicit_out or smoke or not target:
        return None
    import shutil
    dest = Path(target) / "bench"
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for p in paths:
            if p.exists():
                shutil.copy2(p, dest / p.name)
    except OSError as e:
        print(f"could not copy the results to {dest}: {e}", file=sys.stderr)
        return None
    return dest


def write_json(path: Path, data: Dict[str, Any]) -> None:
    def default(o):
        if isinstance(o, (torch.dtype, torch.device, Path)):
            return str(o)
        raise TypeError(f"not JSON serialisable: {type(o).__name__}")

    def clean(o):  # NaN/inf are not JSON
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    path.write_text(json.dumps(clean(data), indent=2, default=default) + "\n")


def env_lines(env: Dict[str, Any], smoke: bool) -> List[str]:
    """The header lines of a markdown report."""
    lines = []
    if smoke:
        lines += ["> **CPU smoke run**: checks that the benchmark runs end to end. "
                  "These numbers are not results.", ""]
    lines += [
        f"- date: {env['date']}",
        f"- device: {env['device']}" + (f" (capability {env['capability']}, "
                                        f"{env['multiprocessors']} SMs, "
                                        f"{env['memory_gib']} GiB)" if "capability" in env else ""),
        f"- driver: {env.get('driver') or 'n/a'}",
        f"- torch {env['torch']} (built for CUDA {env['cuda'] or 'n/a'}), "
        f"cuDNN {env['cudnn'] or 'n/a'}, "
        f"Python {env['python']}, mixedprec {env['mixedprec']}",
    ]
    if env.get("clocks"):
        lines.append(f"- clocks at start (SM, memory, max SM, power limit): {env['clocks']}")
    return lines


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
             align: Optional[str] = None) -> List[str]:
    """A markdown table; ``align`` one letter per column (l or r), right by default
    except the first column, as in the seeds' tables."""
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["-" * max(3, len(str(h))) for h in header]
    sep = [(":" + s[1:]) if a == "l" else (s[:-1] + ":") for s, a in zip(sep, align)]
    out = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join(sep) + "|"]
    out += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return out


def fmt(value: Optional[float], digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("pass" if ok else "miss")


# --- device ops a step dispatches ---------------------------------------------------

# Dispatched ops that launch no kernel: views, allocations, metadata, profiler marks.
NO_KERNEL = frozenset({
    "view", "_reshape_alias", "reshape", "alias", "detach", "as_strided", "_unsafe_view",
    "squeeze", "unsqueeze", "t", "empty", "empty_like", "empty_strided", "device", "dim",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous",
    "_record_function_enter_new", "_record_function_exit"})


class DeviceOps(TorchDispatchMode):
    """Records (``ops``) the ops dispatched with a tensor on a CUDA device, each about
    one kernel launch, views and allocations left out; run over fake CUDA tensors
    (bench/host_step.py, tests/python/optim/test_step_ops.py). An op without a fake
    kernel (torch._fused_sgd_) is recorded and not run."""

    def __init__(self):
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = list(args) + list(kwargs.values())
        tensors = [t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(t, torch.Tensor)]
        device = kwargs.get("device")
        on_device = device is not None and torch.device(device).type == "cuda"
        if (on_device or any(t.device.type == "cuda" for t in tensors)) and \
                name not in NO_KERNEL:
            self.ops.append(name)
        if name == "_fused_sgd_":
            return None
        return func(*args, **kwargs)


# --- timing -----------------------------------------------------------------------

def summary(times_ms: Sequence[float]) -> Dict[str, float]:
    ts = sorted(times_ms)
    q = lambda f: ts[min(len(ts) - 1, int(f * (len(ts) - 1) + 0.5))]  # noqa: E731
    return {"median_ms": statistics.median(ts), "min_ms": ts[0], "p20_ms": q(0.2),
            "p80_ms": q(0.8), "max_ms": ts[-1], "reps": len(ts)}


class Timer:
    """Times ``fn(i)`` (i: the repetition index) on ``device``.

    CUDA: after ``warmup`` calls, each repetition runs as: hold the stream with
    ``torch.cuda._sleep`` (long enough for the host to queue the rest), zero a
    buffer larger than the L2 cache (so no repetition reads the last one's data from
    the cache), record a start event, ``fn(i)``, record an end event. The events then
    measure the device time of ``fn`` (launch gaps included only where the host
    cannot keep up with the device). Repetitions: enough for ``target_s`` seconds of
    timed work, between ``min_reps`` and ``max_reps``. Also measures the latency of
    one call from an idle device (host time, synchronised), which includes Python
    and launch overhead.

    CPU: wall clock (``time.perf_counter``) around each call.
    """

    def __init__(self, device: torch.device, warmup: int = 5, min_reps: int = 20,
                 max_reps: int = 200, target_s: float = 0.4, latency_reps: int = 10):
        self.device = device
        self.warmup = warmup
        self.min_reps = min_reps
        self.max_reps = max_reps
        self.target_s = target_s
        self.latency_reps = latency_reps
        self.cuda = device.type == "cuda"
        self._flush = None
        self._cycles_per_ms = None
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 2**26
            self._flush = torch.empty(max(4 * l2, 2**28) // 4, dtype=torch.int32, device=device)
            self._cycles_per_ms = self._calibrate_sleep()

    def _calibrate_sleep(self) -> float:
        cycles = 20_000_000
        torch.cuda._sleep(cycles)  # first call loads the kernel
        torch.cuda.synchronize(self.device)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(start.elapsed_time(end), 1e-3)

    def __call__(self, fn: Callable[[int], Any]) -> Dict[str, float]:
        if not self.cuda:
            for i in range(self.warmup):
                fn(i)
            times = []
            for i in range(self.min_reps):
                t0 = time.perf_counter()
                fn(self.warmup + i)
                times.append((time.perf_counter() - t0) * 1e3)
            return summary(times)

        sync = lambda: torch.cuda.synchronize(self.device)  # noqa: E731
        i = 0
        host_s = 0.0
        for _ in range(max(1, self.warmup)):
            sync()
            t0 = time.perf_counter()
            fn(i)
            host_s = time.perf_counter() - t0  # time to queue one call (last warm-up)
            i += 1
        sync()
        # Latency of one call from an idle device: what a caller waits for.
        lat = []
        for _ in range(self.latency_reps):
            sync()
            t0 = time.perf_counter()
            fn(i)
            sync()
            lat.append((time.perf_counter() - t0) * 1e3)
            i += 1
        est_ms = statistics.median(lat)
        reps = int(min(self.max_reps, max(self.min_reps, self.target_s * 1e3 / max(est_ms, 1e-3))))
        hold_ms = min(50.0, max(0.2, 3.0 * host_s * 1e3))
        hold = int(hold_ms * self._cycles_per_ms)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for start, end in events:
            torch.cuda._sleep(hold)
            self._flush.zero_()
            start.record()
            fn(i)
            end.record()
            i += 1
        sync()
        out = summary([s.elapsed_time(e) for s, e in events])
        out["latency_ms"] = statistics.median(lat)
        out["hold_ms"] = hold_ms
        return out


def storage_bytes(t: Any, seen: set) -> int:
    """The bytes ``t`` really holds. A wrapper subclass (torchao's 8-bit state: uint8
    codes, fp32 block scales and a 256-entry code map behind a tensor that shows the
    parameter's dtype) by its inner tensors (``__tensor_flatten__``); a plain tensor by
    ``untyped_storage().nbytes()``, each storage once (``seen``: bitsandbytes' code maps
    are one tensor shared by every parameter's state). Not a tensor: 0."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not isinstance(t, torch.Tensor):
        return 0
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(storage_bytes(getattr(t, n), seen) for n in names)
    storage = t.untyped_storage()
    if storage.data_ptr() in seen:
        return 0
    seen.add(storage.data_ptr())
    return storage.nbytes()


def free_memory() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def collecting_only_new_objects():
    """For the block, the garbage collector leaves alone the objects alive at its start
    (gc.freeze: the imported modules, most of the heap), so that free_memory's collection
    walks only what the benchmark made since: each took 0.16 s of a CPU smoke run of
    bench/ops.py, 75 of them 12 of its 16 s, and more inside pytest's process."""
    import gc
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the environment the benchmarks would record."""
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    args = parser.parse_args(argv)
    ensure_importable()
    env = environment(pick_device(args.device))
    print(json.dumps(env, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
