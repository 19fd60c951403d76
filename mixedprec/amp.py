"""Apex's ``amp`` API on mixedprec: ``initialize``, ``scale_loss``, ``master_params``,
``state_dict``/``load_state_dict`` and the function-cast registry.

What differs from Apex:

* O1 runs the model's forward under ``torch.autocast`` instead of patching torch's
  functions globally. ``cast_model_type=torch.bfloat16`` selects bf16 autocast at O1,
  and bf16 weights at O2/O3; with bf16 the loss scale defaults to a static 1.0 (bf16
  has fp32's exponent range).
* ``initialize`` returns the models wrapped in :class:`AmpModel` (it casts inputs and
  outputs, or enters autocast, around the user's module; ``state_dict`` keeps the
  module's own keys) instead of patching ``forward``. Optimizers are returned as given:
  mixedprec's fused optimizers keep fp32 masters in their state and take the loss
  scale and overflow flag through ``grad_scale``/``found_inf``; other optimizers get fp32
  master parameters (O2) and a step pre- and post-hook (``register_step_pre_hook``).
* With mixedprec's fused optimizers nothing reads a device value on the host. With
  other optimizers the pre-hook reads the overflow flag once per step (as Apex did) to
  drop the gradients of a skipped step.
* ``initialize`` may be called again for new models and optimizers.
* ``state_dict`` also carries the O2 master weights of non-fused optimizers, so a
  resumed run continues bit for bit.
* Overflow skips are reported through ``logging`` (logger ``mixedprec.amp``), rate
  limited, and read without stalling the device.
"""

import contextlib
import functools
import logging
import time
import weakref
from collections import deque
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor, nn

from . import ops
from .fp16_utils import convert_network
from .optimizers import _FusedOptimizer

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "half_function", "float_function", "promote_function", "register_half_function",
    "register_float_function", "register_promote_function", "disable_casts", "AmpModel",
]

logger = logging.getLogger("mixedprec.amp")

# Apex's opt levels.
_OPT_LEVELS: Dict[str, Dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}
_HALF = (torch.float16, torch.bfloat16)


def _as_bool(name: str, value: Any) -> Optional[bool]:
    """Apex accepted the strings "True" and "False" for boolean options."""
    if value in ("True", "False"):
        return value == "True"
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"amp.initialize: {name} must be True, False, 'True', 'False' or None, "
                     f"got {value!r}")


class Properties:
    """The resolved options of one ``initialize`` call, validated as Apex did."""

    def __init__(self, opt_level: str, overrides: Dict[str, Any]):
        if opt_level not in _OPT_LEVELS:
            raise ValueError(
                f"amp.initialize: unexpected opt_level {opt_level!r}; options are 'O0', 'O1', "
                "'O2', 'O3' (the prefix is the letter O, not the number zero)")
        self.opt_level = opt_level
        self.options = dict(_OPT_LEVELS[opt_level], cast_model_outputs=None)
        bf16 = overrides.get("cast_model_type") is torch.bfloat16
        if bf16 and overrides.get("loss_scale") is None and opt_level != "O0":
            self.options["loss_scale"] = 1.0  # bf16 has fp32's range: no scaling needed
        for name, value in overrides.items():
            if value is not None:
                self._set(name, value)

    def _set(self, name: str, value: Any) -> None:
        o1 = self.opt_level == "O1"
        if name == "cast_model_type":
            if value not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"amp.initialize: cast_model_type must be torch.float32, "
                                 f"torch.float16 or torch.bfloat16, got {value!r}")
            if o1 and value is torch.float16:
                raise ValueError(
                    "amp.initialize: with opt_level O1 the model weights stay fp32 (casts are "
                    "inserted around functions), so cast_model_type=torch.float16 is "
                    "rejected; use O2 or O3 to cast the model, or torch.bfloat16 for bf16 "
                    "autocast at O1")
        elif name == "patch_torch_functions":
            value = _as_bool(name, value)
            if value and not o1:
                raise ValueError("amp.initialize: patch_torch_functions=True is only valid "
                                 "with opt_level='O1'")
        elif name == "keep_batchnorm_fp32":
            value = _as_bool(name, value)
            if o1:
                raise ValueError("amp.initialize: with opt_level O1 batchnorm already runs in "
                                 f"fp32, so keep_batchnorm_fp32 must be None, got {value!r}")
        elif name == "master_weights":
            value = _as_bool(name, value)
            if o1:
                raise ValueError("amp.initialize: master_weights makes no sense with O1, whose "
                                 "model weights are fp32 already")
        elif name == "loss_scale":
            if value != "dynamic":
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise ValueError("amp.initialize: loss_scale must be 'dynamic' or a "
                                     f"number, got {value!r}") from None
                if not value > 0:
                    raise ValueError(f"amp.initialize: loss_scale must be > 0, got {value}")
        elif name == "cast_model_outputs":
            if value not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError("amp.initialize: cast_model_outputs must be a float dtype, "
                                 f"got {value!r}")
        self.options[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["options"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"Properties(opt_level={self.opt_level!r}, {self.options})"


class LossScaler:
    """One loss's scale on the device: static, or dynamic with Apex's defaults (start
    2**16, halve on overflow, double after 2000 clean steps) and a floor and ceiling."""

    def __init__(self, loss_scale: Any, min_loss_scale: Optional[float],
                 max_loss_scale: float, init_scale: float = 2.0**16,
                 scale_window: int = 2000):
        self.dynamic = loss_scale == "dynamic"
        self.min_scale = float(min_loss_scale or 0.0)
        self.max_scale = float(max_loss_scale)
        self.scale_window = scale_window
        start = min(init_scale, self.max_scale) if self.dynamic else float(loss_scale)
        self.scale = torch.full((1,), start, dtype=torch.float32)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32)
        self.hysteresis_tracker = torch.ones(1, dtype=torch.int32)

    def loss_scale(self) -> float:
        """The current scale as a Python float (Apex's name; reads the device)."""
        return float(self.scale.item())  # sync-ok: an explicit read by the caller

    def to(self, device: torch.device) -> None:
        for name in ("scale", "growth_tracker", "hysteresis_tracker"):
            setattr(self, name, getattr(self, name).to(device))

    def update(self, found_inf: Tensor) -> None:
        if self.dynamic:
            ops.update_loss_scale_(self.scale, self.growth_tracker, self.hysteresis_tracker,
                                   found_inf, 2.0, 0.5, self.scale_window, 1, self.min_scale,
                                   self.max_scale)

    def state_dict(self) -> Dict[str, Any]:
        return {"loss_scale": float(self.scale.item()),  # sync-ok: checkpointing
                "unskipped": int(self.growth_tracker.item())}  # sync-ok: checkpointing

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.scale.fill_(float(sd["loss_scale"]))
        self.growth_tracker.fill_(int(sd["unskipped"]))


class _OverflowReporter:
    """Logs skipped steps without stalling the device: each step's flag and scale are
    copied to the host asynchronously and read once the copy is done. At most one
    message per ``interval`` seconds; the skips in between are counted in it."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self.pending: deque = deque()
        self.suppressed = 0
        self.last_log = -float("inf")

    def record(self, loss_id: int, found_inf: Tensor, scale: Tensor) -> None:
        if not logger.isEnabledFor(logging.WARNING):
            return
        values = torch.cat([found_inf.reshape(1), scale.reshape(1)])
        event = None
        if values.is_cuda:
            host = torch.empty(2, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self.pending.append((loss_id, values, event))
        while self.pending and (self.pending[0][2] is None or self.pending[0][2].query()):
            self._report(*self.pending.popleft()[:2])

    def _report(self, loss_id: int, values: Tensor) -> None:
        found_inf, scale = values.tolist()  # sync-ok: host memory, copy already complete
        if found_inf == 0:
            return
        now = time.monotonic()
        if now - self.last_log < self.interval:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more since the last message)" if self.suppressed else ""
        logger.warning("Gradient overflow: skipping step, loss scaler %d reducing the loss "
                       "scale to %g%s", loss_id, scale, more)
        self.suppressed = 0
        self.last_log = now


class _AmpState:
    """What one ``initialize`` call set up."""

    def __init__(self, props: Properties, num_losses: int, min_loss_scale, max_loss_scale):
        self.props = props
        self.loss_scalers = [LossScaler(props.loss_scale, min_loss_scale, max_loss_scale)
                             for _ in range(num_losses)]
        self.optimizers: List["_OptimizerAmp"] = []
        self.reporter = _OverflowReporter()

    @property
    def opt_properties(self) -> Properties:
        """Apex's name for ``props``, read by some legacy scripts."""
        return self.props


class _OptimizerAmp:
    """amp's bookkeeping for one optimizer: its masters (O2, non-fused), the overflow
    flag of the gradients gathered since its last step, and the hooks around step."""

    def __init__(self, optimizer: torch.optim.Optimizer, state: _AmpState,
                 masters: Optional[Dict[Tensor, Tensor]]):
        self.optimizer = weakref.ref(optimizer)
        self.state = state
        self.fused = isinstance(optimizer, _FusedOptimizer)
        self.masters = masters  # model param -> fp32 master (non-fused O2 only)
        self.model_of = {m: p for p, m in (masters or {}).items()}
        self.found_inf: Optional[Tensor] = None
        self.grads_scaled = False  # grads gathered with delay_unscale still carry the scale
        self.pending_scale: Optional[Tensor] = None  # the scale a fused step will divide by
        self.stash: List[Optional[Tensor]] = []  # gradients set aside during a backward
        self.stash_scale: Optional[Tensor] = None  # the scale they carry (fused only)
        if not self.fused:
            optimizer.register_step_pre_hook(self._before_step)
            optimizer.register_step_post_hook(self._after_step)
        else:
            optimizer.register_step_post_hook(self._after_fused_step)

    def model_params(self) -> List[Tensor]:
        """The parameters whose gradients backward writes (the model's, not masters)."""
        return [self.model_of.get(p, p) for g in self.optimizer().param_groups
                for p in g["params"]]

    def flag(self, device: torch.device) -> Tensor:
        if self.found_inf is None:
            self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        return self.found_inf

    def _before_step(self, optimizer, args, kwargs) -> None:
        # One host read per step, as Apex: a skipped step sees no gradients at all.
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.found_inf is not None and self.found_inf.item() != 0:  # sync-ok: see above
            for p in params:
                p.grad = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.masters:
            model = list(self.masters)
            ops.multi_tensor_copy_([self.masters[p] for p in model], model)
        self._reset()

    def _after_fused_step(self, optimizer, args, kwargs) -> None:
        for name in ("grad_scale", "found_inf"):  # used by one step, as GradScaler does
            if hasattr(optimizer, name):
                delattr(optimizer, name)
        self._reset()

    def _reset(self) -> None:
        if self.found_inf is not None:
            self.found_inf.zero_()
        self.grads_scaled = False
        self.pending_scale = None


_optimizer_amp: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerAmp]" = (
    weakref.WeakKeyDictionary())
_disabled: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_current: Optional[_AmpState] = None
_registered_casts: List[tuple] = []


class AmpModel(nn.Module):
    """The model ``initialize`` returns: ``module`` with amp's casts around its forward.

    O1 runs the forward under ``torch.autocast`` (fp16, or bf16 with
    ``cast_model_type=torch.bfloat16``); O2/O3 cast floating-point inputs to the model's
    dtype, as Apex did. Outputs are cast to ``cast_model_outputs``, by default float32
    (at O1 too: Apex ran the loss functions after the model in fp32). Other
    attributes are looked up on ``module``; ``state_dict`` and ``load_state_dict`` are
    the module's own, so checkpoints keep their keys.
    """

    def __init__(self, module: nn.Module, props: Properties):
        super().__init__()
        self.module = module
        self._autocast_dtype = None
        self._input_dtype = None
        self._output_dtype = props.cast_model_outputs
        if props.patch_torch_functions:
            self._autocast_dtype = props.cast_model_type or torch.float16
            # Apex's O1 ran loss functions in fp32 wherever they were called; autocast
            # covers only the forward, so the outputs leave it as fp32.
            self._output_dtype = props.cast_model_outputs or torch.float32
        elif props.cast_model_type is not None and props.cast_model_type != torch.float32:
            self._input_dtype = props.cast_model_type
            self._output_dtype = props.cast_model_outputs or torch.float32

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._input_dtype is not None:
            args, kwargs = _cast((args, kwargs), self._input_dtype)
        if self._autocast_dtype is not None:
            device_type = _device_type(self.module)
            with torch.autocast(device_type, dtype=self._autocast_dtype):
                out = self.module(*args, **kwargs)
        else:
            out = self.module(*args, **kwargs)
        return out if self._output_dtype is None else _cast(out, self._output_dtype)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def state_dict(self, *args: Any, **kwargs: Any):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _device_type(module: nn.Module) -> str:
    for t in module.parameters():
        return t.device.type
    for t in module.buffers():
        return t.device.type
    return "cpu"


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Casts the floating-point tensors in nested lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [_cast(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return type(value)((k, _cast(v, dtype)) for k, v in value.items())
    return value


def _as_list(value: Any) -> List[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def initialize(models, optimizers=None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale=None, cast_model_outputs=None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale=None,
               max_loss_scale: float = 2.0**24):
    """Prepares models and optimizers for mixed precision at an Apex opt level.

    O0: fp32. O1: autocast around the forward, dynamic loss scaling. O2: the model in
    fp16 (bf16 with ``cast_model_type=torch.bfloat16``) with batchnorm in fp32, fp32
    master weights, dynamic loss scaling. O3: the model entirely in fp16/bf16. The
    keyword overrides are validated as Apex did (strings such as ``"True"`` and
    ``"128.0"`` are accepted). Returns models and optimizers in the shape they were
    given (a model or a list; see :class:`AmpModel`). May be called again for other
    models and optimizers; each optimizer only once.
    """
    global _current
    if not enabled:
        for o in _as_list(optimizers or []):
            _disabled.add(o)
        return models if optimizers is None else (models, optimizers)
    model_list, optimizer_list = _as_list(models), _as_list(optimizers or [])
    for m in model_list:
        if isinstance(m, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise ValueError(
                "amp.initialize: the model is already wrapped in "
                f"{type(m).__name__}; apply parallel wrappers to the models amp.initialize "
                "returns")
        if not isinstance(m, nn.Module):
            raise TypeError(f"amp.initialize: expected models to be nn.Module, got {type(m)}")
    for o in optimizer_list:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError("amp.initialize: expected optimizers to be torch.optim.Optimizer, "
                            f"got {type(o).__name__}")
        if o in _optimizer_amp:
            raise ValueError("amp.initialize: this optimizer was already passed to "
                             "amp.initialize; build a new one for new models")
    if len(set(map(id, optimizer_list))) != len(optimizer_list):
        raise ValueError("amp.initialize: the same optimizer is listed twice")
    if not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be an int >= 1, got {num_losses!r}")
    props = Properties(opt_level, dict(
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs))
    if verbosity:
        logger.info("amp: %s", props)

    state = _AmpState(props, num_losses, min_loss_scale, max_loss_scale)
    # At O1 cast_model_type picks the autocast dtype; the weights stay fp32.
    dtype = None if props.patch_torch_functions else props.cast_model_type
    casting = dtype is not None and dtype != torch.float32
    # fp32 values of every parameter before the cast: exact master weights.
    fp32 = {p: p.detach().to(torch.float32, copy=True)
            for m in model_list for p in m.parameters()} if casting else {}
    for m in model_list:
        if casting and props.keep_batchnorm_fp32:
            convert_network(m, dtype)
        elif dtype is not None:
            m.to(dtype)
    for o in optimizer_list:
        masters = None
        if props.master_weights and isinstance(o, _FusedOptimizer):
            o.master_weights = True
            for p in (p for g in o.param_groups for p in g["params"]):
                if p.dtype in _HALF and p in fp32:
                    o.state[p]["master_param"] = fp32[p]
        if isinstance(o, _FusedOptimizer):
            o._invalidate_plans()  # its state and the model's dtypes changed here
        elif props.master_weights:
            masters = _use_master_params(o, fp32)
        amp = _OptimizerAmp(o, state, masters)
        state.optimizers.append(amp)
        _optimizer_amp[o] = amp
    if props.patch_torch_functions:
        for module, name, wrap in _registered_casts:
            setattr(module, name, wrap(getattr(module, name)))
        _registered_casts.clear()
    _current = state

    wrapped = [AmpModel(m, props) for m in model_list]
    out_models = wrapped if isinstance(models, (list, tuple)) else wrapped[0]
    if optimizers is None:
        return out_models
    return out_models, optimizers


def _use_master_params(optimizer: torch.optim.Optimizer,
                       fp32: Dict[Tensor, Tensor]) -> Dict[Tensor, Tensor]:
    """Makes a non-fused optimizer step fp32 masters of the half model params (Apex O2):
    its param groups and state now hold the masters. Returns model param -> master."""
    masters: Dict[Tensor, Tensor] = {}
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            if p.dtype in _HALF:
                master = nn.Parameter(fp32.get(p, p.detach().float()),
                                      requires_grad=p.requires_grad)
                masters[p] = master
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                new_params.append(master)
            else:
                new_params.append(p)
        group["params"] = new_params
    return masters


@contextlib.contextmanager
def scale_loss(loss: Tensor, optimizers, loss_id: int = 0, model=None,
               delay_unscale: bool = False, delay_overflow_check: bool = False
               ) -> Iterator[Tensor]:
    """Yields ``loss * scale`` for ``backward()``; on exit the gradients are unscaled
    (or handed to the fused optimizer with their scale), overflow is checked on the
    device, and the loss scale is updated. An overflow in any optimizer's gradients
    skips the steps of all the optimizers given. With ``delay_unscale=True`` the
    gradients stay scaled until a later ``scale_loss`` exit (gradient accumulation).
    Apex's ``model`` and ``delay_overflow_check`` are accepted and have no effect."""
    optimizer_list = _as_list(optimizers)
    amps = [_optimizer_amp.get(o) for o in optimizer_list]
    if not amps or all(a is None and o in _disabled for a, o in zip(amps, optimizer_list)):
        yield loss  # amp is off for these optimizers (initialize(enabled=False))
        return
    if any(a is None for a in amps):
        raise ValueError("amp.scale_loss: every optimizer must have been passed to "
                         "amp.initialize")
    state = amps[0].state
    if not 0 <= loss_id < len(state.loss_scalers):
        raise ValueError(f"amp.scale_loss: loss_id must be in [0, {len(state.loss_scalers)}), "
                         f"got {loss_id}")
    scaler = state.loss_scalers[loss_id]
    if scaler.scale.device != loss.device:
        scaler.to(loss.device)
    # The scale this backward uses; update() below changes scaler.scale in place.
    scale = scaler.scale.clone()
    for amp in amps:
        _before_backward(amp, scale)
    try:
        yield loss.float() * scale.reshape(())
    except BaseException:
        for amp in amps:
            _restore_stash(amp)
        raise
    if delay_unscale:
        for amp in amps:
            _restore_stash(amp, scale)
            amp.pending_scale = scale if amp.fused else None
            amp.grads_scaled = True
        return

    found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
    for amp in amps:
        _after_backward(amp, scale, found_inf)
    # Only now is found_inf complete: every optimizer skips if any gradient overflowed.
    for amp in amps:
        if scaler.dynamic:
            amp.flag(found_inf.device).add_(found_inf)
        if amp.fused:
            _hand_scaling(amp.optimizer(), amp.pending_scale, amp.found_inf)
    if scaler.dynamic:  # a static scale never skips a step
        scaler.update(found_inf)
        state.reporter.record(loss_id, found_inf, scaler.scale)


def _hand_scaling(optimizer, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    """The one channel to a fused optimizer, as torch.amp.GradScaler uses it."""
    optimizer.grad_scale = grad_scale
    optimizer.found_inf = found_inf


def _inverse(scale: Tensor) -> Tensor:
    """1 / scale on the device, rounded once from double (as torch's GradScaler)."""
    return scale.double().reciprocal().float()


def _grads(params: Iterable[Tensor]) -> List[Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _before_backward(amp: _OptimizerAmp, scale: Tensor) -> None:
    """Prepares the gradients already present for this loss's backward.

    Gradients an earlier loss left scaled for a fused update, and unscaled ones of a
    non-fused optimizer, are set aside so that this loss's overflow check sees only
    its own gradients; they are added back afterwards, at the right scale. Other
    gradients present at a fused optimizer (zeros after ``zero_grad(set_to_none=False)``)
    are brought to this loss's scale in place. Gradients gathered under
    ``delay_unscale`` carry this scale already."""
    amp.stash, amp.stash_scale = [], None
    if amp.grads_scaled:
        return
    params = amp.model_params()
    if amp.fused and amp.pending_scale is None:
        grads = _grads(params)
        if grads:
            ops.multi_tensor_unscale_(grads, amp.flag(scale.device), scale)
        return
    amp.stash_scale = amp.pending_scale if amp.fused else None
    for p in params:
        amp.stash.append(p.grad)
        p.grad = None


def _restore_stash(amp: _OptimizerAmp, scale: Optional[Tensor] = None) -> None:
    """Adds the gradients set aside back; those a fused update will unscale are first
    brought from their scale to `scale`."""
    stash = [(p, old) for p, old in zip(amp.model_params(), amp.stash) if old is not None]
    if stash and scale is not None and amp.stash_scale is not None:
        ops.multi_tensor_unscale_([old for _, old in stash], amp.flag(scale.device),
                                  scale / amp.stash_scale)
    for p, old in stash:
        p.grad = old if p.grad is None else p.grad.add_(old)
    amp.stash, amp.stash_scale = [], None


def _after_backward(amp: _OptimizerAmp, scale: Tensor, found_inf: Tensor) -> None:
    """Checks one optimizer's new gradients for overflow into found_inf and unscales
    them, unless its fused update will."""
    amp.grads_scaled = False
    params = [p for p in amp.model_params() if p.grad is not None]
    if amp.fused:
        ops.multi_tensor_check_finite_(_grads(params), found_inf)
        _restore_stash(amp, scale)
        amp.pending_scale = scale
        return
    inv_scale = _inverse(scale)
    halves = [p for p in params if amp.masters and p in amp.masters]
    others = [p for p in params if not (amp.masters and p in amp.masters)]
    if halves:  # O2: into fp32 master grads, added to those of an earlier loss
        masters = [amp.masters[p] for p in halves]
        dst = [torch.empty_like(m) for m in masters]
        ops.multi_tensor_unscale_to_(_grads(halves), dst, found_inf, inv_scale)
        for p, m, g in zip(halves, masters, dst):
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None
    if others:
        ops.multi_tensor_unscale_(_grads(others), found_inf, inv_scale)
    _restore_stash(amp)


def _materialize_unscaled_grads(amp: _OptimizerAmp) -> None:
    """For clipping through master_params: turns the scaled gradients a fused
    optimizer would unscale itself into unscaled fp32 master gradients (the optimizer
    reads a master's .grad when it has one), or unscales fp32 ones in place."""
    if amp.pending_scale is None:
        return
    optimizer = amp.optimizer()
    inv_scale = _inverse(amp.pending_scale)
    flag = amp.flag(amp.pending_scale.device)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    with_master = [p for p in params if "master_param" in optimizer.state.get(p, {})]
    without = [p for p in params if "master_param" not in optimizer.state.get(p, {})]
    if with_master:
        dst = [torch.empty_like(optimizer.state[p]["master_param"]) for p in with_master]
        ops.multi_tensor_unscale_to_(_grads(with_master), dst, flag, inv_scale)
        for p, g in zip(with_master, dst):
            optimizer.state[p]["master_param"].grad = g
            p.grad = None
    if without:
        ops.multi_tensor_unscale_(_grads(without), flag, inv_scale)
    amp.pending_scale = None
    _hand_scaling(optimizer, None, amp.found_inf)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The fp32 parameters the optimizer updates: its master weights at O2, else its
    parameters. Their ``.grad`` is unscaled, so they serve for gradient clipping
    between ``scale_loss`` and ``step`` (with a fused optimizer this materializes
    the fp32 master gradients its update then reads)."""
    amp = _optimizer_amp.get(optimizer)
    if amp is not None and amp.fused:
        _materialize_unscaled_grads(amp)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            yield state.get("master_param", p) if isinstance(optimizer, _FusedOptimizer) else p


def state_dict(destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The loss scalers' state (``loss_scaler0``, ... with ``loss_scale`` and
    ``unskipped``, as in Apex) and the O2 master weights of non-fused optimizers
    (``master_params0``, ... in the order of ``initialize``)."""
    if _current is None:
        raise RuntimeError("amp.state_dict: amp.initialize has not been called")
    out = {} if destination is None else destination
    for i, scaler in enumerate(_current.loss_scalers):
        out[f"loss_scaler{i}"] = scaler.state_dict()
    for i, amp in enumerate(_current.optimizers):
        if amp.masters:
            out[f"master_params{i}"] = [m.detach().clone() for m in amp.masters.values()]
    return out


def load_state_dict(state_dict: Dict[str, Any]) -> None:
    """Restores what :func:`state_dict` saved (call it after ``initialize``); the
    master weights are copied exactly and into the model."""
    if _current is None:
        raise RuntimeError("amp.load_state_dict: amp.initialize has not been called")
    scalers = [k for k in state_dict if k.startswith("loss_scaler")]
    if len(scalers) != len(_current.loss_scalers):
        raise ValueError(f"amp.load_state_dict: the state dict has {len(scalers)} loss "
                         f"scalers, amp was initialized with {len(_current.loss_scalers)}")
    for i, amp in enumerate(_current.optimizers):
        saved = state_dict.get(f"master_params{i}")
        if saved is None or not amp.masters:
            continue
        current = list(amp.masters.values())
        if len(saved) != len(current) or any(
                s.shape != c.shape for s, c in zip(saved, current)):
            raise ValueError(f"amp.load_state_dict: master_params{i} do not match optimizer "
                             f"{i}'s parameters in number or shape")
    for i, scaler in enumerate(_current.loss_scalers):
        scaler.load_state_dict(state_dict[f"loss_scaler{i}"])
    for i, amp in enumerate(_current.optimizers):
        saved = state_dict.get(f"master_params{i}")
        if saved is None or not amp.masters:
            continue
        with torch.no_grad():
            for master, value in zip(amp.masters.values(), saved):
                master.copy_(value)
            ops.multi_tensor_copy_(list(amp.masters.values()), list(amp.masters))


class _CurrentAmpState:
    """Apex's ``amp._amp_state``: legacy scripts import it early and later read
    ``loss_scalers[i].loss_scale()`` or ``opt_properties``; this follows the latest
    ``initialize``."""

    def __getattr__(self, name: str) -> Any:
        if _current is None:
            raise AttributeError(f"amp._amp_state.{name}: amp.initialize has not been called")
        return getattr(_current, name)


_amp_state = _CurrentAmpState()


# --- function casts (O1) -----------------------------------------------------------

def _autocast_state(args: Sequence[Any]):
    device_type = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
    return device_type, torch.is_autocast_enabled(device_type)


def _cast_function(fn, dtype_of):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type, enabled = _autocast_state(list(args) + list(kwargs.values()))
        if not enabled:
            return fn(*args, **kwargs)
        dtype = dtype_of(device_type, args, kwargs)
        with torch.autocast(device_type, enabled=False):
            args, kwargs = _cast((args, kwargs), dtype)
            return fn(*args, **kwargs)
    return wrapper


def half_function(fn):
    """Runs ``fn`` in the autocast dtype (fp16/bf16) with its inputs cast, under O1."""
    return _cast_function(fn, lambda device_type, a, k: torch.get_autocast_dtype(device_type))


def float_function(fn):
    """Runs ``fn`` in fp32 with its inputs cast, under O1."""
    return _cast_function(fn, lambda device_type, a, k: torch.float32)


def promote_function(fn):
    """Runs ``fn`` with its floating-point inputs cast to the widest of their dtypes."""
    def widest(device_type, args, kwargs):
        dtypes = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
    return _cast_function(fn, widest)


def _tensors(value: Any) -> Iterable[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def register_half_function(module, name: str) -> None:
    """Wraps ``module.name`` with :func:`half_function` at the next O1 ``initialize``
    (Apex's registry: this replaces the attribute on ``module``, as Apex did)."""
    _register(module, name, half_function)


def register_float_function(module, name: str) -> None:
    """Like :func:`register_half_function`, with :func:`float_function`."""
    _register(module, name, float_function)


def register_promote_function(module, name: str) -> None:
    """Like :func:`register_half_function`, with :func:`promote_function`."""
    _register(module, name, promote_function)


def _register(module, name: str, wrap) -> None:
    if not hasattr(module, name):
        raise ValueError(f"amp: {module!r} has no attribute {name!r}")
    _registered_casts.append((module, name, wrap))


@contextlib.contextmanager
def disable_casts():
    """Turns autocast off inside the block (on CPU and CUDA)."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield
