"""LAMB, fused: Adam's moments give each parameter an update, scaled per tensor by the
trust ratio ||p|| / ||update|| (You et al., 2019; the math of Apex's FusedLAMB)."""

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .. import ops
from ..grads import update_grad
from .optimizer import Optimizer
from .plans import PlanCache
from .precision import FLOAT_DTYPES, Work
from .torch_path import check_betas, check_flag, check_lr, check_nonnegative

__all__ = ["LAMB"]


class LAMB(Optimizer):
    """LAMB with torch-style arguments, one fused op call per param group
    (:func:`mixedprec.ops.fused_lamb_`). Adam's moments give an update ``u`` per
    parameter (decoupled weight decay added to ``u``, or with
    ``decoupled_weight_decay=False`` L2 weight decay added to the gradient), and each
    parameter moves by ``lr * ||p|| / ||u||`` times ``u`` (``lr`` alone where a norm is
    0, and for groups without weight decay unless ``use_nvlamb``). Gradients are first
    divided by ``max(1, norm / max_grad_norm)``, ``norm`` the L2 norm of all gradients
    of all groups (unscaled), computed on the device; ``max_grad_norm=0`` turns that
    off.

    Keyword-only extras as :class:`mixedprec.optim.Adam`: ``master`` ("fp32", the
    default, or "none"), ``unscale_grads`` (an extra pass over the gradients here: the
    op reads them only). Moments are float32. The step count belongs to the param
    group (``group["step"]``, a float32 device tensor, not advanced by a skipped step),
    and a group's parameters share one device.
    """

    _STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq")
    _STATE_TOGETHER = (("exp_avg",), ("exp_avg_sq",))
    _NOT_IN_BACKWARD = ("its update needs every gradient first (the global gradient norm "
                        "it clips by)")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, *,
                 bias_correction=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False, decoupled_weight_decay=True, master="fp32",
                 state_dtype=torch.float32, seed=None, unscale_grads=True):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb,
                        decoupled_weight_decay=decoupled_weight_decay)
        self._check_group(type(self).__name__, defaults)
        self._grad_norm: Optional[Tensor] = None
        super().__init__(params, defaults, master=master, state_dtype=state_dtype, seed=seed,
                         unscale_grads=unscale_grads)

    def _check_group(self, where: str, group: Dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        for name in ("eps", "weight_decay", "max_grad_norm"):
            check_nonnegative(where, name, group[name])
        check_betas(where, group["betas"])
        for name in ("bias_correction", "grad_averaging", "use_nvlamb", "decoupled_weight_decay"):
            check_flag(where, name, group[name])

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (on the device, without host synchronisation)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._grad_norm = self._global_grad_norm()
        try:
            super().step()
        finally:
            self._grad_norm = None
        return loss

    def _global_grad_norm(self) -> Optional[Tensor]:
        """The L2 norm of every gradient the step reads (unscaled by ``grad_scale``), on
        their device; None when clipping is off or there is no gradient. Gradients the
        step rejects are left out here: the step raises for them, before any update."""
        if self.defaults["max_grad_norm"] == 0:
            return None
        grads: List[Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                grad = update_grad(p, state.get("master_param") if state else None)
                if grad is None or grad.is_sparse or grad.dtype not in FLOAT_DTYPES:
                    continue
                grads.append(grad if ops.is_dense(grad) else grad.contiguous())
        if not grads:
            return None
        device = grads[0].device
        others = sorted({str(g.device) for g in grads if g.device != device})
        if others:
            raise ValueError(f"{type(self).__name__}: expected every parameter on one device "
                             f"(the global gradient norm), got {device} and {others}")
        inv_scale, _ = self._scaling(device, (getattr(self, "grad_scale", None), None))
        return ops.multi_tensor_l2norm(grads, inv_scale)[0]

    def _check_devices(self, by_device: Dict[torch.device, Work]) -> None:
        self._one_device(by_device, "the global gradient norm")

    def _step_group(self, group, device, items: Work, inv_scale, found_inf):
        self._group_step(group, device)
        targets, model = self._update_lists(items.params, items.states)
        exp_avgs, exp_avg_sqs = ([self._state_tensor(state, key, t)
                                  for state, t in zip(items.states, targets)]
                                 for key in ("exp_avg", "exp_avg_sq"))
        lists = (targets, exp_avgs, exp_avg_sqs, model)
        self._run_plan(group, lists, items.grads, inv_scale, found_inf)
        return lists

    def _plan_holds(self, group, plan) -> bool:
        return PlanCache.step_on(group, plan)

    def _run_plan(self, group, lists, grads, inv_scale, found_inf) -> None:
        targets, exp_avgs, exp_avg_sqs, model = lists
        beta1, beta2 = group["betas"]
        ops.fused_lamb_(targets, grads, exp_avgs, exp_avg_sqs, model, step=group["step"],
                        lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"],
                        decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
                        bias_correction=group["bias_correction"],
                        grad_averaging=group["grad_averaging"], use_nvlamb=group["use_nvlamb"],
                        global_grad_norm=self._grad_norm,
                        max_grad_norm=self.defaults["max_grad_norm"], inv_scale=inv_scale,
                        found_inf=found_inf)
        self._unscale_after(grads, inv_scale, found_inf)
