"""Plans: a param group's op calls as the last step made them, reused while nothing
they were made from has changed, so that a step only gathers the gradients (the step's
fixed cost with many small tensors)."""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..grads import update_grad
from .lean import _FLOAT_DTYPES


class _Plan(NamedTuple):
    """A param group's op call as the last step made it, reused while nothing it was
    made from has changed (see ``_FusedOptimizer._planned_work``)."""

    state_key: Tuple[int, int, str]  # the state dict's id and size, the master mode
    # per group param: (dtype, storage address, version), so that a parameter converted,
    # moved, re-laid-out (all of which give it new storage) or written elsewhere takes
    # the full path
    signature: List[Tuple[Any, ...]]
    strides: List[Tuple[int, ...]]  # per group param: its strides (its gradient's must match)
    masters: List[Optional[Tensor]]  # per group param: its fp32 master, if any
    stepped: List[bool]  # per group param: whether it had a gradient
    lists: Optional[tuple]  # the op's lists other than the gradients; None: no call
    device: Optional[torch.device]  # where the lists are (None: no call)


def _signature(p: Tensor) -> Tuple[Any, ...]:
    return p.dtype, p.data_ptr(), p._version


class Plans:
    """The optimizer base's plan cache (a mixin of _FusedOptimizer, which keeps
    ``_plans``)."""

    def _invalidate_plans(self) -> None:
        """Forgets the op calls kept from the last step (see ``_planned_work``): for
        whatever changes state, groups or masters other than through a step. (The dict
        is changed in place, never rebound, as torch.compile traces that more easily.)"""
        self._plans.clear()

    @staticmethod
    def _step_on(group: Dict[str, Any], plan: "_Plan") -> bool:
        """Whether the group's step count is a tensor on the device of the plan's lists."""
        step = group.get("step")
        return isinstance(step, Tensor) and step.device == plan.device

    def _state_key(self) -> Tuple[int, int, str]:
        return id(self.state), len(self.state), self.master

    def _make_plan(self, group: Dict[str, Any], lists: Optional[tuple],
                   device: Optional[torch.device]) -> _Plan:
        params = group["params"]
        states = [self.state.get(p) or {} for p in params]
        masters = [state.get("master_param") for state in states]
        stepped = [update_grad(p, m) is not None for p, m in zip(params, masters)]
        return _Plan(self._state_key(), [_signature(p) for p in params],
                     [p.stride() for p in params], masters, stepped, lists, device)

    def _planned_work(self):
        """[(group, plan, gradients, whether some came from masters)] when every group
        can reuse the op call of the last step, else None (the step then takes the
        full path, and makes new plans).

        A plan holds the op's lists of masters, moments, buffers and model params, so
        a step only gathers the gradients. It is reused while the optimizer's state
        dict is the same object of the same size, ``master_weights`` is unchanged, the
        group's parameters have the dtypes, devices and (un)set gradients they had,
        the group settings the plan depends on hold, and nothing called
        ``_invalidate_plans`` (``load_state_dict``, ``add_param_group``,
        ``mixedprec.amp.initialize``). State entries must be replaced through those,
        not by assigning to ``optimizer.state[p][key]``."""
        plans = self._plans
        if len(plans) != len(self.param_groups) or torch.compiler.is_compiling():
            return None  # (a compiled step is traced once: it needs no plans)
        state_key = self._state_key()
        planned = []
        for index, group in enumerate(self.param_groups):
            plan = plans.get(index)
            params = group["params"]
            if plan is None or plan.state_key != state_key or len(params) != len(plan.stepped):
                return None
            grads: List[Tensor] = []
            from_master = False
            for p, m, stepped, signature, strides in zip(params, plan.masters, plan.stepped,
                                                         plan.signature, plan.strides):
                if _signature(p) != signature:
                    return None
                grad = update_grad(p, m)
                from_master |= grad is not None and grad is not p.grad  # (a master's)
                if (grad is not None) != stepped:
                    return None
                if grad is not None:
                    if (grad.is_sparse or grad.dtype not in _FLOAT_DTYPES
                            or grad.stride() != strides):
                        return None  # the full path converts it or raises the error
                    grads.append(grad)
            if plan.lists is not None and not self._plan_holds(group, plan):
                return None
            planned.append((group, plan, grads, from_master))
        return planned

    def _plan_holds(self, group: Dict[str, Any], plan: _Plan) -> bool:
        """Hook: whether group settings a plan depends on are still as planned."""
        return True
