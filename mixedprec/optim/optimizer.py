"""The base of mixedprec's optimizers, :class:`Optimizer`: the loop over param groups,
state creation, the loss scaler's channel and ``state_dict``, composed of three objects:
``optimizer.precision`` (:class:`~mixedprec.optim.precision.Precision`: ``master``,
``state_dtype``, ``seed``, and what each op call takes from them), ``optimizer.masters``
(fp32 masters that follow their parameters) and ``optimizer.plans``
(:class:`~mixedprec.optim.plans.PlanCache`: the op calls of the last step, reused). A
subclass gives ``_step_group`` (one group's op calls on one device, returned for the plan)
and ``_run_plan`` (the same calls again); :mod:`.torch_path` has what comes from
torch.optim (its checks, step counts, tensor ``lr``, and its own step for what the fused
ops do not take: float64 and complex parameters, sparse gradients), :mod:`.state` the
loading. A step reads fp32/fp16/bf16 gradients, unscales them by ``1 / grad_scale`` and
skips on ``found_inf`` as a GradScaler sets them, on the device, without host
synchronisation. State starts at a parameter's first step, as torch's."""

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import grads as _grads
from .. import masters as mst
from ..grads import update_grad
from ..loss_scale import inverse
from . import state as _state
from . import state8, torch_path
from .plans import Plan, PlanCache
from .precision import FLOAT_DTYPES, Masters, Precision, Work
from .precision_report import PrecisionReport


class Optimizer(torch.optim.Optimizer):
    """The base of :mod:`mixedprec.optim`'s optimizers (see the module docstring), with
    the keyword-only extras ``master``, ``state_dtype``, ``seed`` and
    ``unscale_grads``.

    With ``master="fp32"`` an fp16/bf16 parameter's value lives in its fp32 master,
    which each step writes back into the parameter. The master follows writes to the
    parameter between steps that torch records: in-place edits under
    ``torch.no_grad()`` (``with torch.no_grad(): p.clamp_(-c, c)``, ``p.mul_(mask)``,
    ``p.copy_(new)``, ``model.load_state_dict(...)``) and new data (``p.data = new``,
    the model moved or converted). An in-place edit through ``.data``
    (``p.data.clamp_(...)``, ``p.data.copy_(new)``) is not recorded (``.data`` is
    another tensor with its own version counter): the next step overwrites it with
    the master. Edit parameters in place under ``torch.no_grad()`` instead."""

    # torch.amp.GradScaler hands the optimizer `grad_scale` and `found_inf`.
    _step_supports_amp_scaling = True
    #: torch.optim's class of the same name (its checks, defaults and group keys), if any.
    _TORCH_CLASS: Any = None
    #: The per-parameter state entries kept (load_state_dict checks).
    _STATE_KEYS: Tuple[str, ...] = ("master_param",)
    # A parameter's state entries that come together (each a tuple of names, one of which
    # must be there), as the class makes them at its first step: a loaded entry with some
    # but not all is refused (of those in _STATE_KEYS: a face's may lack the step).
    _STATE_TOGETHER: Tuple[Tuple[str, ...], ...] = ()
    #: Whether it takes the lean modes, and the state entries of its 8-bit moments.
    _LEAN = False
    _8BIT_KEYS: Tuple[str, ...] = ()
    #: Group keys a newer release added, with the value an older state dict gets.
    _NEWER_KEYS: Dict[str, Any] = {}
    #: Why it cannot step inside backward (mixedprec.optim.in_backward), if it cannot.
    _NOT_IN_BACKWARD = ""
    #: Group hyperparameters torch lets be tensors and the fused ops take as numbers.
    _SCALAR_KEYS: Tuple[str, ...] = ()
    #: What ``_torch_step`` (torch.optim's implementation, for what the fused ops do not
    #: take) keeps: None where there is none, "params" (the parameters as they are, with
    #: state of their dtype) or "fp32 masters" (that, on the fp32 masters of fp16/bf16
    #: parameters under master="fp32"); torch_path.check_torch_stepped refuses the rest.
    _TORCH_STEP_KEEPS: Optional[str] = None
    #: The state entries ``_torch_step`` takes only in the parameter's dtype (torch's Adam:
    #: its lerp_ takes one dtype); torch_path.check_torch_stepped refuses them in another,
    #: as the fused steps may have made them (fp32 moments of a bf16 parameter).
    _TORCH_STEP_SAME_DTYPE: Tuple[str, ...] = ()

    def __init__(self, params, defaults: Dict[str, Any], *, master: str = "fp32",
                 state_dtype: torch.dtype = torch.float32, seed: Optional[int] = None,
                 unscale_grads: bool = True, precision_report: Any = False):
        where = type(self).__name__
        if not isinstance(unscale_grads, bool):
            raise TypeError(f"{where}: expected unscale_grads to be a bool, got "
                            f"{unscale_grads!r}")
        #: The :class:`~mixedprec.optim.precision_report.PrecisionReport` the steps add to
        #: (``precision_report=True``, or N: every N-th step), else None.
        self.precision_report = PrecisionReport.of(where, precision_report)
        #: master, state_dtype and seed, checked (:meth:`configure` changes them).
        self.precision = Precision(where, master, state_dtype, seed, self._LEAN,
                                   self._8BIT_KEYS)
        #: After a scaled step, p.grad holds the unscaled gradient (as with torch's fused
        #: optimizers); False skips that write.
        self.unscale_grads = unscale_grads
        self.plans = PlanCache()
        self.masters = Masters()
        self._checked: Dict[int, Tuple[Any, ...]] = {}  # see torch_path.check_groups
        # (group, params) that torch's implementation steps, found during a step
        self._pending: List[Tuple[Dict[str, Any], List[Tensor]]] = []
        super().__init__(params, defaults)
        self.state = _state.tracked(self.state)  # (counts its edits: PlanCache.keep)
        #: The number of steps applied (not skipped by a scaler's ``found_inf``): a 0-dim
        #: int64 tensor advanced on the device; mixedprec.optim.lr_scheduler reads it.
        self.applied_steps = torch.zeros((), dtype=torch.int64,
                                         device=_state.count_device(self))
        #: The :class:`~mixedprec.optim.in_backward.InBackward` handle while the optimizer
        #: steps inside backward (``step()`` then raises), else None.
        self.in_backward = None

    master = property(lambda self: self.precision.master, doc="What is kept of each "
                      "parameter's value: 'fp32', 'none', 'kahan', 'stochastic', 'remainder'.")
    state_dtype = property(lambda self: self.precision.state_dtype,
                           doc="The dtype of moments and momentum buffers.")

    def configure(self, *, master: Optional[str] = None,
                  state_dtype: Optional[torch.dtype] = None, check_only: bool = False) -> None:
        """Sets ``master`` and ``state_dtype`` (None: unchanged) after construction: before
        the first step, or after it where the state carries over exactly (into "fp32",
        "remainder" or "none": :meth:`Precision.configure`). Checked first, and nothing
        changes on an error; ``check_only`` only checks."""
        where = f"{type(self).__name__}.configure"
        self.precision.configure(where, master, state_dtype, bool(self.state), apply=False)
        if state_dtype is not None:
            self._check_8bit(where, state_dtype)
        kept = (self.master if master is None else master,
                self.state_dtype if state_dtype is None else state_dtype, self.precision_report)
        for index, group in enumerate(self.param_groups):
            torch_path.check_differentiable(f"{where}: param group {index}", group, *kept)
            torch_path.check_torch_stepped(self, f"{where}: param group {index}", group, *kept)
        if check_only:
            return
        self.precision.configure(where, master, state_dtype, False)
        for i, group in enumerate(self.param_groups):
            if self.precision.seed is not None:
                group.setdefault("seed", self.precision.group_seed(i))
        self.plans.invalidate()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        where = type(self).__name__
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, param)
                   for p in params]
        for p in tensors:  # checked before torch adds the group, so a bad one changes nothing
            if not isinstance(p, Tensor) or not self._fused_dtype(p):
                continue  # (torch's own checks, or torch's implementation steps it)
            if p.layout != torch.strided:
                raise TypeError(f"{where} does not support sparse parameters")
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{where}: expected parameters of dtype float32, float16 or "
                                f"bfloat16, got {p.dtype}")
            self.precision.check_param(where, p)
        self._check_8bit(where, self.state_dtype, [param_group])
        whole = {**self.defaults, **param_group, "params": tensors}
        torch_path.check_differentiable(where, whole, self.master, self.state_dtype,
                                        self.precision_report)
        torch_path.check_torch_stepped(self, where, whole, self.master, self.state_dtype,
                                       self.precision_report)
        param_group = dict(param_group, params=params)
        if self.precision.seed is not None and "seed" not in param_group:
            param_group["seed"] = self.precision.group_seed(len(self.param_groups))
        super().add_param_group(param_group)
        try:  # (checked here, not in the step that follows: torch's checks build tensors)
            torch_path.check_groups(self, self._checked, "add_param_group")
        except (TypeError, ValueError):
            self.param_groups.pop()  # (a bad group changes nothing)
            raise
        self.plans.invalidate()

    def _fused_dtype(self, p: Tensor) -> bool:
        """Whether the fused ops step ``p`` (else torch's implementation)."""
        return torch_path.is_fused_param(p)

    def _fused_group(self, group: Dict[str, Any]) -> bool:
        """Whether the group's hyperparameters suit the fused ops (else torch's
        implementation steps the group: differentiable, or a tensor where the ops take
        a number)."""
        if group.get("differentiable"):
            return False
        return not any(isinstance(v, Tensor) for key in self._SCALAR_KEYS
                       for v in (group[key] if isinstance(group[key], tuple) else (group[key],)))

    def _scaling(self, device: torch.device, scaling) -> Tuple[Optional[Tensor], Any]:
        """``(inv_scale, found_inf)`` on ``device`` from (grad_scale, found_inf)."""
        grad_scale, found_inf = scaling
        inv_scale = None if grad_scale is None else inverse(grad_scale.to(device))
        if found_inf is not None:
            found_inf = found_inf.to(device, torch.float32)
        return inv_scale, found_inf

    def _grads_by_device(self, group: Dict[str, Any]) -> Dict[torch.device, Work]:
        """The group's fused parameters that have gradients, with those gradients and
        their state dicts, by device, after checking them (the others are queued for
        torch's implementation). One pass per parameter: this is the step's fixed cost.
        The gradient the update reads: :func:`mixedprec.grads.update_grad`."""
        where = type(self).__name__
        torch_path.check_once(f"{where}.step", group["params"])
        unfused = torch_path.unfused(self, group)
        self._check_unfused(group, unfused)
        if unfused:  # (checked again: parameters may have changed since they were added)
            torch_path.check_torch_stepped(self, f"{where}.step", group, self.master,
                                           self.state_dtype, self.precision_report, unfused)
            self._pending.append((group, unfused))
        if not self._fused_group(group):
            return {}
        params, grads, states = [], [], []
        for p in torch_path.Subset(group, unfused)["params"]:
            state = self.state.get(p)
            grad = update_grad(p, state.get("master_param") if state else None)
            if grad is None:
                continue
            if grad.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{where}: expected gradients of dtype float32, float16 or "
                                f"bfloat16, got {grad.dtype}")
            if grad.shape != p.shape:
                raise ValueError(f"{where}: a gradient of shape {tuple(grad.shape)} for a "
                                 f"parameter of shape {tuple(p.shape)}")
            if grad.stride() != p.stride() and not mst.same_layout(grad, p):
                grad = mst.follow_layout(grad, p)  # as torch accepts: read in p's layout
            self.precision.check_param(where, p)  # (the model may have been cast since)
            if self.precision_report is not None:
                self.precision_report.check(where, p, self.master)
            params.append(p)
            grads.append(grad)
            states.append(state)
        work = {device: Work(*lists)
                for device, lists in _grads.by_device(params, grads, states).items()}
        for device, items in work.items():
            if device.type == "meta":
                torch_path.refuse_meta(type(self).__name__, group, items.params)
        self._check_devices(work)
        return work

    def _check_devices(self, by_device: Dict[torch.device, Work]) -> None:
        """Rejects a device layout the optimizer cannot step (before any update)."""

    def _one_device(self, by_device: Dict[torch.device, Work], why: str) -> None:
        if len(by_device) > 1:
            raise ValueError(f"{type(self).__name__}: the parameters of a param group must "
                             f"share one device ({why}), got {list(by_device)}")

    def _check_unfused(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """Errors of torch's implementation, raised before any update."""

    _state_tensor = staticmethod(_state.state_tensor)
    _group_step = staticmethod(_state.group_step)

    def _steps(self, group: Dict[str, Any], call: Work, device: torch.device,
               used: List[Tensor], holders) -> List[Tuple[List[int], Tensor]]:
        """[(positions in ``call``, their step-count tensor)]: torch's per-parameter counts
        (:func:`~mixedprec.optim.torch_path.step_counts`; ``holders``: the group's
        ``step_holders``)."""
        return torch_path.step_counts(holders, call, device, used)

    def _update_lists(self, params: List[Tensor], states: List[Dict[str, Any]]):
        """(update targets, model copies) for one op call: the fp32 masters and the
        model params when any param has a master (an fp32 param is then its own
        master), else the params themselves and no model copy."""
        masters = [self.masters.get(p, state, self.precision) for p, state in zip(params, states)]
        if all(m is None for m in masters):
            return list(params), []
        return [p if m is None else m for p, m in zip(params, masters)], list(params)

    def _unscale_after(self, grads: List[Tensor], inv_scale, found_inf) -> None:
        """``unscale_grads`` for an op that reads the gradients only: ``grad *= inv_scale``
        unless the step was skipped (one more pass over the gradients)."""
        if self.unscale_grads and inv_scale is not None and grads:
            factor = inv_scale.reshape(()) if found_inf is None else torch.where(
                found_inf.reshape(()) == 0, inv_scale.reshape(()), 1.0)
            torch._foreach_mul_(grads, factor)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (on the device, without host synchronisation, for fp32,
        fp16 and bf16 parameters with dense gradients)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.in_backward is not None:
            raise RuntimeError(f"{type(self).__name__}.step: this optimizer steps inside "
                               "backward (mixedprec.optim.in_backward): loss.backward() "
                               "steps it; call .remove() on the handle to step here. "
                               "(torch.distributed.checkpoint's get_state_dict and "
                               "set_state_dict call step() to make an optimizer's state "
                               "before its first step: load or save before in_backward(), "
                               "or after the first backward.)")
        self._pending.clear()
        if not torch.compiler.is_compiling():  # (a compiled step guards on the values)
            torch_path.check_groups(self, self._checked)
        self._fused_step()
        torch_path.step_pending(self)
        return loss

    def _fused_step(self, groups: Optional[List[Dict[str, Any]]] = None,
                    cache: Optional[PlanCache] = None) -> None:
        """The fused part of ``step``, under the caller's ``torch.no_grad()``: of every
        param group, or of ``groups`` (:class:`~mixedprec.optim.torch_path.Subset` s of
        them, planned in ``cache``: a bucket stepping inside backward, which counts the
        applied step itself)."""
        found_inf = getattr(self, "found_inf", None)
        # (torch's scaler hands a 0, not a tensor, when it checked no gradient: no flag)
        scaling = (getattr(self, "grad_scale", None),
                   found_inf if isinstance(found_inf, Tensor) else None)
        counts = groups is None
        groups = self.param_groups if groups is None else groups
        cache = self.plans if cache is None else cache
        planned = None
        if all(map(self._fused_group, groups)):  # (else no plan holds)
            planned = cache.planned(groups, self.state, self.master, self._plan_holds)
        if planned is not None:
            scaled: Dict[torch.device, Any] = {}  # (inv_scale, found_inf) by device
            for group, plan, grads, _ in planned:
                if plan.lists is not None:
                    if plan.device not in scaled:
                        scaled[plan.device] = self._scaling(plan.device, scaling)
                    self._run_plan(group, plan.lists, grads, *scaled[plan.device])
                elif counts and group["params"]:
                    self._idle_group(group, scaling)
            if any(from_master for *_, from_master in planned):
                for _, plan, _, _ in planned:  # master gradients are used by one step
                    for master in plan.with_masters:
                        master.grad = None
            if counts:
                _state.count_applied(self, scaling[1])
            return
        # Check every group before touching any state, so a bad gradient changes nothing.
        work = [(group, self._grads_by_device(group)) for group in groups]
        plans: Dict[int, Plan] = {}
        # (no plan for a group that torch's implementation steps in part: each step must
        # find those parameters again)
        compiling = torch.compiler.is_compiling()
        pending = {id(group) for group, _ in self._pending}
        for index, (group, by_device) in enumerate(work):
            plannable = not compiling and id(group) not in pending
            for device, items in by_device.items():
                for i, (p, state) in enumerate(zip(items.params, items.states)):
                    if state is None:  # first step of p: its state starts now
                        items.states[i] = self.state[p]
                lists = self._step_group(group, device, items, *self._scaling(device, scaling))
                for p, state in zip(items.params, items.states):
                    if not state:  # nothing kept (SGD without momentum on an fp32 param)
                        self.state.pop(p, None)
                if lists is not None and len(by_device) == 1 and plannable:
                    plans[index] = cache.make(group, lists, device, self.state, self.master)
            if not by_device:  # no gradients in this group
                if counts and group["params"]:
                    self._idle_group(group, scaling)
                if plannable:
                    plans[index] = cache.make(group, None, None, self.state, self.master)
        for _, by_device in work:  # master gradients are used by one step
            for items in by_device.values():
                for state in items.states:
                    if state.get("master_param") is not None:
                        state["master_param"].grad = None
        cache.invalidate()
        if not compiling:
            cache.keep(plans, self)
        if counts:
            _state.count_applied(self, scaling[1])

    def _patch_step_function(self) -> None:
        """torch's (its ``__init__`` and ``__setstate__`` call it), with the class's step
        wrapped first by :func:`torch_path.hook_step`, which torch's then leaves as it is."""
        torch_path.hook_step(type(self))
        super()._patch_step_function()

    # --- what a subclass gives -----------------------------------------------------------
    def _step_group(self, group, device, items: Work, inv_scale, found_inf) -> Optional[tuple]:
        """One group's update on one device; returns the op's lists other than the
        gradients (for ``_run_plan``), or None when the next step cannot reuse them."""
        raise NotImplementedError

    def _run_plan(self, group, lists: tuple, grads: List[Tensor], inv_scale, found_inf):
        """The op calls of ``_step_group`` again, with the lists it returned."""
        raise NotImplementedError

    def _plan_holds(self, group: Dict[str, Any], plan: Plan) -> bool:
        return True  # (whether group settings a plan depends on are as planned)

    def _idle_group(self, group: Dict[str, Any], scaling) -> None:
        """A param group with parameters but no gradient in a step (``scaling``: the
        step's (grad_scale, found_inf)): left as it is, as torch.optim leaves it."""

    def _torch_step(self, group: Dict[str, Any], params: List[Tensor], grads: List[Tensor]):
        raise NotImplementedError(f"{type(self).__name__}: no torch step for these params")

    def _check_8bit(self, where: str, state_dtype: torch.dtype, groups=None) -> None:
        """Raises where the settings of ``groups`` (default all) exclude 8-bit moments."""

    def _check_group(self, where: str, group: Dict[str, Any]) -> None:
        """A group's hyperparameters, for a class without a torch.optim twin."""

    def state_dict(self) -> Dict[str, Any]:
        """torch's format, and ``applied_steps``. Parameters that step together share
        one step-count tensor in the optimizer; the state dict gives each its own. 8-bit
        moments' scales as float8_e8m0fnu views of the state's bytes (state8.as_e8m0)."""
        state_dict = dict(super().state_dict(), applied_steps=self.applied_steps.clone())
        state_dict["state"] = {key: _saved_entries(value)
                               for key, value in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of this class or of torch.optim's class of the same name.
        Unlike torch's, float32 state stays float32 next to fp16/bf16 parameters, and
        everything is checked first: on a mismatch a ValueError names it and nothing
        changes (:func:`mixedprec.optim.state.load`)."""
        _state.load(self, state_dict)

    def _upgrade_group(self, saved: Dict[str, Any]) -> Dict[str, Any]:
        """A saved param group with the keys a newer release renamed or added."""
        return dict(self._NEWER_KEYS, **_state.renamed_keys(saved))

    def _load_group_state(self, new_group: Dict[str, Any], group: Dict[str, Any]) -> None:
        """A loaded group's ``step`` (a group-level count), when it has one."""
        _state.load_group_step(self, new_group, group)

    def _loaded_value(self, p: Tensor, param_id: Any, key: str, value: Any) -> Any:
        return _state.loaded_value(self, p, param_id, key, value)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()  # (torch keeps defaults, state and param_groups)
        state.update(precision=self.precision, unscale_grads=self.unscale_grads,
                     applied_steps=self.applied_steps, precision_report=self.precision_report)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "precision" not in state:  # (a pickle from before Precision)
            state["precision"] = Precision.from_pickle(state, type(self).__name__, self._LEAN,
                                                       self._8BIT_KEYS)
        state.setdefault("unscale_grads", True)
        state.setdefault("applied_steps", torch.zeros((), dtype=torch.int64))
        state.setdefault("precision_report", None)
        state.update(plans=PlanCache(), masters=Masters(), _pending=[], _checked={},
                     in_backward=None)
        super().__setstate__(state)
        self.param_groups[:] = map(self._upgrade_group, self.param_groups)


def _saved_entries(value: Any) -> Any:
    """A parameter's state as its state dict holds it: its own copy of a shared step
    count, and 8-bit scales as float8_e8m0fnu views."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    if isinstance(out.get("step"), Tensor):
        out["step"] = out["step"].clone()
    for key in state8.SCALE_OF.values():
        if isinstance(out.get(key), Tensor):
            out[key] = state8.as_e8m0(out[key])
    return out
