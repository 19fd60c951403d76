"""The overflow report: which parameters' gradients overflow, how many steps were
skipped, and how the loss scale moved, counted on the device.

:class:`OverflowReport` is fed by the front ends that see the gradients and the scale:
``mixedprec.GradScaler(..., overflow_report=True)``, ``mixedprec.amp`` and
``mixedprec.fp16_utils.FP16_Optimizer``. Each step adds, on the device, a per-parameter
non-finite flag (:func:`mixedprec.grads.nonfinite_per_tensor`: one per-tensor L2-norm
pass over the gradients), the step's overflow flag and the scale before and after the
update. Nothing is read on the host until :meth:`OverflowReport.report` is called.
"""

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import grads as _grads
from . import ops

__all__ = ["OverflowReport", "format_report"]


def _name_map(names: Any, where: str) -> Dict[int, str]:
    """``id(param) -> name`` from a module, or from ``(name, param)`` pairs
    (``model.named_parameters()``); None gives none."""
    if names is None:
        return {}
    if isinstance(names, nn.Module):
        return {id(p): n for n, p in names.named_parameters()}
    if isinstance(names, (str, Tensor)) or not isinstance(names, Iterable):
        raise TypeError(f"{where}: expected an nn.Module or (name, parameter) pairs such as "
                        f"model.named_parameters(), got {type(names).__name__}")
    out = {}
    for pair in names:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], Tensor)):
            raise TypeError(f"{where}: expected (name, parameter) pairs such as "
                            f"model.named_parameters(), got an item {pair!r:.60}")
        out[id(pair[1])] = pair[0]
    return out


class OverflowReport:
    """Per-parameter overflow counts, steps, skipped steps and the loss scale's history,
    kept as device tensors (see the module docstring). ``names``: an ``nn.Module`` or
    ``(name, parameter)`` pairs, for :meth:`report` (it may also be given there)."""

    def __init__(self, names: Any = None, owner: str = "OverflowReport"):
        self.owner = owner
        self._names = _name_map(names, owner)
        self._params: List[Tensor] = []  # row -> parameter (kept: its id names the row)
        self._rows: Dict[int, int] = {}  # id(parameter) -> row
        self._index: Dict[Tuple[Any, ...], Tensor] = {}  # (device, ids) -> rows on device
        self.counts: Optional[Tensor] = None  # int64 [rows]: steps each one overflowed
        self.steps: Optional[Tensor] = None  # int64: steps (loss-scale updates) recorded
        self.skipped: Optional[Tensor] = None  # int64: of which overflowed
        self.backoffs: Optional[Tensor] = None
        self.growths: Optional[Tensor] = None
        self.scale_min: Optional[Tensor] = None
        self.scale_max: Optional[Tensor] = None
        self.scale: Optional[Tensor] = None  # the scale after the last recorded update
        # name -> count loaded (load_state_dict), given to a parameter's row when its name
        # (or "<param N, shape (..)>" for an unnamed one) first appears
        self._loaded: Dict[str, int] = {}

    def _place(self, device: torch.device) -> None:
        if self.steps is None:
            def zero() -> Tensor:
                return torch.zeros((), dtype=torch.int64, device=device)
            self.steps, self.skipped, self.backoffs, self.growths = zero(), zero(), zero(), zero()
            self.counts = torch.zeros(0, dtype=torch.int64, device=device)

    def _rows_of(self, params: List[Tensor], device: torch.device) -> Tensor:
        """The rows of ``params`` as a device tensor (made once per parameter list)."""
        key = (device, *map(id, params))
        rows = self._index.get(key)
        if rows is None:
            for p in params:
                if id(p) not in self._rows:
                    self._rows[id(p)] = len(self._params)
                    self._params.append(p)
            grow = len(self._params) - self.counts.numel()
            if grow:  # (new rows: 0, or the count a checkpoint gave the name)
                first = [self._loaded.pop(self._name(row), 0)
                         for row in range(self.counts.numel(), len(self._params))]
                self.counts = torch.cat([self.counts, ops.int64_tensor(first, device)])
            rows = ops.int64_tensor([self._rows[id(p)] for p in params], device)
            self._index[key] = rows
        return rows

    @torch.no_grad()
    def record_grads(self, params: List[Tensor], grads: List[Tensor],
                     inv_scale: Optional[Tensor] = None) -> None:
        """Adds 1 to the count of each parameter whose gradient (times ``inv_scale``) is
        not finite; ``params[i]`` owns ``grads[i]``. On the device."""
        if not grads:
            return
        device = (inv_scale if inv_scale is not None else grads[0]).device
        self._place(device if self.counts is None else self.counts.device)
        for positions, flags in _grads.nonfinite_per_tensor(grads, inv_scale):
            rows = self._rows_of([params[i] for i in positions], self.counts.device)
            self.counts.index_add_(0, rows, flags.to(self.counts.device, torch.int64))

    @torch.no_grad()
    def keep(self, scale: Tensor) -> Tensor:
        """A copy of ``scale`` (before an update changes it in place), in a buffer of the
        report's own: the ``before`` of :meth:`record_step`."""
        kept = self.__dict__.get("_kept")
        if kept is None or kept.device != scale.device or kept.shape != scale.shape:
            kept = self._kept = torch.empty_like(scale, dtype=torch.float32)
        return kept.copy_(scale)

    @torch.no_grad()
    def record_step(self, found_inf: Tensor, before: Optional[Tensor] = None,
                    after: Optional[Tensor] = None) -> None:
        """One loss-scale update: ``found_inf`` (nonzero: skipped) and, for a dynamic
        scale, the scale ``before`` and ``after`` it (0-dim or 1-element tensors)."""
        self._place(found_inf.device)
        flag = found_inf.reshape(()).to(self.steps.device) != 0
        self.steps.add_(1)
        self.skipped.add_(flag.to(torch.int64))
        if before is None or after is None:
            return
        before = before.reshape(()).to(self.steps.device, torch.float64)
        after = after.reshape(()).to(self.steps.device, torch.float64)
        self.backoffs.add_((after < before).to(torch.int64))
        self.growths.add_((after > before).to(torch.int64))
        if self.scale_min is None:
            self.scale_min, self.scale_max = torch.minimum(before, after), torch.maximum(
                before, after)
        else:
            torch.minimum(self.scale_min, after, out=self.scale_min)
            torch.maximum(self.scale_max, after, out=self.scale_max)
        self.scale = after

    def _name(self, row: int, names_of: Optional[Dict[int, str]] = None) -> str:
        p = self._params[row]
        name = (self._names if names_of is None else names_of).get(id(p))
        return name if name is not None else f"<param {row}, shape {tuple(p.shape)}>"

    def report(self, names: Any = None, scale: bool = True) -> Dict[str, Any]:
        """Reads the counts (one host read): ``{"steps", "skipped", "overflows": {name:
        count, most first, only parameters that overflowed}}`` and, with ``scale``,
        ``"scale": {"current", "min", "max", "backoffs", "growths"}`` (None before any
        dynamic update). ``names``: as the constructor's, to name the parameters; an
        unnamed one is ``"<param N, shape (..)>"``."""
        names_of = {**self._names, **_name_map(names, f"{self.owner}.report")}
        out: Dict[str, Any] = {"steps": 0, "skipped": 0, "overflows": {}}
        if self.steps is not None:
            values = torch.cat([torch.stack([self.steps, self.skipped]), self.counts])
            steps, skipped, *counts = values.cpu().tolist()  # sync-ok: report() reads
            overflows = sorted(((c, row) for row, c in enumerate(counts) if c),
                               key=lambda item: (-item[0], item[1]))
            out.update(steps=steps, skipped=skipped, overflows={
                self._name(row, names_of): c for c, row in overflows})
        if scale:
            history = None
            if self.scale is not None:
                values = torch.stack([self.scale, self.scale_min, self.scale_max,
                                      self.backoffs.double(), self.growths.double()])
                current, low, high, backoffs, growths = values.cpu().tolist()  # sync-ok
                history = dict(current=current, min=low, max=high, backoffs=int(backoffs),
                               growths=int(growths))
            out["scale"] = history
        return out

    def summary(self, names: Any = None, top: int = 5) -> str:
        """:meth:`report` as one readable line (see :func:`format_report`)."""
        return format_report(self.report(names), check_top(f"{self.owner}.summary", top))

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """:meth:`report` (one host read), for a checkpoint: the counts by parameter name
        (the constructor's names; an unnamed parameter as ``"<param N, shape (..)>"``,
        N its place in the order the parameters first overflowed or were checked)."""
        return self.report()

    def load_state_dict(self, state: Any, device: Any) -> None:
        """Carries :meth:`state_dict`'s counts on, on ``device``: the steps, skips and scale
        history at once, each parameter's count when its name first appears (an unnamed
        one's: at its place). Every value is checked first: a bad one raises a TypeError
        or ValueError that names it, and nothing changes."""
        where = f"{self.owner}.load_state_dict"

        def count(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: expected {name} to be an int >= 0, got {value!r:.60}")
            return value

        if not isinstance(state, dict) or not isinstance(state.get("overflows"), dict):
            raise TypeError(f"{where}: expected a dict with steps, skipped and overflows (what "
                            f"state_dict() gives), got {state!r:.80}")
        steps, skipped = count("steps", state.get("steps")), count("skipped", state.get("skipped"))
        if skipped > steps:
            raise ValueError(f"{where}: expected skipped <= steps, got {skipped} > {steps}")
        loaded = {}
        for name, value in state["overflows"].items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: expected the overflows' keys to be names, got "
                                f"{name!r:.60}")
            loaded[name] = count(f"overflows[{name!r}]", value)
        history = state.get("scale")
        if history is not None:
            if not isinstance(history, dict):
                raise TypeError(f"{where}: expected scale to be None or a dict, got "
                                f"{history!r:.60}")
            for key in ("current", "min", "max"):
                value = history.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                        not 0 < value < math.inf:
                    raise ValueError(f"{where}: expected scale[{key!r}] to be a finite number "
                                     f"> 0, got {value!r:.60}")
            moves = [count(f"scale[{key!r}]", history.get(key)) for key in ("backoffs", "growths")]
        names = self._names  # (the constructor's stay)
        self.__init__(owner=self.owner)
        self._names = names
        self._place(torch.device(device))
        self.steps.fill_(steps)
        self.skipped.fill_(skipped)
        self._loaded = loaded
        if history is not None:
            self.backoffs.fill_(moves[0])
            self.growths.fill_(moves[1])
            self.scale, self.scale_min, self.scale_max = (
                torch.full((), float(history[key]), dtype=torch.float64, device=device)
                for key in ("current", "min", "max"))

    def __getstate__(self) -> Dict[str, Any]:
        # Pickled empty: the counts belong to this process's parameters.
        return {"owner": self.owner}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(owner=state.get("owner", "OverflowReport"))


def check_top(where: str, top: Any) -> int:
    """A summary's ``top``: how many entries it names, an int >= 0."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"{where}: expected top to be an int >= 0, got {top!r}")
    return top


def format_report(report: Dict[str, Any], top: int = 5) -> str:
    """One line: ``"12 of 1000 steps skipped (1.2%); scale 1024 (min 512, max 65536, 7
    backoffs, 1 growth); overflows: fc1.weight 9, fc2.bias 3"`` (the ``top`` most)."""
    top = check_top("format_report", top)
    steps, skipped = report["steps"], report["skipped"]
    share = f" ({100.0 * skipped / steps:.1f}%)" if steps else ""
    parts = [f"{skipped} of {steps} steps skipped{share}"]
    history = report.get("scale")
    if history:
        def number(x: float) -> str:
            return f"{x:g}" if math.isfinite(x) else str(x)
        parts.append(f"scale {number(history['current'])} (min {number(history['min'])}, "
                     f"max {number(history['max'])}, {history['backoffs']} backoffs, "
                     f"{history['growths']} growths)")
    overflows = list(report["overflows"].items())
    if overflows:
        shown = ", ".join(f"{name} {count}" for name, count in overflows[:top])
        more = f" and {len(overflows) - top} more" if len(overflows) > top else ""
        parts.append(f"overflows: {shown}{more}")
    return "; ".join(parts)
