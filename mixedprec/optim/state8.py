"""8-bit moments (``state_dtype=torch.float8_e4m3fn``, docs/lean-precision.md): which
parameters get them, their state entries, and the checks of a loaded state dict.

A parameter with 8-bit moments keeps each moment as fp8 e4m3 codes of its shape and
one power-of-two scale per block of 32 consecutive elements, shape ``(shape[0], numel /
shape[0] / 32)``, as its byte (``torch.uint8``: the biased exponent, 2^(byte - 127), as
``torch.float8_e8m0fnu`` reads it; uint8 because torch.compile's inductor has no
float8_e8m0fnu; state dicts hold float8_e8m0fnu views of them, :func:`as_e8m0`): Adam's
``exp_avg`` with ``exp_avg_scale`` and ``exp_avg_sq_root`` (the root of the second
moment) with ``exp_avg_sq_root_scale``; SGD's ``momentum_buffer`` with
``momentum_buffer_scale``. New state: codes 0, scale bytes 127 (1.0).

Eligible: at least 2 dimensions, at least 4096 elements, rows (dim-0 slices) of whole
blocks (``numel / shape[0]`` a multiple of 32), contiguous, and for a DTensor only
Shard(0) and Replicate placements. Blocks then lie within rows, FSDP2's shard
boundaries fall between rows, and the scales of a sharded parameter are a DTensor with
its mesh and placements: a distributed checkpoint reshards codes and scales as they
are. Other parameters keep fp32 moments (the usual entries).
"""

from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from ..distributed import is_dtensor

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu  # (the scales' meaning; loading takes scales of it)
SCALE = torch.uint8  # the scales as kept: their bytes
BLOCK = 32
MIN_NUMEL = 4096
# Each 8-bit entry (codes) and the entry of its scales.
SCALE_OF = {"exp_avg": "exp_avg_scale", "exp_avg_sq_root": "exp_avg_sq_root_scale",
            "momentum_buffer": "momentum_buffer_scale"}
# The entries only a parameter with 8-bit moments keeps.
ONLY_8BIT = ("exp_avg_sq_root", *SCALE_OF.values())
ADAM_KEYS = ("exp_avg", "exp_avg_sq_root")
SGD_KEYS = ("momentum_buffer",)
_ONE = 127  # the scale byte of 2^0


def _local(p: Tensor) -> Tensor:
    return p.to_local() if is_dtensor(p) else p


def eligible(p: Tensor) -> bool:
    """Whether ``p`` gets 8-bit moments (see the module docstring). From shapes and
    metadata only: no device read."""
    if p.dim() < 2 or p.numel() < MIN_NUMEL or (p.numel() // p.shape[0]) % BLOCK:
        return False
    if is_dtensor(p) and not all(pl.is_replicate() or type(pl).__name__ == "Shard"
                                 and pl.dim in (0, -p.dim()) for pl in p.placements):
        return False  # (Shard(d > 0) or Partial: blocks would straddle shards)
    return _local(p).is_contiguous()


def scale_shape(p: Tensor) -> Tuple[int, int]:
    """The shape of ``p``'s scales (of the whole tensor for a DTensor)."""
    return p.shape[0], p.numel() // p.shape[0] // BLOCK


def new_scales(like: Tensor) -> Tensor:
    """Scales of 1.0 for the blocks of ``like`` (a DTensor with its mesh and placements
    for a DTensor)."""
    local = _local(like)
    rows, cols = scale_shape(like)
    out = torch.full((local.shape[0], cols), _ONE, dtype=SCALE, device=local.device)
    return _placed_as(out, like, (rows, cols), (cols, 1)) if is_dtensor(like) else out


def _placed_as(local: Tensor, like: Tensor, shape, stride) -> Tensor:
    """``local`` as the shard of a DTensor of ``shape`` and ``stride`` placed as
    ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def as_e8m0(scales: Tensor) -> Tensor:
    """``scales`` (the state's bytes) as a float8_e8m0fnu view of the same storage (a
    DTensor's with its mesh and placements): how state dicts hold them, as they did
    before the state kept bytes, so that a checkpoint loaded in place (DCP) gets the
    dtype it was saved with, byte for byte."""
    if scales.dtype != SCALE:
        return scales
    if not is_dtensor(scales):
        return scales.view(E8M0)
    return _placed_as(scales.to_local().view(E8M0), scales, scales.shape, scales.stride())


def as_bytes(scales: Tensor) -> Tensor:
    """Loaded scales as the state keeps them: a float8_e8m0fnu tensor as its bytes."""
    return scales.view(SCALE) if scales.dtype == E8M0 else scales


def decode(codes: Tensor, scales: Tensor) -> Tensor:
    """The float32 values of 8-bit state (plain tensors): each code's value times its
    block's scale, 2^(byte - 127). Exact: an e4m3 value times a power of two is a
    float32 (a square of one too, as the second moment's root is squared)."""
    byte = scales.reshape(-1, 1).view(torch.uint8).to(torch.int32)
    # 2^(byte - 127) from its bits: byte << 23 for 1..254; 2^-127 (subnormal) for 0,
    # and NaN for 255, as float8_e8m0fnu reads them
    bits = torch.where(byte == 0, 1 << 22, torch.where(byte == 255, 0x7FC00000, byte << 23))
    values = codes.reshape(-1, BLOCK).to(torch.float32) * bits.view(torch.float32)
    return values.reshape(codes.shape)


def uses_8bit(p: Tensor, state: Dict[str, Any], key: str) -> bool:
    """Whether ``p`` steps with 8-bit moments: its ``key`` entry (codes) is 8-bit, or
    it has none yet and is eligible. 8-bit state of a parameter no longer contiguous
    (``channels_last`` after the state was made) is an error: its blocks follow the
    memory order it was made in."""
    codes = state.get(key)
    if codes is None:
        return eligible(p)
    if codes.dtype != E4M3:
        return False
    if not _local(p).is_contiguous():
        raise RuntimeError(f"8-bit moments need a contiguous parameter; one of shape "
                           f"{tuple(p.shape)} with 8-bit state is no longer contiguous "
                           "(channels_last after the optimizer stepped?)")
    return True


def entries(states: List[Dict[str, Any]], likes: List[Tensor],
            key: str) -> Tuple[List[Tensor], List[Tensor]]:
    """The codes (``key``) and scales of each state, created where absent (codes 0,
    scales 1.0, laid out as ``like``, a target of the update), on like's device."""
    codes, scales = [], []
    for state, like in zip(states, likes):
        value = state.get(key)
        if value is None:
            value = state[key] = torch.zeros_like(like, dtype=E4M3,
                                                  memory_format=torch.contiguous_format)
        elif value.device != like.device:
            value = state[key] = value.to(like.device)
        scale = state.get(SCALE_OF[key])
        if scale is None:
            scale = state[SCALE_OF[key]] = new_scales(like)
        elif scale.device != like.device:
            scale = state[SCALE_OF[key]] = scale.to(like.device)
        codes.append(value)
        scales.append(scale)
    return codes, scales


def expected(p: Tensor, key: str, state_dtype: torch.dtype, where: str):
    """(shape, dtype) a loaded 8-bit-aware entry ``key`` of ``p`` must have with this
    ``state_dtype``, or None when ``key`` is not such an entry (moments, momentum
    buffers and 8-bit entries are); raises for an entry this optimizer does not keep
    for ``p``."""
    eight = state_dtype == E4M3 and eligible(p)
    if key in ONLY_8BIT:
        if not eight:
            why = (f"state_dtype={state_dtype}" if state_dtype != E4M3 else
                   f"the parameter of shape {tuple(p.shape)} is not eligible for them")
            raise ValueError(f"{where}: an 8-bit moment entry, which only a parameter with "
                             f"8-bit moments (state_dtype=torch.float8_e4m3fn) keeps ({why})")
        return (scale_shape(p), SCALE) if key.endswith("_scale") else (tuple(p.shape), E4M3)
    if key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq"):
        if eight and key in SCALE_OF:
            return tuple(p.shape), E4M3
        if eight:
            raise ValueError(f"{where}: a parameter with 8-bit moments keeps no {key!r} "
                             "(state_dtype=torch.float8_e4m3fn: the second moment's root "
                             "is in 'exp_avg_sq_root', and amsgrad is refused)")
        return tuple(p.shape), torch.float32 if state_dtype == E4M3 else state_dtype
    return None


def check_pairs(where: str, state: Dict[str, Any]) -> None:
    """A loaded state's 8-bit codes come with their scales, and scales with codes."""
    for key, scale in SCALE_OF.items():
        codes = state.get(key)
        has_codes = isinstance(codes, Tensor) and codes.dtype == E4M3
        if has_codes != (scale in state):
            missing, present = (scale, key) if has_codes else (key, scale)
            raise ValueError(f"{where}: {present!r} without {missing!r} (8-bit moments "
                             "keep codes and scales together)")
