"""NovoGrad, fused: Adam's first moment per element, a second moment per tensor from
the norm of its gradient (Ginsburg et al., 2019; the math of Apex's FusedNovoGrad)."""

from typing import Any, Dict

import torch
from torch import Tensor

from .. import ops
from .optimizer import Optimizer
from .precision import Work
from .torch_path import check_betas, check_flag, check_lr, check_nonnegative

__all__ = ["NovoGrad"]


class NovoGrad(Optimizer):
    """NovoGrad with torch-style arguments, one fused op call per param group
    (:func:`mixedprec.ops.fused_novograd_`).

    Args: ``lr``, ``betas``, ``eps``, ``weight_decay`` as Adam's; keyword-only
    ``bias_correction`` (divide the moments by ``1 - beta1**step`` and
    ``sqrt(1 - beta2**step)``), ``grad_averaging`` (weigh the gradient by ``1 - beta1``
    in the first moment), ``reg_inside_moment`` (add the weight decay to the normalized
    gradient inside the first moment instead of to the step), ``norm_type`` (2: L2
    norm, blended as ``sqrt(beta2 * v**2 + (1 - beta2) * n**2)``; 0: inf-norm,
    ``beta2 * v + (1 - beta2) * n``), ``init_zero`` (start the second moments at 0
    instead of at the first step's norms), and the extras ``master`` ("fp32", the
    default, or "none") and ``unscale_grads`` (an extra pass over the gradients here).

    The step count and the second moments belong to the param group:
    ``group["step"]`` (a float32 device tensor) and ``group["exp_avg_sq"]``, one float32
    vector with a value per parameter of the group in order, updated on the device.
    A group's parameters share one device. The first moments are float32.
    """

    _STATE_KEYS = ("master_param", "exp_avg")
    _NOT_IN_BACKWARD = ("its second moments are kept per param group, one tensor for all "
                        "the group's parameters")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, *,
                 bias_correction=True, grad_averaging=True, reg_inside_moment=False,
                 norm_type=2, init_zero=False, master="fp32", state_dtype=torch.float32,
                 seed=None, unscale_grads=True):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, grad_averaging=grad_averaging,
                        reg_inside_moment=reg_inside_moment, norm_type=norm_type,
                        init_zero=init_zero)
        self._check_group(type(self).__name__, defaults)
        super().__init__(params, defaults, master=master, state_dtype=state_dtype, seed=seed,
                         unscale_grads=unscale_grads)

    def _check_group(self, where: str, group: Dict[str, Any]) -> None:
        check_lr(where, group["lr"])
        for name in ("eps", "weight_decay"):
            check_nonnegative(where, name, group[name])
        check_betas(where, group["betas"])
        for name in ("bias_correction", "grad_averaging", "reg_inside_moment", "init_zero"):
            check_flag(where, name, group[name])
        if group["norm_type"] not in (0, 2):
            raise ValueError(f"{where}: expected norm_type 0 (inf-norm) or 2 (L2), got "
                             f"{group['norm_type']!r}")

    def _reg_inside_moment(self, group: Dict[str, Any]) -> bool:
        return bool(group["reg_inside_moment"])

    def _check_devices(self, by_device: Dict[torch.device, Work]) -> None:
        self._one_device(by_device, "the group's step count and moments live there")

    @staticmethod
    def _group_tensor(group, key: str, size: int, device: torch.device) -> Tensor:
        value = group.get(key)
        if value is None:
            value = group[key] = torch.zeros(size, dtype=torch.float32, device=device)
        elif value.device != device:  # the model moved after the optimizer was built
            value = group[key] = value.to(device)
        return value

    def _step_group(self, group, device, items: Work, inv_scale, found_inf):
        self._group_tensor(group, "step", 1, device)
        self._group_tensor(group, "exp_avg_sq", len(group["params"]), device)
        targets, model = self._update_lists(items.params, items.states)
        exp_avgs = [self._state_tensor(state, "exp_avg", t)
                    for state, t in zip(items.states, targets)]
        index = None  # the positions in exp_avg_sq of the params stepped, when not all are
        if len(items.params) != len(group["params"]):
            position = {id(p): i for i, p in enumerate(group["params"])}
            index = ops.int64_tensor([position[id(p)] for p in items.params], device)
        lists = (targets, exp_avgs, model, index)
        self._run_plan(group, lists, items.grads, inv_scale, found_inf)
        return lists

    def _plan_holds(self, group, plan) -> bool:
        return all(group.get(key) is not None and group[key].device == plan.device
                   for key in ("step", "exp_avg_sq"))

    def _run_plan(self, group, lists, grads, inv_scale, found_inf) -> None:
        targets, exp_avgs, model, index = lists
        exp_avg_sq = group["exp_avg_sq"]
        moments = exp_avg_sq if index is None else exp_avg_sq.index_select(0, index)
        beta1, beta2 = group["betas"]
        ops.fused_novograd_(targets, grads, exp_avgs, model, exp_avg_sq=moments,
                            step=group["step"], lr=group["lr"], beta1=beta1, beta2=beta2,
                            eps=group["eps"], weight_decay=group["weight_decay"],
                            bias_correction=group["bias_correction"],
                            grad_averaging=group["grad_averaging"],
                            reg_inside_moment=self._reg_inside_moment(group),
                            norm_type=group["norm_type"], init_zero=group["init_zero"],
                            inv_scale=inv_scale, found_inf=found_inf)
        if index is not None:
            exp_avg_sq.index_copy_(0, index, moments)
        self._unscale_after(grads, inv_scale, found_inf)

    def _load_group_state(self, new_group: Dict[str, Any], group: Dict[str, Any]) -> None:
        device = group["params"][0].device if group["params"] else None
        for key, size in (("step", 1), ("exp_avg_sq", len(group["params"]))):
            value = new_group.get(key)
            if value is None:
                continue
            if not isinstance(value, Tensor) or value.numel() != size or value.dim() != 1:
                raise ValueError(f"{type(self).__name__}.load_state_dict: a param group's "
                                 f"{key!r} must be a tensor of shape [{size}]")
            new_group[key] = value.to(device or value.device, torch.float32, copy=True)
