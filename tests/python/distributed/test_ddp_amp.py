"""Two processes (gloo, CPU) train under DDP with loss scaling and stay in sync, also
when only one rank's gradients overflow: the all-reduce spreads the inf, so every rank
skips the same step and backs off its scale the same way."""

import gc
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import make_model
from torch import nn

import mixedprec
from mixedprec import amp
from mixedprec.parallel import DistributedDataParallel

WORLD_SIZE = 2
STEPS = 5
OVERFLOW_STEP = 2  # rank 1 alone sees an inf at this step


MLP = dict(sizes=(8, 16, 1), activation=nn.ReLU)  # helpers.make_model's Sequential


def flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def all_ranks_equal(t):
    gathered = [torch.empty_like(t) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    if rank == 1 and step == OVERFLOW_STEP:
        x[0, 0] = float("inf")
    return x


def train_amp(rank):
    """amp O2 (bf16 weights, a dynamic loss scale) with FusedAdam masters."""
    model = make_model(**MLP)
    opt = mixedprec.FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    model = DistributedDataParallel(model)
    scales, params = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(batch(rank, step)).float().square().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        before = flat(model.module)
        opt.step()
        scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        params.append((before, flat(model.module)))
    return scales, params, opt.param_groups[0]["step"].item()


def train_scaler(rank):
    """mixedprec.GradScaler with FusedSGD on an fp32 model."""
    model = DistributedDataParallel(make_model(**MLP))
    opt = mixedprec.FusedSGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = mixedprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    scales, params = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(batch(rank, step)).square().mean()
        scaler.scale(loss).backward()
        before = flat(model.module)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append((before, flat(model.module)))
    return scales, params, None


def check(rank, mode):
    scales, params, adam_step = (train_amp if mode == "amp" else train_scaler)(rank)
    for step, (before, after) in enumerate(params):
        assert all_ranks_equal(after), f"{mode}: ranks diverged at step {step}"
        skipped = torch.equal(before, after)
        assert skipped == (step == OVERFLOW_STEP), (
            f"{mode}: step {step} {'skipped' if skipped else 'taken'} on rank {rank}")
    assert all_ranks_equal(torch.tensor(scales))
    assert scales[OVERFLOW_STEP] == scales[OVERFLOW_STEP - 1] / 2, scales
    if adam_step is not None:
        assert adam_step == STEPS - 1  # the skipped step is not counted
    return scales


def worker(rank, init_file, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        results = {mode: check(rank, mode) for mode in ("amp", "scaler")}
        if rank == 0:
            torch.save(results, result_file)
        # DDP's reducer sits in reference cycles: free it while the process group still
        # exists, then tear gloo down together (a rank that leaves while its peer's
        # connections are live, or a reducer destroyed after its group, aborts).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalisation, where gloo threads still referenced by leftover
    # objects can abort ("terminate called without an active exception"). Failures
    # raise above and reach mp.spawn as usual.
    os._exit(0)


def test_ddp_ranks_stay_in_sync_when_one_rank_overflows(tmp_path):
    """amp O2 with FusedAdam, and GradScaler with FusedSGD, in one pair of processes."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result = tmp_path / "scales.pt"
    mp.spawn(worker, args=(str(tmp_path / "init"), str(result)), nprocs=WORLD_SIZE, join=True)
    scales = torch.load(result, weights_only=True)
    assert set(scales) == {"amp", "scaler"} and all(len(s) == STEPS for s in scales.values())
