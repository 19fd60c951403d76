"""What the torch-named optimizers (Adam, AdamW, SGD) add to the fused base: torch.optim's
surface and torch's results where the fused ops do not go.

* Arguments: torch's own constructor checks them and gives the defaults (so messages,
  defaults and param-group keys are torch's, release for release); mixedprec adds only
  what torch lets through and cannot be stepped (a non-finite ``lr``, a NaN
  ``dampening``) and refuses ``differentiable=True``. ``foreach`` and ``fused`` are
  accepted as torch's implementation selectors: every step is fused.
* Fallback: float64 and complex parameters, strided views that are not dense, sparse
  gradients and tensor hyperparameters other than ``lr`` are stepped by torch's own
  functional implementation, on torch's state layout, so the results are torch's. That
  path unscales gradients in place and reads ``found_inf`` on the host (float64 and
  complex training is not a mixed-precision hot path).
* State: torch's ``state_dict`` format both ways (a torch.optim state dict loads, and
  ours loads into torch.optim), older state dicts get the newer group keys' defaults.
"""

import functools
import inspect
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.optim.optimizer as torch_optimizer
from torch import Tensor

from .. import ops
from ..loss_scale import inverse
from .optimizer import _FLOAT_DTYPES, _MASTER_MODES, _FusedOptimizer, _Work
from .state import whole_count


def torch_defaults(torch_class, where: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``torch_class``'s defaults for ``kwargs``, after its own argument checks (it is
    built over one empty parameter and dropped), and mixedprec's few more."""
    if kwargs.get("differentiable"):
        raise ValueError(f"{where}: differentiable=True is not supported (the step is a fused "
                         "op without autograd); use torch.optim for a differentiable step")
    defaults = dict(torch_class([torch.empty(0)], **kwargs).defaults)
    lr = defaults["lr"]
    if not isinstance(lr, Tensor) and not math.isfinite(lr):
        raise ValueError(f"{where}: expected lr to be a finite number >= 0, got {lr}")
    dampening = defaults.get("dampening", 0.0)
    if not isinstance(dampening, Tensor) and not math.isfinite(dampening):
        raise ValueError(f"{where}: expected dampening to be a finite number, got {dampening}")
    return defaults


@functools.lru_cache(maxsize=None)
def _hyperparameter_names(torch_class) -> frozenset:
    """The arguments of ``torch_class``'s constructor but ``params`` and ``lr``."""
    names = inspect.signature(torch_class.__init__).parameters
    return frozenset(names) - {"self", "params", "lr"}


class TorchOptimizer(_FusedOptimizer):
    """The base of mixedprec.optim's torch-named optimizers (see the module docstring)."""

    #: torch.optim's class of the same name (its checks, defaults and group keys).
    _TORCH_CLASS: Any = None
    #: Group keys a newer torch added, with the value torch's ``__setstate__`` gives an
    #: older state dict.
    _NEWER_KEYS: Dict[str, Any] = {}
    #: Group hyperparameters that torch lets be tensors and the fused ops take as numbers.
    _SCALAR_KEYS: Tuple[str, ...] = ()

    def __init__(self, params, defaults: Dict[str, Any], *, master: str, state_dtype,
                 seed, unscale_grads: bool, set_grad_none: bool = True):
        if not isinstance(unscale_grads, bool):
            raise TypeError(f"{type(self).__name__}: expected unscale_grads to be a bool, got "
                            f"{unscale_grads!r}")
        if not isinstance(master, str):  # (None is not "none": the default is "fp32")
            raise ValueError(f"{type(self).__name__}: expected master to be one of "
                             f"{list(_MASTER_MODES)}, got {master!r}")
        # group index -> its hyperparameters (but lr) as torch's checks last passed them
        self._checked: Dict[int, Tuple[Any, ...]] = {}
        #: After a scaled step, p.grad holds the unscaled gradient (torch's fused
        #: optimizers do the same); False skips that write (a pass over the gradients).
        self.unscale_grads = unscale_grads
        # (group, params) that torch's implementation steps, found during a step; changed
        # in place, never rebound (torch.compile traces that)
        self._pending: List[Tuple[Dict[str, Any], List[Tensor]]] = []
        super().__init__(params, defaults, None, set_grad_none, master, state_dtype, seed)

    def __getstate__(self) -> Dict[str, Any]:
        return dict(super().__getstate__(), unscale_grads=self.unscale_grads)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state.setdefault("unscale_grads", True)
        state["_pending"] = []
        state["_checked"] = {}
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self._NEWER_KEYS.items():
                group.setdefault(key, value)

    @staticmethod
    def _lr(group: Dict[str, Any], device: torch.device, found_inf: Optional[Tensor]):
        """(lr, lr_tensor, found_inf) for a group's fused op calls. A tensor ``lr`` is
        read on the device, never on the host: one that is not a finite number >= 0
        (a NaN written by hand, say) skips the group's update there, as an overflow does
        (nothing written, no step counted), through the ``found_inf`` returned: the
        scaler's plus a flag that is nonzero (or NaN) for such an lr. A number ``lr`` is
        checked by the op itself, before it writes anything."""
        lr = group["lr"]
        if not isinstance(lr, Tensor):
            return lr, None, found_inf
        lr = lr.to(device, torch.float32).reshape(())
        # 0 for a finite lr >= 0; NaN for an infinite or NaN one (lr * 0), negative else
        flag = lr.clamp(max=0).add_(lr, alpha=0).reshape(1)
        return 0.0, lr, flag if found_inf is None else flag.add_(found_inf.reshape(1))

    def _fused_dtype(self, p: Tensor) -> bool:
        # (a strided view, such as every other column, is not dense: torch steps it)
        return p.dtype in _FLOAT_DTYPES and ops.is_dense(p)

    def _fused_group(self, group: Dict[str, Any]) -> bool:
        """Whether the group's hyperparameters suit the fused op (tensors other than lr
        go to torch's implementation)."""
        return not any(isinstance(v, Tensor) for key in self._SCALAR_KEYS
                       for v in (group[key] if isinstance(group[key], tuple) else (group[key],)))

    def _unfused(self, group: Dict[str, Any]) -> List[Tensor]:
        """The group's parameters with gradients that torch's implementation steps."""
        if not self._fused_group(group):
            return [p for p in group["params"] if p.grad is not None]
        return [p for p in group["params"] if p.grad is not None and (
            not self._fused_dtype(p) or p.grad.is_sparse)]

    def _grads_by_device(self, group: Dict[str, Any]) -> Dict[torch.device, _Work]:
        # (the full path of a step: every group is checked here before any is updated)
        unfused = self._unfused(group)
        self._check_unfused(group, unfused)
        if unfused:
            self._pending.append((group, unfused))
        if not self._fused_group(group):
            return {}
        return super()._grads_by_device(_Subset(group, unfused))

    def _planned_work(self):
        # (a plan never holds unfused parameters: their gradients' dtypes or sparse
        # layout send the step to the full path)
        if not all(map(self._fused_group, self.param_groups)):
            return None
        return super()._planned_work()

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (on the device, without host synchronisation, for fp32,
        fp16 and bf16 parameters with dense gradients)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._pending.clear()
        if not torch.compiler.is_compiling():  # (a compiled step guards on the values)
            self._check_hyperparameters()
        self._fused_step()  # (under this step's no_grad)
        pending = list(self._pending)
        self._pending.clear()
        found_inf = getattr(self, "found_inf", None)
        # sync-ok: the fallback (float64, complex, sparse) runs torch's own step on the host
        if pending and (found_inf is None or not bool(found_inf)):
            grad_scale = getattr(self, "grad_scale", None)
            for group, params in pending:
                grads = [p.grad for p in params]
                if grad_scale is not None:
                    for grad in grads:
                        grad.mul_(inverse(grad_scale.to(grad.device)).to(grad.dtype))
                self._torch_step(group, params, grads)
        return loss

    def _check_hyperparameters(self) -> None:
        """Every group's hyperparameters before any group is updated, so that a bad one
        (set on a group by hand, loaded, added) raises with nothing changed: ``lr`` a
        number or a one-element floating tensor, each step; the others through torch's
        own constructor checks (``torch_defaults``), again only when they changed."""
        where = f"{type(self).__name__}.step"
        accepted = _hyperparameter_names(self._TORCH_CLASS)
        for index, group in enumerate(self.param_groups):
            lr = group.get("lr")
            if isinstance(lr, Tensor):
                if lr.numel() != 1 or not lr.is_floating_point():
                    raise ValueError(f"{where}: param group {index}: expected a tensor lr to "
                                     f"hold one floating-point value, got {lr.dtype} of "
                                     f"shape {tuple(lr.shape)}")
            elif isinstance(lr, bool) or not isinstance(lr, (int, float)) or \
                    not 0 <= lr < float("inf"):
                raise ValueError(f"{where}: param group {index}: expected lr to be a finite "
                                 f"number >= 0 or a tensor, got {lr!r}")
            kwargs = {k: v for k, v in group.items() if k in accepted}
            key = tuple((k, ("tensor", id(v)) if isinstance(v, Tensor) else v)
                        for k, v in sorted(kwargs.items(), key=lambda item: item[0]))
            if self._checked.get(index) != key:
                try:
                    torch_defaults(self._TORCH_CLASS, f"{where}: param group {index}", kwargs)
                except (ValueError, TypeError) as error:
                    if str(error).startswith(where):
                        raise
                    raise type(error)(f"{where}: param group {index}: {error}") from error
                self._checked[index] = key

    def _check_unfused(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """Hook: errors of torch's implementation raised before any update."""

    def _refuse_meta(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        # fused=True: torch's own check first, so the error is torch.optim's
        check = getattr(torch_optimizer, "_device_dtype_check_for_fused", None)
        if group.get("fused") and check is not None:
            check(params[0])
        super()._refuse_meta(group, params)

    def _torch_step(self, group: Dict[str, Any], params: List[Tensor],
                    grads: List[Tensor]) -> None:
        """torch's functional step of ``params`` on torch's state layout."""
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """torch's format. Parameters that step together share one step-count tensor in
        the optimizer (one op call advances it); the state dict gives each its own."""
        state_dict = super().state_dict()
        state_dict["state"] = {
            key: dict(value, step=value["step"].clone()) if isinstance(value, dict) and
            isinstance(value.get("step"), Tensor) else value  # (other entries as they are)
            for key, value in state_dict["state"].items()}
        return state_dict

    def _upgrade_group(self, saved: Dict[str, Any]) -> Dict[str, Any]:
        for key, value in self._NEWER_KEYS.items():
            saved.setdefault(key, value)
        return saved

    def _loaded_value(self, p: Tensor, param_id: Any, key: str, value: Any) -> Any:
        if key == "step":
            self._check_step_count(param_id, value)
        if not self._fused_dtype(p) and isinstance(value, Tensor):
            if key == "step":  # torch's layout: a float32 CPU scalar
                return value.to("cpu", torch.float32, copy=True)
            return value.to(p.device, p.dtype if value.is_floating_point() else value.dtype,
                            copy=True)
        if value is None and key == "momentum_buffer":
            return None
        return super()._loaded_value(p, param_id, key, value)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of this class or of torch.optim's class of the same name
        (moments, momentum buffers and step counts in torch's format; masters are taken
        anew from the parameters when the state dict has none). Checked first: on a
        mismatch a ValueError names it and nothing changes."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and state.get("momentum_buffer", 0) is None:
                    del state["momentum_buffer"]
                if state == {}:
                    del self.state[p]
        self._share_steps()

    def _check_step_count(self, param_id: Any, value: Any) -> None:
        """A loaded step count: a whole number >= 0, or a one-element real tensor holding
        one (read on the host here, once, when loading)."""
        if whole_count(value) is None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: state[{param_id}]"
                             f"['step'] must be a whole number >= 0, got {value!r}")

    def _share_steps(self) -> None:
        """Loaded step counts: a float32 tensor on the parameter's device, one per
        group and value, shared by the parameters that the fused op steps together
        (read on the host here, once, when loading; checked by ``_check_step_count``).
        A group that torch's implementation steps (tensor betas, say) keeps one count
        per parameter, as torch does: that implementation advances each."""
        for group in self.param_groups:
            if not self._fused_group(group):
                continue
            shared: Dict[Tuple[torch.device, float], Tensor] = {}
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "step" not in state or not self._fused_dtype(p):
                    continue
                value = float(state["step"])  # sync-ok: loading a state dict, not a step
                key = (p.device, value)
                if key not in shared:
                    shared[key] = torch.tensor(value, dtype=torch.float32, device=p.device)
                state["step"] = shared[key]
        self._invalidate_plans()


class _Subset(dict):
    """A param group seen without some of its parameters (those torch's implementation
    steps)."""

    def __init__(self, group: Dict[str, Any], without: List[Tensor]):
        super().__init__(group)
        if without:
            skip = {id(p) for p in without}
            self["params"] = [p for p in group["params"] if id(p) not in skip]
