"""The optimizers' state: creating it (:func:`state_tensor`, :func:`group_step`), the
applied-steps count (:func:`count_applied`), and loading a state dict (:func:`load`, the
base's ``load_state_dict``):
groups, sizes and dtypes checked before anything changes, float32 state kept float32
next to fp16/bf16 parameters, group-level step counts, state saved in another master
mode converted or refused; and the state's containers (:class:`ParamStates`,
``optimizer.state``, and :class:`ParamState`, a parameter's), which count the entries
replaced or removed, so that a step's kept op call (:mod:`.plans`) sees them."""

from collections import defaultdict
from typing import Any, Dict, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .. import masters as mst
from . import state8

# State entries shaped like their parameter, with the dtype they must have: masters
# and Adagrad's sums are float32; moments and momentum buffers have the optimizer's
# state_dtype (None here; with 8-bit moments, state8.expected says); Kahan
# compensations are bfloat16, remainders int16.
_PARAM_STATE = {"master_param": torch.float32, "sum": torch.float32, "momentum_buffer": None,
                "exp_avg": None, "exp_avg_sq": None, "max_exp_avg_sq": None,
                "kahan_comp": torch.bfloat16, "remainder": torch.int16}
# The entries that hold part of a 16-bit parameter's value, the master mode that keeps
# each, and the modes that take it exactly from another mode's state dict (converted at
# the parameter's next step: Precision.convert); the other modes refuse it.
_MODE_STATE = {"master_param": ("fp32", "an fp32 master"),
               "kahan_comp": ("kahan", "a Kahan compensation"),
               "remainder": ("remainder", "a remainder (the low half of an fp32 master)")}
_EXACT_FROM = {"fp32": ("kahan_comp", "remainder"), "remainder": ("master_param", "kahan_comp")}


class _Edits:
    """The number of entries of an optimizer's state replaced or removed so far (of
    ``optimizer.state`` and of every parameter's state dict in it)."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0


_ABSENT = object()


class _CountsEdits:
    """What :class:`ParamState` and :class:`ParamStates` share: the dict methods that
    remove entries or set them, each counting an edit (``_edited``) through the class's
    own ``__setitem__`` or directly."""

    __slots__ = ()

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self._edited()

    def pop(self, key, *default):
        if key in self:
            self._edited()
        return dict.pop(self, key, *default)

    def popitem(self):
        item = dict.popitem(self)
        self._edited()
        return item

    def clear(self):
        if self:
            self._edited()
        dict.clear(self)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):  # (the entries, without the count: pickle, deepcopy)
        return type(self), (), None, None, iter(self.items())


class ParamState(_CountsEdits, dict):
    """A parameter's state (``optimizer.state[p]``): a dict that counts, in its
    optimizer's :class:`_Edits`, every entry set to another object, deleted or popped
    (``state["exp_avg"] = torch.zeros_like(p)``, ``state.clear()``, ...), so that the
    next step makes its op call again from the state as it is instead of reusing the
    tensors of the last one (:meth:`mixedprec.optim.plans.PlanCache.planned`). Writing
    an entry's object again counts nothing, nor does an in-place change of a tensor (the
    op call holds the tensor itself). It pickles, copies and saves as a dict does."""

    __slots__ = ("_edits",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._edits: Optional[_Edits] = None  # (set by the ParamStates that holds it)

    def _edited(self) -> None:
        if self._edits is not None:
            self._edits.count += 1

    def __setitem__(self, key, value):
        if dict.get(self, key, _ABSENT) is not value:
            self._edited()
        dict.__setitem__(self, key, value)


class ParamStates(_CountsEdits, defaultdict):
    """``optimizer.state``: torch's ``defaultdict`` of parameter -> state dict, whose
    state dicts are :class:`ParamState` s counting their edits in one :class:`_Edits`
    (``edits``), as do its own entries set to another object, deleted or popped
    (``optimizer.state[p] = {}``). A dict set as a parameter's state is taken as a
    ParamState copy of it (a ParamState that is no other optimizer's: as it is)."""

    def __init__(self, default_factory: Any = None, *args, **kwargs):
        super().__init__(ParamState)  # (whatever the factory: __missing__ makes the entry)
        #: The edits counted (:class:`_Edits`).
        self.edits = _Edits()
        self.update(*args, **kwargs)

    def _edited(self) -> None:
        self.edits.count += 1

    def __missing__(self, key):
        self[key] = ParamState()
        return dict.__getitem__(self, key)

    def __setitem__(self, key, value):
        if isinstance(value, dict):
            if type(value) is not ParamState or value._edits not in (None, self.edits):
                value = ParamState(value)
            value._edits = self.edits
        if dict.get(self, key, _ABSENT) is not value:
            self._edited()
        dict.__setitem__(self, key, value)

    def copy(self) -> defaultdict:
        """A shallow copy, as a plain ``defaultdict`` (the same state dicts, no count)."""
        return defaultdict(dict, self)

    __copy__ = copy

    def __repr__(self) -> str:
        return f"ParamStates({dict.__repr__(self)})"


# Both flatten as the dict and defaultdict they are, for what walks a state with
# torch's pytree (tree_map, tree_leaves: benchmarks, checkpointing code); unflattened,
# they are a plain dict and torch's defaultdict(dict), as torch.optim's state maps to.
def _flatten(states: dict) -> Tuple[list, list]:
    return list(states.values()), list(states.keys())


def _flatten_with_keys(states: dict) -> Tuple[list, list]:
    return [(pytree.MappingKey(k), v) for k, v in states.items()], list(states.keys())


for _cls, _made in ((ParamState, dict), (ParamStates, lambda pairs: defaultdict(dict, pairs))):
    pytree.register_pytree_node(
        _cls, _flatten, lambda values, keys, made=_made: made(zip(keys, values)),
        serialized_type_name=f"mixedprec.optim.state.{_cls.__name__}",
        flatten_with_keys_fn=_flatten_with_keys)


def tracked(states: Any) -> ParamStates:
    """``states`` (an optimizer's ``state``) as a :class:`ParamStates`: itself when it
    is one, else one with its entries (a plain dict set by a script or an old pickle)."""
    return states if type(states) is ParamStates else ParamStates(None, states)


#: Param-group keys renamed since an earlier release: the old name -> today's.
RENAMED_GROUP_KEYS = {"sr_seed": "seed"}


def renamed_keys(group: Dict[str, Any]) -> Dict[str, Any]:
    """A saved or unpickled param group with today's names for renamed keys."""
    return {RENAMED_GROUP_KEYS.get(key, key): value for key, value in group.items()}


def state_tensor(state: Dict[str, Any], key: str, like: Tensor,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """state[key] on like's device and in its layout, created as zeros of ``dtype`` (a
    DTensor's state is a DTensor with its placements) if absent."""
    value = state.get(key)
    if value is None:
        value = state[key] = torch.zeros_like(like, dtype=dtype,
                                              memory_format=torch.preserve_format)
    else:
        value = state[key] = mst.follow_layout(value, like)
    return value


def group_step(group: Dict[str, Any], device: torch.device) -> Tensor:
    """``group["step"]`` (the group's step count, Apex's layout) on ``device``, a float32
    tensor of shape [1], created from the number it holds (0 if absent)."""
    step = group.get("step")
    if not isinstance(step, Tensor):
        step = group["step"] = torch.full((1,), float(step or 0), dtype=torch.float32,
                                          device=device)
    elif step.device != device:  # the model moved after the optimizer was built
        step = group["step"] = step.to(device)
    return step


def count_device(opt) -> torch.device:
    """Where ``opt.applied_steps`` lives: its first parameter's device (else the CPU)."""
    for group in opt.param_groups:
        if group["params"]:
            return group["params"][0].device
    return torch.device("cpu")


def count_applied(opt, found_inf: Optional[Tensor]) -> None:
    """``opt.applied_steps += 1`` unless ``found_inf`` is set, on the device; the
    precision report's step count (on the host: which steps it samples) advances."""
    if opt.precision_report is not None:
        opt.precision_report.advance()
    device = found_inf.device if found_inf is not None else count_device(opt)
    if opt.applied_steps.device != device:
        opt.applied_steps = opt.applied_steps.to(device)
    if found_inf is None:
        opt.applied_steps.add_(1)
    else:  # (the bool flag is promoted in the add: one kernel, not a cast and an add)
        opt.applied_steps.add_((found_inf if found_inf.dim() == 0
                                else found_inf.reshape(())) == 0)


def whole_count(value: Any) -> Optional[int]:
    """A loaded count (a step count, ``applied_steps``) as an int when it is a whole
    number >= 0, given as a number or a one-element real tensor (read on the host:
    loading, not a step); else None."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        value = value.detach().reshape(()).cpu().item()  # sync-ok: loading, not a step
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 <= value < float("inf") or value != int(value):
        return None
    return int(value)


def load_group_step(opt, new_group: Dict[str, Any], group: Dict[str, Any]) -> None:
    """A loaded group's ``step``: a number (an Apex-style int, a start count) stays as
    it is; a 1-element tensor becomes a float32 copy on the group's device."""
    step = new_group.get("step")
    if step is None or isinstance(step, (int, float)) and not isinstance(step, bool) \
            and step >= 0:
        return
    if not isinstance(step, Tensor) or step.numel() != 1:
        raise ValueError(f"{type(opt).__name__}.load_state_dict: a param group's 'step' "
                         "must be a number >= 0 or a 1-element tensor")
    device = group["params"][0].device if group["params"] else step.device
    new_group["step"] = step.to(device, torch.float32, copy=True).reshape(1)


def load(opt, state_dict: Dict[str, Any]) -> None:
    """Loads a state dict into optimizer ``opt``.

    Unlike ``torch.optim.Optimizer.load_state_dict``, float32 state (masters,
    moments, momentum buffers) stays float32 instead of being cast to the dtype of
    fp16/bf16 parameters. Groups, sizes and dtypes are checked first; on a mismatch
    a ValueError names it and nothing is changed. The optimizer's load_state_dict
    pre- and post-hooks run as in torch.
    """
    name = type(opt).__name__
    state_dict = state_dict.copy()
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        hook_result = pre_hook(opt, state_dict)
        if hook_result is not None:
            state_dict = hook_result
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"{name}.load_state_dict: expected a state dict with 'state' and "
                         f"'param_groups', got one without {missing}")
    saved_groups = state_dict["param_groups"]
    if not isinstance(state_dict["state"], dict) or not isinstance(saved_groups, (list, tuple)) \
            or not all(isinstance(g, dict) and "params" in g for g in saved_groups):
        raise ValueError(f"{name}.load_state_dict: expected 'state' to be a dict and "
                         "'param_groups' a list of dicts with 'params', got "
                         f"{type(state_dict['state']).__name__} and {saved_groups!r:.200}")
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"{name}.load_state_dict: the state dict has {len(saved_groups)} param groups, "
            f"the optimizer has {len(opt.param_groups)}"
        )
    id_to_param: Dict[Any, Tensor] = {}
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                f"{name}.load_state_dict: param group {i} has {len(saved['params'])} "
                f"params in the state dict and {len(group['params'])} in the optimizer"
            )
        id_to_param.update(zip(saved["params"], group["params"]))

    saved_groups = [opt._upgrade_group(dict(saved)) for saved in saved_groups]
    for i, saved in enumerate(saved_groups):
        missing = sorted(k for k in opt.defaults if k not in saved)
        if missing:
            raise ValueError(
                f"{name}.load_state_dict: param group {i} of the state dict has no "
                f"{missing}: it was not saved by a {name}")
    new_state: Dict[Tensor, Dict[str, Any]] = {}
    for key, saved_state in state_dict["state"].items():
        if key not in id_to_param:
            raise ValueError(f"{name}.load_state_dict: state for unknown param id {key}")
        _check_together(opt, key, saved_state)
        unknown = sorted(k for k in saved_state if k not in opt._STATE_KEYS)
        if unknown:
            raise ValueError(
                f"{name}.load_state_dict: the state of param {key} has {unknown}, which "
                f"a {name} does not keep (it keeps {list(opt._STATE_KEYS)}): the state "
                f"dict was saved by another optimizer")
        p = id_to_param[key]
        saved_state = _widened_moments(opt, p, saved_state)
        new_state[p] = {k: opt._loaded_value(p, key, k, v) for k, v in saved_state.items()}
        _check_loaded_modes(opt, p, key, saved_state)
        state8.check_pairs(f"{name}.load_state_dict: state[{key}]", new_state[p])

    applied = _loaded_applied_steps(opt, state_dict.get("applied_steps", 0))
    new_groups = []
    for group, saved in zip(opt.param_groups, saved_groups):
        new_group = {k: v for k, v in saved.items() if k != "params"}
        if "param_names" in group:  # (as torch: kept when the state dict has none)
            new_group.setdefault("param_names", group["param_names"])
        if "seed" in group:  # (a state dict saved in another mode has none)
            new_group.setdefault("seed", group["seed"])
        opt._load_group_state(new_group, group)
        new_group["params"] = group["params"]
        new_groups.append(new_group)
    opt._check_8bit(f"{name}.load_state_dict", opt.state_dtype, new_groups)

    # (everything checked: from here on nothing raises)
    opt.state.clear()
    opt.state.update(new_state)
    opt.masters.versions.clear()  # loaded masters are in step with the loaded model
    opt.param_groups = new_groups
    opt.applied_steps.fill_(applied)
    for group in opt.param_groups:  # (torch's format: a None or no momentum buffer)
        for p in group["params"]:
            state = opt.state.get(p)
            if state and state.get("momentum_buffer", 0) is None:
                del state["momentum_buffer"]
            if state == {}:
                del opt.state[p]
    _share_steps(opt)
    opt.plans.invalidate()
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)

def _loaded_applied_steps(opt, value: Any) -> int:
    """The saved ``applied_steps`` (0 when absent: a torch.optim state dict) as an
    int >= 0 (read on the host once, when loading)."""
    count = whole_count(value)
    if count is None:
        one = isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex()
        shown = value.detach().reshape(()).cpu().item() if one else value  # sync-ok: loading
        raise ValueError(f"{type(opt).__name__}.load_state_dict: expected "
                         f"'applied_steps' to be an int >= 0, got {shown!r}")
    return count

def loaded_value(opt, p: Tensor, param_id: Any, key: str, value: Any) -> Any:
    """A loaded state entry, checked and copied to where it belongs: a step count must be
    whole (:func:`whole_count`); torch's layout (its dtype, a CPU step) for parameters
    that torch's implementation steps; shape and dtype checked for the others."""
    if key == "step" and whole_count(value) is None:
        raise ValueError(f"{type(opt).__name__}.load_state_dict: state[{param_id}]['step'] "
                         f"must be a whole number >= 0, got {value!r}")
    if not opt._fused_dtype(p) and isinstance(value, Tensor):  # torch's layout
        if key == "step":
            return value.to("cpu", torch.float32, copy=True)
        return value.to(p.device, p.dtype if value.is_floating_point() else value.dtype,
                        copy=True)
    where = f"{type(opt).__name__}.load_state_dict: state[{param_id}][{key!r}]"
    if not isinstance(value, Tensor) or value.layout != torch.strided:
        # (a momentum buffer may be None, or sparse: torch's SGD makes one from a sparse
        # gradient, and its step takes it back)
        if (key in _PARAM_STATE or key in state8.ONLY_8BIT) and key != "momentum_buffer":
            got = type(value).__name__ if not isinstance(value, Tensor) else \
                f"a tensor of layout {value.layout}"
            raise ValueError(f"{where} must be a dense tensor, got {got}")
        if key == "momentum_buffer" and not isinstance(value, (Tensor, type(None))):
            raise ValueError(f"{where} must be a tensor or None, got {type(value).__name__}")
        return value
    if key in _PARAM_STATE or key in state8.ONLY_8BIT:
        shape, expected = state8.expected(p, key, opt.state_dtype, where) or (
            tuple(p.shape), _PARAM_STATE[key])
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{where} has shape {tuple(value.shape)}, expected "
                             f"{tuple(shape)} (the parameter's is {tuple(p.shape)})")
        if key in state8.SCALE_OF.values():
            value = state8.as_bytes(value)
        if value.dtype != expected:
            hint = ""
            if key in _WIDENED_KEYS or key in state8.SCALE_OF:  # (a moment)
                hint = ("; moments load into wider ones exactly (16-bit into float32, "
                        "8-bit into float32 or bfloat16), never into narrower ones: load "
                        f"it with state_dtype={value.dtype}")
            raise ValueError(f"{where} has dtype {value.dtype}, expected {expected} (the "
                             f"optimizer's setting: state_dtype={opt.state_dtype}){hint}")
    return value.to(p.device, copy=True)


# 16-bit moments that loading widens exactly into float32 moments (8-bit ones:
# _widened_moments).
_WIDENED_16 = (torch.bfloat16, torch.float16)
# The entries loading widens: the moments, whose dtype is the state_dtype's (None in
# _PARAM_STATE), and Adagrad's float32 sums.
_WIDENED_KEYS = tuple(k for k, kept in _PARAM_STATE.items() if kept is None) + ("sum",)


def _widened_moments(opt, p: Tensor, saved: Dict[str, Any]) -> Dict[str, Any]:
    """``saved`` (a parameter's saved state, left as it is) with its moments widened
    where this optimizer keeps them wider, exactly: bf16 or fp16 moments (and Adagrad's
    sums) into float32 (torch.optim's own state dict of a bf16 or fp16 model), and
    8-bit moments (codes and scales: ``state8.decode``, the root squared for
    ``exp_avg_sq``) into float32 or, where every value is a bf16, bfloat16. Narrower
    moments than saved are left, for :func:`loaded_value` to refuse (rounding them is
    not loading them); so are entries it refuses anyway (another shape, codes without
    scales, DTensor codes)."""
    if not opt._fused_dtype(p) or (opt.state_dtype == state8.E4M3 and state8.eligible(p)):
        return saved  # (torch's layout takes any dtype; 8-bit moments are narrowest)
    target = opt.precision.moment_dtype()
    out = dict(saved)
    for key, scale_key in state8.SCALE_OF.items():
        codes, scales = out.get(key), out.get(scale_key)
        name = "exp_avg_sq" if key == "exp_avg_sq_root" else key
        if not (type(codes) is Tensor and type(scales) is Tensor and  # (no DTensor)
                codes.dtype == state8.E4M3 and tuple(codes.shape) == tuple(p.shape) and
                tuple(scales.shape) == state8.scale_shape(p) and name in opt._STATE_KEYS and
                (name == key or name not in out)):
            continue
        values = state8.decode(codes, scales)
        if key == "exp_avg_sq_root":
            values = values * values
        if target != torch.float32:
            narrowed = values.to(target)
            if not torch.equal(narrowed.float(), values):  # sync-ok: loading a state dict
                continue
            values = narrowed
        del out[key], out[scale_key]
        out[name] = values
    for key in _WIDENED_KEYS:
        value = out.get(key)
        wide = _PARAM_STATE[key] or target  # (Adagrad's sums: float32)
        if (wide == torch.float32 and isinstance(value, Tensor) and value.dtype in _WIDENED_16
                and tuple(value.shape) == tuple(p.shape)):
            out[key] = value.to(wide)
    return out


def _check_together(opt, param_id: Any, saved: Any) -> None:
    """Refuses a parameter's saved state that is not a dict, or that has some of the
    entries the class makes together (``_STATE_TOGETHER``, those it keeps) but not all:
    a truncated or edited state dict, whose missing entries would start again from zero
    (a step count with old moments: the wrong bias correction)."""
    name = type(opt).__name__
    if not isinstance(saved, dict):
        raise ValueError(f"{name}.load_state_dict: the state of param {param_id} must be a "
                         f"dict, got {type(saved).__name__}")
    together = [names for names in opt._STATE_TOGETHER
                if any(n in opt._STATE_KEYS for n in names)]
    present = [any(n in saved for n in names) for names in together]
    if any(present) and not all(present):
        missing = [" or ".join(repr(n) for n in names)
                   for names, there in zip(together, present) if not there]
        raise ValueError(f"{name}.load_state_dict: the state of param {param_id} has no "
                         f"{', '.join(missing)} (the optimizer keeps "
                         f"{', '.join('/'.join(names) for names in together)} together): "
                         "the state dict was truncated or edited")


def _check_loaded_modes(opt, p: Tensor, param_id: Any, saved: Dict[str, Any]) -> None:
    """Refuses state entries of another master mode that this optimizer's mode cannot
    take exactly (``_EXACT_FROM``): a master or remainder into master='none', 'kahan'
    or 'stochastic', a Kahan compensation into 'none' or 'stochastic'. (An fp32
    parameter is its own master: its entries say nothing more.)"""
    if p.dtype not in (torch.float16, torch.bfloat16):
        return
    for key, (mode, what) in _MODE_STATE.items():
        if key not in saved or mode == opt.master:
            continue
        where = f"{type(opt).__name__}.load_state_dict: state[{param_id}][{key!r}] is {what}"
        if key not in _EXACT_FROM.get(opt.master, ()):
            exact = [m for m, keys in _EXACT_FROM.items() if key in keys]
            raise ValueError(f"{where}, which master={opt.master!r} cannot keep exactly; "
                             f"load it into an optimizer with master in "
                             f"{sorted({mode, *exact})}")
        if type(p.data) is not Tensor:  # (a DTensor: its local shards are not split)
            raise ValueError(f"{where}, which master={opt.master!r} takes from master="
                             f"{mode!r} exactly for plain tensors only, not for a "
                             f"{type(p.data).__name__} parameter; load it into an "
                             f"optimizer with master={mode!r}")


def _share_steps(opt) -> None:
    """Loaded per-parameter step counts: a float32 tensor on the parameter's device, one
    per group and value, shared by the parameters that the fused op steps together
    (read on the host here, once, when loading). A group that torch's implementation
    steps keeps one count per parameter, as torch does."""
    for group in opt.param_groups:
        if not opt._fused_group(group):
            continue
        shared: Dict[Tuple[torch.device, float], Tensor] = {}
        for p in group["params"]:
            state = opt.state.get(p)
            if not state or "step" not in state or not opt._fused_dtype(p):
                continue
            value = float(state["step"])  # sync-ok: loading a state dict, not a step
            key = (p.device, value)
            if key not in shared:
                shared[key] = torch.tensor(value, dtype=torch.float32, device=p.device)
            state["step"] = shared[key]
