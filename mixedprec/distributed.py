"""mixedprec on torch.distributed's own engines: the ops take DTensor arguments (FSDP2,
tensor parallelism), and sharded gradients give one overflow decision on all ranks.

**How a mixedprec op runs on DTensors.** On each rank, on the local shards. A
pointwise list op (an unscale, an optimizer update) computes on a shard exactly what
it computes there on the whole tensor, whatever the placements, as long as the lists
of one call agree: gradients are first redistributed to their parameter's placements
where they differ (a ``Partial`` gradient of a replicated parameter is all-reduced,
as DTensor does for ``torch.optim``). State made from a DTensor parameter
(``zeros_like``, ``detach().float()``) is a DTensor with its placements, so an
optimizer's ``state_dict`` is sharded like the model's and
``torch.distributed.checkpoint`` saves and reshards it.

The ops are registered as *handlers* in DTensor's dispatcher, the mechanism torch
uses for its own ``_amp_foreach_non_finite_check_and_unscale_``: a call with a
DTensor argument reaches :func:`_run_on_shards`; a call without one never sees this
module (no cost for single-device training). Sharding rules
(``torch.distributed.tensor.experimental.register_sharding``) were tried and not
chosen: they refuse in-place list ops on sharded tensors ("in-place operations that
require placement changes are not supported", torch 2.11), and a rule per op says
nothing the local run does not. Results that depend on whole tensors are reduced
across shards here: the overflow flag and the L2 norms. The optimizer ops that take
per-tensor norms inside (LAMB's trust ratio, NovoGrad's second moment) run tensor by
tensor on all-gathered whole tensors when a parameter is sharded: correct, and slower
than the pointwise ops (:func:`_run_on_whole_tensors`).

**Overflow across ranks.** Each rank checks only its shards: the flag written by
``multi_tensor_unscale_``, ``multi_tensor_unscale_to_`` and
``multi_tensor_check_finite_`` on DTensors is all-reduced (MAX) over the mesh
dimensions on which the gradients are not replicated, on the device, without a host
read, so every rank skips the same steps and the scales stay equal. Plain tensors
(DDP) get no collective: DDP's all-reduce of the gradients already spreads an inf to
every rank. A gradient changed on one rank after that all-reduce is then seen by
that rank alone, as with torch's GradScaler: its overflow skips that rank's step only
(the replicas have diverged anyway, through the changed gradient).
"""

import importlib.abc
import importlib.util
import math
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["global_layout", "is_dtensor", "register_ops", "register_ops_on_import", "shard_index"]

# Ops that write an overflow flag from their first list: the flag is agreed across ranks.
_FLAG_OPS = {"multi_tensor_unscale_": 0, "multi_tensor_unscale_to_": 0,
             "multi_tensor_check_finite_": 0}
# Ops whose math needs whole tensors (per-tensor norms inside the op: LAMB's trust
# ratio, NovoGrad's second moment): their per-tensor lists, and those the op writes.
_WHOLE_TENSOR_OPS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "fused_lamb_": (("params", "grads", "exp_avgs", "exp_avg_sqs", "model_params"),
                    ("params", "exp_avgs", "exp_avg_sqs", "model_params")),
    "fused_novograd_": (("params", "grads", "exp_avgs", "model_params"),
                        ("params", "exp_avgs", "model_params")),
}


_DTENSOR = "torch.distributed.tensor"


def _dtensor_class() -> Optional[type]:
    """DTensor, or None while torch.distributed.tensor is not imported (mixedprec does not
    import it; no DTensor exists before it is)."""
    return getattr(sys.modules.get(_DTENSOR), "DTensor", None)


def is_dtensor(t: object) -> bool:
    DTensor = _dtensor_class()
    return DTensor is not None and isinstance(t, DTensor)


def _local(value: Any) -> Any:
    """``value`` with DTensors (alone or in a list) replaced by their local shards, the
    same storage (an in-place write reaches the DTensor)."""
    DTensor = _dtensor_class()
    if DTensor is None:
        return value
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, (list, tuple)):
        return [v.to_local() if isinstance(v, DTensor) else v for v in value]
    return value


def _local_grads(grads: Sequence[Tensor], params: Sequence[Tensor]) -> List[Tensor]:
    """The local shards of ``grads``, each first redistributed to its parameter's mesh
    and placements where they differ (a collective)."""
    DTensor = _dtensor_class()
    if DTensor is None:
        return list(grads)
    out = []
    for g, p in zip(grads, params):
        if isinstance(g, DTensor) and isinstance(p, DTensor) and (
                g.placements != p.placements or g.device_mesh != p.device_mesh):
            g = g.redistribute(p.device_mesh, p.placements)
        out.append(g.to_local() if isinstance(g, DTensor) else g)
    return out


def _sharded_dims(t: Any) -> list:
    """The process groups of the mesh dimensions on which DTensor ``t`` is sharded (not
    replicated) across more than one rank; [] for a plain tensor."""
    if not is_dtensor(t):
        return []
    mesh = t.device_mesh
    return [mesh.get_group(dim) for dim, placement in enumerate(t.placements)
            if not placement.is_replicate() and mesh.size(dim) > 1]


def _sharded_groups(tensors: Sequence[Any]) -> list:
    """The process groups on which some DTensor of ``tensors`` is sharded, in a fixed
    order (the same on every rank, as every rank holds the same parameters)."""
    groups: list = []
    for t in tensors:
        for group in _sharded_dims(t):
            if group not in groups:
                groups.append(group)
    return groups


def _splits(placement: Any) -> bool:
    """Whether ``placement`` splits the tensor among the ranks: Shard, and
    _StridedShard, which torch 2.11 does not count as is_shard()."""
    return not placement.is_replicate() and not placement.is_partial()


def shard_index(t: Any) -> Tuple[int, int]:
    """(this rank's shard of DTensor ``t`` among its shards, how many shards): over the
    mesh dimensions on which ``t`` is sharded, so that replicas share an index; (0, 1)
    for a plain tensor. From the mesh's metadata: no collective, no device read."""
    if not is_dtensor(t):
        return 0, 1
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    index, count = 0, 1
    for dim, placement in enumerate(t.placements):
        if _splits(placement) and mesh.size(dim) > 1:
            index = index * mesh.size(dim) + coordinate[dim]
            count *= mesh.size(dim)
    return index, count


def _memory_order(t: Tensor) -> Optional[Tuple[int, ...]]:
    """The dimensions of dense tensor ``t`` from outermost to innermost in memory:
    contiguous, channels_last or channels_last_3d; None for another layout."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return (0, 2, 3, 1)
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return (0, 2, 3, 4, 1)
    return None


def global_layout(t: Any) -> Optional[Tuple[int, int, int]]:
    """Where the local elements of ``t`` lie in the full tensor, as (offset, run,
    stride): the local element at position i of the local shard's memory is element
    ``offset + (i // run) * stride + i % run`` of the full tensor in the same memory
    format (run 0: ``offset + i``). Sharding along the outermost dimension (FSDP2's
    Shard(0), even or not, on one or several mesh dimensions) gives one run; along an
    inner one (tensor parallelism's Shard(1)), runs of the rows' local part. (0, 0, 0)
    for a plain or replicated tensor. None where the local elements are not such runs
    (a _StridedShard placement, as FSDP2 over tensor parallelism on the same dimension
    gives; shards of two dimensions with a full one between them; a layout other than
    contiguous or channels_last). From the DTensor's metadata: no collective."""
    if not is_dtensor(t) or not any(_splits(p) for p in t.placements):
        return 0, 0, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(p.is_shard() or not _splits(p) for p in t.placements):
        return None  # _StridedShard, or a split torch added since
    order = _memory_order(t.to_local())
    if order is None:
        return None
    local, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    full = [t.shape[d] for d in order]
    local = [local[d] for d in order]
    offsets = [offsets[d] for d in order]
    partial = [d for d in range(len(full)) if local[d] != full[d]]
    if not partial or math.prod(local) == 0:
        return 0, 0, 0
    last = partial[-1]
    inner = math.prod(full[last + 1:])
    # The dimensions before `last` must hold one contiguous range of their flat index:
    # single entries, then at most one partial dimension, then full ones.
    first = partial[0]
    if first < last and (any(local[d] != 1 for d in range(first))
                         or any(d in partial for d in range(first + 1, last))):
        return None
    outer = sum(offsets[d] * math.prod(full[d + 1:last]) for d in range(last))
    stride = full[last] * inner
    offset = outer * stride + offsets[last] * inner
    if math.prod(local[:last]) == 1:
        return offset, 0, 0
    return offset, local[last] * inner, stride


def agree_found_inf(found_inf: Tensor, tensors: Sequence[Any]) -> None:
    """Makes ``found_inf`` the maximum over the ranks that hold other shards of the
    DTensors among ``tensors``: an all-reduce on the device, no host read."""
    for group in _sharded_groups(tensors):
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def _without_partial(t: Any) -> Any:
    """``t`` with pending (``Partial``) reductions done: a partial sum's norm is not the
    sum of the partial norms."""
    if not is_dtensor(t) or not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in t.placements]
    return t.detach().redistribute(t.device_mesh, placements)


def _l2norm_on_shards(args: Dict[str, Any]) -> Tuple[Tensor, Tensor]:
    """``multi_tensor_l2norm`` of DTensors: each tensor's local sum of squares, summed
    over the ranks that hold its other shards (a replicated tensor counts once), then
    the square roots; the total from the per-tensor sums."""
    tensors = [_without_partial(t) for t in args["tensors"]]
    total, per_tensor = torch.ops.mixedprec.multi_tensor_l2norm.default(
        _local(tensors), _local(args["inv_scale"]), True)
    groups = _sharded_groups(tensors)
    if groups:
        squares = per_tensor.double().square()
        for group in groups:
            sharded = torch.tensor([group in _sharded_dims(t) for t in tensors],
                                   device=squares.device)
            part = torch.where(sharded, squares, 0.0)
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
            squares = torch.where(sharded, part, squares)
        total = squares.sum().sqrt().float().reshape(1)
        per_tensor = squares.sqrt().float()
    if not args["per_tensor"]:
        per_tensor = per_tensor.new_empty(0)
    return total, per_tensor


def _run_on_whole_tensors(op, name: str, bound: Dict[str, Any]) -> None:
    """An op of :data:`_WHOLE_TENSOR_OPS` on sharded DTensors: tensor by tensor, on the
    whole tensors (all-gathered; one tensor's lists at a time in memory), every rank
    computing the same result and keeping its shard of what the op wrote. Correct,
    and slower than on one device: the all-gathers and one op call per tensor."""
    from torch.distributed.tensor import distribute_tensor

    lists, written = _WHOLE_TENSOR_OPS[name]
    step = bound["step"]
    stepped = step
    for i in range(len(bound["params"])):
        call = dict(bound)
        gathered = {}
        for key in lists:
            if bound[key]:  # (model_params may be empty)
                t = bound[key][i]
                full = t.detach().full_tensor() if is_dtensor(t) else t  # (no autograd)
                gathered[key] = (t, full)
                call[key] = [full]
        if "exp_avg_sq" in bound and not isinstance(bound["exp_avg_sq"], (list, tuple)):
            call["exp_avg_sq"] = _local(bound["exp_avg_sq"]).narrow(0, i, 1)  # NovoGrad's
        call = {k: _local(v) for k, v in call.items()}
        call["step"] = stepped = _local(step).clone()  # each tensor steps from the same count
        op(*[call[a.name] for a in op._schema.arguments])
        for key in written:
            if key in gathered and is_dtensor(gathered[key][0]):
                t, full = gathered[key]
                shard = distribute_tensor(full, t.device_mesh, t.placements,
                                          src_data_rank=None).to_local()
                t.to_local().copy_(shard)
    _local(step).copy_(stepped)


def _run_on_shards(op, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """DTensor's handler of every mixedprec op (see the module docstring)."""
    name = op._schema.name.split("::")[1]
    schema_args = op._schema.arguments
    bound: Dict[str, Any] = {a.name: a.default_value for a in schema_args if a.has_default_value()}
    bound.update(zip((a.name for a in schema_args), args))
    bound.update(kwargs)
    if name == "multi_tensor_l2norm":
        return _l2norm_on_shards(bound)
    if name in _WHOLE_TENSOR_OPS and _sharded_groups(bound["params"]):
        return _run_on_whole_tensors(op, name, bound)
    local_args = []
    for a in schema_args:
        value = bound[a.name]
        if a.name == "grads" and "params" in bound:
            value = _local_grads(value, bound["params"])
        else:
            value = _local(value)
        local_args.append(value)
    result = op(*local_args)
    if name in _FLAG_OPS:
        agree_found_inf(local_args[[a.name for a in schema_args].index("found_inf")],
                        bound[schema_args[_FLAG_OPS[name]].name])
    return result


_registered = False


def register_ops() -> None:
    """Registers :func:`_run_on_shards` for every mixedprec op with DTensor's dispatcher
    (once). Without torch.distributed, nothing. ``import mixedprec`` calls it through
    :func:`register_ops_on_import`."""
    global _registered
    DTensor = _dtensor_class()
    if _registered or DTensor is None:
        return
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("mixedprec::"):
            packet = getattr(torch.ops.mixedprec, qualified.split("::")[1].split(".")[0])
            for overload in packet.overloads():
                handlers[getattr(packet, overload)] = _run_on_shards
    _registered = True


class _RegisterOps(importlib.abc.Loader):
    """torch.distributed.tensor's own loader, then :func:`register_ops`."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        register_ops()
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _OnDTensorImport)]

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self.loader, name)


class _OnDTensorImport(importlib.abc.MetaPathFinder):
    """Finds torch.distributed.tensor with the other finders and has its loader call
    :func:`register_ops` once the module has run (the finder then leaves
    sys.meta_path; a find_spec without an import, as availability checks do, leaves it
    in place)."""

    def __init__(self):
        self.finding = False

    def find_spec(self, name, path=None, target=None):
        if name != _DTENSOR or self.finding:
            return None
        self.finding = True  # importlib.util.find_spec asks this finder again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterOps(spec.loader)
        return spec


def register_ops_on_import() -> None:
    """:func:`register_ops` now if torch.distributed.tensor is imported, else as soon as
    it is: importing it takes 1 s (sympy, torch's symbolic shapes), which ``import
    mixedprec`` need not pay; no DTensor exists before it (then no op call needs the
    handlers)."""
    if _DTENSOR in sys.modules:
        register_ops()
    elif not any(isinstance(f, _OnDTensorImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnDTensorImport())
