"""What the optimizer base takes from torch.optim: each class's checks and defaults
(:func:`torch_defaults`, run again at a step on group settings that changed), and the
parameters that torch's own functional implementation steps (float64 and complex ones,
sparse gradients, hyperparameters the fused ops do not take, and the groups with
``differentiable=True``: :func:`check_differentiable`), found by :func:`unfused`."""

import functools
import inspect
import math
import numbers
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.optim.optimizer as torch_optimizer
from torch import Tensor

from .. import ops
from ..distributed import _local
from ..grads import update_grad
from ..loss_scale import inverse
from .precision import FLOAT_DTYPES, check_seed, whole_group


def hook_step(cls: type) -> None:
    """Wraps ``cls.step`` once, as torch.optim.Optimizer does each class's
    (``_patch_step_function``): the step hooks, global and the optimizer's, and the
    profiler's ``Optimizer.step#Class.step`` range. torch's own wrapper
    (``profile_hook_step``) runs when a hook is registered, this thread's profiler
    records or torch.compile traces. Otherwise the step runs inside torch's fast range
    (``_RecordFunctionFast``: about 0.6 us when nothing records; a profiler that records
    every thread, such as an on-demand one, still sees the range), where torch's
    ``record_function`` costs about 15 us of host time a step (bench/README.md, "torch's
    step wrapper, entered only when something records").

    A subclass's step that calls this class's (``super().step()``: the Apex faces, a
    user's class) runs the hooks and the range once, in the subclass's wrapper: here the
    call goes straight to the step. (torch's wrappers run them at both levels once both
    classes have been instantiated.)"""
    step = cls.step
    if getattr(step, "hooked", False):
        return
    hooked = torch.optim.Optimizer.profile_hook_step(step)
    global_hooks = (getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}),
                    getattr(torch_optimizer, "_global_optimizer_post_hooks", {}))
    fast_range = getattr(torch._C._profiler, "_RecordFunctionFast", None)

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        outer = type(self).step
        if outer is not wrapper and getattr(outer, "hooked", False):
            return step(self, *args, **kwargs)  # called from a subclass's wrapped step
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or \
                global_hooks[0] or global_hooks[1] or fast_range is None or \
                torch.compiler.is_compiling() or torch._C._autograd._profiler_enabled():
            return hooked(self, *args, **kwargs)
        with fast_range(f"Optimizer.step#{type(self).__name__}.step"):
            return step(self, *args, **kwargs)

    wrapper.hooked = True
    cls.step = wrapper


def torch_defaults(torch_class, where: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``torch_class``'s defaults for ``kwargs``, after its own argument checks (it is
    built over one empty parameter and dropped), and mixedprec's few more."""
    betas = kwargs.get("betas")
    if betas is not None and (not isinstance(betas, (tuple, list)) or len(betas) != 2):
        raise ValueError(f"{where}: expected betas to be two numbers in [0, 1), got {betas!r}")
    defaults = dict(torch_class([torch.empty(0)], **kwargs).defaults)
    lr = defaults["lr"]
    if not isinstance(lr, Tensor) and not math.isfinite(lr):
        raise ValueError(f"{where}: expected lr to be a finite number >= 0, got {lr}")
    dampening = defaults.get("dampening", 0.0)
    if not isinstance(dampening, Tensor) and not math.isfinite(dampening):
        raise ValueError(f"{where}: expected dampening to be a finite number, got {dampening}")
    # The fused ops' rules where torch's checks let more through (torch takes inf, and
    # NaN where it tests only `< 0`): so a group set so by hand is refused before any
    # group steps, not by the op after earlier groups have.
    # (a tensor value, as torch's schedulers may write, is not read here: no host read)
    for name in ("eps", "weight_decay", "momentum"):
        if name in defaults and not isinstance(defaults[name], Tensor):
            check_nonnegative(where, name, defaults[name])
    return defaults


@functools.lru_cache(maxsize=None)
def _hyperparameter_names(torch_class) -> frozenset:
    """The arguments of ``torch_class``'s constructor but ``params`` and ``lr``."""
    names = inspect.signature(torch_class.__init__).parameters
    return frozenset(names) - {"self", "params", "lr"}


def check_lr(where: str, lr: Any) -> None:
    """``lr``: a number >= 0 or a one-element floating tensor."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or not lr.is_floating_point() or lr.is_meta:
            raise ValueError(f"{where}: expected a tensor lr to hold one floating-point value, "
                             f"got {lr.dtype} of shape {tuple(lr.shape)}"
                             + (" on the meta device (no value)" if lr.is_meta else ""))
    elif isinstance(lr, bool) or not isinstance(lr, numbers.Real) or \
            not 0 <= lr < float("inf"):  # (numpy's numbers too, as torch takes them)
        raise ValueError(f"{where}: expected lr to be a finite number >= 0 or a tensor, "
                         f"got {lr!r}")


def check_groups(opt, checked: Dict[int, Tuple[Any, ...]], when: str = "step") -> None:
    """Every group's hyperparameters before any group is updated, so that a bad one
    (set on a group by hand, loaded, added) raises with nothing changed: ``lr`` each
    step; the others through the class's checks (torch's constructor, or the class's
    ``_check_group``), again only when they changed (``checked``: group index -> the
    settings last passed; ``add_param_group`` fills it, ``when`` its name)."""
    torch_class = opt._TORCH_CLASS
    accepted = _hyperparameter_names(torch_class) if torch_class else opt.defaults
    for index, group in enumerate(opt.param_groups):
        lr = group.get("lr")
        if type(lr) is not float or not 0.0 <= lr < math.inf:  # (a float in range passes)
            check_lr(f"{type(opt).__name__}.{when}: param group {index}", lr)
        # (in the group's order: a key added or moved costs one more check, no more)
        # (and mixedprec's own "seed", which the ops take as an int64)
        key = tuple((k, ("tensor", id(v)) if isinstance(v, Tensor) else v)
                    for k, v in group.items() if k in accepted and k != "lr" or k == "seed")
        if checked.get(index) == key:
            continue
        where = f"{type(opt).__name__}.{when}"
        kwargs = {k: group[k] for k, _ in key if k != "seed"}
        try:
            if group.get("seed") is not None:
                check_seed(f"{where}: param group {index}", group["seed"])
            if torch_class is not None:
                torch_defaults(torch_class, f"{where}: param group {index}", kwargs)
                check_differentiable(f"{where}: param group {index}", group, opt.master,
                                     opt.state_dtype, opt.precision_report)
            else:
                opt._check_group(f"{where}: param group {index}", group)
        except (ValueError, TypeError) as error:
            if when == "step" and not _has_gradients(opt, group):
                continue  # (checked again at its next step, uncached)
            if str(error).startswith(where):
                raise
            raise type(error)(f"{where}: param group {index}: {error}") from error
        checked[index] = key


def _has_gradients(opt, group: Dict[str, Any]) -> bool:
    """Whether a step updates anything of ``group``: a group without gradients steps
    nothing, so its settings may be anything then, as torch's step takes them (a
    schedule cycling beta1 over 1..22 in PyTorch's test_cycle_lr_with_adam)."""
    return any(update_grad(p, (opt.state.get(p) or {}).get("master_param")) is not None
               for p in group["params"])


def check_differentiable(where: str, group: Dict[str, Any], master: str,
                         state_dtype: torch.dtype, report: Any) -> None:
    """A group with ``differentiable=True`` is stepped by torch.optim's own implementation
    with autograd recording it, as torch.optim does (the fused ops have no derivative):
    its parameters as they are, with state of their dtype (torch's). So it takes no lean
    mode, no ``state_dtype`` but the default, no fp32 masters of fp16/bf16 parameters
    (``master="none"`` steps those as torch.optim does) and no precision report: each is
    refused here, naming it."""
    if not group.get("differentiable"):
        return
    if master not in ("fp32", "none"):
        why = f"master={master!r}"
    elif state_dtype != torch.float32:
        why = f"state_dtype={state_dtype}"
    elif report is not None:
        why = "precision_report"
    elif master == "fp32" and any(isinstance(p, Tensor) and p.dtype in (
            torch.float16, torch.bfloat16) for p in group["params"]):
        why = "fp32 masters of fp16/bf16 parameters (master='fp32'; master='none' steps " \
              "them as torch.optim does)"
    else:
        return
    raise ValueError(f"{where}: differentiable=True steps with torch.optim's own "
                     "implementation (autograd records the step), which keeps the parameters "
                     f"as they are, with state of their dtype: not {why}")


def step_holders(state_of: Dict[Tensor, Dict[str, Any]], group: Dict[str, Any]) -> Counter:
    """id(step-count tensor) -> how many of the group's parameters share it (taken once
    per group, before its op calls change any; of the whole group for a
    :class:`Subset`)."""
    return Counter(id(state["step"]) for state in map(state_of.get, whole_group(group)["params"])
                   if state and "step" in state)


def step_counts(holders: Counter, call, device: torch.device, used: List[Tensor]
                ) -> List[Tuple[List[int], Tensor]]:
    """Per-parameter step counts (torch's layout), shared by the parameters one op call
    advances: [(positions in ``call``, their step-count tensor)]. New parameters get a
    new count (zero); a count whose holders (``step_holders``) are not all in this call
    is split off (a copy), so each op call advances its own tensor once (``used``: the
    counts this step's calls advance)."""
    counts: Dict[int, List[Any]] = {}
    new: List[int] = []
    for i, state in enumerate(call.states):
        step = state.get("step")
        if step is None:
            new.append(i)
        else:
            counts.setdefault(id(step), [step, []])[1].append(i)
    out = []
    if new:
        out.append((new, torch.zeros((), dtype=torch.float32, device=device)))
    for key, (step, picked) in counts.items():
        if any(step is u for u in used) or holders[key] != len(picked) or (
                step.device != device):
            step = step.to(device, torch.float32, copy=True)
        out.append((picked, step))
    for picked, step in out:
        used.append(step)
        for i in picked:
            call.states[i]["step"] = step
    return out


def lr_on_device(group: Dict[str, Any], device: torch.device, found_inf: Optional[Tensor]):
    """(lr, lr_tensor, found_inf) for a group's op calls. A tensor ``lr`` is read on the
    device, never on the host: one that is not a finite number >= 0 (a NaN written by
    hand, say) skips the group's update there, as an overflow does, through the
    ``found_inf`` returned (the scaler's plus a flag nonzero or NaN for such an lr). A
    number ``lr`` is checked by the op itself, before it writes anything."""
    lr = group["lr"]
    if not isinstance(lr, Tensor):
        return lr, None, found_inf
    lr = lr.to(device, torch.float32).reshape(())
    # 0 for a finite lr >= 0; NaN for an infinite or NaN one (lr * 0), negative else
    flag = lr.clamp(max=0).add_(lr, alpha=0).reshape(1)
    return 0.0, lr, flag if found_inf is None else flag.add_(found_inf.reshape(1))


def step_pending(opt) -> None:
    """torch's own step of the parameters the fused step left to it (float64, complex,
    sparse gradients, differentiable groups, ...: ``opt._pending``), unless the scaler's
    ``found_inf`` is set (read on the host: not a mixed-precision hot path); gradients
    unscaled first. A differentiable group's step runs with autograd on, as torch's."""
    pending = list(opt._pending)
    opt._pending.clear()
    found_inf = getattr(opt, "found_inf", None)
    # sync-ok: the fallback (float64, complex, sparse) runs torch's own step on the host
    if not pending or (found_inf is not None and bool(found_inf)):
        return
    grad_scale = getattr(opt, "grad_scale", None)
    for group, params in pending:
        unshare_steps(opt.state, group, params)
        grads = [p.grad for p in params]
        if grad_scale is not None:
            for grad in grads:
                grad.mul_(inverse(grad_scale.to(grad.device)).to(grad.dtype))
        with torch.set_grad_enabled(bool(group.get("differentiable"))):
            opt._torch_step(group, params, grads)


def unshare_steps(state_of: Dict[Tensor, Dict[str, Any]], group: Dict[str, Any],
                  params: List[Tensor]) -> None:
    """Each of ``params`` its own step-count tensor where it shares one with others of
    the group (as the fused steps leave them: :func:`step_counts`): torch's
    implementation advances each parameter's count in place, so a shared one advanced
    once per holder (3 parameters: by 3 a step)."""
    holders = step_holders(state_of, group)
    for p in params:
        state = state_of.get(p)
        step = state.get("step") if state else None
        if isinstance(step, Tensor) and holders[id(step)] > 1:
            state["step"] = step.clone()


def is_fused_param(p: Tensor) -> bool:
    """Whether the fused ops step ``p`` (a strided view, such as every other column, is
    not dense: torch's implementation steps it; a DTensor by its local shard, which the
    ops step)."""
    return p.dtype in FLOAT_DTYPES and ops.is_dense(_local(p))


def torch_steps(opt, p: Tensor, fused_group: bool) -> bool:
    """Whether torch.optim's own implementation (``opt._torch_step``) steps ``p``, of a
    group the fused ops take (``fused_group``: ``opt._fused_group``) or not: all of a group
    they do not take, those that are not fused (``opt._fused_dtype``: float64, sparse,
    strided but not dense) and those with a sparse gradient."""
    return not fused_group or not opt._fused_dtype(p) or (
        p.grad is not None and p.grad.is_sparse)


def check_torch_stepped(opt, where: str, group: Dict[str, Any], master: str,
                        state_dtype: torch.dtype, report: Any,
                        params: Optional[Sequence[Any]] = None) -> None:
    """The parameters of ``group`` (or ``params`` of it) that torch.optim's own
    implementation steps (:func:`torch_steps`; a ``differentiable`` group is
    :func:`check_differentiable`'s, and passes here). What the class's torch step
    keeps is its ``_TORCH_STEP_KEEPS``: None, no such step; "params",
    each parameter as it is, with state and arithmetic of its dtype; "fp32 masters",
    that with the fp32 masters of fp16 and bf16 parameters under ``master="fp32"`` (but
    for a sparse gradient, which it applies to the parameter). Refused here, before any
    update and naming it, is what would otherwise fail after other parameters stepped
    (no torch step) or be dropped: fp32 masters or a bf16 mode of an fp16/bf16
    parameter (``master="none"`` is stepped as torch.optim steps it), a ``state_dtype``
    other than the default and the parameter's, the precision report, and state that
    the torch step takes in the parameter's dtype only (``_TORCH_STEP_SAME_DTYPE``) in
    another, made by fused steps before (:func:`other_dtype`: Adam's fp32 moments of a
    bf16 parameter under ``master="none"``). (An fp32 parameter is its own master and
    keeps fp32 state, as those that 8-bit moments leave out do.)"""
    if group.get("differentiable"):
        return
    keeps, fused_group = opt._TORCH_STEP_KEEPS, opt._fused_group(group)
    for p in group["params"] if params is None else params:
        if not isinstance(p, Tensor) or not torch_steps(opt, p, fused_group):
            continue
        sparse_grad, local = p.grad is not None and p.grad.is_sparse, _local(p)
        low = p.dtype in (torch.float16, torch.bfloat16)
        if keeps is None:
            why = "which it has not"
        elif low and master != "none" and not (
                master == "fp32" and keeps == "fp32 masters" and not sparse_grad):
            why = f"which keeps it as it is, with state of its dtype: not master={master!r}"
        elif low and state_dtype not in (torch.float32, p.dtype):
            why = f"which keeps its state in its dtype: not state_dtype={state_dtype}"
        elif low and report is not None:
            why = "which does not count for the precision report"
        elif other_dtype(opt, p):
            why = f"which takes its state in its dtype only: not {other_dtype(opt, p)}"
        else:
            continue
        error, strided = ValueError, False
        if not fused_group:
            what = "is in a param group with a tensor where the fused ops take a number"
        elif p.dtype not in FLOAT_DTYPES or local.layout != torch.strided:
            kind = "dtype" if p.dtype not in FLOAT_DTYPES else "layout"
            error, what = TypeError, f"has a {kind} that the fused ops do not take"
        elif not ops.is_dense(local):
            strided, what = True, f"is not dense (strides {tuple(local.stride())}" \
                f"{' of its local shard' if local is not p else ''}), which the fused ops " \
                "do not take"
        else:
            error, what = TypeError, "has a sparse gradient, which the fused ops do not take"
        fixes = ["make it contiguous"] if strided else []
        if other_dtype(opt, p) and not fused_group:
            fixes.append(f"set {tensor_settings(opt, group)} of param group "
                         f"{group_index(opt, group)} as numbers")
        elif keeps and low:
            fixes.append(f"use master='none' and state_dtype={p.dtype}")
        raise error(f"{where}: a {p.dtype} parameter of shape {tuple(p.shape)} {what}, so it "
                    f"needs torch.optim's implementation of the step, {why}"
                    + (f" ({' or '.join(fixes)})" if fixes else ""))


def other_dtype(opt, p: Tensor) -> str:
    """Which state of ``p`` torch's step cannot take (``opt._TORCH_STEP_SAME_DTYPE`` in
    another dtype than p's: fp32 moments that fused steps made for a bf16 parameter
    under master="none", or bf16 ones of an fp32 parameter), as "the torch.float32
    'exp_avg' its fused steps made"; else ""."""
    state = opt.state.get(p) or {}
    for key in opt._TORCH_STEP_SAME_DTYPE:
        value = state.get(key)
        if isinstance(value, Tensor) and value.dtype != p.dtype:
            return f"the {value.dtype} {key!r} its fused steps made"
    return ""


def tensor_settings(opt, group: Dict[str, Any]) -> str:
    """The group's settings that are tensors where the fused ops take numbers."""
    names = [key for key in opt._SCALAR_KEYS if any(
        isinstance(v, Tensor) for v in (group[key] if isinstance(group[key], tuple)
                                        else (group[key],)))]
    return " and ".join(names) or "the settings"


def group_index(opt, group: Dict[str, Any]) -> int:
    """``group``'s place in ``opt.param_groups`` (the next one for a group being added)."""
    whole = whole_group(group)
    return next((i for i, g in enumerate(opt.param_groups) if g is whole),
                len(opt.param_groups))


def unfused(opt, group: Dict[str, Any]) -> List[Tensor]:
    """The group's parameters with gradients that torch's implementation steps."""
    fused_group = opt._fused_group(group)
    return [p for p in group["params"] if p.grad is not None and
            torch_steps(opt, p, fused_group)]


def refuse_meta(where: str, group: Dict[str, Any], params: List[Tensor]) -> None:
    """Parameters on the meta device hold no values: refused before any update (torch's
    own check first with fused=True, so the error is torch.optim's)."""
    check = getattr(torch_optimizer, "_device_dtype_check_for_fused", None)
    if group.get("fused") and check is not None:
        check(params[0])
    raise RuntimeError(f"{where}.step: {len(params)} parameter(s) with gradients are on the "
                       "meta device, which holds no values; materialise the model first "
                       "(e.g. model.to_empty(device=...))")


class Subset(dict):
    """A param group seen without some of its parameters (those torch's implementation
    steps), or with only some (``only``: a bucket that steps inside backward). ``whole``
    is the group it was taken from: a parameter's rounding salt and its step-count
    sharing are those of its place there (:func:`~.precision.whole_group`)."""

    def __init__(self, group: Dict[str, Any], without: Sequence[Tensor] = (),
                 only: Optional[Sequence[Tensor]] = None):
        super().__init__(group)
        self.whole = whole_group(group)
        if only is not None:
            self["params"] = list(only)
        elif without:
            skip = {id(p) for p in without}
            self["params"] = [p for p in group["params"] if id(p) not in skip]


def check_nonnegative(where: str, name: str, value: Any) -> None:
    """A hyperparameter that must be a finite number >= 0."""
    if isinstance(value, (Tensor, bool)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: expected {name} to be a float, got {type(value).__name__}")
    if not 0.0 <= value < math.inf:
        raise ValueError(f"{where}: expected {name} to be a finite number >= 0, got {value}")


def check_once(where: str, params: Sequence[Tensor]) -> None:
    """A param group's parameters, each once. torch warns when such a group is added
    (as it does here) and steps the parameter twice; the fused op takes each tensor
    once, and refused the pair mid-step, after the other groups had stepped: refused
    here, with every group's other checks, before any group steps."""
    if len(set(map(id, params))) == len(params):
        return
    seen: Dict[int, int] = {}
    for i, p in enumerate(params):
        first = seen.setdefault(id(p), i)
        if first != i:
            raise ValueError(f"{where}: a param group holds one parameter twice (at {first} "
                             f"and {i}); the fused step updates each parameter once: list it "
                             "once")


def check_flag(where: str, name: str, value: Any) -> None:
    """A hyperparameter that must be a bool (or an int, as Apex's 1 and 0: the ops take
    those, not a string or None)."""
    if not isinstance(value, int):
        raise TypeError(f"{where}: expected {name} to be a bool, got {value!r}")


def check_betas(where: str, betas: Any) -> None:
    """Two numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
            for b in betas):
        raise ValueError(f"{where}: expected betas to be two numbers in [0, 1), got {betas!r}")
