"""Typed wrappers of the ``torch.ops.mixedprec`` operators, with their fake kernels.

The schemas live in ``csrc/ops.cpp``; CPU and CUDA kernels in ``csrc/cpu`` and
``csrc/cuda``. Conventions shared by every op:

* Scalar-like tensors hold one element on the device of the data: ``found_inf``,
  ``inv_scale``, ``step`` and ``scale`` are float32, the loss-scale trackers int32.
* Data tensors are float32, float16 or bfloat16 (mixed dtypes within one list are
  allowed); optimizer state (momentum buffers, ``exp_avgs``, ``exp_avg_sqs``) is
  float32. All math is done in float32.
* Tensors in lists must be dense and non-overlapping: contiguous, or a permutation
  such as channels_last. Tensors paired across lists must have the same number of
  elements and the same memory order. Other layouts are rejected, not copied.
* Bad arguments raise ``TypeError`` (dtype, layout), ``ValueError`` (lengths, sizes,
  hyper-parameters) or ``RuntimeError`` (devices), naming the argument, before
  anything is written. Empty lists and zero-element tensors are no-ops.
* No op synchronises with the host.
* Each wrapper takes its tensor lists (and, in the ops without a second list, its
  tensors) positionally, and everything after them by keyword only.
"""

import functools
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C  # loads the library, which registers the ops

#: Elements per chunk of the multi-tensor engine (one CUDA block each).
CHUNK_SIZE: int = _C.CHUNK_SIZE
#: The most tensors one launch of the engine takes (for single-list ops).
MAX_TENSORS_PER_LAUNCH: int = _C.MAX_TENSORS_PER_LAUNCH
#: The most chunks one launch of the engine takes.
MAX_BLOCKS_PER_LAUNCH: int = _C.MAX_BLOCKS_PER_LAUNCH
#: The optimizers' plan check, a class and not an op (csrc/plan_check.h):
#: ``PlanCheck(params, grads, masters, versions)``, made with a plan, and
#: ``.gradients(params)``, the group's gradients when the plan still holds (else None).
PlanCheck = torch.classes.mixedprec.PlanCheck

# torch._dynamo.disable, imported at the first call (torch's own lazy form, which its
# modules use: importing torch._dynamo takes 2.3 s, more than the rest of `import
# mixedprec`); a torch without it gets torch._dynamo.disable itself. For the host-side
# methods that torch.compile runs as torch's own counterparts run (not traced): the
# GradScaler's step and update, the schedulers' step.
not_traced = getattr(torch, "_disable_dynamo", None) or torch._dynamo.disable

__all__ = [
    "PlanCheck",
    "is_dense",
    "int64_tensor",
    "rounding_words",
    "multi_tensor_unscale_",
    "multi_tensor_unscale_to_",
    "multi_tensor_check_finite_",
    "multi_tensor_copy_",
    "multi_tensor_l2norm",
    "fused_sgd_",
    "fused_adam_",
    "fused_lamb_",
    "sum_fp32",
    "update_loss_scale_",
    "fused_adagrad_",
    "fused_novograd_",
]


def renamed(**renames: str):
    """A decorator for a function or a constructor whose keyword arguments were renamed
    since an earlier release (old name -> new name): a call that passes an old name
    raises a TypeError naming the new one, before anything runs (the signature, as
    inspect shows it, is the new one). The op wrappers below and the Apex faces use it.
    A call with today's names pays nothing but the call: the old names are looked for
    only once Python has refused the call's keywords (before ``fn`` ran)."""
    def wrap(fn):
        where = fn.__name__

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TypeError:
                for old, new in renames.items():
                    if old in kwargs:
                        name = type(args[0]).__name__ if where == "__init__" else where
                        raise TypeError(f"{name}: the keyword argument {old!r} was renamed "
                                        f"{new!r}: pass {new}={kwargs[old]!r}") from None
                raise
        return call
    return wrap


def is_dense(t: Tensor) -> bool:
    """Whether the multi-tensor ops take ``t`` as it is: strided, dense and
    non-overlapping (contiguous, or a permutation of a contiguous layout such as
    channels_last). Size-1 dimensions may have any stride."""
    if t.layout != torch.strided:
        return False
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def rounding_words(rows: Sequence[Sequence[int]], device: Any = None) -> List[Tensor]:
    """``sr_salts`` of :func:`fused_sgd_` and :func:`fused_adam_`: for each param, a
    contiguous int64 tensor of 4 words (views of one tensor on ``device``) from its
    row ``(salt, offset, run, stride)``, or ``(salt,)`` for a whole tensor (0, 0, 0).
    The local element at position i of the param's memory takes the bits of element
    ``offset + (i // run) * stride + i % run`` of the full tensor (run 0: ``offset +
    i``; ``distributed.global_layout``): salt below 2**32, offset >= 0, run and stride
    0 or > 0, checked here (the op reads them on the device).

    The words are made on the device from the rows' numbers as kernel arguments
    (:func:`int64_tensor`), never copied from host memory: building them neither waits
    for the device nor breaks a CUDA graph's capture (a plan made in a captured step)."""
    full = [tuple(int(v) for v in row) + (0,) * (4 - len(row)) for row in rows]
    for i, (salt, offset, run, stride) in enumerate(full):
        if len(rows[i]) not in (1, 4) or not 0 <= salt < 2**32 or offset < 0 or run < 0 \
                or stride < 0:
            raise ValueError("rounding_words: expected rows (salt, offset, run, stride) or "
                             "(salt,) with 0 <= salt < 2**32 and the rest >= 0, got "
                             f"{tuple(rows[i])} at rows[{i}]")
    if not full:
        return []
    columns = [int64_tensor(list(column), device) for column in zip(*full)]
    return list(torch.stack(columns, dim=1).split(1))


def int64_tensor(values: Sequence[int], device: Any = None) -> Tensor:
    """``values`` (ints) as an int64 tensor on ``device``, made there from numbers passed
    as kernel arguments, never copied from host memory (which ``torch.tensor(values,
    device=...)`` does: on CUDA it waits for the host and breaks a graph capture): one
    ``arange * step + start`` or ``full`` per run of equal differences, so a column of
    positions or of zeros is one piece."""
    values = [int(v) for v in values]
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    pieces = []
    start = 0
    while start < len(values):
        end = start + 1
        step = values[end] - values[start] if end < len(values) else 0
        while end < len(values) and values[end] - values[end - 1] == step and \
                abs(step) < 2**62:  # (steps * count stay within int64)
            end += 1
        count = end - start
        if step == 0 or count == 1:
            piece = torch.full((count,), values[start], dtype=torch.int64, device=device)
        else:
            piece = torch.arange(count, dtype=torch.int64, device=device).mul_(step)
            piece.add_(values[start])
        pieces.append(piece)
        start = end
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _no_meta_among_real(op: str, args: dict) -> None:
    """Raises when ``args`` (an op's arguments by name) mix meta and real tensors.

    The dispatcher sends such an eager call to the fake kernel, which writes nothing:
    the call would silently do nothing. All-meta calls (shape inference) pass, and so
    do FakeTensors, which report the device they stand for. Each fake kernel calls it
    first, with its arguments by name (``locals()``, or as _fake_without_outputs names
    them)."""
    meta = real = None
    for name, value in args.items():
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, t in items:
            if not isinstance(t, Tensor):
                continue
            label = name if i is None else f"{name}[{i}]"
            if t.device.type == "meta":
                meta = meta or label
            elif real is None:
                real = (label, t.device)
    if meta is not None and real is not None:
        raise RuntimeError(f"{op}: {meta} is on meta, {real[0]} on {real[1]}: "
                           "expected every tensor on one device")


def multi_tensor_unscale_(tensors: List[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiplies every tensor in place by ``inv_scale``; sets ``found_inf`` to 1.0 when
    any input element is inf or NaN (never clears it)."""
    torch.ops.mixedprec.multi_tensor_unscale_.default(
        tensors=tensors, found_inf=found_inf, inv_scale=inv_scale
    )


def multi_tensor_unscale_to_(
    src: List[Tensor], dst: List[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    """``dst[i] = src[i] * inv_scale`` with a cast to ``dst[i].dtype`` (e.g. fp16/bf16
    gradients into fp32 master gradients); sets ``found_inf`` like
    :func:`multi_tensor_unscale_`."""
    torch.ops.mixedprec.multi_tensor_unscale_to_.default(
        src=src, dst=dst, found_inf=found_inf, inv_scale=inv_scale
    )


def multi_tensor_check_finite_(tensors: List[Tensor], found_inf: Tensor) -> None:
    """Sets ``found_inf`` to 1.0 when any element of ``tensors`` is inf or NaN (never
    clears it); reads the tensors and writes nothing else. The read-only pass that
    lets a fused optimizer skip a step on the device before it writes anything."""
    torch.ops.mixedprec.multi_tensor_check_finite_.default(tensors=tensors, found_inf=found_inf)


def multi_tensor_copy_(src: List[Tensor], dst: List[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` with a cast, for all pairs in few launches (masters into
    the model)."""
    torch.ops.mixedprec.multi_tensor_copy_.default(src=src, dst=dst)


def multi_tensor_l2norm(
    tensors: List[Tensor], inv_scale: Optional[Tensor] = None, *, per_tensor: bool = False
) -> Tuple[Tensor, Tensor]:
    """The L2 norm of all ``tensors`` together (float32, shape ``[1]``), each element
    multiplied by ``inv_scale`` when given; and, when ``per_tensor``, the float32
    vector of per-tensor norms (else an empty tensor). Each element is converted to
    float32 and multiplied by ``inv_scale`` in float32. On the CPU its square and
    every sum are float64 (per chunk of ``CHUNK_SIZE`` elements, per tensor, total),
    rounded to float32 at the end; on CUDA the squares and all the sums (per thread,
    per chunk, per tensor, total) are float32. The result is deterministic: partial
    sums are combined in a fixed order. With no tensors and no ``inv_scale``, the
    norm is 0 on the CPU."""
    return torch.ops.mixedprec.multi_tensor_l2norm.default(
        tensors=tensors, inv_scale=inv_scale, per_tensor=per_tensor
    )


@torch.library.register_fake("mixedprec::multi_tensor_l2norm")
def _(tensors, inv_scale, per_tensor):
    _no_meta_among_real("multi_tensor_l2norm", locals())
    like = tensors[0] if tensors else inv_scale
    device = like.device if like is not None else torch.device("cpu")
    norm = torch.empty([1], dtype=torch.float32, device=device)
    per = torch.empty([len(tensors) if per_tensor else 0], dtype=torch.float32, device=device)
    return norm, per


def fused_sgd_(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Tensor],
    model_params: List[Tensor],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_run: bool = False,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    wd_after_momentum: bool = False,
    kahan_comps: Optional[List[Tensor]] = None,
    sr_salts: Optional[List[Tensor]] = None,
    sr_seed: Optional[int] = None,
    step: Optional[Tensor] = None,
    maximize: bool = False,
    lr_tensor: Optional[Tensor] = None,
    unscale_grads: bool = False,
    remainders: Optional[List[Tensor]] = None,
    momentum_scales: Optional[List[Tensor]] = None,
    state_seed: Optional[int] = None,
    precision_tallies: Optional[List[Tensor]] = None,
) -> None:
    """One ``torch.optim.SGD`` step over all ``params`` in few launches.

    ``params`` are fp32 masters when ``model_params`` is non-empty (the updated
    masters are then written, cast, into ``model_params`` in the same pass), else the
    parameters themselves (fp32/fp16/bf16). ``grads`` (fp32/fp16/bf16) are multiplied
    by ``inv_scale`` when given. ``momentum_buffers`` are fp32, one per param, and
    empty when ``momentum`` is 0; with ``first_run`` they start as the gradient.
    ``wd_after_momentum`` (Apex's option) adds ``weight_decay * p`` to the step after
    the momentum update instead of to the gradient before it. When ``found_inf`` is
    given and nonzero, nothing at all is written.

    ``momentum_buffers`` may also be bf16 (each may differ; the math stays fp32).
    ``kahan_comps`` (Kahan summation, ``master="kahan"``): empty, or one bf16 tensor
    per param, the params then bf16 and ``model_params`` empty; each update starts from
    ``p + comp`` (fp32) and leaves ``p = bf16(new)``, ``comp = bf16(new - p)``.

    ``remainders`` (``master="remainder"``): empty, or one int16 tensor per param, the
    params then bf16, without ``model_params``, ``kahan_comps`` or ``sr_seed``; each
    update starts from the fp32 master ``(bits(p) << 16) + remainder`` and splits the
    new master back into both, ``p`` its high half rounded to nearest with ties away
    from zero (:func:`mixedprec.masters.split_remainder`), exactly.

    ``sr_seed`` (``master="stochastic"``; an int, used as 64 bits): the bf16 params
    (no masters, no ``kahan_comps``) receive the new value rounded stochastically, the
    random bits drawn by Philox4x32-10 keyed by ``sr_seed`` and counted by (element
    index in the full tensor, salt, ``step``): ``sr_salts`` holds, per param, a
    contiguous int64 tensor of 4 words (salt, offset, run, stride), the salt e.g. its
    position in the param group and the rest where a shard's elements lie in the full
    tensor (:func:`rounding_words` makes them), and ``step`` (float32, one element) the
    step count, read only (docs/lean-precision.md).

    As ``torch.optim.SGD``'s options: ``maximize`` negates the (unscaled) gradient
    before anything uses it. ``lr_tensor`` (float32, one element), when given,
    replaces ``lr``: the learning rate is then read on the device, so that a captured
    CUDA graph follows a scheduler that writes it. ``unscale_grads`` writes the
    unscaled gradient ``grad * inv_scale`` (fp32 math, stored in the grad's dtype; not
    negated by ``maximize``) back into ``grads``, as torch's fused optimizers leave
    ``p.grad`` after a ``GradScaler`` step; nothing is written when the step is skipped
    (``found_inf`` set) or without ``inv_scale``.

    ``momentum_scales``: 8-bit momentum buffers (``state_dtype=torch.float8_e4m3fn``):
    each buffer is float8_e4m3fn codes, contiguous, of a number of elements divisible
    by 32, and its scales one contiguous uint8 (or float8_e8m0fnu) tensor of one
    power-of-two scale per block of 32 consecutive elements (its byte, the biased
    exponent): value = code * scale. The op reads each
    block, updates it in fp32, and writes the block's new scale (the smallest power of
    two that brings its largest magnitude within 448) and codes (rounded to nearest
    even, as torch's cast to float8_e4m3fn), or with ``state_seed`` stochastically:
    Philox bits keyed as ``sr_seed``'s (``sr_salts``, one per param, and ``step``, then
    required) but by ``state_seed``; the low byte of an element's 16 bits rounds its
    code up with the probability of the dropped fraction (to 1/256), so that the stored
    state is unbiased (round to nearest freezes a slowly moving state).

    ``precision_tallies``: the precision report, as in :func:`fused_adam_`.
    """
    # Positional, in the schema's order (test_step_ops checks it): every optimizer step
    # calls this, and 23 keyword arguments cost the call ~6 us to match by name.
    torch.ops.mixedprec.fused_sgd_.default(
        params, grads, momentum_buffers, model_params, lr, momentum, dampening,
        weight_decay, nesterov, first_run, inv_scale, found_inf, wd_after_momentum,
        kahan_comps or None, sr_salts or None, sr_seed, step, maximize, lr_tensor,
        unscale_grads, remainders or None, momentum_scales, state_seed, precision_tallies,
    )


@renamed(adamw="decoupled_weight_decay")  # (2026-11-28)
def fused_adam_(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    model_params: List[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True,
    bias_correction: bool = True,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    lr_tensor: Optional[Tensor] = None,
    kahan_comps: Optional[List[Tensor]] = None,
    sr_salts: Optional[List[Tensor]] = None,
    sr_seed: Optional[int] = None,
    maximize: bool = False,
    max_exp_avg_sqs: Optional[List[Tensor]] = None,
    unscale_grads: bool = False,
    remainders: Optional[List[Tensor]] = None,
    exp_avg_scales: Optional[List[Tensor]] = None,
    exp_avg_sq_scales: Optional[List[Tensor]] = None,
    state_seed: Optional[int] = None,
    precision_tallies: Optional[List[Tensor]] = None,
) -> None:
    """One ``torch.optim.Adam`` (``decoupled_weight_decay=False``: weight decay added to
    the gradient) or ``torch.optim.AdamW`` (``decoupled_weight_decay=True``) step over
    all ``params``.

    ``step`` (float32, one element) is incremented on the device before use, unless
    ``found_inf`` is set. ``exp_avgs`` and ``exp_avg_sqs`` are fp32 or bf16 (the two
    moments of a param of one dtype; the math stays fp32). Masters, model copy,
    unscale, skip, ``kahan_comps`` and ``remainders`` behave as in :func:`fused_sgd_`. ``lr_tensor``
    (float32, one element), when given, replaces ``lr``: the learning rate is then read
    on the device, so that a captured CUDA graph follows a scheduler that writes it.
    ``sr_seed`` and ``sr_salts``: stochastic rounding as in :func:`fused_sgd_`, keyed by
    the incremented ``step``.

    ``max_exp_avg_sqs`` (amsgrad, as ``torch.optim.Adam(amsgrad=True)``): None, or one
    tensor per param, of its ``exp_avg_sqs``' dtype; each becomes
    ``maximum(max_exp_avg_sq, exp_avg_sq)`` (NaN where either is) and the denominator
    ``sqrt(max_exp_avg_sq) / sqrt(1 - beta2**step) + eps``. Works with masters, bf16
    moments, ``kahan_comps`` and stochastic rounding alike. ``maximize`` and
    ``unscale_grads`` behave as in :func:`fused_sgd_`.

    ``exp_avg_scales`` and ``exp_avg_sq_scales`` (given together): 8-bit moments, as
    ``momentum_scales`` in :func:`fused_sgd_`; ``exp_avg_sqs`` then hold the square
    roots of the second moments (the denominator's ``sqrt(exp_avg_sq)``, stored),
    ``exp_avgs`` the first moments. Not with ``max_exp_avg_sqs``. ``state_seed``
    rounds their codes stochastically as in :func:`fused_sgd_` (the first moment with
    the low byte of each element's bits, the root with the high byte).

    ``precision_tallies`` (the precision report, :mod:`mixedprec.optim.precision_report`):
    None, or one contiguous float64 tensor of 4 elements per param, to which the step
    adds, on the device: the number of elements whose update was lost (the value the
    next step reads back equals this step's start, though the fp32 update moved it),
    the sums of squares of the lost parts and of the applied parts, and the number of
    elements stepped. The value read back is the bf16 param (rounded to nearest or
    stochastically), the bf16 param plus its Kahan compensation, or the fp32 result
    (fp32 params, masters, remainders: nothing is lost). Not with fp16 params without
    masters. A skipped step (``found_inf``) adds nothing."""
    # Positional, in the schema's order (test_step_ops checks it), as fused_sgd_'s.
    torch.ops.mixedprec.fused_adam_.default(
        params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1, beta2, eps,
        weight_decay, decoupled_weight_decay, bias_correction, inv_scale, found_inf, lr_tensor,
        kahan_comps or None, sr_salts or None, sr_seed, maximize, max_exp_avg_sqs,
        unscale_grads, remainders or None, exp_avg_scales, exp_avg_sq_scales, state_seed,
        precision_tallies,
    )


def sum_fp32(self: Tensor, dim: Optional[Sequence[int]] = None, keepdim: bool = False) -> Tensor:
    """Sum of a float16/bfloat16/float32 tensor accumulated in float32 and returned as
    float32 (float64 input stays float64), so that large fp16 reductions do not
    overflow or round: 4095 fp16 elements of 4.0 sum to exactly 16380. ``dim=None``
    reduces every dimension. Differentiable; the gradient has the input's dtype.
    Any strides are accepted."""
    return torch.ops.mixedprec.sum_fp32.default(self=self, dim=dim, keepdim=keepdim)


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("mixedprec::sum_fp32")
def _(self, dim=None, keepdim=False):
    _no_meta_among_real("sum_fp32", locals())
    return torch.sum(self, dim, keepdim, dtype=_sum_dtype(self.dtype))


def _sum_fp32_setup_context(ctx, inputs, output):
    self, dim, keepdim = inputs
    ctx.shape = self.shape
    ctx.dtype = self.dtype
    ctx.dims = None if dim is None else [d % max(self.dim(), 1) for d in dim]
    ctx.keepdim = keepdim


def _sum_fp32_backward(ctx, grad):
    if not ctx.keepdim and ctx.dims and len(ctx.shape) > 0:
        for d in sorted(ctx.dims):
            grad = grad.unsqueeze(d)
    return grad.expand(ctx.shape).to(ctx.dtype), None, None


torch.library.register_autograd(
    "mixedprec::sum_fp32", _sum_fp32_backward, setup_context=_sum_fp32_setup_context
)


def update_loss_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = float("inf"),
) -> None:
    """Dynamic loss scaling on the device.

    On overflow (``found_inf`` nonzero): ``hysteresis_tracker -= 1``; when it is then
    <= 0, ``scale = max(scale * backoff_factor, min_scale)``; ``growth_tracker = 0``.
    Otherwise: ``hysteresis_tracker = hysteresis``, ``growth_tracker += 1``, and when
    it reaches ``growth_interval``, ``scale = min(scale * growth_factor, max_scale)``
    if that is finite, and ``growth_tracker = 0``. ``scale`` and ``found_inf`` are
    float32, the trackers int32, all one element on the same device. The defaults
    of ``min_scale`` and ``max_scale`` set no floor and no ceiling."""
    torch.ops.mixedprec.update_loss_scale_.default(
        scale=scale, growth_tracker=growth_tracker, hysteresis_tracker=hysteresis_tracker,
        found_inf=found_inf, growth_factor=growth_factor, backoff_factor=backoff_factor,
        growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
        max_scale=max_scale,
    )


@renamed(adamw="decoupled_weight_decay")  # (2026-11-28)
def fused_lamb_(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    model_params: List[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    decoupled_weight_decay: bool = True,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    use_nvlamb: bool = False,
    global_grad_norm: Optional[Tensor] = None,
    max_grad_norm: float = 1.0,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """One LAMB step over all ``params`` (Apex's ``multi_tensor_lamb`` math).

    Per element, in fp32: ``g = grad * inv_scale / clip`` with ``clip =
    max(1, global_grad_norm / max_grad_norm)`` (no clipping when ``global_grad_norm``
    is None; it is the norm of the unscaled gradients, a float32 one-element tensor);
    ``decoupled_weight_decay=False`` adds ``weight_decay * p`` to ``g``; ``m = beta1 * m
    + (1 - beta1) * g`` (``grad_averaging=False``: ``+ g``); ``v = beta2 * v + (1 -
    beta2) * g * g``; ``u = (m / bc1) / (sqrt(v / bc2) + eps)`` with Adam's bias
    corrections (1 when ``bias_correction`` is False); ``decoupled_weight_decay=True``
    adds ``weight_decay * p`` to ``u``.
    Then per tensor ``ratio = lr * ||p|| / ||u||`` when ``use_nvlamb`` or
    ``weight_decay != 0`` and both norms are nonzero, else ``lr``; ``p -= ratio * u``.

    ``u`` lives in a scratch buffer of the call: ``grads`` are read, never written.
    ``step`` (float32, one element) is incremented on the device before use, unless
    ``found_inf`` is set, which skips everything. ``exp_avgs`` and ``exp_avg_sqs``
    are fp32. Masters, model copy and unscale behave as in :func:`fused_sgd_`."""
    torch.ops.mixedprec.fused_lamb_.default(
        params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
        model_params=model_params, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
        bias_correction=bias_correction,
        grad_averaging=grad_averaging, use_nvlamb=use_nvlamb,
        global_grad_norm=global_grad_norm, max_grad_norm=max_grad_norm,
        inv_scale=inv_scale, found_inf=found_inf,
    )


@renamed(adagrad_w_mode="decoupled_weight_decay")  # (2026-11-28)
def fused_adagrad_(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    model_params: List[Tensor],
    *,
    lr: float,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """One Adagrad step over all ``params`` (Apex's ``FusedAdagrad``):
    ``sum += g * g; p -= lr * g / (sqrt(sum) + eps)``. ``weight_decay * p`` is added
    to the gradient (L2, as ``torch.optim.Adagrad``) or, with ``decoupled_weight_decay``, to
    the step (decoupled). ``state_sums`` are fp32, one per param. Masters, model copy,
    unscale and skip behave as in :func:`fused_sgd_`."""
    torch.ops.mixedprec.fused_adagrad_.default(
        params=params, grads=grads, state_sums=state_sums, model_params=model_params, lr=lr,
        eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
        inv_scale=inv_scale, found_inf=found_inf,
    )


def fused_novograd_(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    model_params: List[Tensor],
    *,
    exp_avg_sq: Tensor,
    step: Tensor,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    reg_inside_moment: bool = False,
    norm_type: int = 2,
    init_zero: bool = False,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """One NovoGrad step over all ``params`` (Apex's ``FusedNovoGrad``).

    ``exp_avg_sq`` (float32, shape ``[len(params)]``) holds each tensor's second
    moment, the blended norm of its gradient: first updated on the device from this
    step's (unscaled) gradient norms ``n``, ``sqrt(beta2 * v**2 + (1 - beta2) * n**2)``
    for ``norm_type`` 2 and ``beta2 * v + (1 - beta2) * n`` for 0 (the inf-norm), or
    ``v = n`` on the first step (``step`` 0 before the call) unless ``init_zero``.
    ``step`` (float32, one element) is then incremented. With ``denom = v / sqrt(1 -
    beta2**step) + eps`` and ``m_hat = exp_avg / (1 - beta1**step)`` (no bias correction:
    both divisors 1), the update is ``exp_avg = beta1 * exp_avg + w * g`` and ``p -= lr *
    (m_hat / denom + weight_decay * p)``, or with ``reg_inside_moment`` ``exp_avg = beta1
    * exp_avg + w * (g / denom + weight_decay * p)`` and ``p -= lr * m_hat``, where ``w``
    is ``1 - beta1`` with ``grad_averaging``, else 1. ``exp_avgs`` are fp32. Masters,
    model copy, unscale and skip (nothing written, ``step`` and ``exp_avg_sq``
    included) behave as in :func:`fused_sgd_`."""
    torch.ops.mixedprec.fused_novograd_.default(
        params=params, grads=grads, exp_avgs=exp_avgs, model_params=model_params,
        exp_avg_sq=exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, bias_correction=bias_correction,
        grad_averaging=grad_averaging, reg_inside_moment=reg_inside_moment,
        norm_type=norm_type, init_zero=init_zero, inv_scale=inv_scale, found_inf=found_inf,
    )


# --- fake kernels ----------------------------------------------------------------------
# (multi_tensor_l2norm's and sum_fp32's, which return tensors, are beside their wrappers.)

#: The ops that write their arguments and return nothing: their fake kernels only check
#: that meta tensors are not mixed with real ones, and are all the same.
_OPS_WITHOUT_OUTPUTS = (
    "multi_tensor_unscale_",
    "multi_tensor_unscale_to_",
    "multi_tensor_check_finite_",
    "multi_tensor_copy_",
    "fused_sgd_",
    "fused_adam_",
    "update_loss_scale_",
    "fused_lamb_",
    "fused_adagrad_",
    "fused_novograd_",
)


def _fake_without_outputs(name: str):
    """The fake kernel of op ``name``, one of _OPS_WITHOUT_OUTPUTS: it names the arguments
    (positional ones by the schema) for _no_meta_among_real and returns None."""
    arg_names = [a.name for a in getattr(torch.ops.mixedprec, name).default._schema.arguments]

    def fake(*args, **kwargs):
        _no_meta_among_real(name, {**dict(zip(arg_names, args)), **kwargs})
        return None

    return fake


for _name in _OPS_WITHOUT_OUTPUTS:
    torch.library.register_fake(f"mixedprec::{_name}", _fake_without_outputs(_name))
