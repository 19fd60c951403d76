"""Apex's SyncBatchNorm on the CPU under gloo (two processes), where
torch.nn.SyncBatchNorm refuses to synchronise: each rank's half of a batch is normalised
with the statistics of the whole batch, the gradients of the input, weight and bias and
the running statistics are those of one BatchNorm over the whole batch, channels-first
and channel-last (Apex's [N, ..., C]); a process group of one rank is torch's own
BatchNorm, bit for bit; eval mode uses the running statistics, or without them the
whole batch's statistics."""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import can_run, run_ranks
from torch import nn

from mixedprec.parallel import SyncBatchNorm, convert_syncbn_model

WORLD_SIZE = 2
BATCH = 6  # per rank
SHAPES = {"channels_first": (BATCH * WORLD_SIZE, 3, 5, 4),
          "channel_last": (BATCH * WORLD_SIZE, 7, 3)}

pytestmark = pytest.mark.skipif(not can_run("cpu", WORLD_SIZE), reason="needs gloo")


def data(shape):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
    weights = torch.randn(shape, generator=g, dtype=torch.float64)  # (the loss's)
    return x, weights


def build(channels, cls, **kwargs):
    torch.manual_seed(3)
    bn = cls(channels, momentum=0.3, **kwargs).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def run(bn, x, weights, steps=2):
    """Two training steps' outputs and gradients, then an eval-mode output."""
    outs = []
    for _ in range(steps):
        x = x.detach().requires_grad_()
        out = bn(x)
        (out * weights).sum().backward()
        outs.append((out.detach(), x.grad, bn.weight.grad.clone(), bn.bias.grad.clone()))
        bn.weight.grad = bn.bias.grad = None
    bn.eval()
    evaluated = bn(x.detach())
    bn.train()
    return outs, evaluated, bn.running_mean.clone(), bn.running_var.clone()


def ranks(rank, world_size):
    results = {}
    for name, shape in SHAPES.items():
        channel_last = name == "channel_last"
        x, weights = (t.chunk(world_size)[rank] for t in data(shape))
        bn = build(shape[-1] if channel_last else shape[1], SyncBatchNorm,
                   channel_last=channel_last)
        results[name] = run(bn, x, weights)
    # A group of one rank (every rank makes every group: new_group is collective).
    groups = [dist.new_group([r]) for r in range(world_size)]
    x, weights = (t.chunk(world_size)[rank] for t in data(SHAPES["channels_first"]))
    alone = convert_syncbn_model(build(3, nn.BatchNorm2d), process_group=groups[rank])
    results["alone"] = run(alone, x, weights)
    results["reference_alone"] = run(build(3, nn.BatchNorm2d), x, weights)
    # Without running statistics, eval mode normalises with the batch's, synchronised too
    # (as Apex's SyncBatchNorm; torch's synchronises in training only).
    results["eval_batch_stats"] = build(3, SyncBatchNorm, track_running_stats=False).eval()(x)
    return results


def test_sync_batch_norm_on_the_cpu_equals_batch_norm_over_the_whole_batch():
    results = run_ranks(ranks, WORLD_SIZE)
    for name, shape in SHAPES.items():
        channel_last = name == "channel_last"
        x, weights = data(shape)
        channels = shape[-1] if channel_last else shape[1]
        reference = build(channels, nn.BatchNorm1d if channel_last else nn.BatchNorm2d)
        if channel_last:  # ([N, L, C] -> [N, C, L] for torch's BatchNorm1d)
            x, weights = x.movedim(-1, 1), weights.movedim(-1, 1)
        outs, evaluated, mean, var = run(reference, x, weights)
        if channel_last:
            outs = [(o.movedim(1, -1), g.movedim(1, -1), w, b) for o, g, w, b in outs]
            evaluated = evaluated.movedim(1, -1)
        for rank in range(WORLD_SIZE):
            r_outs, r_evaluated, r_mean, r_var = results[rank][name]
            for step, ((o, g, _, _), (ro, rg, _, _)) in enumerate(zip(outs, r_outs)):
                torch.testing.assert_close(ro, o.chunk(WORLD_SIZE)[rank], msg=f"{name} {step}")
                torch.testing.assert_close(rg, g.chunk(WORLD_SIZE)[rank], msg=f"{name} {step}")
            torch.testing.assert_close(r_evaluated, evaluated.chunk(WORLD_SIZE)[rank])
            torch.testing.assert_close(r_mean, mean)
            torch.testing.assert_close(r_var, var)
        # Each rank's weight and bias gradients are its half's: they sum to the whole's.
        for step, (_, _, w, b) in enumerate(outs):
            halves = [results[r][name][0][step] for r in range(WORLD_SIZE)]
            torch.testing.assert_close(sum(h[2] for h in halves), w)
            torch.testing.assert_close(sum(h[3] for h in halves), b)
    x, _ = data(SHAPES["channels_first"])
    whole = build(3, nn.BatchNorm2d, track_running_stats=False).eval()(x)
    for rank in range(WORLD_SIZE):
        torch.testing.assert_close(results[rank]["eval_batch_stats"],
                                   whole.chunk(WORLD_SIZE)[rank])
    for rank in range(WORLD_SIZE):
        got, want = results[rank]["alone"], results[rank]["reference_alone"]
        for a, b in zip(got[0], want[0]):
            assert all(torch.equal(s, t) for s, t in zip(a, b))
        assert all(torch.equal(s, t) for s, t in zip(got[1:], want[1:]))


def conv_bn():
    torch.manual_seed(5)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=0.3)).double()


def ddp_ranks(rank, world_size):
    """Apex's pattern: convert_syncbn_model, then apex.parallel's DistributedDataParallel,
    on the CPU (torch's DDP refuses a CPU module with torch's SyncBatchNorm)."""
    from mixedprec.parallel import DistributedDataParallel

    x, _ = (t.chunk(world_size)[rank] for t in data(SHAPES["channels_first"]))
    model = DistributedDataParallel(convert_syncbn_model(conv_bn()))
    model(x).square().sum().backward()
    bn = model.module[1]
    with pytest.raises(ValueError, match="mixedprec.parallel.SyncBatchNorm"):  # torch's class
        DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(conv_bn()))
    return ([p.grad for p in model.parameters()], bn.running_mean.clone(),
            bn.running_var.clone())


def test_apex_ddp_takes_sync_batch_norm_on_the_cpu():
    results = run_ranks(ddp_ranks, WORLD_SIZE)
    reference = conv_bn()
    x, _ = data(SHAPES["channels_first"])
    reference(x).square().sum().backward()
    for grads, mean, var in results:
        # each rank's loss is its half's; DDP averages: half the whole batch's gradient
        for g, r in zip(grads, reference.parameters()):
            torch.testing.assert_close(g * WORLD_SIZE, r.grad)
        torch.testing.assert_close(mean, reference[1].running_mean)
        torch.testing.assert_close(var, reference[1].running_var)
