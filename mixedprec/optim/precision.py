"""What an optimizer keeps of each parameter (docs/lean-precision.md), as one object the
optimizer base holds (``optimizer.precision``), built once from the constructor's
keyword-only ``master``, ``state_dtype`` and ``seed``:

* ``master``: fp32 masters ("fp32"), none ("none"), a bf16 Kahan compensation
  ("kahan"), stochastic rounding ("stochastic"), or the fp32 master's low half as an
  int16 remainder ("remainder");
* ``state_dtype``: the dtype of moments and momentum buffers (fp32, bf16, or 8-bit,
  see :mod:`mixedprec.optim.state8`);
* ``seed``: the base seed of stochastic rounding (group i's ``seed`` is seed + i).

Also here: :class:`Masters`, the fp32 masters that follow their parameters."""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import masters as mst
from .. import ops
from ..distributed import global_layout, shard_index
from . import state8

#: The parameter dtypes the fused ops step.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The values of ``master``.
MASTER_MODES = ("fp32", "none", "kahan", "stochastic", "remainder")
#: The master modes that keep bf16 parameters (fp32 ones are updated directly, fp16
#: ones refused).
BF16_MODES = ("kahan", "stochastic", "remainder")
#: The values of ``state_dtype``.
STATE_DTYPES = (torch.float32, torch.bfloat16, state8.E4M3)
# The state entry of each bf16 parameter in the modes that keep one.
_LEAN_STATE = {"kahan": ("kahan_comp", torch.bfloat16), "remainder": ("remainder", torch.int16)}
#: The master modes that keep part of a parameter's value beside it (a compensation or
#: a remainder), which a write to the parameter between steps makes stale.
LEAN_KEPT = tuple(_LEAN_STATE)


class Work(NamedTuple):
    """The parameters of one op call, their gradients and their state dicts (None for
    a parameter without state yet)."""

    params: List[Tensor]
    grads: List[Tensor]
    states: List[Optional[Dict[str, Any]]]

    def pick(self, positions: List[int]) -> "Work":
        return Work([self.params[i] for i in positions], [self.grads[i] for i in positions],
                    [self.states[i] for i in positions])


def whole_group(group: Dict[str, Any]) -> Dict[str, Any]:
    """The param group that ``group`` (a group, or a
    :class:`~mixedprec.optim.torch_path.Subset` of one) is part of."""
    return getattr(group, "whole", group)


def check_master(where: str, master: Any) -> str:
    if not isinstance(master, str) or master not in MASTER_MODES:
        raise ValueError(f"{where}: expected master to be one of {list(MASTER_MODES)}, "
                         f"got {master!r}")
    return master


def check_state_dtype(where: str, dtype: Any) -> torch.dtype:
    if dtype not in STATE_DTYPES:
        raise TypeError(f"{where}: expected state_dtype to be torch.float32, torch.bfloat16 "
                        f"or torch.float8_e4m3fn, got {dtype!r}")
    return dtype


def rounding_seed(where: str, master: str, state_dtype: torch.dtype, seed: Any
                  ) -> Optional[int]:
    """The base seed of stochastic rounding (master='stochastic', and the codes of 8-bit
    moments): ``seed``, or drawn once from torch's default (CPU) generator when None, so
    that ``torch.manual_seed`` makes runs repeat; None otherwise (a seed is then an
    error)."""
    if master != "stochastic" and state_dtype != state8.E4M3:
        if seed is not None:
            raise ValueError(f"{where}: seed is for master='stochastic' or "
                             f"state_dtype=torch.float8_e4m3fn, got master={master!r} and "
                             f"state_dtype={state_dtype}")
        return None
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64))  # sync-ok: a CPU draw
    return check_seed(where, seed)


def check_seed(where: str, seed: Any) -> int:
    """A seed of stochastic rounding: an int in [0, 2**63) (the op's int64)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where}: expected seed to be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"{where}: expected seed in [0, 2**63), got {seed}")
    return seed


def _whole_value(p: Tensor, key: str, value: Tensor) -> Tensor:
    """The fp32 value that ``p`` and its lean state entry ``key`` hold together: the
    remainder joined to p's bf16 bits, or p plus its Kahan compensation in fp32."""
    if key == "remainder":
        return mst.join_remainder(p.detach().to(torch.bfloat16), value)
    return p.detach().float() + value.float()


class Precision:
    """An optimizer's ``master``, ``state_dtype`` and ``seed``, checked, and what follows
    from them for each op call. ``lean``: whether the optimizer takes the lean modes
    (bf16 masters modes and 16/8-bit state); ``eight_keys``: the state entries of its
    8-bit moments, the first telling whether a parameter has them (() for none)."""

    def __init__(self, where: str, master: Any, state_dtype: Any, seed: Any, lean: bool,
                 eight_keys: Tuple[str, ...] = ()):
        self.lean, self.eight_keys, self.name = lean, eight_keys, where
        self.master = check_master(where, master)
        self.state_dtype = check_state_dtype(where, state_dtype)
        self.check_lean(where, self.master, self.state_dtype)
        self.seed = rounding_seed(where, self.master, self.state_dtype, seed)

    @classmethod
    def from_pickle(cls, state: Dict[str, Any], name: str, lean: bool,
                    eight_keys: Tuple[str, ...]) -> "Precision":
        """The precision of an optimizer pickled before this object existed (its state
        held ``master`` or Apex's ``master_weights``, ``state_dtype`` and ``_sr_seed``),
        taken out of ``state``."""
        precision = cls.__new__(cls)
        master = state.pop("master", None) or (
            "fp32" if state.pop("master_weights", False) else "none")
        precision.__dict__.update(master=master, state_dtype=state.pop("state_dtype",
                                                                       torch.float32),
                                  seed=state.pop("_sr_seed", None), lean=lean,
                                  eight_keys=eight_keys, name=name)
        return precision

    def check_lean(self, where: str, master: Optional[str],
                   state_dtype: Optional[torch.dtype]) -> None:
        """Lean modes only for an optimizer that takes them."""
        if (master in BF16_MODES or state_dtype in STATE_DTYPES[1:]) and not self.lean:
            raise TypeError(f"{where}: master={master!r} and state_dtype={state_dtype} take "
                            f"mixedprec.optim.Adam, AdamW or SGD, got {self.name}")

    def group_seed(self, index: int) -> Optional[int]:
        """Param group ``index``'s ``seed`` (each group its own: salts repeat)."""
        return None if self.seed is None else (self.seed + index) % 2**63

    def configure(self, where: str, master: Optional[str], state_dtype: Optional[torch.dtype],
                  has_state: bool, apply: bool = True) -> None:
        """Sets ``master`` and ``state_dtype`` (None: unchanged) after checking them: lean
        modes only where taken; with state (``has_state``), no new ``state_dtype`` and no
        switch into "kahan" or "stochastic" (what the state keeps cannot be carried over
        exactly; into "fp32", "remainder" or "none" it is, at the next step: ``convert``).
        A new stochastic mode draws the seed as the constructor does."""
        if master is not None:
            check_master(where, master)
        if state_dtype is not None:
            check_state_dtype(where, state_dtype)
        self.check_lean(where, master, state_dtype)
        if has_state and ((master in ("kahan", "stochastic") and master != self.master) or
                          (state_dtype is not None and state_dtype != self.state_dtype)):
            raise ValueError(f"{where}: master and state_dtype set what the optimizer keeps; "
                             "pass an optimizer that has not stepped yet")
        if not apply:
            return
        if (master == "stochastic" or state_dtype == state8.E4M3) and self.seed is None:
            self.seed = rounding_seed(where, "stochastic", torch.float32, None)
        self.master = self.master if master is None else master
        self.state_dtype = self.state_dtype if state_dtype is None else state_dtype

    def check_param(self, where: str, p: Tensor) -> None:
        """master='kahan', 'stochastic' and 'remainder' take bf16 parameters, and fp32
        ones (updated directly); fp16 parameters are an error."""
        if self.master in BF16_MODES and p.dtype == torch.float16:
            what = {"kahan": "compensates", "stochastic": "rounds stochastically into",
                    "remainder": "keeps exact fp32 masters in"}[self.master]
            raise TypeError(f"{where}: master={self.master!r} {what} bfloat16 parameters (fp32 "
                            "ones are updated directly), got one of dtype torch.float16 (use "
                            "master='fp32' for fp16 parameters)")

    def moment_dtype(self) -> torch.dtype:
        """The dtype of moments and buffers that are not 8-bit (float32 beside those)."""
        return torch.float32 if self.state_dtype == state8.E4M3 else self.state_dtype

    def calls(self, items: Work, moments: bool = True
              ) -> List[Tuple[Work, Optional[List[int]], bool, bool]]:
        """The op calls of one group's parameters: (their Work, their positions in
        ``items`` or None for all, whether the call is lean, whether its moments are
        8-bit). With a bf16 mode the bf16 parameters go in a lean call and fp32 ones
        (the norms amp O2 keeps in fp32, say) in a plain call that updates them
        directly. With 8-bit state (and ``moments``: the call keeps some) the
        parameters with 8-bit moments (``state8.uses_8bit``) go in calls of their own,
        the others keep fp32 moments. Otherwise one plain call."""
        lean = self.master in BF16_MODES
        eight = moments and self.state_dtype == state8.E4M3 and bool(self.eight_keys)
        if not lean and not eight:
            return [(items, None, False, False)]
        key = self.eight_keys[0] if eight else ""
        kinds = [(lean and p.dtype == torch.bfloat16,
                  eight and state8.uses_8bit(p, state or {}, key))
                 for p, state in zip(items.params, items.states)]
        order = sorted(set(kinds), reverse=True)  # (lean calls first, 8-bit first)
        if len(order) == 1:
            return [(items, None, *order[0])]
        calls = []
        for kind in order:
            positions = [i for i, k in enumerate(kinds) if k == kind]
            calls.append((items.pick(positions), positions, *kind))
        return calls

    def lean_state(self, states: List[Dict[str, Any]], params: List[Tensor], state_tensor,
                   masters: "Masters") -> List[Tensor]:
        """The Kahan compensation or remainder of each parameter (``state_tensor(state,
        key, like, dtype)`` creates it as zeros where absent) in the modes that keep
        one, each brought up to a parameter written since (:meth:`Masters.follow_lean`);
        else none."""
        if self.master not in _LEAN_STATE:
            return []
        key, dtype = _LEAN_STATE[self.master]
        kept = [state_tensor(state, key, p, dtype) for state, p in zip(states, params)]
        for p, comp in zip(params, kept):
            masters.follow_lean(p, comp)
        return kept

    def op_lean_args(self, group: Dict[str, Any], targets: List[Tensor],
                     comps: List[Tensor], salts: List[Tensor], eight: bool) -> Dict[str, Any]:
        """The keyword arguments of the lean modes for one fused op call."""
        rounds = self.master == "stochastic" and len(targets) > 0 and \
            targets[0].dtype == torch.bfloat16  # (len: dynamo traces it, not bool(list))
        seed = group.get("seed")
        return dict(kahan_comps=comps if self.master == "kahan" else None,
                    remainders=comps if self.master == "remainder" else None,
                    sr_salts=salts, sr_seed=seed if rounds else None,
                    state_seed=None if seed is None or not eight else (seed + 2**62) % 2**63)

    @torch.no_grad()
    def convert(self, p: Tensor, state: Dict[str, Any], masters: "Masters") -> None:
        """Brings what ``state`` keeps of ``p``'s value into the master mode, exactly,
        before p's first update in it (after ``load_state_dict`` of another mode's
        state, ``configure(master=...)``, or a parameter cast to fp32):

        * master='remainder', bf16 p: a master or a Kahan pair is split into p (its
          high half) and a remainder, which join back to it bit for bit;
        * master='fp32', bf16 p: a remainder or a Kahan pair becomes p's fp32 master;
        * an fp32 p takes the whole value of a remainder or a Kahan pair;
        * otherwise a compensation or remainder that the mode does not keep is dropped.
        A master the mode does not keep is :meth:`Masters.get`'s."""
        bf16 = p.dtype == torch.bfloat16
        whole = None
        for mode, (key, _) in _LEAN_STATE.items():
            if key not in state or (self.master == mode and bf16):
                continue
            value = state.pop(key)
            if whole is None and type(p.data) is Tensor and value.shape == p.shape:
                whole = _whole_value(p, key, value.to(p.device))
        if self.master == "remainder" and bf16 and "remainder" not in state:
            master = state.pop("master_param", None)
            if master is not None:
                masters.forget(master)
            if whole is None and master is not None and type(p.data) is Tensor:
                whole = master.to(p.device).reshape(p.shape)
            if whole is not None:
                high, state["remainder"] = mst.split_remainder(whole)
                p.copy_(high)
        elif whole is not None and p.dtype == torch.float32:
            p.copy_(whole)
        elif whole is not None and self.master == "fp32" and bf16 and \
                "master_param" not in state:
            state["master_param"] = whole
            if not torch.compiler.is_compiling():  # (p holds the pair's rounding: in step)
                masters.versions[id(whole)] = _seen(p)

    def salts(self, where: str, group: Dict[str, Any], params: List[Tensor],
              device: torch.device, eight: bool = False) -> List[Tensor]:
        """master='stochastic' (or ``eight``: 8-bit moments): each param's rounding words
        (a contiguous int64 tensor of 4 on ``device``, views of one): (salt, offset,
        run, stride), the salt being the param's position in its group and the rest
        where its local elements lie in the full tensor (``distributed.global_layout``),
        so that every element draws the bits of its index in the full tensor, whatever
        the sharding. A sharded DTensor whose shard is not runs of the full tensor
        counts its shard in the salt instead (position + group size * (1 + its shard
        index)), its elements by their local index: its bits then depend on the
        sharding. Else none."""
        if self.master != "stochastic" and not eight:
            return []
        group_params = whole_group(group)["params"]  # (a bucket's: its group's)
        count = len(group_params)
        position = {id(p): i for i, p in enumerate(group_params)}
        rows = []
        for p in params:
            layout = global_layout(p)
            if layout is not None:
                rows.append((position[id(p)], *layout))
                continue
            shard, shards = shard_index(p)
            if count * (1 + shards) > 2**32:  # (a salt is one 32-bit counter word)
                raise ValueError(f"{where}: master='stochastic' counts the {count} params "
                                 f"of a group times the {shards} shards of each in salts "
                                 "below 2**32; split the param group")
            rows.append((position[id(p)] + count * (1 + shard), 0, 0, 0))
        return ops.rounding_words(rows, device)


def _seen(p: Tensor) -> Tuple[int, int, torch.dtype]:
    """What a master's record holds of its parameter (:class:`Masters`): its version
    counter, its storage address and its dtype."""
    return p._version, p.data_ptr(), p.dtype


class Masters:
    """The fp32 masters of an optimizer's fp16/bf16 parameters (``state["master_param"]``),
    kept in step with their parameters: ``versions`` maps id(master) to (the version
    counter, the storage address, the dtype) of its parameter when the master was last
    in step with it (the fused update writes the parameter in place without bumping
    its counter)."""

    def __init__(self):
        self.versions: Dict[int, Tuple[int, int, torch.dtype]] = {}

    def forget(self, master: Tensor) -> None:
        self.versions.pop(id(master), None)

    @staticmethod
    @torch.no_grad()
    def hand_over(master: Tensor, p: Tensor, was: Optional[torch.dtype]) -> None:
        """``p``, an fp16/bf16 parameter of ``master`` cast to fp32 since (``model.float()``;
        or a state dict with masters loaded into an fp32 model: ``was`` None), takes the
        master's value where it holds the master's rounding to ``was`` (its dtype then;
        None: to bf16 or fp16), keeping the bits below it, as master='remainder' and
        'kahan' hand theirs over; elements written since keep their values. It is then
        its own master."""
        master = mst.follow_layout(master, p)
        if master.shape != p.shape or master.device != p.device:
            return
        value = p.detach()
        held = torch.zeros(value.shape, dtype=torch.bool, device=value.device)
        for dtype in (torch.bfloat16, torch.float16) if was is None else (was,):
            held |= master.to(dtype).to(value.dtype) == value
        p.copy_(torch.where(held, master, value))

    def follow_lean(self, p: Tensor, kept: Tensor) -> None:
        """The Kahan compensation or remainder ``kept`` of bf16 ``p``, after p was written
        outside the optimizer (its version counter or storage moved since the step that
        last kept it: an in-place edit under ``no_grad``, ``model.load_state_dict``,
        ``p.data = new``): zeroed where p is now 0 or not finite, so that p is its
        master's value there (a remainder joined to a zeroed p made a NaN: p's bits 0
        less a negative remainder; a compensation, a value p was not given); elsewhere
        kept, below the written value's bf16 bits (the same values written again, as a
        resume that loads the model after the optimizer does, keep their exact masters)."""
        if torch.compiler.is_compiling():  # (id() and the counter are not traceable)
            return
        seen = _seen(p)
        was = self.versions.setdefault(id(kept), seen)
        if was != seen:
            with torch.no_grad():
                kept.masked_fill_((p == 0) | ~torch.isfinite(p), 0)
            self.versions[id(kept)] = seen

    def new(self, p: Tensor, state: Dict[str, Any]) -> Tensor:
        """A fresh fp32 master of ``p`` in its ``state``."""
        master = state["master_param"] = mst.make_master(p)
        if not torch.compiler.is_compiling():  # (id() is not traceable)
            self.versions[id(master)] = _seen(p)
        return master

    def get(self, p: Tensor, state: Dict[str, Any], precision: Precision) -> Optional[Tensor]:
        """p's fp32 master in p's ``state``, or None when p needs none.

        The master follows the parameter: created when the model was cast to 16 bits
        after the optimizer was built, moved and re-laid-out with it, dropped while the
        parameter is fp32 (it is then its own master), and brought up to the parameter
        when the parameter was written outside the optimizer: its version counter
        moved (``load_state_dict`` on the model, an in-place edit under ``no_grad``),
        or it holds other data (``p.data = new``, a model moved or converted: its
        storage address changed). The elements written take the parameter's value,
        the others keep their fp32 value (:func:`mixedprec.masters.retake_master`).
        In-place edits through ``.data`` (``p.data.clamp_(...)``) move no counter and
        keep the storage: they are not seen, and the next step writes the master over
        them (edit under ``torch.no_grad()`` instead: ``p.clamp_(...)``)."""
        precision.convert(p, state, self)
        if precision.master != "fp32" or not mst.needs_master(p):
            if state.get("master_param") is not None:
                master = state.pop("master_param")
                was = self.versions.pop(id(master), None)
                if p.dtype == torch.float32 and not torch.compiler.is_compiling():
                    self.hand_over(master, p, None if was is None else was[2])
            return None
        master = state.get("master_param")
        if master is None:
            return self.new(p, state)
        # (Under torch.compile the version counter is not traceable: not checked there.)
        if not torch.compiler.is_compiling():
            seen = _seen(p)
            was = self.versions.get(id(master))
            # written, other data, or a master not seen before (loaded, or an optimizer's
            # copy: p may have been written since): the master takes what differs
            if was != seen:
                self.versions.pop(id(master), None)
                if master.shape != p.shape:
                    return self.new(p, state)
                master = state["master_param"] = mst.follow_layout(master, p)
                mst.retake_master(master, p, was=(was or seen)[2])
                self.versions[id(master)] = seen
                return master
        moved = mst.follow_layout(master, p)
        if moved is not master:
            self.versions[id(moved)] = self.versions.pop(id(master), _seen(p))
            state["master_param"] = moved
        return moved


def pick(grads: List[Tensor], positions: Optional[List[int]]) -> List[Tensor]:
    """The gradients of one op call of a group (:meth:`Precision.calls`' positions)."""
    return grads if positions is None else [grads[i] for i in positions]


def positions_in(picked: List[int], positions: Optional[List[int]], count: int
                 ) -> Optional[List[int]]:
    """The positions in the group's gradients (``count`` of them) of an op call's
    parameters, ``picked`` from a :meth:`Precision.calls` call at ``positions``: None
    when they are all of them in order, so that :func:`pick` then builds no list."""
    where = picked if positions is None else [positions[i] for i in picked]
    return None if len(where) == count and where == list(range(count)) else where
