"""A negative lr set on a param group after construction steps as Apex's fused kernels
did (``p -= lr * update`` with that lr), where the core's fused ops take lr >= 0 only.

Found running pytorch-pretrained-BERT's run_lm_finetuning.py --fp16 (2019) unmodified:
its warmup_linear schedule returns ``1 - x`` and the last batches of an epoch push x
past 1 when the dataset is not a multiple of the batch size, so the last steps get a
small negative lr; Apex (and torch.optim) applied it, mixedprec raised from the op.

The check: a face stepped at -lr moves each target by minus what a twin stepped at +lr
moves it, and keeps the same optimizer state; the group's lr stays as the script set
it."""

import pytest
import torch
from torch import nn

from mixedprec.fp16_utils import LegacyFP16_Optimizer
from mixedprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

SHAPES = [(6,), (3, 5), (17,)]
LR = 2e-2


def make_params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in SHAPES]


def give_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def targets(opt, params):
    return [opt.state[p].get("master_param", p).detach().float().clone() for p in params]


def run_twins(make_opt, dtype, negative_from=1):
    """Two copies stepped alike, except that step ``negative_from`` (their last) has
    lr=-LR in one and +LR in the other. Returns, for each, its params, its optimizer and
    how far that step moved each target."""
    twins = []
    for sign in (-1.0, 1.0):
        params = make_params(dtype)
        opt = make_opt(params)
        for step in range(negative_from + 1):
            if step == negative_from:
                start = targets(opt, params)
                for group in opt.param_groups:
                    group["lr"] = sign * LR
            give_grads(params, step)
            opt.step()
            if step == negative_from:  # the script's value is left in the group
                assert all(g["lr"] == sign * LR for g in opt.param_groups)
                moved = [t - s for t, s in zip(targets(opt, params), start)]
        twins.append((params, opt, moved))
    return twins


FACES = [
    pytest.param(lambda ps: FusedAdam(ps, lr=LR, weight_decay=0.1), id="FusedAdam"),
    pytest.param(lambda ps: FusedAdam(ps, lr=LR, adam_w_mode=False, weight_decay=0.1,
                                      bias_correction=False), id="FusedAdam-L2"),
    pytest.param(lambda ps: FusedSGD(ps, lr=LR, momentum=0.9, weight_decay=0.1,
                                     nesterov=True), id="FusedSGD"),
    pytest.param(lambda ps: FusedLAMB(ps, lr=LR, weight_decay=0.1), id="FusedLAMB"),
    pytest.param(lambda ps: FusedNovoGrad(ps, lr=LR, weight_decay=0.1), id="FusedNovoGrad"),
    pytest.param(lambda ps: FusedAdagrad(ps, lr=LR, weight_decay=0.1), id="FusedAdagrad"),
]


@pytest.mark.parametrize("make_opt", FACES)
def test_a_negative_lr_moves_the_fp32_params_the_other_way(make_opt):
    (neg_params, neg, neg_moved), (_, pos, pos_moved) = run_twins(make_opt, torch.float32)
    for a, b in zip(neg_moved, pos_moved):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, -b, rtol=0, atol=1e-6)
    # the state advanced as with a positive lr (it does not depend on lr)
    for p_neg, p_pos in zip(neg_params, pos.param_groups[0]["params"]):
        for key, value in neg.state[p_neg].items():
            if isinstance(value, torch.Tensor) and key != "master_param":
                torch.testing.assert_close(value, pos.state[p_pos][key], rtol=0, atol=0)


@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda ps: FusedAdam(ps, lr=LR, master_weights=True), id="FusedAdam"),
    pytest.param(lambda ps: FusedSGD(ps, lr=LR, momentum=0.9, master_weights=True),
                 id="FusedSGD"),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("negative_from", [0, 1])  # 0: the masters are made in that step
def test_fp32_masters_are_reflected_and_the_model_follows_them(make_opt, dtype, negative_from):
    (params, opt, neg_moved), (_, _, pos_moved) = run_twins(make_opt, dtype,
                                                            negative_from=negative_from)
    for a, b in zip(neg_moved, pos_moved):
        torch.testing.assert_close(a, -b, rtol=0, atol=1e-6)
    for p in params:
        master = opt.state[p]["master_param"]
        assert torch.equal(p.detach(), master.to(dtype))
    # the next step keeps the master (no re-take from the rounded model copy)
    kept = targets(opt, params)
    for group in opt.param_groups:
        group["lr"] = 0.0
    give_grads(params, 9)
    opt.step()
    for before, p in zip(kept, params):
        torch.testing.assert_close(opt.state[p]["master_param"], before, rtol=0, atol=0)


def test_apex_2019_step_writes_the_reflected_params_into_output_params():
    """FusedAdam.step(grads=..., output_params=..., scale=...) with max_grad_norm, as
    Apex's 2019 FP16_Optimizer called it; output_params may be a generator."""
    results = []
    for sign in (-1.0, 1.0):
        params = make_params(torch.float32)
        copies = [p.detach().half() for p in params]
        opt = FusedAdam(params, lr=LR, bias_correction=False, max_grad_norm=1.0)
        g = torch.Generator().manual_seed(5)
        grads = [torch.randn(p.shape, generator=g) * 64 for p in params]
        opt.step(grads=grads, output_params=(c for c in copies), scale=64.0)
        opt.param_groups[0]["lr"] = sign * LR
        start = [p.detach().clone() for p in params]
        opt.step(grads=grads, output_params=(c for c in copies), scale=64.0)
        for p, c in zip(params, copies):
            assert torch.equal(c, p.detach().half())
        results.append([p.detach() - s for p, s in zip(params, start)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, -b, rtol=0, atol=1e-6)


def test_pytorch_pretrained_bert_schedule_past_t_total_keeps_training():
    """The script's pattern: an fp16 model, FusedAdam(bias_correction=False,
    max_grad_norm=1.0) under apex.optimizers.FP16_Optimizer, lr written into the groups
    each step by a linear decay that ends below zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).half()
    opt = LegacyFP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2, bias_correction=False,
                                         max_grad_norm=1.0), dynamic_loss_scale=True)
    x, y = torch.randn(32, 8).half(), torch.randint(0, 2, (32,))
    t_total, lrs = 20, []
    for step in range(t_total + 3):  # three steps past t_total
        loss = nn.functional.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        lr = 1e-2 * (1.0 - step / t_total)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad()
        lrs.append(lr)
    assert min(lrs) < 0
    master = opt.fp32_from_fp16_groups[0][0]
    assert torch.isfinite(master).all()
    assert torch.equal(model[0].weight.detach(), master.detach().half())


def test_bf16_master_modes_refuse_a_negative_lr_and_change_nothing():
    params = make_params(torch.bfloat16)
    opt = FusedAdam(params, lr=LR, master="kahan")
    give_grads(params, 0)
    opt.step()
    opt.param_groups[0]["lr"] = -LR
    give_grads(params, 1)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="negative lr .*master='kahan'"):
        opt.step()
    assert opt.param_groups[0]["lr"] == -LR
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_non_finite_lr_is_still_refused():
    params = make_params(torch.float32)
    opt = FusedAdam(params, lr=LR)
    opt.param_groups[0]["lr"] = float("-inf")
    give_grads(params, 0)
    with pytest.raises(ValueError, match="lr"):
        opt.step()
