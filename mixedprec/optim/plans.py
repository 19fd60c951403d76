"""Plans: a param group's op calls as the last step made them, reused while nothing
they were made from has changed, so that a step only gathers the gradients (the step's
fixed cost with many small tensors)."""

from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..grads import update_grad
from ..ops import PlanCheck
from .precision import FLOAT_DTYPES, LEAN_KEPT
from .state import ParamStates, tracked


class Plan(NamedTuple):
    """A param group's op call as the last step made it, reused while nothing it was
    made from has changed (see ``PlanCache.planned``)."""

    state_key: Tuple[int, int, str]  # the state dict's id and size, the master mode
    # per group param: ([storage addresses], [versions] or None), so that a parameter
    # converted, moved or re-laid-out (all of which give it new storage) takes the full
    # path, and one written outside a step too where the group has fp32 masters, Kahan
    # compensations or remainders (which the full path brings up to their params:
    # Masters.get, Masters.follow_lean); None: none of them, nothing kept that such a
    # write changes. (A parameter's dtype is not read: a conversion
    # gives it new storage, and torch keeps a gradient's dtype its parameter's, which
    # ``grad_meta`` holds.)
    signature: Tuple[List[int], Optional[List[int]]]
    strides: List[Tuple[int, ...]]  # per group param: its strides (see _follows)
    masters: List[Optional[Tensor]]  # per group param: its fp32 master, if any
    stepped: List[bool]  # per group param: whether it had a gradient
    # the op's lists other than the gradients (those of tensors boxed once: _boxed);
    # None: no call
    lists: Optional[tuple]
    device: Optional[torch.device]  # where the lists are (None: no call)
    # What a step checks first, in a few list comparisons instead of a loop of
    # per-parameter checks (the step's fixed cost: 161 tensors take ~0.1 ms of Python):
    all_stepped: bool  # every group param had a gradient
    with_masters: List[Tensor]  # the masters in ``masters`` (their .grad: read instead)
    # the gradients read (the params that stepped): ([their dtypes], [whether their
    # parameters are contiguous], [(position, strides) of the parameters that are not])
    grad_meta: Tuple[List[Any], List[bool], List[Tuple[int, Tuple[int, ...]]]]
    # the same check of ``signature`` and ``grad_meta`` in one native pass, which hands
    # the gradients back (a PlanCheck: ~40 us a step on ResNet-50's 161 parameters with
    # masters where the maps take ~155, on a slow core); None where a parameter is not a
    # plain tensor
    check: Any


# Per-tensor reads as C calls mapped over a list (map with a method descriptor or an
# attrgetter runs no Python frame per tensor, and builds no tuple per tensor: a plan's
# check over ResNet-50's 161 parameters took about twice as long as a comprehension).
_grad_of = attrgetter("grad")
_dtype_of = attrgetter("dtype")
_version_of = attrgetter("_version")
_data_ptr = Tensor.data_ptr
_is_contiguous = Tensor.is_contiguous


# What a plan's lists of tensors may be boxed as (below): the tensor types that hold
# their own data. Subclasses (DTensor, fake tensors) stay Python lists, for their own
# dispatch.
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
# TorchScript's list (torch 1.10 on); without it, plans keep Python lists.
_ScriptList = getattr(torch._C, "ScriptList", None)


def _boxed(lists: Any) -> Any:
    """``lists`` (an op call's lists, or tuples of them) with each non-empty list of
    plain tensors made a ``torch._C.ScriptList``: the same tensors in the dispatcher's
    own list, which ``torch.ops`` hands to the op as it is. A Python list is converted
    tensor by tensor at every call: in fused_adam_ on ResNet-50's 161 parameters with
    masters, ~18 us a step (bench/README.md, "A plan's lists, boxed once")."""
    if isinstance(lists, tuple):
        return tuple(map(_boxed, lists))
    if _ScriptList is not None and isinstance(lists, list) and lists and \
            all(type(t) in _PLAIN_TENSORS for t in lists):
        return _ScriptList(lists)
    return lists


def _signature(params: List[Tensor], versions: bool) -> Tuple[List[int], Optional[List[int]]]:
    """Per parameter: its storage address and (``versions``) version, as lists."""
    return list(map(_data_ptr, params)), list(map(_version_of, params)) if versions else None


class PlanCache:
    """A param group index -> its plan, as the last step made them (the optimizer base
    holds one: ``optimizer.plans``)."""

    def __init__(self):
        self.plans: Dict[int, Plan] = {}
        #: The caches of the buckets that step inside backward (:meth:`part`).
        self.parts: List["PlanCache"] = []
        #: The optimizer state's count of edits when the plans were made (:meth:`keep`).
        self.edits = -1

    def invalidate(self) -> None:
        """Forgets the op calls kept from the last step, and those of its parts: for
        whatever changes state, groups or masters other than through a step. (The dict
        is changed in place, never rebound, as torch.compile traces that more easily.)"""
        self.plans.clear()
        for part in self.parts:
            part.invalidate()

    def keep(self, plans: Dict[int, Plan], opt: Any) -> None:
        """Keeps the ``plans`` a step made on the full path (after :meth:`invalidate`),
        with the count of edits of ``opt.state`` (:class:`~.state.ParamStates`) at the
        end of that step: an entry replaced or removed since then (a parameter's state
        cleared or set anew, a moment or step count replaced) makes the next step take
        the full path, which reads the state as it is, as torch.optim reads it at every
        step. A state that counts no edits (a plain dict set as ``optimizer.state``)
        is made a ParamStates here, its parameters' dicts copied."""
        opt.state = tracked(opt.state)
        self.plans.update(plans)
        self.edits = opt.state.edits.count

    def part(self) -> "PlanCache":
        """A cache of its own (a bucket's, inside backward) that :meth:`invalidate`
        clears with this one."""
        part = PlanCache()
        self.parts.append(part)
        return part

    @staticmethod
    def step_on(group: Dict[str, Any], plan: "Plan") -> bool:
        """Whether the group's step count is a tensor on the device of the plan's lists."""
        step = group.get("step")
        return isinstance(step, Tensor) and step.device == plan.device

    @staticmethod
    def make(group: Dict[str, Any], lists: Optional[tuple], device: Optional[torch.device],
             state_of: Dict[Tensor, Dict[str, Any]], master: str) -> Plan:
        params = group["params"]
        states = [state_of.get(p) or {} for p in params]
        masters = [state.get("master_param") for state in states]
        grads = [update_grad(p, m) for p, m in zip(params, masters)]
        stepped = [g is not None for g in grads]
        read = [p for p, g in zip(params, grads) if g is not None]
        contiguous = [p.is_contiguous() for p in read]
        with_masters = [m for m in masters if m is not None]
        versions = bool(with_masters) or master in LEAN_KEPT
        check = None
        if all(type(p) in _PLAIN_TENSORS for p in params):
            try:
                check = PlanCheck(params, grads, with_masters, versions)
            except RuntimeError:  # (a parameter without storage: the Python check only)
                pass
        return Plan((id(state_of), len(state_of), master), _signature(params, versions),
                     [p.stride() for p in params], masters, stepped, _boxed(lists), device,
                     all(stepped), with_masters,
                     ([g.dtype for g in grads if g is not None], contiguous,
                      [(i, p.stride()) for i, p in enumerate(read) if not contiguous[i]]),
                     check)

    def planned(self, param_groups: List[Dict[str, Any]], state_of: Dict[Tensor, Any],
                master: str, holds: Callable[[Dict[str, Any], Plan], bool]):
        """[(group, plan, gradients, whether some came from masters)] when every group
        can reuse the op call of the last step, else None (the step then takes the
        full path, and makes new plans).

        A plan holds the op's lists of masters, moments, buffers and model params, so
        a step only gathers the gradients. It is reused while the optimizer's state
        dict is the same object of the same size, none of its entries, nor of its
        parameters' state dicts, was replaced or removed since the step that made it
        (:meth:`keep`: one comparison of counts), ``master`` is unchanged, the group's
        parameters have the dtypes, devices and (un)set gradients they had, the group
        settings the plan depends on hold (``holds``), and nothing called
        :meth:`invalidate` (``load_state_dict``, ``add_param_group``,
        ``configure``)."""
        plans = self.plans
        if len(plans) != len(param_groups) or torch.compiler.is_compiling():
            return None  # (a compiled step is traced once: it needs no plans)
        if type(state_of) is not ParamStates or state_of.edits.count != self.edits:
            return None  # (a state entry replaced or removed: the full path reads it)
        state_key = (id(state_of), len(state_of), master)
        planned = []
        for index, group in enumerate(param_groups):
            plan = plans.get(index)
            params = group["params"]
            if plan is None or plan.state_key != state_key or len(params) != len(plan.stepped):
                return None
            gathered = _planned_gradients(params, plan)
            if gathered is None:
                return None
            grads, from_master = gathered
            if plan.lists is not None and not holds(group, plan):
                return None
            planned.append((group, plan, grads, from_master))
        return planned


def _planned_gradients(params: List[Tensor], plan: Plan) -> Optional[Tuple[List[Tensor], bool]]:
    """(the gradients the update reads, whether some are masters') when ``params`` and
    their gradients are as ``plan`` was made from, else None. A few list comparisons in
    the usual case (no master holds a gradient; each gradient has the dtype it had and
    its parameter's memory order, :func:`_follows`); else one check per parameter, as
    ``_planned_gradient_by_gradient``. (The step's fixed cost: each map over ResNet-50's
    161 parameters takes ~10-25 us, and none is made that the plan does not need.) The
    plan's native check answers first where it holds; where it does not, the maps tell a
    plan that no longer holds from one that needs a check per gradient."""
    if plan.check is not None:
        try:
            grads = plan.check.gradients(params)
        except RuntimeError:  # (an entry that is not a tensor: the checks below)
            grads = None
        if grads is not None:
            return grads, False
    if _signature(params, plan.signature[1] is not None) != plan.signature:
        return None  # converted, moved, re-laid-out, or written outside a step
    # (a master's .grad that is a tensor compares unequal to None, without a device read)
    masters = plan.with_masters
    if masters and list(map(_grad_of, masters)) != [None] * len(masters):
        return _planned_gradient_by_gradient(params, plan)
    grads = list(map(_grad_of, params))
    if not plan.all_stepped:
        if list(map(is_not, grads, repeat(None))) != plan.stepped:
            return None  # a parameter gained or lost its gradient
        grads = list(compress(grads, plan.stepped))
    dtypes, contiguous, strided = plan.grad_meta
    try:  # (with every gradient planned, one that is now None raises AttributeError)
        if list(map(_dtype_of, grads)) == dtypes and \
                list(map(_is_contiguous, grads)) == contiguous and \
                all(grads[i].stride() == strides for i, strides in strided):
            return grads, False
    except (AttributeError, RuntimeError):  # (a sparse gradient has no strides)
        pass
    return _planned_gradient_by_gradient(params, plan)


def _planned_gradient_by_gradient(params: List[Tensor], plan: Plan
                                  ) -> Optional[Tuple[List[Tensor], bool]]:
    """``_planned_gradients``' answer, one gradient at a time: a master's gradient is
    read where set, and each gradient the update reads must be a dense float one in
    its parameter's memory order (else the full path converts it or raises)."""
    grads: List[Tensor] = []
    from_master = False
    for p, m, stepped, strides in zip(params, plan.masters, plan.stepped, plan.strides):
        grad = update_grad(p, m)
        from_master |= grad is not None and grad is not p.grad  # (a master's)
        if (grad is not None) != stepped:
            return None
        if grad is not None:
            if grad.is_sparse or grad.dtype not in FLOAT_DTYPES or \
                    not _follows(grad, p, strides):
                return None  # the full path converts it or raises the error
            grads.append(grad)
    return grads, from_master


def _follows(grad: Tensor, p: Tensor, strides: Tuple[int, ...]) -> bool:
    """Whether the op reads ``grad`` element for element with ``p`` (of ``strides``):
    both contiguous, or the same strides (:func:`mixedprec.masters.same_layout`; the
    shapes are torch's to keep equal)."""
    return (grad.is_contiguous() and p.is_contiguous()) or grad.stride() == strides
