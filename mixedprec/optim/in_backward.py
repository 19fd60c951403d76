"""The step inside backward: :func:`in_backward` makes a :mod:`mixedprec.optim`
optimizer step each bucket of its parameters as soon as backward has accumulated their
gradients, through the same fused op calls as ``step()``, and free those gradients. A
training step then holds about one bucket of gradients instead of all of them
(docs/lean-precision.md, "The step inside backward").

What it takes, and what it refuses and why:

* Adam, AdamW, SGD and Adagrad, in every master mode and state dtype; one backward is
  one step, bit for bit that of ``step()`` (rounding bits and step counts are those of
  each parameter's place in its param group, whichever bucket it steps in).
* Gradient accumulation: backward passes inside ``with handle.no_step():`` accumulate;
  the next backward outside it steps on the sum.
* ``applied_steps`` advances once per backward that stepped, so the device-side
  schedules of :mod:`mixedprec.optim.lr_scheduler` (and torch's) step as usual, once
  per backward, after it.
* DDP: ``in_backward(optimizer, model=ddp_model)`` steps DDP's own buckets, each once
  DDP has averaged it (a comm hook), bit for bit DDP with ``step()``. DDP keeps its
  buckets, so there the gradients are zeroed, not freed: no memory is saved. The
  optimizer may hold some of the model's parameters (another one, stepped with
  ``step()``, the rest: their gradients stay as DDP averaged them). With
  ``find_unused_parameters=True`` or ``static_graph=True`` DDP knows which parameters
  got no gradient on any rank only after its last bucket, so the buckets step at the end
  of backward (those parameters do not, as in ``step()``), after DDP has given out the
  gradients; they are then freed. A DDP model takes one comm hook: one optimizer steps
  its parameters inside backward, and no other comm hook (bf16 compression, PowerSGD)
  goes with it (one registered before is refused by name; one after, by DDP).
* Refused: LAMB and NovoGrad (their update needs every gradient first: LAMB's global
  gradient norm, NovoGrad's per-group second moments); fp16 parameters (they need a
  loss scaler, and an overflow found late in backward comes after earlier buckets
  have stepped: skipping per bucket would apply part of a step that the scaler skips
  whole, and undoing is not exact, since neither an fp32 moment update nor an 8-bit
  one can be inverted bit for bit; bf16 needs no loss scaler); parameters sharded as
  DTensors (FSDP2 reduce-scatters gradients after the parameters' hooks have run, and
  has no hook after it); a process group of more than one process without ``model=``
  (DDP averages gradients after the parameters' hooks: a step there would read the
  local gradient); a param group with ``differentiable=True`` (autograd records its
  step, which cannot be inside backward).
* Not possible: clipping by the global gradient norm (it needs every gradient before
  the first update); ``clip_grad_norm_`` after backward finds no gradients.
* A bad gradient found in a bucket raises out of ``backward()`` after the buckets
  before it have stepped; hyperparameters are checked before the first bucket, and so
  is a parameter that requires grad but did not when the handle was made (no hook
  steps it: attach again).
* One optimizer steps a parameter inside backward (a second one over it is refused).
* ``torch.utils.checkpoint(use_reentrant=True)`` runs a nested backward inside the
  outer one: it is part of the same step. One around the last layers, whose nested
  backward runs before the outer one's first gradient, is refused once the outer one
  goes on (``use_reentrant=False`` has no nested backward).
"""

import contextlib
import inspect
import math
import threading
import weakref
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import Tensor

from ..distributed import is_dtensor
from . import state as _state
from . import torch_path
from .optimizer import Optimizer
from .plans import PlanCache

__all__ = ["in_backward", "InBackward"]


class _Bucket:
    """Parameters that step together: (group index, its params in the bucket) pairs,
    and the plans of their op calls."""

    def __init__(self, cache: PlanCache):
        self.groups: List[Tuple[int, List[Tensor]]] = []
        self.params: List[Tensor] = []
        self.bytes = 0
        self.cache = cache

    def add(self, index: int, p: Tensor) -> None:
        if not self.groups or self.groups[-1][0] != index:
            self.groups.append((index, []))
        self.groups[-1][1].append(p)
        self.params.append(p)
        self.bytes += p.numel() * p.element_size()


class InBackward:
    """The handle :func:`in_backward` returns: the optimizer steps inside backward until
    :meth:`remove`; :meth:`no_step` accumulates gradients instead."""

    def __init__(self, optimizer: Optimizer, bucket_cap_mb: float, model: Any = None):
        params = _check(optimizer, bucket_cap_mb, model)
        self.optimizer = optimizer
        self.ddp = model if _is_ddp(model) else None
        self.buckets: List[_Bucket] = []
        self._bucket_of: Dict[int, int] = {}
        self._group_of = {id(p): index for index, p in params}
        self._sizes = [len(group["params"]) for group in optimizer.param_groups]
        self._accumulating = False
        # The backward being stepped: its autograd graph tasks, the outer one first (a
        # reentrant checkpoint runs a nested backward, a task of its own, inside it);
        # empty: none. The newest task begun, to tell an outer task from a new backward.
        self._tasks: List[int] = []
        self._newest = -1
        self._left: List[int] = []  # per bucket: its params not yet ready in that backward
        self._stepped: List[bool] = []
        self._group_steps: Dict[int, Any] = {}  # group -> its "step" as backward began
        self._lock = threading.Lock()  # (DDP's callbacks may run on its threads)
        hooks: List[Any] = []
        # DDP that finds unused parameters (or a static graph's) knows which got no
        # gradient on any rank (and must not step, as step() skips their None gradients)
        # only after its last bucket: there the buckets step at the end of backward,
        # after DDP's own.
        self._deferred = self.ddp is not None and bool(
            getattr(self.ddp, "find_unused_parameters", False)
            or getattr(self.ddp, "static_graph", False))
        if self.ddp is not None:  # DDP's buckets; a bucket steps once it is averaged
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self._allreduce = default_hooks.allreduce_hook  # (DDP's own, averaged)
            self._ddp_buckets: Dict[Tuple[int, ...], int] = {}
            comm = _weak_comm_hook(self._ddp_hook, self._allreduce)
            try:
                self.ddp.register_comm_hook(None, comm)
            except RuntimeError as error:
                if "only be called once" not in str(error):
                    raise
                hooks = getattr(self.ddp, "_comm_hooks", None)  # (DDP's Python side kept it)
                if isinstance(hooks, list) and hooks and hooks[-1][0] is comm:
                    hooks.pop()
                raise RuntimeError(
                    "in_backward: this DistributedDataParallel model has a comm hook already "
                    "(another optimizer's in_backward, or a communication hook such as "
                    "bf16 compression or PowerSGD), and DDP takes one: in_backward(model=) "
                    "steps in it. Step the DDP model's parameters inside backward with one "
                    "optimizer and no other comm hook, or use step()") from None
            if self._deferred:
                self._make_buckets(params, bucket_cap_mb * 2**20)
        else:
            self._make_buckets(params, bucket_cap_mb * 2**20)
            hook = _weak_hook(self._ready)
            hooks = [p.register_post_accumulate_grad_hook(hook) for _, p in params]
        # The hooks go with the handle (and its _STEPPERS entries): at remove(), or when
        # the optimizer and the handle are collected while the model lives on (else each
        # parameter would keep a dead hook, called at every backward).
        mine = weakref.ref(self)
        for _, p in params:  # (for _check: one optimizer steps a parameter inside backward)
            _STEPPERS[id(p)] = mine
        self._unhook = weakref.finalize(self, _release, hooks, [id(p) for _, p in params], mine)
        optimizer.in_backward = self

    def _make_buckets(self, params: List[Tuple[int, Tensor]], cap: float) -> None:
        for index, p in reversed(params):  # (backward reaches the last layers first)
            size = p.numel() * p.element_size()
            if not self.buckets or self.buckets[-1].bytes + size > cap and \
                    self.buckets[-1].params:
                self.buckets.append(_Bucket(self.optimizer.plans.part()))
            self.buckets[-1].add(index, p)
            self._bucket_of[id(p)] = len(self.buckets) - 1

    def remove(self) -> None:
        """Back to ``optimizer.step()``: the hooks and the buckets' plans go. (DDP keeps
        a comm hook once registered: a DDP model's handle cannot be removed.)"""
        if self.ddp is not None:
            raise RuntimeError("InBackward.remove: DDP cannot unregister a comm hook; build "
                               "the DistributedDataParallel model again to step() it")
        self._unhook()
        parts = self.optimizer.plans.parts
        parts[:] = [c for c in parts if all(c is not b.cache for b in self.buckets)]
        if self.optimizer.in_backward is self:
            self.optimizer.in_backward = None

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without stepping (the micro-batches
        of gradient accumulation but the last; with DDP, ``model.no_sync()`` also skips
        their all-reduce)."""
        before, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = before

    # --- inside backward -----------------------------------------------------------------
    def _ready(self, p: Tensor) -> None:
        """A parameter's gradient is accumulated: its bucket steps once all are."""
        if self._accumulating:
            return
        self._begin()
        index = self._bucket_of[id(p)]
        self._left[index] -= 1
        if self._left[index] == 0:
            self._step(index, self.buckets[index].params)

    def _ddp_hook(self, process_group, bucket):  # (DDP checks annotations: none here)
        """DDP's comm hook: its all-reduce (the default one: averaged), then the bucket's
        parameters step on the averaged gradients and the bucket is zeroed, which DDP
        then copies into ``p.grad`` (so the next backward accumulates from zero)."""
        averaged = self._allreduce(process_group, bucket)
        if self._accumulating:
            return averaged
        self._begin()
        if self._deferred:  # (the buckets step after DDP's end of backward: _finish)
            return averaged
        params = bucket.parameters()
        key = tuple(map(id, params))
        index = self._ddp_buckets.get(key)
        if index is None:  # (DDP rebuilds its buckets after the first backward)
            mine = _Bucket(self.optimizer.plans.part())
            for p in params:
                if id(p) in self._group_of:
                    mine.add(self._group_of[id(p)], p)
            self.buckets.append(mine)
            self._stepped.append(False)
            index = self._ddp_buckets[key] = len(self.buckets) - 1

        def step(future: torch.futures.Future) -> Tensor:
            buffer = future.value()
            mine = self.buckets[index].params
            if not mine:  # (none of this optimizer's: DDP's gradients as they are)
                return buffer
            with self._lock:
                kept = [p.grad for p in params]
                grads = bucket.gradients()  # (views of the averaged bucket)
                for p, grad in zip(params, grads):
                    p.grad = grad
                try:
                    self._step(index, mine)
                finally:
                    for p, grad in zip(params, kept):
                        p.grad = grad
                # The stepped gradients zeroed, which DDP then copies into p.grad (so the
                # next backward accumulates from zero); a parameter of another optimizer
                # keeps its averaged gradient.
                if len(mine) == len(params):
                    buffer.zero_()
                else:
                    torch._foreach_zero_([grad for p, grad in zip(params, grads)
                                          if id(p) in self._group_of])
            return buffer

        if bucket.is_last():  # (the step is counted once per backward; DDP waits for all)
            self._count()
        return averaged.then(step)

    def _begin(self) -> None:
        """At a backward's first hook: the checks, before any bucket steps; the group
        step counts as they are; the end-of-backward callback queued."""
        task = torch._C._current_graph_task_id()
        if task in self._tasks:
            return
        opt = self.optimizer
        name = type(opt).__name__
        if self._tasks:  # a nested backward (a reentrant checkpoint's): the same step
            self._tasks.append(task)
            self._newest = max(self._newest, task)
            return
        if task < self._newest:
            # (task ids grow: a smaller one is an outer backward whose nested one, which
            # began first, was taken for the whole; the step counted it already)
            raise RuntimeError(
                f"{name}: a nested backward ran before the first gradient of its outer one "
                "(torch.utils.checkpoint with use_reentrant=True around the last layers), so "
                "the step inside backward could not tell where backward ends; use "
                "use_reentrant=False, or checkpoint fewer of the last layers")
        if [len(group["params"]) for group in opt.param_groups] != self._sizes:
            raise RuntimeError(f"{name}: param groups were added or changed after "
                               "in_backward(); call .remove() on its handle and "
                               "mixedprec.optim.in_backward(optimizer) again")
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._group_of:
                    raise RuntimeError(
                        f"{name}: a parameter of shape {tuple(p.shape)} requires grad but did "
                        "not when in_backward() was called, so no hook steps it; call "
                        ".remove() on its handle and mixedprec.optim.in_backward(optimizer) "
                        "again after unfreezing")
        if getattr(opt, "grad_scale", None) is not None:
            raise RuntimeError(f"{name}: a loss scaler's grad_scale is set; the step inside "
                               "backward takes no loss scaler (train in bf16)")
        torch_path.check_groups(opt, opt._checked)  # (before the first bucket steps)
        self._left = [len(bucket.params) for bucket in self.buckets]
        self._stepped = [False] * len(self.buckets)
        self._group_steps = {i: group["step"] for i, group in enumerate(opt.param_groups)
                             if "step" in group}
        self._tasks = [task]
        self._newest = max(self._newest, task)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _step(self, index: int, params: List[Tensor]) -> None:
        """One bucket's step (``params``: those of its parameters that step), then its
        gradients are freed. Each group's ``step`` count (SGD's rounding one) starts from
        its value as backward began, as in ``step()``, and the group keeps the result."""
        opt = self.optimizer
        bucket = self.buckets[index]
        keep = {id(p) for p in params}
        views = []
        for group_index, group_params in bucket.groups:
            view = torch_path.Subset(opt.param_groups[group_index],
                                     only=[p for p in group_params if id(p) in keep])
            start = self._group_steps.get(group_index)
            if isinstance(start, Tensor):
                view["step"] = start.clone()
            elif group_index in self._group_steps:
                view["step"] = start
            else:
                view.pop("step", None)
            views.append((group_index, view))
        with torch.no_grad():
            opt._pending.clear()
            opt._fused_step([view for _, view in views], bucket.cache)
            torch_path.step_pending(opt)
        for group_index, view in views:
            if isinstance(view.get("step"), Tensor):
                opt.param_groups[group_index]["step"] = view["step"]
        for p in params:
            p.grad = None
        self._stepped[index] = True

    def _finish(self) -> None:
        """End of backward: buckets with parameters that got no gradient in it step those
        that have one (accumulated earlier), and ``applied_steps`` counts the step."""
        try:
            if self._deferred:  # after DDP's own end of backward, queued after this one
                torch.autograd.Variable._execution_engine.queue_callback(self._after_ddp)
                return
            if self.ddp is not None:  # (counted by the last bucket's hook)
                return
            for index, bucket in enumerate(self.buckets):
                if not self._stepped[index]:
                    ready = [p for p in bucket.params if p.grad is not None]
                    if ready:
                        self._step(index, ready)
            if any(self._stepped):
                self._count()
        finally:
            self._tasks = []

    def _after_ddp(self) -> None:
        """DDP finding unused parameters (or with a static graph): after its end of
        backward, which has given the parameters some rank used their averaged gradients
        and left the others' as they were (None after a step here), the buckets step
        those with a gradient, and ``applied_steps`` counts the step."""
        for index, bucket in enumerate(self.buckets):
            ready = [p for p in bucket.params if p.grad is not None]
            if ready:
                self._step(index, ready)
        if any(self._stepped):
            self._count()

    def _count(self) -> None:
        """``applied_steps`` counts the backward's step."""
        _state.count_applied(self.optimizer, None)
        # (torch's LR schedulers warn unless they see step() called; it was)
        self.optimizer._opt_called = True


def _weak_hook(method):
    """A parameter's hook calling ``method`` (a handle's) while the handle lives (its
    optimizer holds it). A tensor's hooks are held by its C++ autograd data, which
    Python's garbage collector does not see through: a hook holding the handle, whose
    buckets hold the parameter, would keep the model and the optimizer alive for good."""
    method = weakref.WeakMethod(method)

    def hook(p: Tensor) -> None:
        bound = method()
        if bound is not None:
            bound(p)
    return hook


def _release(hooks: List[Any], ids: List[int], handle: Any) -> None:
    """A handle's hooks removed, and its parameters' entries in ``_STEPPERS``."""
    for hook in hooks:
        hook.remove()
    for i in ids:
        if _STEPPERS.get(i) is handle:
            del _STEPPERS[i]


def _weak_comm_hook(method, allreduce):
    """DDP's comm hook as :func:`_weak_hook` (DDP's C++ reducer holds it, and the handle
    holds the DDP model): ``method`` while the handle lives, else DDP's all-reduce."""
    method = weakref.WeakMethod(method)

    def hook(process_group, bucket):  # (DDP checks the names; no annotations)
        bound = method()
        return (allreduce if bound is None else bound)(process_group, bucket)
    return hook


# id(parameter) -> the handle that steps it inside backward (weakly). A live handle's
# optimizer holds its parameters, so an id here is not reused while its handle lives.
_STEPPERS: Dict[int, Any] = {}


def _stepper(p: Tensor) -> Any:
    """The live handle that steps ``p`` inside backward, if any."""
    ref = _STEPPERS.get(id(p))
    handle = ref() if ref is not None else None
    if handle is None or handle.optimizer.in_backward is not handle or \
            id(p) not in handle._group_of:
        return None
    return handle


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _check(opt: Optimizer, bucket_cap_mb: float, model: Any) -> List[Tuple[int, Tensor]]:
    """The optimizer's parameters that take gradients, as (group index, param), after
    checking that it can step inside backward (nothing changes on an error)."""
    if not isinstance(opt, Optimizer):
        raise TypeError("in_backward: expected a mixedprec.optim optimizer, got "
                        f"{type(opt).__name__}")
    name = type(opt).__name__
    if opt._NOT_IN_BACKWARD:
        raise TypeError(f"in_backward: {name} cannot step inside backward: "
                        f"{opt._NOT_IN_BACKWARD}")
    if inspect.unwrap(type(opt).step) is not inspect.unwrap(Optimizer.step):
        raise TypeError(f"in_backward: {name} has a step of its own; pass one of "
                        "mixedprec.optim's Adam, AdamW, SGD or Adagrad")
    if opt.in_backward is not None:
        raise ValueError(f"in_backward: this {name} already steps inside backward")
    if any(group.get("differentiable") for group in opt.param_groups):
        raise ValueError(f"in_backward: {name} has a param group with differentiable=True, "
                         "whose step autograd records: it cannot run inside backward")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or \
            not 0 < bucket_cap_mb < math.inf:
        raise ValueError(f"in_backward: expected bucket_cap_mb to be a number > 0, got "
                         f"{bucket_cap_mb!r}")
    if model is not None and not _is_ddp(model):
        raise TypeError("in_backward: expected model to be a DistributedDataParallel "
                        f"model (or None), got {type(model).__name__}")
    params = []
    for index, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if is_dtensor(p):
                raise TypeError(f"in_backward: {name} has a DTensor parameter (FSDP2 "
                                "reduce-scatters gradients after the hooks run); use step()")
            if p.dtype == torch.float16:
                raise TypeError(
                    f"in_backward: {name} has float16 parameters, which need a loss "
                    "scaler: an overflow found late in backward would come after earlier "
                    "buckets stepped, and their steps cannot be undone exactly. Use "
                    "bfloat16 parameters, or step() with a GradScaler")
            other = _stepper(p)
            if other is not None:
                raise ValueError(f"in_backward: a parameter of shape {tuple(p.shape)} of this "
                                 f"{name} already steps inside backward with another "
                                 f"optimizer ({type(other.optimizer).__name__}); one "
                                 "optimizer steps a parameter inside backward")
            if p.requires_grad:
                params.append((index, p))
    if model is None and torch.distributed.is_available() and \
            torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise RuntimeError("in_backward: a process group of more than one process is "
                           "initialised; pass the DistributedDataParallel model as model= "
                           "(DDP averages gradients after the parameters' hooks, so the "
                           "step must follow its all-reduce)")
    return params


def in_backward(optimizer: Optimizer, *, bucket_cap_mb: float = 25.0,
                model: Any = None) -> InBackward:
    """Makes ``optimizer`` (a :mod:`mixedprec.optim` Adam, AdamW, SGD or Adagrad) step
    inside backward: its parameters, in buckets of about ``bucket_cap_mb`` MiB of
    gradients taken from the last parameter back, step as soon as backward has
    accumulated a bucket's gradients, and those gradients are freed (``p.grad`` is None
    after backward). Returns the handle (:class:`InBackward`): ``.no_step()`` for
    gradient accumulation, ``.remove()`` to go back to ``step()``, which raises
    meanwhile. With ``model``, a ``DistributedDataParallel`` model of the optimizer's
    parameters, DDP's own buckets step, each once DDP has averaged it (its comm hook:
    DDP keeps its buckets, so gradients take the memory they take under DDP; they are
    zeroed rather than freed; with ``find_unused_parameters=True`` or
    ``static_graph=True``, at the end of backward). What it refuses and why: the module
    docstring."""
    return InBackward(optimizer, bucket_cap_mb, model)
