"""The one master-weights helper: fp32 masters of fp16/bf16 parameters, their
gradients, and the copy back into the model.

Used by the fused optimizers (masters in their state), ``mixedprec.amp`` (O2 with
other optimizers) and ``mixedprec.fp16_utils`` (``FP16_Optimizer``, Apex's
``model_grads_to_master_grads``/``master_params_to_model_params``). Each function
works through the multi-tensor ops, one call per device for the pairs they take
(same device, dense, same memory order), and falls back to ``copy_`` for the rest.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops

__all__ = ["HALF_DTYPES", "needs_master", "make_master", "follow_layout", "same_layout",
           "copy_to_model", "unscale_into_masters", "unscale_"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def needs_master(p: Tensor) -> bool:
    """Whether ``p`` is a 16-bit float parameter, which keeps an fp32 master."""
    return p.dtype in HALF_DTYPES


def make_master(p: Tensor) -> Tensor:
    """An fp32 copy of ``p`` with ``p``'s memory layout (channels_last stays so)."""
    return p.detach().to(torch.float32, copy=True, memory_format=torch.preserve_format)


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether the multi-tensor ops pair ``a`` with ``b`` element for element: both dense,
    on one device, with the same shape and strides (or both contiguous)."""
    if a.device != b.device or a.numel() != b.numel():
        return False
    if not (ops.is_dense(a) and ops.is_dense(b)):
        return False
    return (a.is_contiguous() and b.is_contiguous()) or (
        a.shape == b.shape and a.stride() == b.stride())


def follow_layout(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (state of ``like``: a master, a moment) on ``like``'s device and in its
    memory layout, values unchanged; ``t`` itself when it is there already. For a
    model moved or converted (``.cuda()``, ``channels_last``) after its optimizer was
    built."""
    if t.device == like.device and (t.shape == like.shape and t.stride() == like.stride()
                                    or same_layout(t, like)):
        return t
    out = torch.empty_like(like, dtype=t.dtype)
    out.copy_(t.reshape(like.shape) if t.shape != like.shape else t)
    return out


def _pairs_by_device(src: Sequence[Tensor], dst: Sequence[Tensor]):
    """Splits (src, dst) pairs into those the multi-tensor ops take, by device, and
    the rest."""
    fast: Dict[torch.device, Tuple[List[Tensor], List[Tensor]]] = {}
    slow = []
    for s, d in zip(src, dst):
        if s.dtype in _FLOAT_DTYPES and d.dtype in _FLOAT_DTYPES and same_layout(s, d):
            pair = fast.setdefault(d.device, ([], []))
            pair[0].append(s)
            pair[1].append(d)
        else:
            slow.append((s, d))
    return fast, slow


@torch.no_grad()
def copy_to_model(masters: Sequence[Tensor], params: Sequence[Tensor]) -> None:
    """``params[i].copy_(masters[i])`` with the cast, one ``multi_tensor_copy_`` per
    device for the pairs it takes."""
    fast, slow = _pairs_by_device([m.detach() for m in masters], [p.detach() for p in params])
    for s, d in fast.values():
        ops.multi_tensor_copy_(s, d)
    for s, d in slow:
        d.copy_(s.reshape(d.shape))


@torch.no_grad()
def unscale_into_masters(params: Sequence[Tensor], masters: Sequence[Tensor],
                         found_inf: Tensor, inv_scale: Optional[Tensor],
                         accumulate: bool = False) -> None:
    """``masters[i].grad = params[i].grad * inv_scale`` in fp32 (added to an existing
    master gradient when ``accumulate``), and ``found_inf`` set when any model gradient
    holds inf or NaN. Parameters without gradient leave their master's as it is
    (``None`` unless accumulating). ``found_inf`` and ``inv_scale`` live on one
    device; other devices get copies and their flags are added back, on the device.
    ``inv_scale`` None means 1."""
    by_device: Dict[torch.device, Tuple[List[Tensor], List[Tensor], List[Tensor]]] = {}
    for p, m in zip(params, masters):
        grad = p.grad
        if grad is None:
            continue
        if grad.layout != torch.strided:
            raise TypeError(f"unscale_into_masters: a parameter of shape {tuple(p.shape)} "
                            f"has a sparse gradient (layout {grad.layout}); master weights "
                            "need dense gradients")
        if not ops.is_dense(grad):
            grad = grad.contiguous()
        dst = torch.empty_like(m, dtype=torch.float32) if accumulate or m.grad is None \
            or not same_layout(grad, m.grad) else m.grad
        if not same_layout(grad, dst):
            grad = follow_layout(grad, dst)
        src_list, dst_list, owners = by_device.setdefault(grad.device, ([], [], []))
        src_list.append(grad)
        dst_list.append(dst)
        owners.append(m)
    for device, (src, dst, owners) in by_device.items():
        flag = _flag_on(device, found_inf)
        ops.multi_tensor_unscale_to_(src, dst, flag, _inv_on(device, inv_scale))
        for m, g in zip(owners, dst):
            if accumulate and m.grad is not None:
                m.grad.add_(g)
            else:
                m.grad = g
        _merge(flag, found_inf)


@torch.no_grad()
def unscale_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Optional[Tensor]) -> None:
    """``grads[i] *= inv_scale`` in place (dense gradients; one ``multi_tensor_unscale_``
    per device), and ``found_inf`` set when any holds inf or NaN; devices as in
    :func:`unscale_into_masters`."""
    by_device: Dict[torch.device, List[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, on_device in by_device.items():
        flag = _flag_on(device, found_inf)
        ops.multi_tensor_unscale_(on_device, flag, _inv_on(device, inv_scale))
        _merge(flag, found_inf)


def _flag_on(device: torch.device, found_inf: Tensor) -> Tensor:
    """The overflow flag to pass the ops on ``device``: ``found_inf`` on its own device,
    a fresh one elsewhere (see ``_merge``)."""
    if device == found_inf.device:
        return found_inf
    return torch.zeros((), dtype=torch.float32, device=device)


def _merge(flag: Tensor, found_inf: Tensor) -> None:
    """Joins another device's flag into ``found_inf`` on the device, by a maximum: torch's
    fused optimizers expect 0 or 1."""
    if flag is not found_inf:
        torch.maximum(found_inf, flag.to(found_inf.device, non_blocking=True)
                      .reshape(found_inf.shape), out=found_inf)


def _inv_on(device: torch.device, inv_scale: Optional[Tensor]) -> Tensor:
    if inv_scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return inv_scale.to(device, non_blocking=True)
