"""mixedprec.optim.lr_scheduler against torch.optim.lr_scheduler: step for step equal
(lrs and parameters) when no step is skipped; holding still on the steps a GradScaler
skips (against torch stepping its scheduler on the applied steps only), with no host
read; the optimizers' applied-step count and its state dict; checkpoints and errors."""

import pytest
import torch
from helpers import forbid_host_sync
from torch.optim import lr_scheduler as theirs

import mixedprec
from mixedprec import optim
from mixedprec.optim import lr_scheduler as ours

OPTIMIZERS = {"Adam": (optim.Adam, torch.optim.Adam, {}),
              "AdamW": (optim.AdamW, torch.optim.AdamW, dict(weight_decay=0.1)),
              "SGD": (optim.SGD, torch.optim.SGD, dict(momentum=0.9))}

# Each builds the same schedule from either module (`L`): ours or torch's.
SCHEDULES = {
    "LambdaLR": lambda L, o: L.LambdaLR(o, lambda e: 0.9 ** e),
    "LambdaLR-per-group": lambda L, o: L.LambdaLR(o, [lambda e: 0.9 ** e,
                                                        lambda e: 1.0 / (e + 1)]),
    "LinearLR": lambda L, o: L.LinearLR(o, start_factor=0.25, total_iters=4),
    "CosineAnnealingLR": lambda L, o: L.CosineAnnealingLR(o, T_max=8, eta_min=1e-3),
    "StepLR": lambda L, o: L.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda L, o: L.MultiStepLR(o, milestones=[5, 2, 9, 5], gamma=0.5),
    "warmup-cosine": lambda L, o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=3),
            L.CosineAnnealingLR(o, T_max=9, eta_min=1e-3)], milestones=[3]),
}


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in ((6, 4), (4,), (3,))]


def groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.05}]


def grads(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def lrs(scheduler):
    return [float(lr) for lr in scheduler.get_last_lr()]


def pair(opt_name, schedule):
    mine, torchs, kwargs = OPTIMIZERS[opt_name]
    a, b = make_params(), make_params()
    opt_a, opt_b = mine(groups(a), lr=0.1, **kwargs), torchs(groups(b), lr=0.1, **kwargs)
    return a, b, opt_a, opt_b, SCHEDULES[schedule](ours, opt_a), SCHEDULES[schedule](theirs,
                                                                                      opt_b)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_equal_to_torch_step_for_step(opt_name, schedule):
    a, b, opt_a, opt_b, sched_a, sched_b = pair(opt_name, schedule)
    assert lrs(sched_a) == pytest.approx(lrs(sched_b), rel=1e-12)
    for step in range(14):
        for p, q, g in zip(a, b, grads(a, step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        sched_a.step()
        sched_b.step()
        assert lrs(sched_a) == pytest.approx(lrs(sched_b), rel=1e-12, abs=1e-15), step
        assert [float(g["lr"]) for g in opt_a.param_groups] == pytest.approx(lrs(sched_b))
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert int(sched_a.last_epoch) == sched_b.last_epoch == 14
    assert int(opt_a.applied_steps) == 14


SKIPPED = {2, 5, 6, 11}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_skipped_steps_hold_the_schedule(opt_name, schedule, monkeypatch):
    """Overflows injected through mixedprec.GradScaler: the skipped steps change neither
    the parameters nor the schedule; torch's run steps (optimizer and scheduler) on the
    applied steps only. No host read in step + update + scheduler step."""
    a, b, opt_a, opt_b, sched_a, sched_b = pair(opt_name, schedule)
    # A scale of 1 that never moves: the gradients need no scaling by hand.
    scaler = mixedprec.GradScaler("cpu", init_scale=1.0, min_scale=1.0,
                                  growth_interval=1000)
    scaler.scale(torch.ones(()))  # (places the scale)
    applied = 0
    for step in range(16):
        gs = grads(a, step)
        for p, g in zip(a, gs):
            p.grad = g.clone()
        if step in SKIPPED:
            a[step % 3].grad.view(-1)[0] = float("inf")
        with forbid_host_sync(monkeypatch):
            scaler.step(opt_a)
            scaler.update()
            sched_a.step()
        if step not in SKIPPED:
            applied += 1
            for q, g in zip(b, gs):
                q.grad = g.clone()
            opt_b.step()
            sched_b.step()
        assert lrs(sched_a) == pytest.approx(lrs(sched_b), rel=1e-12, abs=1e-15), step
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert int(opt_a.applied_steps) == applied == 12
    assert int(sched_a.last_epoch) == sched_b.last_epoch == applied


def test_a_step_without_an_applied_optimizer_step_holds():
    """Per-epoch use: an epoch whose steps were all skipped does not advance."""
    params = make_params()
    opt = optim.SGD(params, lr=1.0)
    sched = ours.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()  # no optimizer step since the scheduler was built
    assert lrs(sched) == [1.0]
    for _ in range(3):  # one epoch of three steps
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    sched.step()
    assert lrs(sched) == [0.5]
    opt.found_inf = torch.ones(())  # (the scaler's channel) every step of an epoch skipped
    for _ in range(2):
        opt.step()
    del opt.found_inf
    sched.step()
    assert lrs(sched) == [0.5]


def test_applied_steps_in_the_state_dict_and_torch_loads_it():
    params = make_params()
    opt = optim.AdamW(params, lr=0.1)
    for step in range(3):
        for p, g in zip(params, grads(params, step)):
            p.grad = g
        opt.found_inf = torch.full((), float(step == 1))
        opt.step()
    del opt.found_inf
    saved = opt.state_dict()
    assert int(saved["applied_steps"]) == 2
    theirs_opt = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params])
    theirs_opt.load_state_dict(saved)  # torch ignores the extra key
    again = optim.AdamW([p.detach().clone().requires_grad_() for p in params])
    again.load_state_dict(saved)
    assert int(again.applied_steps) == 2
    again.load_state_dict(theirs_opt.state_dict())  # torch's: no count, it starts at 0
    assert int(again.applied_steps) == 0
    with pytest.raises(ValueError, match="applied_steps"):
        again.load_state_dict(dict(saved, applied_steps=-1))
    assert int(again.applied_steps) == 0


def test_scheduler_state_dict_resumes():
    a, b, opt_a, opt_b, sched_a, sched_b = pair("AdamW", "warmup-cosine")
    for step in range(5):
        for p, g in zip(a, grads(a, step)):
            p.grad = g
        opt_a.step()
        sched_a.step()
    saved_opt, saved_sched = opt_a.state_dict(), sched_a.state_dict()
    resumed = make_params(1)
    opt_c = optim.AdamW(groups(resumed), lr=0.1, weight_decay=0.1)
    opt_c.load_state_dict(saved_opt)
    sched_c = SCHEDULES["warmup-cosine"](ours, opt_c)
    sched_c.load_state_dict(saved_sched)
    assert lrs(sched_c) == lrs(sched_a)
    for step in range(5, 9):
        for p, q, g in zip(a, resumed, grads(a, step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_c.step()
        sched_a.step()
        sched_c.step()
        assert lrs(sched_c) == lrs(sched_a)
    assert int(sched_c.last_epoch) == 9


def test_errors():
    params = make_params()
    with pytest.raises(TypeError, match="applied_steps"):
        ours.LinearLR(torch.optim.SGD(params, lr=0.1))
    opt = optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match="lr_lambdas"):
        ours.LambdaLR(opt, [lambda e: 1.0, lambda e: 1.0])
    with pytest.raises(ValueError, match="start_factor"):
        ours.LinearLR(opt, start_factor=0.0)
    with pytest.raises(KeyError, match="initial_lr"):
        ours.StepLR(opt, step_size=2, last_epoch=3)
    with pytest.raises(TypeError, match="schedulers"):
        ours.SequentialLR(opt, [theirs.StepLR(torch.optim.SGD(params), 2)], milestones=[])
    assert isinstance(opt.param_groups[0]["lr"], float)  # nothing changed


def test_compiled_step_and_schedule():
    params = make_params()
    opt = optim.AdamW(params, lr=0.1)
    sched = SCHEDULES["warmup-cosine"](ours, opt)
    ref_params = make_params()
    ref_opt = optim.AdamW(ref_params, lr=0.1)
    ref_sched = SCHEDULES["warmup-cosine"](ours, ref_opt)

    def step():
        opt.step()
        sched.step()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager")
    for i in range(5):
        for p, q, g in zip(params, ref_params, grads(params, i)):
            p.grad, q.grad = g.clone(), g.clone()
        compiled()
        ref_opt.step()
        ref_sched.step()
        assert lrs(sched) == pytest.approx(lrs(ref_sched), rel=1e-12)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("make", [
    lambda p: mixedprec.FusedAdam(p, lr=0.1),
    lambda p: mixedprec.FusedAdam(p, lr=0.1, max_grad_norm=1.0),  # (the 2019 step path)
    lambda p: mixedprec.FusedSGD(p, lr=0.1, momentum=0.9),
    lambda p: mixedprec.FusedLAMB(p, lr=0.1),
], ids=["FusedAdam", "FusedAdam-max_grad_norm", "FusedSGD", "FusedLAMB"])
def test_apex_faces_count_applied_steps(make):
    params = make_params()
    opt = make(params)
    sched = ours.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(5):
        for p, g in zip(params, grads(params, step)):
            p.grad = g
        opt.found_inf = torch.full((1,), float(step in (1, 3)))
        opt.step()
        sched.step()
    assert int(opt.applied_steps) == 3
    assert lrs(sched) == [0.1 * 0.5**3]
