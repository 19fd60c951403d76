"""Learning-rate schedules computed on the device from the optimizer's count of applied
steps, so that a step skipped by a loss scaler (``found_inf`` set) does not advance the
schedule, and no step reads a device value on the host.

torch.optim.lr_scheduler's names, signatures and defaults: :class:`LambdaLR`,
:class:`LinearLR`, :class:`ConstantLR`, :class:`StepLR`, :class:`MultiStepLR`,
:class:`ExponentialLR`, :class:`PolynomialLR`, :class:`CosineAnnealingLR`,
:class:`CosineAnnealingWarmRestarts` and :class:`SequentialLR` (warmup then cosine:
``SequentialLR(opt, [LinearLR(...), CosineAnnealingLR(...)], milestones=[warmup])``).
Each is a
``torch.optim.lr_scheduler.LRScheduler`` (for the code that checks that). What differs
from torch's (docs/schedules.md):

* The optimizer must count its applied steps on the device (``optimizer.applied_steps``:
  mixedprec's optimizers do). ``step()`` advances ``last_epoch`` by one when that count
  moved since the previous ``step()``, on the device: called once per iteration after
  ``scaler.step(optimizer)``, the schedule holds still on skipped steps; called once per
  epoch, it advances unless every step of the epoch was skipped.
* Each param group's ``lr`` becomes a 0-dim tensor on the device of the count (float64
  when it was a number; a tensor keeps its dtype), written in place by ``step()``.
* ``last_epoch`` is a 0-dim int64 device tensor (reading it is a host synchronisation);
  ``get_last_lr()`` and ``get_lr()`` return float64 device tensors.
* The lrs come from closed forms (``base_lr * factor(last_epoch)``) rather than
  torch's recursive updates: equal to torch's to rounding, also when ``group["lr"]`` was
  changed by hand in between (which torch's recursive forms would carry on from).
* :class:`LambdaLR`'s functions receive ``last_epoch`` as a 0-dim float64 device tensor
  and must use tensor operations (``torch.clamp``, ``torch.minimum``; ``min()`` or an
  ``if`` on it would read the device).
* ``step(epoch)`` (deprecated in torch) sets ``last_epoch`` to ``epoch``.
* :class:`SequentialLR` takes schedulers of this module only; they are not stepped
  themselves.
* Schedules do not chain: a scheduler stepped again after another one stepped the same
  optimizer (torch's ``ChainedScheduler``, or two ``step()`` calls an iteration) raises,
  since each writes its closed-form lr and the last would win. One schedule after
  another (a new scheduler that takes over for good) is fine.
* Arguments, ``step(epoch)`` and the entries ``load_state_dict`` reads are checked
  (torch checks few): a bad one raises a TypeError or ValueError that names it, before
  anything changes. Milestones are ints >= 0 (any iterable, as torch takes them;
  :class:`SequentialLR`'s in increasing order), ``gamma``, ``eta_min`` and the factors
  finite real numbers.
"""

import math
import numbers
import types
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Sequence, Union

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch

from ..ops import not_traced

__all__ = ["LRScheduler", "LambdaLR", "LinearLR", "ConstantLR", "StepLR", "MultiStepLR",
           "ExponentialLR", "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
           "SequentialLR"]


# -- checks of arguments and saved entries (each names what it checks) ----------------
def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"a {type(value).__name__}"


def _one_element(value: Any) -> Any:
    """A one-element tensor's value as a Python number (read on the host: construction
    and checkpoints only); anything else as it is."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        return value.detach().reshape(()).item()  # sync-ok: construction, checkpoint
    return value


def _int(where: str, name: str, value: Any, least: int) -> int:
    """``value`` (an int, or a one-element integer tensor) as an int ``>= least``."""
    if not (isinstance(value, Tensor) and (value.dtype.is_floating_point
                                           or value.dtype.is_complex)):
        value = _one_element(value)  # (a float tensor stays one: refused below)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: expected {name} to be an int >= {least}, got {_shown(value)}")
    if value < least:
        raise ValueError(f"{where}: expected {name} to be an int >= {least}, got {value!r}")
    if value >= 2**63:  # (an int64 on the device)
        raise ValueError(f"{where}: expected {name} to be an int < 2**63, got {value!r}")
    return int(value)


def _real(where: str, name: str, value: Any) -> float:
    """``value`` (a real number, or a one-element real tensor) as a finite float."""
    if not (isinstance(value, Tensor) and value.dtype.is_complex):
        value = _one_element(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: expected {name} to be a real number, got {_shown(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: expected {name} to be a finite real number, got {value!r}")
    return float(value)


def _ints(where: str, name: str, value: Any) -> List[int]:
    """An iterable of ints ``>= 0`` (torch's milestones; a ``Counter``, as torch's
    MultiStepLR keeps them, counts each as often as it says) as a list, in its order."""
    if isinstance(value, Counter):
        value = list(value.elements())
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{where}: expected {name} to be an iterable of ints >= 0, got "
                        f"{_shown(value)}") from None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise TypeError(f"{where}: expected {name} to be ints >= 0, got {_shown(item)} in "
                            f"{_shown(value)}")
        if item < 0:
            raise ValueError(f"{where}: expected {name} to be ints >= 0, got {item!r}")
    return [int(item) for item in items]


def _lengths(where: str, name: str, value: Any, length: int) -> list:
    """``value`` as a list of ``length`` entries (one per param group, or per scheduler)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: expected {name} to be a list of {length}, got "
                        f"{_shown(value)}")
    if len(value) != length:
        raise ValueError(f"{where}: expected {name} to be a list of {length}, got "
                         f"{len(value)} entries")
    return list(value)


def _at_least(least: int) -> Callable[[str, str, Any], int]:
    """A setting's check: an int >= ``least``."""
    return lambda where, name, value: _int(where, name, value, least)


def _factor(low_open: bool) -> Callable[[str, str, Any], float]:
    """A setting's check: a real number in [0, 1], or in (0, 1] with ``low_open``."""
    def check(where: str, name: str, value: Any) -> float:
        value = _real(where, name, value)
        if not (0 < value if low_open else 0 <= value) or value > 1:
            raise ValueError(f"{where}: expected {name} in {'(' if low_open else '['}0, 1], "
                             f"got {value!r}")
        return value
    return check


class _Steppers:
    """An optimizer's schedulers in the order they stepped it: the one that stepped last,
    and those that another stepped after (held weakly: one that is gone is forgotten)."""

    def __init__(self) -> None:
        self.last: Any = None  # a weakref.ref
        self.replaced: "weakref.WeakSet" = weakref.WeakSet()


_STEPPERS: "weakref.WeakKeyDictionary[Optimizer, _Steppers]" = weakref.WeakKeyDictionary()


class LRScheduler(_torch.LRScheduler):
    """The base: ``last_epoch`` and the lrs on the device (see the module docstring).
    Subclasses define :meth:`_lrs_at`, and the checks of their settings in
    ``_SETTINGS`` (or of other saved entries in :meth:`_check_entry`)."""

    #: A subclass's settings (its constructor's arguments, and the same entries of a
    #: saved state): name -> check(where, name, value), which returns the value to set.
    _SETTINGS: Dict[str, Callable[[str, str, Any], Any]] = {}

    def _set_settings(self, **given: Any) -> None:
        """The constructor's settings, each checked by ``_SETTINGS`` and set, before the
        base's constructor: a bad one raises naming it."""
        checked = {key: self._check_entry(type(self).__name__, key, value)
                   for key, value in given.items()}
        vars(self).update(checked)

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:  # noqa: D107
        name = type(self).__name__
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{name}: expected optimizer to be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        count = getattr(optimizer, "applied_steps", None)
        if not isinstance(count, Tensor):
            raise TypeError(f"{name}: expected an optimizer that counts its applied steps on "
                            f"the device (optimizer.applied_steps, as mixedprec.optim's "
                            f"have), got {type(optimizer).__name__}; use "
                            "torch.optim.lr_scheduler with torch.optim's optimizers")
        last_epoch = _int(name, "last_epoch", last_epoch, -1)
        groups = optimizer.param_groups
        if last_epoch != -1:
            missing = [i for i, group in enumerate(groups) if "initial_lr" not in group]
            if missing:
                raise KeyError(f"{name}: param 'initial_lr' is not specified in "
                               f"param_groups[{missing[0]}] when resuming a scheduler with "
                               "last_epoch >= 0 (load the optimizer's state dict first)")
        device = count.device
        # Everything computed before the param groups change: a failure (a LambdaLR
        # function that raises) leaves the optimizer as it was.
        initial = [group.get("initial_lr", group["lr"]) for group in groups]
        lrs = []
        for group in groups:
            lr = group["lr"]
            if not isinstance(lr, Tensor):
                lr = torch.tensor(float(lr), dtype=torch.float64, device=device)
            elif lr.device != device or lr.dim() != 0:
                lr = lr.detach().reshape(()).to(device)
            lrs.append(lr)
        self.optimizer = optimizer
        # The base lrs as numbers: read once here, never in a step.
        self.base_lrs = [float(lr) for lr in initial]  # sync-ok: construction
        self.last_epoch = torch.tensor(last_epoch + 1, dtype=torch.int64, device=device)
        self._seen = count.detach().clone()  # the count at the previous step()
        values = self.get_lr()
        for group, lr, first in zip(groups, lrs, initial):
            if last_epoch == -1:
                group.setdefault("initial_lr", first.clone() if isinstance(first, Tensor)
                                 else first)
            group["lr"] = lr
        self._write(values)

    # -- the schedule -----------------------------------------------------------------
    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        """Each group's lr (a 0-dim float64 device tensor) at ``epoch`` (int64)."""
        raise NotImplementedError

    def get_lr(self) -> List[Tensor]:
        """The lrs at ``last_epoch``, computed on the device."""
        return self._lrs_at(self.last_epoch)

    # -- stepping ---------------------------------------------------------------------
    # Not traced under torch.compile, as torch's schedulers are not: AOT autograd drops
    # an in-place write into a 0-dim float64 input that the graph does not return (the
    # groups' lrs: the lr stayed as it was under aot_eager and inductor), and a traced
    # step was a graph of its own where torch's scheduler adds none.
    @not_traced
    def step(self, epoch: Union[int, Tensor, None] = None) -> None:
        """Advances ``last_epoch`` by one if the optimizer applied a step since the
        previous call (on the device), and writes the lrs into the param groups.
        ``step(epoch)`` sets ``last_epoch`` to ``epoch`` (an int >= 0, or a one-element
        integer tensor, not read on the host).

        A scheduler stepped after another one stepped its optimizer raises (schedules do
        not chain: the module docstring), and so does one whose optimizer has gained a
        param group since (torch's raise too), before anything changes."""
        groups, lrs = len(self.optimizer.param_groups), len(self.base_lrs)
        if groups != lrs:
            name = type(self).__name__
            raise ValueError(
                f"{name}.step: the optimizer has {groups} param groups, and this {name} "
                f"schedules {lrs} (a group added by add_param_group after it was made, as "
                "a fine-tuning callback that unfreezes layers does); make the scheduler "
                "again after adding the group")
        steppers = _STEPPERS.setdefault(self.optimizer, _Steppers())  # (host only)
        last = steppers.last() if steppers.last is not None else None
        if self in steppers.replaced and last is not None:
            # (one that replaced this one and is gone since, a learning-rate finder's
            # say, no longer counts)
            name, other = type(self).__name__, type(last).__name__
            raise RuntimeError(
                f"{name}.step: {other} has stepped this optimizer since this {name} "
                "last did, and mixedprec's schedules do not chain: each writes its "
                "closed-form lr, so the last one stepped would win, where torch's "
                "chained schedulers multiply. Write the product as one LambdaLR "
                "(lr_lambda=lambda e: warmup(e) * decay(e)), or use SequentialLR for one "
                f"schedule after another; a {other} that is done with can be deleted "
                "(docs/schedules.md)")
        count = self.optimizer.applied_steps
        if count.device != self._seen.device:  # the model moved: follow it, once
            self._to(count.device)
        if epoch is None:
            self.last_epoch.add_((count != self._seen).to(torch.int64))
        elif isinstance(epoch, Tensor):
            if (epoch.numel() != 1 or epoch.dtype == torch.bool
                    or epoch.dtype.is_floating_point or epoch.dtype.is_complex):
                raise TypeError(f"{type(self).__name__}.step: expected epoch to be an int "
                                f">= 0 or a one-element integer tensor, got a {epoch.dtype} "
                                f"tensor of shape {tuple(epoch.shape)}")
            self.last_epoch.copy_(epoch.detach().reshape(()))
        else:
            epoch = _int(f"{type(self).__name__}.step", "epoch", epoch, 0)
            self.last_epoch.fill_(epoch)
        self._seen.copy_(count)  # (step(epoch) too: the next step() counts from here)
        self._write(self.get_lr())
        steppers.replaced.discard(self)
        if last is not None and last is not self:
            steppers.replaced.add(last)
        steppers.last = weakref.ref(self)

    # -- what torch's own SequentialLR calls --------------------------------------------
    def _initial_step(self) -> None:
        """torch's SequentialLR undoes its schedulers' first step (``last_epoch -= 1``),
        then calls this on the first: the schedule one step on, as at construction."""
        self.last_epoch.add_(1)
        self._write(self.get_lr())

    def _update_lr(self, epoch: Union[int, Tensor, None] = None) -> None:
        """torch's SequentialLR starts a scheduler at its milestone with
        ``_update_lr(0)``: :meth:`step` at that epoch."""
        if epoch is None:
            self._initial_step()
        else:
            self.step(epoch)

    def _write(self, values: List[Tensor]) -> None:
        for group, value in zip(self.optimizer.param_groups, values):
            lr = group["lr"]
            if not isinstance(lr, Tensor) or lr.device != value.device:
                group["lr"] = lr = torch.zeros((), dtype=torch.float64, device=value.device)
            lr.copy_(value)
        self._last_lr = values

    def _to(self, device: torch.device) -> None:
        for key, value in list(vars(self).items()):
            if isinstance(value, Tensor):
                setattr(self, key, value.to(device))
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], Tensor):
                group["lr"] = group["lr"].to(device)

    def get_last_lr(self) -> List[Tensor]:
        """The lrs the last :meth:`step` wrote: float64 device tensors (copies, not the
        param groups' own)."""
        return self._last_lr

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Every attribute but the optimizer; tensors cloned. And ``_pending``: the
        optimizer's applied steps since the last :meth:`step` (0 or 1 as a rule; on the
        device), from which loading sets ``_seen`` against the optimizer's count then,
        whatever that count restarted from (a checkpoint through torch.distributed.
        checkpoint does not keep ``applied_steps``: the count restarts at 0, and a saved
        ``_seen`` the new count reaches would stall the schedule for a step)."""
        out = {key: value.clone() if isinstance(value, Tensor) else value
               for key, value in vars(self).items() if key != "optimizer"}
        out["_pending"] = (self.optimizer.applied_steps.to(self._seen.device) - self._seen
                           ).clamp(min=0)
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s values (``last_epoch`` may also be an int, as in
        a torch scheduler's state dict); the device tensors are written in place. Every
        entry the scheduler reads is checked first, as its constructor checks its
        arguments: a bad one raises a TypeError or ValueError that names it, and nothing
        changes. Other entries (those of torch's schedulers) are set as they are."""
        self._load_checked(self._check_state(state_dict))

    def _check_state(self, state_dict: Any) -> Dict[str, Any]:
        """The entries of ``state_dict`` as they will be set, each checked; changes
        nothing."""
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: expected state_dict to be a dict, got "
                            f"{type(state_dict).__name__}")
        out = {}
        for key, value in state_dict.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: expected the keys to be str, got {_shown(key)}")
            if key == "optimizer" or key.startswith("__") or \
                    callable(getattr(type(self), key, None)):
                raise ValueError(f"{where}: {key!r} is not an entry of a scheduler's state")
            out[key] = self._check_entry(where, key, value)
        return out

    def _check_entry(self, where: str, key: str, value: Any) -> Any:
        """One saved entry, checked, as it will be set (subclasses add theirs)."""
        if key in self._SETTINGS:
            return self._SETTINGS[key](where, key, value)
        groups = len(self.optimizer.param_groups)
        device = self.last_epoch.device
        if key in ("last_epoch", "_seen", "_pending"):  # (-1: torch's, not yet begun)
            value = _int(where, key, value, -1 if key == "last_epoch" else 0)
            return torch.tensor(value, dtype=torch.int64)
        if key == "base_lrs":
            return [_real(where, f"base_lrs[{i}]", lr)
                    for i, lr in enumerate(_lengths(where, key, value, groups))]
        if key == "_last_lr":
            return [torch.tensor(_real(where, f"_last_lr[{i}]", lr), dtype=torch.float64,
                                 device=device)
                    for i, lr in enumerate(_lengths(where, key, value, groups))]
        return value

    def _load_checked(self, entries: Dict[str, Any]) -> None:
        """Sets what :meth:`_check_state` returned (nothing here can fail)."""
        pending = entries.pop("_pending", None)
        if pending is not None:  # (_seen against the optimizer's count now: state_dict)
            count = self.optimizer.applied_steps
            entries["_seen"] = count.detach().to(self._seen.device) - pending.to(
                self._seen.device)
        for key, value in entries.items():
            current = getattr(self, key, None)
            if (isinstance(current, Tensor) and isinstance(value, Tensor)
                    and current.shape == value.shape):
                current.copy_(value)
            else:
                setattr(self, key, value)


def _epoch(epoch: Tensor) -> Tensor:
    return epoch.to(torch.float64)


class LambdaLR(LRScheduler):
    """``torch.optim.lr_scheduler.LambdaLR``: ``lr = initial_lr * lr_lambda(epoch)``,
    where ``epoch`` is a 0-dim float64 device tensor and ``lr_lambda`` (one, or one per
    group) returns a tensor or a number from tensor operations."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Union[Callable, Sequence[Callable]],
                 last_epoch: int = -1) -> None:  # noqa: D107
        groups = optimizer.param_groups if isinstance(optimizer, Optimizer) else []
        if not isinstance(lr_lambda, (list, tuple)):
            lambdas = [lr_lambda] * len(groups)
        else:
            if len(lr_lambda) != len(groups):
                raise ValueError(f"LambdaLR: expected {len(groups)} lr_lambdas, but got "
                                 f"{len(lr_lambda)}")
            lambdas = list(lr_lambda)
        for fn in lambdas:
            if not callable(fn):
                raise TypeError(f"LambdaLR: expected lr_lambda to be a function or a list of "
                                f"functions, got {_shown(fn)}")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        e = _epoch(epoch)
        out = []
        for i, (base, fn) in enumerate(zip(self.base_lrs, self.lr_lambdas)):
            factor = fn(e)
            if not isinstance(factor, Tensor):  # (a constant: no copy from the host)
                factor = torch.full_like(e, float(factor))
            elif factor.numel() != 1:  # (one value, of any shape: torch's takes it so)
                raise ValueError(f"{type(self).__name__}: expected lr_lambda of group {i} to "
                                 "return a number or a one-element tensor, got shape "
                                 f"{tuple(factor.shape)}")
            out.append(factor.to(torch.float64).reshape(()) * base)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """As torch's: the functions are not saved, callable objects' attributes are."""
        out = super().state_dict()
        out["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else fn.__dict__.copy()
                             for fn in self.lr_lambdas]
        return out

    def _check_entry(self, where: str, key: str, value: Any) -> Any:
        if key != "lr_lambdas":
            return super()._check_entry(where, key, value)
        saved = _lengths(where, key, value, len(self.lr_lambdas))
        for i, (fn, attrs) in enumerate(zip(self.lr_lambdas, saved)):
            if attrs is not None and not isinstance(attrs, Mapping):
                raise TypeError(f"{where}: expected lr_lambdas[{i}] to be None or a dict of "
                                f"attributes, got {_shown(attrs)}")
            if attrs is not None and not hasattr(fn, "__dict__"):
                raise ValueError(f"{where}: lr_lambdas[{i}] holds attributes, but the "
                                 f"scheduler's function {_shown(fn)} has none")
        return saved

    def _load_checked(self, entries: Dict[str, Any]) -> None:
        entries = dict(entries)
        saved = entries.pop("lr_lambdas", [])
        super()._load_checked(entries)
        for fn, attrs in zip(self.lr_lambdas, saved):
            if attrs is not None:
                fn.__dict__.update(attrs)


class LinearLR(LRScheduler):
    """``torch.optim.lr_scheduler.LinearLR``: the factor goes linearly from
    ``start_factor`` to ``end_factor`` over ``total_iters`` steps (warmup)."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3,
                 end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(start_factor=start_factor, end_factor=end_factor,
                           total_iters=total_iters)
        super().__init__(optimizer, last_epoch)

    _SETTINGS = dict(start_factor=_factor(low_open=True), end_factor=_factor(low_open=False),
                     total_iters=_at_least(1))

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        done = _epoch(epoch).clamp(max=self.total_iters) / self.total_iters
        factor = self.start_factor + (self.end_factor - self.start_factor) * done
        return [factor * base for base in self.base_lrs]


class StepLR(LRScheduler):
    """``torch.optim.lr_scheduler.StepLR``: the lr times ``gamma`` every ``step_size``
    steps."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(step_size=step_size, gamma=gamma)
        super().__init__(optimizer, last_epoch)

    _SETTINGS = dict(step_size=_at_least(1), gamma=_real)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        times = torch.div(epoch, self.step_size, rounding_mode="floor").to(torch.float64)
        factor = torch.pow(self.gamma, times)
        return [factor * base for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """``torch.optim.lr_scheduler.MultiStepLR``: the lr times ``gamma`` at each
    milestone (any iterable of ints >= 0; a milestone listed twice counts twice, as in
    torch)."""

    def __init__(self, optimizer: Optimizer, milestones: Iterable[int], gamma: float = 0.1,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(milestones=milestones, gamma=gamma)
        self._marks = torch.tensor(self.milestones, dtype=torch.int64)  # (moved once, below)
        super().__init__(optimizer, last_epoch)

    _SETTINGS = dict(milestones=lambda where, key, value: sorted(_ints(where, key, value)),
                     gamma=_real)

    def _check_entry(self, where: str, key: str, value: Any) -> Any:
        if key == "_marks":  # (the milestones on the device: checked as the milestones)
            if not isinstance(value, Tensor) or value.dim() != 1:
                raise TypeError(f"{where}: expected _marks to be a 1-dim tensor of the "
                                f"milestones, got {_shown(value)}")
            return torch.tensor(sorted(_ints(where, key, value.tolist())),  # sync-ok: ckpt
                                dtype=torch.int64)
        return super()._check_entry(where, key, value)

    def _check_state(self, state_dict: Any) -> Dict[str, Any]:
        out = super()._check_state(state_dict)
        milestones = out.get("milestones", self.milestones)
        # (_check_entry made _marks a CPU tensor from the checkpoint's ints: loading)
        marks = out["_marks"].tolist() if "_marks" in out else milestones  # sync-ok: loading
        if marks != milestones:
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected _marks to "
                             f"hold the milestones {milestones}, got {marks}")
        if "milestones" in out:  # (torch's state dict has no _marks)
            out["_marks"] = torch.tensor(milestones, dtype=torch.int64)
        return out

    def _load_checked(self, entries: Dict[str, Any]) -> None:
        entries = dict(entries)
        if "_marks" in entries:  # (a new tensor: the count of milestones may differ)
            self._marks = entries.pop("_marks").to(self._marks.device)
        super()._load_checked(entries)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        if self._marks.device != epoch.device:
            self._marks = self._marks.to(epoch.device)
        factor = torch.pow(self.gamma, (epoch >= self._marks).sum().to(torch.float64))
        return [factor * base for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingLR``: from the initial lr down to
    ``eta_min`` along half a cosine over ``T_max`` steps (and back up after, as torch's
    schedule continues)."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(T_max=T_max, eta_min=eta_min)
        super().__init__(optimizer, last_epoch)

    _SETTINGS = dict(T_max=_at_least(1), eta_min=_real)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        wave = (1 + torch.cos(_epoch(epoch) * (math.pi / self.T_max))) / 2
        return [wave * (base - self.eta_min) + self.eta_min for base in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``: half a cosine from the
    initial lr down to ``eta_min`` over ``T_0`` steps, then again from the top over
    ``T_0 * T_mult``, ``T_0 * T_mult**2``, ... steps. The cycle a step is in comes from
    the cycles' first steps on the device, in integers (no logarithm to round)."""

    def __init__(self, optimizer: Optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(T_0=T_0, T_mult=T_mult, eta_min=eta_min)
        self._cycles = self._cycle_starts()  # (moved to the count's device once)
        super().__init__(optimizer, last_epoch)

    def _cycle_starts(self) -> Tensor:
        """Each cycle's first step and its length (2 x n int64), up to 2**62."""
        starts, lengths, start, length = [], [], 0, self.T_0
        while start < 2**62:
            starts.append(start)
            lengths.append(min(length, 2**62))  # (no step reaches past 2**62)
            if self.T_mult == 1:  # (one cycle: the epoch modulo T_0 instead)
                break
            start, length = start + length, length * self.T_mult
        return torch.tensor([starts, lengths], dtype=torch.int64)

    _SETTINGS = dict(T_0=_at_least(1), T_mult=_at_least(1), eta_min=_real)

    def _check_entry(self, where: str, key: str, value: Any) -> Any:
        if key == "_cycles":  # (derived from T_0 and T_mult: rebuilt on loading)
            return None
        return super()._check_entry(where, key, value)

    def _load_checked(self, entries: Dict[str, Any]) -> None:
        entries = dict(entries)
        entries.pop("_cycles", None)
        super()._load_checked(entries)
        self._cycles = self._cycle_starts().to(self.last_epoch.device)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        if self._cycles.device != epoch.device:
            self._cycles = self._cycles.to(epoch.device)
        if self.T_mult == 1:
            t_cur, t_i = torch.remainder(epoch, self.T_0), self.T_0
        else:
            cycle = (epoch >= self._cycles[0, 1:]).sum().reshape(1)  # (no host read)
            start, length = self._cycles.index_select(1, cycle).unbind(0)
            t_cur, t_i = epoch - start.reshape(()), length.reshape(()).to(torch.float64)
        wave = (1 + torch.cos(_epoch(t_cur) * math.pi / t_i)) / 2
        return [wave * (base - self.eta_min) + self.eta_min for base in self.base_lrs]


class ConstantLR(LRScheduler):
    """``torch.optim.lr_scheduler.ConstantLR``: the lr times ``factor`` for the first
    ``total_iters`` steps, then the initial lr."""

    def __init__(self, optimizer: Optimizer, factor: float = 1.0 / 3, total_iters: int = 5,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(factor=factor, total_iters=total_iters)
        super().__init__(optimizer, last_epoch)

    _SETTINGS = dict(factor=_factor(low_open=False), total_iters=_at_least(0))

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        e = _epoch(epoch)
        factor = torch.where(epoch < self.total_iters, torch.full_like(e, self.factor),
                             torch.ones_like(e))
        return [factor * base for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.ExponentialLR``: the lr times ``gamma`` every step."""

    def __init__(self, optimizer: Optimizer, gamma: float,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(gamma=gamma)
        super().__init__(optimizer, last_epoch)

    _SETTINGS = dict(gamma=_real)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        factor = torch.pow(self.gamma, _epoch(epoch))
        return [factor * base for base in self.base_lrs]


class PolynomialLR(LRScheduler):
    """``torch.optim.lr_scheduler.PolynomialLR``: the lr times ``(1 - t / total_iters) **
    power`` at step ``t``, 0 from ``total_iters`` on."""

    def __init__(self, optimizer: Optimizer, total_iters: int = 5, power: float = 1.0,
                 last_epoch: int = -1) -> None:  # noqa: D107
        self._set_settings(total_iters=total_iters, power=power)
        super().__init__(optimizer, last_epoch)

    _SETTINGS = dict(total_iters=_at_least(1), power=_real)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        left = 1.0 - _epoch(epoch).clamp(max=self.total_iters) / self.total_iters
        factor = torch.pow(left, self.power)
        return [factor * base for base in self.base_lrs]


class SequentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.SequentialLR``: ``schedulers[i]`` from
    ``milestones[i - 1]`` on, counting its steps from there. E.g. linear warmup then
    cosine: ``SequentialLR(opt, [LinearLR(opt, 0.01, total_iters=w), CosineAnnealingLR(
    opt, T_max=n - w)], milestones=[w])``."""

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler],
                 milestones: Sequence[int], last_epoch: int = -1) -> None:  # noqa: D107
        if not isinstance(schedulers, (list, tuple)):
            raise TypeError(f"SequentialLR: expected schedulers to be a list of schedulers, "
                            f"got {_shown(schedulers)}")
        if len(schedulers) < 1:
            raise ValueError("SequentialLR: expected at least one scheduler, got none")
        for i, scheduler in enumerate(schedulers):
            if not isinstance(scheduler, LRScheduler) or isinstance(scheduler, SequentialLR):
                raise TypeError(f"SequentialLR: expected schedulers[{i}] to be a scheduler of "
                                f"mixedprec.optim.lr_scheduler, got {type(scheduler).__name__}")
            if scheduler.optimizer is not optimizer:
                raise ValueError(f"SequentialLR: expected every scheduler to belong to the "
                                 f"optimizer given; schedulers[{i}] has another")
        self._schedulers = list(schedulers)
        self._milestones = self._check_entry("SequentialLR", "milestones", milestones)
        super().__init__(optimizer, last_epoch)

    def _check_entry(self, where: str, key: str, value: Any) -> Any:
        if key in ("milestones", "_milestones"):  # (the argument, the saved entry)
            milestones = _ints(where, key, value)
            if len(milestones) != len(self._schedulers) - 1:
                raise ValueError(f"{where}: expected {len(self._schedulers) - 1} {key} (one "
                                 f"fewer than schedulers), got {len(milestones)}")
            if milestones != sorted(milestones):
                raise ValueError(f"{where}: expected {key} in increasing order, got "
                                 f"{milestones}")
            return milestones
        if key == "_schedulers":  # each checked by its scheduler, none loaded yet
            saved = _lengths(where, key, value, len(self._schedulers))
            checked = []
            for i, (scheduler, entries) in enumerate(zip(self._schedulers, saved)):
                try:
                    checked.append(scheduler._check_state(entries))
                except (TypeError, ValueError) as e:
                    raise type(e)(f"{where}: _schedulers[{i}]: {e}") from None
            return checked
        return super()._check_entry(where, key, value)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        out = self._schedulers[0]._lrs_at(epoch)
        for scheduler, start in zip(self._schedulers[1:], self._milestones):
            later = scheduler._lrs_at(epoch - start)
            out = [torch.where(epoch >= start, b, a) for a, b in zip(out, later)]
        return out

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102
        out = super().state_dict()
        out["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return out

    def _load_checked(self, entries: Dict[str, Any]) -> None:
        entries = dict(entries)
        saved = entries.pop("_schedulers", [])
        super()._load_checked(entries)
        for scheduler, checked in zip(self._schedulers, saved):
            scheduler._load_checked(checked)
