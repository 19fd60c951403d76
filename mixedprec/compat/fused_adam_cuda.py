"""Apex's ``fused_adam_cuda`` extension on mixedprec: :func:`adam`, the one-tensor Adam
step of Apex's FusedAdam before its 2019 rewrite.

``import fused_adam_cuda`` resolves here under the Apex alias (:mod:`mixedprec.apex`).
Code of that time kept its own copy of that FusedAdam and imported the extension
directly: OpenNMT-py's ``-optim fusedadam``, fairseq's ``FusedAdamV1``. The step is
Apex's kernel's, per element in float32 (or the parameter's float64):

    g = grad / scale
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v + eps)  (eps_mode 0)  or  sqrt(v) + eps  (eps_mode 1)
    p = p - step_size * (m / denom + weight_decay * p)

with ``step_size = lr * sqrt(1 - beta2**step) / (1 - beta1**step)`` (``lr`` without
bias correction), computed on the host in float32 as Apex did, and every constant
(``beta1``, ``1 - beta1``, ``eps``, ``decay``, ...) a float32 as in Apex's kernel. Plain
PyTorch operations, on any device, with no host synchronisation; the arguments are
checked first. Where its compiler fused a multiply and an add, Apex's kernel rounded once
where these round twice.
"""

import math
import numbers

import numpy as np
import torch
from torch import Tensor

__all__ = ["adam"]

_WHERE = "fused_adam_cuda.adam"


def _number(name: str, value, *, integral: bool = False):
    kind = numbers.Integral if integral else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{_WHERE}: expected {name} to be {'an int' if integral else 'a number'}"
                        f", got {type(value).__name__}")
    if not integral and not math.isfinite(value):
        raise ValueError(f"{_WHERE}: expected {name} to be finite, got {value!r}")
    return value


def _check(p, p_copy, m, v, g) -> None:
    for name, t in (("p", p), ("p_copy", p_copy), ("m", m), ("v", v), ("g", g)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{_WHERE}: expected {name} to be a tensor, got "
                            f"{type(t).__name__}")
    if p.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{_WHERE}: expected p to be float32 (or float64), got {p.dtype}")
    for name, t in (("m", m), ("v", v)):
        if t.dtype != p.dtype or t.shape != p.shape or t.device != p.device:
            raise ValueError(f"{_WHERE}: expected {name} to be a {p.dtype} tensor of p's shape "
                             f"{tuple(p.shape)} on {p.device}, got a {t.dtype} tensor of shape "
                             f"{tuple(t.shape)} on {t.device}")
    wanted = (torch.float16, torch.bfloat16, p.dtype)  # (Apex: half gradients, or p's)
    if g.dtype not in wanted or g.shape != p.shape or g.device != p.device:
        raise ValueError(f"{_WHERE}: expected g to be a float16 or {p.dtype} tensor of p's shape "
                         f"{tuple(p.shape)} on {p.device}, got a {g.dtype} tensor of shape "
                         f"{tuple(g.shape)} on {g.device}")
    if p_copy.numel() and (p_copy.numel() != p.numel() or p_copy.device != p.device
                           or not p_copy.dtype.is_floating_point):
        raise ValueError(f"{_WHERE}: expected p_copy to be empty (no copy) or a float tensor of "
                         f"{p.numel()} elements on {p.device}, got a {p_copy.dtype} tensor of "
                         f"{p_copy.numel()} on {p_copy.device}")


def adam(p: Tensor, p_copy: Tensor, m: Tensor, v: Tensor, g: Tensor, lr: float, beta1: float,
         beta2: float, eps: float, grad_scale: float, step: int, mode: int,
         bias_correction: int, decay: float) -> None:
    """One Adam step of ``p`` (float32 or float64) and its moments ``m`` and ``v`` (of
    ``p``'s dtype) in place from the gradient ``g`` (float16, or ``p``'s dtype) divided by
    ``grad_scale``; ``p_copy``, unless empty, receives the new ``p`` cast to its dtype
    (Apex wrote it for float16 gradients only: the fp16 model copy of fp32 masters).
    ``mode`` 0 adds ``eps`` under the square root, 1 after it; ``bias_correction`` 1
    folds Adam's bias corrections into the step size; ``decay`` is added to the update as
    ``decay * p``. Apex's argument order."""
    _check(p, p_copy, m, v, g)
    lr, beta1, beta2, eps = (_number(n, x) for n, x in (
        ("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps)))
    grad_scale, decay = _number("grad_scale", grad_scale), _number("decay", decay)
    step = _number("step", step, integral=True)
    if _number("mode", mode, integral=True) not in (0, 1):
        raise ValueError(f"{_WHERE}: expected mode to be 0 (eps inside the square root) or 1, "
                         f"got {mode}")
    if _number("bias_correction", bias_correction, integral=True) not in (0, 1):
        raise ValueError(f"{_WHERE}: expected bias_correction to be 0 or 1, got "
                         f"{bias_correction}")
    if grad_scale == 0:
        raise ValueError(f"{_WHERE}: expected grad_scale to be nonzero")
    if bias_correction == 1 and step < 1:
        raise ValueError(f"{_WHERE}: expected step >= 1 with bias_correction, got {step}")
    f32 = np.float32  # (Apex: float constants; the powers taken in double)
    b1, b2 = f32(beta1), f32(beta2)
    if bias_correction == 1:
        bc1, bc2 = f32(1 - float(b1) ** step), f32(1 - float(b2) ** step)
        step_size = f32(f32(lr) * np.sqrt(bc2)) / bc1
    else:
        step_size = f32(lr)
    b1, b2, w1, w2, eps, scale, decay, step_size = (float(x) for x in (
        b1, b2, f32(1) - b1, f32(1) - b2, f32(eps), f32(grad_scale), f32(decay), step_size))
    with torch.no_grad():
        grad = g.to(p.dtype) / scale
        m.mul_(b1).add_(grad, alpha=w1)
        v.mul_(b2).add_(grad * grad, alpha=w2)
        denom = (v + eps).sqrt_() if mode == 0 else v.sqrt().add_(eps)
        update = (m / denom).add_(p, alpha=decay)
        p.sub_(update, alpha=step_size)
        if p_copy.numel():
            p_copy.copy_(p.reshape(p_copy.shape))
