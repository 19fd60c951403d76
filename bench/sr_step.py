"""One FusedAdam step on bf16 params with master='none', 'stochastic', 'kahan', 'fp32'
and 'remainder', beside torch.optim.AdamW(fused=True) on fp32 and on bf16 params, on
the CPU, interleaved in one process (issue #11: what stochastic rounding's Philox bits
cost the CPU engine; issue #20: what exact masters in 2 bytes cost).

Cases: 4M bf16 elements as one tensor and as 100 tensors (the same total). Each
repetition runs every (case, mode) once, in a fresh order, and times one step with
the wall clock; the report is the median per (case, mode), its ratio to 'none', and
min/max. Prints a Markdown table and, with --json, writes the numbers.

    python bench/sr_step.py                    # 2 threads, 4M elements, 30 reps
    python bench/sr_step.py --threads 1 --reps 50 --json out.json

To compare two builds of the extension, run the script once per build (for example
with PYTHONPATH pointing at a copy of the package with the other .so), alternating.
"""
import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.ensure_importable()
from mixedprec.optimizers import FusedAdam  # noqa: E402

MODES = ("none", "stochastic", "kahan", "fp32", "remainder", "torch-fused-fp32",
         "torch-fused-bf16")


def make_case(numel: int, tensors: int, mode: str, seed: int = 0):
    """An optimizer over `tensors` bf16 params of `numel` elements in all, with grads."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    dtype = torch.float32 if mode == "torch-fused-fp32" else torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
    if mode.startswith("torch-fused"):
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    else:
        kwargs = {"seed": 1} if mode == "stochastic" else {}
        opt = FusedAdam(params, lr=1e-3, weight_decay=0.01, master=mode, **kwargs)
    opt.step()  # state creation outside the timing
    return opt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--tensors", type=int, nargs="+", default=[1, 100])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--label", default="", help="a name for this build, in the output")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    opts = {(t, m): make_case(args.numel, t, m) for t in args.tensors for m in MODES}
    times = {k: [] for k in opts}
    keys = list(opts)
    rng = random.Random(0)
    for _ in range(3):  # warm-up
        for k in keys:
            opts[k].step()
    for _ in range(args.reps):
        rng.shuffle(keys)
        for k in keys:
            t0 = time.perf_counter()
            opts[k].step()
            times[k].append((time.perf_counter() - t0) * 1e3)
    env = {"cpu_model": common.cpu_model(), "cpu_flags": common.cpu_flags(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "threads": args.threads, "torch": torch.__version__, "label": args.label}
    print(f"# {args.label} {env['cpu_model']}, {env['cpu_capability']}, "
          f"{args.threads} threads, torch {env['torch']}, {args.reps} reps")
    print("| elements x tensors | mode | median ms | / none | min ms | max ms |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for t in args.tensors:
        base = statistics.median(times[(t, "none")])
        for m in MODES:
            ts = times[(t, m)]
            med = statistics.median(ts)
            rows.append({"tensors": t, "mode": m, "median_ms": med, "ratio": med / base,
                         "min_ms": min(ts), "max_ms": max(ts)})
            print(f"| {args.numel} x {t} | {m} | {med:.2f} | {med / base:.2f} | "
                  f"{min(ts):.2f} | {max(ts):.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"env": env, "numel": args.numel, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
