"""Drop-in replacement for ``apex.fp16_utils`` (deleted from Apex in May 2025).

Legacy scripts that did ``from apex.fp16_utils import FP16_Optimizer, network_to_half``
run unmodified with ``from mixedprec.fp16_utils import ...``. Names, signatures and
defaults follow Apex; the per-step work is done by the fused operators of
:mod:`mixedprec.ops`, and with dynamic loss scaling nothing in ``backward``,
``update_master_grads`` or ``step`` reads a device value on the host: the overflow flag
(``found_inf``) and the loss scale are one-element float32 tensors on the device, and
an overflowed step is skipped on the device.

What differs from Apex, in general (each name documents its own differences):

* CPU and CUDA tensors are accepted (Apex required CUDA), and bfloat16 wherever Apex
  took float16 (``dtype=`` arguments, bf16 model parameters).
* Reading :attr:`FP16_Optimizer.overflow` or a ``loss_scale`` synchronises; the
  messages Apex printed on every overflow are not printed, since printing them
  needs that read.
* ``state_dict()`` holds only tensors, numbers, strings, lists and dicts, so it loads
  with ``torch.load(..., weights_only=True)``; Apex pickled its scaler object.
"""

import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import ops

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Device types on which torch's optimizers accept capturable=True (step on the device).
_CAPTURABLE_DEVICE_TYPES = ("cuda", "xpu", "hpu")
# State keys of torch.optim optimizers that always have the shape of their parameter.
_PARAM_SHAPED_STATE = frozenset({
    "momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg",
    "acc_delta", "grad_avg", "exp_inf", "ax", "prev", "step_size", "mu_product_buffer",
})


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------

def _check_dtype(dtype: torch.dtype, name: str = "dtype") -> torch.dtype:
    if dtype not in _HALF_DTYPES:
        raise TypeError(f"{name} must be torch.float16 or torch.bfloat16, got {dtype}")
    return dtype


def _same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether the multi-tensor ops can pair ``a`` with ``b`` element for element."""
    if not (ops.is_dense(a) and ops.is_dense(b)) or a.numel() != b.numel():
        return False
    return (a.is_contiguous() and b.is_contiguous()) or (
        a.shape == b.shape and a.stride() == b.stride()
    )


def _copy_pairs(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` with a cast: one ``multi_tensor_copy_`` per device for the
    pairs the op takes (float dtypes, same device and layout), ``copy_`` for the rest."""
    fast: Dict[torch.device, Tuple[List[Tensor], List[Tensor]]] = {}
    slow = []
    for s, d in zip(src, dst):
        if (s.device == d.device and s.dtype in _FLOAT_DTYPES and d.dtype in _FLOAT_DTYPES
                and _same_layout(s, d)):
            pair = fast.setdefault(d.device, ([], []))
            pair[0].append(s)
            pair[1].append(d)
        else:
            slow.append((s, d))
    with torch.no_grad():
        for s_list, d_list in fast.values():
            ops.multi_tensor_copy_(s_list, d_list)
        for s, d in slow:
            d.copy_(s.reshape(d.shape))


def _reject_sparse(grads: Iterable[Tuple[str, Optional[Tensor]]], where: str) -> None:
    for name, g in grads:
        if g is not None and g.layout != torch.strided:
            raise TypeError(
                f"{where}: {name} has a sparse gradient (layout {g.layout}); mixed-precision "
                "master weights need dense gradients (e.g. nn.Embedding(sparse=False))"
            )


def _positive_finite(name: str, value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def _host_equal(a: Any, b: Any) -> bool:
    """Equality of host values that never reads a tensor (tensors compare by identity)."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _host_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_host_equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (bool, int, float, complex, str, bytes, type(None))):
        return a == b
    return False


def _host_copy(value: Any) -> Any:
    """A copy of a host value deep enough for :func:`_host_equal` to see in-place edits of
    containers; tensors are kept as references."""
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_host_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------
# Network conversion (apex/fp16_utils/fp16util.py)
# ---------------------------------------------------------------------------------------

class tofp16(nn.Module):  # Apex's name
    """Module whose forward casts its input to half precision.

    Differs from Apex: ``dtype`` (default ``torch.float16``, or ``torch.bfloat16``) picks
    the precision, and a non-floating-point input (e.g. token ids) passes through
    unchanged instead of being cast."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        super().__init__()
        self.dtype = _check_dtype(dtype)

    def forward(self, input: Tensor) -> Tensor:
        """``input`` cast to ``self.dtype`` when it is floating point."""
        return input.to(self.dtype) if input.is_floating_point() else input

    def extra_repr(self) -> str:
        """Shows the target dtype in the module's repr."""
        return f"dtype={self.dtype}"


def BN_convert_float(module: nn.Module) -> nn.Module:  # Apex's name
    """Converts every affine BatchNorm layer of ``module`` (recursively) back to float32,
    in place, and returns ``module``. Used by :func:`network_to_half` after the whole
    network was cast to half. As in Apex's last version, BatchNorm without ``affine``
    is left in half precision."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Sequential:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))``: the network in half
    precision except affine BatchNorm layers (float32), preceded by a module that casts
    the input. ``network`` itself is converted in place.

    Differs from Apex: ``dtype=torch.bfloat16`` converts to bfloat16 instead."""
    _check_dtype(dtype)
    return nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts the floating-point parameters, their gradients and the floating-point
    buffers held directly by ``module`` (not its children) to ``dtype``, in place (the
    ``Parameter`` objects are kept). Any floating-point ``dtype`` is accepted."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
        if param.grad is not None and param.grad.is_floating_point():
            param.grad.data = param.grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Casts the parameters and buffers of every module of ``network`` to ``dtype`` with
    :func:`convert_module`, except affine BatchNorm layers, which stay as they are
    (normally float32); re-flattens RNN weights. Returns ``network`` (converted in
    place)."""
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """Wraps ``network`` converted with ``convert_network(network, dtype)`` (BatchNorm
    kept in float32) and casts the inputs of ``forward`` to ``dtype``.

    Differs from Apex: ``dtype`` may be ``torch.bfloat16``; only floating-point tensor
    inputs are cast (Apex called ``.half()`` on every input, which broke integer
    inputs); keyword arguments are passed through, their floating-point tensors cast
    too."""

    def __init__(self, network: nn.Module, dtype: torch.dtype = torch.float16):
        super().__init__()
        self.dtype = _check_dtype(dtype)
        self.network = convert_network(network, dtype=dtype)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        return value

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the network on the inputs, floating-point tensors cast to ``dtype``."""
        inputs = tuple(self._cast(t) for t in inputs)
        kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        return self.network(*inputs, **kwargs)


# ---------------------------------------------------------------------------------------
# Manual master-weight helpers
# ---------------------------------------------------------------------------------------

def prep_param_lists(model: nn.Module,
                     flat_master: bool = False) -> Tuple[List[Tensor], List[Tensor]]:
    """Returns ``(model_params, master_params)``: the parameters of ``model`` that require
    grad, and float32 copies of them that require grad (the master weights).

    With ``flat_master=True`` the masters are one flat float32 ``nn.Parameter`` (a list
    of one) whose ``.grad`` is allocated (zeros), to be used with ``flat_master=True``
    in :func:`model_grads_to_master_grads` and :func:`master_params_to_model_params`.

    Differs from Apex: with ``flat_master=True`` the model may mix dtypes (Apex required
    one dtype), and the flat gradient starts as zeros rather than uninitialised."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        with torch.no_grad():
            if model_params:
                flat = torch.cat([p.detach().reshape(-1).float() for p in model_params])
            else:
                flat = torch.zeros(0)
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    master_params = [p.detach().clone().float().requires_grad_(True) for p in model_params]
    return model_params, master_params


def _flat_views(flat: Tensor, model_params: Sequence[Tensor], name: str) -> List[Tensor]:
    total = sum(p.numel() for p in model_params)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(
            f"{name}: the flat master has {flat.numel()} elements (shape {tuple(flat.shape)}), "
            f"the model parameters have {total}"
        )
    views = flat.split([p.numel() for p in model_params])
    return [v.view(p.shape) for v, p in zip(views, model_params)]


def _check_master_lists(model_params, master_params, flat_master, name):
    if flat_master:
        if len(master_params) != 1:
            raise ValueError(
                f"{name}: flat_master=True expects a list of one flat master, got "
                f"{len(master_params)} tensors"
            )
    elif len(model_params) != len(master_params):
        raise ValueError(
            f"{name}: got {len(model_params)} model parameters and {len(master_params)} "
            "master parameters"
        )


def model_grads_to_master_grads(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                flat_master: bool = False) -> None:
    """Copies (with a cast to float32) the gradients of ``model_params`` into the ``.grad``
    of ``master_params`` (as made by :func:`prep_param_lists`), in one
    ``multi_tensor_copy_`` per device. A model parameter without gradient leaves its
    master with ``.grad = None`` (with ``flat_master``: zeros in its slice, where Apex
    failed). No unscaling is done. Sparse gradients raise ``TypeError`` before anything
    is written; mismatched lists raise ``ValueError``."""
    name = "model_grads_to_master_grads"
    model_params, master_params = list(model_params), list(master_params)
    _check_master_lists(model_params, master_params, flat_master, name)
    _reject_sparse(((f"model_params[{i}]", p.grad) for i, p in enumerate(model_params)), name)
    if flat_master:
        master = master_params[0]
        _flat_views(master.detach(), model_params, name)  # checks the size first
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        grad_views = _flat_views(master.grad, model_params, name)
        src, dst = [], []
        for p, g in zip(model_params, grad_views):
            if p.grad is None:
                g.zero_()
            else:
                src.append(p.grad)
                dst.append(g)
        _copy_pairs(src, dst)
        return
    for model, master in zip(model_params, master_params):
        if model.shape != master.shape:
            raise ValueError(
                f"{name}: a model parameter of shape {tuple(model.shape)} is paired with a "
                f"master of shape {tuple(master.shape)}"
            )
    src, dst = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        src.append(model.grad)
        dst.append(master.grad)
    _copy_pairs(src, dst)


def master_params_to_model_params(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                  flat_master: bool = False) -> None:
    """Copies ``master_params`` into ``model_params`` (with a cast to the model dtype), in
    one ``multi_tensor_copy_`` per device. With ``flat_master`` the single flat master
    is split into the shapes of the model parameters."""
    name = "master_params_to_model_params"
    model_params, master_params = list(model_params), list(master_params)
    _check_master_lists(model_params, master_params, flat_master, name)
    if flat_master:
        masters = _flat_views(master_params[0].detach(), model_params, name)
    else:
        masters = [m.detach() for m in master_params]
        for model, master in zip(model_params, masters):
            if model.shape != master.shape:
                raise ValueError(
                    f"{name}: a model parameter of shape {tuple(model.shape)} is paired "
                    f"with a master of shape {tuple(master.shape)}"
                )
    _copy_pairs(masters, [p.detach() for p in model_params])


def to_python_float(t: Any) -> float:
    """The value of a one-element tensor (or NumPy scalar) as a Python number, via
    ``.item()``; Python numbers are returned as floats (Apex failed on them), other
    sequences give ``t[0]`` as in Apex. Reading a device tensor synchronises."""
    if hasattr(t, "item"):
        return t.item()  # sync-ok: Apex API, a host read by definition
    if isinstance(t, (int, float)):
        return float(t)
    return t[0]


def clip_grad_norm(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.clip_grad_norm_`` under its Apex name (Apex aliased the same
    function); see :meth:`FP16_Optimizer.clip_master_grads` for the fused version."""
    return torch.nn.utils.clip_grad_norm_(
        parameters, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)


# ---------------------------------------------------------------------------------------
# Loss scalers (apex/fp16_utils/loss_scaler.py)
# ---------------------------------------------------------------------------------------

def _grads_have_inf_or_nan(params: Iterable[Tensor]) -> bool:
    """Whether any gradient of ``params`` holds inf or NaN: one ``multi_tensor_check_finite_``
    per device for the tensors it takes, ``torch.isfinite`` for the others; one host
    read per device."""
    flags: Dict[torch.device, Tensor] = {}
    fast: Dict[torch.device, List[Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        flag = flags.setdefault(g.device, torch.zeros(1, dtype=torch.float32, device=g.device))
        if g.layout == torch.strided and g.dtype in _FLOAT_DTYPES and ops.is_dense(g):
            fast.setdefault(g.device, []).append(g)
        else:
            values = g.coalesce().values() if g.layout == torch.sparse_coo else g
            bad = (~torch.isfinite(values)).any().to(torch.float32)
            torch.maximum(flag, bad.reshape(1), out=flag)
    for device, grads in fast.items():
        ops.multi_tensor_check_finite_(grads, flags[device])
    # sync-ok: Apex's has_overflow API returns a Python bool
    return any(bool(flag.item()) for flag in flags.values())  # sync-ok: see above


class LossScaler:
    """A static loss scale, kept as a one-element float32 tensor.

    Used by :class:`FP16_Optimizer` when ``dynamic_loss_scale=False``; usable on its own
    as in Apex: ``scaler.backward(loss)`` back-propagates ``loss * loss_scale``,
    ``has_overflow`` is always ``False`` and ``update_scale`` does nothing.

    Differs from Apex: :attr:`loss_scale` is a Python float read from the device
    tensor (Apex kept a Python number), ``backward`` casts the loss to float32 before
    scaling, and ``state_dict``/``load_state_dict`` exist.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0, *, device: Optional[torch.device] = None):
        scale = _positive_finite("scale", scale)
        self._scale = torch.full((1,), scale, dtype=torch.float32, device=device)

    # -- device state ------------------------------------------------------------------
    def _tensor_names(self) -> Tuple[str, ...]:
        return ("_scale",)

    def _place(self, device: torch.device) -> None:
        """Moves the scaler's tensors to ``device`` (no host read)."""
        device = torch.device(device)
        for name in self._tensor_names():
            t = getattr(self, name)
            if t.device != device:
                setattr(self, name, t.to(device))

    @property
    def device(self) -> torch.device:
        """The device holding the scale."""
        return self._scale.device

    def _update(self, found_inf: Tensor) -> None:
        """Updates the scale on the device from the overflow flag (static: nothing)."""

    # -- Apex API ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current scale (reads the device tensor)."""
        return self._scale.item()  # sync-ok: reading the scale is the caller's choice

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if isinstance(value, Tensor):
            self._scale.copy_(value.reshape(1))
        else:
            self._scale.fill_(_positive_finite("loss_scale", value))

    cur_scale = loss_scale  # Apex's attribute name

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """Always ``False`` for a static scale (as in Apex)."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return False

    def update_scale(self, overflow: Any) -> None:
        """Nothing to do for a static scale."""

    def scale_gradient(self, module: nn.Module, grad_in, grad_out):
        """Backward-hook helper: ``grad_in`` multiplied by the loss scale."""
        return tuple(None if g is None else g * self._scale.to(g.device).to(g.dtype)
                     for g in grad_in)

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """Back-propagates ``loss.float() * loss_scale`` (multiplied on the device)."""
        if self._scale.device != loss.device:
            self._place(loss.device)
        scaled_loss = loss.float() * self._scale.reshape(())
        scaled_loss.backward(retain_graph=retain_graph)

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The scaler as tensors (copies) and numbers, loadable with ``weights_only``."""
        return {"dynamic": False, "loss_scale": self._scale.detach().clone()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads :meth:`state_dict`; ``ValueError`` (nothing changed) when it does not
        describe a scaler of the same kind."""
        loaded = _scaler_from_state_dict(state_dict, self._scale.device, "state_dict")
        if loaded.dynamic != self.dynamic:
            raise ValueError(
                f"state_dict describes a {'dynamic' if loaded.dynamic else 'static'} loss "
                f"scaler, this one is {'dynamic' if self.dynamic else 'static'}"
            )
        self.__dict__.update(loaded.__dict__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"


class DynamicLossScaler(LossScaler):
    """A dynamic loss scale, updated on the device by ``update_loss_scale_``.

    Apex's rule: on an overflow the scale is divided by ``scale_factor`` (not below
    ``min_loss_scale``, 1 in Apex) and the step is skipped; after ``scale_window``
    consecutive steps without overflow it is multiplied by ``scale_factor``.

    Args:
        init_scale: the first scale (Apex's default 2**32).
        scale_factor: the growth factor; the back-off factor is its inverse.
        scale_window: overflow-free steps before the scale grows.
        min_loss_scale, max_loss_scale: keyword-only bounds (defaults 1 and no
            ceiling); ``None`` means no bound. These are the names the last Apex
            ``FP16_Optimizer`` accepted in ``dynamic_loss_args``.

    Differs from Apex: the scale, the count of good steps and the overflow flag live in
    one-element device tensors, so :meth:`update_scale` also accepts the overflow as a
    device tensor (no host read); the scale is float32 (with a ``scale_factor`` that is
    not a power of two the values can differ from Apex's float64 in the last bits), and
    a growth that would overflow float32 is not taken. :meth:`has_overflow` returns a
    Python bool as in Apex, which reads the device.
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0,
                 scale_window: int = 1000, *, min_loss_scale: Optional[float] = 1.0,
                 max_loss_scale: Optional[float] = None,
                 device: Optional[torch.device] = None):
        super().__init__(_positive_finite("init_scale", init_scale), device=device)
        scale_factor = _positive_finite("scale_factor", scale_factor)
        if scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be greater than 1, got {scale_factor}")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"scale_window must be a positive integer, got {scale_window!r}")
        min_loss_scale = 0.0 if min_loss_scale is None else float(min_loss_scale)
        max_loss_scale = math.inf if max_loss_scale is None else float(max_loss_scale)
        if not (0.0 <= min_loss_scale <= max_loss_scale) or math.isnan(max_loss_scale):
            raise ValueError(
                f"expected 0 <= min_loss_scale <= max_loss_scale, got {min_loss_scale} and "
                f"{max_loss_scale}"
            )
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        dev = self._scale.device
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.ones(1, dtype=torch.int32, device=dev)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=dev)

    def _tensor_names(self) -> Tuple[str, ...]:
        return ("_scale", "_growth_tracker", "_hysteresis_tracker", "_found_inf")

    def _update(self, found_inf: Tensor) -> None:
        if found_inf.device != self._scale.device:
            self._place(found_inf.device)
        ops.update_loss_scale_(
            self._scale, self._growth_tracker, self._hysteresis_tracker, found_inf,
            growth_factor=self.scale_factor, backoff_factor=1.0 / self.scale_factor,
            growth_interval=self.scale_window, hysteresis=1,
            min_scale=self.min_loss_scale, max_scale=self.max_loss_scale,
        )

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """Whether any ``p.grad`` of ``params`` holds inf or NaN (fused check per device;
        returns a Python bool, so it reads the device)."""
        return _grads_have_inf_or_nan(params)

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return bool((~torch.isfinite(x)).any().item())  # sync-ok: Apex API returns a Python bool

    def update_scale(self, overflow: Any) -> None:
        """Applies one step of the rule. ``overflow`` is a bool or a device tensor (any
        nonzero value means overflow); a tensor is used without a host read."""
        if isinstance(overflow, Tensor):
            if overflow.device != self._scale.device:
                self._place(overflow.device)
            self._found_inf.copy_(overflow.detach().reshape(1))
        else:
            self._found_inf.fill_(1.0 if overflow else 0.0)
        self._update(self._found_inf)

    def state_dict(self) -> Dict[str, Any]:
        """Scale, trackers (copies) and settings, loadable with ``weights_only``."""
        return {
            "dynamic": True,
            "loss_scale": self._scale.detach().clone(),
            "growth_tracker": self._growth_tracker.clone(),
            "hysteresis_tracker": self._hysteresis_tracker.clone(),
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
        }


def _scaler_from_state_dict(sd: Any, device: torch.device, where: str) -> LossScaler:
    """A new scaler built from a scaler ``state_dict``; ``ValueError`` naming what is
    wrong, before anything is changed."""
    if not isinstance(sd, dict) or "dynamic" not in sd or "loss_scale" not in sd:
        raise ValueError(f"{where} must be a loss-scaler state_dict with 'dynamic' and "
                         f"'loss_scale', got {type(sd).__name__}")
    tensor_specs = {"loss_scale": torch.float32}
    if sd["dynamic"]:
        tensor_specs.update(growth_tracker=torch.int32, hysteresis_tracker=torch.int32)
        for key in ("scale_factor", "scale_window", "min_loss_scale", "max_loss_scale"):
            if key not in sd:
                raise ValueError(f"{where} is missing '{key}'")
    for key, dtype in tensor_specs.items():
        t = sd.get(key)
        if not isinstance(t, Tensor):
            raise ValueError(f"{where}['{key}'] must be a tensor, got {type(t).__name__}")
        if t.numel() != 1 or t.dtype != dtype:
            raise ValueError(
                f"{where}['{key}'] must be one {dtype} element, got dtype {t.dtype} and shape "
                f"{tuple(t.shape)}"
            )
    if sd["dynamic"]:
        scaler: LossScaler = DynamicLossScaler(
            1.0, sd["scale_factor"], sd["scale_window"], min_loss_scale=sd["min_loss_scale"],
            max_loss_scale=sd["max_loss_scale"], device=device)
        scaler._growth_tracker.copy_(sd["growth_tracker"].reshape(1))
        scaler._hysteresis_tracker.copy_(sd["hysteresis_tracker"].reshape(1))
    else:
        scaler = LossScaler(1.0, device=device)
    scaler._scale.copy_(sd["loss_scale"].reshape(1))
    return scaler


# ---------------------------------------------------------------------------------------
# FP16_Optimizer (apex/fp16_utils/fp16_optimizer.py)
# ---------------------------------------------------------------------------------------

class FP16_Optimizer:  # Apex's name
    """Wraps a torch optimizer to train a float16/bfloat16 model with float32 master
    weights and static or dynamic loss scaling.

    The half-precision parameters of ``init_optimizer`` are replaced, in its
    ``param_groups``, by float32 masters (its existing state moves to them and is cast);
    float32 parameters are used as they are. Each iteration::

        optimizer.zero_grad()
        loss = loss_fn(model(input), target)
        optimizer.backward(loss)        # instead of loss.backward()
        optimizer.step()                # updates masters, copies them into the model

    Args:
        init_optimizer: a ``torch.optim.Optimizer`` built on the model's parameters
            (float16, bfloat16 or float32; CPU or CUDA); it is modified and kept as
            ``self.optimizer``.
        static_loss_scale: the loss scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: use a :class:`DynamicLossScaler`.
        dynamic_loss_args: keyword arguments of :class:`DynamicLossScaler`.
        verbose: print the parameters found at construction, as Apex did.

    The fused data path: :meth:`update_master_grads` unscales and casts all half
    gradients into the float32 master gradients and checks them for inf/NaN in one
    ``multi_tensor_unscale_to_`` per device (float32 parameters: one
    ``multi_tensor_unscale_`` in place); with dynamic scaling the loss scale is then
    updated on the device. :meth:`step` copies the masters into the model with one
    ``multi_tensor_copy_`` per device.

    How an overflowed step is skipped without reading the flag on the host
    (dynamic scaling only; a static scale never skips, as in Apex):

    * When the wrapped optimizer declares ``_step_supports_amp_scaling`` (torch's
      ``fused=True`` SGD/Adam/AdamW/Adagrad, mixedprec's fused optimizers), the flag is
      handed to it as ``optimizer.found_inf`` (with ``optimizer.grad_scale = None``:
      the gradients are already unscaled) for the duration of ``step``, as
      ``torch.amp.GradScaler`` does, and its kernel writes nothing on overflow. No
      copies are made.
    * Otherwise the parameters that have a gradient (torch's optimizers touch no
      other) and the tensors of their optimizer state are cloned before the inner
      ``step`` and, after it, put back with ``torch.where(found_inf, before, after)``
      on the device: a skipped step leaves masters, model and state bit-identical at
      the cost of one copy of the parameters and state per step. So that the step
      counters of torch optimizers live on the device too, groups with a
      ``capturable`` option on CUDA get ``capturable=True``. State kept outside
      ``optimizer.state`` and ``param_groups`` (attributes of the optimizer) is not
      restored.
    * What only the host can undo (the step created optimizer state, as the first step
      does, changed a Python number in the state or a group, or left state on another
      device such as the CPU) is decided by reading the flag once in that step; on
      overflow the created state is removed and the rest restored.

    Differs from Apex: CPU and bfloat16 are supported; the defaults of the dynamic
    scaler are those of :class:`DynamicLossScaler` (Apex's last version used amp's
    2**16 and 2000); ``step`` on overflow does not print; ``clip_master_grads`` returns
    a tensor; ``step(closure)`` with dynamic scaling re-runs the closure while the
    gradients overflow (reading the flag, as Apex did) and raises ``RuntimeError`` if
    they still overflow at the minimum scale instead of looping forever;
    :meth:`load_state_dict` validates the checkpoint and copies the masters into the
    model.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[dict] = None,
                 verbose: bool = True):
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "FP16_Optimizer: init_optimizer must be a torch.optim.Optimizer, got "
                f"{type(init_optimizer).__name__}"
            )
        if dynamic_loss_args is not None and not isinstance(dynamic_loss_args, dict):
            raise TypeError(
                f"FP16_Optimizer: dynamic_loss_args must be a dict, got "
                f"{type(dynamic_loss_args).__name__}"
            )
        # Validate everything before the optimizer is touched.
        for gi, group in enumerate(init_optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.layout != torch.strided:
                    raise TypeError(
                        f"FP16_Optimizer: param_groups[{gi}]['params'][{pi}] is a sparse "
                        f"tensor (layout {param.layout}); expected dense parameters"
                    )
                if param.dtype not in _FLOAT_DTYPES:
                    raise TypeError(
                        f"FP16_Optimizer: param_groups[{gi}]['params'][{pi}] has dtype "
                        f"{param.dtype}; expected torch.float16, torch.bfloat16 or torch.float32"
                    )
        if dynamic_loss_scale:
            loss_scaler: LossScaler = DynamicLossScaler(**(dynamic_loss_args or {}))
        else:
            loss_scaler = LossScaler(static_loss_scale)

        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: List[List[Tensor]] = []
        self.fp32_from_fp16_groups: List[List[Tensor]] = []
        self.fp32_from_fp32_groups: List[List[Tensor]] = []
        state = self.optimizer.state
        moved_state = False
        for gi, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {gi}:")
            fp16_params, fp32_from_fp16, fp32_params = [], [], []
            for pi, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                self.maybe_print(f"FP16_Optimizer received {param.dtype} parameter of size "
                                 f"{tuple(param.shape)} on {param.device}")
                if param.dtype in _HALF_DTYPES:
                    master = param.detach().clone().float().requires_grad_(True)
                    group["params"][pi] = master
                    if param in state:
                        state[master] = state.pop(param)
                        moved_state = True
                    fp16_params.append(param)
                    fp32_from_fp16.append(master)
                else:
                    fp32_params.append(param)
            self.fp16_groups.append(fp16_params)
            self.fp32_from_fp16_groups.append(fp32_from_fp16)
            self.fp32_from_fp32_groups.append(fp32_params)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        if moved_state:
            # The optimizer casts floating-point state to the (now float32) params.
            self.optimizer.load_state_dict(self.optimizer.state_dict())

        devices = [p.device for p in self.all_fp16_params + self.all_fp32_from_fp32_params]
        self._device = devices[0] if devices else torch.device("cpu")
        self._devices = list(dict.fromkeys(devices))
        loss_scaler._place(self._device)
        self.loss_scaler = loss_scaler
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=self._device)
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        self._warned_host_state = False
        self._prepare_inner_for_skipping()

    def maybe_print(self, msg: str) -> None:
        """Prints ``msg`` when ``verbose``."""
        if self.verbose:
            print(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic_loss_scale else "static"
        return f"FP16_Optimizer({kind} loss scale, {self.optimizer!r})"

    # -- internals ---------------------------------------------------------------------
    @property
    def _uses_found_inf(self) -> bool:
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def _prepare_inner_for_skipping(self) -> None:
        """With dynamic scaling and a non-fused optimizer, keeps torch's step counters on
        the device (capturable=True), so that a skip restores them without a host read."""
        if not self.dynamic_loss_scale or self._uses_found_inf:
            return
        changed = False
        for group in self.optimizer.param_groups:
            if group.get("capturable", True) or group.get("fused"):
                continue  # no such option, already on, or fused
            if group["params"] and all(p.device.type in _CAPTURABLE_DEVICE_TYPES
                                       for p in group["params"]):
                group["capturable"] = True
                changed = True
        if changed:
            # A deliberate choice: silence torch's advice to turn capturable off.
            self.optimizer._warned_capturable_if_run_uncaptured = True
            if len(self.optimizer.state) > 0:
                self.optimizer.load_state_dict(self.optimizer.state_dict())  # moves "step"

    def _managed(self):
        """(model params, master params) per device, fp16/bf16 ones and fp32 ones."""
        halves: Dict[torch.device, Tuple[List[Tensor], List[Tensor]]] = {}
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            pair = halves.setdefault(model.device, ([], []))
            pair[0].append(model)
            pair[1].append(master)
        fulls: Dict[torch.device, List[Tensor]] = {}
        for p in self.all_fp32_from_fp32_params:
            fulls.setdefault(p.device, []).append(p)
        return halves, fulls

    def _master_params_to_model_params(self) -> None:
        _copy_pairs([m.detach() for m in self.all_fp32_from_fp16_params],
                    [p.detach() for p in self.all_fp16_params])

    def _flag_on(self, device: torch.device, cache: Dict[torch.device, Tensor]) -> Optional[Tensor]:
        """The overflow flag as a 0-dim bool on ``device``; None when getting it there
        would read the device on the host (a CUDA flag to the CPU)."""
        if device in cache:
            return cache[device]
        if device.type == "cpu" and self._device.type != "cpu":
            return None
        flag = cache[self._device].to(device, non_blocking=True)
        cache[device] = flag
        return flag

    # -- Apex API ----------------------------------------------------------------------
    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # Apex's name
        """Zeroes (or, with ``set_grads_to_None``, drops) the gradients of the masters,
        of the float32 parameters and of the model's half parameters. Apex's default
        ``set_grads_to_None=False`` is kept (torch's own default is the opposite)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        params += self.all_fp16_params
        if set_grads_to_None:
            for p in params:
                p.grad = None
            return
        grads = []
        for p in params:
            if p.grad is not None:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)

    def backward(self, loss: Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """Back-propagates ``loss.float() * loss_scale`` (the scale multiplies on the
        device), then, unless ``update_master_grads=False`` (to accumulate several
        losses first), calls :meth:`update_master_grads`. The model's own ``.grad``
        stay scaled; read master gradients with :meth:`inspect_master_grad_data`."""
        scale = self.loss_scaler._scale
        if scale.device != loss.device:
            scale = scale.to(loss.device)
        scaled_loss = loss.float() * scale.reshape(())
        scaled_loss.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscales the model's gradients into the float32 master gradients and sets the
        overflow flag, in one ``multi_tensor_unscale_to_`` per device (float32
        parameters are unscaled in place by one ``multi_tensor_unscale_``); with
        dynamic scaling, then updates the loss scale on the device. A model parameter
        without gradient gets a master with ``.grad = None``. Sparse gradients raise
        ``TypeError`` before anything is written. No host read."""
        named = [(f"a float16/bfloat16 parameter of shape {tuple(p.shape)}", p.grad)
                 for p in self.all_fp16_params]
        named += [(f"a float32 parameter of shape {tuple(p.shape)}", p.grad)
                  for p in self.all_fp32_from_fp32_params]
        _reject_sparse(named, "FP16_Optimizer.update_master_grads")

        halves, fulls = self._managed()
        scale = self.loss_scaler._scale
        inv_scale = torch.reciprocal(scale)
        found_inf = self._found_inf
        found_inf.zero_()
        inv_by_device = {self._device: inv_scale}
        flag_by_device = {self._device: found_inf}
        for device in self._devices:
            if device not in inv_by_device:
                inv_by_device[device] = inv_scale.to(device, non_blocking=True)
                flag_by_device[device] = torch.zeros(1, dtype=torch.float32, device=device)

        with torch.no_grad():
            for device, (models, masters) in halves.items():
                src, dst = [], []
                for model, master in zip(models, masters):
                    grad = model.grad
                    if grad is None:
                        master.grad = None
                        continue
                    if not ops.is_dense(grad):
                        grad = grad.contiguous()
                    if master.grad is None or not _same_layout(grad, master.grad):
                        master.grad = torch.empty_like(grad, dtype=torch.float32)
                    src.append(grad)
                    dst.append(master.grad)
                if src:
                    ops.multi_tensor_unscale_to_(src, dst, flag_by_device[device],
                                                 inv_by_device[device])
            for device, params in fulls.items():
                grads = []
                for p in params:
                    if p.grad is None:
                        continue
                    if not ops.is_dense(p.grad):
                        p.grad = p.grad.contiguous()
                    grads.append(p.grad)
                if grads:
                    ops.multi_tensor_unscale_(grads, flag_by_device[device], inv_by_device[device])
            for device, flag in flag_by_device.items():
                if device != self._device:
                    torch.maximum(found_inf, flag.to(self._device, non_blocking=True),
                                  out=found_inf)
        if self.dynamic_loss_scale:
            self.loss_scaler._update(found_inf)

    def step(self, closure=None):
        """Runs the wrapped optimizer on the master weights, then copies them into the
        model (one ``multi_tensor_copy_`` per device). With dynamic scaling an overflowed
        step is skipped on the device (see the class docstring) with no host read,
        except in a step that creates optimizer state or otherwise needs the host.

        ``closure``, when given, must call ``self.zero_grad()`` and
        ``self.backward(loss)`` and return the loss; with dynamic scaling it is re-run
        while the gradients overflow (this reads the flag), as in Apex."""
        if closure is not None:
            retval = self._step_with_closure(closure)
        elif self.dynamic_loss_scale:
            retval = self._skippable_step()
        else:
            retval = self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure):
        def wrapped_closure():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The inner optimizer may have moved the masters since the last call.
                self._master_params_to_model_params()
            scale_before = self.loss_scale if self.dynamic_loss_scale else None
            loss = closure()
            while self.dynamic_loss_scale and self.overflow:
                scale_after = self.loss_scale
                if scale_after >= scale_before:
                    raise RuntimeError(
                        "FP16_Optimizer.step(closure): the gradients overflow at the minimum "
                        f"loss scale {scale_after}; the loss is probably not finite"
                    )
                scale_before = scale_after
                loss = closure()
            return loss

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    def _skippable_step(self):
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        fused = self._uses_found_inf
        # Host-side picture of the state (tensors by reference) and of the groups.
        state_before = {}
        for p in params:
            st = opt.state.get(p)
            state_before[id(p)] = None if st is None else {k: _host_copy(v) for k, v in st.items()}
        groups_before = [{k: _host_copy(v) for k, v in g.items() if k != "params"}
                         for g in opt.param_groups]
        # torch optimizers touch only parameters that have a gradient.
        stepped = [] if fused else [p for p in params if p.grad is not None]
        snapshots: Dict[int, Tensor] = {}  # id(tensor) -> its value before the step
        with torch.no_grad():
            for p in stepped:
                snapshots[id(p)] = p.detach().clone()
                for v in (state_before[id(p)] or {}).values():
                    if isinstance(v, Tensor):
                        snapshots[id(v)] = v.detach().clone()

        if fused:
            saved = {k: opt.__dict__[k] for k in ("grad_scale", "found_inf") if k in opt.__dict__}
            opt.grad_scale = None  # the gradients are already unscaled
            opt.found_inf = self._found_inf.view(())
            try:
                retval = opt.step()
            finally:
                for k in ("grad_scale", "found_inf"):
                    opt.__dict__.pop(k, None)
                opt.__dict__.update(saved)
        else:
            retval = opt.step()

        # Pairs (tensor now, value before) the device can restore, and whether the
        # host has to decide something (created state, changed Python values).
        need_host = any(not _host_equal({k: v for k, v in g.items() if k != "params"}, before)
                        for g, before in zip(opt.param_groups, groups_before))
        restores = [(p.detach(), snapshots[id(p)]) for p in stepped]
        for p in params:
            before = state_before[id(p)]
            after = opt.state.get(p)
            if not before and not after:
                continue
            if not before or not after or after.keys() != before.keys():
                need_host = True  # state created or removed
                continue
            for k, v in before.items():
                now = after[k]
                if not isinstance(v, Tensor):
                    need_host = need_host or not _host_equal(now, v)
                elif id(v) not in snapshots:
                    continue  # fused (wrote nothing on overflow) or not stepped
                elif (isinstance(now, Tensor) and now.shape == v.shape
                      and now.dtype == v.dtype and now.device == v.device):
                    restores.append((now.detach(), snapshots[id(v)]))
                else:
                    need_host = True

        flags = {self._device: self._found_inf.view(()) > 0}
        if not need_host and any(self._flag_on(t.device, flags) is None for t, _ in restores):
            need_host = True
            if not self._warned_host_state:
                self._warned_host_state = True
                warnings.warn(
                    "FP16_Optimizer: the wrapped optimizer keeps state on the CPU for "
                    "parameters on another device, so skipping an overflowed step reads "
                    "the overflow flag on the host in every step", stacklevel=3)

        if need_host:
            # Only state the host must undo gets here (warned above).
            if bool(self._found_inf.item()):  # sync-ok: see above
                self._restore_on_host(params, state_before, groups_before, snapshots)
            return retval
        with torch.no_grad():
            for now, before in restores:
                torch.where(self._flag_on(now.device, flags), before, now, out=now)
        return retval

    def _restore_on_host(self, params, state_before, groups_before, snapshots) -> None:
        """Undoes an overflowed inner step once the flag was read on the host."""
        opt = self.optimizer
        for group, before in zip(opt.param_groups, groups_before):
            for k in [k for k in group if k != "params" and k not in before]:
                del group[k]
            group.update(before)
        with torch.no_grad():
            for p in params:
                if id(p) in snapshots:
                    p.detach().copy_(snapshots[id(p)])
                before = state_before[id(p)]
                if before is None:
                    opt.state.pop(p, None)
                    continue
                for v in before.values():
                    if isinstance(v, Tensor) and id(v) in snapshots:
                        v.copy_(snapshots[id(v)])
                opt.state[p] = dict(before)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> Tensor:
        """Clips the float32 master gradients (and those of the float32 parameters) to a
        total norm of ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does, and
        returns the total norm before clipping. For ``norm_type=2`` the norm is one
        ``multi_tensor_l2norm`` per device (float32 accumulation) and the clipping a
        ``_foreach_mul_``; other norms use torch's function. No host read.

        Differs from Apex: returns a 0-dim device tensor, which holds -1 when the last
        gradients overflowed with dynamic scaling (Apex returned the number -1)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]
                  if p.grad is not None]
        if float(norm_type) != 2.0:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
            total = total.to(self._device)
        else:
            by_device: Dict[torch.device, List[Tensor]] = {}
            for p in params:
                by_device.setdefault(p.grad.device, []).append(p.grad)
            norms = [ops.multi_tensor_l2norm(grads)[0].to(self._device).reshape(())
                     for grads in by_device.values()]
            if not norms:
                total = torch.zeros((), dtype=torch.float32, device=self._device)
            elif len(norms) == 1:
                total = norms[0]
            else:
                total = torch.stack(norms).square().sum().sqrt()
            clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            with torch.no_grad():
                for device, grads in by_device.items():
                    torch._foreach_mul_(grads, clip_coef.to(device))
        if self.dynamic_loss_scale:
            total = torch.where(self._found_inf.view(()) > 0, -1.0, total)
        return total

    def inspect_master_grad_data(self) -> Optional[List[List[Optional[Tensor]]]]:
        """The gradients the wrapped optimizer sees (float32, unscaled), one list per
        param group (``None`` for parameters without gradient); ``None`` with a warning
        when the last gradients overflowed. Reads the overflow flag on the host."""
        if self.overflow:
            warnings.warn("FP16_Optimizer.inspect_master_grad_data: the last gradients "
                          "overflowed (they may be inf, NaN or stale); returning None",
                          stacklevel=2)
            return None
        return [[None if p.grad is None else p.grad.detach() for p in g["params"]]
                for g in self.optimizer.param_groups]

    @property
    def overflow(self) -> bool:
        """Whether the last :meth:`update_master_grads` found inf/NaN (always False with a
        static scale, as in Apex). Reads the device flag on the host."""
        if not self.dynamic_loss_scale:
            return False
        return bool(self._found_inf.item())  # sync-ok: reading overflow is the caller's choice

    @overflow.setter
    def overflow(self, value: bool) -> None:
        self._found_inf.fill_(1.0 if value else 0.0)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (reads the device); settable, e.g. to schedule a static
        scale."""
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.loss_scale = value

    @property
    def state(self):
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self):
        """The wrapped optimizer's ``param_groups`` (holding the masters), e.g. to set the
        learning rate."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The state of the wrapper and of the wrapped optimizer, made only of tensors,
        numbers, strings, lists and dicts (loads with ``torch.load(...,
        weights_only=True)``). The masters and the inner state are references, as in
        torch's ``state_dict``; save or clone them before training on. Keys:
        ``loss_scaler`` (:meth:`LossScaler.state_dict`), ``dynamic_loss_scale``,
        ``overflow`` (reads the flag), ``first_closure_call_this_step``,
        ``optimizer_state_dict`` and ``fp32_from_fp16`` (masters per group), as in Apex
        except that Apex pickled its scaler object."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a :meth:`state_dict`: scaler, flags, the wrapped optimizer's state and
        the masters, which are then copied into the model (Apex left the model as it
        was; load the model first either way). Checks first and raises ``ValueError``
        naming what differs (groups, sizes, dtypes, missing keys), changing nothing."""
        self._check_state_dict(state_dict)
        scaler = _scaler_from_state_dict(state_dict["loss_scaler"], self._device,
                                         "state_dict['loss_scaler']")
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups,
                                                  state_dict["fp32_from_fp16"]):
                for current, saved in zip(current_group, saved_group):
                    current.detach().copy_(saved)
        self.loss_scaler = scaler
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = bool(state_dict["overflow"]) and self.dynamic_loss_scale
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])
        self._prepare_inner_for_skipping()
        self._master_params_to_model_params()

    def _check_state_dict(self, sd: Any) -> None:
        where = "FP16_Optimizer.load_state_dict"
        if not isinstance(sd, dict):
            raise ValueError(f"{where}: expected a dict, got {type(sd).__name__}")
        for key in ("loss_scaler", "dynamic_loss_scale", "overflow",
                    "first_closure_call_this_step", "optimizer_state_dict", "fp32_from_fp16"):
            if key not in sd:
                raise ValueError(f"{where}: the state_dict has no '{key}'")
        _scaler_from_state_dict(sd["loss_scaler"], torch.device("cpu"),
                                f"{where}: state_dict['loss_scaler']")
        if bool(sd["dynamic_loss_scale"]) != bool(sd["loss_scaler"]["dynamic"]):
            raise ValueError(f"{where}: 'dynamic_loss_scale' disagrees with 'loss_scaler'")

        masters = sd["fp32_from_fp16"]
        is_list = isinstance(masters, (list, tuple))
        if not is_list or len(masters) != len(self.fp32_from_fp16_groups):
            got = len(masters) if is_list else type(masters).__name__
            raise ValueError(f"{where}: the state_dict has {got} groups of master parameters, "
                             f"this optimizer has {len(self.fp32_from_fp16_groups)}")
        for gi, (current, saved) in enumerate(zip(self.fp32_from_fp16_groups, masters)):
            if len(saved) != len(current):
                raise ValueError(f"{where}: group {gi} has {len(saved)} master parameters in "
                                 f"the state_dict, {len(current)} in this optimizer")
            for i, (c, s) in enumerate(zip(current, saved)):
                if not isinstance(s, Tensor):
                    raise ValueError(f"{where}: master {i} of group {gi} is a "
                                     f"{type(s).__name__}, not a tensor")
                if s.shape != c.shape:
                    raise ValueError(f"{where}: master {i} of group {gi} has size "
                                     f"{tuple(s.shape)} in the state_dict, {tuple(c.shape)} here")
                if s.dtype != c.dtype:
                    raise ValueError(f"{where}: master {i} of group {gi} has dtype {s.dtype} "
                                     f"in the state_dict, {c.dtype} here")

        inner = sd["optimizer_state_dict"]
        if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
            raise ValueError(f"{where}: 'optimizer_state_dict' is not an optimizer state_dict")
        groups = self.optimizer.param_groups
        saved_groups = inner["param_groups"]
        if len(saved_groups) != len(groups):
            raise ValueError(f"{where}: the wrapped optimizer's state_dict has "
                             f"{len(saved_groups)} parameter groups, this one has {len(groups)}")
        params_by_id = {}
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"{where}: parameter group {gi} has {len(sg['params'])} "
                                 f"parameters in the state_dict, {len(g['params'])} here")
            params_by_id.update(zip(sg["params"], g["params"]))
        for pid, saved_state in inner["state"].items():
            if pid not in params_by_id:
                raise ValueError(f"{where}: the wrapped optimizer's state_dict has state for "
                                 f"parameter id {pid!r}, which is in none of its groups")
            p = params_by_id[pid]
            current = self.optimizer.state.get(p, {})
            for key, value in saved_state.items():
                if not isinstance(value, Tensor) or key == "step":
                    continue
                if key in current and isinstance(current[key], Tensor):
                    expected = current[key].shape
                elif key in _PARAM_SHAPED_STATE:
                    expected = p.shape
                else:
                    continue
                if value.shape != expected:
                    raise ValueError(f"{where}: state '{key}' of parameter {pid} has size "
                                     f"{tuple(value.shape)} in the state_dict, expected "
                                     f"{tuple(expected)}")
                if value.is_floating_point() != p.is_floating_point():
                    raise ValueError(f"{where}: state '{key}' of parameter {pid} has dtype "
                                     f"{value.dtype}, its parameter {p.dtype}")
