"""A GradScaler with no host synchronisation in the step, hysteresis and a scale floor
and ceiling."""

import math
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.amp.grad_scaler import _MultiDeviceReplicator, _refresh_per_optimizer_state

from . import ops

__all__ = ["GradScaler"]


def _check_hysteresis(hysteresis: Any) -> None:
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
        raise ValueError(f"expected hysteresis to be an int >= 1, got {hysteresis!r}")


def _check_scale_bounds(min_scale: float, max_scale: float) -> None:
    if not 0.0 <= min_scale <= max_scale:
        raise ValueError(f"expected 0 <= min_scale <= max_scale, got min_scale={min_scale} "
                         f"and max_scale={max_scale}")


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the same arguments, defaults, methods and
    ``state_dict`` keys, plus:

    * ``hysteresis``: how many consecutive overflowing steps it takes before the scale
      backs off (1, the default, is torch's behaviour);
    * ``min_scale`` / ``max_scale``: a floor and a ceiling for the scale (by default
      none);
    * no host synchronisation in :meth:`step` and :meth:`update` with optimizers that
      declare ``_step_supports_amp_scaling`` (mixedprec's :class:`FusedSGD` and
      :class:`FusedAdam`, torch's fused optimizers): the overflow check is one
      read-only pass over the gradients on the device, and the optimizer skips the
      update on the device. With any other optimizer, :meth:`step` behaves exactly like
      torch's (it reads the overflow flag on the host to decide whether to step);
    * :meth:`unscale_` runs mixedprec's multi-tensor kernel, which also takes bfloat16
      gradients on CUDA;
    * :meth:`found_inf` gives the last update's overflow flag as a device tensor, so a
      caller can tell whether the last step was skipped when it chooses to read it.

    The scale update follows ``mixedprec.ops.update_loss_scale_``.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, hysteresis: int = 1,
                 min_scale: float = 0.0, max_scale: float = math.inf) -> None:
        _check_hysteresis(hysteresis)
        _check_scale_bounds(min_scale, max_scale)
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval,
                         enabled)
        self._hysteresis = hysteresis
        self._min_scale = float(min_scale)
        self._max_scale = float(max_scale)
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: Optional[Tensor] = None
        self._found_inf: Optional[Tensor] = None

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker,
                                              dtype=torch.int32, device=dev)

    @staticmethod
    def _grads_by_device(optimizer: torch.optim.Optimizer, allow_fp16: bool):
        """Dense gradient tensors by device (sparse ones through their values), checked
        before anything is written."""
        by_device: Dict[torch.device, List[Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                by_device[grad.device].append(grad)
        return by_device

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        with torch.no_grad():
            for device, grads in self._grads_by_device(optimizer, allow_fp16).items():
                dense = [g for g in grads if ops.is_dense(g)]
                other = [g for g in grads if not ops.is_dense(g)]
                ops.multi_tensor_unscale_(dense, per_device_found_inf.get(device),
                                          per_device_inv_scale.get(device))
                if other:  # rare layouts the multi-tensor kernel does not take
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        other, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        return per_device_found_inf._per_device_tensors

    def _check_inf_per_device(self, optimizer):
        # For optimizers that unscale inside their own kernel: read the gradients once,
        # write nothing.
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=_scale.device)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        with torch.no_grad():
            for device, grads in self._grads_by_device(optimizer, True).items():
                flag = per_device_found_inf.get(device)
                dense = [g for g in grads if ops.is_dense(g)]
                ops.multi_tensor_check_finite_(dense, flag)
                for g in grads:
                    if not ops.is_dense(g):
                        flag.add_((~torch.isfinite(g)).any())
        states = self._per_optimizer_states[id(optimizer)]
        states["found_inf_per_device"] = per_device_found_inf._per_device_tensors
        return states["found_inf_per_device"]

    def update(self, new_scale: Optional[Any] = None) -> None:
        """Updates the scale on the device from the overflow flags of this iteration's
        steps: on overflow the hysteresis tracker counts down and, once it reaches 0,
        the scale backs off (not below ``min_scale``); after ``growth_interval`` clean
        steps it grows (not above ``max_scale``). ``new_scale`` sets it directly, as in
        torch."""
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            found_inf.to(device=_scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf_combined = found_infs[0].clone()
        for found_inf in found_infs[1:]:
            found_inf_combined += found_inf
        ops.update_loss_scale_(_scale, _growth_tracker, self._hysteresis_tracker,
                               found_inf_combined, self._growth_factor, self._backoff_factor,
                               self._growth_interval, self._hysteresis, self._min_scale,
                               self._max_scale)
        self._found_inf = found_inf_combined
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def found_inf(self) -> Optional[Tensor]:
        """The last :meth:`update`'s overflow flag (nonzero: the steps were skipped), a
        float32 device tensor; None before the first update. Reading its value is the
        caller's choice (and a host synchronisation)."""
        return self._found_inf

    def get_hysteresis(self) -> int:
        return self._hysteresis

    def set_hysteresis(self, new_hysteresis: int) -> None:
        _check_hysteresis(new_hysteresis)
        self._hysteresis = new_hysteresis
        if self._hysteresis_tracker is None:  # not started yet: the first steps use it too
            self._init_hysteresis_tracker = new_hysteresis

    def get_min_scale(self) -> float:
        return self._min_scale

    def set_min_scale(self, new_min_scale: float) -> None:
        _check_scale_bounds(new_min_scale, self._max_scale)
        self._min_scale = float(new_min_scale)

    def get_max_scale(self) -> float:
        return self._max_scale

    def set_max_scale(self, new_max_scale: float) -> None:
        _check_scale_bounds(self._min_scale, new_max_scale)
        self._max_scale = float(new_max_scale)

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())  # sync-ok: checkpointing reads it

    def state_dict(self) -> Dict[str, Any]:
        """torch's keys, plus ``hysteresis``, ``min_scale``, ``max_scale`` and
        ``_hysteresis_tracker``."""
        state = super().state_dict()
        if self._enabled:
            state.update(hysteresis=self._hysteresis, min_scale=self._min_scale,
                         max_scale=self._max_scale,
                         _hysteresis_tracker=self._get_hysteresis_tracker())
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.amp.GradScaler`` (whose
        missing keys keep this scaler's values)."""
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self._hysteresis = state_dict.get("hysteresis", self._hysteresis)
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._init_hysteresis_tracker = state_dict.get("_hysteresis_tracker", self._hysteresis)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_hysteresis_tracker"] = None
            state["_found_inf"] = None
        return state
