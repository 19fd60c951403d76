"""The host's time per optimizer step (issue 30, part 5): mixedprec's FusedSGD, FusedAdam,
optim.SGD and optim.AdamW against torch's SGD(fused=True) and AdamW(fused=True), on
ResNet-50's parameter count (161 tensors), interleaved in one process, medians.

ResNet-50's device work per step is small (~0.1-0.2 ms on an H200), so what a step costs
the host decides its latency: Python outside the op call, the op's argument parsing and
checks, and the launches. Two ways to leave the kernels' work out, both run by default:

* ``real``: the 161 tensors hold one element each; the ops run. On a CPU the kernels'
  work on 161 elements is in the time (a few microseconds per list); on a GPU they
  are queued, and the time is the host's.
* ``noop``: the fused op itself replaced by a no-op (``mixedprec.ops.fused_sgd_`` and
  ``fused_adam_``, ``torch._fused_sgd_`` and ``torch._fused_adamw_``): the Python
  around the op only; the op call's argument parsing and checks are left out too.

Each step is driven as a GradScaler drives it: ``grad_scale`` and ``found_inf`` set
(``--no-scaler``: neither), no check pass (the step alone). mixedprec's cases on fp16
parameters keep fp32 masters (apex O2: ``master_weights=True``, or ``master="fp32"``,
the torch-named optimizers' default); torch's run on fp32 parameters, as torch's fused
optimizers are used with AMP. Momentum 0.9 for SGD.

Each repetition runs every case once, in a fresh order, each ``--inner`` steps timed
together (the mean per step); the report is the median over repetitions per case and
``vs torch``: torch's median over the case's (> 1: mixedprec's step costs the host
less; target 1.3). ``ops/step`` counts the device ops a planned step dispatches on fake
CUDA tensors (each about one kernel launch; views and allocations left out; a fused
op counted once whatever its launches), as tests/python/optim/test_step_ops.py pins.
On a GPU ``latency`` is also reported: one step from an idle device, synchronised.

    python bench/host_step.py                        # 1 thread, both modes, 60 reps
    python bench/host_step.py --modes noop --reps 200 --json out.json
    python bench/host_step.py --device cuda          # on a GPU: host time and latency

To compare two versions of the Python package, run the script once per version (with
PYTHONPATH pointing at a copy of the package), alternating, and compare each run's
``vs torch``.
"""
import argparse
import contextlib
import json
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.ensure_importable()
import mixedprec  # noqa: E402
from mixedprec import ops as mp_ops  # noqa: E402
from mixedprec import optim as mp_optim  # noqa: E402

TARGET = 1.3
LR, MOMENTUM = 1e-3, 0.9

# name -> (builder(params), parameter dtype, torch counterpart)
CASES = {
    "FusedSGD fp16+masters": (
        lambda ps: mixedprec.FusedSGD(ps, lr=LR, momentum=MOMENTUM, master_weights=True),
        torch.float16, "torch SGD"),
    "FusedSGD fp32": (
        lambda ps: mixedprec.FusedSGD(ps, lr=LR, momentum=MOMENTUM), torch.float32,
        "torch SGD"),
    "FusedAdam fp16+masters": (
        lambda ps: mixedprec.FusedAdam(ps, lr=LR, master_weights=True), torch.float16,
        "torch AdamW"),
    "FusedAdam fp32": (lambda ps: mixedprec.FusedAdam(ps, lr=LR), torch.float32,
                        "torch AdamW"),
    "optim.SGD fp16+masters": (
        lambda ps: mp_optim.SGD(ps, lr=LR, momentum=MOMENTUM), torch.float16, "torch SGD"),
    "optim.SGD fp32": (lambda ps: mp_optim.SGD(ps, lr=LR, momentum=MOMENTUM), torch.float32,
                        "torch SGD"),
    "optim.AdamW fp16+masters": (lambda ps: mp_optim.AdamW(ps, lr=LR), torch.float16,
                                         "torch AdamW"),
    "optim.AdamW fp32": (lambda ps: mp_optim.AdamW(ps, lr=LR), torch.float32, "torch AdamW"),
    "torch SGD": (lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, fused=True),
                  torch.float32, None),
    "torch AdamW": (lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True), torch.float32, None),
}

# The fused ops a "noop" run replaces (module, attribute).
_OPS = ((mp_ops, "fused_sgd_"), (mp_ops, "fused_adam_"), (torch, "_fused_sgd_"),
        (torch, "_fused_adamw_"))
#: ResNet-50's number of parameter tensors (bench/ops.py's list; test_bench_smoke checks).
RESNET50_TENSORS = 161


def make(name: str, count: int, device: torch.device, scaler: bool):
    """(optimizer, step()) for case ``name`` over ``count`` one-element parameters, after
    the steps that make state and plans."""
    build, dtype, _ = CASES[name]
    params = [torch.nn.Parameter(torch.randn(1, device=device).to(dtype)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = build(params)
    scale = torch.full((), 2.0, device=device)
    found_inf = torch.zeros((), device=device)

    def step():
        if scaler:
            opt.grad_scale, opt.found_inf = scale, found_inf
        opt.step()
    for _ in range(3):
        step()
    return opt, step


@contextlib.contextmanager
def noop_ops():
    """The fused ops of both libraries replaced by a no-op."""
    saved = [(module, name, getattr(module, name)) for module, name in _OPS]
    try:
        for module, name, _ in saved:
            setattr(module, name, lambda *args, **kwargs: None)
        yield
    finally:
        for module, name, op in saved:
            setattr(module, name, op)


def count_ops(name: str, count: int, scaler: bool) -> int:
    """The device ops a planned step of case ``name`` dispatches on fake CUDA tensors
    (common.DeviceOps: each about one kernel launch, views and allocations left out)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeTensorMode():
            counter = common.DeviceOps()
            with counter:
                _, step = make(name, count, torch.device("cuda"), scaler)
                counter.ops.clear()
                step()
    return len(counter.ops)


def run(names, count: int, device: torch.device, scaler: bool, mode: str, reps: int,
        inner: int, clock=time.perf_counter, seed: int = 0):
    """{name: {"host_us": [...], "latency_us": [...]}} over ``reps`` interleaved
    repetitions, host times by ``clock``."""
    cuda = device.type == "cuda"
    steps = {name: make(name, count, device, scaler)[1] for name in names}
    times = {name: {"host_us": [], "latency_us": []} for name in names}
    order = list(names)
    rng = random.Random(seed)
    with noop_ops() if mode == "noop" else contextlib.nullcontext():
        for name in order:  # warm-up in this mode
            for _ in range(inner):
                steps[name]()
        for _ in range(reps):
            rng.shuffle(order)
            for name in order:
                step = steps[name]
                if cuda:
                    torch.cuda.synchronize(device)
                t0, c0 = time.perf_counter(), clock()
                for _ in range(inner):
                    step()
                times[name]["host_us"].append((clock() - c0) * 1e6 / inner)
                if cuda:
                    torch.cuda.synchronize(device)
                    times[name]["latency_us"].append((time.perf_counter() - t0) * 1e6 / inner)
    return times


def _summary(times_us):
    """common.summary's statistics (in ms), or None for no times."""
    return common.summary([t / 1e3 for t in times_us]) if times_us else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--modes", default="real,noop", help="real, noop or both (default)")
    ap.add_argument("--cases", default=",".join(n for n in CASES if not n.startswith("torch")),
                    help="mixedprec cases, comma-separated (their torch counterparts run too)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--inner", type=int, help="steps per timing (default: 10 on a CPU, "
                    "1 on a GPU, where the latency is one step's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tensors", type=int, help="parameter tensors (default: ResNet-50's 161)")
    ap.add_argument("--no-scaler", action="store_true",
                    help="steps without grad_scale/found_inf")
    ap.add_argument("--no-count", action="store_true", help="skip the fake-CUDA op counts")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="host time by the wall clock (default) or by this thread's CPU "
                    "time (time.thread_time: steadier on a loaded machine, where the "
                    "process is descheduled)")
    ap.add_argument("--label", default="", help="a name for this run, in the output")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = common.pick_device(args.device)
    inner = args.inner or (1 if device.type == "cuda" else 10)
    count = args.tensors or RESNET50_TENSORS
    scaler = not args.no_scaler
    mine = [n.strip() for n in args.cases.split(",") if n.strip()]
    for name in mine:
        if name not in CASES or CASES[name][2] is None:
            raise SystemExit(f"unknown case {name!r}; choose from "
                             f"{', '.join(n for n in CASES if CASES[n][2])}")
    names = mine + sorted({CASES[n][2] for n in mine})
    env = common.environment(device)
    env.update(label=args.label, tensors=count, scaler=scaler, inner=inner, reps=args.reps,
               clock=args.clock)
    counts = {} if args.no_count else {n: count_ops(n, count, scaler) for n in names}
    results = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in ("real", "noop"):
            raise SystemExit(f"unknown mode {mode!r}; choose real, noop")
        results[mode] = run(names, count, device, scaler, mode, args.reps, inner,
                            time.thread_time if args.clock == "thread" else time.perf_counter)

    print(f"# Host time per optimizer step {args.label}".rstrip())
    print()
    print("\n".join(common.env_lines(env, smoke=False)))
    print(f"- {env['device']}, {count} parameter tensors of one element, "
          f"{'GradScaler-driven (grad_scale, found_inf)' if scaler else 'no scaler'}, "
          f"median of {args.reps} interleaved repetitions of {inner} step(s), "
          f"{'thread CPU time' if args.clock == 'thread' else 'wall clock'}")
    out = {"environment": env, "target": TARGET, "ops_per_step": counts, "modes": {}}
    for mode, times in results.items():
        med = {n: statistics.median(t["host_us"]) for n, t in times.items()}
        lat = {n: statistics.median(t["latency_us"]) for n, t in times.items()
               if t["latency_us"]}
        rows = []
        for name in names:
            ref = CASES[name][2]
            ratio = med[ref] / med[name] if ref else None
            row = [name, common.fmt(med[name], 1)]
            if lat:
                row.append(common.fmt(lat[name], 1))
            row += [common.fmt(ratio) if ratio else "", counts.get(name, ""),
                    common.verdict(ratio >= TARGET) if ratio else ""]
            rows.append(row)
        header = ["step", "host us"] + (["latency us"] if lat else []) + \
            ["vs torch", "ops/step", f">= {TARGET}x"]
        print()
        print(f"## {mode}: " + ("one-element tensors, the ops run" if mode == "real" else
                                "the fused ops replaced by a no-op (Python only)"))
        print()
        print("\n".join(common.md_table(header, rows)))
        out["modes"][mode] = {n: {"host": _summary(t["host_us"]),
                                  "latency": _summary(t["latency_us"]),
                                  "vs_torch": (med[CASES[n][2]] / med[n]) if CASES[n][2]
                                  else None}
                              for n, t in times.items()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
