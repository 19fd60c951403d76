"""Fused optimizers with fp32 master weights for fp16/bf16 models.

:class:`FusedSGD`, :class:`FusedAdam`, :class:`FusedLAMB`, :class:`FusedAdagrad` and
:class:`FusedNovoGrad` take Apex's argument names and defaults and behave as full
:class:`torch.optim.Optimizer` objects (param groups, ``state_dict``,
``add_param_group``, ``zero_grad``, LR schedulers). Each step is one fused op call per
param group and device (two for SGD while some momentum buffers are new), which:

* reads fp32, fp16 or bf16 gradients and multiplies them by ``1 / grad_scale`` when a
  ``torch.amp.GradScaler`` or :class:`mixedprec.GradScaler` set ``grad_scale``;
* skips the whole update on the device when the scaler set ``found_inf``, so an
  overflow never forces a host synchronisation;
* with ``master_weights=True`` updates fp32 master copies of fp16/bf16 parameters
  (kept in the optimizer state as ``master_param``) and writes them, cast, into the
  model parameters in the same pass.

State is created at a parameter's first step, as torch's optimizers create theirs
(masters included): an optimizer that has not stepped has an empty ``state``, which
is what ``torch.distributed.checkpoint.state_dict`` relies on to build the full
state it loads a checkpoint into.

Optimizer state (moments, momentum buffers, masters) is float32 by default; FusedAdam
and FusedSGD can keep their moments or momentum buffers in bfloat16 and, with
``master="kahan"``, a bfloat16 compensation per bf16 parameter instead of an fp32 master,
with ``master="stochastic"``, no master and bf16 parameters rounded stochastically, or
with ``master="remainder"``, an int16 remainder that makes each bf16 parameter an exact
fp32 master (docs/lean-precision.md). State follows
its parameter: moved with it, laid out like it (``channels_last`` after the optimizer
was built works), and a master is taken anew from its parameter when the parameter
was written outside the optimizer (see :class:`mixedprec.optim.precision.Masters`).

The one channel from a loss scaler: the ``grad_scale`` and ``found_inf`` attributes
that ``torch.amp.GradScaler`` sets around ``step()`` (mixedprec's GradScaler, amp and
fp16_utils set the same). ``p.grad`` is read, never written: after a scaled step it
still holds the scaled gradient (torch's fused optimizers unscale it in place).
With masters, a master whose ``.grad`` is set (fp32, unscaled) is updated from that
instead of ``p.grad``: ``mixedprec.amp.master_params`` puts it there for gradient
clipping, and the step clears it.
"""


import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from .. import masters as mst
from .. import ops
from ..grads import update_grad
from ..loss_scale import check_scale, inverse
from ..ops import renamed
from ..optim import BF16_MODES, FLOAT_DTYPES, LAMB, SGD, Adagrad, Adam, NovoGrad, Optimizer
from ..optim.precision import Work
from ..optim.state import count_applied
from ..optim.torch_path import check_betas, check_nonnegative
from . import amp_C

# Apex 2019's apex.optimizers.FP16_Optimizer (see fp16_utils.LegacyFP16_Optimizer).
from .fp16_utils import LegacyFP16_Optimizer as FP16_Optimizer  # noqa: F401

__all__ = ["FusedSGD", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedAdagrad",
           "FusedNovoGrad"]


def _per_group(where: str, name: str, value: Any, count: int) -> List[Optional[List[Any]]]:
    """Apex 2019's per-group argument of ``step``: a list per group, or one list (or
    generator) of tensors for a single group; None: none for any group."""
    if value is None:
        return [None] * count
    value = list(value)
    if not value or not isinstance(value[0], (list, tuple)):
        value = [value]  # one group's tensors
    if len(value) != count:
        raise ValueError(f"{where}: expected {name} to hold one list per param group "
                         f"({count}), got {len(value)}")
    return [None if v is None else list(v) for v in value]




def _master_of(where: str, master_weights: Optional[bool], master: Optional[str]) -> str:
    """The master mode from Apex's ``master_weights`` (True: "fp32", False: "none") and
    ``master``. ``master`` wins over ``master_weights=False`` (Apex's default, which
    then says nothing); ``master_weights=True`` with another ``master`` is a conflict."""
    if master is None:
        return "fp32" if master_weights else "none"
    if master_weights and master != "fp32":
        raise ValueError(f"{where}: master_weights=True conflicts with master={master!r} "
                         "(master_weights=True is master='fp32'); give one of them")
    return master


class _ApexFace:
    """What the Apex faces over mixedprec.optim share: Apex's ``set_grad_none`` (what
    ``zero_grad()`` does by default) and ``master_weights``, Apex's param groups (no
    torch-only keys added on load; the core's names for Apex's renamed keys, and the
    constructor's values for keys Apex's groups lacked), fp32/fp16/bf16 parameters only
    (others are a TypeError, as in Apex) and no sparse gradients."""

    _NEWER_KEYS: Dict[str, Any] = {}
    #: Apex's group keys that the core names otherwise: Apex's name -> the core's.
    _APEX_KEYS: Dict[str, str] = {}
    #: Group keys of the core class that Apex's groups lacked.
    _FACE_KEYS: Tuple[str, ...] = ()
    #: Whether Apex's step advanced ``group["step"]`` of a group with no gradient too
    #: (FusedAdam's and FusedLAMB's: the count is the group's, advanced before the loop
    #: over its parameters), so that bias correction follows the optimizer's steps.
    _COUNTS_IDLE_GROUPS = False
    set_grad_none = True

    def _fused_dtype(self, p: Tensor) -> bool:
        return True

    def _check_unfused(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """What the fused step leaves to torch's implementation is refused: sparse
        gradients (as in Apex), and a group setting the fused ops take as a number but
        that holds a tensor (named, as Apex's kernels would have taken one: a number)."""
        where = type(self).__name__
        if not params:
            return
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{where} does not support sparse gradients")
        index = next((i for i, g in enumerate(self.param_groups) if g is group), None)
        where = f"{where}.step: param group {index}" if index is not None else f"{where}.step"
        for key in self._SCALAR_KEYS:
            values = group[key] if isinstance(group[key], tuple) else (group[key],)
            if any(isinstance(v, Tensor) for v in values):
                raise TypeError(f"{where}: expected {key} to be a float, got Tensor")
        raise ValueError(f"{where}: these settings need torch's implementation, which "
                         f"{type(self).__name__} does not take: differentiable="
                         f"{group.get('differentiable')!r}; expected the fused step's")

    def _set_apex_attribute(self, key: str, value: Any) -> None:
        """An Apex attribute set after construction (``opt.use_nvlamb = True``): Apex's
        step read it from the optimizer each time, so it applies to every param group
        (the core's group key ``key``) and to groups added later."""
        for holder in (self.defaults, *self.param_groups):
            holder[key] = value
        self.plans.invalidate()

    def _idle_group(self, group: Dict[str, Any], scaling) -> None:
        if self._COUNTS_IDLE_GROUPS:  # (as a step would: not when the scaler skips it)
            device = group["params"][0].device
            step, found_inf = self._group_step(group, device), self._scaling(device, scaling)[1]
            step.add_(1.0 if found_inf is None else found_inf.reshape(1) == 0)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Zeroes the gradients; ``set_to_none`` defaults to ``set_grad_none``."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @property
    def master_weights(self) -> bool:
        """Apex's spelling of ``master == "fp32"``; setting it (as ``amp.initialize``
        does) switches between "fp32" and "none"."""
        return self.master == "fp32"

    @master_weights.setter
    def master_weights(self, value: bool) -> None:
        if value or self.master == "fp32":
            self.configure(master="fp32" if value else "none")

    def _upgrade_group(self, saved: Dict[str, Any]) -> Dict[str, Any]:
        saved = dict(saved)
        for apex, core in self._APEX_KEYS.items():
            if apex in saved:
                saved.setdefault(core, saved.pop(apex))
        for key in self._FACE_KEYS:
            saved.setdefault(key, self.defaults[key])
        return super()._upgrade_group(saved)

    def __getstate__(self) -> Dict[str, Any]:
        return dict(super().__getstate__(), set_grad_none=self.set_grad_none)

    def step(self, closure=None):
        """One step of the core class; a param group whose ``lr`` is a negative number
        steps as in Apex (see :meth:`_negative_lr_step`)."""
        return self._negative_lr_step(lambda: super(_ApexFace, self).step(closure))

    def _negative_lr_step(self, run: Callable[[], Any],
                          outputs: Optional[List[Optional[List[Tensor]]]] = None) -> Any:
        """Runs ``run`` (the step) so that a group with a negative number as ``lr`` moves
        its parameters as Apex's kernels did, ``p -= lr * update`` with that lr: up the
        update. Apex checked ``lr`` only when built, and a schedule could go below zero
        afterwards (pytorch-pretrained-BERT's ``warmup_linear`` past its ``t_total``);
        the fused ops take ``lr >= 0`` only. Such a group steps at ``-lr`` and its
        update is then reversed: every update here is ``lr`` times a direction that does
        not depend on ``lr`` (the state advances the same), so the target becomes
        ``2 * before - after`` (to rounding; a skipped step stays put). The fp16 copies
        (the model parameters of fp32 masters, step's ``outputs``, a list per group)
        are written from it. Not with the bf16 master modes, whose targets carry
        hidden bits: a ValueError, nothing changed."""
        flipped = [i for i, g in enumerate(self.param_groups) if _negative_number(g.get("lr"))]
        if not flipped:
            return run()
        return self._flipped_step(run, flipped, outputs)

    @torch.no_grad()
    def _flipped_step(self, run: Callable[[], Any], flipped: List[int],
                      outputs: Optional[List[Optional[List[Tensor]]]]) -> Any:
        """_negative_lr_step's groups ``flipped`` (a negative lr) stepped and reversed."""
        if self.master in BF16_MODES:
            raise ValueError(f"{type(self).__name__}.step: param group {flipped[0]} has a "
                             f"negative lr ({self.param_groups[flipped[0]]['lr']}), which "
                             f"master={self.master!r} cannot apply (Apex had no such mode); "
                             "expected lr >= 0")
        before = []
        for i in flipped:
            for p in self.param_groups[i]["params"]:
                state = self.state.get(p)
                master = state.get("master_param") if state else None
                if master is not None:  # brought up to its parameter, as the step would
                    master = self.masters.get(p, state, self.precision)
                before.append((p, (p if master is None else master).detach().clone()))
        for i in flipped:
            self.param_groups[i]["lr"] = -self.param_groups[i]["lr"]
        try:
            result = run()
        finally:
            for i in flipped:
                self.param_groups[i]["lr"] = -self.param_groups[i]["lr"]
        for p, old in before:
            state = self.state.get(p)
            master = state.get("master_param") if state else None
            target = p if master is None else master
            # (through .data, as the fused update writes: no version bump)
            target.data.copy_(old.float().mul_(2).sub_(target.float()))
            if master is not None:
                p.data.copy_(master)
        for i in flipped:
            if outputs is not None and outputs[i] is not None:
                for p, out in zip(self.param_groups[i]["params"], outputs[i]):
                    out.data.copy_(p)
        return result


def _negative_number(lr: Any) -> bool:
    """A finite negative Python or numpy number (a tensor lr is the core's business)."""
    return isinstance(lr, (int, float)) and not isinstance(lr, bool) and \
        -math.inf < lr < 0


def _apex_attribute(key: str, to_apex: Callable[[Any], Any] = bool,
                    to_core: Callable[[Any], Any] = bool, doc: str = "") -> property:
    """An attribute that Apex's step read from the optimizer: the core's group setting
    ``key`` (of the defaults), as Apex's value; set, it sets every group's
    (:meth:`_ApexFace._set_apex_attribute`)."""
    return property(lambda self: to_apex(self.defaults[key]),
                    lambda self, value: self._set_apex_attribute(key, to_core(value)), doc=doc)


#: FusedAdam's and FusedLAMB's: 1 for decoupled weight decay (AdamW), 0 for L2.
_ADAM_W_MODE = _apex_attribute("decoupled_weight_decay", int, bool,
                               "Apex's attribute: 1 for decoupled weight decay, 0 for L2.")


class _AmsgradError(RuntimeError, ValueError):
    """``amsgrad=True`` given to an Apex face: Apex raised a RuntimeError there; a
    ValueError too, as mixedprec refuses a bad argument."""


def _check_apex(where: str, amsgrad: bool = False, **values: Any) -> None:
    """Apex's argument checks: numbers >= 0 (``lr`` also a one-element float tensor, as
    Apex's kernels took one and ``FusedAdam(capturable=True)`` made one), betas in
    [0, 1), no amsgrad."""
    if amsgrad:
        raise _AmsgradError(f"{where} does not support amsgrad; expected amsgrad=False")
    for name, value in values.items():
        if name == "betas":
            check_betas(where, value)
        elif name == "lr" and isinstance(value, Tensor):
            if value.numel() != 1 or not value.is_floating_point():
                raise TypeError(f"{where}: expected lr to be a float or a one-element float "
                                f"tensor, got a tensor of shape {tuple(value.shape)} and dtype "
                                f"{value.dtype}")
            check_nonnegative(where, name, float(value))  # sync-ok: read once, when built
        else:
            check_nonnegative(where, name, value)


class FusedSGD(_ApexFace, SGD):
    """SGD with momentum, dampening, Nesterov momentum and weight decay, fused over all
    parameters; ``torch.optim.SGD`` semantics (the first step's momentum buffer is the
    gradient), Apex's ``FusedSGD`` argument names.

    Args:
        params: parameters (fp32, fp16 or bf16) or param-group dicts.
        lr: learning rate; 1e-3 by default, as ``torch.optim.SGD`` (Apex required it),
            so that param groups that each set ``lr`` need no top-level one.
        momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        wd_after_momentum: Apex's option: add ``weight_decay * p`` to the step after
            the momentum update instead of to the gradient before it (False:
            ``torch.optim.SGD``'s order).
        materialize_master_grads: accepted for Apex compatibility, no effect. In Apex
            (under amp O2) it chose whether fp16 gradients were first copied into
            fp32 master gradients; here the step always reads the model's gradients
            directly (unscaling them in the same pass), and a master's ``.grad``
            only when one was set (see the module docstring).
        set_grad_none: what ``zero_grad()`` does by default (Apex's default: False).
        master_weights: keep fp32 masters of fp16/bf16 parameters in the state and
            update them; the parameters receive the cast masters. Apex's spelling of
            ``master="fp32"`` (True) or ``"none"`` (False); left out, ``master`` decides.
        master: (keyword) what is kept of each parameter's value (docs/lean-precision.md):
            ``"fp32"`` fp32 masters as above; ``"none"`` (the default) the parameters
            are updated directly, in fp32 math, rounded to nearest; ``"kahan"``
            each bf16 parameter with a bf16 compensation (``state["kahan_comp"]``)
            that carries what bf16 rounding dropped into the next update;
            ``"stochastic"`` bf16 parameters, no master: the fp32 result is
            rounded stochastically into the bf16 parameter (unbiased), with
            reproducible Philox bits keyed by the group's ``seed`` and a device step
            count ``group["step"]`` that this mode adds; ``"remainder"`` each bf16
            parameter with an int16 remainder (``state["remainder"]``), the low half
            of its fp32 master's bits: the master is kept exactly in 2 more bytes.
            With these three, fp32 parameters are updated directly and fp16 ones are a
            TypeError. A ``master_weights`` that disagrees is a ValueError.
        state_dtype: (keyword) torch.float32 (default) or torch.bfloat16, the
            momentum buffers' dtype (the math stays fp32), or torch.float8_e4m3fn:
            8-bit buffers with a power-of-two scale per block of 32
            (``momentum_buffer_scale``) for eligible parameters, fp32 for the others
            (:mod:`mixedprec.optim.state8`, docs/lean-precision.md).
        seed: (keyword) master='stochastic' only: the int in [0, 2**63) that group i's
            ``seed`` is ``seed + i`` of; default: drawn once, at construction, from
            torch's default CPU generator (``torch.manual_seed`` repeats it). The
            seeds are in the state_dict's param groups; a resumed run continues bit
            for bit.

    The arguments are in Apex's order (master_weights, which Apex's FusedSGD lacks,
    last; master and state_dtype keyword-only).

    A step skipped on the device (``found_inf`` set) still creates the momentum
    buffers of parameters stepped for the first time, as zeros. With ``dampening``
    0 the next step is then exactly torch.optim.SGD's first; with ``dampening`` d it
    starts the buffer at ``(1 - d) * grad`` instead of ``grad`` (torch's own
    ``SGD(fused=True)`` also creates its buffers before the skip is known).
    """

    @renamed(momentum_dtype="state_dtype")
    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False, master_weights: bool = False, *,
                 master: Optional[str] = None, state_dtype: torch.dtype = torch.float32,
                 seed: Optional[int] = None):
        _check_apex("FusedSGD", lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum requires a momentum > 0 and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.set_grad_none = bool(set_grad_none)
        Optimizer.__init__(self, params, defaults, master=_master_of(
            "FusedSGD", master_weights, master), state_dtype=state_dtype, seed=seed,
            unscale_grads=False)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update(wd_after_momentum=self.wd_after_momentum,
                     materialize_master_grads=self.materialize_master_grads)
        return state


class FusedAdam(_ApexFace, Adam):
    """Adam (``adam_w_mode=False``: L2 weight decay added to the gradient) and AdamW
    (``adam_w_mode=True``, the default: decoupled weight decay), fused over all
    parameters; ``torch.optim.Adam``/``AdamW`` math, Apex's ``FusedAdam`` argument
    names and defaults.

    Args:
        params: parameters (fp32, fp16 or bf16) or param-group dicts.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        bias_correction: apply Adam's bias correction.
        adam_w_mode: decoupled weight decay (AdamW) when True.
        amsgrad: not supported (an error that is a RuntimeError, as in Apex, and a
            ValueError).
        set_grad_none: what ``zero_grad()`` does by default (Apex's default: True).
        capturable: accepted for Apex compatibility; every step already runs without
            host synchronisation (the step count lives on the device).
        master_weights, master, seed: fp32 masters, none, Kahan compensations,
            stochastic rounding or remainders (see FusedSGD; the step count keying the
            bits is the group's ``step``).
        state_dtype: (keyword) torch.float32 (default) or torch.bfloat16, the dtype
            of both moments (the math stays fp32; docs/lean-precision.md), or
            torch.float8_e4m3fn: 8-bit moments for eligible parameters (see
            :class:`mixedprec.optim.Adam`).

    As in Apex, the step count belongs to the param group (``group["step"]``, a float32
    device tensor) rather than to each parameter: every parameter of a group is
    assumed to step together, and the count advances in every step, also for a group
    none of whose parameters has a gradient (not when a scaler skips the step). A
    group's parameters must share one device.

    Apex's 2019 surface (``apex.optimizers.FusedAdam`` of pytorch-pretrained-BERT), as
    keyword arguments: ``max_grad_norm`` (> 0: each group's gradients are clipped to
    that 2-norm, on the device, before the update), ``eps_inside_sqrt`` (only False:
    True is rejected, the fused op adds eps outside the square root), ``use_mt``
    (accepted: every step is multi-tensor) and ``amp_scale_adjustment`` (gradients are
    also divided by it while the optimizer is under ``mixedprec.amp``). ``step`` takes
    Apex's ``grads``, ``output_params``, ``scale`` and ``grad_norms`` (see
    :meth:`step`). The update is this class's Adam/AdamW: Apex's 2019 kernel applied
    weight decay and eps through the bias-corrected step size, which is the same only
    with ``bias_correction=False`` (as pytorch-pretrained-BERT used it).

    For subclasses written against Apex (fairseq's ``FusedAdamV2``):
    ``multi_tensor_adam`` (:func:`mixedprec.amp_C.multi_tensor_adam`),
    ``_dummy_overflow_buf`` (an int32 zero on the parameters' device) and
    ``adam_w_mode`` (1 or 0, from the defaults). A ``group["step"]`` such a subclass
    keeps as a Python int is accepted by this class's step and ``load_state_dict``.
    """

    _STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq", "kahan_comp", "remainder",
                   "exp_avg_scale", "exp_avg_sq_root", "exp_avg_sq_root_scale")
    _LEAN = True
    _APEX_KEYS = {"adam_w_mode": "decoupled_weight_decay"}
    _FACE_KEYS = ("decoupled_weight_decay",)
    _COUNTS_IDLE_GROUPS = True
    multi_tensor_adam = staticmethod(amp_C.multi_tensor_adam)  # Apex's attribute

    @renamed(moment_dtype="state_dtype")
    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False, *,
                 max_grad_norm: float = 0.0, eps_inside_sqrt: bool = False,
                 use_mt: bool = False, amp_scale_adjustment: float = 1.0,
                 master: Optional[str] = None, state_dtype: torch.dtype = torch.float32,
                 seed: Optional[int] = None):
        _check_apex("FusedAdam", amsgrad, lr=lr, eps=eps, weight_decay=weight_decay,
                    max_grad_norm=max_grad_norm, betas=betas)
        if eps_inside_sqrt:
            raise ValueError("FusedAdam: eps_inside_sqrt=True is not supported (the update "
                             "adds eps outside the square root); expected False")
        if not isinstance(use_mt, bool):
            raise TypeError(f"FusedAdam: expected use_mt to be a bool, got {use_mt!r}")
        self._amp_scale_adjustment = check_scale("FusedAdam", "amp_scale_adjustment",
                                                 amp_scale_adjustment)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, decoupled_weight_decay=bool(adam_w_mode),
                        capturable=capturable)
        if max_grad_norm > 0:  # (only then: checkpoints saved without it still load)
            defaults["max_grad_norm"] = float(max_grad_norm)
        self.set_grad_none = bool(set_grad_none)
        Optimizer.__init__(self, params, defaults, master=_master_of(
            "FusedAdam", master_weights, master), state_dtype=state_dtype, seed=seed,
            unscale_grads=False)

    adam_w_mode = _ADAM_W_MODE

    @property
    def _dummy_overflow_buf(self) -> Tensor:
        """Apex's no-op flag for ``multi_tensor_applier``: an int32 zero on the device of
        the first parameter, made once."""
        buf = self.__dict__.get("_overflow_buf")
        if buf is None:
            params = [p for g in self.param_groups for p in g["params"]]
            device = params[0].device if params else torch.device("cpu")
            buf = self.__dict__["_overflow_buf"] = torch.zeros(1, dtype=torch.int32,
                                                               device=device)
        return buf

    def __getstate__(self) -> Dict[str, Any]:
        return dict(super().__getstate__(), _amp_scale_adjustment=self._amp_scale_adjustment)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state.setdefault("_amp_scale_adjustment", 1.0)
        super().__setstate__(state)

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None,
             grad_norms=None):
        """One Adam step. With no Apex 2019 argument (and no ``max_grad_norm``), the
        fused path of :class:`mixedprec.optim.Adam`. Otherwise, per param group:

        * ``grads``: the gradients to use instead of ``p.grad`` (a list per group, or one
          list for a single group; a None entry falls back to ``p.grad``);
        * ``output_params``: tensors (e.g. the fp16 model copies of fp32 parameters)
          that receive the updated parameters, cast; a list per group, all or none;
        * ``scale``: the gradients are divided by it (a number > 0; default 1);
        * ``grad_norms``: per group, the 2-norm of the gradients as given (still
          multiplied by ``scale``); with ``max_grad_norm`` > 0 the gradients are clipped
          to it. Left out, the norms are computed on the device.

        Everything is checked before anything is updated. No host synchronisation.
        A negative ``lr`` steps as in Apex (:meth:`_negative_lr_step`)."""
        if output_params is not None:  # (a generator is read once, here)
            output_params = _per_group("FusedAdam.step", "output_params", output_params,
                                       len(self.param_groups))
        return self._negative_lr_step(lambda: self._apex_step(
            closure, grads, output_params, scale, grad_norms), output_params)

    def _apex_step(self, closure, grads, output_params, scale, grad_norms):
        legacy_args = (grads, output_params, scale, grad_norms)
        clipping = any(g.get("max_grad_norm", 0) > 0 for g in self.param_groups)
        adjusting = self._amp_scale_adjustment != 1.0 and hasattr(self, "_amp_stash")
        if all(a is None for a in legacy_args) and not clipping and not adjusting:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._legacy_work(*legacy_args)
        scaling = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        for group, items, outputs, norm in work:
            if items.params:
                self._legacy_group_step(group, items, outputs, norm, scale)
            elif group["params"]:
                self._idle_group(group, scaling)
        for _, items, _, _ in work:  # master gradients are used by one step
            for p in items.params:
                master = self.state[p].get("master_param")
                if master is not None:
                    master.grad = None
        self.plans.invalidate()
        count_applied(self, getattr(self, "found_inf", None))
        return loss

    def _legacy_work(self, grads, output_params, scale, grad_norms):
        """[(group, its Work, its output params or None, its given norm or None)] for
        step's Apex 2019 path; every argument checked before anything changes."""
        where = "FusedAdam.step"
        count = len(self.param_groups)
        grads = _per_group(where, "grads", grads, count)
        outputs = _per_group(where, "output_params", output_params, count)
        if scale is not None:
            check_scale(where, "scale", scale)
        if grad_norms is None:
            grad_norms = [None] * count
        grad_norms = list(grad_norms)
        if len(grad_norms) != count:
            raise ValueError(f"{where}: expected grad_norms to hold one norm per param group "
                             f"({count}), got {len(grad_norms)}")
        for norm in grad_norms:
            if norm is not None and not (isinstance(norm, (int, float)) and not isinstance(
                    norm, bool) or isinstance(norm, Tensor) and norm.numel() == 1):
                raise TypeError(f"{where}: expected grad_norms to hold numbers or one-element "
                                f"tensors, got {type(norm).__name__}")
        work = []
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            for name, given in (("grads", grads[gi]), ("output_params", outputs[gi])):
                if given is not None and len(given) != len(params):
                    raise ValueError(f"{where}: {name}[{gi}] holds {len(given)} tensors, param "
                                     f"group {gi} has {len(params)} parameters")
            items, outs = Work([], [], []), []
            for pi, p in enumerate(params):
                state = self.state.get(p)
                master = state.get("master_param") if state else None
                grad = grads[gi][pi] if grads[gi] is not None else None
                if grad is None:
                    grad = update_grad(p, master)
                if grad is None:
                    continue
                self._check_grad(grad, p, f"{where}: the gradient of parameter {pi} of group "
                                          f"{gi}")
                self.precision.check_param(where, p)  # (every group before any update)
                if grad.stride() != p.stride() and not mst.same_layout(grad, p):
                    grad = mst.follow_layout(grad, p)
                if outputs[gi] is not None:
                    out = outputs[gi][pi]
                    if not isinstance(out, Tensor) or out.dtype not in FLOAT_DTYPES or (
                            out.shape != p.shape or out.device != p.device):
                        raise ValueError(f"{where}: expected output_params[{gi}][{pi}] to be "
                                         f"a float tensor of shape {tuple(p.shape)} on "
                                         f"{p.device}, got {out!r:.80}")
                    if self.master_weights and mst.needs_master(p):
                        raise ValueError(f"{where}: output_params with master_weights=True "
                                         "(the masters' model copies are the parameters)")
                    if self.master in BF16_MODES:
                        raise ValueError(f"{where}: output_params with master="
                                         f"{self.master!r} (the bf16 parameters are updated, "
                                         "no copies)")
                    outs.append(out)
                items.params.append(p)
                items.grads.append(grad)
                items.states.append(state)
            devices = {p.device for p in items.params}
            if len(devices) > 1:
                raise ValueError(f"{where}: the parameters of a param group must share one "
                                 f"device, got {sorted(map(str, devices))}")
            work.append((group, items, outs if outputs[gi] is not None else None,
                         grad_norms[gi]))
        return work

    def _check_grad(self, grad: Any, p: Tensor, what: str) -> None:
        if not isinstance(grad, Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(grad).__name__}")
        if grad.is_sparse:
            raise RuntimeError(f"{what} is sparse; FusedAdam does not support sparse gradients")
        if grad.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{what} must be float32, float16 or bfloat16, got {grad.dtype}")
        if grad.shape != p.shape or grad.device != p.device:
            raise ValueError(f"{what} has shape {tuple(grad.shape)} on {grad.device}, its "
                             f"parameter {tuple(p.shape)} on {p.device}")

    def _legacy_group_step(self, group, items: Work, outputs, norm, scale) -> None:
        """One group's update on step's Apex 2019 path: gradients divided by ``scale``
        (and ``amp_scale_adjustment`` under amp), clipped to ``max_grad_norm``, all in
        the op's ``inv_scale`` on the device."""
        device = items.params[0].device
        for i, (p, state) in enumerate(zip(items.params, items.states)):
            if state is None:
                items.states[i] = self.state[p]
        inv_scale, found_inf = self._scaling(device, (getattr(self, "grad_scale", None),
                                                      getattr(self, "found_inf", None)))
        divisor = 1.0 if scale is None else float(scale)
        if hasattr(self, "_amp_stash"):
            divisor *= self._amp_scale_adjustment
        factor = inverse(torch.full((), divisor, dtype=torch.float64, device=device))
        factor = factor if inv_scale is None else inv_scale.reshape(()) * factor
        max_norm = group.get("max_grad_norm", 0.0)
        if max_norm > 0:
            if norm is None:  # the norm of the gradients as the update sees them
                total = ops.multi_tensor_l2norm(items.grads, factor.reshape(1))[0]
            else:  # Apex's convention: the norm of the gradients as given
                total = torch.as_tensor(norm, dtype=torch.float32).to(device).reshape(()) \
                    * factor
            # Apex's rule: clip only where (norm + 1e-6) / max_grad_norm > 1, so a NaN or
            # negative norm given clips nothing (a clamp made it NaN or flipped the update)
            total = total.reshape(()) + 1e-6
            factor = factor * torch.where(total > max_norm, max_norm / total, 1.0)
        calls = self._calls(group, device, items, outputs)  # (outputs: never lean)
        self._run_plan(group, calls, items.grads, factor.reshape(()), found_inf)

    def _check_devices(self, by_device: Dict[torch.device, Work]) -> None:
        self._one_device(by_device, "the group's step count lives there")

    def _steps(self, group, call: Work, device, used: List[Tensor], holders):
        # As in Apex, the step count belongs to the group; a second op call in one step
        # (fp32 params beside bf16 ones, precision.calls) advances a copy taken before the first.
        step = self._group_step(group, device)
        if any(step is u for u in used):
            step = step.clone()
        used.append(step)
        return [(list(range(len(call.params))), step)]

    def _calls(self, group, device, items: Work, outputs=None) -> tuple:
        """optim.Adam's op calls; ``outputs`` (step's Apex 2019 ``output_params``, never
        with the lean modes) replace the model copies."""
        calls = super()._calls(group, device, items)
        if outputs is not None:
            calls = tuple(call[:5] + (outputs,) + call[6:] for call in calls)
        return calls

    def _plan_holds(self, group, plan) -> bool:
        return super()._plan_holds(group, plan) and plan.lists[0][-1] is group.get("step")



class FusedAdagrad(_ApexFace, Adagrad):
    """Apex's ``FusedAdagrad`` arguments and defaults over :class:`mixedprec.optim.Adagrad`:
    ``sum += g * g; p -= lr * g / (sqrt(sum) + eps)``, the math of
    ``torch.optim.Adagrad`` with ``lr_decay=0`` and ``initial_accumulator_value=0``.

    Args:
        params: parameters (fp32, fp16 or bf16) or param-group dicts.
        lr, eps, weight_decay: as ``torch.optim.Adagrad`` (defaults 1e-2, 1e-10, 0).
        set_grad_none: what ``zero_grad()`` does by default (Apex's default: True).
        adagrad_w_mode: False (default): weight decay added to the gradient (L2, as
            torch); True: decoupled, ``lr * weight_decay * p`` added to the step (the
            core's ``decoupled_weight_decay``).
        master_weights: keep fp32 masters of fp16/bf16 parameters (see FusedSGD).

    The state is ``sum`` per parameter (float32, created as zeros at the parameter's
    first step) and torch's ``step``. Steps are unscaled and skipped on the device
    with a GradScaler, as FusedSGD's; ``p.grad`` is read, never written.
    """

    _APEX_KEYS = {"adagrad_w_mode": "decoupled_weight_decay"}
    _FACE_KEYS = ("lr_decay", "initial_accumulator_value", "foreach", "maximize",
                  "differentiable", "fused", "decoupled_weight_decay")

    def __init__(self, params: Iterable, lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, set_grad_none: bool = True,
                 adagrad_w_mode: bool = False, master_weights: bool = False):
        _check_apex("FusedAdagrad", lr=lr, eps=eps, weight_decay=weight_decay)
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adagrad_w_mode,
                         master=_master_of("FusedAdagrad", master_weights, None),
                         unscale_grads=False)

    def _check_unfused(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """Sparse gradients are refused, as in Apex; a group holding a tensor (an ``lr``
        written as one, which Apex's kernel took as a number) steps through torch's
        Adagrad, as :class:`mixedprec.optim.Adagrad` steps it."""
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        super(_ApexFace, self)._check_unfused(group, params)

    @property
    def adagrad_w_mode(self) -> bool:
        """Apex's attribute: decoupled weight decay (the core's decoupled_weight_decay)."""
        return bool(self.defaults["decoupled_weight_decay"])


class FusedNovoGrad(_ApexFace, NovoGrad):
    """Apex's ``FusedNovoGrad`` arguments, defaults and math over
    :class:`mixedprec.optim.NovoGrad`: Adam's first moment per element, a second moment
    per tensor from the norm of its gradient.

    Args:
        params: parameters (fp32, fp16 or bf16) or param-group dicts.
        lr, betas, eps, weight_decay: as Apex's (defaults 1e-3, (0.9, 0.999), 1e-8, 0).
        bias_correction, reg_inside_moment, grad_averaging, norm_type, init_zero: as
            :class:`mixedprec.optim.NovoGrad` (``reg_inside_moment`` is Apex's moment
            mode 0, its default False mode 1).
        amsgrad: not supported (a RuntimeError, as in Apex, and a ValueError).
        set_grad_none: what ``zero_grad()`` does by default (Apex's default: True).
        master_weights: keep fp32 masters of fp16/bf16 parameters (see FusedSGD).

    As in Apex, the step count and the second moments belong to the param group:
    ``group["step"]`` and ``group["exp_avg_sq"]``, one float32 vector with a value for
    each parameter of the group in order (Apex kept two, for its fp16 and fp32
    parameters), updated on the device, the first step's norms included (Apex read them
    on the host). The group's parameters must share one device.
    """

    _FACE_KEYS = ("reg_inside_moment",)

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False,
                 grad_averaging: bool = True, norm_type: int = 2, init_zero: bool = False,
                 set_grad_none: bool = True, master_weights: bool = False):
        _check_apex("FusedNovoGrad", amsgrad, lr=lr, eps=eps, weight_decay=weight_decay,
                    betas=betas)
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, grad_averaging=grad_averaging,
                         reg_inside_moment=bool(reg_inside_moment), norm_type=norm_type,
                         init_zero=init_zero,
                         master=_master_of("FusedNovoGrad", master_weights, None),
                         unscale_grads=False)

    moment_mode = _apex_attribute("reg_inside_moment", lambda v: 0 if v else 1, lambda v: not v,
                                  "Apex's attribute: 0 with ``reg_inside_moment``, else 1.")
    reg_inside_moment = _apex_attribute("reg_inside_moment")


class FusedLAMB(_ApexFace, LAMB):
    """Apex's ``FusedLAMB`` arguments, defaults and math over
    :class:`mixedprec.optim.LAMB` (see there): Adam's moments give an update ``u`` per
    parameter, and each parameter moves by ``lr * ||p|| / ||u||`` times ``u``, after
    the gradients are divided by ``max(1, norm / max_grad_norm)``.

    Args:
        params: parameters (fp32, fp16 or bf16) or param-group dicts.
        lr, betas, eps, weight_decay, bias_correction: as Apex's ``FusedLAMB``.
        adam_w_mode: decoupled weight decay when True (Apex's default; the core's
            ``decoupled_weight_decay``).
        grad_averaging: weight the gradient by ``1 - beta1`` in the first moment.
        max_grad_norm: the global gradient norm above which gradients are scaled down
            (``self.defaults["max_grad_norm"]``, as in Apex); 0 turns clipping off
            (Apex would then zero the gradients).
        use_nvlamb: apply the trust ratio to parameters without weight decay too.
        amsgrad: not supported (a RuntimeError, as in Apex, and a ValueError).
        set_grad_none: what ``zero_grad()`` does by default (Apex's default: True).
        master_weights: keep fp32 masters of fp16/bf16 parameters (see FusedSGD).

    Differences from Apex: the update is kept in a scratch buffer, so gradients are
    read and never written (Apex overwrote them with the update, rounded to their
    dtype); the step count is a float32 device tensor in ``group["step"]``, which a
    step skipped on overflow does not advance (every other step does, as in Apex, for a
    group without gradients too); bf16 parameters and mixed dtypes in a
    group work; all parameters must share one device. Moments are float32.
    """

    _APEX_KEYS = {"adam_w_mode": "decoupled_weight_decay"}
    _COUNTS_IDLE_GROUPS = True

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0,
                 use_nvlamb: bool = False, master_weights: bool = False):
        _check_apex(type(self).__name__, amsgrad, lr=lr, eps=eps, weight_decay=weight_decay,
                    max_grad_norm=max_grad_norm, betas=betas)
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, grad_averaging=grad_averaging,
                         max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb,
                         decoupled_weight_decay=adam_w_mode,
                         master=_master_of(type(self).__name__, master_weights, None),
                         unscale_grads=False)


    adam_w_mode = _ADAM_W_MODE

    use_nvlamb = _apex_attribute("use_nvlamb")


class FusedMixedPrecisionLamb(FusedLAMB):
    """Apex's ``FusedMixedPrecisionLamb``: :class:`FusedLAMB` with fp32 masters of
    fp16/bf16 parameters (``master_weights=True``), with Apex's arguments.

    Args:
        lr: a float, or a one-element float tensor, kept as ``group["lr"]`` (as Apex
            kept it; ``group["lr"].fill_(x)`` and LR schedulers change it on the
            device).
        step: the step count the param groups start from (Apex's ``step``).
        reduced_precision_dtype: accepted (None, torch.float16 or torch.bfloat16);
            every fp16/bf16 parameter gets an fp32 master whatever its value (Apex
            kept masters only for parameters of that dtype, and updated the others in
            their own dtype).
        the others: as :class:`FusedLAMB` (Apex's defaults).

    Gradient scaling comes as for every mixedprec optimizer, from ``torch.amp`` or
    ``mixedprec.GradScaler`` through ``scaler.step(optimizer)`` (the scaler's
    ``grad_scale`` and ``found_inf``); Apex's ``step(grad_scaler=...)`` argument is not
    taken (torch's GradScaler would then pass itself instead of those attributes).
    The gradient norm is of the unscaled gradients, compared with ``max_grad_norm``
    (Apex compared the scaled norm with ``max_grad_norm * scale``: the same test).
    """

    def __init__(self, params: Iterable, lr=1e-3, step: int = 0, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 reduced_precision_dtype: Optional[torch.dtype] = None):
        if reduced_precision_dtype not in (None, torch.float16, torch.bfloat16):
            raise TypeError("expected reduced_precision_dtype to be None, torch.float16 or "
                            f"torch.bfloat16, got {reduced_precision_dtype}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"expected step to be an int >= 0, got {step!r}")
        self.reduced_precision_dtype = reduced_precision_dtype
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adam_w_mode=adam_w_mode,
                         grad_averaging=grad_averaging, set_grad_none=True,
                         max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb,
                         master_weights=True)
        # A number until a group's first step makes it a device tensor.
        self.defaults["step"] = step
        for group in self.param_groups:
            group.setdefault("step", step)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update(reduced_precision_dtype=self.reduced_precision_dtype)
        return state
