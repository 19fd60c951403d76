"""Apex's ``amp_C`` extension on mixedprec's operators, for CPU and CUDA tensors.

Every function keeps Apex's calling convention, ``fn(chunk_size, noop_flag,
tensor_lists, *args)``, usually reached through
:data:`mixedprec.multi_tensor_apply.multi_tensor_applier`. What carries over and what
differs:

* ``chunk_size`` is accepted and ignored: the operators chunk by
  :data:`mixedprec.ops.CHUNK_SIZE`.
* ``noop_flag`` is Apex's one-element int32 tensor and stays int32. It is read and
  written on the device, never on the host. ``multi_tensor_scale``,
  ``multi_tensor_axpby`` and the norms set it to 1 on inf/NaN input (and never clear
  it); the optimizer steps (``multi_tensor_sgd``, the ``multi_tensor_adam*``,
  ``multi_tensor_lamb*``, ``multi_tensor_adagrad`` and ``multi_tensor_novograd``) write
  nothing when it is set. (Apex's non-capturable Adam, its LAMB, Adagrad and NovoGrad
  kernels ignored the flag; here they skip, as its SGD kernel and its capturable Adam
  do.)
* Math is fp32 whatever the storage type, as in Apex. Tensors must be dense (Apex
  required contiguous ones); fp64 tensors, which some Apex kernels took, are rejected.
* Optimizer state (momentum buffers, ``m``, ``v``) that is not fp32 (Apex's all-fp16
  case) is updated through fp32 copies and written back: correct, but slower than
  the fp32 state that mixedprec's own optimizers keep.

* The LAMB kernels keep the update in a scratch buffer instead of writing it into
  the gradients (Apex overwrote ``g`` with it): gradients are read, never written.

Functions of Apex's ``amp_C`` that are not listed in ``__all__`` are not provided;
looking one up raises ``AttributeError`` naming it.
"""

import numbers
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import ops

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adagrad",
    "multi_tensor_novograd",
    "multi_tensor_sgd",
    "update_scale_hysteresis",
    "multi_tensor_l2norm_scale",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
]

TensorLists = Sequence[List[Tensor]]


def _lists(fn: str, tensor_lists: TensorLists, depths: Tuple[int, ...]) -> List[List[Tensor]]:
    lists = [list(tl) for tl in tensor_lists]
    if len(lists) not in depths:
        expected = " or ".join(str(d) for d in depths)
        raise ValueError(f"{fn}: expected tensor_lists to hold {expected} lists, got {len(lists)}")
    for i, tl in enumerate(lists):
        for j, t in enumerate(tl):
            if not isinstance(t, Tensor):
                raise TypeError(f"{fn}: expected tensor_lists[{i}][{j}] to be a tensor, got "
                                f"{type(t).__name__}")
    return lists


def _number(fn: str, name: str, value: Any) -> float:
    """A scalar argument as Apex's bindings took it (a C++ float): a real number, numpy's
    included, or a one-element tensor (read on the host, as there)."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value)  # sync-ok: Apex's binding read it so too
    if isinstance(value, Tensor) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: expected {name} to be a number, got {type(value).__name__}")
    return float(value)


def _device(lists: List[List[Tensor]], noop_flag: Tensor) -> torch.device:
    for tl in lists:
        if tl:
            return tl[0].device
    return noop_flag.device


def _check_flag(fn: str, noop_flag: Tensor) -> None:
    if not isinstance(noop_flag, Tensor) or noop_flag.numel() != 1:
        raise ValueError(f"{fn}: expected noop_flag to be a one-element tensor, got {noop_flag!r}")


def _found_inf_of(noop_flag: Tensor, device: torch.device) -> Tensor:
    """float32 ``found_inf`` (1.0 when the flag is set) on ``device``, made on the device."""
    return (noop_flag != 0).to(device=device, dtype=torch.float32).reshape(1)


def _raise_flag(noop_flag: Tensor, found_inf: Tensor) -> None:
    """``noop_flag = 1`` where ``found_inf`` is set; never clears it, keeps its dtype."""
    hit = (found_inf != 0).to(noop_flag.device).reshape(noop_flag.shape)
    noop_flag.masked_fill_(hit, 1)


def _scalar(value: float, device: torch.device) -> Tensor:
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def _fp32_state(tensors: List[Tensor]) -> Tuple[List[Tensor], List[Tensor], List[Tensor]]:
    """fp32 stand-ins for optimizer state: (state for the op, copies to write back,
    their originals). fp32 tensors are used as they are."""
    state, copies, originals = [], [], []
    for t in tensors:
        if t.dtype == torch.float32:
            state.append(t)
        else:
            copy = t.float()
            state.append(copy)
            copies.append(copy)
            originals.append(t)
    return state, copies, originals


def multi_tensor_scale(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float
) -> None:
    """Apex ``amp_C.multi_tensor_scale``: ``dst[i] = src[i] * scale`` for
    ``tensor_lists = [src, dst]``, cast to each ``dst`` dtype (``src is dst`` works
    in place); sets ``noop_flag`` when any ``src`` element is inf/NaN. The output is
    written either way. One :func:`mixedprec.ops.multi_tensor_unscale_to_` call."""
    _check_flag("multi_tensor_scale", noop_flag)
    src, dst = _lists("multi_tensor_scale", tensor_lists, (2,))
    device = _device([src, dst], noop_flag)
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    ops.multi_tensor_unscale_to_(src, dst, found_inf,
                                 _scalar(_number("multi_tensor_scale", "scale", scale), device))
    _raise_flag(noop_flag, found_inf)


def multi_tensor_axpby(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    a: float,
    b: float,
    arg_to_check: int,
) -> None:
    """Apex ``amp_C.multi_tensor_axpby``: ``out[i] = a * x[i] + b * y[i]`` in fp32 for
    ``tensor_lists = [x, y, out]``, cast to each ``out`` dtype (``out`` may be ``x``
    or ``y``). Sets ``noop_flag`` on inf/NaN in ``x`` (``arg_to_check=0``), ``y``
    (``1``) or either (``-1``); the output is written either way.

    The check is :func:`mixedprec.ops.multi_tensor_check_finite_`; the arithmetic is
    two ``torch._foreach`` calls on fp32 copies and the store one
    :func:`mixedprec.ops.multi_tensor_copy_` (mixedprec has no axpby operator)."""
    _check_flag("multi_tensor_axpby", noop_flag)
    x, y, out = _lists("multi_tensor_axpby", tensor_lists, (3,))
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(
            f"multi_tensor_axpby: expected arg_to_check in (-1, 0, 1), got {arg_to_check}"
        )
    if not (len(x) == len(y) == len(out)):
        raise ValueError(
            f"multi_tensor_axpby: expected x, y and out of one length, got {len(x)}, {len(y)}, "
            f"{len(out)}"
        )
    if not x:
        return
    device = _device([x, y, out], noop_flag)
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    checked = {-1: x + y, 0: x, 1: y}[arg_to_check]
    ops.multi_tensor_check_finite_(checked, found_inf)
    result = torch._foreach_mul([t.float() for t in x], float(a))
    torch._foreach_add_(result, [t.float() for t in y], alpha=float(b))
    ops.multi_tensor_copy_(result, out)
    _raise_flag(noop_flag, found_inf)


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor: Optional[bool] = False,
) -> Tuple[Tensor, Tensor]:
    """Apex ``amp_C.multi_tensor_l2norm``: for ``tensor_lists = [tensors]``, the fp32 L2
    norm of all tensors together (shape ``[1]``) and, when ``per_tensor``, the fp32
    vector of per-tensor norms (else an empty tensor). Sets ``noop_flag`` when the
    norm is not finite. :func:`mixedprec.ops.multi_tensor_l2norm`, which (unlike
    Apex) combines partial sums in a fixed order: the result is deterministic."""
    return multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, None, per_tensor)


def multi_tensor_l2norm_mp(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor: Optional[bool] = False,
) -> Tuple[Tensor, Tensor]:
    """Apex ``amp_C.multi_tensor_l2norm_mp``: the same as :func:`multi_tensor_l2norm`
    (whose fp32 accumulation already covers fp16/bf16 input)."""
    return multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)


def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Optional[Tensor],
    per_tensor: Optional[bool] = False,
) -> Tuple[Tensor, Tensor]:
    """Apex ``amp_C.multi_tensor_unscale_l2norm``: :func:`multi_tensor_l2norm` of every
    element multiplied by ``inv_scale`` (a one-element float32 tensor, or None)."""
    _check_flag("multi_tensor_l2norm", noop_flag)
    (tensors,) = _lists("multi_tensor_l2norm", tensor_lists, (1,))
    if per_tensor is not None and not isinstance(per_tensor, (bool, int)):
        raise TypeError(f"multi_tensor_l2norm: expected per_tensor to be a bool, got "
                        f"{per_tensor!r}")
    if not tensors:
        device = noop_flag.device
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return torch.zeros(1, dtype=torch.float32, device=device), empty
    norm, norms = ops.multi_tensor_l2norm(tensors, inv_scale, per_tensor=bool(per_tensor))
    _raise_flag(noop_flag, ~torch.isfinite(norm))
    return norm, norms


def multi_tensor_adam(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """Apex ``amp_C.multi_tensor_adam``: one Adam step for ``tensor_lists = [g, p, m,
    v]``, or ``[g, p, m, v, p_master]`` (the order of Apex's capturable master-weight
    kernel) to update fp32 masters and write them, cast, into the model ``p``.

    ``step`` is the step number after this update (1 on the first call), a Python int
    as in Apex; ``mode`` 0 adds ``weight_decay * p`` to the gradient (Adam, L2), 1
    decays the weights directly (AdamW); ``bias_correction`` 1 or 0. Gradients are read,
    not written. Skipped, on the device, when ``noop_flag`` is set.

    :func:`mixedprec.ops.fused_adam_`, with ``step`` passed as a float32 device tensor
    holding ``step - 1`` (the op increments it before use)."""
    _check_flag("multi_tensor_adam", noop_flag)
    lists = _lists("multi_tensor_adam", tensor_lists, (4, 5))
    if mode not in (0, 1):
        raise ValueError(f"multi_tensor_adam: expected mode 0 (L2) or 1 (AdamW), got {mode}")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    model_params: List[Tensor] = []
    if len(lists) == 5:
        params, model_params = lists[4], params
    if not params:
        return
    device = params[0].device
    exp_avgs, m_copies, m_originals = _fp32_state(exp_avgs)
    exp_avg_sqs, v_copies, v_originals = _fp32_state(exp_avg_sqs)
    ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params,
                    step=_scalar(step - 1, device), lr=lr, beta1=beta1, beta2=beta2, eps=epsilon,
                    weight_decay=weight_decay, decoupled_weight_decay=mode == 1,
                    bias_correction=bool(bias_correction),
                    found_inf=_found_inf_of(noop_flag, device))
    ops.multi_tensor_copy_(m_copies + v_copies, m_originals + v_originals)


def _device_scalar(fn: str, name: str, value: Tensor, device: torch.device) -> Tensor:
    """A one-element tensor argument as float32 of shape [1] on ``device`` (a copy
    made on the device, without a host read)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: expected {name} to be a one-element tensor, got "
                        f"{type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"{fn}: expected {name} to have one element, got {value.numel()}")
    return value.to(device=device, dtype=torch.float32).reshape(1)


def _adam_capturable(fn: str, noop_flag: Tensor, lists: List[List[Tensor]], lr: Tensor,
                     beta1: float, beta2: float, epsilon: float, step: Tensor, mode: int,
                     bias_correction: int, weight_decay: float, inv_scale: Tensor) -> None:
    _check_flag(fn, noop_flag)
    if mode not in (0, 1):
        raise ValueError(f"{fn}: expected mode 0 (L2) or 1 (AdamW), got {mode}")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    model_params: List[Tensor] = []
    if len(lists) == 5:
        params, model_params = lists[4], params
    device = params[0].device if params else noop_flag.device
    lr_tensor = _device_scalar(fn, "lr", lr, device)
    # The op counts from the step before this one, in a float32 copy: Apex's int step
    # tensor (already incremented by the caller) is left as it is.
    step_before = _device_scalar(fn, "step", step, device) - 1
    inv_scale = _device_scalar(fn, "inv_scale", inv_scale, device)
    if not params:
        return
    exp_avgs, m_copies, m_originals = _fp32_state(exp_avgs)
    exp_avg_sqs, v_copies, v_originals = _fp32_state(exp_avg_sqs)
    ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, step=step_before, lr=0.0,
                    beta1=beta1, beta2=beta2, eps=epsilon, weight_decay=weight_decay,
                    decoupled_weight_decay=mode == 1, bias_correction=bool(bias_correction),
                    inv_scale=inv_scale,
                    found_inf=_found_inf_of(noop_flag, device), lr_tensor=lr_tensor)
    ops.multi_tensor_copy_(m_copies + v_copies, m_originals + v_originals)


def multi_tensor_adam_capturable(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Apex ``amp_C.multi_tensor_adam_capturable``: one Adam step for ``tensor_lists =
    [g, p, m, v]`` whose learning rate, step number and inverse loss scale are
    one-element device tensors (``lr`` float32, ``step`` Apex's int32 step number
    after this update, ``inv_scale`` float32), read on the device, so that the call
    can be captured in a CUDA graph. Gradients are multiplied by ``inv_scale``; the
    rest is :func:`multi_tensor_adam`. Skipped, on the device, when ``noop_flag`` is set.

    Unlike Apex, the gradients are read, not written (Apex's kernel stored the
    unscaled gradient back into ``g``). :func:`mixedprec.ops.fused_adam_` with its
    ``lr_tensor``."""
    fn = "multi_tensor_adam_capturable"
    lists = _lists(fn, tensor_lists, (4,))
    _adam_capturable(fn, noop_flag, lists, lr, beta1, beta2, epsilon, step, mode,
                     bias_correction, weight_decay, inv_scale)


def multi_tensor_adam_capturable_master(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Apex ``amp_C.multi_tensor_adam_capturable_master``:
    :func:`multi_tensor_adam_capturable` for ``tensor_lists = [g, p, m, v, p_master]``:
    the fp32 masters ``p_master`` are updated and written, cast, into the model ``p``."""
    fn = "multi_tensor_adam_capturable_master"
    lists = _lists(fn, tensor_lists, (5,))
    _adam_capturable(fn, noop_flag, lists, lr, beta1, beta2, epsilon, step, mode,
                     bias_correction, weight_decay, inv_scale)


def multi_tensor_adagrad(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    epsilon: float,
    mode: int,
    weight_decay: float,
) -> None:
    """Apex ``amp_C.multi_tensor_adagrad``: one Adagrad step for ``tensor_lists = [g, p,
    h]`` (``h`` the running sums of squared gradients); ``mode`` 0 adds
    ``weight_decay * p`` to the gradient (L2), 1 to the step (decoupled). Gradients are
    read, not written. Skipped, on the device, when ``noop_flag`` is set (Apex's kernel
    ignored the flag). :func:`mixedprec.ops.fused_adagrad_`."""
    _check_flag("multi_tensor_adagrad", noop_flag)
    grads, params, sums = _lists("multi_tensor_adagrad", tensor_lists, (3,))
    if mode not in (0, 1):
        raise ValueError(f"multi_tensor_adagrad: expected mode 0 (L2) or 1 (decoupled), "
                         f"got {mode}")
    if not params:
        return
    device = params[0].device
    sums, copies, originals = _fp32_state(sums)
    ops.fused_adagrad_(params, grads, sums, [], lr=lr, eps=epsilon, weight_decay=weight_decay,
                       decoupled_weight_decay=mode == 1, found_inf=_found_inf_of(noop_flag, device))
    ops.multi_tensor_copy_(copies, originals)


def multi_tensor_novograd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    grad_norms: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    norm_type: int,
) -> None:
    """Apex ``amp_C.multi_tensor_novograd``: one NovoGrad step for ``tensor_lists = [g, p,
    m]``. ``grad_norms`` (float32, one value per tensor, as the caller initialised it)
    is blended in place with this step's gradient norms (``norm_type`` 2: L2, 0:
    inf-norm); ``step`` is the step number after this update (a Python int);
    ``mode`` 0 puts the weight decay inside the moment (``reg_inside_moment``), 1 in
    the step. Gradients are read, not written. Skipped, on the device, when
    ``noop_flag`` is set (Apex's kernel ignored the flag; its norms were blended
    anyway). :func:`mixedprec.ops.fused_novograd_` with ``init_zero=True``."""
    fn = "multi_tensor_novograd"
    _check_flag(fn, noop_flag)
    grads, params, exp_avgs = _lists(fn, tensor_lists, (3,))
    if mode not in (0, 1):
        raise ValueError(f"{fn}: expected mode 0 (reg_inside_moment) or 1, got {mode}")
    if not isinstance(grad_norms, Tensor):
        raise TypeError(f"{fn}: expected grad_norms to be a tensor, got "
                        f"{type(grad_norms).__name__}")
    if not params:
        return
    device = params[0].device
    exp_avgs, copies, originals = _fp32_state(exp_avgs)
    ops.fused_novograd_(params, grads, exp_avgs, [], exp_avg_sq=grad_norms,
                        step=_scalar(step - 1, device), lr=lr, beta1=beta1, beta2=beta2,
                        eps=epsilon, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction), grad_averaging=bool(grad_averaging),
                        reg_inside_moment=mode == 0, norm_type=norm_type, init_zero=True,
                        found_inf=_found_inf_of(noop_flag, device))
    ops.multi_tensor_copy_(copies, originals)


def multi_tensor_sgd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    wd: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float = 1.0,
) -> None:
    """Apex ``amp_C.multi_tensor_sgd``: one SGD step for ``tensor_lists = [g, p, m]`` or
    ``[g, p, m, p_model]`` (``p`` fp32 masters written, cast, into the model copy).
    Gradients are multiplied by ``scale`` (Apex passes the inverse loss scale) and
    read, not written; ``first_run`` starts the momentum buffers as the gradient;
    with ``momentum`` 0 the buffers are not touched; ``wd_after_momentum`` adds
    ``wd * p`` after the momentum update instead of before it. Skipped, on the device,
    when ``noop_flag`` is set. :func:`mixedprec.ops.fused_sgd_`."""
    _check_flag("multi_tensor_sgd", noop_flag)
    lists = _lists("multi_tensor_sgd", tensor_lists, (3, 4))
    grads, params, momentum_buffers = lists[:3]
    model_params = lists[3] if len(lists) == 4 else []
    if not params:
        return
    device = params[0].device
    copies: List[Tensor] = []
    originals: List[Tensor] = []
    if momentum == 0:
        momentum_buffers = []
    else:
        momentum_buffers, copies, originals = _fp32_state(momentum_buffers)
    ops.fused_sgd_(params, grads, momentum_buffers, model_params, lr=lr, momentum=momentum,
                   dampening=dampening, weight_decay=wd, nesterov=bool(nesterov),
                   first_run=bool(first_run),
                   inv_scale=None if scale == 1.0 else _scalar(scale, device),
                   found_inf=_found_inf_of(noop_flag, device),
                   wd_after_momentum=bool(wd_after_momentum))
    ops.multi_tensor_copy_(copies, originals)


def update_scale_hysteresis(
    current_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> Tensor:
    """Apex ``amp_C.update_scale_hysteresis``: the dynamic loss scale with hysteresis,
    updated on the device (float32 scale and found_inf, int32 trackers); returns
    ``current_scale``. :func:`mixedprec.ops.update_loss_scale_` with no floor and no
    ceiling (a scale that would grow to inf stays where it is, as in Apex)."""
    ops.update_loss_scale_(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                           growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval, hysteresis=hysteresis)
    return current_scale


def multi_tensor_l2norm_scale(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    scale: float,
    per_tensor: Optional[bool] = False,
) -> Tuple[Tensor, Tensor]:
    """Apex ``amp_C.multi_tensor_l2norm_scale``: for ``tensor_lists = [src, dst]``,
    :func:`multi_tensor_l2norm` of ``src`` (before scaling), and ``dst[i] = src[i] *
    scale`` as :func:`multi_tensor_scale`; sets ``noop_flag`` on inf/NaN input."""
    src, dst = _lists("multi_tensor_l2norm_scale", tensor_lists, (2,))
    norms = multi_tensor_l2norm(chunk_size, noop_flag, [src], per_tensor)
    multi_tensor_scale(chunk_size, noop_flag, [src, dst], scale)
    return norms


def _lamb(fn: str, noop_flag: Tensor, lists: List[List[Tensor]], lr: float, beta1: float,
          beta2: float, epsilon: float, step: Tensor, bias_correction: int,
          weight_decay: float, grad_averaging: int, mode: int, global_grad_norm: Tensor,
          max_grad_norm: float, use_nvlamb: Optional[bool], inv_scale: Optional[Tensor],
          found_inf: Tensor) -> None:
    """:func:`mixedprec.ops.fused_lamb_` for Apex's LAMB lists ``[g, p, m, v]`` or ``[g,
    p_master, m, v, p_model]``; ``step`` is the float32 count before this update."""
    if mode not in (0, 1):
        raise ValueError(f"{fn}: expected mode 0 (L2) or 1 (decoupled weight decay), got {mode}")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    model_params = lists[4] if len(lists) == 5 else []
    if not params:
        return
    exp_avgs, m_copies, m_originals = _fp32_state(exp_avgs)
    exp_avg_sqs, v_copies, v_originals = _fp32_state(exp_avg_sqs)
    ops.fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, model_params, step=step, lr=lr,
                    beta1=beta1, beta2=beta2, eps=epsilon, weight_decay=weight_decay,
                    decoupled_weight_decay=mode == 1, bias_correction=bool(bias_correction),
                    grad_averaging=bool(grad_averaging), use_nvlamb=bool(use_nvlamb),
                    global_grad_norm=global_grad_norm, max_grad_norm=max_grad_norm,
                    inv_scale=inv_scale, found_inf=found_inf)
    ops.multi_tensor_copy_(m_copies + v_copies, m_originals + v_originals)


def multi_tensor_lamb(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor,
    max_grad_norm: float,
    use_nvlamb: Optional[bool] = None,
) -> None:
    """Apex ``amp_C.multi_tensor_lamb``: one LAMB step for ``tensor_lists = [g, p, m,
    v]`` (:func:`mixedprec.ops.fused_lamb_` gives the math). ``step`` is the step number
    after this update (a Python int, as in Apex); ``mode`` 0 adds L2 weight decay to the
    gradient, 1 decouples it; gradients are divided by ``global_grad_norm /
    max_grad_norm`` when that exceeds 1 (``global_grad_norm`` a one-element float32
    tensor; ``max_grad_norm`` must be > 0). Skipped, on the device, when ``noop_flag`` is
    set (Apex's kernel ignored the flag). Gradients are read, not written."""
    _check_flag("multi_tensor_lamb", noop_flag)
    lists = _lists("multi_tensor_lamb", tensor_lists, (4,))
    device = _device(lists, noop_flag)
    _lamb("multi_tensor_lamb", noop_flag, lists, lr, beta1, beta2, epsilon,
          _scalar(step - 1, device), bias_correction, weight_decay, grad_averaging, mode,
          global_grad_norm, max_grad_norm, use_nvlamb, None, _found_inf_of(noop_flag, device))


def multi_tensor_lamb_mp(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor,
    max_grad_norm,
    use_nvlamb: Optional[bool],
    found_inf: Tensor,
    inv_scale: Tensor,
) -> None:
    """Apex ``amp_C.multi_tensor_lamb_mp``: :func:`multi_tensor_lamb` for ``[g, p, m,
    v]`` or ``[g, p_master, m, v, p_model]`` (fp32 masters written, cast, into the
    model), with gradients multiplied by ``inv_scale``, ``step`` a one-element int
    tensor already holding this update's number, and ``lr`` and ``max_grad_norm``
    floats or one-element tensors (``global_grad_norm`` and ``max_grad_norm`` may both
    be of the scaled gradients, as Apex's FusedMixedPrecisionLamb passes them: only
    their ratio is used, formed on the device). Skipped, on the device, when
    ``noop_flag`` or ``found_inf`` is set.

    A tensor ``lr`` is read on the host (one synchronisation): mixedprec's op takes the
    learning rate as a number."""
    _check_flag("multi_tensor_lamb_mp", noop_flag)
    lists = _lists("multi_tensor_lamb_mp", tensor_lists, (4, 5))
    if not lists[1]:
        return
    device = lists[1][0].device
    if isinstance(lr, Tensor):
        lr = float(lr)  # sync-ok: Apex passes lr as a device tensor; the op takes a number
    if isinstance(max_grad_norm, Tensor):
        global_grad_norm = global_grad_norm.to(device, torch.float32) / max_grad_norm.to(
            device, torch.float32)
        max_grad_norm = 1.0
    skip = torch.maximum(_found_inf_of(noop_flag, device), _found_inf_of(found_inf, device))
    step_before = (step.to(device, torch.float32) - 1).reshape(1)
    _lamb("multi_tensor_lamb_mp", noop_flag, lists, lr, beta1, beta2, epsilon, step_before,
          bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
          max_grad_norm, use_nvlamb, inv_scale, skip)


def __getattr__(name: str):
    if name.startswith("multi_tensor_") or name.startswith("update_scale"):
        raise AttributeError(
            f"mixedprec's amp_C does not provide Apex's {name}; it provides "
            f"{', '.join(__all__)}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _unless(skip: Tensor, dst: Tensor, value: Tensor) -> None:
    """``dst = value`` (cast) unless ``skip``: decided on the device."""
    dst.copy_(torch.where(skip, dst, value.to(dst.dtype)))


def multi_tensor_lamb_stage1_cuda(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor_decay: Tensor,
    step: int,
    beta1: float,
    beta2: float,
    epsilon: float,
    global_grad_norm: Tensor,
    max_global_grad_norm: float,
) -> None:
    """Apex ``amp_C.multi_tensor_lamb_stage1_cuda``, the first half of LAMB as Apex's
    contrib ``DistributedFusedLAMB`` calls it: for ``tensor_lists = [g, p, m, v,
    update]``, with ``g`` divided by ``max(1, global_grad_norm / max_global_grad_norm)``,
    ``m`` and ``v`` updated (``grad_averaging``, bias correction for step ``step + 1``)
    and ``update = m_hat / (sqrt(v_hat) + epsilon) + per_tensor_decay[i] * p``.

    Unlike the fused entries it runs torch operations tensor by tensor (fp32 math, on
    the device, no host read): Apex's contrib optimizer is its only caller. It writes
    nothing when ``noop_flag`` is set (Apex's kernel ignored the flag)."""
    fn = "multi_tensor_lamb_stage1_cuda"
    _check_flag(fn, noop_flag)
    grads, params, exp_avgs, exp_avg_sqs, updates = _lists(fn, tensor_lists, (5,))
    if not grads:
        return
    device = params[0].device
    if per_tensor_decay.numel() < len(params):
        raise ValueError(f"{fn}: expected per_tensor_decay to hold a value per tensor "
                         f"({len(params)}), got {per_tensor_decay.numel()}")
    skip = (noop_flag != 0).to(device).reshape(())
    norm = global_grad_norm.to(device, torch.float32).reshape(())
    clip = torch.where(norm > max_global_grad_norm, norm / max_global_grad_norm,
                       torch.ones((), device=device))
    decay = per_tensor_decay.to(device, torch.float32).reshape(-1)
    bc1, bc2 = 1.0 - beta1 ** (step + 1), 1.0 - beta2 ** (step + 1)
    with torch.no_grad():
        for i, (g, p, m, v, u) in enumerate(zip(grads, params, exp_avgs, exp_avg_sqs, updates)):
            g = g.float() / clip
            new_m = m.float() * beta1 + (1 - beta1) * g
            new_v = v.float() * beta2 + (1 - beta2) * g * g
            update = (new_m / bc1) / ((new_v / bc2).sqrt() + epsilon) + decay[i] * p.float()
            _unless(skip, m, new_m)
            _unless(skip, v, new_v)
            _unless(skip, u, update)


def multi_tensor_lamb_stage2_cuda(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor_param_norm: Tensor,
    per_tensor_update_norm: Tensor,
    lr: float,
    weight_decay: float,
    use_nvlamb_python: Optional[bool] = None,
) -> None:
    """Apex ``amp_C.multi_tensor_lamb_stage2_cuda``, the second half: for ``tensor_lists
    = [p, update]``, ``p -= ratio * update`` with ``ratio = lr * ||p|| / ||update||``
    (the given per-tensor norms) when ``use_nvlamb_python`` or ``weight_decay != 0`` and
    both norms are nonzero, else ``lr``. Torch operations tensor by tensor, as
    :func:`multi_tensor_lamb_stage1_cuda`; nothing is written when ``noop_flag`` is set."""
    fn = "multi_tensor_lamb_stage2_cuda"
    _check_flag(fn, noop_flag)
    params, updates = _lists(fn, tensor_lists, (2,))
    if not params:
        return
    device = params[0].device
    skip = (noop_flag != 0).to(device).reshape(())
    p_norms = per_tensor_param_norm.to(device, torch.float32).reshape(-1)
    u_norms = per_tensor_update_norm.to(device, torch.float32).reshape(-1)
    ratios = torch.full_like(p_norms, lr)
    if use_nvlamb_python or weight_decay != 0:
        trusted = (p_norms != 0) & (u_norms != 0)
        ratios = torch.where(trusted, lr * p_norms / u_norms, ratios)
    with torch.no_grad():
        for i, (p, u) in enumerate(zip(params, updates)):
            _unless(skip, p, p.float() - ratios[i] * u.float())
