"""master="stochastic" keyed by the global element index: a bf16 model sharded by FSDP2
(Shard(0), uneven chunks, an empty one on 4 ranks) and DTensor params sharded along
columns (Shard(1), and (Shard(0), Shard(1)) on a 2 x 2 mesh) step bit for bit as the
unsharded model does, on 1, 2 and 4 processes (gloo, CPU), and a checkpoint saved on 2
ranks (torch.distributed.checkpoint) resumes on 4 and on 1 bit for bit; a
_StridedShard param falls back to salts that count its shard. The gradients
are set, the same on every world size (a backward's reductions would add in another
order on each)."""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import can_run, device, run_ranks
from helpers import make_model
from torch import nn

import mixedprec
from mixedprec.distributed import global_layout, is_dtensor

pytestmark = pytest.mark.skipif(not dist.is_available() or not can_run("cpu", 4),
                                reason="needs torch.distributed with gloo")

SAVE_AT, MORE = 2, 2
SEED = 2**40 + 17


# helpers.make_model's Sequential in bf16: layers whose rows split unevenly over 2 and
# 4 ranks, at offsets off multiples of 8 (30 x 16, 5 x 30 and their biases)
MODEL = dict(dtype=torch.bfloat16, sizes=(16, 30, 5), activation=nn.ReLU)


def column_fulls():
    """Whole values of the column-sharded params."""
    return [(torch.arange(9 * 21) * 0.37).sin().view(9, 21).bfloat16(),
            (torch.arange(6 * 10) * 0.21).cos().view(6, 10).bfloat16()]


def optimizer(params):
    return mixedprec.optim.AdamW(params, lr=1e-2, weight_decay=0.1, master="stochastic",
                                 seed=SEED)


def set_grads(params, step):
    """The gradient of each param at ``step``, the same whole tensor on every world,
    distributed as the param is."""
    from torch.distributed.tensor import distribute_tensor

    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        g = g.bfloat16().to(p.device)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if is_dtensor(p) else g


def train(opt, params, steps):
    for step in steps:
        set_grads(params, step)
        opt.step()
        opt.zero_grad()


def whole(params):
    return [p.full_tensor().cpu() if is_dtensor(p) else p.detach().cpu().clone()
            for p in params]


def check_layout(p):
    """global_layout maps every local element of DTensor ``p`` onto its element of the
    whole tensor."""
    offset, run, stride = global_layout(p)
    local = p.to_local().reshape(-1).cpu()
    i = torch.arange(local.numel())
    index = offset + i if run == 0 else offset + (i // run) * stride + i % run
    assert torch.equal(p.full_tensor().cpu().reshape(-1)[index], local), p.placements


def sharded(rank, world, checkpoint, mode):
    """``mode`` "save": the FSDP2 model trained SAVE_AT + MORE steps, saved after
    SAVE_AT; "resume": loaded from the checkpoint and trained MORE steps, then a fresh
    model trained all steps. Column-sharded params trained all steps. Returns the
    whole params: (resumed or None, straight, columns)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    def fsdp_model():
        model = make_model(device(), **MODEL)
        fully_shard(model[0])
        fully_shard(model[2])
        return fully_shard(model)

    resumed = None
    if mode == "resume":
        model = fsdp_model()
        opt = optimizer(model.parameters())
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        train(opt, list(model.parameters()), range(SAVE_AT, SAVE_AT + MORE))
        resumed = whole(model.parameters())
    model = fsdp_model()
    params = list(model.parameters())
    opt = optimizer(params)
    train(opt, params, range(SAVE_AT))
    if mode == "save":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    train(opt, params, range(SAVE_AT, SAVE_AT + MORE))
    for p in params:
        check_layout(p)

    mesh = init_device_mesh(device().type, (world,))
    first, second = column_fulls()
    columns = [nn.Parameter(distribute_tensor(first.to(device()), mesh, [Shard(1)]))]
    if world == 4:
        mesh2 = init_device_mesh(device().type, (2, 2))
        columns.append(nn.Parameter(distribute_tensor(second.to(device()), mesh2,
                                                      [Shard(0), Shard(1)])))
    else:
        columns.append(nn.Parameter(distribute_tensor(second.to(device()), mesh, [Shard(1)])))
    train(optimizer(columns), columns, range(SAVE_AT + MORE))
    for p in columns:
        check_layout(p)
    return resumed, whole(params), whole(columns), strided_shards_differ(mesh)


def strided_shards_differ(mesh):
    """The fallback: a _StridedShard param (interleaved pieces, not runs) has no global
    layout; its shards count in the salt, so equal values on every rank round with
    different bits (True on several ranks)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [_StridedShard(0, split_factor=2)]
    ones = torch.ones(8 * mesh.size(), 64, dtype=torch.bfloat16, device=device())
    p = nn.Parameter(distribute_tensor(ones, mesh, placements))
    assert global_layout(p) is None
    p.grad = distribute_tensor(torch.full_like(ones, 0.3), mesh, placements)
    optimizer([p]).step()
    local = p.to_local()
    assert not torch.equal(local, ones[:local.shape[0]])  # it moved
    gathered = [torch.empty_like(local) for _ in range(mesh.size())]
    dist.all_gather(gathered, local)
    return mesh.size() > 1 and not any(torch.equal(gathered[0], g) for g in gathered[1:])


def unsharded():
    """The same training in this process, on plain tensors."""
    model = make_model("cpu", **MODEL)
    params = list(model.parameters())
    train(optimizer(params), params, range(SAVE_AT + MORE))
    columns = [nn.Parameter(t) for t in column_fulls()]
    train(optimizer(columns), columns, range(SAVE_AT + MORE))
    return whole(params), whole(columns)


def assert_same(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{what}: param {i}"


def test_sharded_runs_and_resharded_resumes_match_the_unsharded_run_bit_for_bit(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    params, columns = unsharded()
    start = make_model("cpu", **MODEL)
    assert not torch.equal(params[0], start[0].weight.detach())  # it trained
    _, straight2, columns2, differ = run_ranks(sharded, 2, checkpoint, "save")[0]
    assert_same(straight2, params, "2 ranks")
    assert_same(columns2, columns, "columns on 2 ranks")
    assert differ
    for world in (4, 1):
        resumed, straight, cols, differ = run_ranks(sharded, world, checkpoint, "resume")[0]
        assert_same(straight, params, f"{world} ranks")
        assert_same(cols, columns, f"columns on {world} ranks")
        assert_same(resumed, params, f"saved on 2 ranks, resumed on {world}")
        assert differ == (world > 1)
