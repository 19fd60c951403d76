"""The precision report: how much of each parameter's update its storage lost.

A bf16 parameter of 1.0 does not move under an update of 1e-3: the update rounds away.
Asked for with ``precision_report=True`` (:class:`~mixedprec.optim.Adam`,
:class:`~mixedprec.optim.AdamW`, :class:`~mixedprec.optim.SGD`), the fused step counts,
per parameter and on the device, in the same pass (the ``precision_tallies`` of
``fused_adam_`` and ``fused_sgd_``):

* the element updates that were lost: the fp32 update moved the element, but the value
  the next step reads back (the bf16 parameter; with ``master="kahan"`` the parameter
  plus its compensation; rounded stochastically with ``"stochastic"``) is the one the
  step started from;
* the lost parts' and the applied parts' sums of squares, whose roots' ratio says how
  large what was lost is against what was applied;
* the element updates counted.

``precision_report=N`` (an int) counts every N-th step only (the first, then N steps
apart): the step's extra arithmetic is paid on those steps alone. On the CPU, where a
step can be bound by its arithmetic, counting every step costs up to about 40% of the
step time (bf16 moments without masters), so a long run is better sampled
(docs/lean-precision.md gives the measured costs).

fp32 parameters, fp32 masters (``master="fp32"``) and ``master="remainder"`` keep the
fp32 result exactly and lose nothing. The sums grow over steps with no host read;
:meth:`PrecisionReport.report` reads them once, by parameter name, like the overflow
report (:mod:`mixedprec.overflow`), and names ``master="remainder"`` for each parameter
that lost updates: it keeps the exact fp32 value in 2 more bytes per parameter
(``"kahan"`` keeps nearly all of it in the same 2 bytes). docs/lean-precision.md has
the measured cost and an example.
"""

import math
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..distributed import is_dtensor
from ..overflow import _name_map, check_top

__all__ = ["PrecisionReport", "format_precision_report", "totals"]

#: The words of each parameter's tally, as fused_adam_ and fused_sgd_ add to them.
WORDS = ("lost", "lost_squares", "applied_squares", "elements")


def tallies_of(report: Optional["PrecisionReport"], params: List[Tensor]) -> Optional[List[Tensor]]:
    """The tallies of ``params`` an optimizer's cached op call keeps (None without a
    report)."""
    return None if report is None else report.tallies(params)


def counted(report: Optional["PrecisionReport"],
            tallies: Optional[List[Tensor]]) -> Optional[List[Tensor]]:
    """The op call's ``precision_tallies``: ``tallies`` when this step is counted, else
    None."""
    return None if report is None else report.pick(tallies)


class PrecisionReport:
    """Per-parameter tallies of lost updates (see the module docstring), kept as one
    float64 tensor of 4 words per parameter on its device, zero until the parameter
    steps. ``optimizer.precision_report`` when the optimizer was built with
    ``precision_report=True``."""

    def __init__(self, owner: str = "PrecisionReport", every: int = 1):
        self.owner = owner
        #: Which steps are counted: every ``every``-th (the first, then ``every`` apart).
        self.every = every
        self._step = 0  # the optimizer's steps so far (host side: advance())
        self._tallies: Dict[int, Tensor] = {}  # id(parameter) -> its 4 words
        self._params: List[Tensor] = []  # in order of their first step (kept: ids name them)

    @classmethod
    def of(cls, where: str, option: Any) -> Optional["PrecisionReport"]:
        """The report an optimizer's ``precision_report=`` asks for: False, None or 0 none,
        True every step, an int N >= 1 every N-th step."""
        if option is None or option is False:
            return None
        if option is True:
            return cls(where)
        if isinstance(option, int) and option >= 1:
            return cls(where, option)
        raise ValueError(f"{where}: expected precision_report to be a bool or an int >= 1 "
                         f"(count every N-th step), got {option!r}")

    def advance(self) -> None:
        """One optimizer step done (the host's count; whether the next is counted)."""
        self._step += 1

    def pick(self, tallies: Optional[List[Tensor]]) -> Optional[List[Tensor]]:
        """``tallies`` when this step is counted, else None (an op call's argument)."""
        return tallies if tallies is not None and self._step % self.every == 0 else None

    def check(self, where: str, p: Tensor, master: str) -> None:
        """Raises where the report cannot follow ``p`` (before any update)."""
        if master == "none" and p.dtype == torch.float16:
            raise TypeError(f"{where}: precision_report=True: the report follows bfloat16 and "
                            "float32 parameters (or fp32 masters), got a float16 parameter "
                            "with master='none'")
        if is_dtensor(p):
            raise TypeError(f"{where}: precision_report=True: expected plain tensors as "
                            f"parameters, got a {type(p).__name__} (the report does not "
                            "follow sharded parameters)")

    def tallies(self, params: List[Tensor]) -> List[Tensor]:
        """The tally of each of ``params`` (made, zero, at its first step)."""
        out = []
        for p in params:
            tally = self._tallies.get(id(p))
            if tally is None:
                tally = self._tallies[id(p)] = torch.zeros(len(WORDS), dtype=torch.float64,
                                                           device=p.device)
                self._params.append(p)
            out.append(tally)
        return out

    @torch.no_grad()
    def reset(self) -> None:
        """Zeros every tally in place (the step's cached op calls keep theirs)."""
        if self._tallies:
            torch._foreach_zero_(list(self._tallies.values()))

    def report(self, names: Any = None) -> Dict[str, Dict[str, Any]]:
        """Reads the tallies (one host read per device): ``{name: {"elements", "lost",
        "lost_share", "lost_ratio", "keep_with"}}`` in the order the parameters first
        stepped. ``elements``: the element updates counted (elements times steps);
        ``lost``: how many were lost; ``lost_share``: lost / elements; ``lost_ratio``:
        the root of the lost parts' sum of squares over the applied parts' (inf when
        nothing was applied and something lost); ``keep_with``: ``"remainder"`` where
        updates were lost, else None. ``names``: an ``nn.Module`` or ``(name, parameter)``
        pairs; an unnamed parameter is ``"<param N, shape (..)>"``."""
        names_of = _name_map(names, f"{self.owner}.report")
        by_device: Dict[torch.device, List[int]] = {}
        for row, p in enumerate(self._params):
            by_device.setdefault(self._tallies[id(p)].device, []).append(row)
        values: Dict[int, List[float]] = {}
        for rows in by_device.values():
            stacked = torch.stack([self._tallies[id(self._params[row])] for row in rows])
            for row, words in zip(rows, stacked.cpu().tolist()):  # sync-ok: report() reads
                values[row] = words
        out = {}
        for row, p in enumerate(self._params):
            lost, lost_squares, applied_squares, elements = values[row]
            ratio = (math.sqrt(lost_squares / applied_squares) if applied_squares
                     else (math.inf if lost_squares else 0.0))
            out[names_of.get(id(p), f"<param {row}, shape {tuple(p.shape)}>")] = dict(
                elements=int(elements), lost=int(lost),
                lost_share=lost / elements if elements else 0.0, lost_ratio=ratio,
                keep_with="remainder" if lost else None)
        return out

    def summary(self, names: Any = None, top: int = 3) -> str:
        """:meth:`report` as one readable line (:func:`format_precision_report`)."""
        return format_precision_report(self.report(names),
                                       check_top(f"{self.owner}.summary", top))

    def __getstate__(self) -> Dict[str, Any]:
        # Pickled empty: the tallies belong to this process's parameters.
        return {"owner": self.owner, "every": self.every}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state.get("owner", "PrecisionReport"), state.get("every", 1))


def totals(report: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """A :meth:`PrecisionReport.report`'s parameters together: ``elements``, ``lost``
    and ``lost_share``."""
    elements = sum(r["elements"] for r in report.values())
    lost = sum(r["lost"] for r in report.values())
    return dict(elements=elements, lost=lost, lost_share=lost / elements if elements else 0.0)


def format_precision_report(report: Dict[str, Dict[str, Any]], top: int = 3) -> str:
    """One line: ``"lost updates: 31.2% of 1.2e+06 in 4 of 6 parameters; most:
    fc1.weight 48.0% (lost/applied 0.62), ...; keep them with master='remainder'"``."""
    top = check_top("format_precision_report", top)
    overall = totals(report)
    elements = overall["elements"]
    if not elements:
        return "lost updates: none counted yet"
    losing = sorted(((r["lost_share"], name, r) for name, r in report.items() if r["lost"]),
                    key=lambda item: (-item[0], item[1]))
    line = (f"lost updates: {100.0 * overall['lost_share']:.2f}% of {elements:.3g} in "
            f"{len(losing)} of {len(report)} parameters")
    if not losing:
        return line
    shown = ", ".join(f"{name} {100.0 * share:.1f}% (lost/applied {r['lost_ratio']:.2g})"
                      for share, name, r in losing[:top])
    more = f" and {len(losing) - top} more" if len(losing) > top else ""
    return f"{line}; most: {shown}{more}; keep them with master='remainder'"
