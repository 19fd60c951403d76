"""End-to-end training throughput: FP32 vs mixed precision, PyTorch AMP vs mixedprec.

Models (synthetic data, generated once on the device): torchvision's ResNet-18 and
ResNet-50 (224x224 images, 1000 classes; images/s) and a GPT-2-small-shaped causal
language model written here (12 layers, d=768, 12 heads, sequence 1024, vocabulary
50304 = GPT-2's 50257 padded to a multiple of 64; tokens/s).

Modes:

=====  ==========================================================================
fp32   FP32 with TF32 off (matmul and cuDNN)
tf32   FP32 storage, TF32 matmuls and convolutions
amp    torch.autocast + torch.amp.GradScaler + torch.optim.SGD(fused=True)
       (AdamW(fused=True) for the language model)
o1     mixedprec.amp.initialize(opt_level="O1") (autocast, dynamic loss scale)
o2     mixedprec.amp O2: fp16 model with fp32 batchnorm, fp32 master weights
o3     mixedprec.amp O3: the whole model in fp16, no masters
none   the whole model in bf16, mixedprec.optim.SGD(momentum=0.9) / AdamW with
       master="none" (no masters, no loss scale) and precision_report=True: the run
       line and the results add the updates that bf16 lost, per layer
=====  ==========================================================================

fp32, tf32 and amp use torch.optim.SGD(momentum=0.9, fused=True) for the ResNets
and torch.optim.AdamW(fused=True) for the transformer; o1/o2/o3 use
mixedprec.FusedSGD(momentum=0.9) and mixedprec.FusedAdam (masters at O2). The mixed
modes run the ResNets in channels_last (fp32/tf32 in the default NCHW) and allow
TF32 for what stays in fp32. Each run: warm-up steps (cuDNN autotuning included),
then timed steps with CUDA events between steps and one synchronisation at the end;
the median step time gives the throughput. Peak memory is
torch.cuda.max_memory_allocated over the run (weights, optimizer state, batch,
activations). The largest ResNet-50 batch that fits at FP32 and at O2 is found by a
doubling then bisecting search over full training steps, catching OOM, bounded in
time.

With no arguments: the full GPU run when CUDA is available (time-budgeted to stay
under about 4 minutes on an H100), else a CPU smoke run (ResNet-18 at batch 2 on 32x32 images
and a tiny transformer at sequence 32, fp32/O1/O2 in bf16, 2 steps each) written to
bench/results/cpu-smoke/ so that it never reads as a result.
"""

import argparse
import importlib.util
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _load_common():
    name = "mixedprec_bench_common"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("common.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


C = _load_common()

MODES = ("fp32", "tf32", "amp", "o1", "o2", "o3", "none")
MIXED = ("amp", "o1", "o2", "o3", "none")
MODELS: Dict[str, Dict[str, Any]] = {
    "resnet18": dict(kind="conv", label="Resnet18"),
    "resnet50": dict(kind="conv", label="Resnet50"),
    "gpt2-small": dict(kind="lm", label="GPT2small", layers=12, d=768, heads=12, seq=1024,
                       vocab=50304),
    "gpt-tiny": dict(kind="lm", label="GPTtiny", layers=2, d=64, heads=2, seq=32, vocab=512),
}
LR_SGD, MOMENTUM, LR_ADAM, WD_ADAM = 0.01, 0.9, 1e-4, 0.01

# H100 targets (reported, never enforced).
TARGET_O2_VS_AMP = 1.05
TARGET_MIXED_VS_FP32_RN50 = 2.5
TARGET_MAX_BATCH_RATIO = 1.8


# --- the language model -----------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (scaled_dot_product_attention)
    and a 4x GELU MLP, as GPT-2."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class CausalLM(nn.Module):
    """GPT-2-shaped decoder: token + position embeddings, blocks, final LayerNorm,
    output projection tied to the token embedding."""

    def __init__(self, vocab: int, seq: int, layers: int, d: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --- one configuration --------------------------------------------------------------------

def set_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


class Runner:
    """A model, its optimizer and a synthetic batch in one mode; ``step()`` is one
    training step (no host synchronisation)."""

    def __init__(self, name: str, mode: str, device: torch.device, dtype: torch.dtype,
                 image_size: int, seq: Optional[int], overflow_report: bool = False):
        import mixedprec
        from mixedprec import amp

        self.spec = spec = MODELS[name]
        self.mode, self.device, self.dtype = mode, device, dtype
        self.conv = spec["kind"] == "conv"
        self.image_size = image_size
        self.seq = seq or spec.get("seq")
        self.channels_last = self.conv and mode in MIXED
        set_tf32(mode != "fp32")
        with torch.device(device):  # initialise the weights on the device
            if self.conv:
                import torchvision
                model = getattr(torchvision.models, name)(num_classes=1000)
            else:
                model = CausalLM(spec["vocab"], self.seq, spec["layers"], spec["d"], spec["heads"])
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if mode == "none":
            if dtype != torch.bfloat16:
                raise ValueError("mode none trains the whole model in bf16: run it with "
                                 "--dtype bf16")
            model = model.to(torch.bfloat16)
        params = list(model.parameters())
        if mode == "none":
            # The lean mode without masters; the precision report counts what bf16 loses.
            self.optimizer_name = ("mixedprec.optim.SGD(momentum=0.9, master='none')"
                                   if self.conv else "mixedprec.optim.AdamW(master='none')")
            opt = (mixedprec.optim.SGD(params, lr=LR_SGD, momentum=MOMENTUM, master="none",
                                       precision_report=True) if self.conv
                   else mixedprec.optim.AdamW(params, lr=LR_ADAM, weight_decay=WD_ADAM,
                                              master="none", precision_report=True))
        elif mode in ("fp32", "tf32", "amp"):
            self.optimizer_name = ("torch.optim.SGD(momentum=0.9, fused=True)" if self.conv
                                   else "torch.optim.AdamW(fused=True)")
            opt = (torch.optim.SGD(params, lr=LR_SGD, momentum=MOMENTUM, fused=True) if self.conv
                   else torch.optim.AdamW(params, lr=LR_ADAM, weight_decay=WD_ADAM, fused=True))
        else:
            self.optimizer_name = ("mixedprec.FusedSGD(momentum=0.9)" if self.conv
                                   else "mixedprec.FusedAdam")
            opt = (mixedprec.FusedSGD(params, lr=LR_SGD, momentum=MOMENTUM) if self.conv
                   else mixedprec.FusedAdam(params, lr=LR_ADAM, weight_decay=WD_ADAM))
        self.scaler = None
        if mode == "amp":
            self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        elif mode in ("o1", "o2", "o3"):
            kw = {"cast_model_type": torch.bfloat16} if dtype == torch.bfloat16 else {}
            # overflow_report counts overflows per layer (a per-tensor norm pass a
            # step); without it, steps, skipped steps and the scale only.
            model, opt = amp.initialize(model, opt, opt_level=mode.upper(), verbosity=0,
                                        overflow_report=overflow_report, **kw)
        self.model, self.opt, self.amp = model, opt, amp
        self.x = self.y = None

    def set_batch(self, batch: Optional[int]) -> None:
        self.x = self.y = None
        if batch is None:
            return
        dev = self.device
        if self.conv:
            x = torch.randn(batch, 3, self.image_size, self.image_size, device=dev,
                            dtype=torch.bfloat16 if self.mode == "none" else None)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            self.x, self.y = x, torch.randint(0, 1000, (batch,), device=dev)
        else:
            vocab = self.spec["vocab"]
            self.x = torch.randint(0, vocab, (batch, self.seq), device=dev)
            self.y = torch.randint(0, vocab, (batch, self.seq), device=dev)

    def _loss(self, out: torch.Tensor) -> torch.Tensor:
        if self.conv:
            return F.cross_entropy(out, self.y)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), self.y.reshape(-1))

    def step(self) -> torch.Tensor:
        opt = self.opt
        opt.zero_grad(set_to_none=True)
        if self.mode == "none":
            loss = self._loss(self.model(self.x).float())
            loss.backward()
            opt.step()
        elif self.mode in ("fp32", "tf32"):
            loss = self._loss(self.model(self.x))
            loss.backward()
            opt.step()
        elif self.mode == "amp":
            with torch.autocast(self.device.type, dtype=self.dtype):
                loss = self._loss(self.model(self.x))
            self.scaler.scale(loss).backward()
            self.scaler.step(opt)
            self.scaler.update()
        else:
            # O1's model returns autocast's fp16 logits: the loss is taken in fp32, as
            # autocast does for cross_entropy in the AMP run (O2/O3 return fp32 already).
            loss = self._loss(self.model(self.x).float())
            with self.amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        return loss

    def loss_scale(self) -> Optional[float]:
        """The loss scale after the run (a host read: call after timing)."""
        if self.mode == "amp":
            return self.scaler.get_scale() if self.scaler.is_enabled() else None
        if self.mode in ("o1", "o2", "o3"):
            return float(self.amp.state_dict()["loss_scaler0"]["loss_scale"])
        return None

    def overflow(self) -> Optional[Dict[str, Any]]:
        """amp's overflow report (steps, skipped, overflows by layer, the scale's range;
        a host read: call after timing); None for the other modes."""
        if self.mode not in ("o1", "o2", "o3"):
            return None
        return self.amp.overflow_report()

    def precision(self) -> Optional[Dict[str, Any]]:
        """Mode none's precision report over the run (the updates bf16 lost: in all and
        the layers that lost the largest share; a host read: call after timing)."""
        report = getattr(self.opt, "precision_report", None)
        if report is None:
            return None
        from mixedprec.optim.precision_report import format_precision_report, totals
        layers = report.report(self.model)
        top = sorted(layers.items(), key=lambda item: -item[1]["lost_share"])[:3]
        return dict(summary=format_precision_report(layers),
                    lost_share=totals(layers)["lost_share"],
                    top={name: r["lost_share"] for name, r in top})

    def close(self) -> None:
        self.model = self.opt = self.scaler = self.x = self.y = None
        C.free_memory()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(runner: Runner, warmup: int, steps: int) -> Dict[str, Any]:
    device = runner.device
    for _ in range(warmup):
        runner.step()
    sync(device)
    loss = None
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            loss = runner.step()
            events[i + 1].record()
        sync(device)  # the only synchronisation of the timed steps
        times = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    else:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = runner.step()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"step_ms": times, "median_step_ms": statistics.median(times),
            "loss_end": float(loss.detach().float().item()) if loss is not None else None,
            "host_syncs_per_step": count_host_syncs(runner)}


def count_host_syncs(runner: Runner) -> Optional[int]:
    """The host synchronisations of one more training step, as CUDA's sync debug mode
    reports them (one warning each); None off CUDA."""
    if runner.device.type != "cuda":
        return None
    sync(runner.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(runner.device)
    return sum("synchroniz" in str(w.message) for w in caught)


def run_one(name: str, mode: str, batch: int, device: torch.device, dtype: torch.dtype,
            args) -> Dict[str, Any]:
    half = str(dtype).split(".")[-1]
    row: Dict[str, Any] = dict(model=name, mode=mode, batch=batch,
                               dtype="fp32" if mode in ("fp32", "tf32") else half)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runner = None
    t0 = time.time()
    try:
        runner = Runner(name, mode, device, dtype, args.image_size, args.seq_len,
                        args.overflow_report)
        runner.set_batch(batch)
        row.update(time_steps(runner, args.warmup, args.steps))
        per_step = batch * (1 if runner.conv else runner.seq)
        row.update(status="ok", unit="img/s" if runner.conv else "tok/s",
                   throughput=per_step / (row["median_step_ms"] / 1e3),
                   optimizer=runner.optimizer_name, channels_last=runner.channels_last,
                   loss_scale_end=runner.loss_scale(), overflow=runner.overflow(),
                   precision=runner.precision(),
                   seq=None if runner.conv else runner.seq,
                   image_size=args.image_size if runner.conv else None)
        if row["loss_end"] is not None and not math.isfinite(row["loss_end"]):
            row["warning"] = "non-finite loss at the end of the run"
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001  (recorded; the run exits 1)
        row.update(status="error", error=f"{type(e).__name__}: {e}")
    finally:
        if device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if runner is not None:
            runner.close()
        else:
            C.free_memory()
        row["wall_s"] = time.time() - t0
    return row


# --- largest batch ------------------------------------------------------------------------

def _fits(runner: Runner, batch: int) -> Dict[str, Any]:
    """Two training steps at ``batch``: {"fits": bool} and the error of a failure
    other than torch.OutOfMemoryError (cuDNN/cuBLAS allocation failures, size
    limits), which also counts as not fitting."""
    out: Dict[str, Any] = {"fits": False}
    try:
        runner.set_batch(batch)
        runner.step()
        runner.step()  # the second step runs with all optimizer state allocated
        sync(runner.device)
        out["fits"] = True
    except torch.OutOfMemoryError:
        pass
    except RuntimeError as e:
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    runner.set_batch(None)
    if runner.opt is not None:
        runner.opt.zero_grad(set_to_none=True)
    C.free_memory()
    return out


def max_batch(name: str, mode: str, device: torch.device, dtype: torch.dtype, args,
              budget_s: float, start: int = 128) -> Dict[str, Any]:
    """The largest batch for which two full training steps run without OOM: doubling
    from ``start`` until one fails, then bisecting to ~3% (multiples of 8); stops when
    ``budget_s`` has passed (the result is then a lower bound). cuDNN autotuning is
    off during the search (each probe is a new shape)."""
    t0 = time.time()
    out: Dict[str, Any] = dict(model=name, mode=mode, probes=[])
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    runner = None
    try:
        runner = Runner(name, mode, device, dtype, args.image_size, args.seq_len,
                        args.overflow_report)
        lo, hi, b = 0, None, start
        while True:
            if hi is not None:
                if hi - lo <= max(8, lo // 32):
                    break
                b = max(8, ((lo + hi) // 2) // 8 * 8)
                if b <= lo:
                    break
            if time.time() - t0 > budget_s:
                out["bounded"] = True
                break
            t = time.time()
            probe = _fits(runner, b)
            out["probes"].append(dict(batch=b, seconds=round(time.time() - t, 2), **probe))
            if probe["fits"]:
                lo = b
                if hi is None:
                    b *= 2
                    if b > args.max_batch_cap:
                        break
            else:
                hi = b
        out.update(status="ok", largest=lo, smallest_failing=hi,
                   exact=hi is not None and not out.get("bounded", False))
    except Exception as e:  # noqa: BLE001
        out.update(status="error", error=f"{type(e).__name__}: {e}")
    finally:
        if runner is not None:
            runner.close()
        torch.backends.cudnn.benchmark = benchmark
        out["wall_s"] = time.time() - t0
    return out


# --- report -------------------------------------------------------------------------------

def row_label(name: str, mode: str, dtype: torch.dtype) -> str:
    half = "16" if dtype == torch.float16 else "bf16"
    return MODELS[name]["label"] + {"fp32": "-32", "tf32": "-32 TF32", "amp": f"-{half} AMP",
                                    "o1": f"-{half} O1", "o2": f"-{half} O2",
                                    "o3": f"-{half} O3", "none": "-bf16 none"}[mode]


def _get(runs, name, mode, batch):
    for r in runs:
        if r["model"] == name and r["mode"] == mode and r["batch"] == batch:
            return r
    return None


def _ratio(a: Optional[Dict], b: Optional[Dict], key: str = "throughput") -> Optional[float]:
    if a and b and a.get(key) and b.get(key):
        return a[key] / b[key]
    return None


def evaluate_targets(runs, maxb, smoke: bool) -> List[Dict[str, Any]]:
    out = []

    def add(target, value, threshold):
        passed = None if (smoke or value is None) else value >= threshold
        out.append(dict(target=target, value=None if value is None else round(value, 3),
                        threshold=threshold, passed=passed))

    models = sorted({r["model"] for r in runs}, key=list(MODELS).index)
    counted = [r["host_syncs_per_step"] for r in runs
               if r.get("mode") in ("o1", "o2", "o3") and r.get("host_syncs_per_step") is not None]
    if counted:
        # A negated count, so that "value >= threshold" reads "at most 0 syncs".
        add("O1/O2/O3: host syncs per step (most of any run, negated) >= 0",
            -float(max(counted)), 0.0)
    for name in models:
        for batch in sorted({r["batch"] for r in runs if r["model"] == name}):
            o2, amp_ = _get(runs, name, "o2", batch), _get(runs, name, "amp", batch)
            if o2 and amp_:
                add(f"{MODELS[name]['label']} B={batch}: O2 / AMP >= {TARGET_O2_VS_AMP}",
                    _ratio(o2, amp_), TARGET_O2_VS_AMP)
            fp32 = _get(runs, name, "fp32", batch)
            if name == "resnet50" and o2 and fp32:
                add(f"Resnet50 B={batch}: O2 / FP32 >= {TARGET_MIXED_VS_FP32_RN50}",
                    _ratio(o2, fp32), TARGET_MIXED_VS_FP32_RN50)
    by_mode = {m["mode"]: m for m in maxb if m.get("status") == "ok"}
    if "fp32" in by_mode and "o2" in by_mode and by_mode["fp32"]["largest"]:
        add(f"{MODELS[by_mode['o2']['model']]['label']} largest batch: O2 / FP32 >= "
            f"{TARGET_MAX_BATCH_RATIO}", by_mode["o2"]["largest"] / by_mode["fp32"]["largest"],
            TARGET_MAX_BATCH_RATIO)
    return out


def markdown(data: Dict[str, Any]) -> str:
    env, smoke, runs, cfg = data["env"], data["smoke"], data["runs"], data["config"]
    dtype = torch.float16 if cfg["dtype"] == "float16" else torch.bfloat16
    lines = [f"# Training throughput, FP32 vs mixed precision — {env['device']}", ""]
    lines += C.env_lines(env, smoke)
    lines += [f"- synthetic data; {cfg['warmup']} warm-up + {cfg['steps']} timed steps per run, "
              "median step time; " + ("CUDA events, synchronised at the ends only"
                                      if env["device_type"] == "cuda" else "wall clock"),
              f"- half type of the mixed modes: {cfg['dtype']}; FP32 = TF32 off; mixed modes "
              "in channels_last (ResNets) with TF32 allowed",
              "- optimizers: FP32/TF32/AMP torch.optim.SGD(momentum=0.9, fused=True) (ResNets), "
              "AdamW(fused=True) (transformer); O1/O2/O3 mixedprec.FusedSGD(momentum=0.9) / "
              "mixedprec.FusedAdam", ""]

    def table(kind: str, title: str, key: str, digits: int) -> List[str]:
        names = [n for n in cfg["models"] if MODELS[n]["kind"] == kind]
        if not names:
            return []
        batches = sorted({r["batch"] for r in runs if r["model"] in names})
        header = [title]
        for b in batches:
            header += [f"B={b}", "16/32"]
        body = []
        for name in names:
            for mode in cfg["modes"]:
                row = [row_label(name, mode, dtype)]
                base = None
                for b in batches:
                    r = _get(runs, name, mode, b)
                    base = _get(runs, name, "fp32", b)
                    if r is None:
                        row += ["", ""]
                    elif r.get("status") != "ok" and key == "throughput":
                        row += [r.get("status", ""), ""]
                    else:
                        ratio = _ratio(r, base, key) if mode != "fp32" else None
                        row += [C.fmt(r.get(key), digits), C.fmt(ratio, 2)]
                body.append(row)
        return C.md_table(header, body, "r" * len(header)) + [""]

    lines += ["## Speed", "", "Images/s (ResNets, "
              f"{cfg['image_size']}x{cfg['image_size']}) and the ratio to the FP32 row at the same "
              "batch (16/32, as in the seeds; for the TF32 row: TF32/FP32).", ""]
    lines += table("conv", "Speed (img/s)", "throughput", 1)
    lines += table("lm", "Speed (tok/s)", "throughput", 1)
    if env["device_type"] == "cuda":  # both are measured through CUDA
        lines += ["## Peak memory", "", "torch.cuda.max_memory_allocated (GiB); 16/32: the "
                  "ratio to FP32.", ""]
        lines += table("conv", "Memory (GiB)", "peak_mem_gib", 2)
        lines += table("lm", "Memory (GiB)", "peak_mem_gib", 2)
        lines += ["## Host synchronisations per step", "",
                  "One step after the timed ones under "
                  "`torch.cuda.set_sync_debug_mode(\"warn\")`: the warnings it raised.", ""]
        body = [[row_label(r["model"], r["mode"], dtype), r["batch"], r["host_syncs_per_step"]]
                for r in runs if r.get("host_syncs_per_step") is not None]
        lines += C.md_table(["Run", "batch", "syncs"], body, "lrr") + [""]

    precision = [r for r in runs if r.get("precision")]
    if precision:
        lines += ["## Updates lost to bf16 (mode none)", "",
                  "mixedprec.optim's precision report over each run's steps: the element "
                  "updates that left a bf16 parameter unchanged.", ""]
        lines += [f"- {row_label(r['model'], r['mode'], dtype)} B={r['batch']}: "
                  f"{r['precision']['summary']}" for r in precision] + [""]

    lines += ["## Largest batch", ""]
    if data["max_batch"]:
        body = []
        for m in data["max_batch"]:
            if m.get("status") != "ok":
                body.append([row_label(m["model"], m["mode"], dtype), m.get("status"), "", ""])
                continue
            note = ("exact to ~3%" if m.get("exact") else
                    "lower bound (time budget)" if m.get("bounded") else "lower bound (cap)")
            body.append([row_label(m["model"], m["mode"], dtype), m["largest"],
                         m["smallest_failing"] or "", note])
        fp = next((m for m in data["max_batch"] if m["mode"] == "fp32" and m.get("largest")), None)
        o2 = next((m for m in data["max_batch"] if m["mode"] == "o2" and m.get("largest")), None)
        lines += C.md_table(["Largest batch", "fits", "OOM at", "search"], body, "rrrr")
        if fp and o2:
            lines += ["", f"O2 / FP32: **{o2['largest'] / fp['largest']:.2f}**"]
        lines += [""]
    else:
        lines += [data.get("max_batch_note", "not run"), ""]

    lines += ["## Targets (H100)", ""]
    if smoke:
        lines += ["Not evaluated: CPU smoke run.", ""]
    elif env["device_type"] != "cuda":
        lines += ["Not evaluated: the targets are the H100's; this is a CPU measurement. "
                  "Compare the AMP row (torch: autocast + GradScaler + fused optimizer) with "
                  "the O1/O2 rows (mixedprec) instead.", ""]
    body = [[t["target"], C.fmt(t["value"], 2), C.verdict(t["passed"])] for t in data["targets"]]
    if body:
        lines += C.md_table(["Target", "Value", "Result"], body, "lrr") + [""]
    bad = [r for r in runs if r.get("status") not in ("ok",)]
    if bad:
        lines += ["## Runs that did not complete", ""]
        lines += [f"- {row_label(r['model'], r['mode'], dtype)} B={r['batch']}: {r.get('status')}"
                  f" {r.get('error', '')}" for r in bad] + [""]
    warn = [r for r in runs if r.get("warning")]
    lines += [f"- warning: {row_label(r['model'], r['mode'], dtype)} B={r['batch']}: "
              f"{r['warning']}" for r in warn]
    return "\n".join(lines) + "\n"


def chart(data: Dict[str, Any], path: Path) -> Optional[str]:
    """A bar chart of throughput per model, batch and mode; None when matplotlib is
    missing (the reason is returned instead)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no chart: {e}"
    cfg, runs = data["config"], data["runs"]
    names = [n for n in cfg["models"] if any(r["model"] == n for r in runs)]
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(5.5 * max(1, len(names)), 4.5),
                             squeeze=False)
    modes = list(cfg["modes"])
    width = 0.8 / max(1, len(modes))
    for ax, name in zip(axes[0], names):
        batches = sorted({r["batch"] for r in runs if r["model"] == name})
        for j, mode in enumerate(modes):
            xs, ys = [], []
            for i, b in enumerate(batches):
                r = _get(runs, name, mode, b)
                if r and r.get("throughput"):
                    xs.append(i + (j - (len(modes) - 1) / 2) * width)
                    ys.append(r["throughput"])
            bars = ax.bar(xs, ys, width, label=mode.upper())
            for bar, x in zip(bars, xs):
                b = batches[round(x)]
                ratio = _ratio(_get(runs, name, mode, b), _get(runs, name, "fp32", b))
                if ratio and mode != "fp32":
                    ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                                  bar.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(batches)), [f"B={b}" for b in batches])
        unit = "images/s" if MODELS[name]["kind"] == "conv" else "tokens/s"
        ax.set_ylabel(unit)
        ax.set_title(MODELS[name]["label"])
        ax.legend(fontsize=7)
    title = f"Training throughput — {data['env']['device']}"
    if data["smoke"]:
        title += " (CPU SMOKE RUN, not results)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --- main ---------------------------------------------------------------------------------

def _ints(s: str) -> List[int]:
    return [int(v) for v in s.split(",") if v]


def parse_args(argv: Optional[Sequence[str]], gpu: bool, measure: bool = False):
    """The options; their defaults depend on the device, and on a CPU on --measure (a
    CPU measurement long enough to mean something, instead of the smoke run)."""
    p = argparse.ArgumentParser(
        description="End-to-end training throughput on synthetic data: FP32, TF32, "
                    "torch AMP and mixedprec O1/O2/O3 on ResNet-18/50 and a GPT-2-small-"
                    "shaped transformer, with peak memory and the largest ResNet-50 batch.",
        epilog="With no arguments: the full GPU run when CUDA is available, else a CPU smoke "
               "run (resnet18 at batch 2 on 32x32 images, gpt-tiny at seq 32, fp32/o1/o2 in "
               "bf16) written to bench/results/cpu-smoke/. On a CPU, --measure runs long "
               "enough to mean something (resnet18 at batch 16 on 64x64 images, gpt-tiny at "
               "batch 8 and seq 128, 30 steps, FP32 / torch AMP / O1 / O2 in bf16, all "
               "cores) and writes results to bench/results/.")
    p.add_argument("--measure", action="store_true",
                   help="on a CPU: a measurement instead of the smoke run (see below)")
    p.add_argument("--out", help="output directory (default bench/results, or "
                                 "bench/results/cpu-smoke for a CPU run)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--models",
                   default="resnet18,resnet50,gpt2-small" if gpu else "resnet18,gpt-tiny",
                   help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--batch-sizes", type=_ints,
                   default=[128, 256] if gpu else [16] if measure else [2],
                   help="batch sizes of the ResNets (default 128,256; CPU 2)")
    p.add_argument("--lm-batch-sizes", type=_ints,
                   default=[8, 16] if gpu else [8] if measure else [2],
                   help="batch sizes (sequences) of the transformers (default 8,16; CPU 2)")
    # (none needs --dtype bf16: not in the GPU run's fp16 default)
    p.add_argument("--modes", default=",".join(MODES[:-1]) if gpu else "fp32,amp,o1,o2",
                   help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16" if gpu else "bf16",
                   help="half type of the mixed modes (default fp16 on GPU, bf16 on CPU)")
    p.add_argument("--steps", type=int, default=10 if gpu else 30 if measure else 2,
                   help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3 if gpu else 2 if measure else 1,
                   help="warm-up steps per run")
    p.add_argument("--image-size", type=int, default=224 if gpu else 64 if measure else 32)
    p.add_argument("--seq-len", type=int, help="sequence length of the transformers "
                                               "(default: the model's, 1024 or 32)")
    p.add_argument("--max-batch", dest="max_batch", action="store_true", default=None,
                   help="search the largest batch at FP32 and O2 (default: on with CUDA)")
    p.add_argument("--no-max-batch", dest="max_batch", action="store_false")
    p.add_argument("--max-batch-model", default="resnet50")
    p.add_argument("--overflow-report", action="store_true",
                   help="O1/O2/O3 count overflows per layer (amp's overflow_report: one more read "
                        "of the gradients a step) and the run line names the top ones")
    p.add_argument("--max-batch-budget", type=float, default=60.0,
                   help="seconds for the largest-batch search, both modes together")
    p.add_argument("--max-batch-cap", type=int, default=16384)
    p.add_argument("--time-budget", type=float, default=150.0 if gpu else 600.0,
                   help="seconds for the throughput runs; runs past it are skipped and "
                        "marked so")
    p.add_argument("--threads", type=int,
                   help="CPU threads (default: all cores; 1 on a CPU smoke run, which is not "
                        "a measurement and shares its machine)")
    args = p.parse_args(argv)
    if measure and args.seq_len is None and not gpu:
        args.seq_len = 128
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device")
    pre.add_argument("--measure", action="store_true")
    known, _ = pre.parse_known_args(argv)
    device = C.pick_device(known.device)
    gpu = device.type == "cuda"
    args = parse_args(argv, gpu, known.measure)
    C.ensure_importable()
    import mixedprec  # noqa: F401  (fail early with a clear error)

    smoke = not gpu and not args.measure
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    conv_models = [m for m in models if MODELS[m]["kind"] == "conv"]
    if conv_models:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            print("torchvision is not installed: skipping " + ", ".join(conv_models),
                  file=sys.stderr)
            models = [m for m in models if m not in conv_models]

    threads = torch.get_num_threads()
    if args.threads or smoke:
        torch.set_num_threads(args.threads or 1)
    saved_flags = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
                   torch.backends.cudnn.allow_tf32)
    torch.backends.cudnn.benchmark = True
    try:
        return _run(args, argv, device, smoke, models, modes, dtype)
    finally:
        torch.set_num_threads(threads)
        (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.allow_tf32) = saved_flags


def _overflow_note(r: Dict[str, Any]) -> str:
    """The run line's loss scale, skipped steps and most overflowing layers."""
    note = f"  scale {r['loss_scale_end']:g}" if r.get("loss_scale_end") is not None else ""
    report = r.get("overflow")
    if report and report["steps"]:
        note += f"  skipped {report['skipped']}/{report['steps']}"
        top = list(report["overflows"].items())[:3]
        if top:
            note += " (" + ", ".join(f"{k} {v}" for k, v in top) + ")"
    precision = r.get("precision")
    if precision:
        note += f"  lost {100.0 * precision['lost_share']:.1f}% of updates (" + ", ".join(
            f"{k} {100.0 * v:.0f}%" for k, v in precision["top"].items()) + ")"
    return note


def _run(args, argv, device, smoke, models, modes, dtype) -> int:
    env = C.environment(device)
    out = C.out_dir(args.out, smoke)
    t_start = time.time()
    print(f"mixedprec training benchmark on {env['device']}"
          + (" (CPU SMOKE RUN: not results)" if smoke else ""), flush=True)

    runs: List[Dict[str, Any]] = []
    for name in models:
        batches = args.batch_sizes if MODELS[name]["kind"] == "conv" else args.lm_batch_sizes
        for batch in batches:
            for mode in modes:
                if time.time() - t_start > args.time_budget:
                    runs.append(dict(model=name, mode=mode, batch=batch, status="skipped",
                                     error=f"time budget of {args.time_budget:.0f} s spent"))
                else:
                    runs.append(run_one(name, mode, batch, device, dtype, args))
                r = runs[-1]
                msg = (f"{r['throughput']:10.1f} {r['unit']}  step {r['median_step_ms']:8.2f} ms"
                       + (f"  peak {r['peak_mem_gib']:6.2f} GiB" if "peak_mem_gib" in r else "")
                       + (f"  syncs {r['host_syncs_per_step']}"
                          if r.get("host_syncs_per_step") is not None else "")
                       + _overflow_note(r)
                       if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}")
                print(f"  {row_label(name, mode, dtype):<22} B={batch:<5} {msg}", flush=True)

    maxb: List[Dict[str, Any]] = []
    note = ""
    want = args.max_batch if args.max_batch is not None else True
    if want and device.type != "cuda":
        note = "not run: the largest-batch search needs a GPU (it catches CUDA OOM)"
    elif want and args.max_batch_model not in MODELS:
        note = f"not run: unknown model {args.max_batch_model}"
    elif want and MODELS[args.max_batch_model]["kind"] == "conv" and not any(
            MODELS[m]["kind"] == "conv" for m in models):
        note = "not run: torchvision is missing or no ResNet was selected"
    elif want:
        for mode in ("fp32", "o2"):
            m = max_batch(args.max_batch_model, mode, device, dtype, args,
                          args.max_batch_budget / 2, start=min(args.batch_sizes))
            maxb.append(m)
            print(f"  largest batch {row_label(args.max_batch_model, mode, dtype)}: "
                  f"{m.get('largest')} (OOM at {m.get('smallest_failing')}, "
                  f"{len(m['probes'])} probes, {m['wall_s']:.0f} s)", flush=True)
    else:
        note = "not run (--no-max-batch)"

    data = dict(benchmark="mixedprec training throughput", smoke=smoke,
                argv=list(sys.argv[1:] if argv is None else argv), env=env,
                config=dict(models=models, modes=modes, dtype=str(dtype).split(".")[-1],
                            batch_sizes=args.batch_sizes, lm_batch_sizes=args.lm_batch_sizes,
                            steps=args.steps, warmup=args.warmup, image_size=args.image_size,
                            seq_len=args.seq_len, lr_sgd=LR_SGD, momentum=MOMENTUM,
                            lr_adam=LR_ADAM, weight_decay_adam=WD_ADAM,
                            model_specs={m: MODELS[m] for m in models},
                            threads=torch.get_num_threads()),
                runs=runs, max_batch=maxb, max_batch_note=note)
    # The targets are the H100's: reported, never judged, on a CPU.
    data["targets"] = evaluate_targets(runs, maxb, smoke or device.type != "cuda")
    data["elapsed_s"] = time.time() - t_start
    stem = f"train-{C.device_slug(env)}"
    C.write_json(out / f"{stem}.json", data)
    md = markdown(data)
    (out / f"{stem}.md").write_text(md)
    chart_note = chart(data, out / f"{stem}.png")
    print()
    print(md)
    print(f"wrote {out / stem}.json, .md" + ("" if chart_note else ", .png")
          + f" in {data['elapsed_s']:.0f} s")
    if chart_note:
        print(chart_note, file=sys.stderr)
    copied = C.copy_out([out / f"{stem}.{ext}" for ext in ("json", "md", "png")],
                        bool(args.out), smoke)
    if copied:
        print(f"copied them to {copied}")
    failed = [r for r in runs if r["status"] == "error"] + \
        [m for m in maxb if m.get("status") == "error"]
    if failed:
        print(f"FAILED: {len(failed)} run(s) raised an error", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
