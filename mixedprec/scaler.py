"""A GradScaler with no host synchronisation in the step, hysteresis and a scale floor
and ceiling: ``torch.amp.GradScaler``'s face on the one loss-scale core
(:class:`mixedprec.loss_scale.LossScale`)."""

import math
import numbers
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from . import grads
from .loss_scale import DEFAULT_MIN_SCALE, LossScale
from .ops import not_traced as _not_traced
from .overflow import OverflowReport

__all__ = ["GradScaler", "MissingStateKeys"]


# The keys of torch.amp.GradScaler's state dict, which load_state_dict needs.
_TORCH_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                     "_growth_tracker")
# What torch's step hands an optimizer that declares _step_supports_amp_scaling.
_HANDED = ("grad_scale", "found_inf")


class MissingStateKeys(KeyError, ValueError):
    """``GradScaler.load_state_dict`` was given a state dict without some of the keys
    every GradScaler state dict has. A KeyError, as torch's scaler raises for a missing
    key, and a ValueError; its message names the missing keys."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_device(device: Any) -> None:
    """Raises (naming ``device``) unless ``device`` names a device torch knows."""
    if isinstance(device, torch.device):
        return
    if not isinstance(device, str):
        raise TypeError(f"GradScaler: expected device to be a device type such as 'cuda' "
                        f"or 'cpu', got {type(device).__name__} {device!r}")
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"GradScaler: expected device to be a device type such as 'cuda' "
                         f"or 'cpu', got {device!r}") from None


def _check_factor(name: str, value: Any) -> None:
    """torch's GradScaler takes ``growth_factor > 1`` and ``backoff_factor < 1`` (its
    constructor asserts them); the same holds here at construction and in the setters,
    as a ValueError naming the argument. (The core also allows 1.0, a constant scale,
    which Apex's static loss scale uses.)"""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # the core's check names the type
    if name == "growth_factor" and not value > 1.0:
        raise ValueError(f"GradScaler: expected growth_factor > 1, got {value}")
    if name == "backoff_factor" and not value < 1.0:
        raise ValueError(f"GradScaler: expected backoff_factor < 1, got {value}")


def _core_attr(name: str, doc: str) -> property:
    """An attribute of torch's GradScaler kept in the core, so that torch's own methods
    (scale, unscale_, step, get_scale, ...) read and write the core's values."""
    return property(lambda self: getattr(self._core, name),
                    lambda self, value: setattr(self._core, name, value), doc=doc)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the same arguments, defaults, methods and
    ``state_dict`` keys, plus:

    * ``hysteresis``: how many consecutive overflowing steps it takes before the scale
      backs off (1, the default, is torch's behaviour);
    * ``min_scale`` / ``max_scale``: a floor and a ceiling for the scale. The floor is
      never 0: by default it is ``mixedprec.loss_scale.DEFAULT_MIN_SCALE`` (2**-24,
      the smallest fp16 value; see that module), so a run whose gradients overflow in
      every step keeps skipping steps at the floor instead of reaching a zero scale and
      writing NaN. There is no ceiling by default;
    * every setting of an enabled scaler is checked when given (construction, setters,
      ``load_state_dict``): ``init_scale`` 0, inf or NaN, ``backoff_factor`` outside
      (0, 1], ``growth_interval`` < 1, ``hysteresis`` < 1, ``min_scale > max_scale``
      (and, at construction and in the setters, torch's ``growth_factor > 1`` and
      ``backoff_factor < 1``) raise ``ValueError``/``TypeError`` naming the argument,
      before anything changes (a disabled scaler, like torch's, checks none: it never
      uses them). ``device`` must name a device torch knows (torch's scaler takes any
      string and fails at the first ``scale()``); a state dict without one of torch's
      five keys raises :class:`MissingStateKeys` (a ``KeyError``, as torch raises)
      naming them, and loads nothing;
    * no host synchronisation in :meth:`step` and :meth:`update` with optimizers that
      declare ``_step_supports_amp_scaling`` (every :mod:`mixedprec.optim` optimizer
      and the Apex faces over them, torch's fused optimizers): the overflow check is one
      read-only pass over the gradients on the device, and the optimizer skips the
      update on the device. With any other optimizer, :meth:`step` behaves exactly like
      torch's (it reads the overflow flag on the host to decide whether to step);
    * :meth:`unscale_` runs mixedprec's multi-tensor kernel, which also takes bfloat16
      gradients on CUDA (float64 gradients go through torch's kernel, as in torch);
    * :meth:`found_inf` gives the last update's overflow flag as a device tensor;
    * ``overflow_report`` (keyword-only; False by default): True, an ``nn.Module`` or
      ``model.named_parameters()`` counts on the device, per parameter, the steps whose
      gradient overflowed (one per-tensor L2-norm pass over the gradients a step), and
      the steps, skipped steps and scale history; :meth:`report` reads them (the one
      host read). The scaler sees every gradient and every scale update, so it keeps
      the report (docs/schedules.md);
    * ``skip_on_host`` (keyword-only; False by default): with an optimizer that skips on
      the device, :meth:`step` reads the overflow flag once (a host synchronisation)
      and, on overflow, does not call ``optimizer.step()`` at all, as torch's scaler
      does for other optimizers. For frameworks that learn of a skipped step only from
      an uncalled ``step()`` (Accelerate's ``step_was_skipped`` and its scheduler,
      docs/integrations.md); the parameters and state end as without it.

    What ``p.grad`` holds after :meth:`step`: the optimizer decides, as with torch's
    scaler. torch's fused optimizers and :mod:`mixedprec.optim`'s (``unscale_grads=True``,
    their default) leave the unscaled gradient there; with ``unscale_grads=False`` and in
    the Apex faces (``FusedAdam``, ``FusedSGD``, ...) the step reads the gradients scaled
    and writes nothing back (it saves a write of every gradient), so ``p.grad`` still
    holds the scaled gradient. Call :meth:`unscale_` before :meth:`step` to have
    unscaled gradients before it (for clipping or logging); the step then uses those.
    """

    _scale = _core_attr("scale", "The scale tensor (None until the first scale()).")
    _growth_tracker = _core_attr("growth_tracker", "The growth tracker tensor.")
    _growth_factor = _core_attr("growth_factor", "The growth factor.")
    _backoff_factor = _core_attr("backoff_factor", "The backoff factor.")
    _growth_interval = _core_attr("growth_interval", "The growth interval.")

    @property
    def _init_scale(self) -> float:
        return self._core._init[0]

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self._core._init = (value, *self._core._init[1:])

    @property
    def _init_growth_tracker(self) -> int:
        return self._core._init[1]

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        core = self._core
        core._init = (core._init[0], value, core._init[2])

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, hysteresis: int = 1,
                 min_scale: float = DEFAULT_MIN_SCALE, max_scale: float = math.inf,
                 overflow_report: Any = False, skip_on_host: bool = False) -> None:
        _check_device(device)
        if not isinstance(skip_on_host, bool):
            raise TypeError("GradScaler: expected skip_on_host to be a bool, got "
                            f"{type(skip_on_host).__name__}")
        report = None
        if overflow_report is not False and overflow_report is not None:
            report = OverflowReport(None if overflow_report is True else overflow_report,
                                    owner="GradScaler: overflow_report")
        settings = dict(growth_factor=growth_factor, backoff_factor=backoff_factor,
                        growth_interval=growth_interval, hysteresis=hysteresis,
                        min_scale=min_scale, max_scale=max_scale)
        try:
            if enabled:
                _check_factor("growth_factor", growth_factor)
                _check_factor("backoff_factor", backoff_factor)
            self._core = LossScale(init_scale, owner="GradScaler", **settings)
        except (TypeError, ValueError):
            # torch's scaler disables itself for "cuda" without CUDA; a disabled scaler
            # never uses its settings and torch checks none of them then: keep them as
            # given (the getters return them).
            disabled = not enabled or (
                device == "cuda" and torch.cuda.amp.common.amp_definitely_not_available())
            if not disabled:
                raise
            self._core = LossScale(owner="GradScaler")
            self._core.__dict__.update(settings)
            self._core._init = (init_scale, 0, hysteresis)
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval,
                         enabled)
        self._found_inf: Optional[Tensor] = None
        #: The :class:`mixedprec.overflow.OverflowReport` (None unless asked for).
        self.overflow_report: Optional[OverflowReport] = report
        self.skip_on_host = skip_on_host

    # step and update run as torch's do under torch.compile: not traced (torch's dynamo
    # skips torch.amp's GradScaler, whose methods these call), so a compiled training
    # step keeps its one graph instead of breaking into fragments around those calls
    # (test_compiled_step_breaks_no_more_than_torchs).
    @_not_traced
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """torch's ``step``; with ``skip_on_host``, an optimizer that skips on the device
        is not called on an overflowing step (one host read of the flag). When the
        optimizer's step raises, ``optimizer.grad_scale`` and ``found_inf`` are removed
        (torch's step leaves them) and the clip is kept: a retry steps as this call
        would have."""
        if self._enabled and getattr(self, "skip_on_host", False) and \
                getattr(optimizer, "_step_supports_amp_scaling", False) and \
                "closure" not in kwargs:
            self._check_scale_growth_tracker("step")
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
                state["checked"] = True  # torch's step would check again: reuse
            if state["stage"] is not OptState.STEPPED:
                flags = list(state["found_inf_per_device"].values())
                if any(bool(f) for f in flags):  # sync-ok: skip_on_host's one read
                    state["stage"] = OptState.STEPPED
                    return None
        state = self._per_optimizer_states[id(optimizer)] if self._enabled else {}
        kept = {k: state[k] for k in ("clip", "checked") if k in state}
        handed = {k: getattr(optimizer, k) for k in _HANDED if hasattr(optimizer, k)}
        try:
            clip = state.pop("clip", None)
            if clip is not None:  # (torch's step multiplies its scale by this, then deletes it)
                optimizer.grad_scale = getattr(optimizer, "grad_scale", 1) / clip
            return super().step(optimizer, *args, **kwargs)
        except BaseException:
            # torch's step deletes grad_scale and found_inf only after the optimizer's step
            # returns: left there, a later step divided the gradients by the scale again.
            # Both are as before the call, as is the clip, so that a retry steps as this
            # call would have.
            for name in _HANDED:
                if name in handed:
                    setattr(optimizer, name, handed[name])
                elif hasattr(optimizer, name):
                    delattr(optimizer, name)
            state.update(kept)
            raise

    @_not_traced
    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                        norm_type: float = 2.0) -> Tensor:
        """Clips ``optimizer``'s gradients to ``max_norm`` by their global norm, unscaled,
        as ``unscale_(optimizer)`` and then ``torch.nn.utils.clip_grad_norm_`` would, and
        returns that norm (float32, on the scale's device; inf or NaN after an
        overflow, whose step is then skipped as usual). Call it after ``backward()`` and
        before :meth:`step`, at most once per optimizer between updates.

        An optimizer that unscales inside its step (:mod:`mixedprec.optim`'s, the Apex
        faces, torch's fused ones) keeps its gradients scaled and unwritten: one read
        takes the 2-norm of every gradient times ``1 / scale`` (``grads.global_norm``)
        and sets the overflow flag, and :meth:`step` has the optimizer divide them by
        ``scale / clip_coef`` instead of ``scale`` (``clip_coef`` as torch's:
        ``max_norm / (norm + 1e-6)``, at most 1). So the fp16 gradients of an fp16
        model with fp32 masters are clipped too, which :meth:`unscale_` refuses (as
        torch's does). Other optimizers, other norms, and gradients that
        :meth:`unscale_` has unscaled already: torch's ``clip_grad_norm_`` after
        :meth:`unscale_`. No host read."""
        if isinstance(max_norm, Tensor):  # (as torch's clip_grad_norm_ takes: on the device)
            if max_norm.numel() != 1 or not max_norm.is_floating_point():
                raise TypeError("GradScaler.clip_grad_norm_: expected a tensor max_norm to "
                                f"hold one float, got {max_norm.dtype} of shape "
                                f"{tuple(max_norm.shape)}")
        elif isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
            raise TypeError("GradScaler.clip_grad_norm_: expected max_norm to be a number or "
                            f"a one-element tensor, got {type(max_norm).__name__}")
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        self._check_scale_growth_tracker("clip_grad_norm_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        if state.get("clipped"):
            raise RuntimeError("clip_grad_norm_() has already been called on this optimizer "
                               "since the last update().")
        if (state["stage"] is OptState.UNSCALED or float(norm_type) != 2.0 or
                not getattr(optimizer, "_step_supports_amp_scaling", False)):
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)  # (fp16 gradients: its ValueError)
            state["clipped"] = True
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        inv_scale = self._core.inv_scale()
        total = grads.global_norm(self._grads(optimizer, True), inv_scale, self._scale.device)
        state["found_inf_per_device"] = {self._scale.device: (~torch.isfinite(total)).float()}
        state["checked"] = True  # (the step's overflow check: this one)
        self._record(optimizer, inv_scale)
        if isinstance(max_norm, Tensor):
            max_norm = max_norm.detach().to(total.device, torch.float32).reshape(())
        state["clip"] = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        state["clipped"] = True
        return total

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        self._core.place(dev)

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> List[Tensor]:
        """The optimizer's gradients, checked before anything is written; sparse fp16
        ones coalesced into ``param.grad`` first, as torch's scaler does."""
        out = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if grad.is_sparse and grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                out.append(grad)
        return out

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # (no gradient, no flag: torch's then raises "No inf checks were recorded", which
        # catches a forgotten backward(), instead of counting a clean step)
        found = self._grads(optimizer, allow_fp16)
        flags = grads.unscale_(found, found_inf, inv_scale, merge=False) if found else {}
        self._record(optimizer, None)  # (unscaled now)
        return flags

    def _record(self, optimizer, inv_scale: Optional[Tensor]) -> None:
        """The overflow report's per-parameter flags of the optimizer's gradients."""
        if self.overflow_report is None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        self.overflow_report.record_grads(params, [p.grad for p in params], inv_scale)

    def _check_inf_per_device(self, optimizer):
        # For optimizers that unscale inside their own kernel: read the gradients once,
        # write nothing.
        state = self._per_optimizer_states[id(optimizer)]
        if state.pop("checked", False):  # skip_on_host's step checked them already
            return state["found_inf_per_device"]
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=_scale.device)
        found = self._grads(optimizer, True)  # (none: no flag, as _unscale_grads_)
        flags = grads.check_finite_(found, found_inf, merge=False) if found else {}
        self._record(optimizer, self._core.inv_scale())
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = flags
        return flags

    @_not_traced
    def update(self, new_scale: Optional[Any] = None) -> None:
        """Updates the scale on the device from the overflow flags of this iteration's
        steps: on overflow the hysteresis tracker counts down and, once it reaches 0,
        the scale backs off (not below ``min_scale``); after ``growth_interval`` clean
        steps it grows (not above ``max_scale``). ``new_scale`` sets it directly, as in
        torch: a number must be finite and in [min_scale, max_scale]; a one-element
        tensor is held to that range on the device (a NaN leaves the scale as it was)."""
        if not self._enabled:
            return
        if new_scale is not None:
            if not isinstance(new_scale, Tensor):
                new_scale = self._core.check_new_scale("new_scale", new_scale)
            elif new_scale.numel() == 1 and new_scale.is_floating_point() and \
                    not new_scale.requires_grad:  # (else torch's own assertion, below)
                new_scale = self._core.held(new_scale)
            super().update(new_scale)
            return
        _scale, _ = self._check_scale_growth_tracker("update")
        found_infs: List[Tensor] = [
            found_inf.to(device=_scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf_combined = found_infs[0].clone()
        for found_inf in found_infs[1:]:
            found_inf_combined += found_inf
        before = self.overflow_report.keep(_scale) if self.overflow_report is not None else None
        self._core.update(found_inf_combined)
        if self.overflow_report is not None:
            self.overflow_report.record_step(found_inf_combined, before, self._core.scale)
        self._found_inf = found_inf_combined
        self._per_optimizer_states.clear()

    def found_inf(self) -> Optional[Tensor]:
        """The last :meth:`update`'s overflow flag (nonzero: the steps were skipped), a
        float32 device tensor; None before the first update. Reading its value is the
        caller's choice (and a host synchronisation)."""
        return self._found_inf

    def report(self, names: Any = None, scale: bool = True) -> Dict[str, Any]:
        """The overflow report (``overflow_report=...`` at construction), read now: steps,
        skipped steps, overflow counts by parameter name (``names``: a module or
        ``named_parameters()``, if not given at construction) and, with ``scale``, the
        scale's current, min and max values and its backoffs and growths. See
        :meth:`mixedprec.overflow.OverflowReport.report`; ``.summary()`` of
        ``self.overflow_report`` gives it as one line."""
        if self.overflow_report is None:
            raise RuntimeError("GradScaler.report: build the scaler with "
                               "overflow_report=True (or a module) to count overflows")
        return self.overflow_report.report(names, scale)

    # -- settings: checked by the core before they apply --------------------------------
    def set_growth_factor(self, new_factor: float) -> None:
        _check_factor("growth_factor", new_factor)
        self._core.configure(growth_factor=new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_factor("backoff_factor", new_factor)
        self._core.configure(backoff_factor=new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._core.configure(growth_interval=new_interval)

    def get_hysteresis(self) -> int:
        return self._core.hysteresis

    def set_hysteresis(self, new_hysteresis: int) -> None:
        core = self._core
        core.configure(hysteresis=new_hysteresis)
        if core.scale is None:  # not started yet: the first steps use it too
            core._init = (core._init[0], core._init[1], new_hysteresis)

    def get_min_scale(self) -> float:
        return self._core.min_scale

    def set_min_scale(self, new_min_scale: float) -> None:
        self._core.configure(min_scale=new_min_scale)

    def get_max_scale(self) -> float:
        return self._core.max_scale

    def set_max_scale(self, new_max_scale: float) -> None:
        self._core.configure(max_scale=new_max_scale)

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's keys, plus ``hysteresis``, ``min_scale``, ``max_scale`` and
        ``_hysteresis_tracker``; and ``overflow_report``, the report's counts, with the
        report on (so that they carry on over a resume)."""
        state = super().state_dict()
        if self._enabled:
            core = self._core
            state.update(hysteresis=core.hysteresis, min_scale=core.min_scale,
                         max_scale=core.max_scale,
                         _hysteresis_tracker=core.trackers()["hysteresis_tracker"])
            if self.overflow_report is not None:
                state["overflow_report"] = self.overflow_report.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.amp.GradScaler`` (whose
        missing keys keep this scaler's values). Every value is checked first; on a bad
        one a ValueError names it and nothing changes."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was "
                               "saved from a disabled instance of GradScaler.")
        missing = [k for k in _TORCH_STATE_KEYS if k not in state_dict]
        if missing:
            raise MissingStateKeys(
                f"GradScaler.load_state_dict: the state dict has no {', '.join(missing)} "
                f"(a GradScaler state dict has {', '.join(_TORCH_STATE_KEYS)}); "
                "nothing was loaded")
        core = self._core
        settings = {k: state_dict.get(k, getattr(core, k))
                    for k in ("growth_factor", "backoff_factor", "growth_interval",
                              "hysteresis", "min_scale", "max_scale")}
        report = state_dict.get("overflow_report") if self.overflow_report is not None else None
        if report is not None:  # (checked before anything changes: a copy loads first)
            OverflowReport(owner="GradScaler.load_state_dict: overflow_report").load_state_dict(
                report, "cpu")
        core.load(state_dict["scale"], state_dict["_growth_tracker"],
                  state_dict.get("_hysteresis_tracker", settings["hysteresis"]), **settings)
        if report is not None:
            self.overflow_report.load_state_dict(report, self._device)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()  # torch's check that no step is half done
        for name in ("_scale", "_growth_tracker", "_init_scale", "_init_growth_tracker"):
            state.pop(name, None)  # the core pickles its own values
        state["_found_inf"] = None
        return state
