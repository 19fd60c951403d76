"""A whole training step (forward, scaled backward, GradScaler step and update,
zero_grad) compiled with ``torch.compile`` against the same step run eagerly, for
mixedprec's ``GradScaler`` + ``optim.AdamW`` and for torch's ``GradScaler`` +
``AdamW(fused=True)`` (issue 31, part 7), interleaved in one process, medians.

Reported per stack: the median step time eager and compiled and their ratio
(eager / compiled: > 1, the compiled step is faster), and ``torch._dynamo.explain``'s
graph and graph-break counts of the step (compiled without ``fullgraph``;
tests/python/scaler/test_grad_scaler.py checks that mixedprec's are no more than
torch's). The model is an MLP (``--width``, ``--depth``, ``--batch``); on a GPU its
forward runs under fp16 autocast, on the CPU in fp32 (the scaler then still scales,
unscales and checks every step). The compile happens before the timing.

    python bench/compile_step.py                      # CPU: width 256, depth 4, 1 thread
    python bench/compile_step.py --device cuda --width 2048 --batch 256
    python bench/compile_step.py --backend eager --reps 10 --json out.json
"""
import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.ensure_importable()
import mixedprec  # noqa: E402

STACKS = ("torch", "mixedprec")


def build(stack: str, args, device: torch.device) -> Callable[[], Any]:
    """The stack's training step over its own model (the same seed for both stacks)."""
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)
    if stack == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler(device.type)
    else:
        opt = mixedprec.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = mixedprec.GradScaler(device.type)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    amp = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def timed(fn: Callable[[], Any], device: torch.device, inner: int) -> float:
    """Milliseconds per call over ``inner`` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / inner


def measure(args, device: torch.device) -> Dict[str, Any]:
    cases: Dict[str, Callable[[], Any]] = {}
    counts: Dict[str, Dict[str, int]] = {}
    for stack in STACKS:
        eager = build(stack, args, device)
        eager()
        torch._dynamo.reset()
        explain_step = build(stack, args, device)
        explain_step()
        explained = torch._dynamo.explain(explain_step)()
        counts[stack] = dict(graphs=explained.graph_count,
                             breaks=explained.graph_break_count)
        torch._dynamo.reset()
        compiled = torch.compile(build(stack, args, device), backend=args.backend)
        t0 = time.perf_counter()
        for _ in range(3):  # compiles (and recompiles once the state exists)
            compiled()
        counts[stack]["compile_s"] = round(time.perf_counter() - t0, 1)
        cases[f"{stack} eager"], cases[f"{stack} compiled"] = eager, compiled
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for name, fn in cases.items():  # warm-up
        timed(fn, device, args.inner)
    for _ in range(args.reps):
        order = list(cases)
        random.shuffle(order)
        for name in order:
            times[name].append(timed(cases[name], device, args.inner))
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for stack in STACKS:
        eager_ms, compiled_ms = medians[f"{stack} eager"], medians[f"{stack} compiled"]
        rows.append(dict(stack=stack, eager_ms=eager_ms, compiled_ms=compiled_ms,
                         speedup=eager_ms / compiled_ms, **counts[stack]))
    return dict(rows=rows, times=times)


def markdown(data: Dict[str, Any]) -> str:
    cfg = data["config"]
    lines = [f"# A training step compiled against eager ({cfg['device']})", ""]
    lines += common.env_lines(data["env"], smoke=False)
    lines += ["", f"MLP width {cfg['width']}, depth {cfg['depth']}, batch {cfg['batch']}; "
              f"backend {cfg['backend']}; {cfg['reps']} repetitions of {cfg['inner']} steps, "
              f"interleaved; medians; {cfg['threads']} thread(s)", ""]
    header = ["stack", "eager ms", "compiled ms", "eager / compiled", "graphs", "breaks",
              "compile s"]
    rows = [[r["stack"], common.fmt(r["eager_ms"], 3), common.fmt(r["compiled_ms"], 3),
             f"{r['speedup']:.2f}x", r["graphs"], r["breaks"], r["compile_s"]]
            for r in data["rows"]]
    lines += common.md_table(header, rows)
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5, help="steps per timing")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads")
    ap.add_argument("--json", help="also write the numbers here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    data = measure(args, device)
    data["env"] = common.environment(device)
    data["config"] = dict(vars(args), device=str(device), threads=torch.get_num_threads())
    print(markdown(data), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
