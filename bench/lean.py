"""The lean precision modes of FusedAdam side by side (issue #11, docs/lean-precision.md).

Four models, trained in one run:

* ``digits``: the small CNN of examples/digits on scikit-learn's digits (shipped with
  scikit-learn, offline); reports test accuracy.
* ``digits-mlp``: an MLP on the same digits and split (64 -> 416 -> 416 -> 10, ReLU):
  every weight matrix is eligible for 8-bit moments (416 = 13 blocks of 32, and the
  10 x 416 head has at least 4096 elements), 99.6% of the elements; only the biases keep
  fp32 moments. Reports test accuracy: the accuracy model that 8-bit moments touch.
* ``lm``: a byte-level causal transformer (bench/train.py's ``CausalLM``) on a real
  offline corpus: the Python standard library's own top-level ``*.py`` files
  (``sysconfig.get_paths()["stdlib"]``); every tenth file is held out. Reports the final
  held-out loss (nats per byte) and, beside it, the held-out next-byte top-1 accuracy
  (%) on the same windows.
* ``resnet18``: torchvision's ResNet-18 on synthetic 32x32 images, for step time and
  memory only.

Modes (each one ``mixedprec.FusedAdam`` configuration):

===================  ==========================================================
fp32                 fp32 params, fp32 moments (the reference)
bf16-master          bf16 params, ``master="fp32"``, fp32 moments
fp32-bf16mom         fp32 params, ``state_dtype=torch.bfloat16``
bf16-kahan           bf16 params, ``master="kahan"``, fp32 moments
bf16-stochastic      bf16 params, ``master="stochastic"``, fp32 moments
bf16-none            bf16 params, ``master="none"``, fp32 moments (the baseline)
bf16-remainder       bf16 params, ``master="remainder"`` (exact fp32 masters in 2
                     bytes), fp32 moments
bf16-remainder-      the same with ``state_dtype=torch.bfloat16`` (8 bytes per
bf16mom              parameter)
bf16-master-bf16mom  bf16 params, ``master="fp32"``, bf16 moments (10 bytes)
bf16-kahan-bf16mom   bf16 params, ``master="kahan"``, bf16 moments (8 bytes: optimi's
                     recipe)
bf16-stochastic-     bf16 params, ``master="stochastic"``, bf16 moments (6 bytes)
bf16mom
fp32-fp8mom          fp32 params, ``state_dtype=torch.float8_e4m3fn`` (8-bit moments:
                     e4m3 codes, a power-of-two scale per block of 32)
bf16-master-fp8mom   bf16 params, ``master="fp32"``, 8-bit moments
bf16-remainder-      bf16 params, ``master="remainder"``, 8-bit moments (issue #20's
fp8mom               leanest exact mode)
bf16-kahan-fp8mom    bf16 params, ``master="kahan"``, 8-bit moments
bf16-stochastic-     bf16 params, ``master="stochastic"``, 8-bit moments
fp8mom
===================  ==========================================================

Only parameters with at least 2 dimensions, 4096 elements and rows of whole blocks of
32 take 8-bit moments (mixedprec/optim/state8.py); the others keep fp32 moments. The
report gives, per model, the share of the elements that did (none of the digits CNN's:
there the fp8 modes train exactly as their fp32-moment counterparts; 99.6% of the digits
MLP's, 98.9% of the LM's).

bf16 modes cast the whole model (norms included) to bf16 and take the loss on fp32
logits; bf16 needs no loss scale. A mode whose construction raises
``NotImplementedError`` (``master="stochastic"`` in builds without it) is reported as
"not available in this build" and the run carries on.

Per model and mode, over ``--seeds`` seeds (same data order and initial weights per
seed in every mode): final metric mean and spread (max - min), the bytes of
parameters plus optimizer state (sum of numel * element_size over the parameters and
every tensor in the optimizer state, after training: the peak, since the state is
fixed in size after the first step), and the median step time (zero_grad, forward,
backward, step; wall clock on the CPU, synchronised on CUDA). Modes are interleaved
step by step (the order rotated each step) so that machine noise hits all of them
alike.

The learning rate warms up, then decays by cosine to ``lr / 20``: late in training the
updates are smaller than half a bf16 unit of many weights, where ``"none"`` stalls.

The bar (issue #11): kahan and stochastic end within 1% relative of bf16-master's
held-out loss on the LM and within 0.5 points of its accuracy on digits; bf16-none is
visibly worse (beyond the same margins).
The 8-bit bar (issue #20): each fp8 mode within 0.5% relative of its fp32-moment
counterpart's held-out LM loss and within 0.3 points of its accuracy (the LM's next-byte
accuracy, the digits MLP's test accuracy; means over the seeds). A model with no
eligible tensor (the digits CNN) gets no verdict ("no eligible tensor"): its fp8 modes
are its fp32-moment modes.

``--merge`` keeps the modes of the saved ``lean-<device>.json`` in the output directory
that are not run now (same sizes and seeds required) and replaces those that are; a
model the saved run lacks is added (its sizes are new keys of the config).

Writes ``lean-<device>.md``, ``.json``, ``.png`` to bench/results (or ``--out``;
``--quick``, a smoke run of under a minute, writes to bench/results/cpu-smoke). The
chart: the loss curves, and each mode's final LM loss and accuracy and digits
accuracies against its bytes per parameter. ``--replot lean-<device>.json`` writes the
markdown and the chart of a saved run again without training.
"""

import argparse
import importlib.util
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _load(name: str):
    module_name = f"mixedprec_bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            module_name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


C = _load("common")

# name -> (param dtype, master, moment dtype)
MODES: Dict[str, tuple] = {
    "fp32": (torch.float32, "none", torch.float32),
    "bf16-master": (torch.bfloat16, "fp32", torch.float32),
    "fp32-bf16mom": (torch.float32, "none", torch.bfloat16),
    "bf16-kahan": (torch.bfloat16, "kahan", torch.float32),
    "bf16-stochastic": (torch.bfloat16, "stochastic", torch.float32),
    "bf16-none": (torch.bfloat16, "none", torch.float32),
    "bf16-remainder": (torch.bfloat16, "remainder", torch.float32),
    "bf16-remainder-bf16mom": (torch.bfloat16, "remainder", torch.bfloat16),
    "bf16-master-bf16mom": (torch.bfloat16, "fp32", torch.bfloat16),
    "bf16-kahan-bf16mom": (torch.bfloat16, "kahan", torch.bfloat16),
    "bf16-stochastic-bf16mom": (torch.bfloat16, "stochastic", torch.bfloat16),
    "fp32-fp8mom": (torch.float32, "none", torch.float8_e4m3fn),
    "bf16-master-fp8mom": (torch.bfloat16, "fp32", torch.float8_e4m3fn),
    "bf16-remainder-fp8mom": (torch.bfloat16, "remainder", torch.float8_e4m3fn),
    "bf16-kahan-fp8mom": (torch.bfloat16, "kahan", torch.float8_e4m3fn),
    "bf16-stochastic-fp8mom": (torch.bfloat16, "stochastic", torch.float8_e4m3fn),
}
FP8 = torch.float8_e4m3fn
REFERENCE = "bf16-master"  # the bar's reference: fp32 masters
CONTENDERS = ("bf16-kahan", "bf16-stochastic")
BASELINE = "bf16-none"
BAR_LM_REL = 0.01  # relative held-out loss
BAR_DIGITS_POINTS = 0.5  # accuracy, percentage points
UNAVAILABLE = "not available in this build"
# Issue #20: each 8-bit-moment mode against its fp32-moment counterpart (same params and
# master): within 0.5% relative held-out loss and 0.3 points of accuracy.
BAR8_LM_REL = 0.005
BAR8_DIGITS_POINTS = 0.3


def counterpart(mode: str) -> Optional[str]:
    """The fp32-moment mode of an 8-bit-moment mode (None for the others)."""
    if MODES[mode][2] != FP8:
        return None
    return mode[:-len("-fp8mom")]

# Sizes: full run (eleven modes: 686 s on 1 thread of a shared AMD EPYC) and --quick (~10 s
# a model; ResNet-18 one step a mode, untimed warm-up left out: a CPU without AVX512_BF16
# runs bf16 convolutions' backward through torch's slow_conv2d, ~1 s a step on an AVX2 EPYC).
FULL = dict(seeds=3, digits_steps=1200, digits_batch=32, digits_lr=3e-4,
            mlp_steps=1200, mlp_batch=32, mlp_lr=1e-3, mlp_hidden=416,
            lm_steps=400, lm_batch=16, lm_seq=64, lm_d=96, lm_layers=2, lm_heads=4,
            lm_lr=2e-3, lm_eval_every=50, lm_eval_batches=16, lm_corpus_mb=4.0,
            rn_steps=6, rn_warmup=1, rn_batch=8, rn_image=32)
QUICK = dict(seeds=1, digits_steps=30, digits_batch=32, digits_lr=3e-4,
             mlp_steps=30, mlp_batch=32, mlp_lr=1e-3, mlp_hidden=128,
             lm_steps=20, lm_batch=4, lm_seq=32, lm_d=32, lm_layers=1, lm_heads=2,
             lm_lr=2e-3, lm_eval_every=10, lm_eval_batches=2, lm_corpus_mb=0.3,
             rn_steps=1, rn_warmup=0, rn_batch=2, rn_image=32)


def lr_at(step: int, total: int, lr: float) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to lr / 20."""
    warm = max(1, total // 20)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return lr / 20 + (lr - lr / 20) * 0.5 * (1 + math.cos(math.pi * t))


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes of the parameters and of every tensor in the optimizer state, and how many
    parameter elements hold 8-bit moments (``q8_numel``, of ``numel``)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    state = q8 = 0
    for p, s in opt.state.items():
        for v in s.values():
            if torch.is_tensor(v):
                state += v.numel() * v.element_size()
        if torch.is_tensor(s.get("exp_avg")) and s["exp_avg"].dtype == FP8:
            q8 += p.numel()
    return {"param_bytes": params, "state_bytes": state, "total_bytes": params + state,
            "numel": numel, "q8_numel": q8}


def make_optimizer(mode: str, model: nn.Module, lr: float):
    """The mode's FusedAdam; raises NotImplementedError where the build lacks it."""
    import mixedprec
    _, master, moments = MODES[mode]
    return mixedprec.FusedAdam(model.parameters(), lr=lr, master=master, state_dtype=moments)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the three tasks -----------------------------------------------------------------------

class Task:
    """One model in one mode and seed: ``step(i)`` trains on batch ``i`` (returns the
    loss tensor), ``evaluate()`` gives the metrics (``{"metric": the model's metric}``,
    the LM's with its ``"accuracy"`` too; host reads: outside the timed steps)."""

    extra_metrics: tuple = ()  # keys evaluate() gives beside "metric"

    def __init__(self, model: nn.Module, mode: str, lr: float, total: int,
                 device: torch.device):
        self.dtype = MODES[mode][0]
        self.model = model.to(device=device, dtype=self.dtype)
        self.opt = make_optimizer(mode, self.model, lr)
        self.lr, self.total, self.device = lr, total, device

    def step(self, i: int) -> torch.Tensor:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(i, self.total, self.lr)
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(i)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def evaluate(self) -> Dict[str, Optional[float]]:
        return {"metric": self.metric()}


class DigitsTask(Task):
    prefix = "digits"  # of the sizes in the config

    def make_model(self, cfg) -> nn.Module:
        return _load_digits_example().DigitsNet()

    def __init__(self, mode, seed, cfg, data, device):
        p = self.prefix
        torch.manual_seed(seed)
        super().__init__(self.make_model(cfg), mode, cfg[f"{p}_lr"], cfg[f"{p}_steps"], device)
        self.x_train, self.y_train, self.x_test, self.y_test = data
        g = torch.Generator().manual_seed(seed)
        n, b = len(self.y_train), cfg[f"{p}_batch"]
        per_epoch = n // b
        epochs = -(-cfg[f"{p}_steps"] // per_epoch)
        order = torch.cat([torch.randperm(n, generator=g)[:per_epoch * b] for _ in range(epochs)])
        self.batches = order.view(-1, b).to(device)

    def loss(self, i):
        idx = self.batches[i]
        out = self.model(self.x_train[idx].to(self.dtype))
        return F.cross_entropy(out.float(), self.y_train[idx])

    @torch.no_grad()
    def metric(self) -> float:
        self.model.eval()
        pred = self.model(self.x_test.to(self.dtype)).argmax(1)
        self.model.train()
        return 100.0 * (pred == self.y_test).float().mean().item()  # sync-ok: evaluation


def digits_mlp(hidden: int) -> nn.Module:
    """64 -> hidden -> hidden -> 10 with ReLUs on the flattened 8x8 digits. With hidden a
    multiple of 32 and 10 * hidden >= 4096 every weight matrix takes 8-bit moments."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class DigitsMLPTask(DigitsTask):
    """The digits CNN's data, split, batches and schedule, an MLP in its place (its
    own sizes: ``mlp_*``)."""
    prefix = "mlp"

    def make_model(self, cfg) -> nn.Module:
        return digits_mlp(cfg["mlp_hidden"])


class LMTask(Task):
    extra_metrics = ("accuracy",)

    def __init__(self, mode, seed, cfg, data, device):
        train_mod = _load("train")
        torch.manual_seed(seed)
        model = train_mod.CausalLM(256, cfg["lm_seq"], cfg["lm_layers"], cfg["lm_d"],
                                   cfg["lm_heads"])
        super().__init__(model, mode, cfg["lm_lr"], cfg["lm_steps"], device)
        train, held = data
        g = torch.Generator().manual_seed(seed)
        t, b = cfg["lm_seq"], cfg["lm_batch"]
        starts = torch.randint(0, len(train) - t - 1, (cfg["lm_steps"], b), generator=g)
        self.train, self.starts, self.t = train.to(device), starts.to(device), t
        # Fixed held-out windows (the same for every mode and seed).
        g_eval = torch.Generator().manual_seed(12345)
        n_eval = cfg["lm_eval_batches"] * b
        hs = torch.randint(0, len(held) - t - 1, (n_eval,), generator=g_eval)
        windows = torch.stack([held[s:s + t + 1] for s in hs.tolist()]).to(device)
        self.eval_x, self.eval_y = windows[:, :-1], windows[:, 1:]
        self.eval_b = b

    def _xy(self, starts):
        idx = starts[:, None] + torch.arange(self.t + 1, device=starts.device)
        w = self.train[idx]
        return w[:, :-1], w[:, 1:]

    def loss(self, i):
        x, y = self._xy(self.starts[i])
        out = self.model(x)
        return F.cross_entropy(out.float().reshape(-1, 256), y.reshape(-1))

    def evaluate(self) -> Dict[str, Optional[float]]:
        return self._held_out()

    def metric(self) -> float:
        return self._held_out()["metric"]

    @torch.no_grad()
    def _held_out(self) -> Dict[str, float]:
        """Held-out loss (nats per byte) and next-byte top-1 accuracy (%), one pass over
        the fixed held-out windows."""
        total = torch.zeros((), device=self.device)
        hits = torch.zeros((), device=self.device, dtype=torch.int64)
        n = 0
        for s in range(0, len(self.eval_x), self.eval_b):
            x, y = self.eval_x[s:s + self.eval_b], self.eval_y[s:s + self.eval_b]
            out = self.model(x).float().reshape(-1, 256)
            total += F.cross_entropy(out, y.reshape(-1), reduction="sum")
            hits += (out.argmax(1) == y.reshape(-1)).sum()
            n += y.numel()
        loss, acc = torch.stack([total / n, 100.0 * hits / n]).tolist()  # sync-ok: evaluation
        return {"metric": loss, "accuracy": acc}


class ResNetTask(Task):
    def __init__(self, mode, seed, cfg, data, device):
        import torchvision
        torch.manual_seed(seed)
        super().__init__(torchvision.models.resnet18(num_classes=10), mode, 1e-3,
                         cfg["rn_steps"] + cfg["rn_warmup"], device)
        g = torch.Generator().manual_seed(seed)
        b, s = cfg["rn_batch"], cfg["rn_image"]
        self.x = torch.randn(b, 3, s, s, generator=g).to(device=device, dtype=self.dtype)
        self.y = torch.randint(0, 10, (b,), generator=g).to(device)

    def loss(self, i):
        return F.cross_entropy(self.model(self.x).float(), self.y)

    def metric(self) -> Optional[float]:
        return None


def _load_digits_example():
    name = "mixedprec_example_digits"
    if name not in sys.modules:
        path = C.ROOT / "examples" / "digits" / "train.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def stdlib_corpus(max_mb: float):
    """Bytes of the standard library's top-level ``*.py`` files (sorted by name), up to
    ``max_mb`` MB: every tenth file held out. Returns (train, held-out) uint8 -> int64
    tensors and a description."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    train, held, used, size = [], [], 0, 0
    for k, f in enumerate(files):
        data = f.read_bytes()
        (held if k % 10 == 9 else train).append(data)
        used, size = used + 1, size + len(data)
        if size >= max_mb * 1e6:
            break
    to_t = lambda chunks: torch.frombuffer(bytearray(b"\n".join(chunks)),  # noqa: E731
                                           dtype=torch.uint8).long()
    desc = (f"{used} top-level .py files of {root} (sorted by name, {size / 1e6:.2f} MB; "
            f"every tenth held out: {sum(map(len, held)) / 1e6:.2f} MB)")
    return (to_t(train), to_t(held)), desc


TASKS = {"digits": DigitsTask, "digits-mlp": DigitsMLPTask, "lm": LMTask,
         "resnet18": ResNetTask}


def run_model(name: str, cfg: Dict[str, Any], modes: Sequence[str], seeds: int, data,
              device: torch.device, log) -> Dict[str, Any]:
    """Every mode and seed of one model; modes interleaved step by step."""
    cls = TASKS[name]
    steps = {"digits": cfg["digits_steps"], "digits-mlp": cfg["mlp_steps"],
             "lm": cfg["lm_steps"], "resnet18": cfg["rn_steps"] + cfg["rn_warmup"]}[name]
    warmup = cfg["rn_warmup"] if name == "resnet18" else 1
    every = cfg["lm_eval_every"] if name == "lm" else None
    out: Dict[str, Any] = {m: {"seeds": []} for m in modes}
    for seed in range(seeds):
        tasks = {}
        for m in modes:
            try:
                tasks[m] = cls(m, seed, cfg, data, device)
            except NotImplementedError as e:
                out[m]["status"] = UNAVAILABLE
                out[m]["error"] = str(e)
        runs = {m: {"losses": [], "step_ms": [], "evals": []} for m in tasks}
        live = list(tasks)
        for i in range(steps):
            order = live[i % len(live):] + live[:i % len(live)] if live else []
            for m in order:
                sync(device)
                t0 = time.perf_counter()
                loss = tasks[m].step(i)
                sync(device)
                if i >= warmup:
                    runs[m]["step_ms"].append((time.perf_counter() - t0) * 1e3)
                runs[m]["losses"].append(loss)
            if every and ((i + 1) % every == 0 or i + 1 == steps):
                for m in live:  # [step, metric, then the extra metrics (the LM's accuracy)]
                    got = tasks[m].evaluate()
                    runs[m]["evals"].append([i + 1, got["metric"]] +
                                            [got[k] for k in cls.extra_metrics])
        for m, task in tasks.items():
            r = runs[m]
            losses = torch.stack(r.pop("losses")).float().tolist()  # sync-ok: after training
            losses = [round(v, 5) for v in losses]
            r.update(seed=seed, losses=losses, **task.evaluate(),
                     median_step_ms=statistics.median(r["step_ms"]),
                     step_ms=C.summary(r["step_ms"]),
                     **state_bytes(task.model, task.opt))
            out[m]["status"] = "ok"
            out[m]["seeds"].append(r)
            log(f"  {name} seed {seed} {m}: metric {r['metric']}"
                + "".join(f", {k} {r[k]}" for k in cls.extra_metrics)
                + f", step {r['median_step_ms']:.1f} ms")
    for m in modes:
        seeds_ = out[m]["seeds"]
        if not seeds_:
            continue
        for key in ("metric",) + cls.extra_metrics:  # metric_mean, accuracy_mean, ...
            vals = [s[key] for s in seeds_ if s.get(key) is not None]
            out[m][f"{key}_mean"] = statistics.mean(vals) if vals else None
            out[m][f"{key}_spread"] = (max(vals) - min(vals)) if vals else None
        out[m].update(
            median_step_ms=statistics.median(r["median_step_ms"] for r in seeds_),
            total_bytes=seeds_[0]["total_bytes"], param_bytes=seeds_[0]["param_bytes"],
            state_bytes=seeds_[0]["state_bytes"],
            numel=seeds_[0]["numel"], q8_numel=seeds_[0]["q8_numel"],
            nonfinite=any(not math.isfinite(v) for r in seeds_ for v in r["losses"]))
    return out


# --- the bar, the report --------------------------------------------------------------------

def evaluate_bar(results: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Kahan/stochastic against bf16-master on the LM (1% relative loss) and digits
    (0.5 accuracy points); bf16-none beyond the same margin. passed None: not run."""
    bars = []

    def mean(model, mode):
        r = results.get(model, {}).get(mode, {})
        return r.get("metric_mean") if r.get("status") == "ok" else None

    for model, what in (("lm", "held-out loss"), ("digits", "test accuracy")):
        ref = mean(model, REFERENCE)
        for mode in CONTENDERS + (BASELINE,):
            v = mean(model, mode)
            if model == "lm":
                gap = None if v is None or ref is None else (v - ref) / ref
                margin, shown = BAR_LM_REL, (None if gap is None else f"{100 * gap:+.2f}%")
            else:
                gap = None if v is None or ref is None else ref - v
                margin, shown = BAR_DIGITS_POINTS, (None if gap is None else f"{-gap:+.2f} pts")
            if mode == BASELINE:
                target = (f"{mode} visibly worse than {REFERENCE} ({what}: "
                          f"{'> 1% relative' if model == 'lm' else '> 0.5 points'})")
                passed = None if gap is None else gap > margin
            else:
                target = (f"{mode} within {'1% relative' if model == 'lm' else '0.5 points'}"
                          f" of {REFERENCE} ({what})")
                passed = None if gap is None else gap <= margin
            status = results.get(model, {}).get(mode, {}).get("status")
            paired = [_gap(model == "lm", a["metric"], b["metric"]) for a, b in zip(
                results.get(model, {}).get(mode, {}).get("seeds", []),
                results.get(model, {}).get(REFERENCE, {}).get("seeds", []))]
            if shown and paired:
                shown += " (per seed: " + ", ".join(paired) + ")"
            bars.append(dict(model=model, mode=mode, target=target, value=shown,
                             passed=passed, status=status))
    return bars


# Issue #20's bar, row by row: (model, metric key, what, relative). The LM's loss is
# compared relatively (0.5%), the accuracies in points (0.3).
BAR8_METRICS = (("lm", "metric", "held-out loss", True),
                ("lm", "accuracy", "LM next-byte accuracy", False),
                ("digits-mlp", "metric", "digits MLP test accuracy", False),
                ("digits", "metric", "digits CNN test accuracy", False))
NO_ELIGIBLE = "no eligible tensor"


def evaluate_bar8(results: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Issue #20: each 8-bit-moment mode against its fp32-moment counterpart, mean over
    the seeds: LM held-out loss within 0.5% relative, accuracies (the LM's next-byte, the
    digits models') within 0.3 points (lower accuracy or higher loss is worse; better
    always passes). passed None: one of the two not run, the metric not measured (a
    merged run from before it existed), or the model has no tensor eligible for 8-bit
    moments (status "no eligible tensor ...": its fp8 modes are its fp32-moment modes,
    nothing to measure)."""
    bars = []
    for model, key, what, relative in BAR8_METRICS:
        res = results.get(model, {})
        for mode in res:
            ref_mode = counterpart(mode)
            if ref_mode is None:
                continue
            r, ref = res.get(mode, {}), res.get(ref_mode, {})
            ok = r.get("status") == "ok" and ref.get("status") == "ok"
            status = (r.get("status") if r.get("status") != "ok"
                      else ref.get("status", "not run"))
            v = r.get(f"{key}_mean") if ok else None
            w = ref.get(f"{key}_mean") if ok else None
            gap = shown = None
            if ok and r.get("q8_numel") == 0:
                status = (f"{NO_ELIGIBLE} (8-bit moments on 0 of {r['numel']:,} elements: "
                          f"trains as {ref_mode})")
            elif ok and (v is None or w is None):
                status = "not measured in the run kept"
            elif ok and relative:
                gap = (v - w) / w
                shown = f"{100 * gap:+.2f}%"
            elif ok:
                gap = w - v
                shown = f"{v - w:+.2f} pts"  # (not -gap: no "-0.00")
            passed = None if gap is None else gap <= (BAR8_LM_REL if relative
                                                      else BAR8_DIGITS_POINTS)
            paired = [_gap(relative, a[key], b[key]) for a, b in zip(
                r.get("seeds", []), ref.get("seeds", []))] if shown else []
            if paired:
                shown += " (per seed: " + ", ".join(paired) + ")"
            margin = "0.5% relative" if relative else "0.3 points"
            bars.append(dict(model=model, metric=key, mode=mode, reference=ref_mode,
                             target=f"{mode} within {margin} of {ref_mode} ({what})",
                             value=shown, passed=passed, status=status))
    return bars


def _gap(relative: bool, value: float, ref: float) -> str:
    """One seed's difference to the reference, as the bar measures it: relative % (the
    LM's loss) or points (accuracies)."""
    if relative:
        return f"{100 * (value - ref) / ref:+.2f}%"
    return f"{value - ref:+.2f}"


LABELS = {"digits": "Digits CNN, test accuracy (%)",
          "digits-mlp": "Digits MLP, test accuracy (%)",
          "lm": "Byte LM, held-out loss (nats/byte) and next-byte accuracy (%)",
          "resnet18": "ResNet-18 (synthetic), step time only"}
# The metric columns of each model's table: (key, header, decimals).
COLUMNS = {"digits": [("metric", "accuracy % (± half spread)", 2)],
           "digits-mlp": [("metric", "accuracy % (± half spread)", 2)],
           "lm": [("metric", "held-out loss (± half spread)", 4),
                  ("accuracy", "next-byte accuracy % (± half spread)", 2)],
           "resnet18": [("metric", "metric", 4)]}
NOT_MEASURED = "not measured"


def run_date(data: Dict[str, Any], model: str, mode: str) -> Optional[str]:
    """The date of the run that measured ``model`` in ``mode``: the result's own
    ``run_date``, or, for results saved before it existed, followed through the merge
    records (``merged``: the modes run now on ``models_now`` are of the file's date,
    the others of the earlier file's, and so on)."""
    got = data.get("results", {}).get(model, {}).get(mode, {}).get("run_date")
    if got:
        return got
    date, m = data["env"].get("date"), data.get("merged")
    while m:
        if mode in m["run_now"] and model in m.get("models_now", [model]):
            return date
        date, m = m.get("earlier_date"), m.get("earlier_merged")
    return date


def markdown(data: Dict[str, Any]) -> str:
    env, cfg = data["env"], data["config"]
    lines = ["# Lean precision modes: FusedAdam configurations side by side", ""]
    lines += C.env_lines(env, data["smoke"])
    lines += [f"- CPU: {env.get('cpu_model')}, torch threads {env.get('cpu_threads')}, "
              f"{env.get('cpu_count')} cores, capability {env.get('cpu_capability')}",
              f"- seeds: {cfg['seeds']}; modes interleaved step by step; total "
              f"{data['wall_s']:.0f} s",
              f"- corpus: {data['corpus']}", ""]
    if data.get("note"):
        lines += [data["note"], ""]
    for model, res in data["results"].items():
        lines += [f"## {LABELS[model]}", ""]
        rows, q8_rows, unmeasured = [], [], False
        columns = COLUMNS[model]
        for mode, r in res.items():
            if r.get("status") != "ok":
                rows.append([mode, r.get("status", "not run")] + [""] * (len(columns) + 3))
                continue
            metrics = []
            for key, _, digits in columns:
                if r.get(f"{key}_mean") is not None:
                    metrics.append(f"{r[f'{key}_mean']:.{digits}f} "
                                   f"(±{r[f'{key}_spread'] / 2:.{digits}f})")
                else:  # (resnet18's metric; the LM's accuracy in a run kept from before it)
                    metrics.append("" if key == "metric" else NOT_MEASURED)
                    unmeasured |= key != "metric"
            if r["nonfinite"]:
                metrics[0] += " non-finite!"
            if MODES[mode][2] == FP8 and "q8_numel" in r:
                q8_rows.append(f"{mode}: 8-bit moments on {r['q8_numel']:,} of "
                               f"{r['numel']:,} parameter elements "
                               f"({100 * r['q8_numel'] / r['numel']:.1f}%)")
            # Step time ratios only within one run (a merged file's runs had other loads).
            same_run = run_date(data, model, mode) == run_date(data, model, "fp32")
            rows.append([mode] + metrics + [
                         f"{r['total_bytes'] / 1e6:.3f}",
                         f"{bytes_per_param(mode, r):.1f}",
                         C.fmt(r["median_step_ms"], 1),
                         f"{r['median_step_ms'] / res['fp32']['median_step_ms']:.2f}"
                         if res.get("fp32", {}).get("status") == "ok" and same_run else ""])
        lines += C.md_table(["mode"] + [c[1] for c in columns] +
                            ["params+state MB", "B/param", "step ms", "vs fp32"], rows)
        lines.append("")
        dates: Dict[str, List[str]] = {}
        for mode in res:
            dates.setdefault(run_date(data, model, mode) or "?", []).append(mode)
        if len(dates) > 1:
            lines += ["Runs merged here: " + "; ".join(
                f"{d[:16].replace('T', ' ')} UTC: {', '.join(ms)}"
                for d, ms in sorted(dates.items())) +
                ". Step times are compared with fp32's (vs fp32) only within one run.", ""]
        if unmeasured:
            lines += [f"{NOT_MEASURED.capitalize()}: a mode kept from a merged run that "
                      "did not report this metric yet.", ""]
        if q8_rows:
            shares = sorted({row.split(": ", 1)[1] for row in q8_rows})
            lines += [("8-bit-moment modes: " + shares[0] + "; the other parameters (dim < 2, "
                       "fewer than 4096 elements, or rows not whole blocks of 32) keep "
                       "fp32 moments.") if len(shares) == 1 else
                      "8-bit moments: " + "; ".join(q8_rows) + ".", ""]
    lines += ["## The bar (issue #11)", ""]
    lines += C.md_table(["target", "measured", "verdict"],
                        [[b["target"], b["value"] or b["status"] or "",
                          C.verdict(b["passed"])] for b in data["bar"]], align="lll")
    if data.get("bar8"):
        lines += ["", "## The 8-bit moment bar (issue #20)", ""]
        lines += C.md_table(["target", "measured (mean over seeds)", "verdict"],
                            [[b["target"], b["value"] or b["status"] or "",
                              C.verdict(b["passed"])] for b in data["bar8"]], align="lll")
    lines += ["", "Spread: max - min over the seeds (shown as ± half of it). Memory: "
              "numel * element_size summed over the parameters and every optimizer state "
              "tensor after training (gradients and activations not counted). Step time: "
              "wall clock of zero_grad + forward + backward + step, the median of the "
              "seeds' medians. Bar: per seed, the same seed's bf16-master run is the "
              "reference (same initial weights and batches); the 8-bit bar's reference is "
              "each fp8 mode's fp32-moment counterpart, paired the same way. A digits test "
              "sample is 0.28 points of accuracy."]
    return "\n".join(lines) + "\n"


def chart(data: Dict[str, Any], path: Path) -> Optional[str]:
    """Top row: training loss curves, mean over seeds per mode (digits CNN, digits MLP,
    LM). Middle: the LM's held-out loss over training, its final held-out loss against
    the bytes per parameter (params + optimizer state, measured), and the same paired per
    seed with the fp32-master run (REFERENCE, relative %). Bottom: the final accuracies
    against the bytes per parameter, paired per seed with REFERENCE (points): the LM's
    next-byte accuracy, the digits CNN's and the digits MLP's test accuracy. Points are
    means over the seeds, bars the seeds' range. Models not run leave their panels empty.
    Returns why not, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib missing: {e}"
    res = data["results"]
    fig, axes = plt.subplots(3, 3, figsize=(16, 13))

    def smooth(xs, k):
        out, acc = [], []
        for x in xs:
            acc.append(x)
            acc = acc[-k:]
            out.append(sum(acc) / len(acc))
        return out

    colors = {m: _color(m) for m in MODES}
    for mode in MODES:
        for ax, model in ((axes[0][0], "digits"), (axes[0][1], "digits-mlp"),
                          (axes[0][2], "lm")):
            r = res.get(model, {}).get(mode, {})
            if r.get("status") != "ok":
                continue
            curves = [s["losses"] for s in r["seeds"]]
            mean = [statistics.mean(v) for v in zip(*curves)]
            ax.plot(smooth(mean, 20), label=mode, lw=1, color=colors[mode],
                    ls=_style(mode))
        r = res.get("lm", {}).get(mode, {})
        if r.get("status") == "ok" and r["seeds"][0]["evals"]:
            xs = [e[0] for e in r["seeds"][0]["evals"]]
            ys = [statistics.mean(v) for v in zip(*[[e[1] for e in s["evals"]]
                                                     for s in r["seeds"]])]
            axes[1][0].plot(xs, ys, marker="o", ms=3, label=mode, lw=1, color=colors[mode],
                            ls=_style(mode))
    axes[0][0].set(title="digits CNN: training loss (20-step mean)", xlabel="step",
                   yscale="log")
    axes[0][1].set(title="digits MLP: training loss (20-step mean)", xlabel="step",
                   yscale="log")
    axes[0][2].set(title="byte LM: training loss (20-step mean)", xlabel="step")
    axes[1][0].set(title="byte LM: held-out loss", xlabel="step")
    xlabel = "bytes per parameter (params + optimizer state, measured)"
    same = "vs {ref}, same seed"  # (the reference _bytes_panel used)
    panels = ((axes[1][1], "lm", "metric", None, "byte LM: final held-out loss (nats/byte)"),
              (axes[1][2], "lm", "metric", "relative", f"byte LM: final held-out loss {same} (%)"),
              (axes[2][0], "lm", "accuracy", "points",
               f"byte LM: final next-byte accuracy {same} (points)"),
              (axes[2][1], "digits", "metric", "points",
               f"digits CNN: final test accuracy {same} (points)"),
              (axes[2][2], "digits-mlp", "metric", "points",
               f"digits MLP: final test accuracy {same} (points)"))
    for ax, model, key, paired, title in panels:
        ref = _bytes_panel(ax, res.get(model, {}), colors, key, paired)
        ax.set(title=title.format(ref=ref or REFERENCE), xlabel=xlabel)
        if paired:
            ax.axhline(0, color="grey", lw=0.8)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(9)
    fig.suptitle(f"FusedAdam lean modes, mean over {data['config']['seeds']} seeds "
                 f"({data['env']['device']})", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def bytes_per_param(mode: str, r: Dict[str, Any]) -> float:
    """Params + optimizer state bytes over the number of parameters (measured)."""
    return r["total_bytes"] / (r["param_bytes"] / MODES[mode][0].itemsize)


def _bytes_panel(ax, res: Dict[str, Any], colors: Dict[str, str], key: str = "metric",
                 paired: Optional[str] = None) -> Optional[str]:
    """One point per mode at its bytes per parameter: the mean final ``key`` metric over
    the seeds (``paired``: each seed's difference to the same seed's REFERENCE run,
    ``"relative"`` in % or ``"points"``; fp32's where REFERENCE's lacks the metric, as in
    a merged run), the seeds' range as an error bar; modes at the same bytes are spread a
    little sideways. Modes without the metric are left out. Returns the reference used
    (None: nothing drawn, or not paired)."""
    ref_mode = next((m for m in (REFERENCE, "fp32") if res.get(m, {}).get("status") == "ok"
                     and res[m].get(f"{key}_mean") is not None), None)
    if paired and ref_mode is None:
        return None
    ref = res.get(ref_mode, {})
    at: Dict[float, int] = {}
    for mode, r in res.items():
        if r.get("status") != "ok" or r.get(f"{key}_mean") is None:
            continue
        vals = [s[key] for s in r["seeds"]]
        if paired:
            refs = [s[key] for s in ref["seeds"]]
            vals = [100 * (v - w) / w if paired == "relative" else v - w
                    for v, w in zip(vals, refs)]
        mean = statistics.mean(vals)
        b = bytes_per_param(mode, r)
        k = at.get(b, 0)
        at[b] = k + 1
        marker = ("s" if MODES[mode][0] == torch.float32 else "o") if MODES[mode][2] != FP8 \
            else ("D" if MODES[mode][0] == torch.float32 else "^")
        face = colors[mode] if MODES[mode][2] == torch.float32 else "white"
        ax.errorbar(b + 0.15 * k, mean, yerr=[[mean - min(vals)], [max(vals) - mean]],
                    fmt=marker, color=colors[mode], mfc=face, capsize=3, ms=6, label=mode)
    return ref_mode if paired else None


def _color(mode: str) -> str:
    """One color per (param dtype, master); bf16 and 8-bit moments share their
    master's color (dashed and dotted curves, hollow markers)."""
    keys = sorted({MODES[m][:2] for m in MODES}, key=lambda k: list(MODES).index(
        next(m for m in MODES if MODES[m][:2] == k)))
    return f"C{keys.index(MODES[mode][:2]) % 10}"


def _style(mode: str) -> str:
    return {torch.float32: "-", torch.bfloat16: "--"}.get(MODES[mode][2], ":")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", help="output directory (default bench/results, "
                                 "bench/results/cpu-smoke with --quick)")
    p.add_argument("--models", default=",".join(TASKS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", type=int, help="default 3 (1 with --quick)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--note", help="a sentence added to the report (e.g. what else ran)")
    p.add_argument("--merge", action="store_true",
                   help="merge into the saved lean-<device>.json of the output directory: "
                        "its results of the modes not run now are kept (same sizes and "
                        "seeds required), those run now are replaced")
    p.add_argument("--replot", metavar="JSON",
                   help="train nothing: rewrite the markdown and the chart of a saved "
                        "lean-<device>.json (next to it, or into --out)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(Path(args.replot), args.out)
    C.ensure_importable()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def replot(path: Path, out: Optional[str]) -> int:
    """The markdown and the PNG of a saved run, written again by this script."""
    import json
    data = json.loads(path.read_text())
    folder = Path(out) if out else path.parent
    folder.mkdir(parents=True, exist_ok=True)
    stem = path.stem
    (folder / f"{stem}.md").write_text(markdown(data))
    why = chart(data, folder / f"{stem}.png")
    print(f"wrote {folder}/{stem}.md" + (f" (no chart: {why})" if why else ", .png"))
    return 0


SIZE_KEYS = ("seeds", "digits_steps", "digits_batch", "digits_lr", "mlp_steps", "mlp_batch",
             "mlp_lr", "mlp_hidden", "lm_steps", "lm_batch", "lm_seq", "lm_d", "lm_layers",
             "lm_heads", "lm_lr", "lm_eval_every", "lm_eval_batches", "lm_corpus_mb",
             "rn_steps", "rn_warmup", "rn_batch", "rn_image")


def merge(path: Path, new: Dict[str, Any]):
    """``new``'s results over those saved in ``path``: the modes run now replace the
    saved ones, the others are kept. Returns (merged data, a sentence for the report).
    Refused when the sizes or seeds differ (the runs would not be comparable); a size
    the saved run lacks (a model added since, e.g. ``mlp_*``) is not compared. The saved
    run's note and merge record are kept in ``merged`` (``earlier_note``,
    ``earlier_merged``)."""
    import json
    if not path.exists():
        raise SystemExit(f"--merge: no saved run at {path}")
    old = json.loads(path.read_text())
    differ = [k for k in SIZE_KEYS
              if k in old["config"] and old["config"][k] != new["config"].get(k)]
    if differ:
        raise SystemExit(f"--merge: {path} was run with other sizes ({', '.join(differ)})")
    run_now = list(new["config"]["modes"])
    results: Dict[str, Any] = {}
    kept = set()
    kept_of: Dict[str, List[str]] = {}  # model -> its modes kept from the saved run
    models = list(old["results"]) + [m for m in new["results"] if m not in old["results"]]
    for model in sorted(models, key=lambda m: list(TASKS).index(m) if m in TASKS else len(TASKS)):
        got = dict(old["results"].get(model, {}))
        kept |= {m for m in got if m not in run_now}
        now = new["results"].get(model, {})
        if any(m not in now for m in got):
            kept_of[model] = [m for m in got if m not in now]
        got.update(now)
        results[model] = {m: got[m] for m in sorted(got, key=lambda m: (
            list(MODES).index(m) if m in MODES else len(MODES)))}
    modes = [m for m in MODES if any(m in r for r in results.values())]
    data = dict(new, results=results, corpus=new.get("corpus") or old.get("corpus"),
                config=dict(new["config"], models=list(results), modes=modes),
                merged=dict(earlier_date=old["env"].get("date"), kept=sorted(kept),
                            run_now=run_now, models_now=list(new["results"]),
                            earlier_wall_s=old.get("wall_s"), earlier_note=old.get("note"),
                            earlier_merged=old.get("merged"), earlier_env=old["env"]))
    machine = [k for k in ("device", "cpu_model", "cpu_capability", "torch", "python")
               if old["env"].get(k) != new["env"].get(k)]
    kept_text = "; ".join(
        f"{model} ({'all its modes' if not new['results'].get(model) else ', '.join(ms)})"
        for model, ms in kept_of.items())
    sentence = (f"Merged: {', '.join(run_now)} run now on {', '.join(new['results'])} "
                f"({new['wall_s']:.0f} s); kept from the run of {old['env'].get('date')}: "
                f"{kept_text} (same sizes and seeds; the step times of the "
                "two runs are not comparable, the machine's load differs)." + (
                    " The kept run had another " + ", ".join(
                        f"{k} ({old['env'].get(k)}; now {new['env'].get(k)})" for k in machine)
                    + ": its losses need not repeat here to the last digit." if machine else ""))
    return data, sentence


def _run(args) -> int:
    device = C.pick_device(args.device)
    cfg = dict(QUICK if args.quick else FULL)
    if args.seeds:
        cfg["seeds"] = args.seeds
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    for m in models + modes:
        if m not in TASKS and m not in MODES:
            raise SystemExit(f"unknown model or mode {m!r}: models {list(TASKS)}, "
                             f"modes {list(MODES)}")
    env = C.environment(device)
    t_start = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    corpus_desc = None
    results: Dict[str, Any] = {}
    for model in models:
        if model in ("digits", "digits-mlp"):  # (the same split for both)
            data = _load_digits_example().load_data(0, device)
        elif model == "lm":
            data, corpus_desc = stdlib_corpus(cfg["lm_corpus_mb"])
        else:
            data = None
        log(f"{model}: {cfg['seeds']} seeds x {len(modes)} modes")
        results[model] = run_model(model, cfg, modes, cfg["seeds"], data, device, log)
    for res in results.values():
        for r in res.values():
            r["run_date"] = env["date"]
    data = dict(env=env, smoke=args.quick, config=dict(cfg, models=models, modes=modes),
                corpus=corpus_desc, results=results, wall_s=time.time() - t_start)
    note = args.note or ""
    out = C.out_dir(args.out, args.quick)
    slug = C.device_slug(env)
    if args.merge:
        data, merged_note = merge(out / f"lean-{slug}.json", data)
        note = (note + " " + merged_note).strip()
    data["bar"] = evaluate_bar(data["results"])
    data["bar8"] = evaluate_bar8(data["results"])
    if device.type == "cpu":
        data["note"] = ("Timings are wall clock on the CPU, noisy where the machine is "
                        "shared; the modes are interleaved so that noise falls on all of "
                        "them alike. " + note).strip()
    md = markdown(data)
    C.write_json(out / f"lean-{slug}.json", data)
    (out / f"lean-{slug}.md").write_text(md)
    why = chart(data, out / f"lean-{slug}.png")
    print(md)
    print(f"wrote {out}/lean-{slug}.{{md,json}}" + (f" (no chart: {why})" if why else ", .png"))
    C.copy_out([out / f"lean-{slug}.{e}" for e in ("md", "json", "png")],
               bool(args.out), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
