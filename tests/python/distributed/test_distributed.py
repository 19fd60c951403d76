"""mixedprec on torch.distributed's engines, on 2 and 4 processes: FSDP2's
mixed-precision recipes with the fused optimizers, tensor parallelism, one overflow
decision across ranks, ZeroRedundancyOptimizer, and distributed checkpoints that
reshard. Each test runs on the CPU with gloo, and again on GPUs with NCCL on a machine
with one GPU per rank (skipped elsewhere)."""


import pytest
import torch
import torch.distributed as dist
from distributed_harness import can_run, device, run_ranks
from helpers import make_model
from torch import nn

import mixedprec
from mixedprec.optimizers import FusedAdagrad, FusedLAMB, FusedNovoGrad

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


@pytest.fixture(params=["cpu", "cuda"])
def backend(request):
    """The device type of the ranks: the CPU (gloo) always; CUDA (NCCL) with 4 GPUs."""
    if not can_run(request.param, 4):
        pytest.skip(f"needs {'4 GPUs and NCCL' if request.param == 'cuda' else 'gloo'}")
    return request.param

STEPS = 4
GLOBAL_BATCH = 8


def mlp(dtype=torch.float32, on=None) -> nn.Module:
    """The test model, on this rank's device (``on``: another)."""
    return make_model(on if on is not None else device(), dtype, sizes=(16, 32, 8),
                      activation=nn.ReLU)


def batch(step: int, rank: int = 0, world: int = 1):
    """This rank's slice of the global batch of ``step`` (the whole batch for world 1)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
    k = GLOBAL_BATCH // world
    return x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]


def loss_of(model, x, y):
    p = next(model.parameters())
    return (model(x.to(p.device, p.dtype)).float() - y.to(p.device)).square().mean()


def train_beside(model, opt, single, ref, sliced: bool = True) -> None:
    """STEPS steps of ``model`` (on this rank's slice of each global batch, or with
    ``sliced=False`` the whole batch, as tensor parallelism takes it) and of the
    one-process reference ``single`` (the whole batch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        loss_of(model, *(batch(step, rank, world) if sliced else batch(step))).backward()
        opt.step()
        opt.zero_grad()
        loss_of(single, *batch(step)).backward()
        ref.step()
        ref.zero_grad()


def fsdp(model: nn.Module, policy=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if policy is None else {"mp_policy": policy}
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    return model


def ddp(model: nn.Module) -> nn.Module:
    ids = [device().index] if device().type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def full(tensors):
    """Whole tensors from DTensors (a collective), plain tensors as they are."""
    return [t.full_tensor() if mixedprec.distributed.is_dtensor(t) else t.detach().clone()
            for t in tensors]


def all_equal(t: torch.Tensor) -> bool:
    t = t.to(device())
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


# -- 1. FSDP2 recipes ----------------------------------------------------------------------

def fsdp_recipe(rank, world, recipe):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}
    results = {}
    if recipe in ("bf16", "fp16"):
        # fp32 sharded params (the masters), 16-bit compute; fp16 adds a loss scaler.
        policy = MixedPrecisionPolicy(param_dtype=dtype[recipe], reduce_dtype=torch.float32)
        ours, theirs = fsdp(mlp(), policy), fsdp(mlp(), policy)
        opt = mixedprec.FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.01)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.01)
        scalers = None
        if recipe == "fp16":
            scalers = (mixedprec.GradScaler(device().type, init_scale=2.0**8),
                       torch.amp.GradScaler(device().type, init_scale=2.0**8))
        for step in range(STEPS):
            x, y = batch(step, rank, world)
            for i, (model, o) in enumerate(((ours, opt), (theirs, ref))):
                loss = loss_of(model, x, y)
                if scalers is None:
                    loss.backward()
                    o.step()
                else:
                    scalers[i].scale(loss).backward()
                    scalers[i].step(o)
                    scalers[i].update()
                o.zero_grad()
        for a, b in zip(full(ours.parameters()), full(theirs.parameters())):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        p = next(iter(ours.parameters()))
        state = opt.state[p]
        assert type(state["exp_avg"]).__name__ == "DTensor"
        assert state["exp_avg"].placements == p.placements
        results["state_bytes"] = sum(v.to_local().numel() * v.element_size()
                                     for s in opt.state.values() for v in s.values()
                                     if mixedprec.distributed.is_dtensor(v))
    else:  # "masters": bf16 sharded params, fp32 masters inside FusedAdam
        model = fsdp(mlp(torch.bfloat16))
        single = mlp(torch.bfloat16)  # the reference: one process, the whole batch
        opt = mixedprec.FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
        ref = mixedprec.FusedAdam(single.parameters(), lr=1e-2, master_weights=True)
        train_beside(model, opt, single, ref)
        masters = full(opt.state[p]["master_param"] for p in model.parameters())
        ref_masters = [ref.state[p]["master_param"] for p in single.parameters()]
        for a, b in zip(masters, ref_masters):
            # bf16 gradients averaged across ranks (FSDP) or over the whole batch (the
            # reference) differ in their last bits; Adam's normalised update carries that
            # into a few elements: within a tenth of one step (lr) of each other
            torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
        for p, m in zip(full(model.parameters()), masters):
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
        results["state_bytes"] = sum(v.to_local().numel() * v.element_size()
                                     for s in opt.state.values() for v in s.values()
                                     if mixedprec.distributed.is_dtensor(v))
    params = list((ours if recipe != "masters" else model).parameters())
    results["numel"] = sum(p.to_local().numel() for p in params)
    results["param_bytes"] = sum(p.to_local().numel() * p.element_size() for p in params)
    return results


# Bytes per parameter on each rank (docs/distributed.md): (sharded params, optimizer state)
RECIPE_BYTES = {"bf16": (4, 8), "fp16": (4, 8), "masters": (2, 12)}


@pytest.mark.parametrize("recipe", ["bf16", "fp16", "masters"])
def test_fsdp2_mixed_precision_recipes(backend, recipe):
    results = run_ranks(fsdp_recipe, 2, recipe, device=backend)
    total = sum(p.numel() for p in mlp(on="cpu").parameters())
    assert sum(r["numel"] for r in results) == total  # each rank holds its shard alone
    for r in results:
        assert (r["param_bytes"], r["state_bytes"]) == tuple(b * r["numel"]
                                                             for b in RECIPE_BYTES[recipe])


# -- 2. One overflow decision on every rank ----------------------------------------------

INF_STEP = 2


def overflow_agreement(rank, world, layout, kind):
    """Trains with an inf put into rank 1's shard of one gradient at INF_STEP, after the
    gradients were reduced; returns per step whether this rank's shards changed."""
    if layout == "fsdp":
        model = fsdp(mlp())
    else:  # tensor parallelism: Shard(0) and Shard(1) weights, a replicated bias
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(device().type, (world,))
        model = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if kind == "mixedprec":
        opt = mixedprec.FusedAdam(model.parameters(), lr=1e-2)
        scaler = mixedprec.GradScaler(device().type, init_scale=2.0**10)
    else:  # torch's own: the behaviour mixedprec must match
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = ShardedGradScaler(device().type, init_scale=2.0**10)
    changed, scales = [], []
    for step in range(STEPS):
        x, y = batch(step, rank, world) if layout == "fsdp" else batch(step)
        scaler.scale(loss_of(model, x, y)).backward()
        if step == INF_STEP and rank == 1:
            grad = next(iter(model.parameters())).grad
            grad.to_local().view(-1)[0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed.append(any(not torch.equal(b, p.to_local())
                           for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    assert all_equal(torch.tensor(changed)), f"ranks took different steps: {changed}"
    assert all_equal(torch.tensor(scales)), f"scales differ across ranks: {scales}"
    for p in model.parameters():  # replicated parameters stay identical, bit for bit
        if all(pl.is_replicate() for pl in p.placements):
            assert all_equal(p.to_local())
    return changed, scales


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("kind", ["mixedprec", "torch"])
def test_inf_on_one_rank_skips_the_step_on_every_rank(backend, layout, kind):
    results = run_ranks(overflow_agreement, 2, layout, kind, device=backend)
    changed, scales = results[0]
    assert changed == [step != INF_STEP for step in range(STEPS)]
    assert scales[INF_STEP] == scales[INF_STEP - 1] / 2


def ddp_grad_changed_after_allreduce(rank, world, kind):
    """DDP: rank 1 changes its gradient after DDP's all-reduce. Neither scaler adds a
    collective of its own: rank 1 alone skips (as torch.amp.GradScaler does)."""
    model = ddp(mlp())
    if kind == "mixedprec":
        opt = mixedprec.FusedSGD(model.parameters(), lr=0.1)
        scaler = mixedprec.GradScaler(device().type, init_scale=2.0**10)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device().type, init_scale=2.0**10)
    x, y = batch(0, rank, world)
    scaler.scale(loss_of(model, x, y)).backward()
    if rank == 1:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kind", ["mixedprec", "torch"])
def test_ddp_gradient_changed_on_one_rank_is_that_ranks_alone(backend, kind):
    assert run_ranks(ddp_grad_changed_after_allreduce, 2, kind, device=backend) == [True, False]


# -- 3. The fused optimizers on DTensor parameters ---------------------------------------

def _optimizers(master_weights):
    """Each fused optimizer; with master_weights (bf16 params) also the lean modes (bf16
    state, Kahan compensations: state made from the parameters, DTensors alike)."""
    lean = {
        "FusedAdam-kahan-bf16-moments": lambda ps: mixedprec.FusedAdam(
            ps, lr=1e-2, weight_decay=0.01, master="kahan", state_dtype=torch.bfloat16),
        "FusedSGD-bf16-momentum": lambda ps: mixedprec.FusedSGD(
            ps, lr=0.05, momentum=0.9, weight_decay=0.01, master_weights=True,
            state_dtype=torch.bfloat16),
        # (the bits are keyed by the shard-local index: within an ulp or two of one process)
        "FusedAdam-stochastic": lambda ps: mixedprec.FusedAdam(
            ps, lr=1e-2, weight_decay=0.01, master="stochastic", seed=3),
    } if master_weights else {}
    return lean | {
        "FusedSGD": lambda ps: mixedprec.FusedSGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01,
                                                  master_weights=master_weights),
        "FusedAdam": lambda ps: mixedprec.FusedAdam(ps, lr=1e-2, weight_decay=0.01,
                                                    master_weights=master_weights),
        "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01,
                                                master_weights=master_weights),
        # per-tensor norms inside the op: run on the whole tensors (mixedprec.distributed)
        "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.5,
                                          master_weights=master_weights),
        "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01,
                                                  master_weights=master_weights),
    }


def dtensor_optimizers(rank, world, layout):
    """Each optimizer, with and without masters (bf16 params), steps a sharded model as
    it steps the whole model in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # multi_tensor_l2norm of sharded and replicated DTensors: the whole tensors' norms
    model = fsdp(mlp()) if layout == "fsdp" else parallelize_module(
        mlp(), init_device_mesh(device().type, (world,)),
        {"0": ColwiseParallel(), "2": RowwiseParallel()})
    loss_of(model, *(batch(0, rank, world) if layout == "fsdp" else batch(0))).backward()
    grads = [p.grad for p in model.parameters()]
    total, per_tensor = mixedprec.ops.multi_tensor_l2norm(grads, per_tensor=True)
    whole = [g.double() for g in full(grads)]
    torch.testing.assert_close(per_tensor.double(), torch.stack([g.norm() for g in whole]),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(total.double().reshape(()),
                               torch.cat([g.reshape(-1) for g in whole]).norm(), rtol=1e-6, atol=0)
    checked = []
    for master_weights in (False, True):
        dtype = torch.bfloat16 if master_weights else torch.float32
        for name, make in _optimizers(master_weights).items():
            if layout == "fsdp":
                model = fsdp(mlp(dtype))
            else:
                mesh = init_device_mesh(device().type, (world,))
                model = parallelize_module(mlp(dtype), mesh,
                                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
            single = mlp(dtype)
            opt, ref = make(model.parameters()), make(single.parameters())
            train_beside(model, opt, single, ref, sliced=layout == "fsdp")
            tol = dict(rtol=0, atol=2e-2 if master_weights else 1e-5)  # bf16: an ulp or two
            for a, b in zip(full(model.parameters()), single.parameters()):
                torch.testing.assert_close(a, b.detach(), **tol)
            for p in model.parameters():
                for key, value in opt.state[p].items():
                    # (torch's per-parameter step count, FusedAdagrad's: a plain scalar, as
                    # torch.optim keeps it beside DTensor parameters)
                    if isinstance(value, torch.Tensor) and key != "step":
                        assert value.placements == p.placements, (name, key)
                        expected = {"kahan_comp": torch.bfloat16,
                                    "master_param": torch.float32}.get(key, opt.state_dtype)
                        assert value.dtype == expected, (name, key)
            keys = set(opt.state[next(iter(model.parameters()))])
            assert ("master_param" in keys) == opt.master_weights, (name, keys)
            assert ("kahan_comp" in keys) == (opt.master == "kahan"), (name, keys)
            checked.append((name, master_weights))
    return checked


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fused_optimizers_step_dtensor_parameters(backend, layout):
    checked = run_ranks(dtensor_optimizers, 2, layout, device=backend)[0]
    assert len(checked) == len(_optimizers(False)) + len(_optimizers(True))


def stochastic_rounding_bits_per_shard(rank, world):
    """Stochastic rounding on DTensors: the shards of one tensor draw different bits
    (their global indices differ), the replicas of a replicated one the same (they stay
    equal)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device().type, (world,))
    half = torch.linspace(0.5, 1.0, 2048)
    whole = torch.cat([half] * world).to(torch.bfloat16).to(device())  # equal shards
    results = []
    for placement in (Shard(0), Replicate()):
        p = nn.Parameter(distribute_tensor(whole.clone(), mesh, [placement]))
        p.grad = distribute_tensor(torch.full_like(whole, 0.3), mesh, [placement])
        opt = mixedprec.FusedSGD([p], lr=1e-3, master="stochastic", seed=7)
        opt.step()
        local = p.to_local()
        assert not torch.equal(local, whole[:local.numel()])  # it moved
        results.append(all_equal(local))
    return results


def test_stochastic_rounding_bits_differ_across_shards_and_agree_across_replicas(backend):
    assert run_ranks(stochastic_rounding_bits_per_shard, 2, device=backend) == [[False, True]] * 2


# -- 4. ZeroRedundancyOptimizer ----------------------------------------------------------

def zero_fused_adam(rank, world):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = ddp(mlp(torch.bfloat16))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=mixedprec.FusedAdam,
                                  lr=1e-2, master_weights=True)
    single = mlp(torch.bfloat16)
    ref = mixedprec.FusedAdam(single.parameters(), lr=1e-2, master_weights=True)
    train_beside(model, opt, single, ref)
    for a, b in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=2e-2)
        assert all_equal(a.detach())  # every rank got every partition's update
    opt.consolidate_state_dict(to=0)
    if rank != 0:
        return None
    state = opt.state_dict()
    assert len(state["state"]) == len(list(model.parameters()))
    for i, p in enumerate(model.parameters()):
        entry = state["state"][i]
        assert entry["master_param"].dtype == torch.float32
        assert torch.equal(entry["master_param"].to(torch.bfloat16), p.detach())
        assert set(entry) == {"master_param", "exp_avg", "exp_avg_sq"}
    # ... and a fresh single-process FusedAdam resumes from it
    resumed = mixedprec.FusedAdam(mlp(torch.bfloat16).parameters(), lr=1e-2, master_weights=True)
    resumed.load_state_dict({"state": state["state"],
                             "param_groups": [dict(g, params=list(range(4)))
                                              for g in state["param_groups"][:1]]})
    return sorted(state["state"][0])


def test_zero_redundancy_optimizer_with_fused_adam_masters(backend):
    keys = run_ranks(zero_fused_adam, 2, device=backend)[0]
    assert keys == ["exp_avg", "exp_avg_sq", "master_param"]


# -- 5. Distributed checkpoints: save on N ranks, load on M, continue ----------------------

SAVE_AT, MORE = 2, 2


def dcp_run(rank, world, checkpoint, mode, master="fp32"):
    """bf16 sharded params, fp32 masters in FusedAdam (or with master="remainder" their
    low halves, int16 remainders beside the params), a GradScaler whose scale moves
    every step. ``mode``: "save" trains SAVE_AT steps, saves, trains MORE; "load" loads
    the checkpoint and trains MORE. Returns the final whole params and masters, and the
    scale."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = fsdp(mlp(torch.bfloat16))
    opt = mixedprec.FusedAdam(model.parameters(), lr=1e-2, master=master)
    scaler = mixedprec.GradScaler(device().type, init_scale=2.0**8, growth_interval=1)

    def train(steps):
        for step in steps:
            scaler.scale(loss_of(model, *batch(step, rank, world))).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    if mode == "save":
        train(range(SAVE_AT))
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()},
                 checkpoint_id=checkpoint)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        scaler.scale(torch.ones((), device=device()))  # creates the scale tensor that loading fills
        state = {"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        scaler.load_state_dict(state["scaler"])
    train(range(SAVE_AT, SAVE_AT + MORE))
    if master == "remainder":  # (whole int16 tensors travel as int32)
        masters = [mixedprec.masters.join_remainder(p, r.to(torch.int16)) for p, r in zip(
            full(model.parameters()),
            full(opt.state[p]["remainder"].to(torch.int32) for p in model.parameters()))]
    else:
        masters = full(opt.state[p]["master_param"] for p in model.parameters())
    return (full(model.parameters()), masters, scaler.get_scale(),
            opt.param_groups[0]["step"].item())


@pytest.mark.parametrize("saved_on,loaded_on", [(2, 2), (2, 4), (4, 2)])
def test_distributed_checkpoint_resumes_across_world_sizes(backend, tmp_path, saved_on,
                                                           loaded_on):
    checkpoint = str(tmp_path / "ckpt")
    straight = run_ranks(dcp_run, saved_on, checkpoint, "save", device=backend)[0]
    resumed = run_ranks(dcp_run, loaded_on, checkpoint, "load", device=backend)[0]
    params, masters, scale, step = resumed
    assert scale == straight[2] and step == straight[3] == SAVE_AT + MORE
    if saved_on == loaded_on:  # the same run, interrupted: equal bit for bit
        for a, b in zip(params + masters, straight[0] + straight[1]):
            assert torch.equal(a, b)
    else:  # gradients averaged over other shards: equal to rounding (see recipes)
        for a, b in zip(masters, straight[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-3)


@pytest.mark.parametrize("saved_on,loaded_on", [(2, 2), (2, 4)])
def test_distributed_checkpoint_keeps_remainders(backend, tmp_path, saved_on, loaded_on):
    """master="remainder": the int16 remainders are saved and loaded (resharded) with
    their params; an interrupted run is the straight run bit for bit, masters included."""
    checkpoint = str(tmp_path / "ckpt")
    straight = run_ranks(dcp_run, saved_on, checkpoint, "save", "remainder", device=backend)[0]
    params, masters, scale, step = run_ranks(dcp_run, loaded_on, checkpoint, "load",
                                             "remainder", device=backend)[0]
    assert scale == straight[2] and step == straight[3] == SAVE_AT + MORE
    if saved_on == loaded_on:
        for a, b in zip(params + masters, straight[0] + straight[1]):
            assert torch.equal(a, b)
    else:
        for a, b in zip(masters, straight[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-3)


# -- 6. Norms of partial sums --------------------------------------------------------------

def partial_and_sharded_norms(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh(device().type, (world,))
    pending = DTensor.from_local(torch.full((4,), float(rank + 1), device=device()), mesh,
                                 [Partial()])
    sharded = DTensor.from_local(torch.arange(3.0, device=device()) + rank, mesh, [Shard(0)])
    total, per_tensor = mixedprec.ops.multi_tensor_l2norm([pending, sharded], per_tensor=True)
    whole = [t.full_tensor().double() for t in (pending, sharded)]
    torch.testing.assert_close(per_tensor.double(), torch.stack([w.norm() for w in whole]))
    torch.testing.assert_close(total.double().reshape(()), torch.cat(whole).norm())
    return True


def test_l2norm_of_partial_and_sharded_dtensors(backend):
    """A Partial DTensor's norm is that of the sum it stands for, not of its parts."""
    assert run_ranks(partial_and_sharded_norms, 2, device=backend) == [True, True]


def fsdp_clipping(rank, world):
    """FSDP2 with the scaler's clip_grad_norm_ beside one process that unscales and
    clips with torch's clip_grad_norm_."""
    kind = device().type
    model = fsdp(mlp())
    opt = mixedprec.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = mixedprec.GradScaler(kind, init_scale=2.0**8)
    single = mlp()
    ref = mixedprec.optim.AdamW(single.parameters(), lr=1e-2)
    ref_scaler = mixedprec.GradScaler(kind, init_scale=2.0**8)
    norms = []
    for step in range(STEPS):
        scaler.scale(loss_of(model, *batch(step, rank, world))).backward()
        norm = scaler.clip_grad_norm_(opt, 0.05)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref_scaler.scale(loss_of(single, *batch(step))).backward()
        ref_scaler.unscale_(ref)
        ref_norm = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05)
        ref_scaler.step(ref)
        ref_scaler.update()
        ref.zero_grad()
        norms.append((float(norm), float(ref_norm), all_equal(norm.reshape(1))))
    for a, b in zip(full(model.parameters()), single.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    return norms


def test_fsdp2_clips_by_the_norm_of_the_whole_gradients(backend):
    """The norm of sharded gradients is that of the whole ones (every rank the same),
    and the clipped steps are those of one process."""
    for norms in run_ranks(fsdp_clipping, 2, device=backend):
        for norm, ref_norm, agreed in norms:
            assert agreed and ref_norm > 0.05  # (each step clipped)
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm


# -- 7. Shards that are not dense --------------------------------------------------------------

def strided_shards(rank, world):
    """A DTensor whose local shard is every other column of a larger tensor (as FSDP2's
    shards of some shapes are on torch 2.7): torch.optim's step takes the fp32 one, as
    it steps torch.optim.SGD's copy; a bf16 one with fp32 masters is refused, naming
    the shard, as that step would drop the masters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device().type, (world,))
    local = torch.randn(4, 12, generator=torch.Generator().manual_seed(rank),
                        device=device())[:, ::2]
    ours = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
    ref = nn.Parameter(DTensor.from_local(local.detach().clone(), mesh, [Shard(0)]))
    assert not ours.to_local().is_contiguous() and ref.to_local().is_contiguous()
    a = mixedprec.optim.SGD([ours], lr=0.1, momentum=0.9)
    b = torch.optim.SGD([ref], lr=0.1, momentum=0.9, foreach=False)
    for step in range(3):
        g = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step))
        grad = DTensor.from_local(g[4 * rank:4 * rank + 4].to(device()), mesh, [Shard(0)])
        ours.grad, ref.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.equal(ours.to_local(), ref.to_local())
    half = nn.Parameter(DTensor.from_local(local.to(torch.bfloat16)[:, ::2], mesh, [Shard(0)]))
    try:
        mixedprec.optim.SGD([half], lr=0.1)
    except ValueError as error:
        return str(error)
    return "not refused"


def test_a_shard_that_is_not_dense_steps_as_torch_or_is_refused(backend):
    for message in run_ranks(strided_shards, 2, device=backend):
        assert message.startswith("SGD: a torch.bfloat16 parameter of shape (8, 3) is not "
                                  "dense (strides (6, 2) of its local shard)"), message
        assert "not master='fp32'" in message
