"""``apex.parallel`` on ``torch.distributed``: :class:`DistributedDataParallel`,
:class:`SyncBatchNorm`, :func:`convert_syncbn_model`,
:func:`create_syncbn_process_group`, :class:`Reducer`, :class:`LARC`, ``ReduceOp``,
the flat collective helpers of Apex's ``apex.parallel.distributed``
(:func:`flat_dist_call`, :func:`apply_flat_dist_call`, :func:`split_by_type`,
:func:`split_half_float_double`, :func:`flatten`, :func:`unflatten`,
:func:`extract_tensors`) and :func:`multiproc`, Apex's ``python -m
apex.parallel.multiproc`` launcher (``python -m mixedprec.parallel script.py ...``).

Apex deleted this package in May 2025. Data parallelism here is PyTorch's own
(``torch.nn.parallel.DistributedDataParallel``, ``torch.nn.SyncBatchNorm``) behind
Apex's argument names; :class:`LARC` keeps Apex's algorithm but computes the norms
with :func:`mixedprec.ops.multi_tensor_l2norm` and never synchronises with the host.
"""

import math
import subprocess
import sys
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import grads as _grads
from .. import ops
from .apex_C import flatten, unflatten

__all__ = [
    "DistributedDataParallel",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
    "Reducer",
    "LARC",
    "ReduceOp",
    "flatten",
    "unflatten",
    "apply_flat_dist_call",
    "split_half_float_double",
    "split_by_type",
    "flat_dist_call",
    "extract_tensors",
    "multiproc",
]

#: ``torch.distributed.ReduceOp``, where Apex exported it.
ReduceOp = dist.ReduceOp

_MB = 1024 * 1024

class SyncBatchNorm(nn.SyncBatchNorm):
    """Apex's ``SyncBatchNorm`` (the optimized one's arguments) on
    ``torch.nn.SyncBatchNorm``: statistics synchronised over ``process_group`` (default:
    the whole world) in training, when ``torch.distributed`` is initialised.

    ``channel_last=True`` means what it meant in Apex: the channels are the input's
    *last* dimension (``[N, ..., C]``), not a memory format; 2-D input ``[N, C]`` is
    handled that way always. ``forward(input, z=None)``: as in Apex, on the
    channel-last path the output is ``relu(bn(input) + z)``, with ``z`` (optional,
    the input's shape) added and the ReLU applied when ``fuse_relu``; on the
    channels-first path (``[N, C, ...]`` input without ``channel_last``) ``z`` and
    ``fuse_relu`` are ignored, as Apex's kernels ignored them. Nothing is fused: the
    addition and the ReLU are separate PyTorch operations.

    On the CPU (gloo), where ``torch.nn.SyncBatchNorm`` refuses to synchronise, the
    statistics are synchronised here (:func:`_sync_batch_norm`), as Apex's Python
    SyncBatchNorm did on any device its process group served. In eval mode without
    running statistics (``track_running_stats=False``) the batch statistics are
    synchronised too, as in Apex (torch's SyncBatchNorm uses each rank's own there)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, channel_last=False,
                 fuse_relu=False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, process_group=process_group)
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def forward(self, input: Tensor, z: Optional[Tensor] = None) -> Tensor:
        channel_last = self.channel_last or input.dim() == 2
        if not channel_last:
            return self._normalize(input)
        out = self._normalize(input.movedim(-1, 1)).movedim(1, -1)
        if z is not None:
            out = out + z
        return torch.relu(out) if self.fuse_relu else out


    def _normalize(self, input: Tensor) -> Tensor:
        """Batch norm of ``[N, C, ...]`` input, synchronised in training as
        ``torch.nn.SyncBatchNorm``, also on the devices it refuses (the CPU), and in eval
        mode without running statistics (batch statistics then), as Apex's."""
        batch_stats = self.training or self.running_mean is None
        if not batch_stats or not (dist.is_available() and dist.is_initialized()) or \
                self.training and input.device.type in _TORCH_SYNC_DEVICES:
            return super().forward(input)
        group = self.process_group or dist.group.WORLD
        if dist.get_world_size(group) == 1:  # (torch's own path without synchronising)
            return nn.modules.batchnorm._BatchNorm.forward(self, input)
        return _sync_batch_norm(self, input, group)


#: The devices on which torch.nn.SyncBatchNorm synchronises (it refuses the others).
_TORCH_SYNC_DEVICES = ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


def _sync_batch_norm(bn: nn.SyncBatchNorm, x: Tensor, group: Any) -> Tensor:
    """``bn`` (training) on ``[N, C, ...]`` input ``x``, its statistics over the whole
    batch of ``group``'s ranks, in fp32 (fp64 for fp64 input): two differentiable
    all-reduces (the channels' sums and the element count, then the sums of squared
    deviations from the mean), so that autograd all-reduces their gradients back; the
    running statistics updated as torch.nn.SyncBatchNorm updates them (the unbiased
    variance)."""
    from torch.distributed.nn.functional import all_reduce

    bn._check_input_dim(x)
    bn._check_non_zero_input_channels(x)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # (a cumulative average, as torch's)
            factor = 1.0 / bn.num_batches_tracked.item()  # sync-ok: the CPU
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    count = torch.full((1,), x.numel() // x.shape[1], dtype=xf.dtype, device=x.device)
    sums = all_reduce(torch.cat([xf.sum(dims), count]), group=group)
    n = sums[-1]
    mean = sums[:-1] / n
    centered = xf - mean.view(shape)
    var = all_reduce(centered.square().sum(dims), group=group) / n
    out = centered * torch.rsqrt(var + bn.eps).view(shape)
    if bn.weight is not None:
        out = out * bn.weight.view(shape) + bn.bias.view(shape)
    if bn.track_running_stats:
        with torch.no_grad():
            bn.running_mean.mul_(1 - factor).add_(mean * factor)
            bn.running_var.mul_(1 - factor).add_(var * (n / (n - 1)) * factor)
    return out.to(x.dtype)


def convert_syncbn_model(
    module: nn.Module, process_group: Optional[Any] = None, channel_last: bool = False
) -> nn.Module:
    """Apex's ``convert_syncbn_model``: every ``torch.nn.modules.batchnorm._BatchNorm``
    in ``module`` (or ``module`` itself) replaced by a :class:`SyncBatchNorm` that
    synchronises over ``process_group`` (default: the whole world), with
    ``channel_last`` passed on. Running statistics and ``num_batches_tracked`` are the
    old module's buffers, as in Apex; unlike Apex, the weight and bias are the old
    module's parameters themselves, not copies of them."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum,
                                  module.affine, module.track_running_stats, process_group,
                                  channel_last=channel_last)
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        module = converted
    for name, child in module.named_children():
        module.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return module


def create_syncbn_process_group(group_size: int) -> Optional[Any]:
    """Apex's ``create_syncbn_process_group``: splits the world into groups of
    ``group_size`` consecutive ranks and returns this rank's group, for
    :func:`convert_syncbn_model`; None when ``group_size`` is 0 (the whole world).
    Every rank must call it (``torch.distributed.new_group`` is collective)."""
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if group_size < 0 or world_size % group_size != 0:
        raise ValueError(
            f"create_syncbn_process_group: expected group_size to divide the world size "
            f"{world_size}, got {group_size}"
        )
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine


class _AllreduceOptions:
    """State of :func:`_apex_allreduce_hook`: Apex's reduction options."""

    def __init__(self, process_group, gradient_average, gradient_predivide_factor,
                 allreduce_always_fp32, retain_allreduce_buffers):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.allreduce_always_fp32 = allreduce_always_fp32
        #: With ``retain_allreduce_buffers``: DDP bucket index -> its reduced buffer.
        self.buffers: Optional[Dict[int, Tensor]] = {} if retain_allreduce_buffers else None


# Not annotated: DDP only accepts torch's exact annotations, and dist.GradBucket does
# not exist where torch.distributed is unavailable.
def _apex_allreduce_hook(state, bucket):
    """A DDP communication hook (``dist.GradBucket`` in, ``Future[Tensor]`` out) that
    reduces a bucket as Apex did: optionally in fp32, ``grads /
    gradient_predivide_factor`` before the all-reduce and, when averaging,
    ``* gradient_predivide_factor / world_size`` after it."""
    buffer = bucket.buffer()
    tensor = buffer
    if state.allreduce_always_fp32 and buffer.dtype in (torch.float16, torch.bfloat16):
        tensor = buffer.float()
    if state.gradient_predivide_factor != 1.0:
        tensor.mul_(1.0 / state.gradient_predivide_factor)
    future = dist.all_reduce(tensor, group=state.process_group, async_op=True).get_future()

    def finish(fut: torch.futures.Future) -> Tensor:
        reduced = fut.value()[0]
        if state.gradient_average:
            reduced.mul_(state.gradient_predivide_factor / state.world_size)
        if reduced is not buffer:
            buffer.copy_(reduced)
        if state.buffers is not None:
            state.buffers[bucket.index()] = buffer
        return buffer

    return future.then(finish)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """Apex's ``DistributedDataParallel`` arguments on
    ``torch.nn.parallel.DistributedDataParallel`` (this class is a thin subclass of
    it: everything torch's DDP does, it does).

    Honoured:

    * ``message_size`` (elements, default 1e7): the bucket size, passed as
      ``bucket_cap_mb = message_size * bytes per gradient element / 2**20``. Apex
      used it as the least size of a bucket, torch as the most.
    * ``delay_allreduce=True``: all gradients in one bucket, so that the all-reduce
      starts when the whole backward pass is done, as in Apex.
    * ``gradient_average=False`` (sum instead of mean), ``gradient_predivide_factor``
      (``grads / f`` before the all-reduce, ``* f / world_size`` after it),
      ``allreduce_always_fp32`` (reduce fp16/bf16 buckets in fp32), and the
      deprecated ``gradient_average_split_factor`` (as ``gradient_predivide_factor``),
      through a DDP communication hook registered when any differs from the
      default. Gradients are otherwise averaged by torch's default hook.
    * :meth:`disable_allreduce` / :meth:`enable_allreduce` (torch's ``no_sync``).
    * ``retain_allreduce_buffers=True``: after a backward pass,
      :attr:`allreduce_buffers` lists the flat reduced gradient buffers and every
      parameter's ``.grad`` is a view into one of them, as in Apex (set through
      torch's ``gradient_as_bucket_view=True``). The buffers are torch's DDP buckets
      (cut by ``message_size``, mixed dtypes kept apart), in bucket order, where
      Apex had one per dtype.

    Accepted and ignored (torch's DDP has no counterpart, or needs none):
    ``shared_param`` (shared parameters just work), ``allreduce_trigger_params``
    (buckets are cut by size), ``num_allreduce_streams`` and
    ``allreduce_communicators`` (torch's reducer schedules its own communication),
    ``prof`` (no NVTX ranges).

    Any keyword of torch's DDP (``device_ids``, ``process_group``,
    ``find_unused_parameters``, ``gradient_as_bucket_view``, ``bucket_cap_mb``, ...)
    is passed through; an explicit ``bucket_cap_mb`` wins over ``message_size`` and
    ``delay_allreduce``. As in Apex, parameters are broadcast from rank 0 when the
    module is wrapped. Unlike Apex's: buffers (batch norm's running statistics) are
    broadcast from rank 0 then and before every forward, torch's
    ``broadcast_buffers=True`` (pass ``broadcast_buffers=False`` to keep each rank's
    own, as Apex did); models with parameters that get no gradient need
    ``find_unused_parameters=True``.
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Optional[bool] = None,
        allreduce_trigger_params: Optional[Iterable[Tensor]] = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Optional[Any] = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: Optional[float] = None,
        prof: bool = False,
        **ddp_kwargs: Any,
    ):
        # shared_param, allreduce_trigger_params, num_allreduce_streams,
        # allreduce_communicators and prof are accepted and ignored: see the class
        # docstring.
        if gradient_average_split_factor is not None:
            warnings.warn(
                "gradient_average_split_factor is deprecated (as in Apex); use "
                "gradient_predivide_factor",
                DeprecationWarning,
                stacklevel=2,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if isinstance(message_size, bool) or not isinstance(message_size, (int, float)) or \
                not 0 <= message_size < math.inf:
            raise ValueError("DistributedDataParallel: expected message_size to be a number of "
                             f"elements >= 0, got {message_size!r}")
        if isinstance(gradient_predivide_factor, bool) or \
                not isinstance(gradient_predivide_factor, (int, float)) or \
                not 0 < gradient_predivide_factor < math.inf:
            raise ValueError("DistributedDataParallel: expected gradient_predivide_factor to be "
                             f"a finite number > 0, got {gradient_predivide_factor!r}")
        if "bucket_cap_mb" not in ddp_kwargs:
            ddp_kwargs["bucket_cap_mb"] = _bucket_cap_mb(module, message_size, delay_allreduce)
        if retain_allreduce_buffers:
            ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(module, **ddp_kwargs)
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self._apex_options: Optional[_AllreduceOptions] = None
        if (not gradient_average or gradient_predivide_factor != 1.0 or allreduce_always_fp32
                or retain_allreduce_buffers):
            self._apex_options = _AllreduceOptions(
                ddp_kwargs.get("process_group"), gradient_average, gradient_predivide_factor,
                allreduce_always_fp32, retain_allreduce_buffers,
            )
            self.register_comm_hook(self._apex_options, _apex_allreduce_hook)

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """torch's DDP refuses a CPU module holding any ``torch.nn.SyncBatchNorm``; this
        module's :class:`SyncBatchNorm` synchronises on the CPU itself (gloo), as Apex's
        did under Apex's DDP, so only torch's own class is refused there."""
        if self.device_type != "cpu":
            return
        for layer in module.modules():
            if isinstance(layer, nn.SyncBatchNorm) and not isinstance(layer, SyncBatchNorm):
                raise ValueError(
                    "DistributedDataParallel: torch.nn.SyncBatchNorm works with GPU modules "
                    "only; on the CPU use mixedprec.parallel.SyncBatchNorm "
                    "(mixedprec.parallel.convert_syncbn_model)")

    @property
    def allreduce_buffers(self) -> List[Tensor]:
        """With ``retain_allreduce_buffers=True``: the flat buffers of the last
        backward pass's reduced gradients (``.grad`` views into them), in bucket order;
        an empty list before the first backward pass."""
        if self._apex_options is None or self._apex_options.buffers is None:
            raise AttributeError("allreduce_buffers needs retain_allreduce_buffers=True")
        buffers = self._apex_options.buffers
        return [buffers[index] for index in sorted(buffers)]

    def disable_allreduce(self) -> None:
        """Apex's ``disable_allreduce``: following backward passes accumulate gradients
        locally without reducing them (what torch's ``no_sync()`` context does)."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """Apex's ``enable_allreduce``: backward passes reduce gradients again."""
        self.require_backward_grad_sync = True


def _bucket_cap_mb(module: nn.Module, message_size: int, delay_allreduce: bool) -> float:
    params = [p for p in module.parameters() if p.requires_grad]
    if delay_allreduce:
        total = sum(p.numel() * p.element_size() for p in params)
        return (total + _MB) / _MB  # one bucket holds them all
    element_size = params[0].element_size() if params else 4
    # (0: each parameter reduced on its own, as Apex did; torch's DDP takes no 0 cap, so
    # one byte)
    return max(message_size * element_size, 1) / _MB


class Reducer:
    """Apex's ``Reducer``: averages gradients over all processes when :meth:`reduce`
    is called, not during ``backward()``.

    ``module_or_grads_list`` is a module (its parameters are broadcast from rank 0
    here, and its parameters' gradients are reduced) or a list of gradient tensors
    (which the caller keeps in sync)."""

    def __init__(self, module_or_grads_list: Any):
        if isinstance(module_or_grads_list, nn.Module):
            self.module: Optional[nn.Module] = module_or_grads_list
            self.grads: List[Tensor] = []
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self) -> None:
        """All-reduce and average the gradients, bucketed by dtype."""
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)


def apply_flat_dist_call(bucket: Sequence[Tensor], call: Callable[..., Any],
                         extra_args: Optional[Sequence[Any]] = None) -> None:
    """Apex's ``apply_flat_dist_call``: ``call(flat, *extra_args)`` on one flat copy of
    ``bucket`` (tensors of one dtype and device), divided by the world size when
    ``call`` is ``torch.distributed.all_reduce``, and copied back into ``bucket``."""
    flat = flatten(bucket)
    call(flat, *(extra_args or ()))
    if call is dist.all_reduce:
        flat.div_(dist.get_world_size())
    for tensor, synced in zip(bucket, unflatten(flat, bucket)):
        tensor.copy_(synced)


def split_by_type(tensors: Iterable[Tensor]) -> "OrderedDict[str, List[Tensor]]":
    """Apex's ``split_by_type``: the tensors grouped by ``tensor.type()``
    (``"torch.cuda.HalfTensor"``, ``"torch.FloatTensor"``, ...), in first-seen order."""
    buckets: "OrderedDict[str, List[Tensor]]" = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def split_half_float_double(tensors: Iterable[Tensor]) -> List[List[Tensor]]:
    """Apex's ``split_half_float_double``: the CUDA tensors of ``tensors`` in up to three
    lists, float16, float32 and float64 (empty lists left out; other tensors, CPU ones
    included, are not returned, as in Apex)."""
    tensors = list(tensors)
    buckets = []
    for name in ("torch.cuda.HalfTensor", "torch.cuda.FloatTensor", "torch.cuda.DoubleTensor"):
        bucket = [t for t in tensors if t.type() == name]
        if bucket:
            buckets.append(bucket)
    return buckets


def flat_dist_call(tensors: Iterable[Tensor], call: Callable[..., Any],
                   extra_args: Optional[Sequence[Any]] = None) -> None:
    """Apex's ``flat_dist_call``: :func:`apply_flat_dist_call` on each group of
    :func:`split_by_type` (``flat_dist_call(grads, dist.all_reduce)`` averages the
    gradients; ``flat_dist_call(params, dist.broadcast, (0,))`` broadcasts from rank
    0)."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor: Any, tensor_list: List[Tensor]) -> None:
    """Apex's ``extract_tensors``: appends to ``tensor_list`` every tensor in
    ``maybe_tensor`` (a tensor, or nested iterables of them; anything else is
    skipped; strings too, where Apex recursed without end)."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    if isinstance(maybe_tensor, (str, bytes)):
        return
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        extract_tensors(item, tensor_list)


def _per_tensor_norms(tensors: List[Tensor]) -> Tensor:
    """The L2 norm of each tensor (all on one device), as an fp32 vector on that device
    (fp64 when a tensor is fp64)."""
    if all(ops.is_dense(t) and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
           for t in tensors):
        return ops.multi_tensor_l2norm(tensors, None, per_tensor=True)[1]
    # (in float64 when a tensor is: its norm is then not rounded to fp32)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return torch.stack([torch.linalg.vector_norm(t, dtype=dtype) for t in tensors])


class LARC:
    """Apex's ``LARC`` (layer-wise adaptive rate clipping or scaling,
    https://arxiv.org/abs/1708.03888) around any optimizer.

    Before each step of ``optimizer``, the gradient of every parameter whose norm and
    whose gradient's norm are both nonzero becomes
    ``(grad + weight_decay * param) * factor`` with the local learning rate
    ``local = trust_coefficient * |param| / (|grad| + |param| * weight_decay + eps)``
    and ``factor = min(local / lr, 1)`` when ``clip`` (the effective rate is
    ``min(lr, local)``), else ``factor = local``; the group's ``weight_decay`` is
    set to 0 for the step and restored after it.

    As Apex, but without a host synchronisation: the norms come from
    :func:`mixedprec.ops.multi_tensor_l2norm` (``per_tensor=True``, one call per
    group and device for the parameters, one for the gradients) and the
    "both norms nonzero" test is a device-side select, not a Python ``if``. The
    properties and methods forward to the wrapped optimizer as Apex's do; ``step``
    also takes an optional ``closure``, run first. Norms are fp32 (fp64 for fp64
    tensors). ``amp.initialize`` and ``amp.scale_loss`` take a LARC as Apex's did; it
    then adapts unscaled gradients, those of the fp32 masters at O2.
    """

    def __init__(self, optimizer: Any, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self):
        return self.optim.__getstate__()

    def __setstate__(self, state):
        self.optim.__setstate__(state)

    @property
    def state(self):
        return self.optim.state

    def __repr__(self) -> str:
        return self.optim.__repr__()

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Runs ``closure`` (if given: it computes the gradients), adapts the gradients,
        then steps the wrapped optimizer; returns the closure's loss, else what the
        wrapped step returns."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight_decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                weight_decay = group.get("weight_decay", 0)
                weight_decays.append(weight_decay)
                if "weight_decay" in group:
                    group["weight_decay"] = 0
                self._adapt(group, weight_decay)
        try:
            result = self.optim.step()
            return result if closure is None else loss
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                if "weight_decay" in group:
                    group["weight_decay"] = weight_decay

    def _stepped(self, group: Dict[str, Any]) -> List[Tensor]:
        """The tensors the wrapped step updates from their ``.grad``: a parameter, or its
        fp32 master in a mixedprec optimizer's state when the master holds the (unscaled)
        gradient (amp at O2, after ``master_params`` or before LARC's step)."""
        state = self.optim.state
        out = []
        for p in group["params"]:
            master = state[p].get("master_param") if p in state else None
            if isinstance(master, Tensor) and master.grad is not None:
                out.append(master)
            elif p.grad is not None:
                out.append(p)
        return out

    def _adapt(self, group: Dict[str, Any], weight_decay: float) -> None:
        with_grads = self._stepped(group)
        for (members,) in _grads.by_device(with_grads).values():
            params = [p.data for p in members]
            grads = [p.grad.data for p in members]
            param_norms = _per_tensor_norms(params)
            grad_norms = _per_tensor_norms(grads)
            local_lr = self.trust_coefficient * param_norms / (
                grad_norms + param_norms * weight_decay + self.eps)
            if self.clip:
                local_lr = torch.clamp(local_lr / group["lr"], max=1.0)
            adapt = (param_norms != 0) & (grad_norms != 0)
            factors = torch.where(adapt, local_lr, 1.0).unbind(0)
            if weight_decay != 0:
                decays = torch.where(adapt, float(weight_decay), 0.0).unbind(0)
                torch._foreach_add_(grads, torch._foreach_mul(params, decays))
            torch._foreach_mul_(grads, factors)


def multiproc(argv: Optional[Sequence[str]] = None) -> int:
    """Apex's ``python -m apex.parallel.multiproc script.py args...``: runs ``python
    script.py args... --world-size N --rank i`` for ``i`` in ``0..N-1``, all at once,
    and waits for them. ``N`` is the ``--world-size`` in the arguments, else the number
    of CUDA devices (then appended). ``--rank`` is set, or appended, per process. As in
    Apex, process 0 writes to this process's stdout and process ``i`` to
    ``GPU_<i>.log`` in the working directory. Returns the first nonzero exit status of
    the processes, else 0 (Apex returned 0 always)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m apex.parallel.multiproc script.py [args...]")
    if "--world-size" in args:
        world_size = int(args[args.index("--world-size") + 1])
    else:
        world_size = torch.cuda.device_count()
        args += ["--world-size", str(world_size)]
    if world_size < 1:
        raise SystemExit("multiproc: no CUDA device and no --world-size: nothing to launch")
    if "--rank" not in args:
        args += ["--rank", "0"]
    rank_at = args.index("--rank") + 1
    workers, logs = [], []
    try:
        for rank in range(world_size):
            args[rank_at] = str(rank)
            stdout = None if rank == 0 else open(f"GPU_{rank}.log", "w")
            if stdout is not None:
                logs.append(stdout)
            print(args, flush=True)
            workers.append(subprocess.Popen([sys.executable] + args, stdout=stdout))
        codes = [worker.wait() for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        for log in logs:
            log.close()
    return next((code for code in codes if code != 0), 0)


if __name__ == "__main__":
    sys.exit(multiproc())
