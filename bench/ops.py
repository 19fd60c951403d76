"""Benchmark of mixedprec's fused ops against their PyTorch counterparts.

Each op runs on the same inputs as its native PyTorch counterpart, in one run:

- unscale fp16/fp32: ``ops.multi_tensor_unscale_`` vs
  ``torch._amp_foreach_non_finite_check_and_unscale_``;
- adam: ``ops.multi_tensor_check_finite_`` + ``ops.fused_adam_`` (fp32 masters, fp16
  grads and model copy, inv_scale, found_inf), and ``mixedprec.FusedAdam.step``, vs
  GradScaler's check pass + ``torch.optim.AdamW(fused=True).step`` and GradScaler's
  ``unscale_`` + ``AdamW(foreach=True).step``, on fp32 parameters;
- sgd: ``ops.multi_tensor_check_finite_`` + ``ops.fused_sgd_`` (momentum 0.9,
  masters), and ``mixedprec.FusedSGD.step``, vs GradScaler's check pass +
  ``torch.optim.SGD(fused=True).step``;
- sum fp16/bf16: ``ops.sum_fp32`` vs ``torch.sum(x, dtype=torch.float32)``;
- l2norm fp32/fp16: ``ops.multi_tensor_l2norm`` vs ``torch._foreach_norm`` then
  ``vector_norm(stack(...))`` (what ``clip_grad_norm_`` does);

on parameter lists shaped like ResNet-50 (161 tensors, 25.6M elements), GPT-2-medium
(292 tensors, 355M) and one flat tensor of 1e9 elements. The ``modes`` group
(``--ops modes``, issue 30 part 4) times one optimizer step in every mode on the
GPT-2-medium and ResNet-50 lists: mixedprec's AdamW and SGD over master x state dtype
(bf16 parameters) and on fp32 parameters, torch's fused AdamW and SGD on fp32 and bf16
parameters, mixedprec's FusedLAMB, FusedAdagrad and FusedNovoGrad (fp32 parameters;
bf16 with fp32 masters) and torch's Adagrad, and the no-master bf16 AdamW and SGD with
``precision_report=True`` and ``=8`` (its cost, issue 32); each as a percentage of the
copy bandwidth at its own bytes (``mode_bytes``: from the tensors' storages), with the
roofline time, the ratio to torch's fused AdamW on fp32 and its targets
(``evaluate_mode_targets``).

Reported per case: the median device time (CUDA events; see common.Timer), the
effective bandwidth from the fewest bytes the op must move (formulas in BYTES and
bench/README.md), that bandwidth as a percentage of a large device-to-device copy's
measured in the same run, and the speed-up over PyTorch (PyTorch's time / mixedprec's
time).

With no arguments: the full run on a GPU when CUDA is available, else a small smoke
run on the CPU (sizes divided by 1000, wall-clock timing, results under
bench/results/cpu-smoke/ so that they never read as results).
"""

import argparse
import gc
import importlib.util
import math
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


def _load_common():
    name = "mixedprec_bench_common"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("common.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


C = _load_common()

Shapes = List[Tuple[int, ...]]

# --- parameter lists ------------------------------------------------------------------


def resnet50_shapes_fixed() -> Shapes:
    """torchvision's ResNet-50 parameter shapes in ``parameters()`` order, written out
    (for machines without torchvision): 161 tensors, 25,557,032 elements."""
    shapes: Shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if b == 0:  # downsample: 1x1 conv and batchnorm
                shapes += [(width * 4, inplanes, 1, 1), (width * 4,), (width * 4,)]
            inplanes = width * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def resnet50_shapes() -> Tuple[Shapes, str]:
    try:
        import torchvision
    except ImportError:
        return resnet50_shapes_fixed(), "hard-coded"
    with torch.device("meta"):
        model = torchvision.models.resnet50()
    return [tuple(p.shape) for p in model.parameters()], "torchvision"


def gpt2_medium_shapes(layers: int = 24, d: int = 1024, vocab: int = 50257,
                       ctx: int = 1024) -> Shapes:
    """GPT-2-medium's parameters (HF order): token and position embeddings, 24 blocks
    of (ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj) weights and biases, ln_f:
    292 tensors, 354,823,168 elements."""
    shapes: Shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def flat_shapes(n: int = 1_000_000_000) -> Shapes:
    return [(n,)]


def gpt_98m_shapes() -> Shapes:
    """GPT-2-small's layout (12 blocks, d=768) with a 16384-token vocabulary: 148
    tensors, 98,425,344 elements (the CPU runs' large list)."""
    return gpt2_medium_shapes(layers=12, d=768, vocab=16384)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def scaled(shapes: Shapes, factor: int, keep_dims: bool = False) -> Shapes:
    """The same number of tensors, each with numel // factor elements (at least 1),
    as 1-D tensors: the smoke-test version of a list. ``keep_dims``: a tensor of 2 or
    more dimensions keeps them, its first divided instead (at least 1), so that the
    optimizers see matrices as on the GPU (8-bit state takes only tensors of 2+
    dimensions and 4096+ elements: the modes group's smoke run keeps some)."""
    if factor <= 1:
        return list(shapes)
    if keep_dims:
        return [(max(1, s[0] // factor), *s[1:]) if len(s) >= 2 else
                (max(1, numel(s) // factor),) for s in shapes]
    return [(max(1, numel(s) // factor),) for s in shapes]


LIST_LABELS = {"resnet50": "ResNet-50", "gpt2-medium": "GPT-2-medium", "flat-1b": "flat 1B",
               "gpt-98m": "GPT 98M", "tiny-161": "161 x 1"}
# Lists on which the bandwidth targets apply (>= 100M elements at full size).
LARGE_LISTS = ("gpt2-medium", "flat-1b")


def build_lists(names: Sequence[str], factor: int,
                keep_dims: bool = False) -> Dict[str, Dict[str, Any]]:
    out = {}
    for name in names:
        if name == "resnet50":
            shapes, source = resnet50_shapes()
        elif name == "gpt2-medium":
            shapes, source = gpt2_medium_shapes(), "GPT-2-medium layout"
        elif name == "flat-1b":
            shapes, source = flat_shapes(), "one tensor"
        elif name == "gpt-98m":
            shapes, source = gpt_98m_shapes(), "GPT-2-small layout, 16384 tokens"
        elif name == "tiny-161":  # the fixed cost of a step: ResNet-50's 161 tensors
            shapes, source = [(1,)] * 161, "161 one-element tensors"
        else:
            raise SystemExit(f"unknown list {name!r}; choose from {', '.join(LIST_LABELS)}")
        full = sum(numel(s) for s in shapes)
        shapes = scaled(shapes, factor, keep_dims)
        out[name] = dict(label=LIST_LABELS[name], shapes=shapes, tensors=len(shapes),
                         numel=sum(numel(s) for s in shapes), full_numel=full, source=source,
                         scale=factor)
    return out


# --- bytes each op must move, per element ------------------------------------------------

# Each input read once and each output written once; found_inf, inv_scale and the
# other one-element tensors are left out. fp16 = 2 B, fp32 = 4 B.
BYTES = {
    # in place: read and write each gradient
    "unscale fp16": {"mixedprec": 2 + 2, "torch": 2 + 2},
    "unscale fp32": {"mixedprec": 4 + 4, "torch": 4 + 4},
    # DESIGN.md: check pass reads the fp16 grad (2); update reads grad 2 + master 4 +
    # m 4 + v 4 = 14 and writes master 4 + m 4 + v 4 + fp16 model copy 2 = 14. Total 30.
    # PyTorch on fp32 params: the check op as called unscales in place (read 4 + write
    # 4); the update reads grad, param, m, v (16) and writes param, m, v (12). Total 36.
    # (Its fused kernel also writes the unscaled grad back when given grad_scale: not
    # counted, as it is not needed.)
    "adam": {"mixedprec": 2 + 14 + 14, "torch": 8 + 16 + 12},
    # check 2; update reads grad 2 + master 4 + momentum 4, writes master 4 +
    # momentum 4 + model 2: 22. PyTorch fp32: check 8 + reads 12 + writes 8: 28.
    "sgd": {"mixedprec": 2 + 10 + 10, "torch": 8 + 12 + 8},
    # read-only reductions
    "sum fp16": {"mixedprec": 2, "torch": 2},
    "sum bf16": {"mixedprec": 2, "torch": 2},
    "l2norm fp32": {"mixedprec": 4, "torch": 4},
    "l2norm fp16": {"mixedprec": 2, "torch": 2},
    "l2norm bf16": {"mixedprec": 2, "torch": 2},
    # cast copy fp32 -> fp16 (masters into the model): read 4, write 2
    "copy": {"mixedprec": 4 + 2, "torch": 4 + 2},
    # the step through each library's GradScaler (scaler.step + scaler.update), as adam
    "adam+scaler": {"mixedprec": 2 + 14 + 14, "torch": 8 + 16 + 12},
    # the same without the report (with it: 2 more, the per-tensor norms' read)
    "adam+scaler report": {"mixedprec": 2 + 14 + 14, "torch": 8 + 16 + 12},
}
OP_GROUPS = {
    "unscale": ["unscale fp16", "unscale fp32"],
    "adam": ["adam"],
    "sgd": ["sgd"],
    "sum": ["sum fp16", "sum bf16"],
    "l2norm": ["l2norm fp32", "l2norm fp16", "l2norm bf16"],
    "copy": ["copy"],
    "scaler": ["adam+scaler"],
    "report": ["adam+scaler report"],
}
LISTS_DEFAULT = "resnet50,gpt2-medium,flat-1b"
# What a CPU measurement runs by default (--device cpu --scale 1).
CPU_LISTS = "resnet50,gpt-98m,tiny-161"
CPU_OPS = "unscale,adam,sgd,copy,l2norm,scaler"
# The H100 targets (issue "On a GPU"): share of the copy bandwidth on the large lists,
# and speed-up over every PyTorch counterpart on every list (the launch-bound
# ResNet-50 list asks more, and there the optimizer-level call's latency, Python
# included, counts too).
BANDWIDTH_TARGETS = {"unscale fp16": 0.90, "unscale fp32": 0.90, "adam": 0.93, "sgd": 0.90}
SPEEDUP_TARGETS = {"unscale fp16": 1.0, "unscale fp32": 1.0, "adam": 1.10, "sgd": 1.0}
RESNET50_SPEEDUP_TARGET = 1.3  # adam and sgd
TARGET_OPS = tuple(BANDWIDTH_TARGETS)

LR, BETAS, EPS, WD, MOMENTUM = 1e-3, (0.9, 0.999), 1e-8, 0.01, 0.9
# The checks compare updates (parameter after - before); a large learning rate keeps
# the rounding of the parameters themselves far below the tolerance.
CHECK_LR = 0.1


# --- inputs -------------------------------------------------------------------------------

class Inputs:
    """Random tensors of one list on one device (never zeros: see METHOD.md)."""

    def __init__(self, shapes: Shapes, device: torch.device, seed: int = 0):
        self.shapes = shapes
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def randn(self, dtype: torch.dtype, std: float = 1.0) -> List[torch.Tensor]:
        out = []
        for s in self.shapes:
            t = torch.randn(s, dtype=dtype, device=self.device, generator=self.gen)
            out.append(t.mul_(std) if std != 1.0 else t)
        return out

    def rand(self, dtype: torch.dtype, lo: float, hi: float) -> List[torch.Tensor]:
        out = []
        for s in self.shapes:
            t = torch.rand(s, dtype=dtype, device=self.device, generator=self.gen)
            out.append(t.mul_(hi - lo).add_(lo))
        return out

    def scalar(self, value: float, shape: Tuple[int, ...] = (1,)) -> torch.Tensor:
        """A float32 one-element tensor: shape (1,) for mixedprec's ops, () as
        torch.amp.GradScaler makes its scale and found_inf."""
        return torch.full(shape, value, dtype=torch.float32, device=self.device)

    def tscalar(self, value: float) -> torch.Tensor:
        return self.scalar(value, ())


def _pairs(inp: Inputs, shape: Tuple[int, ...] = (1,)):
    """Loss scales alternating between 2 and 1/2 with their inverses: exact in every
    dtype, so gradients unscaled in place every repetition return to their values
    every other repetition instead of drifting to zero."""
    scales = [inp.scalar(2.0, shape), inp.scalar(0.5, shape)]
    invs = [inp.scalar(0.5, shape), inp.scalar(2.0, shape)]
    return scales, invs


# --- the cases: each builds its inputs, returns fn(i) to time ------------------------------

Case = Callable[[Inputs], Tuple[Callable[[int], Any], Callable[[], Dict[str, Any]]]]


def _no_skip(*flags: torch.Tensor) -> Callable[[], Dict[str, Any]]:
    """After timing: every found_inf flag must still be 0 (a skipped update would be
    faster than a real one and void the timing)."""
    def after():
        return {"found_inf": max(float(f.max().item()) for f in flags)}  # sync-ok: after timing
    return after


def case_unscale_mixedprec(dtype):
    def build(inp: Inputs):
        from mixedprec import ops
        grads = inp.randn(dtype)
        found_inf = inp.scalar(0.0)
        _, invs = _pairs(inp)
        fn = lambda i: ops.multi_tensor_unscale_(grads, found_inf, invs[i % 2])  # noqa: E731
        return fn, _no_skip(found_inf)
    return build


def case_unscale_torch(dtype):
    def build(inp: Inputs):
        grads = inp.randn(dtype)
        found_inf = inp.tscalar(0.0)
        _, invs = _pairs(inp, ())
        return (lambda i: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, invs[i % 2])), _no_skip(found_inf)
    return build


def _as_params(tensors: List[torch.Tensor], grads: List[torch.Tensor]) -> List[torch.Tensor]:
    params = [torch.nn.Parameter(t, requires_grad=True) for t in tensors]
    for p, g in zip(params, grads):
        p.grad = g
    return params


def _mixedprec_scaled_step(inp: Inputs, grads: List[torch.Tensor], opt):
    """A step of a mixedprec fused optimizer as mixedprec's GradScaler drives it: the
    overflow check, then the step, which unscales and skips on the device."""
    from mixedprec import ops
    found_inf = inp.scalar(0.0)
    scales, _ = _pairs(inp)

    def fn(i):
        ops.multi_tensor_check_finite_(grads, found_inf)
        opt.grad_scale, opt.found_inf = scales[i % 2], found_inf
        opt.step()
    return fn, _no_skip(found_inf)


def _torch_scaled_fused_step(inp: Inputs, grads: List[torch.Tensor], opt):
    """torch.amp.GradScaler.step with a fused torch optimizer: the check pass (in-place
    unscale by 1.0), then the optimizer divides by grad_scale and skips on found_inf."""
    found_inf, one = inp.tscalar(0.0), inp.tscalar(1.0)
    scales, _ = _pairs(inp, ())

    def fn(i):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
        opt.grad_scale, opt.found_inf = scales[i % 2], found_inf
        opt.step()
    return fn, _no_skip(found_inf)


def case_adam_mixedprec_op(inp: Inputs):
    from mixedprec import ops
    masters = inp.randn(torch.float32)
    model = [m.to(torch.float16) for m in masters]
    grads = inp.randn(torch.float16)
    exp_avgs = inp.randn(torch.float32, std=0.1)
    exp_avg_sqs = inp.rand(torch.float32, 0.01, 1.0)
    step = inp.scalar(0.0)
    found_inf = inp.scalar(0.0)
    _, invs = _pairs(inp)

    def fn(i):
        ops.multi_tensor_check_finite_(grads, found_inf)  # what a GradScaler does first
        ops.fused_adam_(masters, grads, exp_avgs, exp_avg_sqs, model, step=step, lr=LR,
                        beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                        decoupled_weight_decay=True, bias_correction=True, inv_scale=invs[i % 2],
                        found_inf=found_inf)
    return fn, _no_skip(found_inf)


def case_adam_mixedprec_optimizer(inp: Inputs):
    import mixedprec
    params = _as_params(inp.randn(torch.float16), inp.randn(torch.float16))
    grads = [p.grad for p in params]
    opt = mixedprec.FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                              master_weights=True)
    return _mixedprec_scaled_step(inp, grads, opt)


def _torch_adamw(inp: Inputs, **kw):
    params = _as_params(inp.randn(torch.float32), inp.randn(torch.float32))
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    return params, [p.grad for p in params], opt


def case_adam_torch_fused(inp: Inputs):
    params, grads, opt = _torch_adamw(inp, fused=True)
    return _torch_scaled_fused_step(inp, grads, opt)


def case_adam_torch_foreach(inp: Inputs):
    params, grads, opt = _torch_adamw(inp, foreach=True)
    found_inf = inp.tscalar(0.0)
    _, invs = _pairs(inp, ())

    def fn(i):
        # GradScaler.unscale_ (the found_inf.item() GradScaler then reads is left out)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, invs[i % 2])
        opt.step()
    return fn, _no_skip(found_inf)


def case_sgd_mixedprec_op(inp: Inputs):
    from mixedprec import ops
    masters = inp.randn(torch.float32)
    model = [m.to(torch.float16) for m in masters]
    grads = inp.randn(torch.float16)
    buffers = inp.randn(torch.float32, std=0.1)
    found_inf = inp.scalar(0.0)
    _, invs = _pairs(inp)

    def fn(i):
        ops.multi_tensor_check_finite_(grads, found_inf)
        ops.fused_sgd_(masters, grads, buffers, model, lr=LR, momentum=MOMENTUM, dampening=0.0,
                       weight_decay=0.0, nesterov=False, first_run=False, inv_scale=invs[i % 2],
                       found_inf=found_inf)
    return fn, _no_skip(found_inf)


def case_sgd_mixedprec_optimizer(inp: Inputs):
    import mixedprec
    params = _as_params(inp.randn(torch.float16), inp.randn(torch.float16))
    grads = [p.grad for p in params]
    opt = mixedprec.FusedSGD(params, lr=LR, momentum=MOMENTUM, master_weights=True)
    return _mixedprec_scaled_step(inp, grads, opt)


def case_sgd_torch_fused(inp: Inputs):
    params = _as_params(inp.randn(torch.float32), inp.randn(torch.float32))
    grads = [p.grad for p in params]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, fused=True)
    return _torch_scaled_fused_step(inp, grads, opt)


def _flat(inp: Inputs, dtype) -> torch.Tensor:
    """One tensor with as many elements as the list."""
    n = sum(numel(s) for s in inp.shapes)
    return torch.randn(n, dtype=dtype, device=inp.device, generator=inp.gen)


def case_sum_mixedprec(dtype):
    def build(inp: Inputs):
        from mixedprec import ops
        x = _flat(inp, dtype)
        return (lambda i: ops.sum_fp32(x)), dict
    return build


def case_sum_torch(dtype):
    def build(inp: Inputs):
        x = _flat(inp, dtype)
        return (lambda i: torch.sum(x, dtype=torch.float32)), dict
    return build


def case_l2norm_mixedprec(dtype):
    def build(inp: Inputs):
        from mixedprec import ops
        grads = inp.randn(dtype)
        return (lambda i: ops.multi_tensor_l2norm(grads, None, per_tensor=False)), dict
    return build


def torch_total_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """clip_grad_norm_'s foreach path (torch.nn.utils.get_total_norm)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)


def case_l2norm_torch(dtype):
    def build(inp: Inputs):
        grads = inp.randn(dtype)
        return (lambda i: torch_total_norm(grads)), dict
    return build


def case_copy_mixedprec(inp: Inputs):
    from mixedprec import ops
    src, dst = inp.randn(torch.float32), inp.randn(torch.float16)
    return (lambda i: ops.multi_tensor_copy_(src, dst)), dict


def case_copy_torch(inp: Inputs):
    src, dst = inp.randn(torch.float32), inp.randn(torch.float16)
    return (lambda i: torch._foreach_copy_(dst, src)), dict


def _scaler_step(scaler, opt, init_scale: float):
    """scaler.step(opt) and scaler.update(), as a training step ends; the gradients
    are finite, so the scale must stay where it started."""
    def fn(i):
        scaler.step(opt)
        scaler.update()

    def after():
        return {"found_inf": float(scaler.get_scale() < init_scale)}  # sync-ok: after timing
    return fn, after


def case_adam_scaler_mixedprec(inp: Inputs):
    import mixedprec
    params = _as_params(inp.randn(torch.float16), inp.randn(torch.float16))
    opt = mixedprec.FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                              master_weights=True)
    scaler = mixedprec.GradScaler(inp.device.type, init_scale=2.0**8, growth_interval=10**9)
    scaler.scale(torch.ones((), device=inp.device))  # creates the scale, as a forward would
    return _scaler_step(scaler, opt, 2.0**8)


def _adamw_scaler(inp: Inputs, report: bool):
    import mixedprec
    params = _as_params(inp.randn(torch.float16), inp.randn(torch.float16))
    opt = mixedprec.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    scaler = mixedprec.GradScaler(inp.device.type, init_scale=2.0**8, growth_interval=10**9,
                                  overflow_report=report)
    scaler.scale(torch.ones((), device=inp.device))  # creates the scale, as a forward would
    return _scaler_step(scaler, opt, 2.0**8)


def case_adam_scaler_mixedprec_optim(inp: Inputs):
    return _adamw_scaler(inp, report=False)


def case_adam_scaler_mixedprec_report(inp: Inputs):
    """As above with the overflow report on: per-tensor norms (one more read of the
    gradients), counts and the scale history, on the device."""
    return _adamw_scaler(inp, report=True)


def case_adam_scaler_torch(inp: Inputs):
    params, grads, opt = _torch_adamw(inp, fused=True)
    scaler = torch.amp.GradScaler(inp.device.type, init_scale=2.0**8, growth_interval=10**9)
    scaler.scale(torch.ones((), device=inp.device))
    return _scaler_step(scaler, opt, 2.0**8)


F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
REPORT_ON = "mixedprec optim.AdamW + GradScaler(overflow_report=True)"
# op -> [(implementation label, side, case)]; side "mixedprec" or "torch".
CASES: Dict[str, List[Tuple[str, str, Case]]] = {
    "unscale fp16": [
        ("mixedprec multi_tensor_unscale_", "mixedprec", case_unscale_mixedprec(F16)),
        ("torch _amp_foreach_non_finite_check_and_unscale_", "torch", case_unscale_torch(F16)),
    ],
    "unscale fp32": [
        ("mixedprec multi_tensor_unscale_", "mixedprec", case_unscale_mixedprec(F32)),
        ("torch _amp_foreach_non_finite_check_and_unscale_", "torch", case_unscale_torch(F32)),
    ],
    "adam": [
        ("mixedprec check_finite_ + fused_adam_", "mixedprec", case_adam_mixedprec_op),
        ("mixedprec FusedAdam.step (+ check)", "mixedprec", case_adam_mixedprec_optimizer),
        ("torch AdamW fused=True (+ check)", "torch", case_adam_torch_fused),
        ("torch AdamW foreach=True (+ unscale_)", "torch", case_adam_torch_foreach),
    ],
    "sgd": [
        ("mixedprec check_finite_ + fused_sgd_", "mixedprec", case_sgd_mixedprec_op),
        ("mixedprec FusedSGD.step (+ check)", "mixedprec", case_sgd_mixedprec_optimizer),
        ("torch SGD fused=True (+ check)", "torch", case_sgd_torch_fused),
    ],
    "sum fp16": [
        ("mixedprec sum_fp32", "mixedprec", case_sum_mixedprec(F16)),
        ("torch sum(dtype=float32)", "torch", case_sum_torch(F16)),
    ],
    "sum bf16": [
        ("mixedprec sum_fp32", "mixedprec", case_sum_mixedprec(BF16)),
        ("torch sum(dtype=float32)", "torch", case_sum_torch(BF16)),
    ],
    "l2norm fp32": [
        ("mixedprec multi_tensor_l2norm", "mixedprec", case_l2norm_mixedprec(F32)),
        ("torch _foreach_norm + vector_norm", "torch", case_l2norm_torch(F32)),
    ],
    "l2norm fp16": [
        ("mixedprec multi_tensor_l2norm", "mixedprec", case_l2norm_mixedprec(F16)),
        ("torch _foreach_norm + vector_norm", "torch", case_l2norm_torch(F16)),
    ],
    "l2norm bf16": [
        ("mixedprec multi_tensor_l2norm", "mixedprec", case_l2norm_mixedprec(BF16)),
        ("torch _foreach_norm + vector_norm", "torch", case_l2norm_torch(BF16)),
    ],
    "copy": [
        ("mixedprec multi_tensor_copy_", "mixedprec", case_copy_mixedprec),
        ("torch _foreach_copy_", "torch", case_copy_torch),
    ],
    "adam+scaler": [
        ("mixedprec FusedAdam + GradScaler step/update", "mixedprec",
         case_adam_scaler_mixedprec),
        ("mixedprec optim.AdamW + GradScaler step/update", "mixedprec",
         case_adam_scaler_mixedprec_optim),
        ("torch AdamW fused=True + GradScaler step/update", "torch", case_adam_scaler_torch),
        (REPORT_ON, "mixedprec", case_adam_scaler_mixedprec_report),
    ],
    # The overflow report's cost where the gradients' bytes count (not on 161 x 1).
    "adam+scaler report": [
        ("mixedprec optim.AdamW + GradScaler step/update", "mixedprec",
         case_adam_scaler_mixedprec_optim),
        (REPORT_ON, "mixedprec", case_adam_scaler_mixedprec_report),
        ("torch AdamW fused=True + GradScaler step/update", "torch", case_adam_scaler_torch),
    ],
}
DTYPE_NOTE = {
    "unscale fp16": "fp16 grads", "unscale fp32": "fp32 grads",
    "adam": "mixedprec: fp16 grads/model, fp32 masters+moments; torch: fp32",
    "sgd": "mixedprec: fp16 grads/model, fp32 masters+momentum; torch: fp32",
    "sum fp16": "fp16 input, fp32 result", "sum bf16": "bf16 input, fp32 result",
    "l2norm fp32": "fp32 grads", "l2norm fp16": "fp16 grads", "l2norm bf16": "bf16 grads",
    "copy": "fp32 into fp16",
    "adam+scaler": "mixedprec: fp16 params, fp32 masters; torch: fp32",
    "adam+scaler report": "mixedprec: fp16 params, fp32 masters, the overflow report off "
                          "and on; torch: fp32",
}


# --- one optimizer step in every mode (--ops modes) -------------------------------------
#
# Each mode is an optimizer over its own random parameters with random gradients
# (Inputs, seed 0: the same values in every mode of a parameter dtype). One step
# outside the timing makes its state; then plain ``step()`` calls are timed as every
# case (common.Timer); after timing, the steps the optimizer counted must equal the
# calls (none skipped). One mode at a time, freed before the next: GPT-2-medium takes
# up to ~16 B per element a mode.

MODES_GROUP = "modes"
ALL_GROUPS = (*OP_GROUPS, MODES_GROUP)
# The lists the group runs on (those of --lists), in this order: GPT-2-medium first,
# where the bytes count and the bandwidth target applies.
MODE_LISTS = ("gpt2-medium", "resnet50")
MODE_PARAMS = {"fp32": F32, "bf16": BF16}
MODE_STATES = {"fp32": F32, "bf16": BF16, "fp8": torch.float8_e4m3fn}
MODE_MASTERS = ("fp32", "none", "kahan", "stochastic", "remainder")
# mixedprec AdamW and SGD modes: this share of the copy bandwidth at their own bytes on
# the large lists (reported, not enforced).
MODE_BANDWIDTH_TARGET = 0.85
MODE_REFERENCE = "torch AdamW(fused=True) | fp32 | - | fp32"
# precision_report= values timed beside the no-master bf16 mode (issue #32): True counts
# every step, 8 every 8th; either should cost at most MODE_REPORT_COST of the step.
MODE_REPORTS = (True, 8)
MODE_REPORT_COST = 0.10
# What an optimizer's constructor or first step raises for a combination it refuses
# (reported "not available"); running out of memory and device errors are errors.
MODE_REFUSED = (NotImplementedError, ValueError, TypeError, RuntimeError)
# The modes' timing: fewer repetitions than the other cases (52 modes a list), enough
# for a median of a bandwidth-bound step.
MODE_TIMER_GPU = dict(warmup=2, min_reps=10, max_reps=25, target_s=0.05, latency_reps=3)
MODE_TIMER_CPU = dict(warmup=1, min_reps=2, max_reps=2)


def mode_key(optimizer: str, params: str, master: Optional[str], state: str) -> str:
    return f"{optimizer} | {params} | {master or '-'} | {state}"


def mode_label(row: Dict[str, Any]) -> str:
    master = f", master {row['master']}" if row["master"] else ""
    return f"{row['optimizer']} ({row['params']} params{master}, {row['state']} state)"


def mode_specs() -> List[Dict[str, Any]]:
    """Every mode, in the order they run: in each family torch's references and the
    mixedprec mode at their bytes first, so that a spent time budget skips the others.
    ``master``: mixedprec's ``master=`` on bf16 parameters (None: fp32 parameters,
    which need none, and torch); ``state``: the moments' (momentum's) dtype."""
    out: List[Dict[str, Any]] = []

    def add(optimizer, family, impl, params, master, state, report=False):
        out.append(dict(key=mode_key(optimizer, params, master, state), optimizer=optimizer,
                        family=family, impl=impl, params=params, master=master, state=state,
                        report=report))

    for family in ("AdamW", "SGD"):
        ours, theirs = f"mixedprec.optim.{family}", f"torch {family}(fused=True)"
        add(theirs, family, "torch", "fp32", None, "fp32")
        add(theirs, family, "torch", "bf16", None, "bf16")  # torch's state: the params' dtype
        add(ours, family, "mixedprec", "bf16", "none", "bf16")
        for every in MODE_REPORTS:  # the precision report's cost, beside the plain mode
            add(f"{ours}(precision_report={every})", family, "mixedprec", "bf16", "none",
                "bf16", report=every)
        for state in MODE_STATES:
            add(ours, family, "mixedprec", "fp32", None, state)
        for master in MODE_MASTERS:
            for state in MODE_STATES:
                if (master, state) != ("none", "bf16"):
                    add(ours, family, "mixedprec", "bf16", master, state)
    for family in ("LAMB", "Adagrad", "NovoGrad"):
        if family == "Adagrad":  # (torch's fused Adagrad is CPU only)
            add("torch Adagrad(fused=True)", family, "torch", "fp32", None, "fp32")
            add("torch Adagrad(foreach=True)", family, "torch", "fp32", None, "fp32")
        # Their state is fp32; bf16 parameters take fp32 masters (master_weights=True).
        add(f"mixedprec.Fused{family}", family, "mixedprec", "fp32", None, "fp32")
        add(f"mixedprec.Fused{family}", family, "mixedprec", "bf16", "fp32", "fp32")
    return out


def same_bytes_pairs(specs: Sequence[Dict[str, Any]]) -> List[Tuple[str, List[str]]]:
    """(mixedprec mode, its torch counterparts): the mixedprec mode that keeps what
    torch keeps (no master, state in the parameters' dtype), so moves the same bytes."""
    out = []
    for s in specs:
        if s["impl"] != "mixedprec" or s["master"] not in (None, "none") or \
                s["state"] != s["params"] or s["report"]:
            continue
        refs = [t["key"] for t in specs if t["impl"] == "torch" and
                t["family"] == s["family"] and t["params"] == s["params"]]
        if refs:
            out.append((s["key"], refs))
    return out


def _mode_optimizer(spec: Dict[str, Any], params: List[torch.Tensor]):
    family = spec["family"]
    if spec["impl"] == "torch":
        if family == "AdamW":
            return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                     fused=True)
        if family == "SGD":
            return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, fused=True)
        variant = "fused" if "fused" in spec["optimizer"] else "foreach"
        return torch.optim.Adagrad(params, lr=LR, weight_decay=WD, **{variant: True})
    import mixedprec
    if family in ("AdamW", "SGD"):
        kw = dict(state_dtype=MODE_STATES[spec["state"]])
        if spec["report"]:
            kw["precision_report"] = spec["report"]
        if spec["master"]:  # (fp32 parameters: the default, "fp32", which keeps none)
            kw["master"] = spec["master"]
        if spec["master"] == "stochastic":
            kw["seed"] = 1
        if family == "AdamW":
            return mixedprec.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS,
                                         weight_decay=WD, **kw)
        return mixedprec.optim.SGD(params, lr=LR, momentum=MOMENTUM, **kw)
    cls = getattr(mixedprec, f"Fused{family}")
    return cls(params, lr=LR, weight_decay=WD, master_weights=spec["master"] == "fp32")


def _refused(e: BaseException) -> bool:
    """Whether ``e`` is a refusal of the combination (not out of memory, not a device
    error)."""
    if not isinstance(e, MODE_REFUSED) or isinstance(e, torch.OutOfMemoryError):
        return False
    device_error = getattr(torch, "AcceleratorError", None)
    return not (device_error and isinstance(e, device_error)) and "CUDA error" not in str(e)


def mode_bytes(params: Sequence[torch.Tensor], opt) -> Tuple[int, int]:
    """(stored, moved) of an optimizer after its first step. Stored: what the storages
    of the parameters and of every state tensor hold (common.storage_bytes; 8-bit
    state's block scales included; the 0-dim step counts and a group's one-per-tensor
    values left out). Moved: the fewest bytes a step must move: parameters and state
    read and written once, each gradient read once; a parameter whose fp32 master is in
    the state is only written (the master is read instead)."""
    seen: set = set()
    stored = moved = 0
    for p in params:
        state = opt.state.get(p, {})
        param_b = C.storage_bytes(p, seen)
        state_b = sum(C.storage_bytes(v, seen) for v in state.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
        stored += param_b + state_b
        moved += (param_b if "master_param" in state else 2 * param_b) + 2 * state_b \
            + C.storage_bytes(p.grad, seen)
    return stored, moved


def _steps_applied(opt, params: Sequence[torch.Tensor]) -> Optional[int]:
    """The steps the optimizer counted: mixedprec's ``applied_steps`` (steps not skipped
    on the device), torch's per-parameter ``step``; None where there is no count (torch's
    SGD)."""
    count = getattr(opt, "applied_steps", None)
    if count is None:
        count = opt.state.get(params[0], {}).get("step")
    return None if count is None else int(float(count))  # sync-ok: after timing


def _release(opt_ref: Callable[[], Any]) -> None:
    """Frees a dropped optimizer held by a reference cycle: a young-generation
    collection first (cheap), a full one only if that was not enough."""
    if opt_ref() is not None:
        gc.collect(1)
    if opt_ref() is not None:
        gc.collect()


def targets_markdown(targets: Sequence[Dict[str, Any]], smoke: bool) -> List[str]:
    """The lines of a targets table (target, value, pass/miss) and how many were met."""
    lines = ["Not evaluated: CPU smoke run.", ""] if smoke else []
    body = [[t["target"], f"{t['value']}{'%' if t['unit'] == '% of copy' else 'x'}",
             C.verdict(t["passed"])] for t in targets]
    if body:
        lines += C.md_table(["Target", "Value", "Result"], body, "lrr") + [""]
        if not smoke:
            lines += [f"{sum(1 for t in targets if t['passed'])} of {len(body)} targets met.",
                      ""]
    return lines


def run_mode(spec: Dict[str, Any], shapes: Shapes, device: torch.device, timer,
             copy_gbps: float) -> Dict[str, Any]:
    """One mode: its optimizer built and stepped once (the state), its steps timed.
    Returns the row's numbers, or ``status`` "not available: ..." when the optimizer
    refuses the combination."""
    inp = Inputs(shapes, device)
    dtype = MODE_PARAMS[spec["params"]]
    params = _as_params(inp.randn(dtype), inp.randn(dtype))
    del inp
    t0 = time.perf_counter()
    try:
        opt = _mode_optimizer(spec, params)
        opt.step()  # the state is made here, outside the timing
    except MODE_REFUSED as e:
        if not _refused(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return dict(status=f"not available: {type(e).__name__}: {first}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_ms = (time.perf_counter() - t0) * 1e3
    stored, moved = mode_bytes(params, opt)
    n = sum(p.numel() for p in params)
    calls = [1]  # the first step

    def fn(i):
        opt.step()
        calls[0] += 1

    row: Dict[str, Any] = dict(status="ok", **timer(fn))
    applied = _steps_applied(opt, params)
    row.update(bytes_per_param=stored / n, bytes_per_elem=moved / n, bytes=moved,
               first_step_ms=first_ms, steps_called=calls[0], steps_applied=applied)
    row["gbps"] = moved / (row["median_ms"] * 1e6)
    row["pct_copy"] = 100.0 * row["gbps"] / copy_gbps
    row["roofline_ms"] = moved / (copy_gbps * 1e6)
    if applied is not None and applied != calls[0]:
        row["skipped_steps"] = calls[0] - applied
    opt_ref = weakref.ref(opt)
    fn = opt = params = None  # noqa: F841  (frees them before the next mode is built)
    _release(opt_ref)
    return row


def run_modes(args, list_names: Sequence[str], factor: int, device: torch.device,
              copy: Dict[str, Any], copy_elems: int, t_start: float,
              smoke: bool) -> Dict[str, Any]:
    """The modes group: every mode of ``mode_specs()`` on the lists of ``MODE_LISTS``
    that ``--lists`` names, within the run's ``--time-budget`` (modes past it are
    skipped and marked so), then the copy again (its drift over the group)."""
    names = [n for n in MODE_LISTS if n in list_names]
    lists = build_lists(names, factor, keep_dims=True)
    gpu = device.type == "cuda"
    kw = dict(MODE_TIMER_GPU if gpu else MODE_TIMER_CPU)
    if args.reps:
        kw["min_reps"] = args.reps
        kw["max_reps"] = max(kw["max_reps"], args.reps)
    if args.warmup is not None:
        kw["warmup"] = args.warmup
    timer = C.Timer(device, **kw)
    specs = mode_specs()
    rows: List[Dict[str, Any]] = []
    where = ", ".join(names) if names else f"no list (--lists has none of {MODE_LISTS})"
    print(f"  modes: {len(specs)} per list on {where}", flush=True)
    for lname, lst in lists.items():
        for spec in specs:
            row = dict(list=lname, numel=lst["numel"], tensors=lst["tensors"], **spec)
            if time.time() - t_start > args.time_budget:
                row.update(status="skipped",
                           skipped=f"time budget of {args.time_budget:.0f} s spent")
            else:
                try:
                    row.update(run_mode(spec, lst["shapes"], device, timer, copy["gbps"]))
                except Exception as e:  # noqa: BLE001  (recorded, and the run fails)
                    row.update(status="error", error=f"{type(e).__name__}: {e}")
                    C.free_memory()
            rows.append(row)
            msg = row["status"] if "median_ms" not in row else (
                f"{row['median_ms']:9.4f} ms {row['bytes_per_elem']:6.2f} B/elem "
                f"{row['pct_copy']:5.1f}% of copy")
            print(f"  {lst['label']:<13} {row['key']:<58} {msg}"
                  + (f" error: {row['error']}" if "error" in row else ""), flush=True)
        C.free_memory()
    for row in rows:
        ref = next((r for r in rows if r["list"] == row["list"] and r["key"] == MODE_REFERENCE
                    and "median_ms" in r), None)
        if ref and "median_ms" in row:
            row["vs_torch_adamw_fp32"] = ref["median_ms"] / row["median_ms"]
    measured = any("median_ms" in r for r in rows)
    copy_after = measure_copy(device, copy_elems, timer) if measured else None
    targets = evaluate_mode_targets(rows, lists, smoke)
    return dict(lists={k: {kk: vv for kk, vv in v.items() if kk != "shapes"}
                       for k, v in lists.items()},
                timer=kw, reference=MODE_REFERENCE, bandwidth_target=MODE_BANDWIDTH_TARGET,
                copy_after=copy_after, rows=rows, targets=targets)


def evaluate_mode_targets(rows, lists, smoke: bool) -> List[Dict[str, Any]]:
    """Every mixedprec AdamW and SGD mode: at least MODE_BANDWIDTH_TARGET of the copy
    bandwidth at its own bytes on the large lists; at the same bytes as torch (no
    master, state in the parameters' dtype), at least as fast as the fastest torch
    counterpart, on every list. A mode with the precision report: its step at most
    MODE_REPORT_COST slower than the same mode without it, on every list. Reported,
    never enforced; not evaluated on a CPU smoke run."""
    out = []

    def add(target, value, unit, threshold):
        out.append(dict(target=target, value=round(value, 3), unit=unit, threshold=threshold,
                        passed=None if smoke else value >= threshold))

    by_key = {(r["list"], r["key"]): r for r in rows if "median_ms" in r}
    bw = MODE_BANDWIDTH_TARGET * 100
    for r in rows:
        if r["impl"] == "mixedprec" and r["family"] in ("AdamW", "SGD") and \
                r["list"] in LARGE_LISTS and "median_ms" in r and not r.get("report"):
            add(f"{mode_label(r)} on {lists[r['list']]['label']}: >= {bw:.0f}% of copy at "
                f"its {r['bytes_per_elem']:.2f} B/elem", r["pct_copy"], "% of copy", bw)
    for lname in lists:
        for ours, refs in same_bytes_pairs(mode_specs()):
            m = by_key.get((lname, ours))
            theirs = [by_key[(lname, k)] for k in refs if (lname, k) in by_key]
            if m is None or not theirs:
                continue
            t = min(theirs, key=lambda r: r["median_ms"])
            add(f"{mode_label(m)} on {lists[lname]['label']}: >= 1.0x {t['optimizer']} on "
                f"{t['params']} params at the same bytes ({m['bytes_per_elem']:.2f} vs "
                f"{t['bytes_per_elem']:.2f} B/elem)", t["median_ms"] / m["median_ms"], "x", 1.0)
    for r in rows:
        plain = by_key.get((r["list"], mode_key(f"mixedprec.optim.{r['family']}", r["params"],
                                                r["master"], r["state"])))
        if r.get("report") and "median_ms" in r and plain is not None:
            cost = MODE_REPORT_COST * 100
            add(f"{mode_label(r)} on {lists[r['list']]['label']}: costs <= {cost:.0f}% of "
                f"the step (>= {1 / (1 + MODE_REPORT_COST):.2f}x the speed without it)",
                plain["median_ms"] / r["median_ms"], "x", 1 / (1 + MODE_REPORT_COST))
    return out


def modes_markdown(data: Dict[str, Any]) -> List[str]:
    modes, smoke = data["modes"], data["smoke"]
    copy, after = data["copy"], modes.get("copy_after")
    lines = ["## One optimizer step in every mode (`--ops modes`)", "",
             "Each mode: its optimizer over its own random parameters and gradients, one "
             "step to make the state, then plain `step()` calls timed (median ms). "
             "`B/param`: parameters + optimizer state, as their storages hold them; "
             "`B/elem`: the fewest bytes a step moves (parameters and state read and "
             "written once, the gradient read once, a parameter with an fp32 master only "
             "written; 8-bit state's block scales included); `at copy`: the time at 100% "
             "of the copy bandwidth for those bytes (the roofline); `% copy`: that time "
             "over the measured one; `vs torch AdamW fp32`: torch's fused AdamW on fp32 "
             "params' time / this time (> 1: faster). master `-`: fp32 parameters (no "
             "master) or torch.", "",
             f"Copy: {copy['gbps']:.1f} GB/s before the group"
             + (f", {after['gbps']:.1f} GB/s after it" if after else "") + ".", ""]
    header = ["optimizer", "params", "master", "state", "B/param", "B/elem", "ms",
              "at copy (ms)", "GB/s", "% copy", "vs torch AdamW fp32"]
    for lname, lst in modes["lists"].items():
        lines += [f"### {lst['label']}: {lst['tensors']} tensors, {lst['numel']:,} elements"
                  + (f" (full size / {lst['scale']}, matrices kept 2-D)" if lst["scale"] > 1
                     else ""), ""]
        body = []
        for r in (r for r in modes["rows"] if r["list"] == lname):
            lead = [r["optimizer"], r["params"], r["master"] or "-", r["state"]]
            if "median_ms" not in r:
                status = "error" if "error" in r else r["status"]
                body.append(lead + ["", "", status] + [""] * 4)
                continue
            skipped = f" ({r['skipped_steps']} skipped!)" if r.get("skipped_steps") else ""
            body.append(lead + [C.fmt(r.get("bytes_per_param"), 2),
                                C.fmt(r.get("bytes_per_elem"), 2),
                                C.fmt(r["median_ms"], 4) + skipped,
                                C.fmt(r.get("roofline_ms"), 4), C.fmt(r.get("gbps"), 1),
                                C.fmt(r.get("pct_copy"), 1),
                                C.fmt(r.get("vs_torch_adamw_fp32"), 2)])
        lines += C.md_table(header, body, "llll" + "r" * 7) + [""]
    lines += ["### Targets (modes; reported, not enforced)", ""]
    lines += targets_markdown(modes["targets"], smoke)
    errors = [r for r in modes["rows"] if "error" in r]
    if errors:
        lines += ["### Errors (modes)", ""] + [f"- {r['list']} {r['key']}: {r['error']}"
                                              for r in errors] + [""]
    return lines


# --- correctness checks (before timing, on the first list) -------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a - b).item() / (den if den > 0 else 1.0)


def _cat(ts: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in ts])


def run_checks(shapes: Shapes, device: torch.device, ops_selected: Sequence[str]) -> List[Dict]:
    """Fresh random inputs; mixedprec against PyTorch (or float64) on the same data."""
    inp = Inputs(shapes, device, seed=1234)
    checks: List[Dict] = []

    def add(name, err, tol, extra=None):
        ok = err is not None and math.isfinite(err) and err <= tol
        checks.append(dict(name=name, rel_err=err, tol=tol, ok=bool(ok), **(extra or {})))

    for op in ops_selected:
        try:
            _check_one(op, inp, device, add)
        except Exception as e:  # noqa: BLE001  (a failed check; the run exits 1)
            checks.append(dict(name=op, rel_err=None, tol=None, ok=False,
                               error=f"{type(e).__name__}: {e}"))
        C.free_memory()
    return checks


def _check_one(op: str, inp: "Inputs", device: torch.device, add) -> None:
    """One check; ``add(name, rel_err, tol, extra)`` records it."""
    from mixedprec import ops
    if op.startswith("unscale"):
        dtype = F16 if op.endswith("fp16") else F32
        g = inp.randn(dtype)
        ref = [t.clone() for t in g]
        fi, fi_ref, inv = inp.scalar(0.0), inp.tscalar(0.0), inp.scalar(1 / 1024)
        ops.multi_tensor_unscale_(g, fi, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(ref, fi_ref, inv)
        err = _rel(_cat(g), _cat(ref))
        # and the flag: an inf in the last tensor must be seen by both
        g[-1].view(-1)[-1] = float("inf")
        ref[-1].view(-1)[-1] = float("inf")
        ops.multi_tensor_unscale_(g, fi, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(ref, fi_ref, inv)
        flags = (fi.item(), fi_ref.item())
        add(op, err if flags == (1.0, 1.0) else float("nan"), 0.0,
            {"found_inf (mixedprec, torch) after an inf": flags})
    elif op in ("adam", "sgd"):
        masters = inp.randn(F32)
        grads16 = inp.randn(F16)
        model = [m.to(F16) for m in masters]
        params = [torch.nn.Parameter(m.clone()) for m in masters]
        for p, g in zip(params, grads16):
            p.grad = g.float()
        scale = 512.0
        fi, fi_ref = inp.scalar(0.0), inp.tscalar(0.0)
        if op == "adam":
            m1, v1 = inp.randn(F32, std=0.1), inp.rand(F32, 0.01, 1.0)
            opt = torch.optim.AdamW(params, lr=CHECK_LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                    fused=True)
            for p, a, b in zip(params, m1, v1):
                opt.state[p] = {"step": torch.zeros((), dtype=F32, device=device),
                                "exp_avg": a.clone(), "exp_avg_sq": b.clone()}
            ops.fused_adam_(masters, grads16, m1, v1, model, step=inp.scalar(0.0), lr=CHECK_LR,
                            beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                            decoupled_weight_decay=True, bias_correction=True,
                            inv_scale=inp.scalar(1 / scale), found_inf=fi)
        else:
            buf = inp.randn(F32, std=0.1)
            opt = torch.optim.SGD(params, lr=CHECK_LR, momentum=MOMENTUM, fused=True)
            for p, b in zip(params, buf):
                opt.state[p] = {"momentum_buffer": b.clone()}
            ops.fused_sgd_(masters, grads16, buf, model, lr=CHECK_LR, momentum=MOMENTUM,
                           dampening=0.0, weight_decay=0.0, nesterov=False, first_run=False,
                           inv_scale=inp.scalar(1 / scale), found_inf=fi)
        before = _cat([p.detach() for p in params])
        opt.grad_scale, opt.found_inf = inp.tscalar(scale), fi_ref
        opt.step()
        after_ref = _cat([p.detach() for p in params])
        # compare the updates (the parameters themselves would hide errors)
        err = _rel(_cat(masters) - before, after_ref - before)
        copy_exact = all(torch.equal(a, m.to(F16)) for a, m in zip(model, masters))
        add(op, err if copy_exact and fi.item() == 0 else float("nan"), 1e-4,
            {"model copy == masters cast": copy_exact})
    elif op.startswith("sum"):
        x = _flat(inp, F16 if op.endswith("fp16") else BF16)
        ref = x.double().sum()
        scale = x.double().abs().sum().item()  # error relative to sum |x|
        err = abs(ops.sum_fp32(x).double().item() - ref.item()) / scale
        err_torch = abs(torch.sum(x, dtype=F32).double().item() - ref.item()) / scale
        add(op, err, 1e-5, {"torch rel_err": err_torch})
    elif op.startswith("l2norm"):
        g = inp.randn({"fp32": F32, "fp16": F16, "bf16": BF16}[op.split()[-1]])
        ref = torch.linalg.vector_norm(_cat(g).double())
        norm, _ = ops.multi_tensor_l2norm(g, None, per_tensor=False)
        add(op, _rel(norm.reshape(()), ref), 1e-5,
            {"torch rel_err": _rel(torch_total_norm(g).float(), ref)})
    elif op == "copy":
        src, dst = inp.randn(F32), inp.randn(F16)
        ops.multi_tensor_copy_(src, dst)
        exact = all(torch.equal(d, s.to(F16)) for s, d in zip(src, dst))
        add(op, 0.0 if exact else float("nan"), 0.0, {"== .to(float16)": exact})
    elif op == "adam+scaler":
        import mixedprec
        masters = inp.randn(F32)
        grads16 = inp.randn(F16)
        ours = [torch.nn.Parameter(m.to(F16)) for m in masters]
        theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]  # = the masters
        for a, b, g in zip(ours, theirs, grads16):
            a.grad, b.grad = g.clone(), g.float()
        opt = mixedprec.FusedAdam(ours, lr=CHECK_LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                  master_weights=True)
        opt_ref = torch.optim.AdamW(theirs, lr=CHECK_LR, betas=BETAS, eps=EPS,
                                    weight_decay=WD, fused=True)
        before = _cat([p.detach() for p in theirs])
        for o, scaler in ((opt, mixedprec.GradScaler(device.type, init_scale=512.0)),
                          (opt_ref, torch.amp.GradScaler(device.type, init_scale=512.0))):
            scaler.scale(torch.ones((), device=device))
            scaler.step(o)
            scaler.update()
        # the gradients carry no scale here: both divide them by 512
        masters_after = _cat([opt.state[p]["master_param"] for p in ours])
        err = _rel(masters_after - before, _cat([p.detach() for p in theirs]) - before)
        add(op, err, 1e-4)
    elif op == "adam+scaler report":
        # The report changes no update (bit for bit) and counts a clean step as clean.
        import mixedprec
        masters, grads16 = inp.randn(F32), inp.randn(F16)
        after, reports = [], []
        for report in (False, True):
            params = [torch.nn.Parameter(m.to(F16)) for m in masters]
            for p, g in zip(params, grads16):
                p.grad = g.clone()
            opt = mixedprec.optim.AdamW(params, lr=CHECK_LR, betas=BETAS, eps=EPS,
                                        weight_decay=WD)
            scaler = mixedprec.GradScaler(device.type, init_scale=512.0,
                                          overflow_report=report)
            scaler.scale(torch.ones((), device=device))
            scaler.step(opt)
            scaler.update()
            after.append(_cat([opt.state[p]["master_param"] for p in params]))
            reports.append(scaler.report(scale=False) if report else None)
        clean = reports[1] == {"steps": 1, "skipped": 0, "overflows": {}}
        add(op, 0.0 if torch.equal(*after) and clean else float("nan"), 0.0,
            {"report": reports[1]})


# --- running ----------------------------------------------------------------------------

def measure_copy(device: torch.device, elems: int, timer) -> Dict[str, Any]:
    src = torch.randn(elems, device=device)
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    t = timer(lambda i: dst.copy_(src))
    src = dst = None  # noqa: F841  (frees the buffers before the next case)
    C.free_memory()
    return dict(bytes=nbytes, gbps=nbytes / (t["median_ms"] * 1e6), **t)


def run_case(case: Case, shapes: Shapes, device: torch.device, timer) -> Dict[str, Any]:
    inp = Inputs(shapes, device)
    fn, after = case(inp)
    t = timer(fn)
    t.update(after())
    del fn, after, inp
    C.free_memory()
    return t


def parse_args(argv: Optional[Sequence[str]]):
    p = argparse.ArgumentParser(
        description="Times mixedprec's ops against PyTorch's on ResNet-50-, "
                    "GPT-2-medium-shaped and flat 1B-element parameter lists.",
        epilog="With no arguments: the full GPU run when CUDA is available, else a CPU "
               "smoke run (sizes / 1000) written to bench/results/cpu-smoke/.")
    p.add_argument("--out", help="output directory (default bench/results, or "
                                 "bench/results/cpu-smoke for a CPU run)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--lists", default=LISTS_DEFAULT,
                   help="comma-separated: resnet50, gpt2-medium, flat-1b, gpt-98m, tiny-161 "
                        f"(default {LISTS_DEFAULT}; a CPU measurement: {CPU_LISTS})")
    p.add_argument("--ops", default=",".join(ALL_GROUPS),
                   help=f"comma-separated: {', '.join(ALL_GROUPS)} (default all; a CPU "
                        f"measurement: {CPU_OPS}). {MODES_GROUP}: one optimizer step in "
                        "every mode (AdamW and SGD master x state, torch's fused ones, LAMB, "
                        "Adagrad, NovoGrad) on the GPT-2-medium and ResNet-50 lists of "
                        "--lists, as %% of the copy bandwidth at its own bytes")
    p.add_argument("--scale", type=int,
                   help="divide every tensor's size by this (default 1 on a GPU, 1000 on CPU)")
    p.add_argument("--warmup", type=int, help="warm-up calls per case (default 5 GPU, 1 CPU)")
    p.add_argument("--reps", type=int,
                   help="the fewest timed repetitions (default 20 GPU, 3 CPU; the GPU run "
                        "takes more, up to 200, where a case is short)")
    p.add_argument("--copy-elems", type=int,
                   help="fp32 elements of the copy reference (default 2**29, / scale)")
    p.add_argument("--no-checks", action="store_true", help="skip the correctness checks")
    p.add_argument("--time-budget", type=float, default=200.0,
                   help="seconds; cases past it are skipped and marked so (default 200)")
    p.add_argument("--threads",
                   help="CPU threads, comma-separated for several runs (default: 1 on a "
                        "CPU smoke run; 1 and every core on a CPU measurement)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    C.ensure_importable()
    import mixedprec  # noqa: F401  (fail early with a clear error)

    device = C.pick_device(args.device)
    threads = torch.get_num_threads()
    try:
        with C.collecting_only_new_objects():
            if device.type == "cpu" and args.scale == 1:
                return _run_cpu(args, argv, device)
            if args.threads or device.type != "cuda":
                torch.set_num_threads(int((args.threads or "1").split(",")[0]))
            return _run(args, argv, device)
    finally:
        torch.set_num_threads(threads)


# --- the CPU measurement (--device cpu --scale 1) ----------------------------------------
#
# Full-size lists; for each thread count and each op, every implementation's case is
# built first, then the calls alternate between them (A/B/A/B, the first one rotating
# each round), so that a noisy machine slows them alike. Wall clock per call; median
# and the p20-p80 spread.

CPU_TARGET = 1.0  # every op at least as fast as torch's, at every thread count
CPU_SCALING_TARGET = 1.6  # all cores vs 1 thread, on the large list


def run_interleaved(cases, shapes: Shapes, device: torch.device, reps: int,
                    warmup: int) -> List[Dict[str, Any]]:
    """[(impl, side, case)] -> one summary per impl, calls interleaved."""
    built = []
    for _, _, case in cases:
        built.append(case(Inputs(shapes, device)))
    for w in range(warmup):
        for fn, _ in built:
            fn(w)
    times: List[List[float]] = [[] for _ in built]
    for r in range(reps):
        order = list(range(len(built)))
        order = order[r % len(built):] + order[:r % len(built)]
        for k in order:
            t0 = time.perf_counter()
            built[k][0](warmup + r)
            times[k].append((time.perf_counter() - t0) * 1e3)
    out = []
    for (fn, after), ts in zip(built, times):
        t = C.summary(ts)
        t.update(after())
        out.append(t)
    del built
    C.free_memory()
    return out


def _cpu_threads(arg: Optional[str]) -> List[int]:
    if arg:
        return [int(t) for t in arg.split(",") if t]
    cores = os.cpu_count() or 1
    return [1] if cores == 1 else [1, cores]


def _run_cpu(args, argv, device: torch.device) -> int:
    list_names = [s for s in (args.lists if args.lists != LISTS_DEFAULT else CPU_LISTS)
                  .split(",") if s]
    groups = [s for s in (args.ops if args.ops != ",".join(ALL_GROUPS) else CPU_OPS)
              .split(",") if s]
    op_names = []
    for g in groups:
        if g == MODES_GROUP:
            raise SystemExit(f"--ops {MODES_GROUP} runs on a GPU or as a CPU smoke run "
                             "(--scale > 1); on the CPU, bench/lean_speed.py measures the "
                             "AdamW modes")
        if g not in OP_GROUPS:
            raise SystemExit(f"unknown op {g!r}; choose from {', '.join(OP_GROUPS)}")
        op_names += OP_GROUPS[g]
    lists = build_lists(list_names, 1)
    reps, warmup = args.reps or 15, 2 if args.warmup is None else args.warmup
    thread_counts = _cpu_threads(args.threads)
    env = C.environment(device)
    out = C.out_dir(args.out, False)
    t_start = time.time()
    print(f"mixedprec ops benchmark on {env['device']}, threads {thread_counts}, "
          f"{reps} interleaved calls per case", flush=True)
    checks = []
    if not args.no_checks:
        checks = run_checks(build_lists(["resnet50"], 1000)["resnet50"]["shapes"], device,
                            op_names)
        for c in checks:
            detail = c.get("error") or f"rel_err {c['rel_err']:.2e} (tol {c['tol']:.0e})"
            print(f"  check {c['name']:<14} {detail} {'ok' if c['ok'] else 'FAILED'}", flush=True)

    results: List[Dict[str, Any]] = []
    copies: Dict[int, Dict[str, Any]] = {}
    timer = C.Timer(device, warmup=2, min_reps=reps, max_reps=reps)
    for threads in thread_counts:
        torch.set_num_threads(threads)
        copies[threads] = measure_copy(device, args.copy_elems or 2**27, timer)
        copy = copies[threads]
        print(f"  {threads} thread(s): copy {copy['median_ms']:.2f} ms, "
              f"{copy['gbps']:.1f} GB/s", flush=True)
        for lname, lst in lists.items():
            for op in op_names:
                cases = CASES[op]
                # 161 x 1 measures the fixed cost of a step; the others, bandwidth.
                if (lname == "tiny-161") != (op in ("adam", "adam+scaler")) and \
                        (lname == "tiny-161" or op == "adam+scaler"):
                    continue
                if time.time() - t_start > args.time_budget:
                    for impl, side, _ in cases:
                        results.append(dict(threads=threads, list=lname, op=op, impl=impl,
                                            side=side, skipped="time budget spent"))
                    continue
                try:
                    timed = run_interleaved(cases, lst["shapes"], device, reps, warmup)
                except Exception as e:  # noqa: BLE001  (recorded, and the run fails)
                    timed = [dict(error=f"{type(e).__name__}: {e}")] * len(cases)
                    C.free_memory()
                for (impl, side, _), t in zip(cases, timed):
                    row = dict(threads=threads, list=lname, op=op, impl=impl, side=side,
                               numel=lst["numel"], tensors=lst["tensors"],
                               bytes_per_elem=BYTES[op][side], **t)
                    row["bytes"] = row["bytes_per_elem"] * lst["numel"]
                    if "median_ms" in row:
                        row["gbps"] = row["bytes"] / (row["median_ms"] * 1e6)
                        row["pct_copy"] = 100.0 * row["gbps"] / copy["gbps"]
                        row["spread_pct"] = 100.0 * (row["p80_ms"] - row["p20_ms"]) / \
                            row["median_ms"]
                    results.append(row)
                    msg = row.get("error") or (f"{row['median_ms']:9.3f} ms "
                                               f"(p20-p80 {row['p20_ms']:.3f}-"
                                               f"{row['p80_ms']:.3f})")
                    print(f"  {threads}T {lst['label']:<10} {op:<12} {impl:<48} {msg}",
                          flush=True)

    for row in results:
        if row["side"] != "mixedprec" or "median_ms" not in row:
            continue
        refs = [r for r in results if r["threads"] == row["threads"] and
                r["list"] == row["list"] and r["op"] == row["op"] and r["side"] == "torch"
                and "median_ms" in r]
        row["speedup"] = {r["impl"]: r["median_ms"] / row["median_ms"] for r in refs}
        if refs:
            row["speedup_vs_fastest_torch"] = min(r["median_ms"] for r in refs) / row["median_ms"]
    targets = evaluate_cpu_targets(results, lists, copies)
    data = dict(benchmark="mixedprec ops (CPU)", smoke=False,
                argv=list(sys.argv[1:] if argv is None else argv), env=env,
                config=dict(threads=thread_counts, reps=reps, warmup=warmup,
                            lists={k: {kk: vv for kk, vv in v.items() if kk != "shapes"}
                                   for k, v in lists.items()},
                            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, momentum=MOMENTUM,
                            timing="wall clock per call, implementations interleaved, median",
                            bytes_per_elem=BYTES),
                copy=copies, checks=checks, results=results, targets=targets,
                elapsed_s=time.time() - t_start)
    stem = "ops-cpu"
    C.write_json(out / f"{stem}.json", data)
    md = cpu_markdown(data, lists, op_names)
    (out / f"{stem}.md").write_text(md)
    print()
    print(md)
    note = cpu_chart(data, lists, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')}, .md" + (f" ({note})" if note else ", .png")
          + f" in {data['elapsed_s']:.0f} s")
    failed = [r for r in results if "error" in r or r.get("found_inf")]
    failed_checks = [c for c in checks if not c["ok"]]
    if failed or failed_checks:
        print(f"FAILED: {len(failed)} case(s), {len(failed_checks)} check(s)", file=sys.stderr)
        return 1
    return 0


def cpu_chart(data: Dict[str, Any], lists: Dict[str, Dict], path: Path) -> Optional[str]:
    """Bars of each op's speed-up over its fastest torch counterpart (log scale, 1 =
    as fast), per list and thread count; the reason instead when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no chart: {e}"
    rows = [r for r in data["results"] if r["side"] == "mixedprec" and
            "speedup_vs_fastest_torch" in r and not r["impl"].startswith("mixedprec Fused")]
    ops_ = list(dict.fromkeys(r["op"] for r in rows))
    series = sorted({(r["list"], r["threads"]) for r in rows},
                    key=lambda k: (list(lists).index(k[0]), k[1]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(ops_) + 2), 4.5))
    width = 0.8 / max(1, len(series))
    for j, (lname, threads) in enumerate(series):
        xs, ys = [], []
        for i, op in enumerate(ops_):
            r = next((r for r in rows if (r["op"], r["list"], r["threads"]) ==
                      (op, lname, threads)), None)
            if r is not None:
                xs.append(i + (j - (len(series) - 1) / 2) * width)
                ys.append(r["speedup_vs_fastest_torch"])
        ax.bar(xs, ys, width, label=f"{lists[lname]['label']}, {threads} thread(s)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(ops_)), ops_, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("torch time / mixedprec time")
    ax.legend(fontsize=7)
    fig.suptitle(f"mixedprec ops vs torch — {data['env']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def evaluate_cpu_targets(results, lists, copies) -> List[Dict[str, Any]]:
    """Every mixedprec op at least as fast as each torch counterpart, at every thread
    count (the optimizer-level FusedAdam.step/FusedSGD.step rows are information; on
    the 161 x 1 list, the step through GradScaler is the fixed cost compared); and on
    the largest list, all cores at least CPU_SCALING_TARGET x one thread."""
    out = []
    for row in results:
        if row["side"] != "mixedprec" or "median_ms" not in row:
            continue
        if row["impl"].startswith("mixedprec Fused") and row["op"] != "adam+scaler":
            continue
        if row["impl"] == REPORT_ON or row["op"] == "adam+scaler report":
            continue  # (information: the report's cost)
        if (row["list"] == "tiny-161") != (row["op"] == "adam+scaler"):
            continue  # the fixed cost on 161 x 1; bandwidth-bound ops on the others
        for impl, s in row.get("speedup", {}).items():
            out.append(dict(target=f"{row['op']} on {lists[row['list']]['label']}, "
                                   f"{row['threads']} thread(s): >= {CPU_TARGET}x {impl}",
                            value=round(s, 3), unit="x", threshold=CPU_TARGET,
                            passed=s >= CPU_TARGET))
    counts = sorted(copies)
    big = max(lists, key=lambda n: lists[n]["numel"])
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        copy_ratio = copies[lo]["median_ms"] / copies[hi]["median_ms"]
        for row in results:
            if (row["list"] != big or row["threads"] != hi or row["side"] != "mixedprec"
                    or "median_ms" not in row or row["impl"].startswith("mixedprec Fused")
                    or row["op"] == "adam+scaler report"):
                continue
            one = next((r for r in results if r["threads"] == lo and r["list"] == big and
                        r["op"] == row["op"] and r["impl"] == row["impl"] and
                        "median_ms" in r), None)
            if one is None:
                continue
            ratio = one["median_ms"] / row["median_ms"]
            out.append(dict(target=f"{row['op']} on {lists[big]['label']}: {hi} threads >= "
                                   f"{CPU_SCALING_TARGET}x {lo} (the copy: "
                                   f"{copy_ratio:.2f}x)",
                            value=round(ratio, 3), unit="x", threshold=CPU_SCALING_TARGET,
                            passed=ratio >= CPU_SCALING_TARGET))
    return out


def cpu_markdown(data: Dict[str, Any], lists: Dict[str, Dict], op_names: Sequence[str]) -> str:
    env, results = data["env"], data["results"]
    lines = [f"# mixedprec ops vs PyTorch on the CPU — {env.get('cpu_model') or env['device']}",
             ""]
    lines += C.env_lines(env, False)
    lines += [f"- CPU: {env.get('cpu_model')}, {env.get('cpu_count')} cores; flags "
              f"{' '.join(env.get('cpu_flags', []))}; torch's CPU capability "
              f"{env.get('cpu_capability')}",
              "- lists: " + ", ".join(f"{v['label']}: {v['tensors']} tensors, "
                                      f"{v['numel']:,} elements" for v in lists.values()),
              f"- timing: {data['config']['timing']}; {data['config']['reps']} calls per "
              f"case after {data['config']['warmup']} warm-up calls", ""]
    for threads in data["config"]["threads"]:
        copy = data["copy"][threads]
        lines += [f"## {threads} thread(s)", "",
                  f"Copy reference: {copy['bytes'] / 1e9:.3g} GB moved (read + write) in "
                  f"{copy['median_ms']:.2f} ms = **{copy['gbps']:.1f} GB/s**. Time: median ms "
                  "(p20-p80); `torch/this`: the fastest torch counterpart's median over this "
                  "one's (> 1: mixedprec is faster).", ""]
        header = ["op: implementation"]
        for ln in lists:
            header += [lists[ln]["label"], "torch/this"]
        header += ["% copy (largest)"]
        big = max(lists, key=lambda n: lists[n]["numel"])
        body = []
        for op in op_names:
            for impl, side, _ in CASES[op]:
                row = [f"{op}: {impl}"]
                for ln in lists:
                    r = next((x for x in results if x["threads"] == threads and x["list"] == ln
                              and x["op"] == op and x["impl"] == impl), None)
                    if r is None or "median_ms" not in r:
                        row += [(r or {}).get("error", (r or {}).get("skipped", "")), ""]
                        continue
                    row += [f"{r['median_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f})",
                            C.fmt(r.get("speedup_vs_fastest_torch"), 2)
                            if side == "mixedprec" else ""]
                rb = next((x for x in results if x["threads"] == threads and x["list"] == big
                           and x["op"] == op and x["impl"] == impl and "pct_copy" in x), None)
                row += [C.fmt(rb["pct_copy"], 1) if rb else ""]
                body.append(row)
        lines += C.md_table(header, body) + [""]
    lines += ["## Targets (CPU)", ""]
    body = [[t["target"], f"{t['value']}x", C.verdict(t["passed"])] for t in data["targets"]]
    if body:
        lines += C.md_table(["Target", "Value", "Result"], body, "lrr") + [""]
        n = sum(1 for t in data["targets"] if t["passed"])
        lines += [f"{n} of {len(body)} targets met.", ""]
    if data["checks"]:
        lines += ["## Correctness checks (ResNet-50 list / 1000, before timing)", ""]
        body = [[c["name"], f"{c['rel_err']:.2e}" if c["rel_err"] is not None else
                 c.get("error", "nan"), "" if c["tol"] is None else f"{c['tol']:.0e}",
                 "ok" if c["ok"] else "FAILED"] for c in data["checks"]]
        lines += C.md_table(["Check", "rel. error", "tolerance", "result"], body, "lrrr")
    return "\n".join(lines) + "\n"


def _run(args, argv, device: torch.device) -> int:
    gpu = device.type == "cuda"
    smoke = not gpu
    factor = args.scale if args.scale else (1 if gpu else 1000)
    list_names = [s for s in args.lists.split(",") if s]
    groups = [s for s in args.ops.split(",") if s]
    op_names = []
    for g in groups:
        if g not in ALL_GROUPS:
            raise SystemExit(f"unknown op {g!r}; choose from {', '.join(ALL_GROUPS)}")
        op_names += OP_GROUPS.get(g, [])
    lists = build_lists(list_names, factor)
    timer = C.Timer(device, warmup=args.warmup if args.warmup is not None else (5 if gpu else 1),
                    min_reps=args.reps or (20 if gpu else 3), max_reps=200 if gpu else 3)
    env = C.environment(device)
    out = C.out_dir(args.out, smoke)
    t_start = time.time()
    print(f"mixedprec ops benchmark on {env['device']}"
          + (" (CPU SMOKE RUN: not results)" if smoke else ""), flush=True)

    checks = []
    if not args.no_checks and list_names and op_names:
        checks = run_checks(lists[list_names[0]]["shapes"], device, op_names)
        for c in checks:
            detail = (c["error"] if "error" in c else
                      f"rel_err {c['rel_err']:.2e} (tol {c['tol']:.0e})")
            print(f"  check {c['name']:<14} {detail} {'ok' if c['ok'] else 'FAILED'}", flush=True)

    copy_elems = args.copy_elems or max(1 << 12, (1 << 29) // factor)
    copy = measure_copy(device, copy_elems, timer)
    print(f"  copy reference: {copy['bytes'] / 1e9:.3g} GB moved, {copy['median_ms']:.3f} ms, "
          f"{copy['gbps']:.1f} GB/s", flush=True)

    results: List[Dict[str, Any]] = []
    for lname, lst in lists.items():
        for op in op_names:
            for impl, side, case in CASES[op]:
                row = dict(list=lname, op=op, impl=impl, side=side, dtypes=DTYPE_NOTE[op],
                           numel=lst["numel"], tensors=lst["tensors"],
                           bytes_per_elem=BYTES[op][side])
                row["bytes"] = row["bytes_per_elem"] * lst["numel"]
                if time.time() - t_start > args.time_budget:
                    row["skipped"] = f"time budget of {args.time_budget:.0f} s spent"
                    results.append(row)
                    print(f"  {lst['label']:<13} {op:<13} {impl:<50} skipped", flush=True)
                    continue
                try:
                    row.update(run_case(case, lst["shapes"], device, timer))
                    row["gbps"] = row["bytes"] / (row["median_ms"] * 1e6)
                    row["pct_copy"] = 100.0 * row["gbps"] / copy["gbps"]
                except Exception as e:  # noqa: BLE001  (recorded, and the run fails)
                    row["error"] = f"{type(e).__name__}: {e}"
                    C.free_memory()
                results.append(row)
                msg = row.get("error") or (f"{row['median_ms']:9.4f} ms {row['gbps']:8.1f} GB/s "
                                           f"{row['pct_copy']:5.1f}% of copy")
                print(f"  {lst['label']:<13} {op:<13} {impl:<50} {msg}", flush=True)

    # Every optimizer mode, after the ops, within the same time budget.
    modes = None
    if MODES_GROUP in groups:
        modes = run_modes(args, list_names, factor, device, copy, copy_elems, t_start, smoke)

    # speed-ups: PyTorch's time / this time, against each PyTorch counterpart
    for row in results:
        if row["side"] != "mixedprec" or "median_ms" not in row:
            continue
        refs = [r for r in results if r["list"] == row["list"] and r["op"] == row["op"]
                and r["side"] == "torch" and "median_ms" in r]
        row["speedup"] = {r["impl"]: r["median_ms"] / row["median_ms"] for r in refs}
        row["latency_speedup"] = {r["impl"]: r["latency_ms"] / row["latency_ms"] for r in refs
                                  if r.get("latency_ms") and row.get("latency_ms")}
        if refs:
            row["speedup_vs_fastest_torch"] = min(r["median_ms"] for r in refs) / row["median_ms"]

    targets = evaluate_targets(results, lists, smoke)
    data = dict(benchmark="mixedprec ops", smoke=smoke,
                argv=list(sys.argv[1:] if argv is None else argv), env=env,
                config=dict(scale=factor,
                            lists={k: {kk: vv for kk, vv in v.items() if kk != "shapes"}
                                   for k, v in lists.items()},
                            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, momentum=MOMENTUM,
                            timing=("CUDA events, stream held while queued, L2 flushed, "
                                    "median" if gpu else "wall clock, median"),
                            bytes_per_elem=BYTES),
                copy=copy, checks=checks, results=results, targets=targets,
                elapsed_s=time.time() - t_start)
    if modes is not None:
        data["modes"] = modes
    stem = f"ops-{C.device_slug(env)}"
    C.write_json(out / f"{stem}.json", data)
    md = markdown(data, lists, op_names)
    (out / f"{stem}.md").write_text(md)
    print()
    print(md)
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')} "
          f"in {data['elapsed_s']:.0f} s")
    copied = C.copy_out([out / f"{stem}.json", out / f"{stem}.md"], bool(args.out), smoke)
    if copied:
        print(f"copied them to {copied}")
    failed = [r for r in results if "error" in r] + [c for c in checks if not c["ok"]] + \
        [r for r in results if r.get("found_inf")]
    if modes is not None:
        failed += [r for r in modes["rows"] if "error" in r or r.get("skipped_steps")]
    if failed:
        print(f"FAILED: {len(failed)} case(s) raised, failed a check, or skipped a step",
              file=sys.stderr)
        return 1
    return 0


def evaluate_targets(results, lists, smoke: bool) -> List[Dict[str, Any]]:
    """The H100 targets: bandwidth (BANDWIDTH_TARGETS, of the copy's) on the large
    lists; speed-up over every PyTorch counterpart on every list (SPEEDUP_TARGETS; on
    ResNet-50, RESNET50_SPEEDUP_TARGET for adam and sgd), for the op-level rows; on
    ResNet-50 also the optimizer-level rows' latency (one call, Python included)
    against each counterpart's. Reported, never enforced; not evaluated on a CPU
    smoke run."""
    out = []

    def add(target, value, unit, threshold):
        out.append(dict(target=target, value=round(value, 3), unit=unit, threshold=threshold,
                        passed=None if smoke else value >= threshold))

    for row in results:
        op = row["op"]
        if row["side"] != "mixedprec" or op not in TARGET_OPS or "median_ms" not in row:
            continue
        label = f"{op} on {lists[row['list']]['label']}"
        resnet = row["list"] == "resnet50"
        need = (RESNET50_SPEEDUP_TARGET if resnet and op in ("adam", "sgd")
                else SPEEDUP_TARGETS[op])
        if row["impl"].startswith("mixedprec Fused"):  # optimizer level: latency on ResNet-50
            if resnet:
                for impl, s in row.get("latency_speedup", {}).items():
                    add(f"{label}: {row['impl']} latency >= {need}x {impl}'s", s, "x", need)
            continue
        if row["list"] in LARGE_LISTS:
            bw = BANDWIDTH_TARGETS[op]
            add(f"{label}: >= {bw:.0%} of copy bandwidth", row["pct_copy"], "% of copy",
                bw * 100)
        for impl, s in row.get("speedup", {}).items():
            add(f"{label}: >= {need}x {impl}", s, "x", need)
    return out


def markdown(data: Dict[str, Any], lists: Dict[str, Dict], op_names: Sequence[str]) -> str:
    env, smoke, results = data["env"], data["smoke"], data["results"]
    copy = data["copy"]
    lnames = list(lists)
    lines = [f"# mixedprec ops vs PyTorch — {env['device']}", ""]
    lines += C.env_lines(env, smoke)
    sizes = ", ".join(f"{v['label']}: {v['tensors']} tensor{'s' if v['tensors'] > 1 else ''}, "
                      f"{v['numel']:,} elements"
                      + (f" (full size / {v['scale']})" if v["scale"] > 1 else "")
                      for v in lists.values())
    lines += [f"- lists: {sizes}",
              f"- copy reference: {copy['bytes'] / 1e9:.3g} GB moved (read + write) in "
              f"{copy['median_ms']:.3f} ms = **{copy['gbps']:.1f} GB/s**",
              f"- timing: {data['config']['timing']}", ""]

    def cell(row, key, digits=3):
        if row is None:
            return ""
        if "error" in row:
            return "error"
        if "skipped" in row:
            return "skipped"
        return C.fmt(row.get(key), digits)

    rows_by = {(r["list"], r["op"], r["impl"]): r for r in results}
    impls = []
    for op in op_names:
        for impl, side, _ in CASES[op]:
            impls.append((op, impl, side))

    if impls:  # (none with --ops modes alone)
        lines += ["## Time (median ms) and speed-up over PyTorch", "",
                  "`vs PyTorch` = fastest PyTorch counterpart's time / this time "
                  "(> 1: mixedprec is faster), like the seeds' 16/32 column.", ""]
        header = ["Time (ms)"]
        for ln in lnames:
            header += [lists[ln]["label"], "vs PyTorch"]
        body = []
        for op, impl, side in impls:
            row = [f"{op}: {impl}"]
            for ln in lnames:
                r = rows_by.get((ln, op, impl))
                row += [cell(r, "median_ms", 4),
                        cell(r, "speedup_vs_fastest_torch", 2) if side == "mixedprec" else ""]
            body.append(row)
        lines += C.md_table(header, body) + [""]

        lines += ["## Effective bandwidth", "",
                  "From the fewest bytes each op must move (B/elem column; see "
                  "bench/README.md), and as a percentage of the copy's bandwidth.", ""]
        header = ["Bandwidth", "B/elem"]
        for ln in lnames:
            header += [f"{lists[ln]['label']} GB/s", "% copy"]
        body = []
        for op, impl, side in impls:
            row = [f"{op}: {impl}", BYTES[op][side]]
            for ln in lnames:
                r = rows_by.get((ln, op, impl))
                row += [cell(r, "gbps", 1), cell(r, "pct_copy", 1)]
            body.append(row)
        lines += C.md_table(header, body) + [""]

        lines += ["## Targets (H100)", ""]
        lines += targets_markdown(data["targets"], smoke)

    if data.get("modes"):
        lines += modes_markdown(data)

    if data["checks"]:
        lines += ["## Correctness checks (first list, before timing)", ""]
        body = [[c["name"], f"{c['rel_err']:.2e}" if c["rel_err"] is not None else
                 c.get("error", "nan"), "" if c["tol"] is None else f"{c['tol']:.0e}",
                 "ok" if c["ok"] else "FAILED"] for c in data["checks"]]
        lines += C.md_table(["Check", "rel. error", "tolerance", "result"], body, "lrrr") + [""]
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["## Errors", ""] + [f"- {r['list']} {r['op']} {r['impl']}: {r['error']}"
                                      for r in errors] + [""]
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
