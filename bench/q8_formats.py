"""8-bit Adam moments: which format, block size, scale, root and rounding (issue #20).

A bench-only study in pure PyTorch emulation: the numbers say why the 8-bit state of
``FusedAdam`` is what it is (fp8 e4m3 codes, blocks of 32, a power-of-two scale per
block, the second moment stored as its square root, round to nearest even). Nothing here
calls the 8-bit op: an AdamW written in plain torch (fp32 parameters, weight decay 0.01)
keeps its moments in fp32 buffers and, after every step, passes them through a
quantize -> dequantize function, so each moment holds exactly the values the 8-bit codes
and scales would decode to. The step itself uses the fresh (unrounded) moments, as the
fused kernel does in registers; only what is stored is rounded.

A variant is ``FORMAT-bBLOCK-SCALE-ROOT-ROUNDING``:

=========  ===================================================================
FORMAT     ``e4m3`` (torch.float8_e4m3fn casts: max 448), ``e5m2`` (float8_e5m2:
           max 57344), ``int8`` (linear codes -127..127, the block's absmax maps to
           127), ``dyn`` (a dynamic "tree" map, written from the idea in Dettmers et
           al., "8-bit Optimizers via Block-wise Quantization", 2021: a sign bit, then
           the number of leading zero bits E picks the decade 10^-E, the bits after
           the first one are a linear fraction in (0.1, 1]; unsigned (no sign bit)
           for the second moment; values are normalised by the block's absmax)
BLOCK      consecutive elements of each flattened tensor sharing one scale (32, 128,
           2048); a tensor's last block is padded with zeros
SCALE      ``pow2``: the smallest power of two 2^e with absmax * 2^-e <= the format's
           max (an e8m0 byte: dequantize -> requantize is exact); ``absmax``: the
           exact scale absmax / max (an fp32 per block)
ROOT       ``sqrt``: the second moment is stored as s = sqrt(v) (v_old = s^2 next
           step); ``v``: stored as v
ROUNDING   ``rn``: to nearest (even); ``sr``: stochastic (torch.rand, unbiased)
=========  ===================================================================

``fp32`` is the baseline (no quantization). ``fp32-jitter`` is the noise floor: fp32
moments multiplied by (1 + d), d uniform in +-2^-20 (a few fp32 units in the last place),
after every step; its gap to ``fp32`` is how far two runs drift apart from a perturbation
that carries no information (training amplifies any difference), the yardstick for every
other gap. The first moment is stored as itself
(signed codes) in every variant. By default every parameter's moments are quantized
(``--eligible all``: a harder test than the op, which keeps fp32 moments for small
tensors); ``--eligible spec`` quantizes only what the op would (dim >= 2, numel >= 4096,
rows of whole 32-blocks), which leaves the digits CNN with no 8-bit state at all.

Models and data are bench/lean.py's (imported, not copied): the digits CNN (test loss
and accuracy), the byte-level LM on the standard library's sources (held-out loss and
next-byte accuracy), ResNet-18 on lean.py's fixed synthetic batch (memorisation: the
final training loss and accuracy on that batch). lean.py's learning-rate schedule
(warm-up, cosine to lr/20). Per seed every variant starts from the same weights and sees
the same batches; variants run one after another (the results do not depend on timing).

Reported per model and variant: final loss and accuracy, mean and sample standard
deviation over the seeds, and the gap to fp32 moments paired per seed (mean and std of
the per-seed differences); issue #20's bar (within 0.5% of the fp32-moment loss and 0.3
points of accuracy) per variant; and each axis of the chosen variant against its
alternatives. Writes ``q8-formats-<device>.json`` and ``.md`` to bench/results (or
``--out``; ``--quick``, a few seconds, to bench/results/cpu-smoke). ``--replot JSON``
rewrites the markdown of a saved run (with ``--note`` for the conclusions), training
nothing.
"""

import argparse
import importlib.util
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F


def _load(name: str):
    module_name = f"mixedprec_bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            module_name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


lean = _load("lean")
C = lean.C

# --- the element formats --------------------------------------------------------------------

# name -> (largest code value, torch dtype of the cast, mantissa bits, smallest normal exponent)
FLOATS = {"e4m3": (448.0, torch.float8_e4m3fn, 3, -6),
          "e5m2": (57344.0, torch.float8_e5m2, 2, -14)}
INT8_MAX = 127.0
FORMATS = ("e4m3", "e5m2", "int8", "dyn")
CHOSEN = "e4m3-b32-pow2-sqrt-rn"  # docs: the lead's format (q8spec)
BASELINE = "fp32"
JITTER = "fp32-jitter"  # the noise floor
JITTER_REL = 2.0 ** -20
BAR_LOSS_REL = 0.005  # issue #20: within 0.5% of the fp32-moment loss
BAR_ACC_POINTS = 0.3  # and 0.3 points of accuracy


def dynamic_map(signed: bool) -> torch.Tensor:
    """The sorted code values of the dynamic tree map on [-1, 1] ([0, 1] unsigned):
    after the sign bit (if any), E leading zero bits pick the decade 10^-E, the first
    one bit ends them, and the F bits after it split (0.1, 1] into 2^F equal steps
    (the upper end of each: 1.0 is a code). All-zero is 0. 255 values signed, 256
    unsigned."""
    bits = 7 if signed else 8
    mags = [0.0]
    for e in range(bits):
        f = bits - e - 1
        mags += [10.0 ** -e * (0.1 + 0.9 * (k + 1) / 2 ** f) for k in range(2 ** f)]
    vals = sorted(set(mags + ([-m for m in mags] if signed else [])))
    return torch.tensor(vals, dtype=torch.float32)


_DYN: Dict[bool, torch.Tensor] = {}


def _dyn_nearest(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """Each element of y (in [-1, 1]) to the nearest value of the dynamic map."""
    if signed not in _DYN:
        _DYN[signed] = dynamic_map(signed)
    table = _DYN[signed].to(y.device)
    hi = torch.searchsorted(table, y.contiguous()).clamp_(1, len(table) - 1)
    up, down = table[hi], table[hi - 1]
    return torch.where((up - y) < (y - down), up, down)


@dataclass(frozen=True)
class Variant:
    fmt: str  # e4m3 | e5m2 | int8 | dyn
    block: int
    scale: str  # pow2 | absmax
    root: bool  # second moment stored as sqrt(v)
    stochastic: bool

    @property
    def name(self) -> str:
        return (f"{self.fmt}-b{self.block}-{self.scale}-{'sqrt' if self.root else 'v'}-"
                f"{'sr' if self.stochastic else 'rn'}")

    @staticmethod
    def parse(name: str) -> Optional["Variant"]:
        """None for ``fp32`` and ``fp32-jitter``; raises ValueError naming what is wrong
        otherwise."""
        if name in (BASELINE, JITTER):
            return None
        parts = name.split("-")
        if (len(parts) != 5 or parts[0] not in FORMATS or not parts[1].startswith("b")
                or not parts[1][1:].isdigit() or parts[2] not in ("pow2", "absmax")
                or parts[3] not in ("sqrt", "v") or parts[4] not in ("rn", "sr")):
            raise ValueError(f"variant {name!r}: expected fp32, fp32-jitter or FORMAT-bBLOCK-"
                             f"SCALE-ROOT-ROUNDING with FORMAT in {FORMATS}, SCALE pow2|absmax, "
                             "ROOT sqrt|v, ROUNDING rn|sr (e.g. e4m3-b32-pow2-sqrt-rn)")
        v = Variant(parts[0], int(parts[1][1:]), parts[2], parts[3] == "sqrt", parts[4] == "sr")
        if v.block < 1:
            raise ValueError(f"variant {name!r}: block must be >= 1")
        if v.fmt == "dyn" and v.stochastic:
            raise ValueError(f"variant {name!r}: the dynamic map rounds to nearest only")
        return v


def _pow2_exponent(a: torch.Tensor, fmax: float) -> torch.Tensor:
    """The smallest integer e with a * 2^-e <= fmax (a > 0), clamped to e8m0's
    [-127, 127]; 0 where a == 0."""
    pos = a > 0
    a_ = torch.where(pos, a, torch.ones_like(a))
    e = torch.ceil(torch.log2(a_ / fmax))
    e = torch.where(torch.ldexp(a_, -e) > fmax, e + 1, e)  # log2 rounded down
    e = torch.where(torch.ldexp(a_, -(e - 1)) <= fmax, e - 1, e)  # log2 rounded up
    return torch.where(pos, e, torch.zeros_like(e)).clamp_(-127, 127)


def qdq(blocks: torch.Tensor, v: Variant, signed: bool = True,
        generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Quantize the rows of ``blocks`` (n_blocks x block, fp32) to ``v``'s 8-bit codes
    with one scale per row and decode them again: the values the 8-bit state holds.
    ``signed=False`` (only read by the dynamic map): the values are >= 0 and all 8
    bits are magnitude."""
    a = blocks.abs().amax(1, keepdim=True)
    fmax = 1.0 if v.fmt == "dyn" else FLOATS[v.fmt][0] if v.fmt in FLOATS else INT8_MAX
    if v.scale == "pow2":
        scale = torch.ldexp(torch.ones_like(a), _pow2_exponent(a, fmax))
    else:
        scale = torch.where(a > 0, a / fmax, torch.ones_like(a))
    y = (blocks / scale).clamp_(-fmax, fmax)
    rand = (lambda: torch.rand(y.shape, generator=generator, device=y.device)) \
        if v.stochastic else None
    if v.fmt in FLOATS:
        _, dtype, mbits, emin = FLOATS[v.fmt]
        if rand is None:
            q = y.to(dtype).float()
        else:  # floor(|y| / ulp + u) * ulp, ulp of |y|'s binade (subnormals: emin's)
            _, ex = torch.frexp(y)
            ulp = torch.ldexp(torch.ones_like(y), (ex - 1).clamp_(min=emin) - mbits)
            q = torch.floor(y.abs() / ulp + rand()) * ulp * torch.sign(y)
    elif v.fmt == "int8":
        q = torch.round(y) if rand is None else torch.floor(y + rand())
    else:
        q = _dyn_nearest(y, signed)
    return q * scale


# --- the optimizer ---------------------------------------------------------------------------

def spec_eligible(p: torch.Tensor) -> bool:
    """The op's rule (q8spec): dim >= 2, numel >= 4096, each dim-0 row whole 32-blocks."""
    return p.dim() >= 2 and p.numel() >= 4096 and (p.numel() // p.shape[0]) % 32 == 0


class EmulatedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) on fp32 parameters whose stored
    moments pass through ``qdq`` after every step (``variant=None``: fp32 moments).
    The state lives in flat buffers in which every tensor starts on a block boundary
    (zero padding between them), so that blocks never span two tensors; tensors that
    are not quantized (``eligible="spec"``) keep their exact values. ``jitter``
    (variant None only): the fp32 moments are multiplied by 1 + U(-2^-20, 2^-20) after
    every step instead (the noise floor)."""

    def __init__(self, params, lr: float, variant: Optional[Variant], betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, eligible: str = "all",
                 generator: Optional[torch.Generator] = None, jitter: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if len(self.param_groups) != 1:
            raise ValueError("EmulatedAdamW takes one parameter group")
        if eligible not in ("all", "spec"):
            raise ValueError(f"eligible must be 'all' or 'spec', got {eligible!r}")
        if jitter and variant is not None:
            raise ValueError("jitter is the fp32 noise floor: it needs variant=None")
        self.variant, self.generator, self.jitter = variant, generator, jitter
        self.params: List[torch.Tensor] = list(self.param_groups[0]["params"])
        block = variant.block if variant else 1
        p0 = self.params[0]
        starts, pos, quantized = [], 0, []
        for p in self.params:
            starts.append(pos)
            n = -(-p.numel() // block) * block
            quantized.append(variant is not None and (eligible == "all" or spec_eligible(p)))
            pos += n
        kw = dict(dtype=torch.float32, device=p0.device)
        self.m, self.s, self.g = (torch.zeros(pos, **kw) for _ in range(3))
        self.g_views = [self.g[s:s + p.numel()] for s, p in zip(starts, self.params)]
        self.starts = starts
        self.mask = None
        if variant is not None and not all(quantized):
            self.mask = torch.zeros(pos, dtype=torch.bool, device=p0.device)
            for s, p, q in zip(starts, self.params, quantized):
                if q:
                    self.mask[s:s + -(-p.numel() // block) * block] = True
        self.quantized_elems = sum(p.numel() for p, q in zip(self.params, quantized) if q)
        self.t = 0
        # Sums over the steps (device tensors, read once after training): the relative L2
        # error of what is stored, and the fraction of nonzero values stored as zero.
        self.diag = torch.zeros(4, dtype=torch.float64, device=p0.device)
        # The exact (fp32) moments of the same gradients, beside the stored ones: how far
        # what is stored drifts from what Adam means over the run (no effect on training).
        self.shadow = None if variant is None else (self.m.clone(), self.s.clone())

    def diagnostics(self) -> Dict[str, float]:
        """Means over the steps: ``m_rel_err`` = |m_stored - m| / |m|, ``v_rel_err`` the
        same for the second moment as v (squared where the root is stored), and
        ``m_flushed`` / ``v_flushed``, the fraction of the nonzero values stored as 0."""
        d = (self.diag / max(1, self.t)).tolist()  # sync-ok: after training
        out = dict(m_rel_err=d[0], m_flushed=d[1], v_rel_err=d[2], v_flushed=d[3])
        if self.shadow is not None:
            out.update(self.drift())
        return out

    def drift(self) -> Dict[str, float]:
        """The stored moments against the exact ones of the same gradients (the shadow),
        over the quantized elements: ``m_drift`` = |m - m_exact| / |m_exact|;
        ``denom_ratio`` = the median of sqrt(v) / sqrt(v_exact) (the Adam denominator's
        factor; 1: faithful) over the elements with v_exact > 0, and ``denom_off``, the
        share of them off by more than 25% (below 0.8 or above 1.25)."""
        m_ex, v_ex = self.shadow
        v = self.s.square() if self.variant.root else self.s
        sel = v_ex > 0
        if self.mask is not None:
            sel &= self.mask
        ratio = (v[sel] / v_ex[sel]).sqrt()
        keep = slice(None) if self.mask is None else self.mask
        if not ratio.numel():
            return {}
        return dict(  # sync-ok: after training
            m_drift=((self.m[keep] - m_ex[keep]).norm() / m_ex[keep].norm()).item(),
            denom_ratio=ratio.median().item(),
            denom_off=((ratio < 0.8) | (ratio > 1.25)).float().mean().item())

    def _measure(self, stored: torch.Tensor, exact: torch.Tensor, at: int, square: bool):
        if square:
            stored, exact = stored.square(), exact.square()
        nz = exact != 0
        self.diag[at] += ((stored - exact).norm() / exact.norm().clamp_min(1e-30)).double()
        self.diag[at + 1] += ((nz & (stored == 0)).sum() / nz.sum().clamp_min(1)).double()

    def _store(self, x: torch.Tensor, signed: bool) -> torch.Tensor:
        v = self.variant
        if v is None:
            if self.jitter:
                u = torch.rand(x.shape, generator=self.generator, device=x.device)
                return x * (1 + JITTER_REL * (2 * u - 1))
            return x
        q = qdq(x.view(-1, v.block), v, signed, self.generator).view(-1)
        return q if self.mask is None else torch.where(self.mask, q, x)

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        self.t += 1
        for p, gv in zip(self.params, self.g_views):
            if p.grad is None:
                gv.zero_()
            else:
                gv.copy_(p.grad.reshape(-1))
        root = self.variant is not None and self.variant.root
        if self.shadow is not None:
            self.shadow[0].mul_(b1).add_(self.g, alpha=1 - b1)
            self.shadow[1].mul_(b2).addcmul_(self.g, self.g, value=1 - b2)
        m = self.m.mul(b1).add_(self.g, alpha=1 - b1)
        v = (self.s.square() if root else self.s.clone()).mul_(b2).addcmul_(
            self.g, self.g, value=1 - b2)
        s = v.sqrt()
        denom = (s / math.sqrt(1 - b2 ** self.t)).add_(eps)
        upd = (m / denom).mul_(-lr / (1 - b1 ** self.t))
        torch._foreach_mul_(self.params, 1 - lr * wd)
        torch._foreach_add_(self.params, [upd[st:st + p.numel()].view_as(p)
                                          for st, p in zip(self.starts, self.params)])
        self.m = self._store(m, signed=True)
        self.s = self._store(s if root else v, signed=False)
        if self.variant is not None:
            self._measure(self.m, m, 0, False)
            self._measure(self.s, s if root else v, 2, root)
        return None


# --- the runs --------------------------------------------------------------------------------

VARIANTS = [
    BASELINE,
    JITTER,
    CHOSEN,
    "e4m3-b32-pow2-sqrt-sr",     # rounding
    "e4m3-b32-pow2-v-sr",
    "e4m3-b32-pow2-v-rn",        # root
    "e4m3-b32-absmax-sqrt-rn",   # scale
    "e4m3-b128-pow2-sqrt-rn",    # block
    "e4m3-b2048-pow2-sqrt-rn",
    "e5m2-b32-pow2-sqrt-rn",     # format
    "e5m2-b32-pow2-v-rn",
    "int8-b32-absmax-sqrt-rn",
    "int8-b32-absmax-v-rn",
    "int8-b32-absmax-sqrt-sr",
    "int8-b2048-absmax-sqrt-rn",
    "dyn-b2048-absmax-v-rn",     # the bitsandbytes-like recipe (v, blocks of 2048)
    "dyn-b32-absmax-sqrt-rn",
]
# ResNet-18's 11.2M parameters make each emulated step 2-6x fp32's (stochastic rounding
# and the dynamic map's table search the slowest): by default it runs the baselines, the
# chosen variant and one alternative per axis (scale and the dynamic map left out).
RESNET_VARIANTS = [BASELINE, JITTER, CHOSEN, "e4m3-b32-pow2-sqrt-sr", "e4m3-b32-pow2-v-rn",
                   "e4m3-b2048-pow2-sqrt-rn", "e5m2-b32-pow2-sqrt-rn", "int8-b32-absmax-sqrt-rn"]

# Full run (17 variants, 8 on ResNet-18, x 3 seeds: 2011 s on 1 thread of a loaded 2-core
# AMD EPYC, about 16 min idle; bench/README.md) and --quick (a few seconds).
FULL = dict(lean.FULL, seeds=3, digits_steps=1200, lm_steps=300, rn_steps=20, rn_warmup=0,
            rn_batch=8, rn_lr=1e-3, probe_rise=500, probe_steps=3000,
            probe_at=[10, 100, 500, 1000, 2000, 3000])
QUICK = dict(lean.QUICK, seeds=1, digits_steps=20, lm_steps=10, rn_steps=2, rn_warmup=0,
             rn_batch=2, rn_lr=1e-3, probe_rise=20, probe_steps=60, probe_at=[10, 20, 60])
MODELS = ("digits", "lm", "resnet18")


def _with_emulated_adam(cls):
    """A lean.py task whose optimizer is EmulatedAdamW: the task is built in its fp32
    mode (fp32 params; the FusedAdam it makes is replaced before any step)."""

    class Emulated(cls):
        def __init__(self, variant_name, seed, cfg, data, device, eligible):
            super().__init__("fp32", seed, cfg, data, device)
            gen = torch.Generator(device=device).manual_seed(1000 + seed)
            self.opt = EmulatedAdamW(self.model.parameters(), lr=self.lr,
                                     variant=Variant.parse(variant_name), eligible=eligible,
                                     generator=gen, jitter=variant_name == JITTER)

    Emulated.__name__ = f"Emulated{cls.__name__}"
    return Emulated


class DigitsRun(_with_emulated_adam(lean.DigitsTask)):
    @torch.no_grad()
    def evaluate(self):
        """Test loss and accuracy (%) on the held-out split."""
        self.model.eval()
        out = self.model(self.x_test)
        self.model.train()
        return (F.cross_entropy(out, self.y_test).item(),  # sync-ok: evaluation
                100.0 * (out.argmax(1) == self.y_test).float().mean().item())


class LMRun(_with_emulated_adam(lean.LMTask)):
    @torch.no_grad()
    def evaluate(self):
        """Held-out loss (nats/byte) and next-byte accuracy (%) on lean.py's fixed
        held-out windows."""
        loss = torch.zeros((), device=self.device)
        hits = torch.zeros((), device=self.device)
        n = 0
        for s in range(0, len(self.eval_x), self.eval_b):
            x, y = self.eval_x[s:s + self.eval_b], self.eval_y[s:s + self.eval_b]
            out = self.model(x).float().reshape(-1, 256)
            loss += F.cross_entropy(out, y.reshape(-1), reduction="sum")
            hits += (out.argmax(1) == y.reshape(-1)).sum()
            n += y.numel()
        return (loss / n).item(), 100.0 * (hits / n).item()  # sync-ok: evaluation


class ResNetRun(_with_emulated_adam(lean.ResNetTask)):
    def __init__(self, variant_name, seed, cfg, data, device, eligible):
        super().__init__(variant_name, seed, cfg, data, device, eligible)
        for g in self.opt.param_groups:  # lean.py's ResNet learning rate is fixed
            g["lr"] = cfg["rn_lr"]
        self.lr = cfg["rn_lr"]

    @torch.no_grad()
    def evaluate(self):
        """Loss and accuracy (%) on the training batch itself (train-mode batchnorm, as
        in training): how far the batch is memorised."""
        out = self.model(self.x).float()
        return (F.cross_entropy(out, self.y).item(),  # sync-ok: evaluation
                100.0 * (out.argmax(1) == self.y).float().mean().item())


def decay_probe(names: Sequence[str], cfg: Dict[str, Any]) -> Dict[str, List[float]]:
    """The stored sqrt(v) of one element whose gradient is 1 for ``probe_rise`` steps,
    then 0.01 (another element of its block keeps gradient 1, holding the block's
    scale), read at the steps ``probe_at``; lr 0, so only the state moves. fp32's row is
    the exact EMA: sqrt(1 - 0.999^t) while rising, then decaying towards 0.01."""
    out = {}
    for name in names:
        v = Variant.parse(name)
        n = max(32, v.block if v else 32)
        p = torch.zeros(n, requires_grad=True)
        opt = EmulatedAdamW([p], lr=0.0, variant=v, weight_decay=0.0, jitter=name == JITTER,
                            generator=torch.Generator().manual_seed(0))
        g, low = torch.ones(n), torch.full((n,), 0.01)
        low[0] = 1.0
        vals = []
        for t in range(1, cfg["probe_steps"] + 1):
            p.grad = g if t <= cfg["probe_rise"] else low
            opt.step()
            if t in cfg["probe_at"]:
                x = opt.s[1]
                vals.append((x if v is not None and v.root else x.sqrt()).item())  # sync-ok
        out[name] = vals
    return out


RUNS = {"digits": DigitsRun, "lm": LMRun, "resnet18": ResNetRun}
STEPS = {"digits": "digits_steps", "lm": "lm_steps", "resnet18": "rn_steps"}


def run_model(name, cfg, variants, data, device, eligible, log) -> Dict[str, Any]:
    out: Dict[str, Any] = {v: {"seeds": []} for v in variants}
    steps = cfg[STEPS[name]]
    for seed in range(cfg["seeds"]):
        for vname in variants:
            t0 = time.perf_counter()
            task = RUNS[name](vname, seed, cfg, data, device, eligible)
            losses = [task.step(i) for i in range(steps)]
            loss, acc = task.evaluate()
            train = torch.stack(losses).float()
            r = dict(seed=seed, loss=loss, acc=acc,
                     train_loss_last=train[-max(1, steps // 20):].mean().item(),  # sync-ok
                     nonfinite=not bool(torch.isfinite(train).all()),  # sync-ok: after training
                     wall_s=time.perf_counter() - t0,
                     quantized_elems=task.opt.quantized_elems, **task.opt.diagnostics(),
                     elems=sum(p.numel() for p in task.opt.params))
            out[vname]["seeds"].append(r)
            log(f"  {name} seed {seed} {vname}: loss {loss:.4f} acc {acc:.2f} "
                f"({r['wall_s']:.1f} s)")
    return out


def _paired(runs: Sequence[Dict[str, Any]], refs: Sequence[Dict[str, Any]]):
    """Per seed: the relative loss difference (%) and the accuracy difference (points)
    of ``runs`` to ``refs``; None where a loss is not finite."""
    def ok(x):
        return x is not None and math.isfinite(x)
    rel = [100 * (s["loss"] - b["loss"]) / b["loss"] if ok(s["loss"]) and ok(b["loss"])
           else None for s, b in zip(runs, refs)]
    pts = [s["acc"] - b["acc"] for s, b in zip(runs, refs)]
    return rel, pts


def _stats(xs: Sequence[float]):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(results: Dict[str, Dict[str, Any]]) -> None:
    """Means, stds and the paired gaps to fp32 (per seed) into each variant's entry."""
    for res in results.values():
        base = res.get(BASELINE, {}).get("seeds", [])
        for r in res.values():
            seeds = r["seeds"]
            r["loss_mean"], r["loss_std"] = _stats([s["loss"] for s in seeds])
            r["acc_mean"], r["acc_std"] = _stats([s["acc"] for s in seeds])
            r["nonfinite"] = any(s["nonfinite"] or s["loss"] is None
                                 or not math.isfinite(s["loss"]) for s in seeds)
            if base:
                rel, pts = _paired(seeds, base)
                r["loss_gap_pct_mean"], r["loss_gap_pct_std"] = _stats(rel)
                r["acc_gap_mean"], r["acc_gap_std"] = _stats(pts)
                r["bar"] = (False if r["nonfinite"] else None if r["loss_gap_pct_mean"] is None
                            else r["loss_gap_pct_mean"] <= 100 * BAR_LOSS_REL
                            and r["acc_gap_mean"] >= -BAR_ACC_POINTS)


# --- the report ------------------------------------------------------------------------------

LABELS = {"digits": ("Digits CNN (3,866 params): test set", "test loss", "test acc %"),
          "lm": ("Byte LM: held-out windows", "held-out loss (nats/byte)", "next-byte acc %"),
          "resnet18": ("ResNet-18 (11.2M params): lean.py's fixed synthetic batch, "
                       "memorised", "final loss on the batch", "acc % on the batch")}


def _pm(mean, std, digits, sign=False):
    if mean is None:
        return ""
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f.format(mean) + " ± " + f"{std:.{digits}f}"


def state_bits(name: str) -> str:
    """Bits per element of one moment: 8 for the code plus the scale's share."""
    v = Variant.parse(name)
    if v is None:
        return "32"
    return f"{8 + (8 if v.scale == 'pow2' else 32) / v.block:.2f}"


def axes(variants: Sequence[str]) -> List[tuple]:
    """(axis, alternative) for every run variant that differs from CHOSEN in one field
    (the format counts as one with the absmax scale that int8 and dyn use)."""
    base = Variant.parse(CHOSEN)
    out = []
    for name in variants:
        v = Variant.parse(name)
        if v is None or v == base:
            continue
        diff = [f for f in ("fmt", "block", "scale", "root", "stochastic")
                if getattr(v, f) != getattr(base, f)]
        if diff == ["fmt", "scale"]:  # int8 and the dynamic map: absmax scales
            diff = ["fmt"]
        if len(diff) == 1:
            out.append(({"fmt": "format", "block": "block", "scale": "scale", "root": "root",
                         "stochastic": "rounding"}[diff[0]], name))
    return out


def markdown(data: Dict[str, Any]) -> str:
    env, cfg, results = data["env"], data["config"], data["results"]
    lines = ["# 8-bit Adam moments: formats, blocks, scales, roots, rounding (emulated)", ""]
    lines += C.env_lines(env, data["smoke"])
    lines += [f"- CPU: {env.get('cpu_model')}, torch threads {env.get('cpu_threads')}, "
              f"{env.get('cpu_count')} cores, capability {env.get('cpu_capability')}",
              f"- seeds: {cfg['seeds']}; steps: digits {cfg['digits_steps']} (batch "
              f"{cfg['digits_batch']}, lr {cfg['digits_lr']}), LM {cfg['lm_steps']} (batch "
              f"{cfg['lm_batch']}, seq {cfg['lm_seq']}, d {cfg['lm_d']}, lr {cfg['lm_lr']}), "
              f"ResNet-18 {cfg['rn_steps']} (batch {cfg['rn_batch']}, "
              f"{cfg['rn_image']}x{cfg['rn_image']}, lr {cfg['rn_lr']}); AdamW betas (0.9, "
              f"0.999), eps 1e-8, weight decay 0.01; total {data['wall_s']:.0f} s",
              f"- quantized tensors: {cfg['eligible']} ("
              + ", ".join(f"{m}: {_qfrac(res)}" for m, res in results.items()) + ")",
              f"- corpus: {data.get('corpus')}", "",
              f"Chosen format (the op's): `{CHOSEN}`. Variant names: "
              "FORMAT-bBLOCK-SCALE-ROOT-ROUNDING (the script's docstring). Loss and "
              "accuracy: mean ± sample std over the seeds; gaps: to fp32 moments, paired "
              "per seed (same initial weights and batches), mean ± std of the per-seed "
              f"differences. Bar (issue #20): loss gap <= +{100 * BAR_LOSS_REL:.1f}% and "
              f"accuracy gap >= -{BAR_ACC_POINTS} points. What is stored, averaged over the "
              "steps (and seeds): m err, v err: |stored - exact| / |exact| (L2 over all "
              "elements; v as v, squared where its root is stored); m→0, v→0: the share of "
              "nonzero values stored as 0 (flushed below the block's smallest code).", ""]
    if data.get("note"):
        lines += ["## Conclusions", "", data["note"], ""]
    for model, res in results.items():
        title, lname, aname = LABELS[model]
        lines += [f"## {title}", ""]
        rows = []
        for name, r in res.items():
            d = 2 if model == "digits" else 4
            rows.append([f"`{name}`" + (" (chosen)" if name == CHOSEN else ""),
                         state_bits(name),
                         _pm(r["loss_mean"], r["loss_std"], d) + (" non-finite!"
                                                                 if r["nonfinite"] else ""),
                         "" if name == BASELINE else _pm(r.get("loss_gap_pct_mean"),
                                                         r.get("loss_gap_pct_std"), 2, True),
                         _pm(r["acc_mean"], r["acc_std"], 2),
                         "" if name == BASELINE else _pm(r.get("acc_gap_mean"),
                                                         r.get("acc_gap_std"), 2, True),
                         "" if name == BASELINE else C.verdict(r.get("bar"))])
        lines += C.md_table(["variant", "bits/elem", lname, "gap %", aname, "gap pts", "bar"],
                            rows)
        lines += ["", "What is stored (means over the seeds):", ""]
        lines += C.md_table(["variant", "m err %/step", "v err %/step", "m→0 %", "v→0 %",
                             "m drift % (end)", "sqrt(v) / exact (end, median)",
                             "off > 25 % (end)"],
                            [[f"`{name}`"] + _diag_cells(r) for name, r in res.items()
                             if Variant.parse(name) is not None])
        lines.append("")
    probe = data.get("probe")
    if probe:
        lines += ["## The second moment of a gradient that rises, then shrinks", "",
                  f"`decay_probe`: one element's gradient is 1 for {cfg['probe_rise']} steps, "
                  "then 0.01 (another element of its block stays at 1, holding the scale); "
                  "the stored sqrt(v) (no bias correction) at each step below. `fp32` is "
                  "exact. A value that stops moving is the stored moment stagnating: an "
                  "update smaller than half a code step rounds back to the same code.", ""]
        lines += C.md_table(["variant"] + [f"step {t}" for t in cfg["probe_at"]],
                            [[f"`{n}`"] + [f"{x:.4g}" for x in vals]
                             for n, vals in probe.items()])
        lines.append("")
    pairs = axes(list(dict.fromkeys(v for res in results.values() for v in res)))
    if pairs:
        lines += ["## Each choice against its alternatives", "",
                  f"Each row changes one field of `{CHOSEN}`. Per model: the alternative's "
                  "loss gap to fp32 minus the chosen one's (percentage points of relative "
                  "loss, mean ± std over the paired seeds; > 0: the alternative is worse) "
                  "and the same for accuracy (points; < 0: worse).", ""]
        rows = []
        for axis, name in pairs:
            row = [axis, f"`{name}`"]
            for model, res in results.items():
                if CHOSEN not in res or name not in res:
                    row += ["not run", ""]
                    continue
                rel, pts = _paired(res[name]["seeds"], res[CHOSEN]["seeds"])
                row += [_pm(*_stats(rel), 2, True), _pm(*_stats(pts), 2, True)]
            rows.append(row)
        head = ["axis", "alternative"]
        for model in results:
            head += [f"{model} loss", f"{model} acc"]
        lines += C.md_table(head, rows, align="ll" + "r" * (len(head) - 2))
        lines.append("")
    return "\n".join(lines) + "\n"


def _diag_cells(r: Dict[str, Any]) -> List[str]:
    """The stored moments' error per step and their drift from the exact moments of the
    same gradients at the end, means over the seeds (percent, but the ratio)."""
    cells = []
    for key in ("m_rel_err", "v_rel_err", "m_flushed", "v_flushed", "m_drift", "denom_ratio",
                "denom_off"):
        vals = [s.get(key) for s in r["seeds"] if s.get(key) is not None]
        vals = [x for x in vals if math.isfinite(x)]
        scale = 1 if key == "denom_ratio" else 100
        cells.append(f"{scale * statistics.mean(vals):.3g}" if vals else "")
    return cells


def _qfrac(res: Dict[str, Any]) -> str:
    for r in res.values():
        for s in r["seeds"]:
            if s["quantized_elems"]:
                return f"{s['quantized_elems']:,} of {s['elems']:,} elements"
    return "none"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run, a few seconds")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", help="output directory (default bench/results, "
                                 "bench/results/cpu-smoke with --quick)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated: fp32 and FORMAT-bBLOCK-SCALE-ROOT-ROUNDING names")
    p.add_argument("--resnet-variants", default=",".join(RESNET_VARIANTS),
                   help="the variants run on resnet18 (default: a subset, see the docstring)")
    p.add_argument("--eligible", choices=("all", "spec"), default="all",
                   help="which tensors get 8-bit moments: every one (default) or the op's "
                        "rule (dim >= 2, numel >= 4096, rows of whole 32-blocks)")
    p.add_argument("--seeds", type=int, help="default 3 (1 with --quick)")
    p.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every model's step count (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--note", help="text of the report's Conclusions section")
    p.add_argument("--replot", metavar="JSON",
                   help="train nothing: rewrite the markdown of a saved q8-formats-<device>"
                        ".json (next to it, or into --out); --note replaces its conclusions")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(Path(args.replot), args.out, args.note)
    C.ensure_importable()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def replot(path: Path, out: Optional[str], note: Optional[str]) -> int:
    import json
    data = json.loads(path.read_text())
    if note is not None:
        data["note"] = note
        C.write_json(path, data)
    folder = Path(out) if out else path.parent
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{path.stem}.md").write_text(markdown(data))
    print(f"wrote {folder}/{path.stem}.md")
    return 0


def _run(args) -> int:
    device = C.pick_device(args.device)
    cfg = dict(QUICK if args.quick else FULL)
    if args.seeds:
        cfg["seeds"] = args.seeds
    for k in STEPS.values():
        cfg[k] = max(1, round(cfg[k] * args.steps_scale))
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in RUNS:
            raise SystemExit(f"--models: unknown model {m!r}, expected some of {list(RUNS)}")
    per_model = {}
    for m in models:
        arg, text = (("--resnet-variants", args.resnet_variants) if m == "resnet18"
                     else ("--variants", args.variants))
        names = [v for v in text.split(",") if v]
        for v in names:
            try:
                Variant.parse(v)
            except ValueError as e:
                raise SystemExit(f"{arg}: {e}")
        per_model[m] = [BASELINE] + [v for v in dict.fromkeys(names) if v != BASELINE]
    cfg.update(models=models, variants=per_model, eligible=args.eligible)
    env = C.environment(device)
    t_start = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    corpus, results = None, {}
    for model in models:
        if model == "digits":
            data = lean._load_digits_example().load_data(0, device)
        elif model == "lm":
            data, corpus = lean.stdlib_corpus(cfg["lm_corpus_mb"])
        else:
            data = None
        log(f"{model}: {cfg['seeds']} seeds x {len(per_model[model])} variants")
        results[model] = run_model(model, cfg, per_model[model], data, device, args.eligible,
                                   log)
    summarise(results)
    names = list(dict.fromkeys(v for m in models for v in per_model[m]))
    log(f"decay probe: {len(names)} variants")
    probe = decay_probe(names, cfg)
    data = dict(env=env, smoke=args.quick, config=cfg, corpus=corpus, results=results,
                probe=probe, wall_s=time.time() - t_start, note=args.note)
    out = C.out_dir(args.out, args.quick)
    slug = C.device_slug(env)
    C.write_json(out / f"q8-formats-{slug}.json", data)
    md = markdown(data)
    (out / f"q8-formats-{slug}.md").write_text(md)
    print(md)
    print(f"wrote {out}/q8-formats-{slug}.{{md,json}}")
    C.copy_out([out / f"q8-formats-{slug}.{e}" for e in ("md", "json")], bool(args.out),
               args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
