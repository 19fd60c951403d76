"""The base of mixedprec's optimizers: master weights or the lean modes, the loss
scaler's channel (``grad_scale``/``found_inf``), state that follows its parameter,
plans that reuse a step's op calls, and state loading.

Each subclass runs one fused op call per param group and device:

* it reads fp32, fp16 or bf16 gradients and multiplies them by ``1 / grad_scale`` when a
  ``torch.amp.GradScaler`` or :class:`mixedprec.GradScaler` set ``grad_scale``;
* it skips the whole update on the device when the scaler set ``found_inf``, so an
  overflow never forces a host synchronisation;
* with fp32 masters (``master="fp32"``) it updates fp32 master copies of fp16/bf16
  parameters (kept in the optimizer state as ``master_param``) and writes them, cast,
  into the model parameters in the same pass.

State is created at a parameter's first step, as torch's optimizers create theirs
(masters included): an optimizer that has not stepped has an empty ``state``, which
is what ``torch.distributed.checkpoint.state_dict`` relies on to build the full
state it loads a checkpoint into. State follows its parameter: moved with it, laid out
like it (``channels_last`` after the optimizer was built works), and a master is taken
anew from its parameter when the parameter was written outside the optimizer (see
``_FusedOptimizer._master``). Moments and momentum buffers are float32, bfloat16 or 8-bit
(``state_dtype``); docs/lean-precision.md has the lean modes.

The one channel from a loss scaler: the ``grad_scale`` and ``found_inf`` attributes
that ``torch.amp.GradScaler`` sets around ``step()`` (mixedprec's GradScaler and the
Apex faces set the same). With masters, a master whose ``.grad`` is set (fp32,
unscaled) is updated from that instead of ``p.grad``: Apex's amp puts it there for
gradient clipping, and the step clears it.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import grads as _grads
from .. import masters as mst
from ..grads import update_grad
from ..loss_scale import inverse
from .lean import (  # noqa: F401
    _FLOAT_DTYPES,
    _MASTER_MODES,
    _STATE_DTYPES,
    LeanModes,
    _check_state_dtype,
    _master_mode,
    _rounding_seed,
    lean_refused,
)
from .plans import Plans, _Plan
from .state import StateLoading


class _Work(NamedTuple):
    """The parameters of one op call, their gradients and their state dicts (None for
    a parameter without state yet)."""

    params: List[Tensor]
    grads: List[Tensor]
    states: List[Optional[Dict[str, Any]]]

    def pick(self, positions: List[int]) -> "_Work":
        return _Work([self.params[i] for i in positions], [self.grads[i] for i in positions],
                     [self.states[i] for i in positions])


def _pick(grads: List[Tensor], positions: Optional[List[int]]) -> List[Tensor]:
    """The gradients of one op call of a group (``_lean_calls``' positions)."""
    return grads if positions is None else [grads[i] for i in positions]


def _where(picked: List[int], positions: Optional[List[int]], count: int
           ) -> Optional[List[int]]:
    """The positions in the group's gradients (``count`` of them) of an op call's
    parameters, ``picked`` from a ``_lean_calls`` call at ``positions``: None when
    they are all of them in order, so that ``_pick`` then builds no list."""
    where = picked if positions is None else [positions[i] for i in picked]
    return None if len(where) == count and where == list(range(count)) else where


def _check_nonnegative(name: str, value: Any) -> None:
    if isinstance(value, Tensor) or not isinstance(value, (int, float)):
        raise TypeError(f"expected {name} to be a float, got {type(value).__name__}")
    if not value >= 0.0:
        raise ValueError(f"expected {name} >= 0, got {value}")



class _FusedOptimizer(LeanModes, Plans, StateLoading, Optimizer):
    """What FusedSGD and FusedAdam share: masters, scaler hand-off, state loading."""

    # torch.amp.GradScaler hands this optimizer `grad_scale` and `found_inf` instead of
    # unscaling and checking gradients itself.
    _step_supports_amp_scaling = True
    # The per-parameter state entries this optimizer keeps (load_state_dict checks).
    _STATE_KEYS: Tuple[str, ...] = ("master_param",)
    # Whether it takes the lean modes: master "kahan"/"stochastic" and bf16 state
    # (FusedAdam, FusedSGD), or only fp32 masters or none, and fp32 state.
    _LEAN = False

    def __init__(self, params, defaults: Dict[str, Any], master_weights: Optional[bool],
                 set_grad_none: bool, master: Optional[str] = None,
                 state_dtype: torch.dtype = torch.float32, seed: Optional[int] = None):
        where = type(self).__name__
        # "fp32" (fp32 masters of fp16/bf16 params), "none" (params updated directly),
        # "kahan" (bf16 params with a bf16 compensation each, "kahan_comp") or
        # "stochastic" (bf16 params rounded stochastically, group["sr_seed"]).
        self.master = _master_mode(where, master_weights, master)
        # The dtype of moments and momentum buffers (float32, bfloat16 or float8_e4m3fn).
        self.state_dtype = _check_state_dtype(where, "state_dtype", state_dtype)
        # master='stochastic' or 8-bit moments: group i's seed is this + i (see
        # add_param_group).
        self._sr_seed = _rounding_seed(where, self.master, seed, self.state_dtype)
        self.set_grad_none = bool(set_grad_none)
        self._plans: Dict[int, _Plan] = {}
        # id(master) -> the version counter of its parameter when the master was last
        # in step with it (the update writes the parameter without bumping it).
        self._master_versions: Dict[int, int] = {}
        super().__init__(params, defaults)
        #: The number of steps applied (not skipped on the device by a scaler's
        #: ``found_inf``): a 0-dim int64 tensor, advanced in :meth:`step` without a host
        #: read; ``state_dict()["applied_steps"]``. mixedprec.optim.lr_scheduler reads it.
        self.applied_steps = torch.zeros((), dtype=torch.int64, device=self._count_device())

    def _count_device(self) -> torch.device:
        """Where ``applied_steps`` lives: the device of the first parameter."""
        for group in self.param_groups:
            if group["params"]:
                return group["params"][0].device
        return torch.device("cpu")

    def _count_applied(self, found_inf: Optional[Tensor]) -> None:
        """``applied_steps += 1`` unless ``found_inf`` is set, on the device (moved first,
        once, to the flag's or the parameters' device when that changed)."""
        device = found_inf.device if found_inf is not None else self._count_device()
        if self.applied_steps.device != device:
            self.applied_steps = self.applied_steps.to(device)
        if found_inf is None:
            self.applied_steps.add_(1)
        else:  # (the bool flag is promoted in the add: one kernel, not a cast and an add)
            self.applied_steps.add_((found_inf if found_inf.dim() == 0
                                     else found_inf.reshape(())) == 0)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:  # checked before torch adds the group, so a bad one changes nothing
            p = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, param)
            if isinstance(p, Tensor) and not self._fused_dtype(p):
                continue  # (a subclass steps it another way)
            if isinstance(p, Tensor) and p.layout != torch.strided:
                raise TypeError(f"{type(self).__name__} does not support sparse parameters")
            if isinstance(p, Tensor) and p.dtype not in _FLOAT_DTYPES:
                raise TypeError(
                    f"{type(self).__name__}: expected parameters of dtype float32, float16 or "
                    f"bfloat16, got {p.dtype}"
                )
            if isinstance(p, Tensor):
                self._check_kahan(p)
        param_group = dict(param_group, params=params)
        if self._sr_seed is not None and "sr_seed" not in param_group:
            # Each group its own seed: positions (the salts) repeat across groups.
            param_group["sr_seed"] = (self._sr_seed + len(self.param_groups)) % 2**63
        super().add_param_group(param_group)
        self._invalidate_plans()

    def _fused_dtype(self, p: Tensor) -> bool:
        """Hook: whether the fused ops step ``p`` (the torch-named optimizers step float64
        and complex parameters through torch's own implementation)."""
        return True

    def _new_master(self, p: Tensor, state: Dict[str, Any]) -> Tensor:
        """A fresh fp32 master of ``p`` in its ``state``, and the version of ``p`` it was
        taken at (see ``_master``)."""
        master = state["master_param"] = mst.make_master(p)
        if not torch.compiler.is_compiling():  # (id() is not traceable; see _master)
            self._master_versions[id(master)] = p._version
        return master

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Zeroes the gradients; ``set_to_none`` defaults to the constructor's
        ``set_grad_none``."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _scaling(self, device: torch.device, scaling):
        """``(inv_scale, found_inf)`` on `device` from (grad_scale, found_inf)."""
        grad_scale, found_inf = scaling
        inv_scale = None
        if grad_scale is not None:
            inv_scale = inverse(grad_scale.to(device))
        if found_inf is not None:
            found_inf = found_inf.to(device, torch.float32)
        return inv_scale, found_inf

    def _grads_by_device(self, group: Dict[str, Any]) -> Dict[torch.device, "_Work"]:
        """The group's parameters that have gradients, with those gradients and their
        state dicts, by device, after checking them. One pass and one state lookup
        per parameter: this runs every step, and its cost is the step's fixed cost.
        The gradient the update reads: :func:`mixedprec.grads.update_grad`."""
        params: List[Tensor] = []
        grads: List[Tensor] = []
        states: List[Optional[Dict[str, Any]]] = []
        state_of = self.state
        for p in group["params"]:
            state = state_of.get(p)
            grad = update_grad(p, state.get("master_param") if state else None)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if grad.dtype not in _FLOAT_DTYPES:
                raise TypeError(
                    f"{type(self).__name__}: expected gradients of dtype float32, float16 or "
                    f"bfloat16, got {grad.dtype}"
                )
            if grad.shape != p.shape:
                raise ValueError(f"{type(self).__name__}: a gradient of shape "
                                 f"{tuple(grad.shape)} for a parameter of shape "
                                 f"{tuple(p.shape)}")
            if grad.stride() != p.stride() and not mst.same_layout(grad, p):
                grad = mst.follow_layout(grad, p)  # as torch accepts: read in p's layout
            self._check_kahan(p)  # (the model may have been cast after construction)
            params.append(p)
            grads.append(grad)
            states.append(state)
        work = {device: _Work(*lists)
                for device, lists in _grads.by_device(params, grads, states).items()}
        for device, items in work.items():
            if device.type == "meta":
                self._refuse_meta(group, items.params)
        self._check_devices(work)
        return work

    def _check_devices(self, by_device: Dict[torch.device, _Work]) -> None:
        """Hook: reject a device layout the optimizer cannot step (before any update)."""

    def _refuse_meta(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """Parameters on the meta device hold no values: refused before any update (a
        step would leave meta state behind for the parameters once materialised)."""
        raise RuntimeError(f"{type(self).__name__}.step: {len(params)} parameter(s) with "
                           "gradients are on the meta device, which holds no values; "
                           "materialise the model first (e.g. model.to_empty(device=...))")

    def _master(self, p: Tensor, state: Dict[str, Any]) -> Optional[Tensor]:
        """p's fp32 master in p's `state`, or None when p needs none.

        The master follows the parameter: created when the model was cast to 16 bits
        after the optimizer was built, moved and re-laid-out with it (``.cuda()``,
        ``channels_last``), dropped while the parameter is fp32 (it is then its own
        master), and brought up to the parameter when the parameter was written
        outside the optimizer (its version counter moved: ``load_state_dict`` on the
        model, an in-place edit under ``no_grad``; edits through ``.data`` do not
        count, as they bypass the counter): the elements written take the parameter's
        value, those the write left as they were keep their fp32 value
        (:func:`mixedprec.masters.retake_master`). A Kahan compensation or remainder is
        converted as ``_convert_lean_state`` says."""
        self._convert_lean_state(p, state)
        if not self.master_weights or not mst.needs_master(p):
            if state.get("master_param") is not None:
                self._master_versions.pop(id(state.pop("master_param")), None)
            return None
        master = state.get("master_param")
        if master is None:
            return self._new_master(p, state)
        # (Under torch.compile the version counter is not traceable: not checked there.)
        if not torch.compiler.is_compiling() and (
                self._master_versions.setdefault(id(master), p._version) != p._version):
            del self._master_versions[id(master)]
            if not mst.retake_master(master, p):
                return self._new_master(p, state)
            self._master_versions[id(master)] = p._version
        moved = mst.follow_layout(master, p)
        if moved is not master:
            self._master_versions[id(moved)] = self._master_versions.pop(id(master),
                                                                          p._version)
            state["master_param"] = moved
        return moved

    @staticmethod
    def _state_tensor(state: Dict[str, Any], key: str, like: Tensor,
                      dtype: torch.dtype = torch.float32) -> Tensor:
        """state[key] on like's device and in its layout, created as zeros of `dtype`
        (made from `like`: a DTensor's state is a DTensor with its placements) if
        absent."""
        value = state.get(key)
        if value is None:
            value = state[key] = torch.zeros_like(like, dtype=dtype,
                                                  memory_format=torch.preserve_format)
        else:
            value = state[key] = mst.follow_layout(value, like)
        return value

    def _moments(self, states: List[Dict[str, Any]], targets: List[Tensor]):
        """Adam's two moments (``exp_avg``, ``exp_avg_sq``, of ``state_dtype``) of each
        target, created as zeros where absent (FusedAdam, FusedLAMB)."""
        dtype = self._moment_dtype()
        return ([self._state_tensor(state, "exp_avg", t, dtype)
                 for state, t in zip(states, targets)],
                [self._state_tensor(state, "exp_avg_sq", t, dtype)
                 for state, t in zip(states, targets)])

    # The step count of FusedAdam, FusedLAMB and FusedNovoGrad belongs to the param group,
    # as in Apex: ``group["step"]``, a float32 tensor of shape [1] on the group's device.
    @staticmethod
    def _group_step(group: Dict[str, Any], device: torch.device) -> Tensor:
        """``group["step"]`` on ``device``, created from the number it holds (0 if absent:
        an Apex-style subclass's int, FusedMixedPrecisionLamb's start count)."""
        step = group.get("step")
        if not isinstance(step, Tensor):
            step = group["step"] = torch.full((1,), float(step or 0), dtype=torch.float32,
                                              device=device)
        elif step.device != device:  # the model moved after the optimizer was built
            step = group["step"] = step.to(device)
        return step

    def _one_device(self, by_device: Dict[torch.device, "_Work"], why: str) -> None:
        if len(by_device) > 1:
            raise ValueError(f"{type(self).__name__}: the parameters of a param group must "
                             f"share one device ({why}), got {list(by_device)}")

    def _update_lists(self, params: List[Tensor], states: List[Dict[str, Any]]):
        """(update targets, model copies) for one op call: the fp32 masters and the
        model params when any param has a master (an fp32 param is then its own
        master), else the params themselves and no model copy."""
        masters = [self._master(p, state) for p, state in zip(params, states)]
        if all(m is None for m in masters):
            return list(params), []
        return [p if m is None else m for p, m in zip(params, masters)], list(params)

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one optimization step (on the device, without host synchronisation)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._fused_step()
        return loss

    def _fused_step(self) -> None:
        """``step`` without the closure, under the caller's ``torch.no_grad()``."""
        # The one channel from a loss scaler: the attributes torch.amp.GradScaler sets
        # around step() for optimizers with _step_supports_amp_scaling (mixedprec's
        # GradScaler, amp and fp16_utils set the same ones).
        scaling = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        planned = self._planned_work()
        if planned is not None:
            used_master_grads = False
            scaled: Dict[torch.device, Any] = {}  # (inv_scale, found_inf) by device
            for group, plan, grads, from_master in planned:
                if plan.lists is not None:
                    if plan.device not in scaled:
                        scaled[plan.device] = self._scaling(plan.device, scaling)
                    self._run_plan(group, plan.lists, grads, *scaled[plan.device])
                used_master_grads |= from_master
            if used_master_grads:  # master gradients are used by one step
                for _, plan, _, _ in planned:
                    for master in plan.masters:
                        if master is not None:
                            master.grad = None
            self._count_applied(scaling[1])
            return
        # Check every group before touching any state, so a bad gradient changes nothing.
        work = [(group, self._grads_by_device(group)) for group in self.param_groups]
        plans: Dict[int, _Plan] = {}
        compiling = torch.compiler.is_compiling()
        for index, (group, by_device) in enumerate(work):
            for device, items in by_device.items():
                for i, (p, state) in enumerate(zip(items.params, items.states)):
                    if state is None:  # first step of p: its state starts now
                        items.states[i] = self.state[p]
                lists = self._step_group(group, device, items, *self._scaling(device, scaling))
                for p, state in zip(items.params, items.states):
                    if not state:  # nothing kept (SGD without momentum on an fp32 param)
                        self.state.pop(p, None)
                if lists is not None and len(by_device) == 1 and not compiling:
                    plans[index] = self._make_plan(group, lists, device)
            if not by_device and not compiling:  # no gradients in this group
                plans[index] = self._make_plan(group, None, None)
        for _, by_device in work:  # master gradients are used by one step
            for items in by_device.values():
                for state in items.states:
                    master = state.get("master_param")
                    if master is not None:
                        master.grad = None
        self._plans.clear()
        if not torch.compiler.is_compiling():
            self._plans.update(plans)
        self._count_applied(scaling[1])

    def state_dict(self) -> Dict[str, Any]:
        """torch's ``state`` and ``param_groups``, and ``applied_steps`` (a tensor, which
        torch.optim's ``load_state_dict`` ignores)."""
        return dict(super().state_dict(), applied_steps=self.applied_steps.clone())

    def __getstate__(self) -> Dict[str, Any]:
        # torch.optim.Optimizer keeps only defaults, state and param_groups.
        state = super().__getstate__()
        state.update(master=self.master, state_dtype=self.state_dtype,
                     set_grad_none=self.set_grad_none, _sr_seed=self._sr_seed, _plans={},
                     _master_versions={}, applied_steps=self.applied_steps)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # (A pickle from before the master modes holds master_weights instead.)
        master_weights = state.pop("master_weights", False)
        state.setdefault("master", "fp32" if master_weights else "none")
        state.setdefault("state_dtype", torch.float32)
        state.setdefault("_sr_seed", None)
        state.setdefault("applied_steps", torch.zeros((), dtype=torch.int64))
        super().__setstate__(state)

    def _step_group(self, group, device, items: "_Work", inv_scale,
                    found_inf) -> Optional[tuple]:
        """One group's update on one device; returns the op's lists other than the
        gradients (for ``_run_plan``), or None when the next step cannot reuse them."""
        raise NotImplementedError

    def _run_plan(self, group, lists: tuple, grads: List[Tensor], inv_scale,
                  found_inf) -> None:
        """The op call of ``_step_group`` again, with the lists it returned."""
        raise NotImplementedError
