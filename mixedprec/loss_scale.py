"""The one loss-scale core under every front end.

:class:`LossScale` holds a loss scale and its trackers on the device and updates them
there from an overflow flag (``mixedprec.ops.update_loss_scale_``), so no step reads a
device value on the host. :class:`mixedprec.GradScaler`, ``mixedprec.amp``'s loss
scalers and ``mixedprec.fp16_utils``' ``LossScaler``/``DynamicLossScaler`` are faces
on it: each keeps its own public names, defaults and ``state_dict`` keys.

Every setting is checked when it is given (construction, setters, loading a state),
never first in :meth:`LossScale.update`, and a rejected value changes nothing.

The floor: a dynamic scale never goes below ``min_scale``, which must be > 0. The
default, :data:`DEFAULT_MIN_SCALE` = 2**-24, is the smallest positive float16 value:
a loss multiplied by less turns every fp16 gradient into zero anyway, and as a power
of two its reciprocal (2**24) is exact in float32, so unscaling stays exact. A step
that still overflows at the floor is skipped, as every overflowing step is; the scale
stays at the floor instead of reaching 0 (after which ``1 / scale`` is inf and the
unscaled gradients NaN).
"""

import math
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from . import ops

__all__ = ["LossScale", "DEFAULT_MIN_SCALE", "inverse"]

#: The default floor of every dynamic loss scale (see the module docstring).
DEFAULT_MIN_SCALE: float = 2.0**-24


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, Tensor) or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: expected {name} to be a number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{owner}: expected {name} to be a number, got nan")
    return value


# The trackers and their settings are int32 on the device (update_loss_scale_ takes
# growth_interval and hysteresis in [1, INT32_MAX]).
INT32_MAX = 2**31 - 1


def _positive_int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32_MAX:
        raise ValueError(f"{owner}: expected {name} to be an int in [1, 2**31 - 1], "
                         f"got {value!r}")
    return value


def inverse(scale: Tensor) -> Tensor:
    """``1 / scale`` on the device as float32, with the bits of ``torch.amp.GradScaler``'s
    ``scale.double().reciprocal().float()``: what every unscale divides by.

    A float32 scale (the scalers' own) takes one kernel, ``scale.reciprocal()``, where that
    takes three, each a launch every step. The same bits: a float32 division is correctly
    rounded, and so is the float64 quotient rounded once more to float32, since float64
    carries more than 2 * 24 + 2 bits (double rounding is innocuous for a quotient then;
    tests/python/scaler/test_loss_scale.py compares the two over a wide sample)."""
    if scale.dtype == torch.float32:
        return scale.reciprocal()
    return scale.double().reciprocal().float()


def check_scale(owner: str, name: str, value: Any) -> float:
    """``value`` as a float if it is a usable loss scale (finite and > 0), else raises."""
    value = _number(owner, name, value)
    if not 0.0 < value < math.inf:
        raise ValueError(f"{owner}: expected {name} to be finite and > 0, got {value}")
    return value


class LossScale:
    """A loss scale on the device, static or dynamic.

    Dynamic: on an overflow the hysteresis tracker counts down, and when it reaches 0
    the scale is multiplied by ``backoff_factor`` (not below ``min_scale``) and the
    growth tracker restarts; after ``growth_interval`` steps without overflow the scale
    is multiplied by ``growth_factor`` (not above ``max_scale``). Static: the scale
    never changes.

    The tensors (float32 ``scale``, int32 ``growth_tracker`` and
    ``hysteresis_tracker``, 0-dim) are created on first use by :meth:`place`, on the
    device of the data; until then the values are kept on the host.

    ``owner`` names the front end in error messages (e.g. ``"GradScaler"``).
    """

    def __init__(self, init_scale: float = 2.0**16, *, dynamic: bool = True,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = DEFAULT_MIN_SCALE, max_scale: float = math.inf,
                 owner: str = "LossScale"):
        self.owner = owner
        self.dynamic = bool(dynamic)
        settings = self.check_settings(init_scale=init_scale, growth_factor=growth_factor,
                                       backoff_factor=backoff_factor,
                                       growth_interval=growth_interval, hysteresis=hysteresis,
                                       min_scale=min_scale, max_scale=max_scale)
        self.growth_factor = settings["growth_factor"]
        self.backoff_factor = settings["backoff_factor"]
        self.growth_interval = settings["growth_interval"]
        self.hysteresis = settings["hysteresis"]
        self.min_scale = settings["min_scale"]
        self.max_scale = settings["max_scale"]
        # Host values until place() creates the tensors.
        self._init = (settings["init_scale"], 0, self.hysteresis)
        self.scale: Optional[Tensor] = None
        self.growth_tracker: Optional[Tensor] = None
        self.hysteresis_tracker: Optional[Tensor] = None

    # -- settings -------------------------------------------------------------------
    def check_settings(self, **changes: Any) -> Dict[str, Any]:
        """The settings with ``changes`` applied, checked together; raises (naming the
        argument) without changing anything. Keys: init_scale, growth_factor,
        backoff_factor, growth_interval, hysteresis, min_scale, max_scale."""
        owner = self.owner
        current = {k: getattr(self, k) for k in ("growth_factor", "backoff_factor",
                                                  "growth_interval", "hysteresis",
                                                  "min_scale", "max_scale")
                   if hasattr(self, k)}
        s = dict(current, **changes)
        out: Dict[str, Any] = {}
        if "init_scale" in s:
            out["init_scale"] = check_scale(owner, "init_scale", s["init_scale"])
        out["growth_factor"] = _number(owner, "growth_factor", s["growth_factor"])
        if not 1.0 <= out["growth_factor"] < math.inf:
            raise ValueError(f"{owner}: expected growth_factor to be finite and >= 1, "
                             f"got {out['growth_factor']}")
        out["backoff_factor"] = _number(owner, "backoff_factor", s["backoff_factor"])
        if not 0.0 < out["backoff_factor"] <= 1.0:
            raise ValueError(f"{owner}: expected backoff_factor to be in (0, 1], "
                             f"got {out['backoff_factor']}")
        out["growth_interval"] = _positive_int(owner, "growth_interval", s["growth_interval"])
        out["hysteresis"] = _positive_int(owner, "hysteresis", s["hysteresis"])
        out["min_scale"] = check_scale(owner, "min_scale", s["min_scale"])
        out["max_scale"] = _number(owner, "max_scale", s["max_scale"])
        if not out["max_scale"] >= out["min_scale"]:
            raise ValueError(f"{owner}: expected min_scale <= max_scale, got min_scale="
                             f"{out['min_scale']} and max_scale={out['max_scale']}")
        init = out.get("init_scale")
        if self.dynamic and init is not None and not (
                out["min_scale"] <= init <= out["max_scale"]):
            raise ValueError(f"{owner}: expected init_scale in [min_scale, max_scale] = "
                             f"[{out['min_scale']}, {out['max_scale']}], got {init}")
        return out

    def configure(self, **changes: Any) -> None:
        """Checks ``changes`` (see :meth:`check_settings`) and applies them."""
        settings = self.check_settings(**changes)
        for key in changes:
            if key == "init_scale":
                self.set(settings[key])
            else:
                setattr(self, key, settings[key])

    # -- the tensors ----------------------------------------------------------------
    def place(self, device: torch.device) -> Tensor:
        """Creates the tensors on ``device``, or moves them there; returns the scale."""
        if self.scale is None:
            scale, growth, hysteresis = self._init
            self.scale = torch.full((), scale, dtype=torch.float32, device=device)
            self.growth_tracker = torch.full((), growth, dtype=torch.int32, device=device)
            self.hysteresis_tracker = torch.full((), hysteresis, dtype=torch.int32,
                                                 device=device)
        elif self.scale.device != torch.device(device):
            self.scale = self.scale.to(device)
            self.growth_tracker = self.growth_tracker.to(device)
            self.hysteresis_tracker = self.hysteresis_tracker.to(device)
        return self.scale

    def inv_scale(self) -> Tensor:
        """``1 / scale`` on the scale's device (see :func:`inverse`)."""
        return inverse(self.scale)

    def update(self, found_inf: Tensor) -> None:
        """One step of the rule from ``found_inf`` (nonzero: the step overflowed), on the
        device; nothing for a static scale."""
        if not self.dynamic:
            return
        self.place(found_inf.device)
        ops.update_loss_scale_(self.scale, self.growth_tracker, self.hysteresis_tracker, found_inf,
                               growth_factor=self.growth_factor, backoff_factor=self.backoff_factor,
                               growth_interval=self.growth_interval, hysteresis=self.hysteresis,
                               min_scale=self.min_scale, max_scale=self.max_scale)

    # -- host reads and writes --------------------------------------------------------
    def get(self) -> float:
        """The scale as a Python float (reads the device once placed)."""
        if self.scale is None:
            return self._init[0]
        return float(self.scale.item())  # sync-ok: an explicit read by the caller

    def set(self, value: Any) -> None:
        """Sets the scale (a number, or a one-element tensor copied on the device);
        checked first."""
        if isinstance(value, Tensor):
            if value.numel() != 1 or not value.is_floating_point():
                raise ValueError(f"{self.owner}: expected the new scale to be a number or a "
                                 f"one-element float tensor, got shape {tuple(value.shape)} "
                                 f"and dtype {value.dtype}")
            self.place(value.device).copy_(value.detach().reshape(()))
            return
        value = check_scale(self.owner, "the new scale", value)
        if self.scale is None:
            self._init = (value, *self._init[1:])
        else:
            self.scale.fill_(value)

    def check_new_scale(self, name: str, value: Any) -> float:
        """A new scale given as a number: finite and > 0 (:func:`check_scale`) and, for
        a dynamic scale, in [min_scale, max_scale]; raises naming ``name`` else."""
        value = check_scale(self.owner, name, value)
        if self.dynamic and not self.min_scale <= value <= self.max_scale:
            raise ValueError(f"{self.owner}: expected {name} in [min_scale, max_scale] = "
                             f"[{self.min_scale}, {self.max_scale}], got {value}")
        return value

    def held(self, value: Tensor) -> Tensor:
        """A new scale given as a one-element float tensor, as a float32 0-dim tensor on
        its device held there to [min_scale, max_scale] (a NaN: the current scale), for
        a dynamic scale; no host read. A static scale takes it as it is."""
        value = value.detach().reshape(()).to(torch.float32)
        if not self.dynamic:
            return value
        # (the current scale read where the value is, never moved or made here: a new
        # scale on another device, or before the first scale(), is the caller's to refuse)
        current = value.new_full((), self._init[0]) if self.scale is None else \
            self.scale.to(value.device)
        return torch.where(value.isnan(), current, value.clamp(self.min_scale, self.max_scale))

    def trackers(self) -> Dict[str, int]:
        """The growth and hysteresis trackers as Python ints (reads the device once
        placed: for checkpoints)."""
        if self.scale is None:
            return {"growth_tracker": self._init[1], "hysteresis_tracker": self._init[2]}
        return {"growth_tracker": int(self.growth_tracker.item()),  # sync-ok: checkpoint
                "hysteresis_tracker": int(self.hysteresis_tracker.item())}  # sync-ok

    def load(self, scale: Any, growth_tracker: Any = 0,
             hysteresis_tracker: Optional[Any] = None, check_only: bool = False,
             **settings: Any) -> None:
        """Restores a saved scale, trackers and settings, all checked before anything
        changes (``check_only``: checked, not applied; for loading several scales all or
        none). ``scale`` may be a number or a one-element tensor."""
        checked = self.check_settings(**settings)
        if isinstance(scale, Tensor):
            if scale.numel() != 1:
                raise ValueError(f"{self.owner}: expected the saved scale to hold one "
                                 f"element, got shape {tuple(scale.shape)}")
            scale = float(scale.detach().reshape(()).cpu())  # sync-ok: checkpoint
        scale = check_scale(self.owner, "the saved scale", scale)
        if self.dynamic and not checked["min_scale"] <= scale <= checked["max_scale"]:
            raise ValueError(f"{self.owner}: expected the saved scale in [min_scale, "
                             f"max_scale] = [{checked['min_scale']}, {checked['max_scale']}], "
                             f"got {scale}")
        if hysteresis_tracker is None:
            hysteresis_tracker = checked["hysteresis"]
        trackers = {}
        for name, value in (("growth_tracker", growth_tracker),
                            ("hysteresis_tracker", hysteresis_tracker)):
            if isinstance(value, Tensor):
                value = int(value.detach().reshape(()).cpu())  # sync-ok: checkpoint
            elif isinstance(value, float) and value.is_integer():
                value = int(value)  # e.g. a checkpoint that went through a float format
            # The hysteresis tracker counts below 0 while overflows follow each other.
            low = 0 if name == "growth_tracker" else -(2**31)
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not low <= value <= INT32_MAX:
                raise ValueError(f"{self.owner}: expected the saved {name} to be an int "
                                 f"in [{low}, 2**31 - 1], got {value!r}")
            trackers[name] = value
        if check_only:
            return
        for key, value in checked.items():
            if key != "init_scale":
                setattr(self, key, value)
        self._init = (scale, trackers["growth_tracker"], trackers["hysteresis_tracker"])
        if self.scale is not None:
            self.scale.fill_(scale)
            self.growth_tracker.fill_(trackers["growth_tracker"])
            self.hysteresis_tracker.fill_(trackers["hysteresis_tracker"])

    def __getstate__(self) -> Dict[str, Any]:
        # Pickled with host values (as torch's GradScaler is); the tensors come back on
        # first use.
        state = self.__dict__.copy()
        if self.scale is not None:
            state["_init"] = (self.get(), *self.trackers().values())
        state.update(scale=None, growth_tracker=None, hysteresis_tracker=None)
        return state

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScale({kind}, owner={self.owner!r})"
