"""Apex's ``amp`` API on mixedprec: ``initialize``, ``scale_loss``, ``master_params``,
``state_dict``/``load_state_dict`` and the function-cast registry.

What differs from Apex:

* O1 runs the forward under ``torch.autocast`` instead of patching torch globally.
  ``cast_model_type=torch.bfloat16`` selects bf16 (autocast at O1, weights at O2/O3)
  with a static loss scale of 1.0 by default. ``MIXEDPREC_HALF_DTYPE=bfloat16`` makes the
  opt levels' fp16 (and ``init``'s) bf16 for an unmodified script, its loss scaling
  unchanged (see ``fp16_utils.half_dtype``).
* ``initialize`` returns the user's own models with, as in Apex, an instance attribute
  ``model.forward`` wrapping the original with amp's casts (O1: autocast; O2/O3: inputs
  to the model's dtype; outputs to ``cast_model_outputs``, default fp32). It may be
  called again for new models and optimizers, and replaces a wrapper, never nests it.
* Fused optimizers keep fp32 masters and take the scale and overflow flag as
  ``grad_scale``/``found_inf`` (as from ``torch.amp.GradScaler``): no host reads. Other
  optimizers get fp32 masters (O2) and step hooks that read the flag once a step.
* ``min_loss_scale`` defaults to ``DEFAULT_MIN_SCALE`` (2**-24, not 0 as in Apex).
* ``state_dict`` also carries non-fused O2 master weights (a resumed run continues bit
  for bit); ``load_state_dict`` applies all of it or none.
* Overflows (logger ``mixedprec.amp``, without a host read in a step), by ``verbosity``:
  0 nothing; 1 (the default) one summary at exit when steps were skipped (skipped
  steps, the scale's range, backoffs and growths), where Apex printed a line per
  skipped step; 2 also a line per skipped step as Apex's ("Gradient overflow: skipping
  step, loss scaler 0 reducing the loss scale to X"), rate limited. With the
  keyword-only ``overflow_report=True`` the summary also names the parameters whose
  gradients overflowed most (counting per parameter costs one per-tensor L2-norm pass
  over the gradients a step, 8-15% of an optimizer step on the CPU, so it is opt-in).
  :func:`overflow_report` reads the counts any time.
"""

import atexit
import contextlib
import functools
import itertools
import logging
import math
import time
import types
import warnings
import weakref
from collections import deque
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch
from torch import Tensor, nn

from .. import grads
from .. import masters as _masters
from ..loss_scale import DEFAULT_MIN_SCALE, LossScale, check_scale, inverse
from ..optim import BF16_MODES, MASTER_MODES, STATE_DTYPES, Optimizer
from ..overflow import OverflowReport, format_report
from .fp16_utils import convert_network, half_dtype
from .parallel import LARC

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "half_function", "float_function", "promote_function", "register_half_function",
    "register_float_function", "register_promote_function", "disable_casts",
    "init", "AmpHandle", "NoOpHandle", "overflow_report",
]

logger = logging.getLogger("mixedprec.amp")

# Apex's opt levels.
_OPT_LEVELS: Dict[str, Dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


class Properties:
    """The resolved options of one ``initialize`` call, validated as Apex did."""

    def __init__(self, opt_level: str, overrides: Dict[str, Any],
                 half: torch.dtype = torch.float16):
        if opt_level not in _OPT_LEVELS:
            raise ValueError(
                f"amp.initialize: unexpected opt_level {opt_level!r}; options are 'O0', 'O1', "
                "'O2', 'O3' (the prefix is the letter O, not the number zero)")
        self.opt_level = opt_level
        # `half`: the opt levels' 16-bit dtype (O1's autocast, O2/O3's weights), float16
        # unless MIXEDPREC_HALF_DTYPE says otherwise; a cast_model_type given overrides it.
        self.half_dtype = half
        self.options = dict(_OPT_LEVELS[opt_level], cast_model_outputs=None, master=None,
                            state_dtype=None)
        if self.options["cast_model_type"] is torch.float16:
            self.options["cast_model_type"] = half
        bf16 = overrides.get("cast_model_type") is torch.bfloat16
        if bf16 and overrides.get("loss_scale") is None and opt_level != "O0":
            self.options["loss_scale"] = 1.0  # bf16 has fp32's range: no scaling needed
        for name, value in overrides.items():
            if value is not None and name not in ("master", "state_dtype"):
                self._set(name, value)
        self._set_lean(overrides.get("master"), overrides.get("state_dtype"),
                       overrides.get("master_weights"))
        vars(self).update(self.options)

    def _set_lean(self, master: Any, state_dtype: Any, master_weights: Any) -> None:
        """mixedprec's ``master`` (what is kept of each 16-bit weight's value, see
        docs/lean-precision.md) and ``state_dtype`` (of the optimizer's moments and
        momentum), beside Apex's options. ``master`` applies to the cast weights of O2
        and O3 and decides ``master_weights`` ("fp32": True; the others False);
        "kahan", "stochastic" and "remainder" need them in bfloat16."""
        if state_dtype is not None and state_dtype not in STATE_DTYPES:
            raise ValueError("amp.initialize: state_dtype must be torch.float32, "
                             f"torch.bfloat16 or torch.float8_e4m3fn, got {state_dtype!r}")
        self.options["state_dtype"] = state_dtype
        if master is None:
            return
        if not isinstance(master, str) or master not in MASTER_MODES:
            raise ValueError(f"amp.initialize: master must be one of {list(MASTER_MODES)}, "
                             f"got {master!r}")
        if self.opt_level in ("O0", "O1"):
            raise ValueError(f"amp.initialize: master={master!r} is for the 16-bit weights of "
                             f"opt_level O2 or O3; with {self.opt_level} the weights stay "
                             "fp32 (their own masters)")
        if master in BF16_MODES and self.options["cast_model_type"] is not torch.bfloat16:
            raise ValueError(f"amp.initialize: master={master!r} keeps bfloat16 weights; "
                             "expected cast_model_type=torch.bfloat16, got "
                             f"{self.options['cast_model_type']}")
        if master_weights is not None and self.options["master_weights"] != (master == "fp32"):
            raise ValueError(f"amp.initialize: master_weights={master_weights!r} conflicts "
                             f"with master={master!r} (master='fp32' is master_weights=True, "
                             "the other modes False); give one of them")
        self.options["master"] = master
        self.options["master_weights"] = master == "fp32"

    def _set(self, name: str, value: Any) -> None:
        o1 = self.opt_level == "O1"
        if name in ("cast_model_type", "cast_model_outputs"):
            if value not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"amp.initialize: {name} must be torch.float32, "
                                 f"torch.float16 or torch.bfloat16, got {value!r}")
            if name == "cast_model_type" and o1 and value is torch.float16:
                raise ValueError("amp.initialize: with opt_level O1 the model weights stay fp32 "
                                 "(casts are inserted around functions), so cast_model_type="
                                 "torch.float16 is rejected; use O2 or O3 to cast the model, "
                                 "or torch.bfloat16 for bf16 autocast at O1")
        elif name in ("patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
            if value in ("True", "False"):  # as Apex accepted
                value = value == "True"
            if not isinstance(value, bool):
                raise ValueError(f"amp.initialize: {name} must be True, False, 'True', "
                                 f"'False' or None, got {value!r}")
            if name == "patch_torch_functions" and value and not o1:
                raise ValueError("amp.initialize: patch_torch_functions=True is only valid "
                                 "with opt_level='O1'")
            if name != "patch_torch_functions" and o1:
                raise ValueError(f"amp.initialize: with opt_level O1 the weights (batchnorm "
                                 f"included) stay fp32, so {name} must be None, got {value!r}")
        elif name == "loss_scale" and value != "dynamic":
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError("amp.initialize: loss_scale must be 'dynamic' or a "
                                 f"number, got {value!r}") from None
            value = check_scale("amp.initialize", "loss_scale", value)
        self.options[name] = value

    def __repr__(self) -> str:
        return f"Properties(opt_level={self.opt_level!r}, {self.options})"


class LossScaler:
    """Apex's loss scaler of one loss (``loss_scale()``, ``dynamic``, ``state_dict``
    entries ``loss_scale`` and ``unskipped``), a face on :class:`LossScale`. Dynamic
    with Apex's rule: start at ``min(2**16, max_loss_scale)``, halve on overflow,
    double after 2000 clean steps, within [``min_loss_scale``, ``max_loss_scale``]."""

    def __init__(self, loss_scale: Any, min_loss_scale: Optional[float] = None,
                 max_loss_scale: float = 2.0**24, init_scale: float = 2.0**16,
                 scale_window: int = 2000):
        self.dynamic = loss_scale == "dynamic"
        floor = DEFAULT_MIN_SCALE if min_loss_scale is None else min_loss_scale
        # Apex starts at min(init, max); a floor above that start raises the start.
        start = max(min(init_scale, max_loss_scale), floor) if self.dynamic else loss_scale
        self.core = LossScale(start, dynamic=self.dynamic, growth_factor=2.0,
                              backoff_factor=0.5, growth_interval=scale_window,
                              min_scale=floor, max_scale=max_loss_scale, owner="amp")
        self._has_overflow = False

    def loss_scale(self) -> float:
        """The current scale as a Python float (reads the device)."""
        return self.core.get()

    def update(self, found_inf: Tensor) -> None:
        self.core.update(found_inf)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickles mixedprec's scaler or Apex's (``apex.amp.scaler.LossScaler``, which
        Apex's ``FP16_Optimizer`` pickled into its state dict): Apex's scale, bounds,
        window and ``_unskipped`` count become this scaler's."""
        if "_loss_scale" not in state:
            self.__dict__.update(state)
            return
        dynamic = bool(state.get("dynamic"))
        LossScaler.__init__(self, "dynamic" if dynamic else state["_loss_scale"],
                            state.get("_min_loss_scale"), state.get("_max_loss_scale", 2.0**24),
                            scale_window=state.get("_scale_seq_len", 2000))
        if dynamic:
            self.core.load(float(state["_loss_scale"]), int(state.get("_unskipped", 0)))

    # -- Apex's internals that scripts touch (NVIDIA's BERT and GNMT, ...) ----------------
    @property
    def _loss_scale(self) -> float:
        """Apex's attribute: reads the scale on the device; a write sets it there, and the
        next ``scale_loss`` uses it (a number, finite and > 0)."""
        return self.core.get()

    @_loss_scale.setter
    def _loss_scale(self, value: Any) -> None:
        self.core.set(value)

    @property
    def _unskipped(self) -> int:
        """Apex's count of steps since the last overflow or growth (reads the device)."""
        return self.core.trackers()["growth_tracker"]

    # Apex's settings, which scripts write after initialize (NVIDIA's GNMT sets
    # _scale_seq_len, a float from argparse): checked, then the scale's own settings.
    _min_loss_scale = property(  # (None: the default floor, as initialize takes it)
        lambda self: self.core.min_scale,
        lambda self, value: self.core.configure(
            min_scale=DEFAULT_MIN_SCALE if value is None else value))
    _max_loss_scale = property(lambda self: self.core.max_scale,
                               lambda self, value: self.core.configure(max_scale=value))

    @property
    def _scale_seq_len(self) -> int:
        """Apex's growth window: the steps without overflow after which the scale grows
        (the scale's ``growth_interval``); a write may be a whole float, as Apex's."""
        return self.core.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: Any) -> None:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("amp: expected _scale_seq_len (the loss scaler's growth window) "
                             f"to be a whole number >= 1, got {value!r}")
        self.core.configure(growth_interval=value)

    @property
    def _overflow_buf(self) -> Tensor:
        """Apex's int32 overflow flag, which :meth:`update_scale` reads (scripts hand it to
        ``amp_C`` kernels, or replace it with their own); zeroed by
        :meth:`clear_overflow_state`. ``scale_loss`` keeps its own flag."""
        buf = self.__dict__.get("_buf")
        if buf is None:
            device = self.core.scale.device if self.core.scale is not None else "cpu"
            buf = self.__dict__["_buf"] = torch.zeros(1, dtype=torch.int32, device=device)
        return buf

    @_overflow_buf.setter
    def _overflow_buf(self, value: Tensor) -> None:
        if not isinstance(value, Tensor) or value.numel() != 1:
            raise TypeError("amp: expected _overflow_buf to be a one-element tensor, got "
                            f"{value!r:.60}")
        self.__dict__["_buf"] = value

    def clear_overflow_state(self) -> None:
        """Apex's method: clears ``_has_overflow`` and zeroes ``_overflow_buf``."""
        self._has_overflow = False
        self._overflow_buf.zero_()

    def update_scale(self) -> bool:
        """Apex's method: one step of the dynamic rule from ``_overflow_buf`` (or
        ``_has_overflow``), on the device; returns whether the step should be skipped
        (always False for a static scale). Differs from Apex: the update consumes
        ``_has_overflow`` (Apex kept it set until ``clear_overflow_state``, which a
        script accumulating with ``delay_unscale=True`` never reached: every later step
        was skipped)."""
        if not self.dynamic:
            return False
        buf = self._overflow_buf
        device = self.core.scale.device if self.core.scale is not None else buf.device
        found = (buf.reshape(1) != 0).to(device, torch.float32)
        if self._has_overflow:
            found.fill_(1.0)
        self.core.update(found)
        self._has_overflow = False
        return bool(found.item())  # sync-ok: Apex returns a bool here

    def state_dict(self) -> Dict[str, Any]:
        return {"loss_scale": self.core.get(),
                "unskipped": self.core.trackers()["growth_tracker"]}

    def load_state_dict(self, sd: Dict[str, Any], key: str = "the state",
                        check_only: bool = False) -> None:
        """A bad entry raises ValueError naming ``key`` (and a key missing from it);
        ``check_only``: only checks."""
        if not isinstance(sd, dict):
            raise ValueError(f"amp.load_state_dict: expected {key} to be a dict with "
                             "'loss_scale' and 'unskipped' (as amp.state_dict() saves it), got "
                             f"{type(sd).__name__}")
        missing = [name for name in ("loss_scale", "unskipped") if name not in sd]
        if missing:
            raise ValueError(f"amp.load_state_dict: {key} has no {missing[0]!r}; expected "
                             f"'loss_scale' and 'unskipped' (as amp.state_dict() saves them), "
                             f"got the keys {list(sd)}")
        try:
            self.core.load(sd["loss_scale"], sd["unskipped"], check_only=check_only)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"amp.load_state_dict: expected {key} to be a dict with "
                             "'loss_scale' (finite, > 0) and 'unskipped' (an int >= 0), got "
                             f"{sd!r}: {err}") from None


class _OverflowReporter:
    """Logs skipped steps, at most once per ``interval`` seconds (counting the skips in
    between), from flags copied to the host asynchronously and read once copied."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self.pending: deque = deque()
        self.suppressed = 0
        self.last_log = -float("inf")

    def record(self, loss_id: int, found_inf: Tensor, scale: Tensor) -> None:
        if not logger.isEnabledFor(logging.WARNING):
            return
        values = torch.cat([found_inf.reshape(1), scale.reshape(1)])
        event = None
        if values.is_cuda:
            values = torch.empty(2, dtype=values.dtype, pin_memory=True).copy_(
                values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending.append((loss_id, values, event))
        while self.pending and (self.pending[0][2] is None or self.pending[0][2].query()):
            loss_id, values, _ = self.pending.popleft()
            found_inf, scale = values.tolist()  # sync-ok: host memory, copy already complete
            if found_inf == 0:
                continue
            now = time.monotonic()
            if now - self.last_log < self.interval:
                self.suppressed += 1
                continue
            more = f" ({self.suppressed} more since the last message)" if self.suppressed else ""
            logger.warning("Gradient overflow: skipping step, loss scaler %d reducing the loss "
                           "scale to %g%s", loss_id, scale, more)
            self.suppressed, self.last_log = 0, now


class _AmpState:
    """What one ``initialize`` call set up."""

    def __init__(self, props: Properties, scalers: List[LossScaler], verbosity: int = 1,
                 names: Any = None, per_param: bool = False):
        self.props = self.opt_properties = props  # Apex's name, read by legacy scripts
        self.loss_scalers = scalers
        self.optimizers: List["_OptimizerAmp"] = []
        self.verbosity = verbosity
        self.reporter = _OverflowReporter()  # verbosity 2: a line per skipped step
        self.overflow = OverflowReport(names, owner="amp")
        self.per_param = per_param  # overflow_report=True: counts per parameter
        if verbosity >= 1:
            ref = weakref.ref(self)
            atexit.register(lambda: ref() is not None and ref().log_summary())

    def log_summary(self) -> None:
        """Logs the overflow summary once, if any step was skipped (verbosity >= 1, at
        exit)."""
        report = self.overflow.report()
        if report["skipped"] and logger.isEnabledFor(logging.WARNING):
            logger.warning("amp: %s", format_report(report))


def _unscale(params: List[Tensor], masters: Dict[Tensor, Tensor], found_inf: Tensor,
             scale: Tensor, accumulate: bool = False) -> None:
    """Unscales the gradients of ``params`` into their fp32 ``masters`` (dropping the
    model's), the others in place; an overflow sets ``found_inf``."""
    inv_scale = inverse(scale)
    halves = [p for p in params if p in masters]
    _masters.unscale_into_masters(halves, [masters[p] for p in halves], found_inf,
                                  inv_scale, accumulate=accumulate)
    for p in halves:
        p.grad = None
    grads.unscale_([p.grad for p in params if p not in masters], found_inf, inv_scale)


class _OptimizerAmp:
    """amp's bookkeeping for one optimizer between two steps.

    ``found_inf``: the overflow flag of the gradients gathered since the last step
    (None: no ``scale_loss`` exit since then). ``carried``: the scale the model
    gradients carry (None: unscaled, or none gathered). ``delayed``: the loss id of a
    ``delay_unscale`` exit whose gradients are still scaled and unchecked. ``stash``:
    the gradients set aside during one loss's backward, at scale ``stash_scale``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: _AmpState,
                 masters: Dict[Tensor, Tensor]):
        self.optimizer = weakref.ref(optimizer)
        self.state = state
        self.fused = isinstance(optimizer, Optimizer)
        self.masters = masters  # model param -> fp32 master (non-fused O2 only)
        self.model_of = {m: p for p, m in masters.items()}
        self.versions: Dict[Tensor, int] = {}  # model param -> its version its master has
        self.masters_follow()
        self.found_inf = self.carried = self.delayed = self.stash_scale = None
        self.decides = True  # False after a delay_overflow_check exit: the script skips
        self.stash: List[Optional[Tensor]] = []
        self.skip = False
        if not self.fused:
            _guard_step(optimizer, self._should_skip, self._follow_model)
        optimizer.register_step_post_hook(self._after_step)
        optimizer._amp_stash = _AmpStash(self)
        state.optimizers.append(self)
        _optimizer_amp[optimizer] = self

    def model_params(self) -> List[Tensor]:
        """The parameters whose gradients backward writes (the model's, not masters)."""
        return [self.model_of.get(p, p) for g in self.optimizer().param_groups
                for p in g["params"]]

    def masters_follow(self) -> None:
        """Records that the masters hold their model parameters' values as they are now."""
        self.versions = {p: p._version for p in self.masters}

    def _follow_model(self) -> None:
        """Non-fused O2, before a step: a master whose model parameter was written since
        (``model.load_state_dict`` after ``initialize``, an in-place edit under
        ``torch.no_grad()``) takes the values written, as Apex's masters, made at the first
        ``scale_loss``, took the model's weights of then; stale, the step would write the
        old weights back into the model."""
        for p, master in self.masters.items():
            if p._version != self.versions.get(p):
                # (the elements that still hold the master's rounding keep its fp32 value:
                # DDP's first broadcast, a load of the same weights change nothing)
                _masters.retake_master(master.data, p.data)
                self.versions[p] = p._version

    def _should_skip(self) -> bool:
        """Non-fused only, before the step: whether the gradients overflowed. A skipped
        step does not run at all (any optimizer, even one that would update without
        gradients); its gradients are dropped and amp's bookkeeping is reset."""
        flag = self.found_inf if self.decides else None
        self.skip = flag is not None and flag.item() != 0  # sync-ok: once a step, as Apex
        if self.skip:
            optimizer = self.optimizer()
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                p.grad = None
            self.found_inf = self.carried = self.delayed = None
        return self.skip

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.fused:  # used by one step, as torch.amp.GradScaler does
            for name in ("grad_scale", "found_inf"):
                if hasattr(optimizer, name):
                    delattr(optimizer, name)
        elif self.masters and not self.skip:
            _masters.copy_to_model(list(self.masters.values()), list(self.masters))
            self.masters_follow()
        # As Apex's O2 step: the masters' gradients are used by one step. model.zero_grad()
        # (transformers' Trainer) never reaches them; kept, they would add up over steps.
        for master in self.step_masters(optimizer):
            master.grad = None
        self.found_inf = self.carried = self.delayed = None

    def step_masters(self, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
        """The fp32 masters of the cast parameters: amp's (torch optimizers) or those in a
        fused optimizer's state (whose step reads a master's ``.grad`` when set)."""
        if not self.fused:
            return iter(self.masters.values())
        if not getattr(optimizer, "master_weights", False):  # (O1, O3: no masters to visit)
            return iter(())
        state = optimizer.state
        return (s["master_param"] for s in (state.get(p) for g in optimizer.param_groups
                                             for p in g["params"])
                if s and s.get("master_param") is not None)

    def before_backward(self, loss_id: int) -> None:
        """Sets aside the gradients gathered since the last step, so that this loss's
        overflow check and unscale see only its own; not after a ``delay_unscale`` exit
        of the same loss, whose gradients carry this loss's scale."""
        stashing = self.found_inf is not None and self.delayed != loss_id
        params = self.model_params() if stashing else []
        self.stash, self.stash_scale = [p.grad for p in params], self.carried
        for p in params:
            p.grad = None

    def restore(self, to_scale: Optional[Tensor]) -> None:
        """Adds the gradients set aside back, first rescaled to ``to_scale`` (None:
        unscaled); an overflow there counts for the step, not for this loss's scaler."""
        stash = [(p, old) for p, old in zip(self.model_params(), self.stash) if old is not None]
        if stash and (to_scale is not None or self.stash_scale is not None):
            flag = self.found_inf  # not None: a stash exists only after an exit
            one = torch.ones((), dtype=torch.float32, device=flag.device)
            factor = (one if to_scale is None else to_scale) / (
                one if self.stash_scale is None else self.stash_scale)
            grads.unscale_([old for _, old in stash], flag, factor)
        for p, old in stash:
            p.grad = old if p.grad is None else p.grad.add_(old)
        self.stash, self.stash_scale = [], None

    def abandon(self) -> None:
        """After an exception in ``scale_loss``: the gradients set aside come back."""
        for p, old in zip(self.model_params(), self.stash):
            p.grad = old

    def after_backward(self, scale: Tensor, found_inf: Tensor, check: bool) -> None:
        """Checks this loss's new gradients for overflow into ``found_inf`` (unless
        ``check`` is False: a static scale, which never skips); unscales them (into the
        masters at O2) unless the optimizer is fused (its update does)."""
        params = [p for p in self.model_params() if p.grad is not None]
        if check and self.state.per_param:  # (before any unscale)
            self.state.overflow.record_grads(params, [p.grad for p in params],
                                             inverse(scale))
        if self.fused:
            if check:  # bf16 at a static scale of 1 reads no gradient here
                grads.check_finite_([p.grad for p in params], found_inf)
            self.carried = scale
        else:  # O2: added to the master gradients of an earlier loss
            _unscale(params, self.masters, found_inf, scale, accumulate=True)
            self.carried = None
        self.restore(self.carried)

    def add_flag(self, found_inf: Optional[Tensor], device: torch.device,
                 decides: bool = True) -> None:
        """Joins one loss's overflow flag (None: a static scale, which never skips).
        ``decides`` False (``delay_overflow_check``): the flag skips no step, the script
        checks and skips itself; the flag then starts again at 0."""
        if self.found_inf is None or not decides:
            self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if found_inf is not None:
            self.found_inf.add_(found_inf)
        self.decides = decides
        if self.fused:  # the one channel to it, as torch.amp.GradScaler uses it
            opt = self.optimizer()
            opt.grad_scale, opt.found_inf = self.carried, self.flag()

    def flag(self) -> Optional[Tensor]:
        """The overflow flag that skips the step on the device (None: none skips it)."""
        return self.found_inf if self.decides else None

    def unscale_for_clipping(self) -> None:
        """``master_params`` of a fused optimizer: unscales the gradients now, into its
        fp32 masters' ``.grad`` (which its update then reads); ``grad_scale`` is None."""
        if self.carried is None or self.delayed is not None:
            return
        opt = self.optimizer()
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        masters = {p: opt.state[p]["master_param"] for p in params
                   if "master_param" in opt.state.get(p, {})}
        _unscale(params, masters, self.found_inf, self.carried)
        self.carried = None
        opt.grad_scale, opt.found_inf = None, self.flag()


def _unwrap(optimizer: Any, where: str) -> torch.optim.Optimizer:
    """The optimizer amp keeps the books of: ``optimizer``, or the one a ``LARC`` wraps
    (Apex's amp took a LARC in place of an optimizer)."""
    inner = optimizer.optim if isinstance(optimizer, LARC) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"{where}: expected optimizers to be a torch.optim.Optimizer (or a LARC "
                        f"around one) or a list of them, got {type(optimizer).__name__}")
    return inner


def _larc_steps_unscaled(larc: LARC, amp: "_OptimizerAmp") -> None:
    """A LARC around a fused optimizer adapts unscaled gradients, as under Apex's amp:
    its step first unscales them (into the fp32 masters' ``.grad`` at O2), as
    ``master_params`` does; the fused step then reads no scale. Other optimizers'
    gradients are unscaled at ``scale_loss``'s exit already."""
    larc._amp_stash = amp.optimizer()._amp_stash
    if not amp.fused:
        return
    original = larc.step

    def step(self, *args: Any, **kwargs: Any) -> Any:
        amp.unscale_for_clipping()
        return original(*args, **kwargs)

    larc.step = types.MethodType(step, larc)


def _guard_step(optimizer: torch.optim.Optimizer, should_skip, before=None) -> None:
    """Makes ``optimizer.step()`` return None without running when ``should_skip()``
    says so, and call ``before()`` (if given) first otherwise: an instance attribute, a bound
    method as torch's LR schedulers expect (they wrap ``optimizer.step.__func__``), as
    Apex's amp replaced ``step`` too."""
    original = optimizer.step

    def step(opt, *args: Any, **kwargs: Any) -> Any:
        if should_skip():
            return None
        if before is not None:
            before()
        return original(*args, **kwargs)

    if getattr(original, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # a scheduler built before amp still counts steps
    optimizer.step = types.MethodType(step, optimizer)


class _AmpStash:
    """``optimizer._amp_stash`` as Apex's amp kept it, for scripts that read it (NVIDIA's
    BERT clears ``all_fp32_from_fp16_params``' gradients after an overflow): the
    parameter lists per group and flattened, from amp's current bookkeeping."""

    lazy_init_called = True
    already_patched = False

    def __init__(self, amp: "_OptimizerAmp"):
        self._amp = amp

    def _groups(self):
        amp = self._amp
        opt = amp.optimizer()
        out = []
        for group in opt.param_groups:
            fp16, masters, fp32 = [], [], []
            for p in group["params"]:
                master = opt.state.get(p, {}).get("master_param") if amp.fused else p
                model = p if amp.fused else amp.model_of.get(p)
                if amp.fused and master is not None or not amp.fused and model is not None:
                    fp16.append(model)
                    masters.append(master)
                elif _masters.needs_master(p):  # a 16-bit parameter without master
                    fp16.append(p)
                else:
                    fp32.append(p)
            out.append((fp16, masters, fp32))
        return out

    fp16_groups = property(lambda self: [g[0] for g in self._groups()])
    fp32_from_fp16_groups = property(lambda self: [g[1] for g in self._groups()])
    fp32_from_fp32_groups = property(lambda self: [g[2] for g in self._groups()])
    all_fp16_params = property(lambda self: [p for g in self._groups() for p in g[0]])
    all_fp32_from_fp16_params = property(lambda self: [p for g in self._groups() for p in g[1]])
    all_fp32_from_fp32_params = property(lambda self: [p for g in self._groups() for p in g[2]])

    @property
    def params_have_scaled_gradients(self) -> bool:
        """True between a ``delay_unscale=True`` exit and the next exit or step."""
        return self._amp.delayed is not None


_optimizer_amp: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerAmp]" = (
    weakref.WeakKeyDictionary())
_disabled: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_current: Optional[_AmpState] = None
_registered_casts: List[tuple] = []


class _AmpForward:
    """``model.forward`` after ``initialize``: the original bound forward under
    autocast (O1) or with inputs cast (O2/O3), outputs cast to ``output_dtype``."""

    def __init__(self, module, original, autocast_dtype, input_dtype, output_dtype):
        functools.update_wrapper(self, original)  # name, docstring, signature
        self.module = module  # (copy.deepcopy of the model rebinds both to the copy)
        self.original = original
        self.autocast_dtype = autocast_dtype
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.input_dtype)
        if self.autocast_dtype is None:
            out = self.original(*args, **kwargs)
        else:
            tensors = itertools.chain(self.module.parameters(), self.module.buffers())
            with torch.autocast(next((t.device.type for t in tensors), "cpu"),
                                dtype=self.autocast_dtype):
                out = self.original(*args, **kwargs)
        return out if self.output_dtype is None else _cast(out, self.output_dtype)


def _patch_forward(model: nn.Module, props: Properties) -> None:
    autocast_dtype = input_dtype = None
    output_dtype = props.cast_model_outputs
    if props.patch_torch_functions:
        autocast_dtype = props.cast_model_type or props.half_dtype
    elif props.cast_model_type is not None and props.cast_model_type != torch.float32:
        input_dtype = props.cast_model_type
    if autocast_dtype or input_dtype:
        # Apex's O1 ran loss functions in fp32 wherever they were called; autocast
        # covers only the forward, so the outputs leave it as fp32.
        output_dtype = output_dtype or torch.float32
    current = model.__dict__.get("forward")
    original = model.forward
    if isinstance(current, _AmpForward):  # replaced, never nested
        original = current.original
        del model.forward
    if autocast_dtype or input_dtype or output_dtype:
        model.forward = _AmpForward(model, original, autocast_dtype, input_dtype, output_dtype)


class _Fp32StateDict:
    """A model's state dict hook at O2/O3, as Apex's: the tensors of the cast dtype
    (``dtype``) come out as float32 with the same values, so a checkpoint keeps the
    fp32 dtypes it had before ``initialize`` (loading casts them back)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        for key, value in state_dict.items():
            if key.startswith(prefix) and isinstance(value, Tensor) and value.dtype == self.dtype:
                state_dict[key] = value.float()


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Casts the floating-point tensors in nested lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [_cast(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return type(value)((k, _cast(v, dtype)) for k, v in value.items())
    return value


def _as_list(value: Any) -> List[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _configure(optimizer: Optimizer, props: "Properties", check_only: bool = False) -> None:
    """The optimizer's master and state_dtype as the properties say (master_weights=True:
    fp32 masters), through its public ``configure``, with amp.initialize's name on the
    errors."""
    master = "fp32" if props.master_weights and props.master is None else props.master
    try:
        optimizer.configure(master=master, state_dtype=props.state_dtype,
                            check_only=check_only)
    except (TypeError, ValueError) as error:
        where = f"{type(optimizer).__name__}.configure"
        message = str(error)
        if message.startswith(where):
            raise type(error)("amp.initialize" + message[len(where):]) from None
        raise


_warned_fp16_on_cpu = False


def _warn_fp16_on_cpu(props: "Properties", models: List[nn.Module]) -> None:
    """Once a process: float16 on CPU parameters takes PyTorch's slow float16 kernels on
    most CPUs (a legacy script's O1 ran 7 times slower than in fp32 on a Xeon with
    AVX512-FP16; the same in bfloat16 took fp32's time)."""
    global _warned_fp16_on_cpu
    dtype = props.cast_model_type  # (O1: the autocast dtype, the opt levels' half unless set)
    if dtype is None and props.patch_torch_functions:
        dtype = props.half_dtype
    if _warned_fp16_on_cpu or dtype is not torch.float16:
        return
    if any(p.device.type == "cpu" for m in models for p in m.parameters()):
        _warned_fp16_on_cpu = True
        warnings.warn(
            f"amp.initialize: opt_level {props.opt_level} casts to float16 on the CPU, where "
            "PyTorch's float16 kernels are slow on most CPUs (several times fp32's time); "
            "bfloat16 is fast there: `python -m mixedprec.apex --half-dtype bfloat16 "
            "script.py` (or MIXEDPREC_HALF_DTYPE=bfloat16) runs the script in bfloat16, "
            "loss scaling unchanged", stacklevel=3)


def initialize(models, optimizers=None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale=None, cast_model_outputs=None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale=None,
               max_loss_scale: float = 2.0**24, *, master: Optional[str] = None,
               state_dtype: Optional[torch.dtype] = None, overflow_report: bool = False):
    """Prepares models and optimizers for mixed precision at an Apex opt level.

    O0: fp32. O1: autocast around the forward. O2: the model in fp16 (or
    ``cast_model_type``), batchnorm in fp32, fp32 master weights. O3: the model all in
    fp16/bf16. O1 and O2 scale the loss dynamically. The environment variable
    ``MIXEDPREC_HALF_DTYPE=bfloat16`` makes the opt levels' fp16 bf16 (a
    ``cast_model_type`` given is kept; the loss scale stays the script's or the opt
    level's), read at each call. Overrides are checked as Apex did
    (``"True"``, ``"128.0"`` accepted), all before anything changes. Returns the models
    and optimizers given, in the shape given; each optimizer may be passed only once.

    mixedprec's lean precision (docs/lean-precision.md), keyword-only, for
    ``mixedprec.FusedAdam``/``FusedSGD`` (Apex's opt levels are unchanged without them):

    * ``master``: what is kept of each cast weight's value at O2/O3: ``"fp32"`` (fp32
      masters, O2's default), ``"none"``, ``"kahan"`` (a bf16 compensation per bf16
      weight), ``"stochastic"`` (bf16 weights rounded stochastically) or
      ``"remainder"`` (an int16 remainder per bf16 weight: exact fp32 masters); the last
      three with ``cast_model_type=torch.bfloat16``. Parameters left fp32 (batchnorm at O2)
      are updated directly.
    * ``state_dtype``: ``torch.bfloat16`` keeps the optimizers' moments and momentum
      buffers in bf16 (any opt level), ``torch.float8_e4m3fn`` in 8 bits with a scale
      per block of 32 for eligible parameters (docs/lean-precision.md);
      ``torch.float32`` the default.

    ``overflow_report=True`` (keyword-only, as ``GradScaler``'s) also counts overflows
    per parameter (one per-tensor norm pass over the gradients a step), so that the
    summary and :func:`overflow_report` name the parameters that overflowed.
    """
    global _current
    optimizer_list = _as_list(optimizers or [])
    if not enabled:
        _disabled.update(o.optim if isinstance(o, LARC) else o for o in optimizer_list)
        return models if optimizers is None else (models, optimizers)
    model_list = _as_list(models)
    for m in model_list:
        if isinstance(m, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise ValueError(f"amp.initialize: the model is already wrapped in {type(m).__name__}"
                             "; apply parallel wrappers to the models amp.initialize returns")
        if not isinstance(m, nn.Module):
            raise TypeError(f"amp.initialize: expected models to be nn.Module, got {type(m)}")
    wrappers = optimizer_list
    optimizer_list = [_unwrap(o, "amp.initialize") for o in wrappers]
    for o in optimizer_list:
        if o in _optimizer_amp:
            raise ValueError("amp.initialize: this optimizer was already passed to "
                             "amp.initialize; build a new one for new models")
    if len(set(map(id, optimizer_list))) != len(optimizer_list):
        raise ValueError("amp.initialize: the same optimizer is listed twice")
    model_params = {p for m in model_list for p in m.parameters()}
    for i, o in enumerate(optimizer_list):
        held = [p for g in o.param_groups for p in g["params"]]
        if held and not any(p in model_params for p in held):
            # (An optimizer over a copy or an earlier instance of the model: the models
            # would be cast and never stepped. Some parameters of its own beside the
            # models', a learnable loss temperature, are fine.)
            raise ValueError(
                f"amp.initialize: expected optimizers[{i}] ({type(o).__name__}) to hold "
                f"parameters of the models given; its {len(held)} parameters are none of "
                "theirs (an optimizer built on another instance or a copy of the model?). "
                "Build it from the model's parameters, e.g. "
                f"{type(o).__name__}(model.parameters(), ...)")
    props = Properties(opt_level, dict(
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs, master=master,
        state_dtype=state_dtype), half=half_dtype())
    for o in optimizer_list:
        if isinstance(o, Optimizer):
            _configure(o, props, check_only=True)
        elif props.master in BF16_MODES or props.state_dtype is not None:
            raise TypeError(f"amp.initialize: master={props.master!r} and state_dtype="
                            f"{props.state_dtype} take mixedprec.optim.Adam, AdamW or SGD (or "
                            f"mixedprec.FusedAdam or FusedSGD), got {type(o).__name__}")
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be an int >= 1, got {num_losses!r}")
    if min_loss_scale is not None:
        min_loss_scale = check_scale("amp.initialize", "min_loss_scale", min_loss_scale)
    if not (isinstance(max_loss_scale, (int, float)) and max_loss_scale == math.inf):
        max_loss_scale = check_scale("amp.initialize", "max_loss_scale", max_loss_scale)
    if min_loss_scale is not None and not min_loss_scale <= max_loss_scale:
        raise ValueError("amp.initialize: expected min_loss_scale <= max_loss_scale, got "
                         f"min_loss_scale={min_loss_scale} and max_loss_scale={max_loss_scale}")
    if not isinstance(overflow_report, bool):
        raise TypeError("amp.initialize: expected overflow_report to be a bool, got "
                        f"{type(overflow_report).__name__}")
    if not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"amp.initialize: verbosity must be an int >= 0 (0 silent, 1 a "
                         f"summary, 2 a line per skipped step), got {verbosity!r}")
    names = [(f"{i}.{n}" if len(model_list) > 1 else n, p)
             for i, m in enumerate(model_list) for n, p in m.named_parameters()]
    state = _AmpState(props, [LossScaler(props.loss_scale, min_loss_scale, float(max_loss_scale))
                              for _ in range(num_losses)], verbosity, names, overflow_report)
    if verbosity:
        logger.info("amp: %s", props)
    _warn_fp16_on_cpu(props, model_list)

    # At O1 cast_model_type picks the autocast dtype; the weights stay fp32.
    dtype = None if props.patch_torch_functions else props.cast_model_type
    casting = dtype is not None and dtype != torch.float32
    # fp32 values of every parameter before the cast: exact master weights.
    fp32 = {p: _masters.make_master(p) for m in model_list
            for p in m.parameters()} if casting and props.master_weights else {}
    for m in model_list:
        if casting and props.keep_batchnorm_fp32:
            convert_network(m, dtype)
        elif dtype is not None:
            m.to(dtype)
        _patch_forward(m, props)
        if casting and not any(isinstance(h, _Fp32StateDict) and h.dtype == dtype
                               for h in m._state_dict_hooks.values()):
            m.register_state_dict_post_hook(_Fp32StateDict(dtype))
    for o in optimizer_list:
        masters: Dict[Tensor, Tensor] = {}
        if isinstance(o, Optimizer):
            # (configure forgets the op calls kept from earlier steps: the state and the
            # model's dtypes change here)
            _configure(o, props)
            if props.master_weights:
                for p in (p for g in o.param_groups for p in g["params"] if p in fp32):
                    if _masters.needs_master(p):
                        o.state[p]["master_param"] = fp32[p]
        elif props.master_weights:  # the optimizer steps fp32 masters of the half params
            for group in o.param_groups:
                for p in (p for p in group["params"] if _masters.needs_master(p)):
                    masters[p] = nn.Parameter(fp32[p] if p in fp32 else _masters.make_master(p),
                                              requires_grad=p.requires_grad)
                    if p in o.state:
                        o.state[masters[p]] = o.state.pop(p)
                group["params"] = [masters.get(p, p) for p in group["params"]]
        _OptimizerAmp(o, state, masters)
    for wrapper, o in zip(wrappers, optimizer_list):
        if wrapper is not o:
            _larc_steps_unscaled(wrapper, _optimizer_amp[o])
    if props.patch_torch_functions:
        for module, name, wrap in _registered_casts:
            setattr(module, name, wrap(getattr(module, name)))
        _registered_casts.clear()
    _current = state
    return models if optimizers is None else (models, optimizers)


@contextlib.contextmanager
def scale_loss(loss: Tensor, optimizers, loss_id: int = 0, model=None,
               delay_unscale: bool = False, delay_overflow_check: bool = False
               ) -> Iterator[Tensor]:
    """Yields ``loss * scale`` for ``backward()``. On exit, one overflow check of the
    new gradients on the device: fused optimizers are handed the scale and flag, other
    optimizers' gradients are unscaled (into the fp32 masters at O2); then the scale is
    updated. An overflow skips the steps of all the optimizers given. With
    ``delay_unscale=True`` the gradients stay scaled and unchecked until the next exit
    of the same loss. With ``delay_overflow_check=True`` the gradients are unscaled
    but neither the scale nor any step follows this exit's check: the script checks
    the gradients itself and calls the scaler's ``update_scale()`` (NVIDIA's BERT
    pretraining, which checks after its all-reduce), as in Apex. Apex's ``model`` has
    no effect."""
    optimizer_list = [_unwrap(o, "amp.scale_loss") for o in _as_list(optimizers)]
    amps = [_optimizer_amp.get(o) for o in optimizer_list]
    if not amps or all(a is None and o in _disabled for a, o in zip(amps, optimizer_list)):
        yield loss  # amp is off for these optimizers (initialize(enabled=False))
        return
    if not isinstance(loss, Tensor):
        raise TypeError(f"amp.scale_loss: expected loss to be a tensor, got "
                        f"{type(loss).__name__}")
    if isinstance(loss_id, bool) or not isinstance(loss_id, int):
        raise TypeError(f"amp.scale_loss: expected loss_id to be an int, got {loss_id!r}")
    if any(a is None for a in amps):
        raise ValueError("amp.scale_loss: every optimizer must have been passed to amp.initialize")
    scalers = amps[0].state.loss_scalers
    if not 0 <= loss_id < len(scalers):
        raise ValueError(f"amp.scale_loss: loss_id must be in [0, {len(scalers)}), got {loss_id}")
    scaler = scalers[loss_id]
    # The scale this backward uses: the update below changes the scaler's in place.
    scale = scaler.core.place(loss.device).clone()
    for amp in amps:
        amp.before_backward(loss_id)
    try:
        yield loss.float() * scale
    except BaseException:
        for amp in amps:
            amp.abandon()
        raise
    found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
    check = scaler.dynamic and not delay_unscale  # a static scale never skips a step
    for amp in amps:
        if delay_unscale:  # the gradients set aside join this loss's, at this scale
            amp.restore(scale)
            amp.carried, amp.delayed = scale, loss_id
        else:
            amp.after_backward(scale, found_inf, check)
            amp.delayed = None
    decides = check and not delay_overflow_check  # (else the script's update_scale() does)
    for amp in amps:  # found_inf is complete: an overflow anywhere skips every step
        amp.add_flag(found_inf if decides else None, scale.device,
                     decides=not delay_overflow_check)
    if decides:
        scaler.update(found_inf)
        state = amps[0].state
        state.overflow.record_step(found_inf, scale, scaler.core.scale)
        if state.verbosity >= 2:
            state.reporter.record(loss_id, found_inf, scaler.core.scale)


def overflow_report(names: Any = None, scale: bool = True) -> Dict[str, Any]:
    """mixedprec's extra: the overflow counts of the latest ``initialize``, read now (see
    :meth:`mixedprec.overflow.OverflowReport.report`): the loss-scale updates
    (``scale_loss`` exits that checked for overflow) as ``steps``, the skipped ones, the
    overflows by parameter name (``overflow_report=True``; names from the models given to
    ``initialize``, or ``names``) and the scale's history (the scale of the latest
    loss)."""
    if _current is None:
        raise RuntimeError("amp.overflow_report: amp.initialize has not been called")
    return _current.overflow.report(names, scale)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The fp32 parameters the optimizer updates (its masters at O2), with unscaled
    ``.grad``, e.g. for clipping between ``scale_loss`` and ``step``."""
    optimizer = _unwrap(optimizer, "amp.master_params")
    amp = _optimizer_amp.get(optimizer)
    if amp is not None and amp.fused:
        amp.unscale_for_clipping()
    fused = isinstance(optimizer, Optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield optimizer.state.get(p, {}).get("master_param", p) if fused else p


def state_dict(destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Apex's ``loss_scaler0``, ... entries, and ``master_params0``, ... (the O2 masters
    of non-fused optimizers, in the order of ``initialize``)."""
    if _current is None:
        raise RuntimeError("amp.state_dict: amp.initialize has not been called")
    out = {} if destination is None else destination
    for i, scaler in enumerate(_current.loss_scalers):
        out[f"loss_scaler{i}"] = scaler.state_dict()
    for i, amp in enumerate(_current.optimizers):
        if amp.masters:
            out[f"master_params{i}"] = [m.detach().clone() for m in amp.masters.values()]
    return out


def load_state_dict(state_dict: Dict[str, Any]) -> None:
    """Restores what :func:`state_dict` saved, after ``initialize``; every entry is
    checked first: a bad one raises ValueError naming its key, and nothing changes. As
    Apex did, a state dict with another number of loss scalers than ``num_losses`` warns
    and loads its scalers in order into the first ones."""
    if _current is None:
        raise RuntimeError("amp.load_state_dict: amp.initialize has not been called")
    if not isinstance(state_dict, dict):
        raise ValueError("amp.load_state_dict: expected state_dict to be a dict (from "
                         f"amp.state_dict()), got {type(state_dict).__name__}")

    def number(key: str) -> int:
        return int(key[len("loss_scaler"):])

    # (loss_scaler<i> only: another key after the prefix is unexpected, below)
    scalers = sorted((k for k in state_dict if isinstance(k, str)
                      and k.startswith("loss_scaler") and k[len("loss_scaler"):].isdigit()),
                     key=number)
    unexpected = [k for k in state_dict if k not in scalers and not (
        isinstance(k, str) and k.startswith("master_params"))]
    if unexpected:
        raise ValueError(f"amp.load_state_dict: unexpected keys {unexpected} in state_dict "
                         "(amp.state_dict() saves 'loss_scaler<i>' and 'master_params<i>')")
    loss_scalers = _current.loss_scalers
    if len(scalers) != len(loss_scalers):
        # Apex warned and loaded the saved scalers in order into the first ones (a
        # checkpoint of num_losses=1 resumes a run with num_losses=2, say).
        warnings.warn(f"amp.load_state_dict: state_dict holds {len(scalers)} loss scalers "
                      f"({', '.join(scalers) or 'none'}), amp was initialized with "
                      f"{len(loss_scalers)}: loading the first "
                      f"{min(len(scalers), len(loss_scalers))} "
                      "in order, the others keep their state", stacklevel=2)
    pairs = list(zip(scalers, loss_scalers))
    for check_only in (True, False):  # every entry is checked before any is loaded
        for key, scaler in pairs:
            scaler.load_state_dict(state_dict[key], key, check_only)
        for i, amp in enumerate(_current.optimizers):
            saved, current = state_dict.get(f"master_params{i}"), list(amp.masters.values())
            if saved is None or not current:
                continue
            if check_only and (not isinstance(saved, (list, tuple)) or len(saved) != len(
                    current) or any(not isinstance(s, Tensor) or not s.is_floating_point()
                                    or s.shape != c.shape for s, c in zip(saved, current))):
                raise ValueError(f"amp.load_state_dict: expected master_params{i} to be a "
                                 f"list of {len(current)} float tensors with the shapes of "
                                 f"optimizer {i}'s master parameters")
            if not check_only:
                _masters.copy_to_model(saved, current)  # exactly
                _masters.copy_to_model(current, list(amp.masters))
                amp.masters_follow()  # (the model's weights are the masters', cast)


class _CurrentAmpState:
    """Apex's ``amp._amp_state`` (legacy scripts read ``loss_scalers[i].loss_scale()``
    or ``opt_properties``): follows the latest ``initialize``."""

    def __getattr__(self, name: str) -> Any:
        if _current is None:
            raise AttributeError(f"amp._amp_state.{name}: amp.initialize has not been called")
        return getattr(_current, name)


_amp_state = _CurrentAmpState()


# --- the 2018 API: amp.init() and its handle (maskrcnn-benchmark) ------------------------

def _autocast_device() -> str:
    """The device type whose autocast ``amp.init`` turns on: CUDA where available (Apex
    was CUDA only), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class _SkipFlag:
    """One optimizer's overflow flag between a handle's ``scale_loss`` and its step."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.found_inf: Optional[Tensor] = None
        _guard_step(optimizer, self.should_skip)

    def add(self, found_inf: Tensor) -> None:
        self.found_inf = found_inf if self.found_inf is None else self.found_inf + found_inf

    def should_skip(self) -> bool:
        flag, self.found_inf = self.found_inf, None
        return flag is not None and flag.item() != 0  # sync-ok: once a step, as Apex


_skip_flags: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _SkipFlag]" = (
    weakref.WeakKeyDictionary())


def _unscale_grads(params: Iterable[Tensor], scale: Tensor) -> Tensor:
    """Unscales the ``.grad`` of ``params`` in place (a sparse one: its values); returns
    the overflow flag."""
    found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
    grads.unscale_([p.grad for p in params if p.grad is not None], found_inf, inverse(scale))
    return found_inf


def _scaled_backward_exit(scaler: LossScaler, params: List[Tensor], scale: Tensor) -> Tensor:
    """After the backward of ``loss * scale``: unscales, updates the scale; the flag."""
    found_inf = _unscale_grads(params, scale)
    if scaler.dynamic:
        scaler.update(found_inf)
    else:
        found_inf.zero_()  # a static scale never skips
    return found_inf


def _params(optimizer: torch.optim.Optimizer) -> List[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


class AmpHandle:
    """What Apex's ``amp.init()`` returned (2018 API, maskrcnn-benchmark): autocast on for
    the thread that called ``init`` (no torch function is patched), and a loss scale.

    ``with handle.scale_loss(loss, optimizer) as scaled: scaled.backward()`` scales the
    loss, then unscales the gradients of ``optimizer``'s parameters in place and updates
    the scale; on an overflow the next ``optimizer.step()`` is skipped (one host read in
    that step). Each exit clears autocast's cache of cast weights, as Apex cleared its
    own. :meth:`wrap_optimizer` gives Apex's ``OptimWrapper`` for several losses."""

    def __init__(self, loss_scale: Any = "dynamic", enable_caching: bool = True,
                 verbose: bool = False):
        if loss_scale != "dynamic":
            loss_scale = check_scale("amp.init", "loss_scale", loss_scale)
        self._loss_scale_arg = loss_scale
        self._enable_caching = bool(enable_caching)
        self._verbose = bool(verbose)
        self._default_scaler: Optional[LossScaler] = LossScaler(loss_scale)
        self._is_active = True
        self._dtype = half_dtype()  # float16, unless MIXEDPREC_HALF_DTYPE says bfloat16
        self._device = _autocast_device()
        self._previous = (torch.is_autocast_enabled(self._device),
                          torch.get_autocast_dtype(self._device),
                          torch.is_autocast_cache_enabled())
        torch.set_autocast_dtype(self._device, self._dtype)
        torch.set_autocast_enabled(self._device, True)
        torch.set_autocast_cache_enabled(self._enable_caching)

    def is_active(self) -> bool:
        return self._is_active

    @contextlib.contextmanager
    def _disable_casts(self):
        self._is_active = False
        try:
            with disable_casts():
                yield
        finally:
            self._is_active = True

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1):
        """Apex's ``OptimWrapper``: ``optimizer.scale_loss(loss)`` once per loss (a loss
        scale each), then ``optimizer.step()``, skipped if any loss overflowed."""
        self._default_scaler = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
        if not self.is_active():
            yield loss
            return
        if self._default_scaler is None:
            raise RuntimeError("amp handle: after handle.wrap_optimizer(), use the wrapped "
                               "optimizer's scale_loss(loss)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("amp handle: expected optimizer to be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        scaler = self._default_scaler
        scale = scaler.core.place(loss.device).clone()
        yield loss.float() * scale
        found_inf = _scaled_backward_exit(scaler, _params(optimizer), scale)
        flag = _skip_flags.get(optimizer)
        if flag is None:
            flag = _skip_flags[optimizer] = _SkipFlag(optimizer)
        flag.add(found_inf)
        self._clear_cache()

    def _clear_cache(self) -> None:
        torch.clear_autocast_cache()

    def _deactivate(self) -> None:
        """Turns amp off: autocast as it was before ``init`` (once; again: nothing)."""
        if self._previous is None:
            return
        (enabled, dtype, cache), self._previous = self._previous, None
        torch.set_autocast_enabled(self._device, enabled)
        torch.set_autocast_dtype(self._device, dtype)
        torch.set_autocast_cache_enabled(cache)
        torch.clear_autocast_cache()
        self._is_active = False

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    def remove_cache(self, param: Tensor) -> None:
        """Apex dropped one weight's cached cast; autocast's cache is cleared whole."""
        if self._enable_caching:
            torch.clear_autocast_cache()

    @property
    def verbose(self) -> bool:
        return self._verbose


class NoOpHandle:
    """What ``amp.init(enabled=False)`` returns: every method leaves training as it is."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self):
        yield

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1):
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
        yield loss

    has_cache = property(lambda self: False)
    verbose = property(lambda self: False)

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


class OptimWrapper:
    """Apex's ``amp.opt.OptimWrapper`` (from ``handle.wrap_optimizer``): one dynamic loss
    scale per loss; each ``scale_loss`` sees only its loss's gradients (those of the
    earlier losses are set aside and added back, unscaled); ``step`` is skipped when
    any loss overflowed since the last step (one host read). Other attributes are the
    optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle, num_loss: int = 1):
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"amp handle: expected num_loss to be an int >= 1, got {num_loss!r}")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._loss_scaler = [LossScaler("dynamic") for _ in range(num_loss)]
        self._found_inf: Optional[Tensor] = None

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor) -> Iterator[Tensor]:
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(f"amp handle: scale_loss called more than num_loss="
                               f"{self._num_loss} times before step()")
        params = _params(self._optimizer)
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        scaler = self._loss_scaler[self._loss_idx]
        scale = scaler.core.place(loss.device).clone()
        try:
            yield loss.float() * scale
        except BaseException:
            for p, g in zip(params, earlier):
                p.grad = g
            raise
        found_inf = _scaled_backward_exit(scaler, params, scale)
        self._found_inf = found_inf if self._found_inf is None else self._found_inf + found_inf
        self._loss_idx += 1
        for p, g in zip(params, earlier):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self._amp_handle._clear_cache()

    def step(self, closure=None):
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure=closure)
        if closure is not None:
            raise NotImplementedError("amp handle: the wrapped optimizer's step takes no "
                                      "closure (as in Apex)")
        self._loss_idx = 0
        flag, self._found_inf = self._found_inf, None
        if flag is not None and flag.item() != 0:  # sync-ok: once a step, as Apex
            return None
        return self._optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> Dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self._optimizer.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)


_handle: Optional[AmpHandle] = None


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True,
         verbose: bool = False, allow_banned: bool = False):
    """Apex's 2018 entry point: returns an :class:`AmpHandle` (``enabled=False``: a
    :class:`NoOpHandle`). Instead of patching torch's functions it turns autocast on
    (float16, or bfloat16 under ``MIXEDPREC_HALF_DTYPE``; CUDA where available, else
    the CPU) for the calling thread until
    ``handle._deactivate()``, and applies the ``register_*_function`` registry.
    ``allow_banned=True`` is rejected: under autocast, torch refuses
    ``binary_cross_entropy`` in float16 whatever is allowed; use
    ``binary_cross_entropy_with_logits`` or wrap the call in :func:`float_function`."""
    global _handle
    if allow_banned:
        raise ValueError("amp.init: allow_banned=True is not supported (torch's autocast "
                         "refuses float16 binary_cross_entropy); expected False")
    if enabled and loss_scale != "dynamic":  # checked before the last handle is replaced
        check_scale("amp.init", "loss_scale", loss_scale)
    if enabled:
        half_dtype()  # a bad MIXEDPREC_HALF_DTYPE raises here, the last handle untouched
    if _handle is not None:  # a second init replaces the first
        _handle._deactivate()
        _handle = None
    if not enabled:
        return NoOpHandle()
    _handle = AmpHandle(loss_scale, enable_caching, verbose)
    for module, name, wrap in _registered_casts:
        setattr(module, name, wrap(getattr(module, name)))
    _registered_casts.clear()
    return _handle


# --- function casts (O1) -----------------------------------------------------------

def _cast_function(fn, dtype_of):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = next((a.device.type for a in (*args, *kwargs.values())
                            if isinstance(a, Tensor)), "cpu")
        if not torch.is_autocast_enabled(device_type):
            return fn(*args, **kwargs)
        dtype = dtype_of(device_type, args, kwargs)
        with torch.autocast(device_type, enabled=False):
            args, kwargs = _cast((args, kwargs), dtype)
            return fn(*args, **kwargs)
    return wrapper


def half_function(fn):
    """Runs ``fn`` in the autocast dtype (fp16/bf16) with its inputs cast, under O1."""
    return _cast_function(fn, lambda device_type, a, k: torch.get_autocast_dtype(device_type))


def float_function(fn):
    """Runs ``fn`` in fp32 with its inputs cast, under O1."""
    return _cast_function(fn, lambda device_type, a, k: torch.float32)


def promote_function(fn):
    """Runs ``fn`` with its floating-point inputs cast to the widest of their dtypes."""
    def widest(device_type, args, kwargs):
        dtypes = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
    return _cast_function(fn, widest)


def _tensors(value: Any) -> Iterable[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _tensors(v)


def register_half_function(module, name: str) -> None:
    """Wraps ``module.name`` with :func:`half_function` at the next O1 ``initialize``
    (Apex's registry: this replaces the attribute on ``module``, as Apex did)."""
    _register(module, name, half_function)


def register_float_function(module, name: str) -> None:
    """Like :func:`register_half_function`, with :func:`float_function`."""
    _register(module, name, float_function)


def register_promote_function(module, name: str) -> None:
    """Like :func:`register_half_function`, with :func:`promote_function`."""
    _register(module, name, promote_function)


def _register(module, name: str, wrap) -> None:
    if not hasattr(module, name):
        raise ValueError(f"amp: {module!r} has no attribute {name!r}")
    _registered_casts.append((module, name, wrap))


@contextlib.contextmanager
def disable_casts():
    """Turns autocast off inside the block (on CPU and CUDA)."""
    cuda = torch.cuda.is_available()
    with torch.autocast("cpu", enabled=False), (
            torch.autocast("cuda", enabled=False) if cuda else contextlib.nullcontext()):
        yield
