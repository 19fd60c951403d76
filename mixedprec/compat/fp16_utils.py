"""Drop-in replacement for ``apex.fp16_utils`` (deleted from Apex in May 2025): Apex's
names, signatures and defaults, on :class:`mixedprec.loss_scale.LossScale` and
:mod:`mixedprec.masters`. Differs from Apex in general (each name documents the rest):
CPU tensors and bfloat16 are accepted; ``backward`` and ``update_master_grads`` never
read the device, nor does ``step`` when the wrapped optimizer skips overflowed steps on
the device (``_step_supports_amp_scaling``), else it reads the flag once as Apex did;
``FP16_Optimizer`` does not print a line per overflow: with ``verbose`` it logs one
summary at exit (see :meth:`FP16_Optimizer.overflow_report`); ``state_dict()`` loads
with ``weights_only=True``.

``MIXEDPREC_HALF_DTYPE=bfloat16`` (or ``python -m mixedprec.apex --half-dtype bfloat16``)
runs an unmodified fp16 script in bfloat16 (on a CPU, several times faster): see
:func:`half_dtype`.
"""

import atexit
import contextlib
import logging
import math
import os
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .. import grads as _grads
from .. import ops
from ..loss_scale import DEFAULT_MIN_SCALE, LossScale, check_scale
from ..masters import HALF_DTYPES, copy_to_model, make_master, unscale_into_masters
from ..overflow import OverflowReport, format_report

logger = logging.getLogger("mixedprec.fp16_utils")

__all__ = ["BN_convert_float", "DynamicLossScaler", "FP16Model", "FP16_Optimizer",
           "LossScaler", "clip_grad_norm", "convert_module", "convert_network",
           "master_params_to_model_params", "model_grads_to_master_grads", "network_to_half",
           "prep_param_lists", "to_python_float", "tofp16"]

_FLOAT_DTYPES = (torch.float32, *HALF_DTYPES)
# State keys of torch.optim optimizers that always have the shape of their parameter.
_PARAM_SHAPED_STATE = frozenset((
    "momentum_buffer exp_avg exp_avg_sq max_exp_avg_sq sum square_avg acc_delta grad_avg "
    "exp_inf ax prev step_size mu_product_buffer").split())


#: The environment variable naming the 16-bit dtype Apex's fp16 stands for (see
#: :func:`half_dtype`); ``python -m mixedprec.apex --half-dtype`` sets it.
HALF_DTYPE_VAR = "MIXEDPREC_HALF_DTYPE"
_HALF_DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                     "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def half_dtype() -> torch.dtype:
    """The 16-bit dtype that Apex's float16 stands for where a legacy script leaves it
    to Apex: torch.float16, or torch.bfloat16 when the environment variable
    ``MIXEDPREC_HALF_DTYPE`` says ``bfloat16`` (or ``bf16``; ``float16``, ``fp16``,
    ``half`` or unset: float16), read at each call. Read by ``amp.initialize`` (O2/O3's
    weights, O1's autocast), ``amp.init``, :func:`network_to_half` and
    :class:`FP16Model` without a ``dtype``; a dtype a script passes is kept. Loss
    scaling stays as the script asked. Any other value raises ``ValueError`` naming the
    variable."""
    value = os.environ.get(HALF_DTYPE_VAR, "")
    if not value.strip():
        return torch.float16
    dtype = _HALF_DTYPE_NAMES.get(value.strip().lower())
    if dtype is None:
        raise ValueError(f"{HALF_DTYPE_VAR}={value!r}: expected 'bfloat16' or 'float16' "
                         "(also 'bf16', 'fp16', 'half'), or the variable unset (float16)")
    return dtype


_TORCH_HALF = {}  # torch's own Tensor.half and Module.half, while redirected


def redirect_half_casts() -> bool:
    """Under ``MIXEDPREC_HALF_DTYPE=bfloat16``: makes ``Tensor.half()`` and
    ``Module.half()`` cast to bfloat16 in this process, for scripts that cast with
    torch's own ``model.half()`` and ``input.half()`` (FP16_Optimizer's examples do)
    rather than through Apex. ``python -m mixedprec.apex --half-dtype bfloat16`` calls
    it in the script's process and its children; casts by dtype (``.to(torch.half)``,
    ``.type(torch.cuda.HalfTensor)``) are left alone. Under float16 it restores torch's
    methods. Returns whether the casts are redirected."""
    redirect = half_dtype() is torch.bfloat16
    if redirect and not _TORCH_HALF:
        _TORCH_HALF.update(tensor=torch.Tensor.half, module=torch.nn.Module.half)

        def tensor_half(self, memory_format=torch.preserve_format):
            return self.to(torch.bfloat16, memory_format=memory_format)

        def module_half(self):
            return self._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point()
                               else t)

        tensor_half.__doc__ = "Casts to bfloat16 (MIXEDPREC_HALF_DTYPE=bfloat16)."
        module_half.__doc__ = tensor_half.__doc__
        torch.Tensor.half, torch.nn.Module.half = tensor_half, module_half
    elif not redirect and _TORCH_HALF:
        torch.Tensor.half, torch.nn.Module.half = _TORCH_HALF.pop("tensor"), \
            _TORCH_HALF.pop("module")
    return redirect


def _check_dtype(dtype: torch.dtype, name: str = "dtype") -> torch.dtype:
    if dtype not in HALF_DTYPES:
        raise TypeError(f"{name} must be torch.float16 or torch.bfloat16, got {dtype}")
    return dtype


def _reject_sparse(grads: Iterable[Tuple[str, Optional[Tensor]]], where: str) -> None:
    for name, g in grads:
        if g is not None and g.layout != torch.strided:
            raise TypeError(
                f"{where}: {name} has a sparse gradient (layout {g.layout}); mixed-precision "
                "master weights need dense gradients (e.g. nn.Embedding(sparse=False))")


# -- Network conversion (apex/fp16_utils/fp16util.py) -----------------------------------

class tofp16(nn.Module):  # Apex's name
    """Casts its input to half precision. Differs from Apex: ``dtype`` may be
    ``torch.bfloat16``; non-floating-point inputs (token ids) pass through."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        super().__init__()
        self.dtype = _check_dtype(dtype)

    def forward(self, input: Tensor) -> Tensor:
        return input.to(self.dtype) if input.is_floating_point() else input

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}"


def BN_convert_float(module: nn.Module) -> nn.Module:  # Apex's name
    """Converts every affine BatchNorm layer of ``module`` back to float32, in place;
    returns ``module``. BatchNorm without ``affine`` stays half, as in Apex."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
            m.float()
    return module


def network_to_half(network: nn.Module, dtype: Optional[torch.dtype] = None) -> nn.Sequential:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))`` (``network`` converted
    in place). Differs from Apex: ``dtype`` may be torch.float16 or torch.bfloat16;
    ``None``: float16, or bfloat16 under ``MIXEDPREC_HALF_DTYPE`` (:func:`half_dtype`)."""
    dtype = half_dtype() if dtype is None else _check_dtype(dtype)
    return nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts, in place, the floating-point parameters, their gradients and buffers held
    directly by ``module`` (not its children) to any floating-point ``dtype``."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
        if param.grad is not None and param.grad.is_floating_point():
            param.grad.data = param.grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """:func:`convert_module` on every module but affine BatchNorm layers; re-flattens RNN
    weights. Returns ``network``, converted in place."""
    for module in network.modules():
        if not (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine):
            convert_module(module, dtype)
            if isinstance(module, nn.RNNBase):
                module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``convert_network(network, dtype)`` whose floating-point inputs are cast to ``dtype``.
    Differs from Apex: ``dtype`` may be bfloat16 (``None``: float16, or bfloat16 under
    ``MIXEDPREC_HALF_DTYPE``, see :func:`half_dtype`); only floating-point tensors are
    cast (Apex called ``.half()`` on every input); keyword arguments are passed (and
    cast) too."""

    def __init__(self, network: nn.Module, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.dtype = half_dtype() if dtype is None else _check_dtype(dtype)
        self.network = convert_network(network, dtype=self.dtype)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        return value

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs = tuple(self._cast(t) for t in inputs)
        return self.network(*inputs, **{k: self._cast(v) for k, v in kwargs.items()})


# -- Manual master-weight helpers --------------------------------------------------------

def prep_param_lists(model: nn.Module,
                     flat_master: bool = False) -> Tuple[List[Tensor], List[Tensor]]:
    """``(model_params, master_params)``: the parameters requiring grad and their float32
    masters (a list of one flat ``nn.Parameter`` with ``flat_master``). Differs from Apex:
    ``flat_master`` takes mixed dtypes and makes a zero (not uninitialised) ``.grad``."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if not flat_master:
        return model_params, [make_master(p).requires_grad_(True) for p in model_params]
    master = nn.Parameter(torch.cat([p.detach().reshape(-1).float() for p in model_params]
                                    or [torch.zeros(0)]))
    master.grad = torch.zeros_like(master)
    return model_params, [master]


def _pair_up(model_params, master_params, flat_master, name, grads=False):
    """The masters (their ``.grad`` with ``grads``; views of the one flat master with
    ``flat_master``) paired with ``model_params``, after checking the lists."""
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
    """Copies the model gradients, cast to float32 and not unscaled, into the masters'
    ``.grad``. Differs from Apex: a parameter without gradient leaves its master's
    ``.grad`` None (zeros in its slice with ``flat_master``, where Apex failed); sparse
    gradients raise ``TypeError`` and mismatched lists ``ValueError``, writing nothing."""
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
        else:
            if not flat_master and master.grad is None:
                master.grad = torch.empty_like(master)
            src.append(model.grad)
            dst.append(master if flat_master else master.grad)
    copy_to_model(src, dst)


def master_params_to_model_params(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                  flat_master: bool = False) -> None:
    """Copies the masters into the model parameters (cast to their dtype); with
    ``flat_master`` the flat master is split into the parameters' shapes."""
    model_params, masters = _pair_up(model_params, master_params, flat_master,
                                     "master_params_to_model_params")
    copy_to_model(masters, model_params)


def to_python_float(t: Any) -> float:
    """The value of a one-element tensor as a Python number (a host read, as in Apex);
    differs from Apex: Python numbers are returned as floats (Apex failed); other
    sequences give ``t[0]`` as in Apex."""
    if hasattr(t, "item"):
        return t.item()  # sync-ok: Apex API, a host read by definition
    if isinstance(t, (int, float)):
        return float(t)
    return t[0]


def clip_grad_norm(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.clip_grad_norm_`` under its Apex name."""
    return torch.nn.utils.clip_grad_norm_(
        parameters, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)


# -- Loss scalers (apex/fp16_utils/loss_scaler.py): faces on LossScale -------------------

# LossScale's setting names -> Apex's (for error messages).
_APEX_NAMES = (("growth_factor", "scale_factor"), ("growth_interval", "scale_window"),
               ("min_scale", "min_loss_scale"), ("max_scale", "max_loss_scale"))
# DynamicLossScaler's settings, as saved in its state_dict.
_SETTINGS = ("scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")
_UNSET_BOUNDS = {"min_loss_scale": DEFAULT_MIN_SCALE, "max_loss_scale": math.inf}


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
    """LossScale's settings from Apex's names (``None`` bounds: LossScale's floor, no
    ceiling); checks that ``scale_factor`` > 1, since Apex divides by it."""
    out = {}
    if "scale_factor" in apex:
        factor = check_scale("DynamicLossScaler", "scale_factor", apex.pop("scale_factor"))
        if factor <= 1.0:
            raise ValueError(f"DynamicLossScaler: expected scale_factor to be > 1, got {factor}")
        out.update(growth_factor=factor, backoff_factor=1.0 / factor)
    ours = {apex_name: name for name, apex_name in _APEX_NAMES}
    for key, value in apex.items():
        out[ours.get(key, key)] = _UNSET_BOUNDS.get(key) if value is None else value
    return out


class LossScaler:
    """A static loss scale, a face on ``core`` (a :class:`mixedprec.loss_scale.LossScale`).
    Differs from Apex: ``loss_scale`` reads the device; ``backward`` casts the loss to
    float32; ``state_dict``/``load_state_dict`` exist; the scale must be finite and > 0."""

    dynamic = False

    def __init__(self, scale: float = 1.0, *, device: Optional[torch.device] = None):
        scale = check_scale("LossScaler", "scale", scale)
        self.core = LossScale(scale, dynamic=False, owner="LossScaler")
        self.core.place(torch.device("cpu") if device is None else device)

    @property
    def _scale(self) -> Tensor:
        core = self.core
        return core.scale if core.scale is not None else core.place(torch.device("cpu"))

    @property
    def device(self) -> torch.device:
        return self._scale.device

    @property
    def loss_scale(self) -> float:
        """The scale (reads the device); settable to a number or a one-element tensor."""
        return self.core.get()

    @loss_scale.setter
    def loss_scale(self, value: Any) -> None:
        self.core.set(value.to(self.device) if isinstance(value, Tensor)
                      else check_scale(type(self).__name__, "loss_scale", value))

    cur_scale = loss_scale  # Apex's attribute name

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return False

    def update_scale(self, overflow: Any) -> None:
        pass

    def scale_gradient(self, module: nn.Module, grad_in, grad_out):
        """Backward-hook helper: ``grad_in`` multiplied by the loss scale."""
        return tuple(None if g is None else g * self._scale.to(g.device).to(g.dtype)
                     for g in grad_in)

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """Back-propagates ``loss.float() * loss_scale``."""
        scaled_loss = loss.float() * self.core.place(loss.device)
        scaled_loss.backward(retain_graph=retain_graph)

    def state_dict(self) -> Dict[str, Any]:
        return {"dynamic": False, "loss_scale": self._scale.detach().clone().reshape(1)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Raises ``ValueError`` (nothing changed) for a state of an invalid scaler or of
        another kind."""
        loaded = _scaler_from_state_dict(state_dict, self.device, "state_dict")
        if loaded.dynamic != self.dynamic:
            kinds = {True: "dynamic", False: "static"}
            raise ValueError(f"state_dict describes a {kinds[loaded.dynamic]} loss scaler, "
                             f"this one is {kinds[self.dynamic]}")
        self.core = loaded.core

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickles mixedprec's scaler, or Apex's (``apex.fp16_utils.loss_scaler``'s
        objects, which Apex's ``FP16_Optimizer.state_dict`` pickled): Apex's attributes
        become this class's scaler, on the CPU until first used."""
        if "core" in state:
            self.__dict__.update(state)
        elif "cur_scale" in state:
            self._from_apex(state)
        elif "_loss_scale" in state:
            self._from_apex_amp(state)
        else:
            raise ValueError(f"{type(self).__name__}: cannot unpickle a state with "
                             f"{sorted(state)}; expected Apex's (cur_scale, ... or "
                             "_loss_scale, ...) or mixedprec's (core)")

    def _from_apex(self, state: Dict[str, Any]) -> None:
        LossScaler.__init__(self, state["cur_scale"])

    def _from_apex_amp(self, state: Dict[str, Any]) -> None:
        """``apex.amp.scaler.LossScaler``'s attributes (what Apex's ``FP16_Optimizer``
        pickled from 2019 on): a :class:`DynamicLossScaler` with amp's rule (factor 2,
        ``_scale_seq_len`` clean steps, its bounds; ``_unskipped`` steps counted), or a
        static :class:`LossScaler`."""
        scale = state["_loss_scale"]
        if state.get("dynamic"):
            self.__class__ = DynamicLossScaler
            DynamicLossScaler.__init__(self, scale, 2.0, state.get("_scale_seq_len", 2000),
                                       min_loss_scale=state.get("_min_loss_scale"),
                                       max_loss_scale=state.get("_max_loss_scale"))
            self.core.load(float(scale), int(state.get("_unskipped", 0)))
        else:
            self.__class__ = LossScaler
            LossScaler.__init__(self, scale)


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
    """A dynamic loss scale, updated on the device by Apex's rule: an overflow divides it by
    ``scale_factor`` (> 1) and skips the step; ``scale_window`` clean steps multiply it. It
    stays within ``min_loss_scale`` (``None``: 2**-24) and ``max_loss_scale`` (``None``: inf).
    Settings are checked when given, set or loaded; an error changes nothing.
    Differs from Apex: :meth:`update_scale` also takes a device tensor (no host read); the
    scale is float32 (Apex's float64 may differ in the last bits for a ``scale_factor``
    that is not a power of two)."""

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
        """Whether any ``p.grad`` holds inf or NaN (one fused check per device; reads it)."""
        found = [p.grad for p in params if p.grad is not None]
        if not found:
            return False
        found_inf = torch.zeros((), dtype=torch.float32, device=found[0].device)
        _grads.check_finite_(found, found_inf)
        return bool(found_inf.item())  # sync-ok: Apex returns a bool

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return bool((~torch.isfinite(x)).any().item())  # sync-ok: Apex API returns a Python bool

    def update_scale(self, overflow: Any) -> None:
        """One step of the rule; ``overflow`` is a bool or a one-element tensor (nonzero:
        overflow), used on the device."""
        if isinstance(overflow, Tensor):
            if overflow.numel() != 1:
                raise ValueError("DynamicLossScaler.update_scale: expected overflow to be a bool "
                                 f"or a one-element tensor, got shape {tuple(overflow.shape)}")
            flag = (overflow.detach().reshape(()) != 0).to(torch.float32)
        else:
            flag = torch.full((), float(bool(overflow)), device=self.device)
        self.core.update(flag)

    def _from_apex(self, state: Dict[str, Any]) -> None:
        """Apex's rule (``cur_iter``, ``last_overflow_iter``: the scale grows at the update
        where ``(cur_iter - last_overflow_iter) % scale_window == 0``; floor 1, no
        ceiling) as this class's scale and growth tracker."""
        scale, window = state["cur_scale"], state["scale_window"]
        DynamicLossScaler.__init__(self, scale, state["scale_factor"], window,
                                   min_loss_scale=min(1.0, scale), max_loss_scale=None)
        since = state.get("cur_iter", 0) - state.get("last_overflow_iter", -1)
        self.core.load(float(scale), (since - 1) % window)

    def state_dict(self) -> Dict[str, Any]:
        return dict(super().state_dict(), dynamic=True,
                    growth_tracker=self.core.growth_tracker.clone().reshape(1),
                    hysteresis_tracker=self.core.hysteresis_tracker.clone().reshape(1),
                    **{key: getattr(self, key) for key in _SETTINGS})


def _scaler_from_state_dict(sd: Any, device: torch.device, where: str) -> LossScaler:
    """A new scaler from a scaler ``state_dict``, every value checked; ``ValueError``."""
    if not isinstance(sd, dict):
        raise ValueError(f"{where} must be a loss-scaler state_dict (a dict with 'dynamic' "
                         f"and 'loss_scale'), got {type(sd).__name__}")
    for key in ("dynamic", "loss_scale"):
        if key not in sd:
            raise ValueError(f"{where} is missing '{key}' (a loss-scaler state_dict has "
                             f"'dynamic' and 'loss_scale'; it has {list(sd)})")
    tensor_specs = {"loss_scale": torch.float32}
    if sd["dynamic"]:
        tensor_specs.update(growth_tracker=torch.int32, hysteresis_tracker=torch.int32)
        for key in ("growth_tracker", "hysteresis_tracker", *_SETTINGS):
            if key not in sd:
                raise ValueError(f"{where} is missing '{key}' (a dynamic loss scaler's "
                                 f"state_dict; it has {list(sd)})")
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
        scaler = DynamicLossScaler(scale, **{key: sd[key] for key in _SETTINGS}, device=device)
        scaler.core.load(scale, sd["growth_tracker"], sd["hysteresis_tracker"])
    return scaler


# -- FP16_Optimizer (apex/fp16_utils/fp16_optimizer.py) ----------------------------------

def _forwarded(owner: str, name: str) -> property:
    """``self.<owner>.<name>``, readable and settable."""
    return property(lambda self: getattr(getattr(self, owner), name),
                    lambda self, value: setattr(getattr(self, owner), name, value))


class FP16_Optimizer:  # Apex's name
    """Wraps a torch optimizer to train a float16/bfloat16 model with float32 master
    weights (replacing the half parameters in its ``param_groups``; their state moves to
    them, cast) and a static or dynamic loss scale. Each iteration::

        optimizer.zero_grad()
        optimizer.backward(loss)        # instead of loss.backward()
        optimizer.step()                # updates masters, copies them into the model

    An overflowed step (dynamic scaling only) is skipped on the device by an optimizer
    with ``_step_supports_amp_scaling``, given ``found_inf`` as by ``torch.amp.GradScaler``
    (except on a parameter's first step: torch's ``SGD(fused=True)`` would leave
    uninitialised momentum); otherwise ``step`` reads the flag and skips, as Apex did.

    Differs from Apex: CPU and bfloat16; :class:`DynamicLossScaler`'s defaults (Apex's
    last version used 2**16 and 2000); no line per overflow: with ``verbose`` (and
    dynamic scaling) one summary at exit, logged (logger ``mixedprec.fp16_utils``) when
    steps were skipped; with the keyword-only ``overflow_report=True`` (mixedprec's extra,
    as ``GradScaler``'s: one per-tensor norm pass over the gradients a step) it names the
    parameters whose gradients overflowed by their place (``param_groups[g][i]``;
    :meth:`overflow_report` takes a model for names); ``clip_master_grads``
    returns a tensor; ``step(closure)`` raises ``RuntimeError`` instead of looping forever
    at the minimum scale; :meth:`load_state_dict` validates and copies into the model.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[dict] = None,
                 verbose: bool = True, *, overflow_report: bool = False):
        if not isinstance(overflow_report, bool):
            raise TypeError("FP16_Optimizer: expected overflow_report to be a bool, got "
                            f"{type(overflow_report).__name__}")
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError("FP16_Optimizer: init_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(init_optimizer).__name__}")
        if dynamic_loss_args is not None and not isinstance(dynamic_loss_args, dict):
            raise TypeError("FP16_Optimizer: dynamic_loss_args must be a dict, got "
                            f"{type(dynamic_loss_args).__name__}")
        # Validate everything before the optimizer is touched.
        for gi, group in enumerate(init_optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                where = f"FP16_Optimizer: param_groups[{gi}]['params'][{pi}]"
                if param.requires_grad and param.layout != torch.strided:
                    raise TypeError(f"{where} is a sparse tensor (layout {param.layout}); "
                                    "expected dense parameters")
                if param.requires_grad and param.dtype not in _FLOAT_DTYPES:
                    raise TypeError(f"{where} has dtype {param.dtype}; expected "
                                    "torch.float16, torch.bfloat16 or torch.float32")
        loss_scaler = (DynamicLossScaler(**(dynamic_loss_args or {})) if dynamic_loss_scale
                       else LossScaler(static_loss_scale))
        if half_dtype() is torch.bfloat16 and any(
                p.dtype == torch.float16 for g in init_optimizer.param_groups
                for p in g["params"]):
            warnings.warn(
                f"FP16_Optimizer: {HALF_DTYPE_VAR} asks for bfloat16, but the optimizer holds "
                "float16 parameters: the model was cast outside mixedprec (by dtype, or by "
                "model.half() outside `python -m mixedprec.apex --half-dtype bfloat16`, "
                "which redirects it); the variable reaches amp.initialize, network_to_half "
                "and FP16Model. They train in float16.", stacklevel=2)

        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups = [], [], []
        state = init_optimizer.state
        moved_state = False
        for gi, group in enumerate(init_optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {gi}:")
            fp16_params, fp32_from_fp16, fp32_params = [], [], []
            for pi, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                self.maybe_print(f"FP16_Optimizer received {param.dtype} parameter of size "
                                 f"{tuple(param.shape)} on {param.device}")
                if param.dtype not in HALF_DTYPES:
                    fp32_params.append(param)
                    continue
                master = make_master(param).requires_grad_(True)
                group["params"][pi] = master
                if param in state:
                    state[master] = state.pop(param)
                    moved_state = True
                fp16_params.append(param)
                fp32_from_fp16.append(master)
            self.fp16_groups.append(fp16_params)
            self.fp32_from_fp16_groups.append(fp32_from_fp16)
            self.fp32_from_fp32_groups.append(fp32_params)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        if moved_state:  # the optimizer casts floating-point state to the float32 masters
            init_optimizer.load_state_dict(init_optimizer.state_dict())

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
        # Overflows per parameter (dynamic scaling, overflow_report=True: one per-tensor
        # norm pass over the gradients a step), named by their place in the groups.
        self._count_per_param = overflow_report
        self._overflow = OverflowReport(
            [(f"param_groups[{gi}][{pi}]", p) for gi, group in enumerate(self.fp16_groups)
             for pi, p in enumerate(group)] +
            [(f"param_groups[{gi}][fp32 {pi}]", p)
             for gi, group in enumerate(self.fp32_from_fp32_groups)
             for pi, p in enumerate(group)], owner="FP16_Optimizer")
        if verbose and self.dynamic_loss_scale:
            ref = weakref.ref(self)
            atexit.register(lambda: ref() is not None and ref()._log_summary())

    def overflow_report(self, names: Any = None, scale: bool = True) -> Dict[str, Any]:
        """mixedprec's extra: steps, skipped steps, overflows by parameter and the scale's
        history, read now (dynamic scaling; see
        :meth:`mixedprec.overflow.OverflowReport.report`). ``names``: a model (or its
        ``named_parameters()``) for names instead of places."""
        return self._overflow.report(names, scale)

    def _log_summary(self) -> None:
        report = self._overflow.report()
        if report["skipped"]:
            logger.warning("FP16_Optimizer: %s", format_report(report))

    def maybe_print(self, msg: str) -> None:
        if self.verbose:
            print(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic_loss_scale else "static"
        return f"FP16_Optimizer({kind} loss scale, {self.optimizer!r})"

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # Apex's name
        """Zeroes (or drops) the gradients of the masters, the float32 parameters and the
        model's half parameters. Apex's default ``set_grads_to_None=False`` is kept."""
        params = [p for g in self.param_groups for p in g["params"]] + self.all_fp16_params
        if set_grads_to_None:
            for p in params:
                p.grad = None
            return
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            if g.grad_fn is not None:
                g.detach_()
            else:
                g.requires_grad_(False)
        if grads:
            torch._foreach_zero_(grads)

    def backward(self, loss: Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """Back-propagates ``loss.float() * loss_scale``, then (unless
        ``update_master_grads=False``, to accumulate several losses) calls
        :meth:`update_master_grads`. The model's own ``.grad`` stay scaled."""
        scaled_loss = loss.float() * self.loss_scaler._scale.to(loss.device)
        scaled_loss.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscales the model's gradients into the masters' (float32 parameters: in place)
        and sets the overflow flag, then updates a dynamic scale; no host read. Sparse
        gradients raise ``TypeError`` before anything is written."""
        _reject_sparse([(f"a {kind} parameter of shape {tuple(p.shape)}", p.grad)
                        for kind, params in (("float16/bfloat16", self.all_fp16_params),
                                             ("float32", self.all_fp32_from_fp32_params))
                        for p in params], "FP16_Optimizer.update_master_grads")

        core = self.loss_scaler.core
        inv_scale = core.inv_scale()
        found_inf = self._found_inf.zero_()
        if self.dynamic_loss_scale and self._count_per_param:  # (before the unscale)
            params = [p for p in self.all_fp16_params + self.all_fp32_from_fp32_params
                      if p.grad is not None]
            self._overflow.record_grads(params, [p.grad for p in params], inv_scale)
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model.grad is None:
                master.grad = None
        unscale_into_masters(self.all_fp16_params, self.all_fp32_from_fp16_params,
                             found_inf, inv_scale)
        for p in self.all_fp32_from_fp32_params:
            if p.grad is not None and not ops.is_dense(p.grad):
                p.grad = p.grad.contiguous()
        _grads.unscale_([p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None],
                        found_inf, inv_scale)
        if self.dynamic_loss_scale:
            before = self._overflow.keep(core.scale)
            core.update(found_inf)
            self._overflow.record_step(found_inf, before, core.scale)

    def step(self, closure=None):
        """Runs the wrapped optimizer on the masters and copies them into the model. A
        ``closure`` calls ``self.zero_grad()`` and ``self.backward(loss)`` and returns the
        loss; with dynamic scaling it is re-run while the gradients overflow, as in Apex."""
        opt = self.optimizer
        fused = getattr(opt, "_step_supports_amp_scaling", False)
        stepping = [id(p) for g in opt.param_groups for p in g["params"]
                    if p.grad is not None] if fused else []
        if closure is not None:
            retval = self._step_with_closure(closure)
        elif not self.dynamic_loss_scale:
            retval = opt.step()
        elif fused and self._started.issuperset(stepping):
            # torch.amp.GradScaler's hand-off (gradients already unscaled): skips on the device.
            opt.grad_scale, opt.found_inf = None, self._found_inf
            try:
                retval = opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        elif self._found_inf.item():  # sync-ok: skips the step as Apex did, one read a step
            return None
        else:
            retval = opt.step()
        self._started.update(stepping)
        copy_to_model(self.all_fp32_from_fp16_params, self.all_fp16_params)
        return retval

    def _step_with_closure(self, closure):
        def wrapped_closure():
            if not self.first_closure_call_this_step:  # the masters may have moved since
                copy_to_model(self.all_fp32_from_fp16_params, self.all_fp16_params)
            self.first_closure_call_this_step = False
            scale = self.loss_scale if self.dynamic_loss_scale else None
            loss = closure()
            while self.dynamic_loss_scale and self.overflow:
                before, scale = scale, self.loss_scale
                if scale >= before:
                    raise RuntimeError(
                        "FP16_Optimizer.step(closure): the gradients overflow at the minimum "
                        f"loss scale {scale}; the loss is probably not finite")
                loss = closure()
            return loss

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> Tensor:
        """``clip_grad_norm_`` on the gradients the wrapped optimizer sees, without host read.
        Differs from Apex: returns the norm as a 0-dim device tensor, -1 after an overflow
        with dynamic scaling."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]
                  if p.grad is not None]
        if float(norm_type) != 2.0:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type).to(self._device)
        else:
            total = _grads.global_norm([p.grad for p in params], device=self._device)
            clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            with torch.no_grad():
                for device, (on_device,) in _grads.by_device([p.grad for p in params]).items():
                    torch._foreach_mul_(on_device, clip_coef.to(device))
        if self.dynamic_loss_scale:
            total = torch.where(self._found_inf > 0, -1.0, total)
        return total

    def inspect_master_grad_data(self) -> Optional[List[List[Optional[Tensor]]]]:
        """The gradients the wrapped optimizer sees, per param group; ``None`` with a
        warning after an overflow (reads the flag)."""
        if self.overflow:
            warnings.warn("FP16_Optimizer.inspect_master_grad_data: the last gradients "
                          "overflowed (they may be inf, NaN or stale); returning None",
                          stacklevel=2)
            return None
        return [[None if p.grad is None else p.grad.detach() for p in g["params"]]
                for g in self.optimizer.param_groups]

    @property
    def overflow(self) -> bool:
        """Whether the last gradients overflowed (False with a static scale); reads it."""
        if not self.dynamic_loss_scale:
            return False
        return bool(self._found_inf.item())  # sync-ok: reading overflow is the caller's choice

    @overflow.setter
    def overflow(self, value: bool) -> None:
        self._found_inf.fill_(1.0 if value else 0.0)

    loss_scale = _forwarded("loss_scaler", "loss_scale")
    state = _forwarded("optimizer", "state")
    param_groups = _forwarded("optimizer", "param_groups")

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Apex's keys, referencing the masters and inner state as torch does. Differs from
        Apex: ``loss_scaler`` is :meth:`LossScaler.state_dict` (Apex pickled the object), so
        it loads with ``weights_only=True``; ``overflow`` reads the flag."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a :meth:`state_dict`, or one saved by Apex's ``FP16_Optimizer`` (its
        ``loss_scaler`` a pickled ``LossScaler``/``DynamicLossScaler``), and copies the
        masters into the model (Apex did not; load the model first either way). As in Apex,
        a static-scale state makes this optimizer static and a dynamic one dynamic (the
        state's scale, settings and trackers). Differs from Apex: checks first, raising
        ``ValueError`` (nothing changed) on a mismatch, a missing key (named) or another
        kind of optimizer."""
        saved = state_dict.get("loss_scaler") if isinstance(state_dict, dict) else None
        if isinstance(getattr(saved, "core", None), LossScale):
            # Apex pickled its scaler object: unpickled as this module's class, or as
            # mixedprec.amp's (apex.amp.scaler.LossScaler under the alias): the same core.
            face = (DynamicLossScaler if saved.core.dynamic else LossScaler).__new__(
                DynamicLossScaler if saved.core.dynamic else LossScaler)
            face.core = saved.core
            state_dict = dict(state_dict, loss_scaler=face.state_dict())
        self._check_state_dict(state_dict)
        scaler = _scaler_from_state_dict(state_dict["loss_scaler"], self._device,
                                         "state_dict['loss_scaler']")
        opt = self.optimizer
        opt.load_state_dict(state_dict["optimizer_state_dict"])
        copy_to_model([m for g in state_dict["fp32_from_fp16"] for m in g],
                      self.all_fp32_from_fp16_params)
        # As Apex: the state's kind of loss scale (static or dynamic) replaces this one's,
        # whole: the scaler, the flags, and which parameters the inner optimizer holds
        # state for (a fused one is handed found_inf only after a parameter's first step).
        self._started = {id(p) for g in opt.param_groups for p in g["params"] if opt.state.get(p)}
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
            if not isinstance(saved, (list, tuple)):
                raise ValueError(f"{where}: group {gi} of 'fp32_from_fp16' is a "
                                 f"{type(saved).__name__}, expected a list of tensors")
            if len(saved) != len(current):
                raise ValueError(f"{where}: group {gi} has {len(saved)} master parameters in "
                                 f"the state_dict, {len(current)} in this optimizer")
            for i, (c, s) in enumerate(zip(current, saved)):
                if not isinstance(s, Tensor):
                    raise ValueError(f"{where}: master {i} of group {gi} is a "
                                     f"{type(s).__name__}, not a tensor")
                for what, got, here in (("size", tuple(s.shape), tuple(c.shape)),
                                        ("dtype", s.dtype, c.dtype)):
                    if got != here:
                        raise ValueError(f"{where}: master {i} of group {gi} has {what} "
                                         f"{got} in the state_dict, {here} here")
        self._check_inner_state_dict(sd["optimizer_state_dict"], where)

    def _check_inner_state_dict(self, inner: Any, where: str) -> None:
        """Same groups and sizes, saved by the same kind of optimizer: not when a group lacks
        non-flag ``defaults`` of this one while having unknown options, or state keys are
        neither within the other. Scheduler or torch-version keys are accepted."""
        opt = self.optimizer
        kind = type(opt).__name__
        if not isinstance(inner, dict):
            raise ValueError(f"{where}: 'optimizer_state_dict' is not an optimizer state_dict "
                             f"(a dict), got {type(inner).__name__}")
        for key, expected_type in (("state", dict), ("param_groups", (list, tuple))):
            if key not in inner:
                raise ValueError(f"{where}: 'optimizer_state_dict' has no '{key}' (an "
                                 f"optimizer state_dict has 'state' and 'param_groups')")
            if not isinstance(inner[key], expected_type):
                raise ValueError(f"{where}: 'optimizer_state_dict'['{key}'] is a "
                                 f"{type(inner[key]).__name__}, expected a "
                                 f"{'dict' if key == 'state' else 'list'}")
        saved_groups = inner["param_groups"]
        if len(saved_groups) != len(opt.param_groups):
            raise ValueError(f"{where}: the wrapped optimizer's state_dict has "
                             f"{len(saved_groups)} parameter groups, this one has "
                             f"{len(opt.param_groups)}")
        params_by_id = {}
        not_options = {"params", "param_names"}
        for gi, (g, sg) in enumerate(zip(opt.param_groups, saved_groups)):
            # 'params' always, 'lr' where the optimizer has one: torch loads a group
            # without them, and the next step fails on the missing key.
            for key in ("params", "lr"):
                if not isinstance(sg, dict) or key not in sg and key in g:
                    raise ValueError(f"{where}: parameter group {gi} of the wrapped optimizer's "
                                     f"state_dict has no '{key}'")
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
                here = current.get(key)
                expected = (here.shape if isinstance(here, Tensor)
                            else p.shape if key in _PARAM_SHAPED_STATE else None)
                if not isinstance(value, Tensor) or key == "step" or expected is None:
                    continue
                if value.shape != expected:
                    raise ValueError(f"{where}: state '{key}' of parameter {pid} has size "
                                     f"{tuple(value.shape)} in the state_dict, expected "
                                     f"{tuple(expected)}")
                if value.is_floating_point() != p.is_floating_point():
                    raise ValueError(f"{where}: state '{key}' of parameter {pid} has dtype "
                                     f"{value.dtype}, its parameter {p.dtype}")


class LegacyFP16_Optimizer(FP16_Optimizer):
    """Apex's 2019 ``apex.optimizers.FP16_Optimizer`` (also
    ``apex.contrib.optimizers.FP16_Optimizer``; pytorch-pretrained-BERT's examples), as
    ``mixedprec.optimizers.FP16_Optimizer``: :class:`FP16_Optimizer` with that class's
    defaults. Apex's was "designed only to wrap FusedAdam": it flattened each group
    and called ``FusedAdam.step(grads=..., output_params=..., scale=...,
    grad_norms=...)``; here the wrapped optimizer (any) steps fp32 masters with
    unscaled gradients, and :class:`mixedprec.optimizers.FusedAdam` clips them to its
    ``max_grad_norm`` itself, per group as Apex did. Differs from Apex: no flat
    buffers (``fp16_groups_flat``/``fp32_groups_flat``), the state dict is
    :class:`FP16_Optimizer`'s (a 2019 checkpoint does not load), overflows summarised
    once at exit as by :class:`FP16_Optimizer`.

    ``dynamic_loss_scale=True``: the scale starts at 2**16, halves on an overflow (not
    below 1, the step skipped) and doubles after 1000 clean steps, as in Apex;
    ``dynamic_loss_args`` is rejected, as Apex did. ``zero_grad`` sets the model's
    gradients to None by default."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[dict] = None,
                 verbose: bool = True):
        if dynamic_loss_args is not None:
            raise ValueError("FP16_Optimizer (apex.optimizers): dynamic_loss_args is not "
                             "supported, as in Apex; expected None (use "
                             "mixedprec.fp16_utils.FP16_Optimizer for custom arguments)")
        args = dict(init_scale=2.0**16, scale_factor=2.0, scale_window=1000,
                    min_loss_scale=1.0) if dynamic_loss_scale else None
        super().__init__(init_optimizer, static_loss_scale, dynamic_loss_scale, args, verbose)

    def zero_grad(self, set_grads_to_None: bool = True) -> None:  # Apex's name
        super().zero_grad(set_grads_to_None)


# Apex's FP16_Optimizer pickled its scaler into state_dict(); torch.load(weights_only=True),
# torch's default since 2.6, loads those names as this module's classes.
# (apex.amp.scaler.LossScaler, which it pickled from 2019 on, comes back as a
# DynamicLossScaler or, for a static scale, a LossScaler: see LossScaler._from_apex_amp.)
torch.serialization.add_safe_globals([
    (LossScaler, "apex.fp16_utils.loss_scaler.LossScaler"),
    (DynamicLossScaler, "apex.fp16_utils.loss_scaler.DynamicLossScaler"),
    (DynamicLossScaler, "apex.amp.scaler.LossScaler"),
])
