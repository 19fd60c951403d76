"""Learning-rate schedules computed on the device from the optimizer's count of applied
steps, so that a step skipped by a loss scaler (``found_inf`` set) does not advance the
schedule, and no step reads a device value on the host.

torch.optim.lr_scheduler's names, signatures and defaults: :class:`LambdaLR`,
:class:`LinearLR`, :class:`StepLR`, :class:`MultiStepLR`, :class:`CosineAnnealingLR`
and :class:`SequentialLR` (warmup then cosine: ``SequentialLR(opt, [LinearLR(...),
CosineAnnealingLR(...)], milestones=[warmup])``). Each is a
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
"""

import math
import types
from typing import Any, Callable, Dict, List, Sequence, Union

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch

__all__ = ["LRScheduler", "LambdaLR", "LinearLR", "StepLR", "MultiStepLR",
           "CosineAnnealingLR", "SequentialLR"]


class LRScheduler(_torch.LRScheduler):
    """The base: ``last_epoch`` and the lrs on the device (see the module docstring).
    Subclasses define :meth:`_lrs_at`."""

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
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"{name}: expected last_epoch to be an int >= -1, got "
                             f"{last_epoch!r}")
        groups = optimizer.param_groups
        if last_epoch != -1:
            missing = [i for i, group in enumerate(groups) if "initial_lr" not in group]
            if missing:
                raise KeyError(f"{name}: param 'initial_lr' is not specified in "
                               f"param_groups[{missing[0]}] when resuming a scheduler with "
                               "last_epoch >= 0 (load the optimizer's state dict first)")
        device = count.device
        for group in groups:
            lr = group["lr"]
            if last_epoch == -1:
                group.setdefault("initial_lr", lr.clone() if isinstance(lr, Tensor) else lr)
            if not isinstance(lr, Tensor):
                group["lr"] = torch.tensor(float(lr), dtype=torch.float64, device=device)
            elif lr.device != device or lr.dim() != 0:
                group["lr"] = lr.detach().reshape(()).to(device)
        self.optimizer = optimizer
        # The base lrs as numbers: read once here, never in a step.
        self.base_lrs = [float(g["initial_lr"]) for g in groups]  # sync-ok: construction
        self.last_epoch = torch.tensor(last_epoch + 1, dtype=torch.int64, device=device)
        self._seen = count.detach().clone()  # the count at the previous step()
        self._write(self.get_lr())

    # -- the schedule -----------------------------------------------------------------
    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        """Each group's lr (a 0-dim float64 device tensor) at ``epoch`` (int64)."""
        raise NotImplementedError

    def get_lr(self) -> List[Tensor]:
        """The lrs at ``last_epoch``, computed on the device."""
        return self._lrs_at(self.last_epoch)

    # -- stepping ---------------------------------------------------------------------
    def step(self, epoch: Union[int, Tensor, None] = None) -> None:
        """Advances ``last_epoch`` by one if the optimizer applied a step since the
        previous call (on the device), and writes the lrs into the param groups."""
        if epoch is None:
            count = self.optimizer.applied_steps
            if count.device != self._seen.device:  # the model moved: follow it, once
                self._to(count.device)
            self.last_epoch.add_((count != self._seen).to(torch.int64))
            self._seen.copy_(count)
        else:
            self.last_epoch.copy_(torch.as_tensor(epoch, dtype=torch.int64))
        self._write(self.get_lr())

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
        """Every attribute but the optimizer; tensors cloned."""
        return {key: value.clone() if isinstance(value, Tensor) else value
                for key, value in vars(self).items() if key != "optimizer"}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s values (``last_epoch`` may also be an int, as in
        a torch scheduler's state dict); the device tensors are written in place."""
        for key, value in state_dict.items():
            current = getattr(self, key, None)
            if isinstance(current, Tensor) and isinstance(value, (Tensor, int, float)):
                current.copy_(torch.as_tensor(value, dtype=current.dtype))
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
            self.lr_lambdas = [lr_lambda] * len(groups)
        else:
            if len(lr_lambda) != len(groups):
                raise ValueError(f"LambdaLR: expected {len(groups)} lr_lambdas, but got "
                                 f"{len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        super().__init__(optimizer, last_epoch)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        e = _epoch(epoch)
        out = []
        for base, fn in zip(self.base_lrs, self.lr_lambdas):
            factor = fn(e)
            if not isinstance(factor, Tensor):  # (a constant: no copy from the host)
                factor = torch.full_like(e, float(factor))
            out.append(factor.to(torch.float64) * base)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """As torch's: the functions are not saved, callable objects' attributes are."""
        out = super().state_dict()
        out["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else fn.__dict__.copy()
                             for fn in self.lr_lambdas]
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # noqa: D102
        state_dict = dict(state_dict)
        lambdas = state_dict.pop("lr_lambdas", [])
        super().load_state_dict(state_dict)
        for fn, saved in zip(self.lr_lambdas, lambdas):
            if saved is not None:
                fn.__dict__.update(saved)


class LinearLR(LRScheduler):
    """``torch.optim.lr_scheduler.LinearLR``: the factor goes linearly from
    ``start_factor`` to ``end_factor`` over ``total_iters`` steps (warmup)."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3,
                 end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1) -> None:  # noqa: D107
        if not 0 < start_factor <= 1:
            raise ValueError("LinearLR: expected start_factor in (0, 1], got "
                             f"{start_factor!r}")
        if not 0 <= end_factor <= 1:
            raise ValueError(f"LinearLR: expected end_factor in [0, 1], got {end_factor!r}")
        if isinstance(total_iters, bool) or not isinstance(total_iters, int) or total_iters < 1:
            raise ValueError(f"LinearLR: expected total_iters to be an int >= 1, got "
                             f"{total_iters!r}")
        self.start_factor, self.end_factor = float(start_factor), float(end_factor)
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        done = _epoch(epoch).clamp(max=self.total_iters) / self.total_iters
        factor = self.start_factor + (self.end_factor - self.start_factor) * done
        return [factor * base for base in self.base_lrs]


class StepLR(LRScheduler):
    """``torch.optim.lr_scheduler.StepLR``: the lr times ``gamma`` every ``step_size``
    steps."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:  # noqa: D107
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"StepLR: expected step_size to be an int >= 1, got "
                             f"{step_size!r}")
        self.step_size, self.gamma = step_size, float(gamma)
        super().__init__(optimizer, last_epoch)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        times = torch.div(epoch, self.step_size, rounding_mode="floor").to(torch.float64)
        factor = torch.pow(self.gamma, times)
        return [factor * base for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """``torch.optim.lr_scheduler.MultiStepLR``: the lr times ``gamma`` at each
    milestone (a milestone listed twice counts twice, as in torch)."""

    def __init__(self, optimizer: Optimizer, milestones: Sequence[int], gamma: float = 0.1,
                 last_epoch: int = -1) -> None:  # noqa: D107
        milestones = sorted(milestones)
        if any(isinstance(m, bool) or not isinstance(m, int) for m in milestones):
            raise ValueError(f"MultiStepLR: expected milestones to be ints, got {milestones}")
        self.milestones, self.gamma = milestones, float(gamma)
        self._marks = torch.tensor(milestones, dtype=torch.int64)  # (moved once, below)
        super().__init__(optimizer, last_epoch)

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
        if isinstance(T_max, bool) or not isinstance(T_max, int) or T_max < 1:
            raise ValueError(f"CosineAnnealingLR: expected T_max to be an int >= 1, got "
                             f"{T_max!r}")
        self.T_max, self.eta_min = T_max, float(eta_min)
        super().__init__(optimizer, last_epoch)

    def _lrs_at(self, epoch: Tensor) -> List[Tensor]:
        wave = (1 + torch.cos(_epoch(epoch) * (math.pi / self.T_max))) / 2
        return [wave * (base - self.eta_min) + self.eta_min for base in self.base_lrs]


class SequentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.SequentialLR``: ``schedulers[i]`` from
    ``milestones[i - 1]`` on, counting its steps from there. E.g. linear warmup then
    cosine: ``SequentialLR(opt, [LinearLR(opt, 0.01, total_iters=w), CosineAnnealingLR(
    opt, T_max=n - w)], milestones=[w])``."""

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler],
                 milestones: Sequence[int], last_epoch: int = -1) -> None:  # noqa: D107
        if len(schedulers) < 1:
            raise ValueError("SequentialLR: expected at least one scheduler, got none")
        for i, scheduler in enumerate(schedulers):
            if not isinstance(scheduler, LRScheduler) or isinstance(scheduler, SequentialLR):
                raise TypeError(f"SequentialLR: expected schedulers[{i}] to be a scheduler of "
                                f"mixedprec.optim.lr_scheduler, got {type(scheduler).__name__}")
            if scheduler.optimizer is not optimizer:
                raise ValueError(f"SequentialLR: expected every scheduler to belong to the "
                                 f"optimizer given; schedulers[{i}] has another")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"SequentialLR: expected {len(schedulers) - 1} milestones (one "
                             f"fewer than schedulers), got {len(milestones)}")
        self._schedulers = list(schedulers)
        self._milestones = [int(m) for m in milestones]
        super().__init__(optimizer, last_epoch)

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

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # noqa: D102
        state_dict = dict(state_dict)
        saved = state_dict.pop("_schedulers", [])
        super().load_state_dict(state_dict)
        for scheduler, sd in zip(self._schedulers, saved):
            scheduler.load_state_dict(sd)
