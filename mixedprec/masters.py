"""The one master-weights helper: fp32 masters of fp16/bf16 parameters, their
gradients (unscaled into them through :mod:`mixedprec.grads`), and the copy back into
the model; and master="remainder"'s form of a master (a bf16 parameter and an int16
remainder, :func:`split_remainder`), with the exact conversions of optimizer state
between the two forms.

Used by the fused optimizers (masters in their state), ``mixedprec.amp`` (O2 with
other optimizers) and ``mixedprec.fp16_utils`` (``FP16_Optimizer``, Apex's
``model_grads_to_master_grads``/``master_params_to_model_params``). Each function
works through the multi-tensor ops, one call per device for the pairs they take
(same device, dense, same memory order), and falls back to ``copy_`` for the rest.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import grads, ops
from .grads import OP_DTYPES

__all__ = ["HALF_DTYPES", "needs_master", "make_master", "retake_master", "follow_layout",
           "same_layout", "copy_to_model", "unscale_into_masters", "split_remainder",
           "join_remainder", "masters_to_remainders", "remainders_to_masters"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def needs_master(p: Tensor) -> bool:
    """Whether ``p`` is a 16-bit float parameter, which keeps an fp32 master."""
    return p.dtype in HALF_DTYPES


def make_master(p: Tensor) -> Tensor:
    """An fp32 copy of ``p`` with ``p``'s memory layout (channels_last stays so)."""
    return p.detach().to(torch.float32, copy=True, memory_format=torch.preserve_format)


@torch.no_grad()
def retake_master(master: Tensor, p: Tensor, was: Optional[torch.dtype] = None) -> bool:
    """Brings ``master`` up to ``p`` after ``p`` was written outside the optimizer, in
    place and on the device (no host synchronisation): an element where ``p`` still holds
    the master's rounding keeps the master's fp32 value (a write of the same values, such
    as copying a model onto itself, loses no precision), every other element takes
    ``p``'s value. ``was``: the dtype ``p`` had when it held the master's rounding (a
    model converted since, fp16 to bf16: the master rounded through it). False, and
    nothing changed, when ``master`` no longer matches ``p``'s shape or device (a new
    master is then needed)."""
    if master.shape != p.shape or master.device != p.device:
        return False
    value = p.detach()
    rounded = master.to(was) if was is not None and was != value.dtype else master
    master.copy_(torch.where(rounded.to(value.dtype) == value, master,
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


def _check_pairs(where: str, a_name: str, a: Sequence[Any], b_name: str,
                 b: Sequence[Any]) -> None:
    """Two lists of tensors paired element for element: the same length, each pair
    tensors of as many elements."""
    if len(a) != len(b):
        raise ValueError(f"{where}: expected {a_name} and {b_name} of one length, got "
                         f"{len(a)} and {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if not isinstance(x, Tensor) or not isinstance(y, Tensor):
            raise TypeError(f"{where}: expected {a_name}[{i}] and {b_name}[{i}] to be "
                            f"tensors, got {type(x).__name__} and {type(y).__name__}")
        if x.numel() != y.numel():
            raise ValueError(f"{where}: {a_name}[{i}] has shape {tuple(x.shape)}, "
                             f"{b_name}[{i}] {tuple(y.shape)}: expected as many elements")


@torch.no_grad()
def copy_to_model(masters: Sequence[Tensor], params: Sequence[Tensor]) -> None:
    """``params[i].copy_(masters[i])`` with the cast, one ``multi_tensor_copy_`` per
    device for the pairs it takes. The lists and each pair's sizes are checked before
    anything is written."""
    masters, params = list(masters), list(params)
    _check_pairs("copy_to_model", "masters", masters, "params", params)
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
    params, masters = list(params), list(masters)
    _check_pairs("unscale_into_masters", "params", params, "masters", masters)
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


# master="remainder" (docs/lean-precision.md): an fp32 master kept as a bf16 parameter,
# the high half of its bits, and an int16 remainder, the low half: bits(master) =
# (bits(param) << 16) + remainder (mod 2^32). The same rule as the fused ops' kernels
# (csrc/pointwise.h, split_bf16_remainder), in torch ops (int64 math: no overflow).


def split_remainder(master: Tensor) -> Tuple[Tensor, Tensor]:
    """``(param, remainder)`` of fp32 ``master``: the bf16 parameter, ``master`` rounded
    to nearest with ties away from zero (in magnitude; high half
    ``(bits + 0x8000) >> 16``), and the int16 remainder ``bits - (high << 16)``, in
    [-2^15, 2^15). The pair joins back to ``master`` bit for bit, for every fp32 value
    but NaN (a NaN master splits into bf16's NaN and 0). The parameter differs from
    ``master.bfloat16()`` (to nearest, ties to even) only at exact ties on an even
    high half (low half 0x8000), by one unit away from zero."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_remainder: expected a float32 master, got {master.dtype}")
    bits = master.detach().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((bits + 0x8000) >> 16) & 0xFFFF
    remainder = ((bits - (high << 16) + 0x8000) & 0xFFFF) - 0x8000
    nan = master.detach().isnan()
    high = torch.where(nan, 0x7FC0, high)
    remainder = torch.where(nan, 0, remainder)
    param = (((high + 0x8000) & 0xFFFF) - 0x8000).to(torch.int16).view(torch.bfloat16)
    return param.reshape(master.shape), remainder.to(torch.int16).reshape(master.shape)


def join_remainder(param: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master of bf16 ``param`` and its int16 ``remainder``:
    ``(bits(param) << 16) + remainder``, as the bits of a float32 tensor."""
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError("join_remainder: expected a bfloat16 param and an int16 remainder, "
                        f"got {param.dtype} and {remainder.dtype}")
    high = (param.detach().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    bits = (high + remainder.to(torch.int64) + 2**31) % 2**32 - 2**31
    return bits.to(torch.int32).view(torch.float32).reshape(param.shape)


def _state_params(state_dict: Dict[str, Any], params: Sequence[Tensor],
                  where: str) -> Dict[Any, Tensor]:
    ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    if len(ids) != len(params):
        raise ValueError(f"{where}: expected params to be the optimizer's {len(ids)} "
                         f"parameters in state-dict order, got {len(params)}")
    return dict(zip(ids, params))


@torch.no_grad()
def masters_to_remainders(state_dict: Dict[str, Any], params: Sequence[Tensor]) -> Dict[str, Any]:
    """An optimizer state dict of ``master="fp32"`` as ``master="remainder"`` keeps it
    (for an optimizer of the same class built with ``master="remainder"``): each
    ``master_param`` of a bf16 parameter becomes its ``remainder``, and the parameter
    (``params``: the optimizer's, in state-dict order, ``[p for g in
    opt.param_groups for p in g["params"]]``) receives the master's high half, which
    differs from what the fp32 mode wrote only at ties. Exact: the new pairs are the
    masters bit for bit. Everything is checked before anything is written."""
    where = "masters_to_remainders"
    by_id = _state_params(state_dict, params, where)
    for key, state in state_dict["state"].items():
        if "master_param" in state and by_id[key].dtype != torch.bfloat16:
            raise TypeError(f"{where}: master='remainder' keeps bfloat16 parameters, got "
                            f"one of dtype {by_id[key].dtype} (param {key})")
    out = dict(state_dict, state={})
    for key, state in state_dict["state"].items():
        state = dict(state)
        master = state.pop("master_param", None)
        if master is not None:
            p = by_id[key]
            high, state["remainder"] = split_remainder(master.to(p.device).reshape(p.shape))
            p.copy_(high)
        out["state"][key] = state
    return out


@torch.no_grad()
def remainders_to_masters(state_dict: Dict[str, Any], params: Sequence[Tensor]) -> Dict[str, Any]:
    """The inverse of :func:`masters_to_remainders`: each ``remainder`` becomes the
    ``master_param`` it and its parameter hold, and the parameter receives the master
    rounded to nearest even, as ``master="fp32"`` writes it. Exact."""
    by_id = _state_params(state_dict, params, "remainders_to_masters")
    out = dict(state_dict, state={})
    masters = {}
    for key, state in state_dict["state"].items():
        state = dict(state)
        remainder = state.pop("remainder", None)
        if remainder is not None:
            p = by_id[key]
            masters[key] = state["master_param"] = join_remainder(
                p, remainder.to(p.device).reshape(p.shape))
        out["state"][key] = state
    for key, master in masters.items():
        by_id[key].copy_(master)
    return out
