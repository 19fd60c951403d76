"""CPU speed of one optimizer step in every lean mode of mixedprec's AdamW against
``torch.optim.AdamW(fused=True)`` on fp32 parameters (issue #20, part 5).

Modes are named ``MASTER[+STATE]``: MASTER is mixedprec's ``master`` option on bf16
parameters (``fp32``, ``none``, ``kahan``, ``stochastic``, ``remainder``), STATE the
moments' dtype, a key of ``STATE_DTYPES`` (``fp32`` when left out, ``bf16``); a mode
ending in ``+report`` (``none+bf16+report``) is the same with ``precision_report=True``,
in ``+reportN`` with ``precision_report=N`` (every N-th step)
(mixedprec.optim.precision_report: its cost beside the plain mode). A dtype
added to ``STATE_DTYPES`` (``"fp8": torch.float8_e4m3fn`` is) makes modes such as
``remainder+fp8`` available by name with ``--modes``; a mode the build or the
optimizer refuses is reported "not available" and the run goes on. ``torch`` is the
reference: torch's fused AdamW on fp32 parameters.

Peers, bench-only extras (the mixedprec package never imports them; nothing installs
them): ``optimi-kahan`` (optimi's AdamW, ``kahan_sum=True``), ``torchao-sr`` (torchao's
AdamW with ``bf16_stochastic_round=True``), ``torchao-8bit`` (``torchao.optim.AdamW8bit``)
and ``bnb-8bit`` (``bitsandbytes.optim.AdamW8bit``), all on bf16 parameters, by name in
``--modes`` or all of them with ``--peers``. Each is imported when its mode is built; a
library not installed is reported "not available (not installed)" and the run goes on.
Installed into the venv without touching torch (what was measured with torch 2.11.0):

    pip install --no-deps torch-optimi==0.3.3 torchao==0.18.0 bitsandbytes==0.50.2

(their other requirements, numpy and packaging, are already there). torchao compiles its
step per tensor shape (``torch.compile``, a C++ compiler needed) in the first step,
outside the timing: 2-6 minutes per torchao mode for the ResNet-50 list on a busy
2-core machine with an empty compile cache.

Method: per list (ResNet-50 and GPT-2-medium, bench/ops.py's builders) and thread
count, every mode's optimizer is built over its own parameters (random, N(0, 1)) with
one shared gradient list per dtype (N(0, 1e-2); nothing writes it; a peer gets its own
copy), stepped once (state creation) and warmed up; then each repetition steps every
mode once, in a fresh random order, timed with the wall clock. A mode whose own steps
have taken ``--mode-budget`` seconds (per list and thread count) leaves the later
repetitions once it has ``MIN_REPS``, so a slow mode (a peer at a second a step) keeps
the run bounded. Reported: the median per mode, p20-p80, the ratio torch median / mode
median (> 1: faster than torch), bytes per parameter (parameters + optimizer state: the
bytes their storages hold, see ``_storage_bytes``) and the bytes one step must move per
element (reads and writes of parameters, state and the gradient), with the effective GB/s.
``--start-step N`` sets torch's and mixedprec's step counts to N after the first step
(through the state dict, as a resume does), for a long run's steps: from step 16,628 on
(beta2 0.999) sqrt(1 - beta2^step) is 1 in float, and the CPU skips dividing by it.

GPT-2-medium (355M elements) needs ~16 bytes per element per mode; every mode at once
would not fit the 24 GB CPU machines, so by default its list is cut to its first
``--gpt2-layers`` blocks (the embeddings and every tensor shape kept); the report says
which. ``--gpt2-layers 24`` is the whole list.

    python bench/lean_speed.py                       # both lists, 1 and 2 threads
    python bench/lean_speed.py --modes torch,remainder,remainder+bf16 --reps 60
    python bench/lean_speed.py --lists resnet50 --modes torch,remainder+bf16 --peers
    python bench/lean_speed.py --quick               # smoke run (tiny lists)

Outputs ``lean-speed-cpu.{json,md,png}`` in bench/results (or ``--out``; the smoke run
in bench/results/cpu-smoke).
"""

import argparse
import gc
import importlib.util
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch


def _load(name: str):
    module_name = f"mixedprec_bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name,
                                                      Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


C = _load("common")
B = _load("ops")  # the parameter lists
C.ensure_importable()

REFERENCE = "torch"
MASTERS = ("fp32", "none", "kahan", "stochastic", "remainder")
# Moment dtypes by the name a mode gives after "+". The hook for 8-bit moments:
# "fp8": 8-bit moments (state_dtype=torch.float8_e4m3fn), e.g. "remainder+fp8".
STATE_DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                        "fp8": torch.float8_e4m3fn}
DEFAULT_MODES = ("torch", "fp32", "fp32+bf16", "none", "none+bf16", "kahan", "kahan+bf16",
                 "stochastic", "stochastic+bf16", "remainder", "remainder+bf16")
# Peers by mode name -> the pip package that brings them (bench extras, see above).
PEER_MODES: Dict[str, str] = {"optimi-kahan": "torch-optimi", "torchao-sr": "torchao",
                              "torchao-8bit": "torchao", "bnb-8bit": "bitsandbytes"}
UNAVAILABLE = "not available"
# What a mixedprec mode may raise when the build or the optimizer refuses it; a peer's
# library may raise anything (a failed torch.compile, say), all of it reported.
REFUSED = (NotImplementedError, ValueError, TypeError, RuntimeError)
LR, WD = 1e-3, 1e-2
BETAS, EPS = (0.9, 0.999), 1e-8  # torch's defaults; optimi's own are (0.9, 0.99), 1e-6
MIN_REPS = 5
# A mode's suffix for the precision report: "+report" (precision_report=True, every step),
# "+reportN" (every N-th step), e.g. "none+bf16+report", "none+report8".
REPORT = "+report[N]"


def parse_mode(mode: str) -> Dict[str, Any]:
    """``torch``, a peer or ``MASTER[+STATE]`` -> what builds it; ValueError when unknown."""
    if mode == REFERENCE:
        return dict(kind="torch", param_dtype=torch.float32)
    if mode in PEER_MODES:
        return dict(kind="peer", param_dtype=torch.bfloat16, package=PEER_MODES[mode])
    found = re.search(r"\+report(\d*)$", mode)
    report = (int(found.group(1)) if found.group(1) else True) if found else False
    master, _, state = mode[:found.start()].partition("+") if found else mode.partition("+")
    state = state or "fp32"
    if master not in MASTERS or state not in STATE_DTYPES:
        raise ValueError(f"unknown mode {mode!r}: expected 'torch', a peer "
                         f"({', '.join(PEER_MODES)}) or MASTER[+STATE][{REPORT}] with "
                         f"MASTER in {list(MASTERS)} and STATE in {list(STATE_DTYPES)}")
    return dict(kind="mixedprec", param_dtype=torch.bfloat16, master=master,
                state_dtype=STATE_DTYPES[state], precision_report=report)


def list_shapes(name: str, gpt2_layers: int, quick: bool):
    if name == "resnet50":
        shapes, source = B.resnet50_shapes()
    elif name == "gpt2-medium":
        shapes = B.gpt2_medium_shapes(layers=gpt2_layers)
        source = (f"GPT-2-medium layout, first {gpt2_layers} of 24 blocks" if gpt2_layers < 24
                  else "GPT-2-medium layout")
    else:
        raise SystemExit(f"unknown list {name!r}; choose from resnet50, gpt2-medium")
    if quick:
        shapes = B.scaled(shapes, 1000)
        source += ", sizes / 1000 (smoke)"
    return shapes, source


# The bytes a tensor's storage holds, each storage once (bench/common.py; ops.py's
# modes group counts the same way).
_storage_bytes = C.storage_bytes


def _peer_optimizer(mode: str, params: List[torch.nn.Parameter]):
    """A peer's optimizer; its library is imported here only (ImportError: not installed)."""
    if mode == "optimi-kahan":
        import optimi  # foreach left to optimi (None: its per-tensor loop on the CPU)
        return optimi.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS,
                            kahan_sum=True)
    if mode in ("torchao-sr", "torchao-8bit"):
        import torch._inductor.config
        import torchao.optim
        # torch.compile bakes the thread count of the first step into its CPU kernels
        # unless told otherwise: follow torch.set_num_threads like every other mode.
        torch._inductor.config.cpp.dynamic_threads = True
        if mode == "torchao-8bit":
            return torchao.optim.AdamW8bit(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
        # torchao 0.18 exports no AdamW: its plain (unquantized-state) one is _AdamW.
        adamw = getattr(torchao.optim, "AdamW", None) or torchao.optim._AdamW
        return adamw(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS,
                     bf16_stochastic_round=True)
    import bitsandbytes
    return bitsandbytes.optim.AdamW8bit(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)


def peer_versions(modes: Sequence[str]) -> Dict[str, str]:
    """The installed version of each peer package ``modes`` name (missing ones left out)."""
    from importlib import metadata
    out = {}
    for package in sorted({PEER_MODES[m] for m in modes if m in PEER_MODES}):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def _set_step(opt, step: int) -> None:
    """Every parameter's step count set to ``step`` (through the state dict, as a resume
    would: torch's and mixedprec's optimizers keep one per parameter)."""
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = torch.full_like(st["step"], float(step))
    opt.load_state_dict(sd)


class Case:
    """One mode's optimizer over its own parameters, the gradients shared."""

    def __init__(self, mode: str, shapes, grads: List[torch.Tensor], seed: int,
                 start_step: int = 0):
        spec = parse_mode(mode)
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(spec["param_dtype"]))
                       for s in shapes]
        if spec["kind"] == "peer":
            # Foreign code gets its own gradients: optimi's Kahan step writes its scratch
            # into the gradient, which the other modes share.
            grads = [g.clone() for g in grads]
        for p, g in zip(self.params, grads):
            p.grad = g
        if spec["kind"] == "torch":
            self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, fused=True)
        elif spec["kind"] == "peer":
            self.opt = _peer_optimizer(mode, self.params)
        else:
            import mixedprec.optim
            kw = {"seed": 1} if spec["master"] == "stochastic" else {}
            self.opt = mixedprec.optim.AdamW(self.params, lr=LR, weight_decay=WD,
                                             master=spec["master"],
                                             state_dtype=spec["state_dtype"],
                                             precision_report=spec["precision_report"], **kw)
        t0 = time.perf_counter()
        self.opt.step()  # state creation (torchao: its compilation), outside the timing
        self.first_step_s = time.perf_counter() - t0
        if start_step and spec["kind"] != "peer":
            _set_step(self.opt, start_step)
        self.spec = spec
        # "+reportN": a timed call is N steps, one of them counted (reported per step)
        report = spec.get("precision_report")
        self.steps_per_call = report if type(report) is int else 1
        n = sum(p.numel() for p in self.params)
        param_b = sum(_storage_bytes(p, set()) for p in self.params)
        # Every state tensor but the step counts (0-dim; bitsandbytes' are ints), with
        # 8-bit state's scales and code maps.
        seen: set = set()
        state_b = sum(_storage_bytes(v, seen) for st in self.opt.state.values()
                      for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        grad_b = sum(_storage_bytes(g, set()) for g in grads)
        self.bytes_per_param = (param_b + state_b) / n
        # A step reads and writes the parameters and the state and reads the gradient;
        # with fp32 masters (in the state) the bf16 parameters are only written.
        only_written = param_b if spec.get("master") == "fp32" else 0
        self.moved_per_elem = (2 * (param_b + state_b) + grad_b - only_written) / n
        self.numel = n

    def step(self) -> None:
        for _ in range(self.steps_per_call):
            self.opt.step()


def measure(shapes, modes: Sequence[str], threads: Sequence[int], reps: int, warmup: int,
            seed: int, log, mode_budget: float = float("inf"),
            start_step: int = 0) -> Dict[str, Any]:
    """Builds every mode over ``shapes`` and times them interleaved, per thread count; a
    mode leaves the repetitions once its steps have taken ``mode_budget`` seconds and it
    has ``MIN_REPS``."""
    gen = torch.Generator().manual_seed(seed + 1)
    grads32 = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    grads = {torch.float32: grads32, torch.bfloat16: [g.to(torch.bfloat16) for g in grads32]}
    cases: Dict[str, Case] = {}
    status: Dict[str, str] = {}
    for i, mode in enumerate(modes):
        spec = parse_mode(mode)
        try:
            cases[mode] = Case(mode, shapes, grads[spec["param_dtype"]], seed + 10 + i,
                               start_step)
            status[mode] = "ok"
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            if spec["kind"] == "peer" and isinstance(e, ImportError):
                status[mode] = f"{UNAVAILABLE} (not installed): {first}"
            elif spec["kind"] == "peer" or isinstance(e, REFUSED):
                status[mode] = f"{UNAVAILABLE}: {type(e).__name__}: {first}"
            else:
                raise
            log(f"  {mode}: {status[mode]}")
    out: Dict[str, Any] = {}
    rng = random.Random(seed)
    keys = list(cases)
    saved = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            times: Dict[str, List[float]] = {k: [] for k in keys}
            for _ in range(warmup):
                for k in keys:
                    cases[k].step()
            for _ in range(reps):
                active = [k for k in keys
                          if len(times[k]) < MIN_REPS or sum(times[k]) < mode_budget * 1e3]
                if not active:
                    break
                rng.shuffle(active)
                for k in active:
                    t0 = time.perf_counter()
                    cases[k].step()
                    times[k].append((time.perf_counter() - t0) * 1e3 / cases[k].steps_per_call)
            rows = {}
            ref = statistics.median(times[REFERENCE]) if REFERENCE in times else None
            for mode in modes:
                if mode not in cases:
                    rows[mode] = dict(status=status[mode])
                    continue
                c, s = cases[mode], C.summary(times[mode])
                rows[mode] = dict(
                    status="ok", **s, ratio=(ref / s["median_ms"]) if ref else None,
                    bytes_per_param=c.bytes_per_param, moved_per_elem=c.moved_per_elem,
                    gbs=c.moved_per_elem * c.numel / (s["median_ms"] * 1e-3) / 1e9,
                    first_step_s=c.first_step_s)
            out[str(t)] = rows
            log(f"  {t} thread(s): " + ", ".join(
                f"{m} {r['median_ms']:.1f} ms ({r['ratio']:.2f}x)" if r.get("ratio")
                else f"{m} {r.get('median_ms', float('nan')):.1f} ms"
                for m, r in rows.items() if r["status"] == "ok"))
    finally:
        torch.set_num_threads(saved)
    return out


def markdown(data: Dict[str, Any]) -> str:
    env = data["env"]
    lines = ["# Lean AdamW modes: one step on the CPU against torch's fused AdamW", ""]
    lines += C.env_lines(env, data["smoke"])
    lines += [f"- CPU: {env.get('cpu_model')}, {env.get('cpu_count')} cores visible, "
              f"flags {' '.join(env.get('cpu_flags') or [])}; torch's CPU capability "
              f"{env.get('cpu_capability')}",
              f"- {data['config']['reps']} repetitions after {data['config']['warmup']} "
              "warm-ups, every mode once per repetition in a fresh order; medians"
              + (f"; a mode stops after {C.fmt(data['config']['mode_budget'], 0)} s of its "
                 f"own steps (at least {MIN_REPS} repetitions; its count in brackets)"
                 if data["config"].get("mode_budget") not in (None, float("inf")) else "")]
    if data["config"].get("start_step"):
        lines += [f"- the timed steps start from step {data['config']['start_step']} (torch's "
                  "and mixedprec's step counts set after the first step; the peers' not)"]
    if data.get("peer_versions"):
        lines += ["- peers: " + ", ".join(f"{k} {v}" for k, v in
                                          data["peer_versions"].items())]
    lines += [""]
    if data.get("note"):
        lines += [data["note"], ""]
    for name, res in data["results"].items():
        lines += [f"## {res['label']}: {res['tensors']} tensors, {res['numel']:,} elements "
                  f"({res['source']})", ""]
        threads = list(res["threads"])
        header = ["mode", "B/param", "B moved/elem"]
        for t in threads:
            header += [f"{t}T ms", f"{t}T p20-p80", f"{t}T vs torch", f"{t}T GB/s"]
        rows = []
        for mode in data["config"]["modes"]:
            first = res["threads"][threads[0]][mode]
            if first["status"] != "ok":
                rows.append([mode, first["status"]] + [""] * (len(header) - 2))
                continue
            row = [mode, C.fmt(first["bytes_per_param"], 1), C.fmt(first["moved_per_elem"], 1)]
            for t in threads:
                r = res["threads"][t][mode]
                ratio = r["ratio"]
                mark = "" if ratio is None or ratio >= 1.0 or mode == REFERENCE else " (miss)"
                cut = (f" ({r['reps']})" if r.get("reps", data["config"]["reps"])
                       < data["config"]["reps"] else "")
                row += [C.fmt(r["median_ms"]) + cut,
                        f"{C.fmt(r['p20_ms'])}-{C.fmt(r['p80_ms'])}",
                        (C.fmt(ratio) + "x" + mark) if ratio else "", C.fmt(r["gbs"], 1)]
            rows.append(row)
        lines += C.md_table(header, rows) + [""]
        ref = {t: res["threads"][t].get(REFERENCE, {}).get("median_ms") for t in threads}
        for t in threads[1:]:
            if ref[t] and ref[threads[0]] and ref[t] > ref[threads[0]]:
                lines += [f"**{t} threads: torch's step ({C.fmt(ref[t])} ms) was slower than "
                          f"at {threads[0]} ({C.fmt(ref[threads[0]])} ms)**: the reference was "
                          "disturbed (another process on the cores), so this column's ratios "
                          "do not compare the kernels.", ""]
    lines += ["Modes: MASTER[+STATE] on bf16 parameters (mixedprec.optim.AdamW, master= and "
              "state_dtype=, fp32 moments unless +STATE); `torch`: torch.optim.AdamW("
              "fused=True) on fp32 parameters. vs torch: torch's median / the mode's median "
              "(> 1: faster). B/param: parameters + optimizer state, from the tensors. "
              "B moved/elem: what one step reads and writes (parameters, state, the "
              "gradient read); GB/s: that over the median time."]
    if any(m in PEER_MODES for m in data["config"]["modes"]):
        lines += ["", "Peers, on bf16 parameters: `optimi-kahan` optimi.AdamW(kahan_sum=True) "
                  "(bf16 moments and compensation); `torchao-sr` torchao's AdamW("
                  "bf16_stochastic_round=True) (bf16 moments); `torchao-8bit` "
                  "torchao.optim.AdamW8bit and `bnb-8bit` bitsandbytes.optim.AdamW8bit "
                  "(8-bit moments in blocks of 256 with fp32 scales for tensors of 4096 "
                  "elements or more; torchao keeps the others' moments in bf16, "
                  "bitsandbytes in fp32; parameters rounded to nearest). Their B/param "
                  "counts the bytes the state's storages hold (scales and code maps "
                  "included); B moved/elem is the "
                  "same lower bound as the others' (their CPU steps go through fp32 "
                  "temporaries, and optimi's also writes the gradient, its scratch). "
                  "torchao's step is compiled (torch.compile) in the first step, outside "
                  "the timing."]
    return "\n".join(lines) + "\n"


def chart(data: Dict[str, Any], path: Path) -> Optional[str]:
    """One panel per list: each mode's speed against torch (bars per thread count),
    labelled with its bytes per parameter. Returns why not, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib missing: {e}"
    results = data["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    modes = list(data["config"]["modes"])
    for ax, (name, res) in zip(axes[0], results.items()):
        threads = list(res["threads"])
        width = 0.8 / len(threads)
        for j, t in enumerate(threads):
            ys = [res["threads"][t][m].get("ratio") or 0.0 for m in modes]
            ax.bar([i + j * width for i in range(len(modes))], ys, width, label=f"{t} thread(s)")
        ax.axhline(1.0, color="grey", lw=0.8)
        labels = []
        for m in modes:
            r = res["threads"][threads[0]][m]
            labels.append(f"{m}\n{r['bytes_per_param']:.0f} B" if r["status"] == "ok"
                          else f"{m}\nn/a")
        ax.set_xticks([i + width * (len(threads) - 1) / 2 for i in range(len(modes))])
        ax.set_xticklabels(labels, rotation=60, fontsize=7)
        ax.set(title=f"{res['label']} ({res['numel']:,} elements)",
               ylabel="torch fused AdamW fp32 time / mode time")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"One AdamW step, {data['env'].get('cpu_model')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lists", default="resnet50,gpt2-medium")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES))
    ap.add_argument("--peers", action="store_true",
                    help=f"add the peers ({', '.join(PEER_MODES)}) to --modes")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode-budget", type=float, default=60.0,
                    help="seconds of one mode's steps per list and thread count after which "
                         f"it stops repeating (at least {MIN_REPS} repetitions)")
    ap.add_argument("--gpt2-layers", type=int, default=2,
                    help="GPT-2-medium blocks kept (24: the whole list, ~16 B/elem/mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-step", type=int, default=0,
                    help="the step count the timed steps start from, torch's and mixedprec's "
                         "(default: a fresh state; a long run's steps, e.g. 20000, have "
                         "sqrt(1 - beta2^step) at 1 in float, where the CPU skips that "
                         "division)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny lists, 2 reps")
    ap.add_argument("--note", default="", help="a line for the report")
    ap.add_argument("--out")
    ap.add_argument("--replot", metavar="JSON",
                    help="rewrite a saved run's markdown and chart next to it, timing nothing")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.replot:
        import json
        path = Path(args.replot)
        data = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(data))
        why = chart(data, path.with_suffix(".png"))
        if why:
            print(f"no chart: {why}")
        return 0
    modes = [m for m in args.modes.split(",") if m]
    modes += [m for m in PEER_MODES if args.peers and m not in modes]
    for m in modes:
        try:
            parse_mode(m)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if REFERENCE not in modes:
        modes.insert(0, REFERENCE)
    threads = [int(t) for t in args.threads.split(",") if t]
    if args.quick:
        args.reps, args.warmup = 2, 1
    out = C.out_dir(args.out, args.quick)
    device = torch.device("cpu")
    results: Dict[str, Any] = {}
    for name in [n for n in args.lists.split(",") if n]:
        shapes, source = list_shapes(name, args.gpt2_layers, args.quick)
        numel = sum(B.numel(s) for s in shapes)
        print(f"{name}: {len(shapes)} tensors, {numel:,} elements ({source})", flush=True)
        res = measure(shapes, modes, threads, args.reps, args.warmup, args.seed, print,
                      args.mode_budget, args.start_step)
        results[name] = dict(label=B.LIST_LABELS[name], source=source, tensors=len(shapes),
                             numel=numel, threads=res)
        gc.collect()
    data = dict(env=C.environment(device), smoke=args.quick, note=args.note,
                config=dict(modes=modes, threads=threads, reps=args.reps, warmup=args.warmup,
                            mode_budget=args.mode_budget, gpt2_layers=args.gpt2_layers,
                            start_step=args.start_step,
                            lr=LR, weight_decay=WD),
                peer_versions=peer_versions(modes), results=results)
    stem = out / "lean-speed-cpu"
    C.write_json(stem.with_suffix(".json"), data)
    md = markdown(data)
    stem.with_suffix(".md").write_text(md)
    why = chart(data, stem.with_suffix(".png"))
    if why:
        print(f"no chart: {why}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
