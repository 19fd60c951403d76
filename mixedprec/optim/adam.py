"""torch.optim.Adam and AdamW, fused: one op call per group and device for fp32, fp16
and bf16 parameters, with fp32 masters or the lean modes as keyword-only extras."""

from typing import Any, Dict, List

import torch
import torch.optim.adam as torch_adam
import torch.optim.optimizer as torch_optimizer
from torch import Tensor

from .. import ops
from . import state8
from .optimizer import Optimizer
from .precision import Work, pick, positions_in
from .precision_report import counted, tallies_of
from .torch_path import lr_on_device, step_holders, torch_defaults

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """``torch.optim.Adam`` with torch's arguments, defaults, param-group keys and
    ``state_dict`` (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` per
    parameter), stepped by one fused op call per group and device without host
    synchronisation. Step for step equal to torch.optim.Adam on fp32 parameters.

    mixedprec's extras, keyword-only:

    * ``master``: what is kept of fp16/bf16 parameters' values: ``"fp32"`` (default)
      fp32 masters in the state (``master_param``), the parameters receive them cast;
      ``"none"`` the parameters are updated directly (torch.optim's behaviour);
      ``"kahan"``/``"stochastic"``: bf16 parameters with a bf16 compensation, or
      rounded stochastically; ``"remainder"``: bf16 parameters with an int16
      ``remainder`` each, the low half of an exact fp32 master
      (docs/lean-precision.md).
    * ``state_dtype``: ``torch.float32`` (default) or ``torch.bfloat16``, the moments'
      dtype (the math stays fp32), or ``torch.float8_e4m3fn``: 8-bit moments with a
      power-of-two scale per block of 32 (``exp_avg`` and ``exp_avg_scale``, the
      second moment's root ``exp_avg_sq_root`` and ``exp_avg_sq_root_scale``) for the
      parameters :mod:`mixedprec.optim.state8` deems eligible, fp32 moments for the
      others; not with ``amsgrad``.
    * ``seed``: master="stochastic"'s base seed.
    * ``unscale_grads``: after a step with a GradScaler, ``p.grad`` holds the unscaled
      gradient, as with torch's fused optimizers (default True); False skips that write.
    * ``precision_report``: count, in the step's pass, the updates each parameter's
      storage lost (``optimizer.precision_report``,
      :mod:`mixedprec.optim.precision_report`; default False; an int N: every N-th
      step).

    ``foreach``, ``fused`` and ``capturable`` are accepted (every step is fused and
    capturable). A group with ``differentiable=True`` is stepped by torch.optim's own
    implementation with autograd on, as torch.optim does (the fused op has no
    derivative): torch's state, of the parameters' dtype, and no lean mode, other
    ``state_dtype``, fp32 masters of 16-bit parameters or precision report there. So
    are float64 and complex parameters, those that are not dense and a group with
    tensor ``betas``, ``weight_decay`` or ``eps`` (for fp16/bf16 ones: master="none"
    only, ``torch_path.check_torch_stepped``). Parameters that step together share one
    step-count tensor inside the optimizer; ``state_dict()`` gives each its own, as
    torch does. So an in-place write to one parameter's count
    (``optimizer.state[p]["step"].zero_()``) changes the count of every parameter of
    its group that shares it (torch.optim's would change p's only); to restart p's
    count alone, set a new tensor (``optimizer.state[p]["step"] = torch.tensor(0.)``)
    or clear p's state (``optimizer.state[p].clear()``). State entries set, replaced
    or removed between steps are read at the next step, as torch.optim reads them.
    """

    _TORCH_CLASS = torch.optim.Adam
    _STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param",
                   "kahan_comp", "remainder", "exp_avg_scale", "exp_avg_sq_root",
                   "exp_avg_sq_root_scale")
    _STATE_TOGETHER = (("step",), ("exp_avg",), ("exp_avg_sq", "exp_avg_sq_root"))
    _TORCH_STEP_KEEPS = "params"
    _TORCH_STEP_SAME_DTYPE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _LEAN = True
    _8BIT_KEYS = state8.ADAM_KEYS
    _NEWER_KEYS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                       differentiable=False, fused=None, decoupled_weight_decay=False)
    _SCALAR_KEYS = ("betas", "weight_decay", "eps")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master="fp32", state_dtype=torch.float32, seed=None, unscale_grads=True,
                 precision_report=False):
        defaults = torch_defaults(self._TORCH_CLASS, type(self).__name__, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused,
            **self._decoupled_kwarg(decoupled_weight_decay)))
        super().__init__(params, defaults, master=master, state_dtype=state_dtype, seed=seed,
                         unscale_grads=unscale_grads, precision_report=precision_report)

    @staticmethod
    def _decoupled_kwarg(value: bool) -> Dict[str, Any]:
        return {"decoupled_weight_decay": value}

    def _check_8bit(self, where: str, state_dtype, groups=None) -> None:
        if state_dtype == state8.E4M3 and any(
                group.get("amsgrad", self.defaults.get("amsgrad"))
                for group in (self.param_groups if groups is None else groups)):
            raise ValueError(f"{where}: amsgrad=True is not supported with "
                             "state_dtype=torch.float8_e4m3fn (8-bit moments); use "
                             "amsgrad=False or another state_dtype")

    def _step_group(self, group, device, items: Work, inv_scale, found_inf):
        calls = self._calls(group, device, items)
        self._run_plan(group, calls, items.grads, inv_scale, found_inf)
        return calls

    def _calls(self, group, device, items: Work) -> tuple:
        """The group's op calls: ``precision.calls``, each split by step count (parameters
        whose counts are one tensor, all of its holders, go in one call)."""
        holders = step_holders(self.state, group)
        used: List[Tensor] = []  # the counts this step's calls advance
        calls = []
        precision = self.precision
        dtype = precision.moment_dtype()
        for call, positions, lean, eight in precision.calls(items):
            for picked, step in self._steps(group, call, device, used, holders):
                part = call.pick(picked)
                where = positions_in(picked, positions, len(items.grads))
                targets, model = self._update_lists(part.params, part.states)
                scales = None
                if eight:
                    exp_avgs, avg_scales = state8.entries(part.states, targets, "exp_avg")
                    exp_avg_sqs, sq_scales = state8.entries(part.states, targets,
                                                            "exp_avg_sq_root")
                    scales = (avg_scales, sq_scales)
                else:
                    exp_avgs, exp_avg_sqs = ([self._state_tensor(state, key, t, dtype)
                                              for state, t in zip(part.states, targets)]
                                             for key in ("exp_avg", "exp_avg_sq"))
                maxes = [self._state_tensor(state, "max_exp_avg_sq", t, dtype)
                         for state, t in zip(part.states, targets)] if group.get("amsgrad") \
                    else []
                comps = precision.lean_state(part.states, targets, self._state_tensor,
                                             self.masters) if lean else []
                salts = precision.salts(type(self).__name__, group, part.params, device,
                                        eight) if lean or eight else []
                tallies = tallies_of(self.precision_report, part.params)
                calls.append((where, targets, exp_avgs, exp_avg_sqs, maxes, model, comps,
                               salts, scales, tallies, step))
        return tuple(calls)

    def _plan_holds(self, group, plan) -> bool:
        return all(bool(call[4]) == bool(group.get("amsgrad")) for call in plan.lists)

    def _run_plan(self, group, calls, grads, inv_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        lr, lr_tensor, found_inf = lr_on_device(group, calls[0][-1].device, found_inf)
        for (where, targets, exp_avgs, exp_avg_sqs, maxes, model, comps, salts, scales,
             tallies, step) in calls:
            ops.fused_adam_(
                targets, pick(grads, where), exp_avgs, exp_avg_sqs, model, step=step, lr=lr,
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
                bias_correction=group.get("bias_correction", True),
                inv_scale=inv_scale, found_inf=found_inf, lr_tensor=lr_tensor,
                maximize=bool(group.get("maximize")), max_exp_avg_sqs=maxes or None,
                unscale_grads=self.unscale_grads and inv_scale is not None,
                exp_avg_scales=scales[0] if scales else None,
                exp_avg_sq_scales=scales[1] if scales else None,
                precision_tallies=counted(self.precision_report, tallies),
                **self.precision.op_lean_args(group, targets, comps, salts, scales is not None))

    def _check_unfused(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, "
                               "please consider SparseAdam instead")

    def _torch_step(self, group, params: List[Tensor], grads: List[Tensor]) -> None:
        exp_avgs, exp_avg_sqs, maxes, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if "step" not in state:  # (torch's: float32, or float64 by default dtype)
                state["step"] = torch.tensor(0.0, dtype=torch_optimizer._get_scalar_dtype())
                for key in ("exp_avg", "exp_avg_sq") + (
                        ("max_exp_avg_sq",) if group["amsgrad"] else ()):
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                maxes.append(state.setdefault("max_exp_avg_sq", torch.zeros_like(
                    p, memory_format=torch.preserve_format)))
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        torch_adam.adam(
            params, grads, exp_avgs, exp_avg_sqs, maxes, steps, foreach=False,
            capturable=False, differentiable=bool(group.get("differentiable")), fused=False,
            has_complex=any(torch.is_complex(p) for p in params),
            decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"])


class AdamW(Adam):
    """``torch.optim.AdamW``: :class:`Adam` with decoupled weight decay (default 1e-2),
    torch's arguments and defaults, and the same keyword-only extras."""

    _TORCH_CLASS = torch.optim.AdamW
    _NEWER_KEYS = dict(Adam._NEWER_KEYS, decoupled_weight_decay=True)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master="fp32", state_dtype=torch.float32,
                 seed=None, unscale_grads=True, precision_report=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused, master=master,
                         state_dtype=state_dtype, seed=seed, unscale_grads=unscale_grads,
                         precision_report=precision_report)

    @staticmethod
    def _decoupled_kwarg(value: bool) -> Dict[str, Any]:
        return {}  # (torch.optim.AdamW sets it, and takes no such argument)

    def _upgrade_group(self, saved: Dict[str, Any]) -> Dict[str, Any]:
        # As torch.optim.AdamW: its weight decay is decoupled, whatever a state dict or a
        # pickle says (an Adam's, loaded into an AdamW, has decoupled_weight_decay=False).
        return dict(super()._upgrade_group(saved), decoupled_weight_decay=True)

