"""Drop-in replacement for ``apex.fp16_utils`` (deleted from Apex in May 2025).

Legacy scripts that did ``from apex.fp16_utils import FP16_Optimizer, network_to_half``
run unmodified with ``from mixedprec.fp16_utils import ...``. Names, signatures and
defaults follow Apex. The loss scale is :class:`mixedprec.loss_scale.LossScale` (the
scalers here are faces on it) and the master weights go through
:mod:`mixedprec.masters`.

What differs from Apex, in general (each name documents its own differences):

* CPU and CUDA tensors are accepted (Apex required CUDA), and bfloat16 wherever Apex
  took float16 (``dtype=`` arguments, bf16 model parameters).
* With dynamic scaling, ``backward`` and ``update_master_grads`` never read a device
  value on the host; nor does ``step`` when the wrapped optimizer skips an overflowed
  step on the device (it declares ``_step_supports_amp_scaling``: mixedprec's fused
  optimizers, torch's ``fused=True`` ones). With any other optimizer ``step`` reads the
  overflow flag once, as Apex did.
* Reading :attr:`FP16_Optimizer.overflow` or a ``loss_scale`` synchronises; the
  messages Apex printed on every overflow are not printed, since printing them
  needs that read.
* ``state_dict()`` holds only tensors, numbers, strings, lists and dicts, so it loads
  with ``torch.load(..., weights_only=True)``; Apex pickled its scaler object.
"""

import contextlib
import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import ops
from .loss_scale import DEFAULT_MIN_SCALE, LossScale, check_scale
from .masters import HALF_DTYPES, copy_to_model, make_master, unscale_into_masters

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

_FLOAT_DTYPES = (torch.float32, *HALF_DTYPES)
# State keys of torch.optim optimizers that always have the shape of their parameter.
_PARAM_SHAPED_STATE = frozenset({
    "momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg",
    "acc_delta", "grad_avg", "exp_inf", "ax", "prev", "step_size", "mu_product_buffer",
})


def _check_dtype(dtype: torch.dtype, name: str = "dtype") -> torch.dtype:
    if dtype not in HALF_DTYPES:
        raise TypeError(f"{name} must be torch.float16 or torch.bfloat16, got {dtype}")
    return dtype


def _reject_sparse(grads: Iterable[Tuple[str, Optional[Tensor]]], where: str) -> None:
    for name, g in grads:
        if g is not None and g.layout != torch.strided:
            raise TypeError(
                f"{where}: {name} has a sparse gradient (layout {g.layout}); mixed-precision "
                "master weights need dense gradients (e.g. nn.Embedding(sparse=False))"
            )


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
    return model_params, [make_master(p).requires_grad_(True) for p in model_params]


def _pair_up(model_params, master_params, flat_master, name, grads=False):
    """The masters (or their gradients) as tensors paired with ``model_params``: views of
    the one flat master with ``flat_master``; checks the lists first."""
    model_params, master_params = list(model_params), list(master_params)
    if flat_master:
        if len(master_params) != 1:
            raise ValueError(f"{name}: flat_master=True expects a list of one flat master, "
                             f"got {len(master_params)} tensors")
        flat = master_params[0].detach()
        total = sum(p.numel() for p in model_params)
        if flat.dim() != 1 or flat.numel() != total:
            raise ValueError(f"{name}: the flat master has {flat.numel()} elements (shape "
                             f"{tuple(flat.shape)}), the model parameters have {total}")
        if grads:
            if master_params[0].grad is None:
                master_params[0].grad = torch.zeros_like(flat)
            flat = master_params[0].grad
        views = flat.split([p.numel() for p in model_params])
        return model_params, [v.view(p.shape) for v, p in zip(views, model_params)]
    if len(model_params) != len(master_params):
        raise ValueError(f"{name}: got {len(model_params)} model parameters and "
                         f"{len(master_params)} master parameters")
    for model, master in zip(model_params, master_params):
        if model.shape != master.shape:
            raise ValueError(f"{name}: a model parameter of shape {tuple(model.shape)} is "
                             f"paired with a master of shape {tuple(master.shape)}")
    return model_params, master_params


def model_grads_to_master_grads(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                flat_master: bool = False) -> None:
    """Copies (with a cast to float32) the gradients of ``model_params`` into the ``.grad``
    of ``master_params`` (as made by :func:`prep_param_lists`) with
    :func:`mixedprec.masters.copy_to_model`. A model parameter without gradient leaves
    its master with ``.grad = None`` (with ``flat_master``: zeros in its slice, where
    Apex failed). No unscaling is done. Sparse gradients raise ``TypeError`` before
    anything is written; mismatched lists raise ``ValueError``."""
    name = "model_grads_to_master_grads"
    model_params = list(model_params)
    _reject_sparse(((f"model_params[{i}]", p.grad) for i, p in enumerate(model_params)), name)
    model_params, masters = _pair_up(model_params, master_params, flat_master, name, grads=True)
    src, dst = [], []
    for model, master in zip(model_params, masters):
        if model.grad is None:
            if flat_master:
                master.zero_()
            else:
                master.grad = None
            continue
        if not flat_master and master.grad is None:
            master.grad = torch.empty_like(master)
        src.append(model.grad)
        dst.append(master if flat_master else master.grad)
    copy_to_model(src, dst)


def master_params_to_model_params(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                  flat_master: bool = False) -> None:
    """Copies ``master_params`` into ``model_params`` (with a cast to the model dtype) with
    :func:`mixedprec.masters.copy_to_model`. With ``flat_master`` the single flat master
    is split into the shapes of the model parameters."""
    model_params, masters = _pair_up(model_params, master_params, flat_master,
                                     "master_params_to_model_params")
    copy_to_model(masters, model_params)


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
# Loss scalers (apex/fp16_utils/loss_scaler.py): faces on LossScale
# ---------------------------------------------------------------------------------------

# LossScale's setting names -> Apex's (for error messages).
_APEX_NAMES = (("growth_factor", "scale_factor"), ("growth_interval", "scale_window"),
               ("min_scale", "min_loss_scale"), ("max_scale", "max_loss_scale"))


@contextlib.contextmanager
def _apex_names(prefix: str = "", *renames: Tuple[str, str]):
    """Re-raises LossScale's errors with Apex's argument names (and ``prefix``)."""
    try:
        yield
    except (TypeError, ValueError) as error:
        message = str(error)
        for ours, apex in _APEX_NAMES + renames:
            message = message.replace(ours, apex)
        raise type(error)(prefix + message) from None


def _core_settings(**apex: Any) -> Dict[str, Any]:
    """LossScale's settings from Apex's names; checks what LossScale does not (Apex
    divides by ``scale_factor``, so it must be > 1). ``None`` bounds: the default floor
    (:data:`mixedprec.loss_scale.DEFAULT_MIN_SCALE`), no ceiling."""
    out = {}
    if "scale_factor" in apex:
        factor = check_scale("DynamicLossScaler", "scale_factor", apex.pop("scale_factor"))
        if factor <= 1.0:
            raise ValueError(f"DynamicLossScaler: expected scale_factor to be > 1, got {factor}")
        out.update(growth_factor=factor, backoff_factor=1.0 / factor)
    if "scale_window" in apex:
        out["growth_interval"] = apex.pop("scale_window")
    if "min_loss_scale" in apex:
        value = apex.pop("min_loss_scale")
        out["min_scale"] = DEFAULT_MIN_SCALE if value is None else value
    if "max_loss_scale" in apex:
        value = apex.pop("max_loss_scale")
        out["max_scale"] = math.inf if value is None else value
    out.update(apex)  # init_scale
    return out


def _grads_have_inf_or_nan(params: Iterable[Tensor]) -> bool:
    """Whether any gradient of ``params`` holds inf or NaN: one ``multi_tensor_check_finite_``
    per device for the tensors it takes, ``torch.isfinite`` for the others."""
    flags: Dict[torch.device, Tensor] = {}
    fast: Dict[torch.device, List[Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        flag = flags.setdefault(g.device, torch.zeros((), dtype=torch.float32, device=g.device))
        if g.layout == torch.strided and g.dtype in _FLOAT_DTYPES and ops.is_dense(g):
            fast.setdefault(g.device, []).append(g)
        else:
            values = g.coalesce().values() if g.layout == torch.sparse_coo else g
            flag.add_((~torch.isfinite(values)).any())
    for device, grads in fast.items():
        ops.multi_tensor_check_finite_(grads, flags[device])
    # sync-ok: Apex's has_overflow API returns a Python bool (one read per device)
    return any(bool(flag.item()) for flag in flags.values())  # sync-ok: see above


class LossScaler:
    """A static loss scale: a face on :class:`mixedprec.loss_scale.LossScale` (``core``).

    Used by :class:`FP16_Optimizer` when ``dynamic_loss_scale=False``; usable on its own
    as in Apex: ``scaler.backward(loss)`` back-propagates ``loss * loss_scale``,
    ``has_overflow`` is always ``False`` and ``update_scale`` does nothing.

    Differs from Apex: :attr:`loss_scale` is a Python float read from the device
    tensor (Apex kept a Python number), ``backward`` casts the loss to float32 before
    scaling, and ``state_dict``/``load_state_dict`` exist. A scale that is not finite
    and > 0 is rejected.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0, *, device: Optional[torch.device] = None):
        scale = check_scale("LossScaler", "scale", scale)
        self.core = LossScale(scale, dynamic=False, owner="LossScaler")
        self.core.place(torch.device("cpu") if device is None else device)

    @property
    def _scale(self) -> Tensor:
        """The scale: a 0-dim float32 device tensor."""
        core = self.core
        return core.scale if core.scale is not None else core.place(torch.device("cpu"))

    @property
    def device(self) -> torch.device:
        """The device holding the scale."""
        return self._scale.device

    @property
    def loss_scale(self) -> float:
        """The current scale (reads the device tensor); settable (a number, or a
        one-element tensor copied on the device)."""
        return self.core.get()

    @loss_scale.setter
    def loss_scale(self, value: Any) -> None:
        if isinstance(value, Tensor):
            value = value.to(self.device)
        else:
            value = check_scale(type(self).__name__, "loss_scale", value)
        self.core.set(value)

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
        scaled_loss = loss.float() * self.core.place(loss.device)
        scaled_loss.backward(retain_graph=retain_graph)

    def state_dict(self) -> Dict[str, Any]:
        """The scaler as tensors (copies) and numbers, loadable with ``weights_only``."""
        return {"dynamic": False, "loss_scale": self._scale.detach().clone().reshape(1)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads :meth:`state_dict`; ``ValueError`` (nothing changed) when it does not
        describe a valid scaler of the same kind."""
        loaded = _scaler_from_state_dict(state_dict, self.device, "state_dict")
        if loaded.dynamic != self.dynamic:
            kinds = {True: "dynamic", False: "static"}
            raise ValueError(f"state_dict describes a {kinds[loaded.dynamic]} loss scaler, "
                             f"this one is {kinds[self.dynamic]}")
        self.core = loaded.core

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"


def _apex_setting(name: str, doc: str) -> property:
    """A setting of :class:`DynamicLossScaler` kept by its core, checked when set."""
    core_name = {apex: ours for ours, apex in _APEX_NAMES}[name]

    def get(self):
        return getattr(self.core, core_name)

    def set(self, value):
        with _apex_names():
            self.core.configure(**_core_settings(**{name: value}))
    return property(get, set, doc=doc)


class DynamicLossScaler(LossScaler):
    """A dynamic loss scale: a face on :class:`mixedprec.loss_scale.LossScale`
    (``core``), updated on the device.

    Apex's rule: on an overflow the scale is divided by ``scale_factor`` (not below
    ``min_loss_scale``) and the step is skipped; after ``scale_window`` consecutive
    steps without overflow it is multiplied by ``scale_factor`` (not above
    ``max_loss_scale``).

    Args:
        init_scale: the first scale (Apex's default 2**32).
        scale_factor: the growth factor (> 1); the back-off factor is its inverse.
        scale_window: overflow-free steps before the scale grows.
        min_loss_scale, max_loss_scale: keyword-only bounds (defaults 1 and no
            ceiling). ``min_loss_scale=None`` means LossScale's floor 2**-24 (the scale
            never reaches 0); ``max_loss_scale=None`` no ceiling. These are the names the
            last Apex ``FP16_Optimizer`` accepted in ``dynamic_loss_args``.

    Every setting is checked at construction, when set and when loaded; an error names
    the argument and changes nothing.

    Differs from Apex: the scale and its trackers live in device tensors, so
    :meth:`update_scale` also accepts the overflow as a device tensor (no host read);
    the scale is float32 (with a ``scale_factor`` that is not a power of two the values
    can differ from Apex's float64 in the last bits). :meth:`has_overflow` returns a
    Python bool as in Apex, which reads the device.
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0,
                 scale_window: int = 1000, *, min_loss_scale: Optional[float] = 1.0,
                 max_loss_scale: Optional[float] = None,
                 device: Optional[torch.device] = None):
        with _apex_names():
            settings = _core_settings(init_scale=init_scale, scale_factor=scale_factor,
                                      scale_window=scale_window, min_loss_scale=min_loss_scale,
                                      max_loss_scale=max_loss_scale)
            self.core = LossScale(**settings, dynamic=True, owner="DynamicLossScaler")
        self.core.place(torch.device("cpu") if device is None else device)

    scale_window = _apex_setting("scale_window", "Overflow-free steps before the scale grows.")
    min_loss_scale = _apex_setting("min_loss_scale", "The floor of the scale.")
    max_loss_scale = _apex_setting("max_loss_scale", "The ceiling of the scale (inf: none).")
    scale_factor = _apex_setting("scale_factor", "The growth factor (back-off: its inverse).")

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """Whether any ``p.grad`` of ``params`` holds inf or NaN (fused check per device;
        returns a Python bool, so it reads the device)."""
        return _grads_have_inf_or_nan(params)

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return bool((~torch.isfinite(x)).any().item())  # sync-ok: Apex API returns a Python bool

    def update_scale(self, overflow: Any) -> None:
        """Applies one step of the rule. ``overflow`` is a bool or a one-element tensor
        (nonzero: overflow), used on the device without a host read."""
        if isinstance(overflow, Tensor):
            if overflow.numel() != 1:
                raise ValueError("DynamicLossScaler.update_scale: expected overflow to be a "
                                 "bool or a one-element tensor, got shape "
                                 f"{tuple(overflow.shape)}")
            flag = (overflow.detach().reshape(()) != 0).to(torch.float32)
        else:
            flag = torch.full((), float(bool(overflow)), device=self.device)
        self.core.update(flag)

    def state_dict(self) -> Dict[str, Any]:
        """Scale, trackers (copies) and settings, loadable with ``weights_only``."""
        core, scale = self.core, self._scale
        return {
            "dynamic": True,
            "loss_scale": scale.detach().clone().reshape(1),
            "growth_tracker": core.growth_tracker.clone().reshape(1),
            "hysteresis_tracker": core.hysteresis_tracker.clone().reshape(1),
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
        }


def _scaler_from_state_dict(sd: Any, device: torch.device, where: str) -> LossScaler:
    """A new scaler built from a scaler ``state_dict``, every value checked (by
    LossScale); ``ValueError`` naming what is wrong."""
    if not isinstance(sd, dict) or "dynamic" not in sd or "loss_scale" not in sd:
        raise ValueError(f"{where} must be a loss-scaler state_dict with 'dynamic' and "
                         f"'loss_scale', got {type(sd).__name__}")
    tensor_specs = {"loss_scale": torch.float32}
    settings = ("scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")
    if sd["dynamic"]:
        tensor_specs.update(growth_tracker=torch.int32, hysteresis_tracker=torch.int32)
        for key in settings:
            if key not in sd:
                raise ValueError(f"{where} is missing '{key}'")
    for key, dtype in tensor_specs.items():
        t = sd.get(key)
        if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != dtype:
            got = (f"dtype {t.dtype} and shape {tuple(t.shape)}" if isinstance(t, Tensor)
                   else type(t).__name__)
            raise ValueError(f"{where}['{key}'] must be one {dtype} element, got {got}")
    scale = float(sd["loss_scale"].reshape(()))  # sync-ok: loading a checkpoint
    scale = check_scale(where, "'loss_scale'", scale)
    with _apex_names(f"{where}: ", ("init_scale", "'loss_scale'")):
        if not sd["dynamic"]:
            return LossScaler(scale, device=device)
        scaler = DynamicLossScaler(scale, **{key: sd[key] for key in settings}, device=device)
        scaler.core.load(scale, sd["growth_tracker"], sd["hysteresis_tracker"])
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

    :meth:`update_master_grads` unscales the gradients into the float32 master
    gradients and sets the overflow flag (a device tensor) with
    :func:`mixedprec.masters.unscale_into_masters` (float32 parameters: one
    ``multi_tensor_unscale_`` in place); with dynamic scaling the loss scale is then
    updated on the device. :meth:`step` copies the masters into the model with
    :func:`mixedprec.masters.copy_to_model`.

    How an overflowed step is skipped (dynamic scaling only; a static scale never
    skips, as in Apex):

    * When the wrapped optimizer declares ``_step_supports_amp_scaling`` (torch's
      ``fused=True`` optimizers, mixedprec's fused optimizers), the flag is handed to it
      as ``optimizer.found_inf`` (with ``optimizer.grad_scale = None``: the gradients
      are already unscaled) for the duration of ``step``, as ``torch.amp.GradScaler``
      does; its kernel writes nothing on overflow, and no value is read on the host.
      The first step of a parameter is the exception: torch's ``SGD(fused=True)``
      skipping on the device would leave the momentum buffers it creates
      uninitialised, so a step with a parameter the fused optimizer has not stepped
      yet goes the way below.
    * Otherwise ``step`` reads the flag on the host, once, and does not call the wrapped
      optimizer's ``step`` when it is set, as Apex did.

    Differs from Apex: CPU and bfloat16 are supported; the defaults of the dynamic
    scaler are those of :class:`DynamicLossScaler` (Apex's last version used amp's
    2**16 and 2000); ``step`` on overflow does not print; ``clip_master_grads`` returns
    a tensor; ``step(closure)`` with dynamic scaling re-runs the closure while the
    gradients overflow (reading the flag, as Apex did) and raises ``RuntimeError`` if
    they still overflow at the minimum scale instead of looping forever;
    :meth:`load_state_dict` validates the checkpoint (refusing one of another kind of
    optimizer) and copies the masters into the model.
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
                if param.dtype in HALF_DTYPES:
                    master = make_master(param).requires_grad_(True)
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
        loss_scaler.core.place(self._device)
        self.loss_scaler = loss_scaler
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=self._device)
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        # ids of the parameters a fused inner optimizer has stepped (so holds state for).
        self._started: set = set()

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
        scaled_loss = loss.float() * self.loss_scaler._scale.to(loss.device)
        scaled_loss.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscales the model's gradients into the float32 master gradients and sets the
        overflow flag (float32 parameters are unscaled in place); with dynamic scaling,
        then updates the loss scale on the device. A model parameter without gradient
        gets a master with ``.grad = None``. Sparse gradients raise ``TypeError`` before
        anything is written. No host read."""
        named = [(f"a float16/bfloat16 parameter of shape {tuple(p.shape)}", p.grad)
                 for p in self.all_fp16_params]
        named += [(f"a float32 parameter of shape {tuple(p.shape)}", p.grad)
                  for p in self.all_fp32_from_fp32_params]
        _reject_sparse(named, "FP16_Optimizer.update_master_grads")

        core = self.loss_scaler.core
        inv_scale = core.inv_scale()
        found_inf = self._found_inf
        found_inf.zero_()
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model.grad is None:
                master.grad = None
        unscale_into_masters(self.all_fp16_params, self.all_fp32_from_fp16_params,
                             found_inf, inv_scale)
        fp32_grads: Dict[torch.device, List[Tensor]] = {}
        for p in self.all_fp32_from_fp32_params:
            if p.grad is not None:
                if not ops.is_dense(p.grad):
                    p.grad = p.grad.contiguous()
                fp32_grads.setdefault(p.grad.device, []).append(p.grad)
        with torch.no_grad():
            for device, grads in fp32_grads.items():
                flag = found_inf if device == found_inf.device else torch.zeros_like(
                    found_inf, device=device)
                ops.multi_tensor_unscale_(grads, flag, inv_scale.to(device))
                if flag is not found_inf:  # a maximum: torch's fused optimizers expect 0 or 1
                    torch.maximum(found_inf, flag.to(found_inf.device), out=found_inf)
        if self.dynamic_loss_scale:
            core.update(found_inf)

    def step(self, closure=None):
        """Runs the wrapped optimizer on the master weights, then copies them into the
        model. With dynamic scaling an overflowed step is skipped (see the class
        docstring: on the device by a fused optimizer, else after one host read).

        ``closure``, when given, must call ``self.zero_grad()`` and
        ``self.backward(loss)`` and return the loss; with dynamic scaling it is re-run
        while the gradients overflow (this reads the flag), as in Apex."""
        opt = self.optimizer
        fused = getattr(opt, "_step_supports_amp_scaling", False)
        stepping = [id(p) for g in opt.param_groups for p in g["params"]
                    if p.grad is not None] if fused else []
        if closure is not None:
            retval = self._step_with_closure(closure)
        elif not self.dynamic_loss_scale:
            retval = opt.step()
        elif fused and self._started.issuperset(stepping):
            # torch.amp.GradScaler's hand-off: the optimizer skips on the device.
            opt.grad_scale = None  # the gradients are already unscaled
            opt.found_inf = self._found_inf
            try:
                retval = opt.step()
            finally:
                delattr(opt, "grad_scale")
                delattr(opt, "found_inf")
        elif self._found_inf.item():  # sync-ok: skips the step as Apex did, one read a step
            return None
        else:
            retval = opt.step()
        self._started.update(stepping)
        copy_to_model(self.all_fp32_from_fp16_params, self.all_fp16_params)
        return retval

    def _step_with_closure(self, closure):
        def wrapped_closure():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The inner optimizer may have moved the masters since the last call.
                copy_to_model(self.all_fp32_from_fp16_params, self.all_fp16_params)
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
            total = torch.where(self._found_inf > 0, -1.0, total)
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
        naming what differs (groups, sizes, dtypes, missing keys, a state saved around
        another kind of optimizer), changing nothing."""
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
        copy_to_model(self.all_fp32_from_fp16_params, self.all_fp16_params)

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
        self._check_inner_state_dict(sd["optimizer_state_dict"], where)

    def _check_inner_state_dict(self, inner: Any, where: str) -> None:
        """The wrapped optimizer's part: same groups and sizes, and saved by the same kind
        of optimizer. The kind is told by the keys: a saved group that lacks a
        hyperparameter of this optimizer's ``defaults`` (``betas``; on/off flags such as
        ``fused``, which torch versions add, do not count) while holding options this
        one does not know (``momentum``), or saved per-parameter state whose keys and
        those this optimizer keeps are not one within the other (SGD's
        ``momentum_buffer``, Adam's ``exp_avg``), come from another kind. Keys of a
        scheduler (``initial_lr``) or of another torch version are accepted."""
        opt = self.optimizer
        kind = type(opt).__name__
        if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
            raise ValueError(f"{where}: 'optimizer_state_dict' is not an optimizer state_dict")
        saved_groups = inner["param_groups"]
        if len(saved_groups) != len(opt.param_groups):
            raise ValueError(f"{where}: the wrapped optimizer's state_dict has "
                             f"{len(saved_groups)} parameter groups, this one has "
                             f"{len(opt.param_groups)}")
        params_by_id = {}
        not_options = {"params", "param_names"}
        for gi, (g, sg) in enumerate(zip(opt.param_groups, saved_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"{where}: parameter group {gi} has {len(sg['params'])} "
                                 f"parameters in the state_dict, {len(g['params'])} here")
            missing = sorted(k for k, v in opt.defaults.items() if k not in sg
                             and k not in not_options and not isinstance(v, (bool, type(None))))
            unknown = sorted(set(sg) - set(g) - not_options)
            if missing and unknown:
                raise ValueError(f"{where}: parameter group {gi} of the state_dict was saved "
                                 f"around another kind of optimizer than this {kind}: it has "
                                 f"{unknown} and lacks {missing}")
            params_by_id.update(zip(sg["params"], g["params"]))
        for pid, saved_state in inner["state"].items():
            if pid not in params_by_id:
                raise ValueError(f"{where}: the wrapped optimizer's state_dict has state for "
                                 f"parameter id {pid!r}, which is in none of its groups")
            p = params_by_id[pid]
            current = opt.state.get(p, {})
            if current and saved_state and not (set(current) <= set(saved_state)
                                                or set(saved_state) <= set(current)):
                raise ValueError(f"{where}: the state of parameter {pid} was saved around "
                                 f"another kind of optimizer than this {kind}: it has "
                                 f"{sorted(saved_state)}, this one keeps {sorted(current)}")
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
