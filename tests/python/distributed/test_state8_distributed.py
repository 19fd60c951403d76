"""8-bit moments (state_dtype=torch.float8_e4m3fn) on DTensor parameters: Shard(0) and
Replicate keep 8-bit codes and scales laid out like the parameter and step exactly as
the whole tensor does (blocks lie within rows); Shard(1) keeps fp32 moments; a
distributed checkpoint saved on 2 ranks loads on 4 and on 1 bit for bit (resharding
moves whole blocks). CPU with gloo; again on GPUs with NCCL where there are enough."""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import can_run, device, run_ranks
from helpers import make_model
from torch import nn

import mixedprec
from mixedprec.optim import SGD, AdamW, state8

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")

E4M3 = torch.float8_e4m3fn
SHAPE = (130, 64)  # 130 rows: uneven shards on 4 ranks (33, 33, 33, 31)


@pytest.fixture(params=["cpu", "cuda"])
def backend(request):
    if not can_run(request.param, 4):
        pytest.skip(f"needs {'4 GPUs and NCCL' if request.param == 'cuda' else 'gloo'}")
    return request.param


def pieces(t):
    """(first global row, local rows as bytes) of DTensor ``t`` (Shard(0)/Replicate):
    1-byte dtypes are gathered as bytes by the parent, whatever the backend takes."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local().detach()
    if local.dtype in (E4M3, torch.float8_e8m0fnu):
        local = local.view(torch.uint8)
    return offset[0], local.cpu().clone(), tuple(t.shape)


def assemble(per_rank):
    """Whole tensors from each rank's ``pieces``."""
    out = {}
    for result in per_rank:
        for name, (row, local, shape) in result.items():
            whole = out.setdefault(name, torch.zeros(shape, dtype=local.dtype))
            whole[row:row + local.shape[0]] = local
    return out


def dtensor_steps(rank, world):
    """Adam and SGD with 8-bit state on one DTensor parameter per placement, three steps,
    beside the same steps on the whole tensor in this process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device().type, (world,))
    checked = []
    # (one seed for both: the 8-bit codes round stochastically, keyed by the seed and
    # each element's index in the whole tensor, so shards draw the whole tensor's bits)
    for make in (lambda ps, dtype=E4M3: AdamW(ps, lr=1e-2, state_dtype=dtype,
                                              seed=7 if dtype == E4M3 else None),
                 lambda ps, dtype=E4M3: SGD(ps, lr=0.1, momentum=0.9, state_dtype=dtype,
                                            seed=7 if dtype == E4M3 else None)):
        for placement in (Shard(0), Replicate(), Shard(1)):
            gen = torch.Generator().manual_seed(0)
            whole = nn.Parameter(torch.randn(SHAPE, generator=gen).to(device()))
            grads = [torch.randn(SHAPE, generator=gen).to(device()) for _ in range(3)]
            p = nn.Parameter(distribute_tensor(whole.detach().clone(), mesh, [placement]))
            # (Shard(1) keeps fp32 moments: the whole tensor's run then has them too)
            opt = make([p])
            ref = make([whole], torch.float32 if placement == Shard(1) else E4M3)
            for g in grads:
                p.grad = distribute_tensor(g, mesh, [placement])
                whole.grad = g.clone()
                opt.step()
                ref.step()
            assert torch.equal(p.full_tensor(), whole.detach()), placement
            key = next(k for k in ("exp_avg", "momentum_buffer") if k in opt.state[p])
            codes = opt.state[p][key]
            assert codes.placements == p.placements and codes.device_mesh == p.device_mesh
            if placement == Shard(1):  # blocks would straddle shards: fp32 moments
                assert codes.dtype == torch.float32 and state8.SCALE_OF[key] not in opt.state[p]
                checked.append(str(placement))
                continue
            scales = opt.state[p][state8.SCALE_OF[key]]
            assert codes.dtype == E4M3 and scales.shape == (SHAPE[0], SHAPE[1] // 32)
            assert scales.placements == p.placements and scales.device_mesh == p.device_mesh
            for name, value in opt.state[p].items():
                if name != "step":
                    row, local, _ = pieces(value)
                    expected = ref.state[whole][name].view(torch.uint8).cpu()
                    assert torch.equal(local, expected[row:row + local.shape[0]]), name
            checked.append(str(placement))
    return checked


def test_8bit_state_of_dtensor_parameters(backend):
    checked = run_ranks(dtensor_steps, 2, device=backend)[0]
    assert len(checked) == 6


# helpers.make_model's Sequential: weights (130, 64) and (96, 64) get 8-bit moments;
# (64, 130), rows of 130, does not
MODEL8 = dict(sizes=(SHAPE[1], SHAPE[0], SHAPE[1], 96), activation=nn.ReLU)


def dcp_8bit(rank, world, checkpoint, mode):
    """FSDP2 (Shard(0)) with AdamW's 8-bit moments: "save" trains 3 steps and saves a
    distributed checkpoint; "load" loads it into a fresh model and optimizer. Returns
    this rank's pieces of every 8-bit state entry (as saved, or as loaded), then steps
    once more (the loaded state steps)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = make_model(device(), **MODEL8)
    for layer in (model[0], model[2], model[4], model):
        fully_shard(layer)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=E4M3)

    def train(steps):
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, SHAPE[1], generator=g).to(device())
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    if mode == "save":
        train(range(3))
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    out = {}
    for i, p in enumerate(model.parameters()):
        state = opt.state[p]
        eight = state8.eligible(p)
        assert (state["exp_avg"].dtype == E4M3) == eight, (i, state["exp_avg"].dtype)
        for name, value in state.items():
            if name in state8.ONLY_8BIT or (eight and name == "exp_avg"):
                assert value.placements == p.placements, name
                out[f"{i}.{name}"] = pieces(value)
    assert len(out) == 8  # two weights, four entries each
    train(range(3, 4))
    return out


@pytest.mark.parametrize("loaded_on", [4, 1])
def test_distributed_checkpoint_of_8bit_state_reshards_bit_for_bit(backend, tmp_path,
                                                                   loaded_on):
    checkpoint = str(tmp_path / "ckpt")
    saved = assemble(run_ranks(dcp_8bit, 2, checkpoint, "save", device=backend))
    loaded = assemble(run_ranks(dcp_8bit, loaded_on, checkpoint, "load", device=backend))
    assert sorted(saved) == sorted(loaded)
    for name in saved:
        assert saved[name].any(), name  # (trained state, not fresh)
        assert torch.equal(loaded[name], saved[name]), name


def test_eligibility_follows_placements():
    """Without a process group: a plain tensor's eligibility (the DTensor cases run
    above); mixedprec.distributed.is_dtensor is False for it."""
    assert not mixedprec.distributed.is_dtensor(torch.empty(SHAPE))
    assert state8.eligible(torch.empty(SHAPE))
