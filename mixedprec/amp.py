"""Apex's ``amp`` API on mixedprec: ``initialize``, ``scale_loss``, ``master_params``,
``state_dict``/``load_state_dict`` and the function-cast registry.

What differs from Apex:

* O1 runs the model's forward under ``torch.autocast`` instead of patching torch's
  functions globally. ``cast_model_type=torch.bfloat16`` selects bf16 autocast at O1,
  and bf16 weights at O2/O3; with bf16 the loss scale defaults to a static 1.0 (bf16
  has fp32's exponent range).
* The compatibility alias: ``initialize`` returns the user's own model objects, and,
  as Apex did, sets an instance attribute ``model.forward`` that wraps the original
  bound forward with amp's casts (O1: autocast; O2/O3: floating inputs cast to the
  model's dtype; outputs cast to ``cast_model_outputs``, by default fp32). This is the
  one place mixedprec patches a user's object: Apex compatibility needs the object
  itself back (``isinstance``, indexing, parameter and ``state_dict`` names unchanged).
  A second ``initialize`` of the model replaces the wrapper, never nests it.
* Optimizers are returned as given. mixedprec's fused optimizers keep fp32 masters in
  their state and take the loss scale and the overflow flag through ``grad_scale`` and
  ``found_inf``, as ``torch.amp.GradScaler`` hands them: nothing reads a device value
  on the host. Other optimizers get fp32 master parameters (O2) and step hooks; the
  pre-hook reads the overflow flag once per step (as Apex did) to skip the step.
* The loss scalers are faces on :class:`mixedprec.loss_scale.LossScale`. A dynamic
  scale never goes below ``min_loss_scale``; left None, that floor is
  :data:`~mixedprec.loss_scale.DEFAULT_MIN_SCALE` (2**-24, not 0 as in Apex), so the
  scale never reaches 0.
* ``initialize`` may be called again for new models and optimizers.
* ``state_dict`` also carries the O2 master weights of non-fused optimizers, so a
  resumed run continues bit for bit; ``load_state_dict`` applies all of it or none.
* Overflow skips are reported through ``logging`` (logger ``mixedprec.amp``), rate
  limited, and read without stalling the device.
"""

import contextlib
import functools
import itertools
import logging
import math
import time
import weakref
from collections import deque
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch
from torch import Tensor, nn

from . import masters as _masters
from . import ops
from .fp16_utils import convert_network
from .loss_scale import DEFAULT_MIN_SCALE, LossScale, check_scale
from .optimizers import _FusedOptimizer

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "half_function", "float_function", "promote_function", "register_half_function",
    "register_float_function", "register_promote_function", "disable_casts",
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
        if name in ("cast_model_type", "cast_model_outputs"):
            if value not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"amp.initialize: {name} must be torch.float32, "
                                 f"torch.float16 or torch.bfloat16, got {value!r}")
            if name == "cast_model_type" and o1 and value is torch.float16:
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
        elif name in ("keep_batchnorm_fp32", "master_weights"):
            value = _as_bool(name, value)
            if o1:
                raise ValueError(f"amp.initialize: with opt_level O1 the weights (batchnorm "
                                 f"included) stay fp32, so {name} must be None, got {value!r}")
        elif name == "loss_scale":
            if value != "dynamic":
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise ValueError("amp.initialize: loss_scale must be 'dynamic' or a "
                                     f"number, got {value!r}") from None
                value = check_scale("amp.initialize", "loss_scale", value)
        self.options[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["options"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"Properties(opt_level={self.opt_level!r}, {self.options})"


class LossScaler:
    """Apex's loss scaler of one loss, a face on :class:`LossScale`: static, or dynamic
    with Apex's defaults (start at ``min(2**16, max_loss_scale)``, halve on overflow,
    double after 2000 clean steps, not above ``max_loss_scale`` nor below
    ``min_loss_scale``, whose default is ``DEFAULT_MIN_SCALE``). Apex's public names:
    ``loss_scale()``, ``dynamic`` and the ``state_dict`` entries ``loss_scale`` and
    ``unskipped``."""

    def __init__(self, loss_scale: Any, min_loss_scale: Optional[float] = None,
                 max_loss_scale: float = 2.0**24, init_scale: float = 2.0**16,
                 scale_window: int = 2000):
        self.dynamic = loss_scale == "dynamic"
        floor = DEFAULT_MIN_SCALE if min_loss_scale is None else min_loss_scale
        # Apex starts at min(init, max); a floor above that start raises the start.
        start = max(min(init_scale, max_loss_scale), floor) if self.dynamic else loss_scale
        self.core = LossScale(start, dynamic=self.dynamic, growth_factor=2.0,
                              backoff_factor=0.5, growth_interval=scale_window,
                              min_scale=floor, max_scale=max_loss_scale, owner="amp")

    def loss_scale(self) -> float:
        """The current scale as a Python float (Apex's name; reads the device)."""
        return self.core.get()

    def update(self, found_inf: Tensor) -> None:
        """One step of the dynamic rule, on the device."""
        self.core.update(found_inf)

    def state_dict(self) -> Dict[str, Any]:
        return {"loss_scale": self.core.get(),
                "unskipped": self.core.trackers()["growth_tracker"]}

    def load_state_dict(self, sd: Dict[str, Any], key: str = "the state",
                        check_only: bool = False) -> None:
        """Loads Apex's entry; checked first (by a scratch LossScale when
        ``check_only``), a bad one raises ValueError naming ``key``."""
        try:
            (LossScale() if check_only else self.core).load(sd["loss_scale"], sd["unskipped"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"amp.load_state_dict: expected {key} to be a dict with "
                             "'loss_scale' (finite, > 0) and 'unskipped' (an int >= 0), got "
                             f"{sd!r}: {err}") from None


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

    def __init__(self, props: Properties, scalers: List[LossScaler]):
        self.props = self.opt_properties = props  # Apex's name, read by legacy scripts
        self.loss_scalers = scalers
        self.optimizers: List["_OptimizerAmp"] = []
        self.reporter = _OverflowReporter()


class _OptimizerAmp:
    """amp's bookkeeping for one optimizer between two steps.

    ``found_inf``: the overflow flag of the gradients gathered since the last step
    (None: no ``scale_loss`` exit since then). ``carried``: the scale the model
    gradients carry (None: unscaled, or none gathered). ``delayed``: the loss id of a
    ``delay_unscale`` exit whose gradients are still scaled and unchecked.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: _AmpState,
                 masters: Optional[Dict[Tensor, Tensor]]):
        self.optimizer = weakref.ref(optimizer)
        self.state = state
        self.fused = isinstance(optimizer, _FusedOptimizer)
        self.masters = masters or {}  # model param -> fp32 master (non-fused O2 only)
        self.model_of = {m: p for p, m in self.masters.items()}
        self.found_inf: Optional[Tensor] = None
        self.carried: Optional[Tensor] = None
        self.delayed: Optional[int] = None
        self.stash: List[Optional[Tensor]] = []
        self.stash_scale: Optional[Tensor] = None
        self.skip = False
        if not self.fused:
            optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def model_params(self) -> List[Tensor]:
        """The parameters whose gradients backward writes (the model's, not masters)."""
        return [self.model_of.get(p, p) for g in self.optimizer().param_groups
                for p in g["params"]]

    def _before_step(self, optimizer, args, kwargs) -> None:
        # Non-fused only: a skipped step sees no gradients at all.
        flag = self.found_inf
        self.skip = flag is not None and flag.item() != 0  # sync-ok: once a step, as Apex
        if self.skip:
            for g in optimizer.param_groups:
                for p in g["params"]:
                    p.grad = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.fused:  # used by one step, as torch.amp.GradScaler does
            for name in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(name, None)
        elif self.masters and not self.skip:
            _masters.copy_to_model(list(self.masters.values()), list(self.masters))
        self.found_inf = self.carried = self.delayed = None
        self.skip = False

    # -- around one loss's backward --------------------------------------------------
    def before_backward(self, loss_id: int) -> None:
        """Sets aside the gradients gathered since the last step, if any, so that this
        loss's overflow check sees only its own and its unscale leaves theirs alone.
        Not needed for the first loss after a step (gradients present are taken as
        they are: None or zeros), nor after a ``delay_unscale`` exit of the same loss,
        whose gradients carry this loss's scale, unchecked."""
        self.stash, self.stash_scale = [], None
        if self.found_inf is None or self.delayed == loss_id:
            return
        self.stash_scale = self.carried
        for p in self.model_params():
            self.stash.append(p.grad)
            p.grad = None

    def restore(self, to_scale: Optional[Tensor]) -> None:
        """Adds the gradients set aside back, first brought from the scale they carry
        to ``to_scale`` (None: unscaled), since they join gradients at that scale (an
        overflow there counts for the step, not for this loss's scaler)."""
        stash = [(p, old) for p, old in zip(self.model_params(), self.stash) if old is not None]
        if stash and (to_scale is not None or self.stash_scale is not None):
            flag = self.found_inf  # not None: a stash exists only after an exit
            one = torch.ones((), dtype=torch.float32, device=flag.device)
            factor = (one if to_scale is None else to_scale) / (
                one if self.stash_scale is None else self.stash_scale)
            ops.multi_tensor_unscale_([old for _, old in stash], flag, factor)
        for p, old in stash:
            p.grad = old if p.grad is None else p.grad.add_(old)
        self.stash, self.stash_scale = [], None

    def abandon(self) -> None:
        """After an exception in the ``scale_loss`` block: the gradients set aside come
        back as they were."""
        for p, old in zip(self.model_params(), self.stash):
            p.grad = old

    def after_backward(self, scale: Tensor, found_inf: Tensor) -> None:
        """Checks this loss's new gradients for overflow into ``found_inf``: read-only
        for a fused optimizer (its update unscales), else unscaled into the fp32 masters
        (O2) or in place."""
        params = [p for p in self.model_params() if p.grad is not None]
        if self.fused:
            ops.multi_tensor_check_finite_([p.grad for p in params], found_inf)
            self.carried = scale
            self.restore(scale)
            return
        inv_scale = scale.double().reciprocal().float()  # as torch.amp.GradScaler
        halves = [p for p in params if p in self.masters]
        if halves:  # O2: added to the master gradients of an earlier loss
            _masters.unscale_into_masters(halves, [self.masters[p] for p in halves],
                                          found_inf, inv_scale, accumulate=True)
            for p in halves:
                p.grad = None
        others = [p.grad for p in params if p not in self.masters]
        if others:
            ops.multi_tensor_unscale_(others, found_inf, inv_scale)
        self.carried = None
        self.restore(None)

    def add_flag(self, found_inf: Optional[Tensor], device: torch.device) -> None:
        """Joins one loss's overflow flag (None: a static scale, which never skips) and
        hands the scale and flag to a fused optimizer."""
        if self.found_inf is None:
            self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if found_inf is not None:
            self.found_inf.add_(found_inf)
        if self.fused:
            self.hand_scaling()

    def hand_scaling(self) -> None:
        """The one channel to a fused optimizer, as torch.amp.GradScaler uses it."""
        self.optimizer().grad_scale, self.optimizer().found_inf = self.carried, self.found_inf

    def unscale_for_clipping(self) -> None:
        """For ``master_params`` with a fused optimizer: turns the scaled gradients its
        update would unscale into unscaled fp32 master gradients (the update then reads
        a master's ``.grad``), or unscales fp32 ones in place; ``grad_scale`` is None."""
        if self.carried is None or self.delayed is not None:
            return
        optimizer = self.optimizer()
        inv_scale = self.carried.double().reciprocal().float()
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        with_master = [p for p in params if "master_param" in optimizer.state.get(p, {})]
        if with_master:
            _masters.unscale_into_masters(
                with_master, [optimizer.state[p]["master_param"] for p in with_master],
                self.found_inf, inv_scale)
            for p in with_master:
                p.grad = None
        without = [p.grad for p in params if p.grad is not None]
        if without:
            ops.multi_tensor_unscale_(without, self.found_inf, inv_scale)
        self.carried = None
        self.hand_scaling()


_optimizer_amp: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerAmp]" = (
    weakref.WeakKeyDictionary())
_disabled: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_current: Optional[_AmpState] = None
_registered_casts: List[tuple] = []


class _AmpForward:
    """``model.forward`` after ``initialize`` (the compatibility alias, see the module
    docstring): the original bound forward with amp's casts around it. O1 runs it
    under ``torch.autocast``; O2/O3 cast floating-point inputs to the model's dtype.
    Outputs are cast to ``output_dtype`` (None: left as they are)."""

    def __init__(self, module, original, autocast_dtype, input_dtype, output_dtype):
        functools.update_wrapper(self, original)  # name, docstring, signature
        self.module = module  # (copy.deepcopy of the model rebinds both to the copy)
        self.original = original
        self.autocast_dtype = autocast_dtype
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.input_dtype)
        with (contextlib.nullcontext() if self.autocast_dtype is None else
              torch.autocast(_device_type(self.module), dtype=self.autocast_dtype)):
            out = self.original(*args, **kwargs)
        return out if self.output_dtype is None else _cast(out, self.output_dtype)


def _patch_forward(model: nn.Module, props: Properties) -> None:
    autocast_dtype = input_dtype = None
    output_dtype = props.cast_model_outputs
    if props.patch_torch_functions:
        autocast_dtype = props.cast_model_type or torch.float16
        # Apex's O1 ran loss functions in fp32 wherever they were called; autocast
        # covers only the forward, so the outputs leave it as fp32.
        output_dtype = output_dtype or torch.float32
    elif props.cast_model_type is not None and props.cast_model_type != torch.float32:
        input_dtype = props.cast_model_type
        output_dtype = output_dtype or torch.float32
    current = model.__dict__.get("forward")
    original = current.original if isinstance(current, _AmpForward) else model.forward
    if autocast_dtype is None and input_dtype is None and output_dtype is None:
        if isinstance(current, _AmpForward):  # O0 after another level: no casts
            del model.forward
        return
    model.forward = _AmpForward(model, original, autocast_dtype, input_dtype, output_dtype)


def _device_type(module: nn.Module) -> str:
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return "cpu" if first is None else first.device.type


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


def _loss_scalers(props: Properties, num_losses: Any, min_loss_scale: Any,
                  max_loss_scale: Any) -> List[LossScaler]:
    """The loss scalers, after checking their arguments (naming them)."""
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be an int >= 1, got {num_losses!r}")
    where = "amp.initialize"
    if min_loss_scale is not None:
        min_loss_scale = check_scale(where, "min_loss_scale", min_loss_scale)
    if not (isinstance(max_loss_scale, (int, float)) and max_loss_scale == math.inf):
        max_loss_scale = check_scale(where, "max_loss_scale", max_loss_scale)
    if min_loss_scale is not None and not min_loss_scale <= max_loss_scale:
        raise ValueError(f"{where}: expected min_loss_scale <= max_loss_scale, got "
                         f"min_loss_scale={min_loss_scale} and max_loss_scale={max_loss_scale}")
    return [LossScaler(props.loss_scale, min_loss_scale, float(max_loss_scale))
            for _ in range(num_losses)]


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
    ``"128.0"`` are accepted), and all arguments are checked before anything changes.
    ``min_loss_scale`` None means the floor ``DEFAULT_MIN_SCALE`` (2**-24).
    Returns the models and optimizers given, in the shape given; each model's
    ``forward`` is wrapped with the casts (see the module docstring). May be called
    again for other models and optimizers; each optimizer only once.
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
    props = Properties(opt_level, dict(
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs))
    state = _AmpState(props, _loss_scalers(props, num_losses, min_loss_scale, max_loss_scale))
    if verbosity:
        logger.info("amp: %s", props)

    # At O1 cast_model_type picks the autocast dtype; the weights stay fp32.
    dtype = None if props.patch_torch_functions else props.cast_model_type
    casting = dtype is not None and dtype != torch.float32
    # fp32 values of every parameter before the cast: exact master weights.
    fp32 = {p: _masters.make_master(p)
            for m in model_list for p in m.parameters()} if casting else {}
    for m in model_list:
        if casting and props.keep_batchnorm_fp32:
            convert_network(m, dtype)
        elif dtype is not None:
            m.to(dtype)
        _patch_forward(m, props)
    for o in optimizer_list:
        masters = None
        if isinstance(o, _FusedOptimizer):
            if props.master_weights:
                o.master_weights = True
                for p in (p for g in o.param_groups for p in g["params"]):
                    if _masters.needs_master(p) and p in fp32:
                        o.state[p]["master_param"] = fp32[p]
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
    return models if optimizers is None else (models, optimizers)


def _use_master_params(optimizer: torch.optim.Optimizer,
                       fp32: Dict[Tensor, Tensor]) -> Dict[Tensor, Tensor]:
    """Makes a non-fused optimizer step fp32 masters of the half model params (Apex O2):
    its param groups and state now hold the masters. Returns model param -> master."""
    masters: Dict[Tensor, Tensor] = {}
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            if _masters.needs_master(p):
                master = nn.Parameter(fp32[p] if p in fp32 else _masters.make_master(p),
                                      requires_grad=p.requires_grad)
                masters[p] = master
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                p = master
            new_params.append(p)
        group["params"] = new_params
    return masters


@contextlib.contextmanager
def scale_loss(loss: Tensor, optimizers, loss_id: int = 0, model=None,
               delay_unscale: bool = False, delay_overflow_check: bool = False
               ) -> Iterator[Tensor]:
    """Yields ``loss * scale`` for ``backward()``. On exit, one overflow check of the
    new gradients on the device; a fused optimizer is handed the scale and the flag
    (its update unscales, or is skipped, on the device), other optimizers' gradients
    are unscaled (into the fp32 masters at O2); then the loss scale is updated. An
    overflow in any optimizer's gradients skips the steps of all the optimizers given.
    With ``delay_unscale=True`` the gradients stay scaled and unchecked until the next
    ``scale_loss`` exit of the same loss (gradient accumulation). Apex's ``model`` and
    ``delay_overflow_check`` are accepted and have no effect."""
    optimizer_list = _as_list(optimizers)
    amps = [_optimizer_amp.get(o) for o in optimizer_list]
    if not amps or all(a is None and o in _disabled for a, o in zip(amps, optimizer_list)):
        yield loss  # amp is off for these optimizers (initialize(enabled=False))
        return
    if any(a is None for a in amps):
        raise ValueError("amp.scale_loss: every optimizer must have been passed to "
                         "amp.initialize")
    scalers = amps[0].state.loss_scalers
    if not 0 <= loss_id < len(scalers):
        raise ValueError(f"amp.scale_loss: loss_id must be in [0, {len(scalers)}), "
                         f"got {loss_id}")
    scaler = scalers[loss_id]
    # The scale this backward uses: the update below changes the scaler's in place.
    scale = scaler.core.place(loss.device).clone()
    for amp in amps:
        amp.before_backward(loss_id)
    try:
        yield loss.float() * scale
    except BaseException:
        for amp in amps:
            amp.abandon()
        raise
    found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
    for amp in amps:
        if delay_unscale:
            # The gradients set aside join this loss's, which stay at this scale.
            amp.restore(scale)
            amp.carried, amp.delayed = scale, loss_id
        else:
            amp.after_backward(scale, found_inf)
            amp.delayed = None
    # Only now is found_inf complete: every optimizer skips if any gradient overflowed.
    for amp in amps:
        amp.add_flag(found_inf if scaler.dynamic and not delay_unscale else None,
                     scale.device)
    if scaler.dynamic and not delay_unscale:  # a static scale never skips a step
        scaler.update(found_inf)
        amps[0].state.reporter.record(loss_id, found_inf, scaler.core.scale)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The fp32 parameters the optimizer updates: its master weights at O2, else its
    parameters. Their ``.grad`` is unscaled, so they serve for gradient clipping
    between ``scale_loss`` and ``step`` (with a fused optimizer this materializes
    the fp32 master gradients its update then reads)."""
    amp = _optimizer_amp.get(optimizer)
    if amp is not None and amp.fused:
        amp.unscale_for_clipping()
    fused = isinstance(optimizer, _FusedOptimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield optimizer.state.get(p, {}).get("master_param", p) if fused else p


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
    master weights are copied exactly and into the model. Every entry is checked
    first: a bad one raises ValueError naming its key, and nothing changes."""
    if _current is None:
        raise RuntimeError("amp.load_state_dict: amp.initialize has not been called")
    scalers = [k for k in state_dict if k.startswith("loss_scaler")]
    if len(scalers) != len(_current.loss_scalers):
        raise ValueError(f"amp.load_state_dict: the state dict has {len(scalers)} loss "
                         f"scalers, amp was initialized with {len(_current.loss_scalers)}")
    for check_only in (True, False):  # every entry is checked before any is loaded
        for i, scaler in enumerate(_current.loss_scalers):
            key = f"loss_scaler{i}"
            scaler.load_state_dict(state_dict.get(key), key, check_only)
        for i, amp in enumerate(_current.optimizers):
            saved, current = state_dict.get(f"master_params{i}"), list(amp.masters.values())
            if saved is None or not current:
                continue
            if check_only and (not isinstance(saved, (list, tuple)) or len(saved) != len(
                    current) or any(not isinstance(s, Tensor) or not s.is_floating_point()
                                    or s.shape != c.shape for s, c in zip(saved, current))):
                raise ValueError(f"amp.load_state_dict: expected master_params{i} to be a "
                                 f"list of {len(current)} float tensors with the shapes of "
                                 f"optimizer {i}'s master parameters")
            if not check_only:
                with torch.no_grad():
                    for master, value in zip(current, saved):
                        master.copy_(value)
                _masters.copy_to_model(current, list(amp.masters))


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

def _cast_function(fn, dtype_of):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = next((a.device.type for a in (*args, *kwargs.values())
                            if isinstance(a, Tensor)), "cpu")
        if not torch.is_autocast_enabled(device_type):
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
