"""torch.optim.SGD, fused: one op call per group and device (two while some momentum
buffers start) for fp32, fp16 and bf16 parameters, with fp32 masters or the lean modes
as keyword-only extras."""

from typing import Any, Dict, List, Optional

import torch
import torch.optim.sgd as torch_sgd
from torch import Tensor

from .. import ops
from . import state8
from .optimizer import Optimizer
from .plans import PlanCache
from .precision import Work, pick, positions_in
from .precision_report import counted, tallies_of
from .torch_path import lr_on_device, torch_defaults

__all__ = ["SGD"]


class SGD(Optimizer):
    """``torch.optim.SGD`` with torch's arguments, defaults, param-group keys and
    ``state_dict`` (``momentum_buffer`` per parameter, none without momentum), stepped
    by fused op calls without host synchronisation. Step for step equal to
    torch.optim.SGD on fp32 parameters. Sparse gradients, float64 and complex
    parameters, parameters that are not dense and a tensor ``weight_decay`` go through
    torch's own implementation (for fp16/bf16 ones: master="none" only,
    ``torch_path.check_torch_stepped``).

    Keyword-only extras as :class:`mixedprec.optim.Adam`: ``master``, ``state_dtype``
    (the momentum buffers' dtype; with ``torch.float8_e4m3fn`` eligible parameters keep
    ``momentum_buffer`` as 8-bit codes and ``momentum_buffer_scale``), ``seed``,
    ``unscale_grads``, ``precision_report``. With master="stochastic" the group keeps a
    device step count (``group["step"]``) that keys the rounding bits.

    A step skipped on the device (``found_inf`` set) still creates the momentum
    buffers of parameters stepped for the first time, as zeros (torch's own
    ``SGD(fused=True)`` also creates them before the skip is known).
    """

    _TORCH_CLASS = torch.optim.SGD
    _STATE_KEYS = ("momentum_buffer", "master_param", "kahan_comp", "remainder",
                   "momentum_buffer_scale")
    _TORCH_STEP_KEEPS = "params"
    _LEAN = True
    _8BIT_KEYS = state8.SGD_KEYS
    _NEWER_KEYS = dict(nesterov=False, maximize=False, foreach=None, differentiable=False,
                       fused=False)
    _SCALAR_KEYS = ("weight_decay", "momentum", "dampening")
    #: Apex's option (mixedprec.FusedSGD): weight decay added after the momentum update.
    wd_after_momentum = False

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, master="fp32", state_dtype=torch.float32, seed=None,
                 unscale_grads=True, precision_report=False):
        defaults = torch_defaults(self._TORCH_CLASS, "SGD", dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused))
        super().__init__(params, defaults, master=master, state_dtype=state_dtype, seed=seed,
                         unscale_grads=unscale_grads, precision_report=precision_report)

    def _step_group(self, group, device, items: Work, inv_scale, found_inf):
        momentum = group["momentum"]
        lr = lr_on_device(group, device, found_inf)
        step = self._rounding_step(group, device, lr[2])
        calls, starting = [], False
        precision = self.precision
        for call, positions, lean, eight in precision.calls(items, momentum != 0):
            # Params whose momentum buffer starts now (first_run) go in a call of their own.
            starts = [momentum != 0 and "momentum_buffer" not in state for state in call.states]
            for first_run in sorted(set(starts)):
                picked = [i for i, s in enumerate(starts) if s == first_run]
                part = call.pick(picked)
                where = positions_in(picked, positions, len(items.grads))
                targets, model = self._update_lists(part.params, part.states)
                scales = None
                if eight:
                    buffers, scales = state8.entries(part.states, targets, "momentum_buffer")
                else:
                    dtype = precision.moment_dtype()
                    buffers = [self._state_tensor(state, "momentum_buffer", t, dtype)
                               for state, t in zip(part.states, targets)] if momentum else []
                comps = precision.lean_state(part.states, targets, self._state_tensor,
                                             self.masters) if lean else []
                salts = precision.salts(type(self).__name__, group, part.params, device,
                                        eight) if lean or eight else []
                tallies = tallies_of(self.precision_report, part.params)
                lists = (where, targets, buffers, model, comps, salts, scales, tallies)
                self._sgd(group, lists, pick(items.grads, where), first_run, inv_scale,
                          lr, step)
                calls.append(lists)
                starting |= first_run
        # The next step reuses the calls unless buffers started in this one.
        return None if starting else tuple(calls)

    def _rounding_step(self, group, device, found_inf) -> Optional[Tensor]:
        """master='stochastic' or 8-bit buffers: ``group["step"]`` advanced on the device
        unless found_inf is set (it keys the rounding bits); else None."""
        if not self._stochastic(group):
            return None
        step = self._group_step(group, device)
        # (a bool flag is promoted in the add: one kernel, not a cast and an add)
        step.add_(1.0 if found_inf is None else found_inf.reshape(1) == 0)
        return step

    def _stochastic(self, group) -> bool:
        """Whether the group's steps draw rounding bits: master='stochastic', or 8-bit
        momentum buffers (none without momentum: no step count to advance then)."""
        return self.master == "stochastic" or (
            self.state_dtype == state8.E4M3 and group["momentum"] != 0)

    def _plan_holds(self, group, plan) -> bool:
        return (group["momentum"] != 0) == bool(plan.lists[0][2]) and (
            not self._stochastic(group) or PlanCache.step_on(group, plan))

    def _run_plan(self, group, calls, grads, inv_scale, found_inf) -> None:
        lr = lr_on_device(group, calls[0][1][0].device, found_inf)
        step = self._rounding_step(group, calls[0][1][0].device, lr[2])
        for lists in calls:
            self._sgd(group, lists, pick(grads, lists[0]), False, inv_scale, lr, step)

    def _sgd(self, group, lists, grads, first_run, inv_scale, lr_and_skip, step) -> None:
        """One fused_sgd_ call; ``lr_and_skip``: ``_lr``'s (lr, lr_tensor, found_inf)."""
        _, targets, buffers, model, comps, salts, scales, tallies = lists
        lr, lr_tensor, found_inf = lr_and_skip
        ops.fused_sgd_(targets, grads, buffers, model, lr=lr, momentum=group["momentum"],
                       dampening=group["dampening"], weight_decay=group["weight_decay"],
                       nesterov=group["nesterov"], first_run=first_run, inv_scale=inv_scale,
                       found_inf=found_inf, wd_after_momentum=self.wd_after_momentum,
                       step=step if salts else None, maximize=bool(group.get("maximize")),
                       lr_tensor=lr_tensor,
                       unscale_grads=self.unscale_grads and inv_scale is not None,
                       momentum_scales=scales,
                       precision_tallies=counted(self.precision_report, tallies),
                       **self.precision.op_lean_args(group, targets, comps, salts,
                                                     scales is not None))

    def _check_unfused(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """What torch's SGD fails on with a sparse gradient (``add(sparse, dense)``, after
        the other parameters have stepped): weight decay, and Nesterov momentum over a
        dense buffer; refused before any group steps."""
        for p in params:
            if not p.grad.is_sparse:
                continue
            buffer = self.state.get(p, {}).get("momentum_buffer")
            if group["weight_decay"] != 0:
                why = f"weight_decay={group['weight_decay']}"
            elif group["nesterov"] and isinstance(buffer, Tensor) and not buffer.is_sparse:
                why = "nesterov=True over a dense momentum buffer"
            else:
                continue
            raise RuntimeError(f"{type(self).__name__}.step: a parameter of shape "
                               f"{tuple(p.shape)} has a sparse gradient, which torch.optim's "
                               f"SGD steps, and it does not take {why} with one")

    def _torch_step(self, group, params: List[Tensor], grads: List[Tensor]) -> None:
        momentum = group["momentum"]
        buffers = [self.state[p].get("momentum_buffer") for p in params] if momentum != 0 \
            else []
        torch_sgd.sgd(
            params, grads, buffers, has_sparse_grad=any(g.is_sparse for g in grads),
            foreach=False, fused=False, weight_decay=group["weight_decay"], momentum=momentum,
            lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
            maximize=group["maximize"])
        for p, buffer in zip(params, buffers):
            self.state[p]["momentum_buffer"] = buffer
