"""The one gradient module of the core: every place that groups gradients by device,
checks them for overflow, unscales them or picks the gradient an update reads calls
this module (nowhere else does it).

* :func:`by_device` groups parallel lists (gradients; or sources and destinations) by
  device: the multi-tensor ops take one device and any mix of float32, float16 and
  bfloat16 per call. :func:`by_device_and_dtype` also splits by dtype, with torch's own
  helper, for torch's kernels that want one dtype per call.
* :func:`check_finite_` is the read-only overflow check, :func:`unscale_` the unscale
  (in place, or into other tensors: fp32 master gradients). Both take sparse gradients
  (their values) and gradients on several devices: ``found_inf`` lives on one device,
  each other device gets a flag of its own, folded back into ``found_inf`` on the
  device by a maximum (torch's fused optimizers expect 0 or 1). No host reads.
* Every float32, float16 and bfloat16 gradient goes through mixedprec's multi-tensor
  ops, a strided view that is not dense (a slice of a transpose, say) as a dense copy
  (written back after an in-place unscale): the same math, bit for bit, on every
  device. torch's kernels only take what the ops do not (float64): torch's unscale
  kernel has no bfloat16 CUDA implementation.
* :func:`update_grad`: the fp32 master's ``.grad`` when set, else ``p.grad``.
* :func:`nonfinite_per_tensor`: which gradients hold inf or NaN, one flag each, on the
  device (the overflow report's per-parameter attribution).
* :func:`global_norm`: the L2 norm of all gradients together, unscaled on the fly
  (the scaler's clipping), on the device.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops

__all__ = ["OP_DTYPES", "by_device", "by_device_and_dtype", "update_grad", "check_finite_",
           "unscale_", "nonfinite_per_tensor", "global_norm"]

# The dtypes the multi-tensor ops take; others (float64) go through torch's kernels.
OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
Flags = Dict[torch.device, Tensor]


def by_device(*lists: Sequence[Any]) -> Dict[torch.device, Tuple[List[Any], ...]]:
    """Parallel lists (the first of tensors) grouped by the device of the first list's
    entries, in order: ``{device: (one list per argument)}``."""
    groups: Dict[torch.device, Tuple[List[Any], ...]] = {}
    for row in zip(*lists):
        group = groups.get(row[0].device)
        if group is None:
            group = groups[row[0].device] = tuple([] for _ in row)
        for out, item in zip(group, row):
            out.append(item)
    return groups


def by_device_and_dtype(*lists: Sequence[Tensor]):
    """As :func:`by_device`, keyed by ``(device, dtype)`` of the first list's tensors:
    ``torch.optim.Optimizer._group_tensors_by_device_and_dtype`` (one group under
    torch.compile, as there)."""
    if not lists or not lists[0]:
        return {}
    grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype([list(x) for x in lists])
    return {key: tuple(tensors) for key, (tensors, _) in grouped.items()}


def update_grad(p: Tensor, master: Optional[Tensor]) -> Optional[Tensor]:
    """The gradient an update of ``p`` reads: its fp32 ``master``'s ``.grad`` when one
    was materialized (unscaled; e.g. for clipping, by ``mixedprec.amp.master_params``),
    else ``p.grad``."""
    if master is not None and master.grad is not None:
        return master.grad
    return p.grad


# What an unscale takes: the multi-tensor ops' dtypes and float64 (torch's kernel).
_UNSCALED = frozenset(OP_DTYPES + (torch.float64,))


def _check_unscaled(grads: Sequence[Any], out: Optional[Sequence[Any]]) -> None:
    """Refuses, before anything is written, a gradient that is not a float tensor of
    those dtypes, and an ``out`` of another length."""
    bad = [i for i, g in enumerate(grads) if getattr(g, "dtype", None) not in _UNSCALED]
    if bad:
        g = grads[bad[0]]
        raise TypeError(f"unscale_: expected grads[{bad[0]}] to be a float32, float16, "
                        "bfloat16 or float64 tensor, got "
                        f"{g.dtype if isinstance(g, Tensor) else type(g).__name__}")
    if out is not None and len(out) != len(grads):
        raise ValueError(f"unscale_: expected out to hold one tensor per gradient "
                         f"({len(grads)}), got {len(out)}")


def _ours(t: Tensor) -> bool:
    """Whether the multi-tensor ops take ``t``: as it is when it is dense, else as a
    dense copy (:func:`_dense`). The rest (float64) goes through torch's kernels."""
    return t.dtype in OP_DTYPES and t.layout == torch.strided


def _dense(t: Tensor) -> Tensor:
    """``t`` when the multi-tensor ops take it as it is, else a contiguous copy."""
    return t if ops.is_dense(t) else t.contiguous()


def _read_values(grads: Sequence[Tensor]) -> List[Tensor]:
    """What a read-only pass reads of each gradient: a sparse one's coalesced values (the
    values its update sums), the others as they are."""
    return [(g if g.is_coalesced() else g.coalesce())._values() if g.is_sparse else g
            for g in grads]


def _flag(flags: Flags, found_inf: Tensor, device: torch.device) -> Tensor:
    """The overflow flag for ``device``: ``found_inf`` on its own device, a fresh zero
    flag (kept in ``flags``) elsewhere."""
    flag = flags.get(device)
    if flag is None:
        flag = flags[device] = found_inf.new_zeros(found_inf.shape, device=device)
    return flag


def _to(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; asynchronously, except into host memory, which the CPU ops
    read at once (a non-blocking copy there could still be under way)."""
    return t.to(device, non_blocking=device.type != "cpu")


def _finish(flags: Flags, found_inf: Tensor, merge: bool) -> Flags:
    if merge:
        for flag in flags.values():
            if flag is not found_inf:
                torch.maximum(found_inf, _to(flag, found_inf.device), out=found_inf)
    return flags


@torch.no_grad()
def check_finite_(grads: Sequence[Tensor], found_inf: Tensor, merge: bool = True) -> Flags:
    """Sets ``found_inf`` (a float32 flag; never cleared) when any gradient holds inf or
    NaN, writing nothing else: one ``multi_tensor_check_finite_`` per device over the
    float32, float16 and bfloat16 gradients (a sparse gradient: its coalesced values; one
    that is not dense: a dense copy), torch for the rest (float64). Returns each device's
    flag (``found_inf`` on its own); ``merge=False`` leaves the others out of
    ``found_inf`` (torch's GradScaler keeps them per device)."""
    flags = {found_inf.device: found_inf}
    values = _read_values(grads)
    for device, (on_device,) in by_device(values).items():
        flag = _flag(flags, found_inf, device)
        ours = [_dense(g) for g in on_device if _ours(g)]
        if ours:
            ops.multi_tensor_check_finite_(ours, flag)
        for g in (g for g in on_device if not _ours(g)):
            torch.maximum(flag, (~torch.isfinite(g)).any().to(flag.dtype), out=flag)
    return _finish(flags, found_inf, merge)


@torch.no_grad()
def unscale_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Optional[Tensor],
             out: Optional[Sequence[Tensor]] = None, merge: bool = True) -> Flags:
    """``grads[i] *= inv_scale`` in place, or ``out[i] = grads[i] * inv_scale`` (cast to
    ``out[i]``'s dtype: fp16/bf16 gradients into fp32 master gradients), and
    ``found_inf`` set as by :func:`check_finite_` (its flags returned). In place, one
    ``multi_tensor_unscale_`` per device over the float32, float16 and bfloat16
    gradients (a sparse gradient's values included; one that is not dense as a dense
    copy, unscaled there and copied back), torch's kernel for the rest (float64);
    ``out`` takes pairs that the multi-tensor ops take (dense, one device and layout),
    one ``multi_tensor_unscale_to_`` per device. ``inv_scale`` None means 1."""
    grads = list(grads)
    out = None if out is None else list(out)
    _check_unscaled(grads, out)
    flags = {found_inf.device: found_inf}
    inv_on = {} if inv_scale is None else {inv_scale.device: inv_scale}

    def on(device: torch.device) -> Tuple[Tensor, Tensor]:
        if device not in inv_on:
            inv_on[device] = torch.ones((), dtype=torch.float32, device=device) \
                if inv_scale is None else _to(inv_scale, device)
        return _flag(flags, found_inf, device), inv_on[device]

    if out is not None:
        for device, (src, dst) in by_device(grads, out).items():
            ops.multi_tensor_unscale_to_(src, dst, *on(device))
        return _finish(flags, found_inf, merge)
    values = [g._values() if g.is_sparse else g for g in grads]  # written in place
    for device, (on_device,) in by_device(values).items():
        ours = [g for g in on_device if _ours(g)]
        dense = [_dense(g) for g in ours]
        if dense:
            ops.multi_tensor_unscale_(dense, *on(device))
        for g, copy in zip(ours, dense):
            if copy is not g:  # (a dense copy of a view that is not dense)
                g.copy_(copy)
        for (other,) in by_device_and_dtype([g for g in on_device if not _ours(g)]).values():
            torch._amp_foreach_non_finite_check_and_unscale_(other, *on(device))
    return _finish(flags, found_inf, merge)


@torch.no_grad()
def nonfinite_per_tensor(grads: Sequence[Tensor], inv_scale: Optional[Tensor] = None
                         ) -> List[Tuple[List[int], Tensor]]:
    """Per device: (positions in ``grads``, a bool vector that is True where that
    gradient's norm is not finite). One ``multi_tensor_l2norm(per_tensor=True)`` per
    device, of the float32, float16 and bfloat16 gradients (sparse values included; one
    that is not dense as a dense copy) times ``inv_scale`` (so a scaled gradient's
    squares do not overflow); torch for the rest (float64). Flagged: a gradient holding
    inf or NaN, or one whose unscaled L2 norm exceeds float32's range. No host reads."""
    values = _read_values(grads)
    out = []
    for device, (on_device, positions) in by_device(values, list(range(len(values)))).items():
        fast = [i for i, g in zip(positions, on_device) if _ours(g)]
        flags = []
        if fast:
            inv = None if inv_scale is None else _to(inv_scale, device)
            _, norms = ops.multi_tensor_l2norm([_dense(values[i]) for i in fast], inv,
                                               per_tensor=True)
            flags.append(~torch.isfinite(norms))
        rest = [i for i, g in zip(positions, on_device) if not _ours(g)]
        if rest:
            flags.append(torch.stack([~torch.isfinite(values[i]).all() for i in rest]))
        out.append((fast + rest, torch.cat(flags)))
    return out


@torch.no_grad()
def global_norm(grads: Sequence[Tensor], inv_scale: Optional[Tensor] = None,
                device: Optional[torch.device] = None) -> Tensor:
    """The L2 norm of all ``grads`` together, each element times ``inv_scale`` (None: 1)
    in float32 first, as a float32 0-dim tensor on ``device`` (default: ``inv_scale``'s,
    else the first gradient's, else the CPU; 0 for no gradients). One
    ``multi_tensor_l2norm`` per device over the float32, float16 and bfloat16 gradients
    (a sparse gradient: its coalesced values; one that is not dense: a dense copy),
    torch's ``vector_norm`` for the rest (float64); the devices' norms combined in
    float32. inf or NaN where a gradient holds one. No host reads."""
    values = _read_values(grads)
    if device is None:
        device = inv_scale.device if inv_scale is not None else (
            values[0].device if values else torch.device("cpu"))
    norms = []
    for on, (on_device,) in by_device(values).items():
        inv = None if inv_scale is None else _to(inv_scale, on).reshape(1).float()
        ours = [_dense(g) for g in on_device if _ours(g)]
        if ours:
            norms.append(ops.multi_tensor_l2norm(ours, inv)[0].reshape(()))
        for g in (g for g in on_device if not _ours(g)):
            g = g.double() if inv is None else g.double() * inv.double()
            norms.append(torch.linalg.vector_norm(g).float())
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [_to(n, device) for n in norms]
    return norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
