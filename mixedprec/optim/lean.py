"""The lean modes of mixedprec's optimizers (docs/lean-precision.md): what is kept of
each parameter's value (``master``: fp32 masters, none, a bf16 Kahan compensation,
stochastic rounding, or the fp32 master's low half as an int16 remainder), the dtype of
moments and momentum buffers (``state_dtype``: fp32, bf16, or 8-bit, see
:mod:`mixedprec.optim.state8`), and the seeds of stochastic rounding."""

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import ops
from ..distributed import global_layout, shard_index
from ..masters import join_remainder, split_remainder
from . import state8

if TYPE_CHECKING:
    from .optimizer import _Work

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What FusedAdam and FusedSGD keep of each parameter's value ("master", see
# _master_mode); the _BF16_MODES take bf16 parameters (and fp32 ones, updated
# directly: _FusedOptimizer._lean_calls).
_MASTER_MODES = ("fp32", "none", "kahan", "stochastic", "remainder")
_BF16_MODES = ("kahan", "stochastic", "remainder")
# The state entry of each bf16 parameter in the modes that keep one.
_LEAN_STATE = {"kahan": ("kahan_comp", torch.bfloat16), "remainder": ("remainder", torch.int16)}
_STATE_DTYPES = (torch.float32, torch.bfloat16, state8.E4M3)


def _master_mode(where: str, master_weights: Optional[bool], master: Optional[str]) -> str:
    """The master mode from Apex's ``master_weights`` (True: "fp32", False: "none") and
    ``master``. ``master`` wins over ``master_weights=False`` (Apex's default, which
    then says nothing); ``master_weights=True`` with another ``master`` is a conflict."""
    if master is None:
        return "fp32" if master_weights else "none"
    if not isinstance(master, str) or master not in _MASTER_MODES:
        raise ValueError(f"{where}: expected master to be one of {list(_MASTER_MODES)}, "
                         f"got {master!r}")
    if master_weights and master != "fp32":
        raise ValueError(f"{where}: master_weights=True conflicts with master={master!r} "
                         "(master_weights=True is master='fp32'); give one of them")
    return master


def lean_refused(where: str, master: Optional[str], state_dtype: Optional[torch.dtype],
                 optimizer: Optimizer) -> TypeError:
    """The error for lean modes asked of an optimizer without them (FusedAdam and
    FusedSGD have them)."""
    return TypeError(f"{where}: master={master!r} and state_dtype={state_dtype} take "
                     f"mixedprec.FusedAdam or FusedSGD, got {type(optimizer).__name__}")


def _rounding_seed(where: str, master: str, seed: Any,
                   state_dtype: Optional[torch.dtype] = None) -> Optional[int]:
    """The base seed of stochastic rounding (master='stochastic', and the codes of 8-bit
    moments: state_dtype=torch.float8_e4m3fn): ``seed``, or drawn once from torch's
    default (CPU) generator when None, so that ``torch.manual_seed`` makes runs repeat;
    None otherwise (where a seed is an error)."""
    if master != "stochastic" and state_dtype != state8.E4M3:
        if seed is not None:
            raise ValueError(f"{where}: seed is for master='stochastic' or "
                             f"state_dtype=torch.float8_e4m3fn, got master={master!r} and "
                             f"state_dtype={state_dtype}")
        return None
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64))  # sync-ok: a CPU draw
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where}: expected seed to be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"{where}: expected seed in [0, 2**63), got {seed}")
    return seed


def _check_state_dtype(where: str, name: str, dtype: Any) -> torch.dtype:
    if dtype not in _STATE_DTYPES:
        raise TypeError(f"{where}: expected {name} to be torch.float32, torch.bfloat16 or "
                        f"torch.float8_e4m3fn, got {dtype!r}")
    return dtype



def _whole_value(p: Tensor, key: str, value: Tensor) -> Tensor:
    """The fp32 value that ``p`` and its lean state entry ``key`` ("remainder" or
    "kahan_comp") hold together: the remainder joined to p's bf16 bits, or p plus its
    compensation in fp32 (the sum Kahan's update starts from)."""
    if key == "remainder":
        return join_remainder(p.detach().to(torch.bfloat16), value)
    return p.detach().float() + value.float()


class LeanModes:
    """The optimizer base's methods for the lean modes (a mixin of _FusedOptimizer, which
    sets ``master``, ``state_dtype`` and ``_sr_seed``)."""

    # The entries of a parameter's 8-bit moments (codes; state8.SCALE_OF has their
    # scales), the first telling whether it has them; () for a class without.
    _8BIT_KEYS: Tuple[str, ...] = ()

    @property
    def master_weights(self) -> bool:
        """Apex's spelling of ``master == "fp32"``; setting it (as ``amp.initialize``
        does) switches between "fp32" and "none"."""
        return self.master == "fp32"

    @master_weights.setter
    def master_weights(self, value: bool) -> None:
        if value:
            self.master = "fp32"
        elif self.master == "fp32":
            self.master = "none"

    def _check_kahan(self, p: Tensor) -> None:
        """master='kahan', 'stochastic' and 'remainder' take bfloat16 parameters, and fp32
        ones (updated directly, see ``_lean_calls``); fp16 parameters are an error."""
        if self.master in _BF16_MODES and p.dtype == torch.float16:
            what = {"kahan": "compensates", "stochastic": "rounds stochastically into",
                    "remainder": "keeps exact fp32 masters in"}[self.master]
            raise TypeError(f"{type(self).__name__}: master={self.master!r} {what} bfloat16 "
                            "parameters (fp32 ones are updated directly), got one of dtype "
                            "torch.float16 (use master='fp32' for fp16 parameters)")

    def _lean_calls(self, items: "_Work", moments: bool = True
                    ) -> List[Tuple["_Work", Optional[List[int]], bool, bool]]:
        """The op calls of one group's parameters: (their _Work, their positions in
        ``items`` or None for all, whether the call is lean, whether its moments are
        8-bit). With master='kahan', 'stochastic' or 'remainder' the bf16 parameters go
        in a lean call (compensated, rounded stochastically, or with their remainders)
        and fp32 ones (the norms amp O2 keeps in fp32, say) in a plain call that updates
        them directly, as master='none' does: fp32 holds their updates. With
        state_dtype=torch.float8_e4m3fn (and ``moments``: the call keeps some), the
        parameters with 8-bit moments (``state8.uses_8bit``) go in calls of their own,
        the others keep fp32 moments. Otherwise one plain call."""
        lean = self.master in _BF16_MODES
        eight = moments and self.state_dtype == state8.E4M3 and bool(self._8BIT_KEYS)
        if not lean and not eight:
            return [(items, None, False, False)]
        key = self._8BIT_KEYS[0] if eight else ""
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

    def _check_precision(self, where: str, master: Optional[str],
                         state_dtype: Optional[torch.dtype]) -> None:
        """Raises unless ``_set_precision`` can apply these: lean modes on a class that
        has them, and no change to what an optimizer with state keeps."""
        if master is not None:
            _master_mode(where, None, master)
        if state_dtype is not None:
            _check_state_dtype(where, "state_dtype", state_dtype)
        if (master in _BF16_MODES or state_dtype in _STATE_DTYPES[1:]) and \
                not self._LEAN:
            raise lean_refused(where, master, state_dtype, self)
        if state_dtype is not None:
            self._check_8bit(where, state_dtype)
        if self.state and ((master is not None and master != self.master) or
                           (state_dtype is not None and state_dtype != self.state_dtype)):
            raise ValueError(f"{where}: master and state_dtype set what the optimizer keeps; "
                             "pass an optimizer that has not stepped yet")

    def _moment_dtype(self) -> torch.dtype:
        """The dtype of moments and momentum buffers that are not 8-bit: state_dtype, or
        float32 beside 8-bit ones (parameters ``state8.eligible`` refuses)."""
        return torch.float32 if self.state_dtype == state8.E4M3 else self.state_dtype

    def _check_8bit(self, where: str, state_dtype: torch.dtype,
                    groups: Optional[List[Dict[str, Any]]] = None) -> None:
        """Hook: raises where the optimizer's settings (those of ``groups``, default its
        param groups) exclude 8-bit moments (Adam's amsgrad)."""

    def _set_precision(self, where: str, master: Optional[str],
                       state_dtype: Optional[torch.dtype]) -> None:
        """``mixedprec.amp.initialize``'s ``master`` and ``state_dtype`` (None:
        unchanged), checked by ``_check_precision`` first. master='stochastic' draws
        the seeds as the constructor does."""
        self._check_precision(where, master, state_dtype)
        if (master == "stochastic" or state_dtype == state8.E4M3) and self._sr_seed is None:
            self._sr_seed = _rounding_seed(where, "stochastic", None)
            for i, group in enumerate(self.param_groups):
                group.setdefault("sr_seed", (self._sr_seed + i) % 2**63)
        if master is not None:
            self.master = master
        if state_dtype is not None:
            self.state_dtype = state_dtype
        self._invalidate_plans()

    def _compensations(self, states: List[Dict[str, Any]], params: List[Tensor]):
        """The bf16 Kahan compensation (``kahan_comp``) of each parameter with
        master='kahan', or its int16 remainder (``remainder``: the low half of its fp32
        master's bits) with master='remainder', created as zeros where absent (the
        master is then the parameter); else none."""
        if self.master not in _LEAN_STATE:
            return []
        key, dtype = _LEAN_STATE[self.master]
        return [self._state_tensor(state, key, p, dtype) for state, p in zip(states, params)]

    @torch.no_grad()
    def _convert_lean_state(self, p: Tensor, state: Dict[str, Any]) -> None:
        """Brings what ``state`` keeps of ``p``'s value into the optimizer's master mode,
        exactly, before p's first update in it: after ``load_state_dict`` of a state
        saved in another mode (``_check_loaded_modes`` refused what no exact conversion
        keeps), ``master_weights = True`` after construction, or a parameter cast to
        fp32 (``model.float()``). The whole fp32 value that a state holds: its
        ``master_param``; its remainder joined to p's bits; p plus its Kahan compensation
        in fp32 (where Kahan's next update would start).

        * master='remainder', bf16 p: a master or a Kahan pair is split into p (its
          high half) and a remainder, which join back to it bit for bit;
        * master='fp32', bf16 p: a remainder or a Kahan pair becomes p's fp32 master;
        * an fp32 p takes the whole value of a remainder or a Kahan pair;
        * otherwise a compensation or remainder that the mode does not keep is dropped
          (a DTensor's too). A master that the mode does not keep is ``_master``'s."""
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
                self._master_versions.pop(id(master), None)
            if whole is None and master is not None and type(p.data) is Tensor:
                whole = master.to(p.device).reshape(p.shape)
            if whole is not None:
                high, state["remainder"] = split_remainder(whole)
                p.copy_(high)
        elif whole is not None and p.dtype == torch.float32:
            p.copy_(whole)
        elif whole is not None and self.master == "fp32" and bf16:
            state.setdefault("master_param", whole)

    def _rounds_params(self, params: List[Tensor]) -> bool:
        """Whether an op call over ``params`` rounds them stochastically (master=
        'stochastic': its bf16 call; ``_lean_calls``)."""
        return self.master == "stochastic" and bool(params) and params[0].dtype == torch.bfloat16

    @staticmethod
    def _state_seed(group: Dict[str, Any]) -> Optional[int]:
        """The seed of the stochastic rounding of a group's 8-bit moments: its
        ``sr_seed`` moved by 2**62 (another stream than the parameters' bits)."""
        seed = group.get("sr_seed")
        return None if seed is None else (seed + 2**62) % 2**63

    def _salts(self, group: Dict[str, Any], params: List[Tensor],
               device: torch.device, eight: bool = False) -> List[Tensor]:
        """master='stochastic': each param's rounding words (a contiguous int64 tensor
        of 4 on ``device``, views of one): (salt, offset, run, stride), the salt being
        the param's position in its group and the rest where its local elements lie in
        the full tensor (``distributed.global_layout``), so that every element draws the
        bits of its index in the full tensor, whatever the sharding. A sharded DTensor
        whose shard is not runs of the full tensor (``global_layout`` None) counts its
        shard in the salt instead (position + group size * (1 + its shard index), as
        ``distributed.shard_index``), its elements by their local index: its bits then
        depend on the sharding. The same words key the rounding of 8-bit moments
        (``eight``). Else none."""
        if self.master != "stochastic" and not eight:
            return []
        count = len(group["params"])
        position = {id(p): i for i, p in enumerate(group["params"])}
        rows = []
        for p in params:
            layout = global_layout(p)
            if layout is not None:
                rows.append((position[id(p)], *layout))
                continue
            shard, shards = shard_index(p)
            if count * (1 + shards) > 2**32:  # (a salt is one 32-bit counter word)
                raise ValueError(f"{type(self).__name__}: master='stochastic' counts the "
                                 f"{count} params of a group times the {shards} shards of "
                                 "each in salts below 2**32; split the param group")
            rows.append((position[id(p)] + count * (1 + shard), 0, 0, 0))
        return ops.rounding_words(rows, device)
