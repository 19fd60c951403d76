"""``apex.normalization`` on PyTorch's ``layer_norm`` and ``rms_norm``:
:class:`FusedLayerNorm`, :class:`FusedRMSNorm`, :class:`MixedFusedLayerNorm`,
:class:`MixedFusedRMSNorm` and the functional forms of Apex's ``fused_layer_norm.py``.

Apex's names, arguments and defaults (the modules' ``eps=1e-5``, the functions'
``eps=1e-6``), with the dtypes of Apex's CUDA kernels on every device:

* The statistics are computed in float32 (float64 for float64 input), whatever the
  input's and parameters' dtypes.
* ``fused_*`` and :class:`FusedLayerNorm` / :class:`FusedRMSNorm` return the input's
  dtype. ``mixed_dtype_*`` and the ``MixedFused*`` modules return the parameters'
  dtype: their weights stay float32 (unless the module is converted) while the input
  is fp16 or bf16, and the output is then float32, as Apex's
  ``forward_affine_mixed_dtypes`` kernels did.
* Under autocast, the tensor arguments are first cast to autocast's dtype and the norm
  runs with autocast off, as in Apex.

``memory_efficient`` is accepted and kept as an attribute; it has no effect (Apex
saved the output instead of the input for the backward pass; autograd here saves what
``torch.nn.functional`` saves). Apex fell back to other code on the CPU; here the same
code runs on every device.
"""

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
    "fused_layer_norm_affine", "fused_layer_norm", "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm_affine", "fused_rms_norm", "mixed_dtype_fused_rms_norm_affine",
    "manual_rms_norm",
]

Shape = Union[int, Sequence[int], torch.Size]


def _shape(normalized_shape: Shape) -> Tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    if not isinstance(normalized_shape, (Sequence, torch.Size)) or not all(
            isinstance(n, numbers.Integral) for n in normalized_shape):
        raise TypeError(f"expected normalized_shape to be an int or a sequence of ints, got "
                        f"{normalized_shape!r}")
    return tuple(int(n) for n in normalized_shape)


def _norm(kind: str, input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
          normalized_shape: Shape, eps: float, mixed: bool) -> Tensor:
    """Layer or RMS norm in float32 (float64 for float64 input); the output in the
    parameters' dtype when ``mixed``, else in the input's."""
    if not isinstance(input, Tensor):
        raise TypeError(f"expected input to be a tensor, got {type(input).__name__}")
    shape = _shape(normalized_shape)
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):  # Apex casts every argument, then runs
        dtype = torch.get_autocast_dtype(device_type)
        input, weight, bias = (t if t is None or not t.is_floating_point() else t.to(dtype)
                               for t in (input, weight, bias))
    out_dtype = weight.dtype if mixed and weight is not None else input.dtype
    if kind == "layer" and all(t is None or t.dtype == out_dtype for t in (input, weight, bias)):
        # One dtype throughout: torch's kernel reads fp16/bf16 input and accumulates the
        # statistics in float32 itself, without a float32 copy of the input.
        with torch.autocast(device_type, enabled=False):
            return F.layer_norm(input, shape, weight, bias, eps)
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    x, w, b = (None if t is None else t.to(compute) for t in (input, weight, bias))
    with torch.autocast(device_type, enabled=False):
        if kind == "layer":
            y = F.layer_norm(x, shape, w, b, eps)
        else:
            y = F.rms_norm(x, shape, w, eps)
    return y.to(out_dtype)


def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                            memory_efficient=False):
    """Layer norm with weight and bias; output in the input's dtype."""
    return _norm("layer", input, weight, bias, normalized_shape, eps, mixed=False)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """Layer norm without affine parameters; output in the input's dtype."""
    return _norm("layer", input, None, None, normalized_shape, eps, mixed=False)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                                        memory_efficient=False):
    """Layer norm with weight and bias; output in the weight's dtype."""
    return _norm("layer", input, weight, bias, normalized_shape, eps, mixed=True)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm (``x / sqrt(mean(x**2) + eps) * weight``); output in the input's dtype."""
    return _norm("rms", input, weight, None, normalized_shape, eps, mixed=False)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm without a weight; output in the input's dtype."""
    return _norm("rms", input, None, None, normalized_shape, eps, mixed=False)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6,
                                      memory_efficient=False):
    """RMS norm with a weight; output in the weight's dtype."""
    return _norm("rms", input, weight, None, normalized_shape, eps, mixed=True)


def manual_rms_norm(input, normalized_shape, weight, eps):
    """Apex's unfused RMS norm (its CPU path): output in the weight's dtype when that is
    fp16 or bf16, else in the widest of float32, the input's and the weight's dtypes."""
    wide = torch.promote_types(input.dtype, torch.float32)
    if weight is not None and weight.dtype not in (torch.float16, torch.bfloat16):
        wide = torch.promote_types(wide, weight.dtype)
    out = _norm("rms", input.to(wide), weight, None, normalized_shape, eps, mixed=False)
    if weight is not None and weight.dtype in (torch.float16, torch.bfloat16):
        return out.to(weight.dtype)
    return out


class _FusedNorm(nn.Module):
    """What Apex's four norm modules share: ``torch.nn.LayerNorm``'s arguments plus
    ``memory_efficient`` (no effect here), a weight (and, for the layer norm, a bias)
    of ``normalized_shape``, and the output dtype rule of ``_norm``."""

    _kind = "layer"  # or "rms": no bias
    _mixed = False  # the output in the parameters' dtype (the Mixed* modules)

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False):
        super().__init__()
        self.normalized_shape = torch.Size(_shape(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        has_bias = self._kind == "layer"
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        if has_bias and elementwise_affine:
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
        elif has_bias:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            if self._kind == "layer":
                nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        bias = self.bias if self._kind == "layer" else None
        return _norm(self._kind, input, self.weight, bias, self.normalized_shape, self.eps,
                     mixed=self._mixed)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class FusedLayerNorm(_FusedNorm):
    """Apex's ``FusedLayerNorm``: ``torch.nn.LayerNorm``'s arguments plus
    ``memory_efficient`` (no effect here); output in the input's dtype."""


class FusedRMSNorm(_FusedNorm):
    """Apex's ``FusedRMSNorm``: ``y = x / sqrt(mean(x**2) + eps) * weight`` over the last
    ``normalized_shape`` dimensions; output in the input's dtype."""

    _kind = "rms"


def _mixed_affine(cls_name: str, kwargs: dict) -> None:
    """Apex's Mixed* modules always have affine parameters."""
    unknown = set(kwargs) - {"elementwise_affine"}
    if unknown:
        raise TypeError(f"{cls_name}: unexpected keyword arguments {sorted(unknown)}")
    if "elementwise_affine" in kwargs and not kwargs["elementwise_affine"]:
        raise ValueError(f"{cls_name}: elementwise_affine=False is not supported "
                         "(the parameters are always there)")


class MixedFusedLayerNorm(FusedLayerNorm):
    """Apex's ``MixedFusedLayerNorm``: a :class:`FusedLayerNorm` whose output has the
    parameters' dtype (float32 parameters, fp16/bf16 input: float32 output)."""

    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_affine("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """Apex's ``MixedFusedRMSNorm``: a :class:`FusedRMSNorm` whose output has the
    parameters' dtype."""

    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_affine("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)
