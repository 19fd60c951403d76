"""The one master-weights helper: fp32 masters of fp16/bf16 parameters, their
gradients (unscaled into them through :mod:`mixedprec.grads`), and the copy back into
the model.

Used by the fused optimizers (masters in their state), ``mixedprec.amp`` (O2 with
other optimizers) and ``mixedprec.fp16_utils`` (``FP16_Optimizer``, Apex's
``model_grads_to_master_grads``/``master_params_to_model_params``). Each function
works through the multi-tensor ops, one call per device for the pairs they take
(same device, dense, same memory order), and falls back to ``copy_`` for the rest.
"""

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from . import grads, ops
from .grads import OP_DTYPES

__all__ = ["HALF_DTYPES", "needs_master", "make_master", "retake_master", "follow_layout",
           "same_layout", "copy_to_model", "unscale_into_masters"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def needs_master(p: Tensor) -> bool:
    """Whether ``p`` is a 16-bit float parameter, which keeps an fp32 master."""
    return p.dtype in HALF_DTYPES


def make_master(p: Tensor) -> Tensor:
    """An fp32 copy of ``p`` with ``p``'s memory layout (channels_last stays so)."""
    return p.detach().to(torch.float32, copy=True, memory_format=torch.preserve_format)


@torch.no_grad()
def retake_master(master: Tensor, p: Tensor) -> bool:
    """Brings ``master`` up to ``p`` after ``p`` was written outside the optimizer, in
    place and on the device (no host synchronisation): an element where ``p`` still holds
    the master's rounding keeps the master's fp32 value (a write of the same values, such
    as copying a model onto itself, loses no precision), every other element takes
    ``p``'s value. False, and nothing changed, when ``master`` no longer matches ``p``'s
    shape or device (a new master is then needed)."""
    if master.shape != p.shape or master.device != p.device:
        return False
    value = p.detach()
    master.copy_(torch.where(master.to(value.dtype) == value, master,
                             value.to(torch.float32)))
    return True


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


@torch.no_grad()
def copy_to_model(masters: Sequence[Tensor], params: Sequence[Tensor]) -> None:
    """``params[i].copy_(masters[i])`` with the cast, one ``multi_tensor_copy_`` per
    device for the pairs it takes."""
    src, dst, slow = [], [], []
    for s, d in zip(masters, params):
        s, d = s.detach(), d.detach()
        if s.dtype in OP_DTYPES and d.dtype in OP_DTYPES and same_layout(s, d):
            src.append(s)
            dst.append(d)
        else:
            slow.append((s, d))
    for s_list, d_list in grads.by_device(src, dst).values():
        ops.multi_tensor_copy_(s_list, d_list)
    for s, d in slow:
        d.copy_(s.reshape(d.shape))


@torch.no_grad()
def unscale_into_masters(params: Sequence[Tensor], masters: Sequence[Tensor],
                         found_inf: Tensor, inv_scale: Optional[Tensor],
                         accumulate: bool = False) -> None:
    """``masters[i].grad = params[i].grad * inv_scale`` in fp32 (added to an existing
    master gradient when ``accumulate``), and ``found_inf`` set when any model gradient
    holds inf or NaN (:func:`mixedprec.grads.unscale_`, which also says how devices are
    handled). Parameters without gradient leave their master's as it is (``None``
    unless accumulating). ``inv_scale`` None means 1."""
    src: List[Tensor] = []
    dst: List[Tensor] = []
    owners: List[Tensor] = []
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
        out = torch.empty_like(m, dtype=torch.float32) if accumulate or m.grad is None \
            or not same_layout(grad, m.grad) else m.grad
        src.append(grad if same_layout(grad, out) else follow_layout(grad, out))
        dst.append(out)
        owners.append(m)
    grads.unscale_(src, found_inf, inv_scale, out=dst)
    for m, g in zip(owners, dst):
        if accumulate and m.grad is not None:
            m.grad.add_(g)
        else:
            m.grad = g
