"""torch.optim.Adagrad, fused: one op call per group and device for fp32, fp16 and bf16
parameters, with fp32 masters as a keyword-only extra."""

from typing import Any, Dict, List

import torch
import torch.optim.adagrad as torch_adagrad
from torch import Tensor

from .. import ops
from .optimizer import Optimizer
from .precision import Work, pick, positions_in
from .torch_path import step_holders, torch_defaults

__all__ = ["Adagrad"]


class Adagrad(Optimizer):
    """``torch.optim.Adagrad`` with torch's arguments, defaults, param-group keys and
    ``state_dict`` (``step`` and ``sum`` per parameter), stepped by one fused op call
    per group and device (:func:`mixedprec.ops.fused_adagrad_`) without host
    synchronisation: ``sum += g * g; p -= lr * g / (sqrt(sum) + eps)``.

    mixedprec's extras, keyword-only: ``master`` ("fp32", the default: fp32 masters of
    fp16/bf16 parameters, or "none"), ``decoupled_weight_decay`` (``lr * weight_decay
    * p`` added to the step instead of ``weight_decay * p`` to the gradient),
    ``unscale_grads`` (as :class:`mixedprec.optim.Adam`; an extra pass over the
    gradients here). ``sum`` is float32 beside 16-bit parameters. A group with
    ``lr_decay != 0``, ``maximize`` or a tensor ``lr``, float64 and complex parameters
    and sparse gradients go through torch's own implementation (on the fp32 masters
    where there are some; it reads ``found_inf`` on the host). As in
    :class:`mixedprec.optim.Adam`, the parameters that step together share one
    step-count tensor: an in-place write to one's count (``state[p]["step"].zero_()``)
    changes theirs; set a new tensor to change one parameter's count.
    """

    _TORCH_CLASS = torch.optim.Adagrad
    _STATE_KEYS = ("step", "sum", "master_param")
    _STATE_TOGETHER = (("step",), ("sum",))
    _TORCH_STEP_KEEPS = "fp32 masters"
    _NEWER_KEYS = dict(foreach=None, maximize=False, differentiable=False, fused=None,
                       decoupled_weight_decay=False)
    _SCALAR_KEYS = ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value")

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0,
                 initial_accumulator_value=0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master="fp32", state_dtype=torch.float32, seed=None, unscale_grads=True):
        defaults = torch_defaults(self._TORCH_CLASS, type(self).__name__, dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
            maximize=maximize, differentiable=differentiable, fused=fused))
        defaults["decoupled_weight_decay"] = bool(decoupled_weight_decay)
        super().__init__(params, defaults, master=master, state_dtype=state_dtype, seed=seed,
                         unscale_grads=unscale_grads)

    def _fused_group(self, group: Dict[str, Any]) -> bool:
        return super()._fused_group(group) and group["lr_decay"] == 0 and \
            not group["maximize"]

    def _step_group(self, group, device, items: Work, inv_scale, found_inf):
        calls = []
        init = group["initial_accumulator_value"]
        for picked, step in self._steps(group, items, device, [],
                                          step_holders(self.state, group)):
            part = items.pick(picked)
            targets, model = self._update_lists(part.params, part.states)
            sums = []
            for state, t in zip(part.states, targets):
                if "sum" not in state:
                    state["sum"] = torch.full_like(t, init, dtype=torch.float32,
                                                   memory_format=torch.preserve_format)
                sums.append(self._state_tensor(state, "sum", t))
            calls.append((positions_in(picked, None, len(items.grads)), targets, sums, model,
                          step))
        self._run_plan(group, calls, items.grads, inv_scale, found_inf)
        return tuple(calls)

    def _check_unfused(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """torch's Adagrad refuses weight decay with a sparse gradient (after the other
        parameters have stepped): refused here before any group steps, in its words."""
        if group["weight_decay"] != 0 and any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{type(self).__name__}.step: weight_decay option is not "
                               "compatible with sparse gradients")

    def _run_plan(self, group, calls, grads, inv_scale, found_inf) -> None:
        for where, targets, sums, model, step in calls:
            picked = pick(grads, where)
            ops.fused_adagrad_(targets, picked, sums, model, lr=group["lr"], eps=group["eps"],
                               weight_decay=group["weight_decay"],
                               decoupled_weight_decay=group["decoupled_weight_decay"],
                               inv_scale=inv_scale, found_inf=found_inf)
            step.add_(1.0 if found_inf is None else found_inf.reshape(()) == 0)
            self._unscale_after(picked, inv_scale, found_inf)

    def _torch_step(self, group, params: List[Tensor], grads: List[Tensor]) -> None:
        """torch's functional Adagrad, on the fp32 masters of fp16/bf16 parameters where
        ``master="fp32"`` keeps them (the parameters then receive them, cast)."""
        targets, steps, sums = [], [], []
        for p, grad in zip(params, grads):
            state = self.state[p]
            target = self.masters.get(p, state, self.precision) if not grad.is_sparse else None
            targets.append(p if target is None else target)
            if not isinstance(state.get("step"), Tensor):  # (new, or a number loaded)
                state["step"] = torch.tensor(float(state.get("step", 0)), dtype=torch.float32)
            if "sum" not in state:  # (as torch: a complex parameter's halves both start there)
                init = group["initial_accumulator_value"]
                state["sum"] = torch.full_like(
                    targets[-1], complex(init, init) if torch.is_complex(p) else init,
                    memory_format=torch.preserve_format)
            sums.append(state["sum"])
            steps.append(state["step"])
        grads = [g if t is p else g.to(t.dtype) for t, p, g in zip(targets, params, grads)]
        weight_decay = group["weight_decay"]
        if group["decoupled_weight_decay"]:  # (torch's takes L2 decay only)
            torch._foreach_mul_(targets, 1 - group["lr"] * weight_decay)
            weight_decay = 0
        torch_adagrad.adagrad(
            targets, grads, sums, steps, has_sparse_grad=any(g.is_sparse for g in grads),
            foreach=False, differentiable=bool(group.get("differentiable")),
            has_complex=any(torch.is_complex(p) for p in params), lr=group["lr"],
            weight_decay=weight_decay, lr_decay=group["lr_decay"], eps=group["eps"],
            maximize=group["maximize"])
        for p, target in zip(params, targets):
            if target is not p:
                p.copy_(target)
