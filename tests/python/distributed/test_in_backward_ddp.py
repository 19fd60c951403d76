"""The step inside backward under DDP (two gloo processes on the CPU): each of DDP's
buckets steps once DDP has averaged it (in_backward(..., model=ddp_model)), bit for bit
DDP with step(), in the modes with the most per-step keys (remainder + 8-bit Adam
moments; stochastic rounding with SGD's group step count), the ranks equal; and
gradient accumulation under no_sync(); a dropped DDP model and optimizer are
collected without remove(); an optimizer of some of the model's parameters leaves the
others' averaged gradients to theirs; find_unused_parameters=True steps no parameter
that got no gradient on any rank, nor static_graph=True a layer never used, bit for bit
step(); and a second comm hook is refused by name, nothing left attached."""

import gc
import time
import weakref

import pytest
import torch
from distributed_harness import can_run, run_ranks
from helpers import make_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mixedprec import optim

WORLD_SIZE = 2
SIZES = (8, 64, 64, 4)
CONFIGS = [
    (optim.AdamW, dict(master="remainder", state_dtype=torch.float8_e4m3fn, seed=3)),
    (optim.SGD, dict(momentum=0.9, master="stochastic", state_dtype=torch.bfloat16, seed=5)),
    (optim.Adam, dict()),
]

pytestmark = pytest.mark.skipif(not can_run("cpu", WORLD_SIZE), reason="needs gloo")


def loss_of(model, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(5, SIZES[0], generator=g).to(torch.bfloat16)
    y = torch.randn(5, SIZES[-1], generator=g)
    return (model(x).float() - y).pow(2).mean()


def tensors(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def train(rank, world_size, cls, kwargs, attach, accumulate, view=False):
    model = make_model(dtype=torch.bfloat16, sizes=SIZES, activation=nn.GELU)
    ddp = DDP(model, bucket_cap_mb=0.01, gradient_as_bucket_view=view)  # (several buckets)
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    handle = optim.in_backward(opt, model=ddp) if attach else None
    for step in range(3):
        if accumulate:
            with ddp.no_sync():
                if handle is not None:
                    with handle.no_step():
                        loss_of(ddp, rank, 10 + step).backward()
                else:
                    loss_of(ddp, rank, 10 + step).backward()
        loss_of(ddp, rank, step).backward()
        if handle is None:
            opt.step()
            opt.zero_grad()
    return tensors(model, opt) + [opt.applied_steps.clone()]


def ranks(rank, world_size):
    results = {}
    for c, (cls, kwargs) in enumerate(CONFIGS):
        for accumulate in (False, True):
            results[c, accumulate] = [train(rank, world_size, cls, kwargs, attach, accumulate)
                                      for attach in (False, True)]
    cls, kwargs = CONFIGS[0]
    results["view"] = [train(rank, world_size, cls, kwargs, attach, True, view=True)
                       for attach in (False, True)]
    results["fsdp"] = fsdp_refusal()
    results["collected"] = collected(rank)
    results["partial"] = [partial(rank, attach) for attach in (False, True)]
    results["unused"] = [unused(rank, cls, kwargs, attach)
                         for cls, kwargs in CONFIGS[:2] for attach in (False, True)]
    results["static"] = [unused(rank, *CONFIGS[0], attach, static=True)
                         for attach in (False, True)]
    results["hooked"] = second_comm_hook()
    return results


def partial(rank, attach):
    """The first layer inside backward (AdamW), the rest stepped by torch's SGD with
    step(): the rest train on DDP's averaged gradients as without in_backward."""
    model = make_model(dtype=torch.bfloat16, sizes=SIZES, activation=nn.GELU)
    ddp = DDP(model)  # (one bucket: both optimizers' parameters in it)
    params = list(model.parameters())
    first = optim.AdamW(params[:2], lr=1e-2)
    rest = torch.optim.SGD(params[2:], lr=0.1)
    handle = optim.in_backward(first, model=ddp) if attach else None
    for step in range(3):
        loss_of(ddp, rank, step).backward()
        if handle is None:
            first.step()
            first.zero_grad()
        rest.step()
        rest.zero_grad()
    return tensors(model, first)


class WithSide(nn.Module):
    """make_model's layers, and a side layer used in the first step only."""

    def __init__(self):
        super().__init__()
        self.body = make_model(dtype=torch.bfloat16, sizes=SIZES, activation=nn.GELU)
        self.side = nn.Linear(SIZES[0], SIZES[-1]).to(torch.bfloat16)

    def forward(self, x, side):
        return self.body(x) + self.side(x) if side else self.body(x)


def unused(rank, cls, kwargs, attach, static=False):
    """DDP with find_unused_parameters=True: a layer unused in a step (on every rank)
    does not step there, as step() skips its None gradient; with static_graph=True, a
    layer never used (a static graph's usage does not change)."""
    torch.manual_seed(0)
    model = WithSide()
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=not static,
              static_graph=static)
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    handle = optim.in_backward(opt, model=ddp) if attach else None
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(5, SIZES[0], generator=g).to(torch.bfloat16)
        y = torch.randn(5, SIZES[-1], generator=g)
        (ddp(x, step == 0 and not static).float() - y).pow(2).mean().backward()
        if handle is None:
            opt.step()
            opt.zero_grad()
    return tensors(model, opt) + [opt.applied_steps.clone()]


def second_comm_hook():
    """A second in_backward on one DDP model (DDP takes one comm hook): the error, and
    whether the second optimizer was left attached."""
    model = make_model(dtype=torch.bfloat16, sizes=SIZES, activation=nn.GELU)
    ddp = DDP(model)
    params = list(model.parameters())
    optim.in_backward(optim.AdamW(params[:2]), model=ddp)
    other = optim.AdamW(params[2:])
    hooks = len(getattr(ddp, "_comm_hooks", []))
    try:
        optim.in_backward(other, model=ddp)
    except RuntimeError as error:
        return str(error), other.in_backward is None and len(
            getattr(ddp, "_comm_hooks", [])) == hooks
    return None


def collected(rank):
    """Whether a DDP model, its module and its optimizer stepping inside backward are
    all collected once dropped, without remove() (DDP's C++ reducer holds the comm hook,
    out of the garbage collector's sight: the hook holds the handle weakly)."""
    model = make_model(dtype=torch.bfloat16, sizes=SIZES, activation=nn.GELU)
    ddp = DDP(model, bucket_cap_mb=0.01)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    optim.in_backward(opt, model=ddp)
    loss_of(ddp, rank, 0).backward()
    refs = [weakref.ref(x) for x in (ddp, model, opt, opt.in_backward)]
    del model, ddp, opt
    for _ in range(50):  # (gloo's threads may still hold a finished all-reduce's callback)
        gc.collect()
        if all(r() is None for r in refs):
            break
        time.sleep(0.02)
    return [r() is None for r in refs]


def fsdp_refusal():
    """in_backward on an FSDP2 model's optimizer: the error, and whether hooks remain."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(dtype=torch.bfloat16, sizes=SIZES, activation=nn.GELU)
    fully_shard(model)
    opt = optim.AdamW(model.parameters())
    try:
        optim.in_backward(opt)
    except TypeError as error:
        hooked = any(getattr(p, "_post_accumulate_grad_hooks", None)
                     for p in model.parameters())
        return str(error), hooked, opt.in_backward is None
    return None


def test_ddp_buckets_step_bit_for_bit_as_step_and_fsdp2_is_refused():
    results = run_ranks(ranks, WORLD_SIZE)
    for key, value in results[0].items():
        if key in ("fsdp", "collected", "unused", "static", "hooked"):
            continue
        stepped, inside = value
        assert len(stepped) == len(inside), key
        for i, (a, b) in enumerate(zip(stepped, inside)):
            assert a.dtype == b.dtype and torch.equal(a, b), (key, i)
        for i, (a, b) in enumerate(zip(inside, results[1][key][1])):
            assert torch.equal(a, b), ("ranks differ", key, i)
    assert int(results[0][0, False][1][-1]) == 3
    # FSDP2 (in the same processes: a spawn costs seconds) is refused, naming why, and
    # nothing is left attached.
    for rank in range(WORLD_SIZE):
        message, hooked, detached = results[rank]["fsdp"]
        assert "DTensor parameter (FSDP2 reduce-scatters gradients" in message
        assert not hooked and detached
        assert results[rank]["collected"] == [True] * 4
        message, detached = results[rank]["hooked"]
        assert "has a comm hook already" in message and detached
        # find_unused_parameters: each config without and with in_backward, bit for bit
        runs = results[rank]["unused"]
        for stepped, inside in (runs[0:2], runs[2:4], results[rank]["static"]):
            assert len(stepped) == len(inside)
            for i, (a, b) in enumerate(zip(stepped, inside)):
                assert a.dtype == b.dtype and torch.equal(a, b), ("unused", rank, i)

