"""Apex's ``apex_C`` extension on mixedprec: :func:`flatten` and :func:`unflatten`.

``import apex_C`` resolves here under the Apex alias (:mod:`mixedprec.apex`); NVIDIA's
BERT pretraining imports it at top level. Both functions are plain PyTorch (one
``torch.cat``; views into the flat tensor) and run on any device.
"""

from typing import List, Sequence

import torch
from torch import Tensor

__all__ = ["flatten", "unflatten"]


def _check(fn: str, tensors: Sequence[Tensor]) -> None:
    if isinstance(tensors, Tensor) or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError(f"apex_C.{fn}: expected a sequence of tensors, got {type(tensors)}")
    if any(t.layout != torch.strided for t in tensors):
        raise TypeError(f"apex_C.{fn}: expected dense tensors")


def flatten(bucket: Sequence[Tensor]) -> Tensor:
    """One new 1-D tensor holding the elements of the tensors of ``bucket`` one after the
    other (all of one dtype and device, as in Apex)."""
    tensors = bucket
    _check("flatten", tensors)
    if not tensors:
        raise ValueError("apex_C.flatten: expected at least one tensor, got none")
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise TypeError(f"apex_C.flatten: expected tensors of one dtype and device, got "
                        f"{sorted(str(k) for k in kinds)}")
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(coalesced: Tensor, bucket: Sequence[Tensor]) -> List[Tensor]:
    """Views into ``coalesced`` (as :func:`flatten` made it) with the shapes of the tensors
    of ``bucket``."""
    flat, tensors = coalesced, bucket
    _check("unflatten", tensors)
    if not isinstance(flat, Tensor) or flat.dim() != 1:
        raise TypeError("apex_C.unflatten: expected coalesced to be a 1-D tensor")
    sizes = [t.numel() for t in tensors]
    if flat.numel() != sum(sizes):
        raise ValueError(f"apex_C.unflatten: coalesced has {flat.numel()} elements, the bucket "
                         f"{sum(sizes)}")
    return [part.view_as(t) for part, t in zip(torch.split(flat, sizes), tensors)]
