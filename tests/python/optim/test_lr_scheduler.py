"""mixedprec.optim.lr_scheduler against torch.optim.lr_scheduler: step for step equal
(lrs and parameters) when no step is skipped; holding still on the steps a GradScaler
skips (against torch stepping its scheduler on the applied steps only), with no host
read; the optimizers' applied-step count and its state dict; checkpoints and errors."""

import numpy as np
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
    "ConstantLR": lambda L, o: L.ConstantLR(o, factor=0.25, total_iters=4),
    "ExponentialLR": lambda L, o: L.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda L, o: L.PolynomialLR(o, total_iters=9, power=1.5),
    "CosineAnnealingWarmRestarts": lambda L, o: L.CosineAnnealingWarmRestarts(o, T_0=3,
                                                                              eta_min=1e-3),
    "CosineAnnealingWarmRestarts-T_mult": lambda L, o: L.CosineAnnealingWarmRestarts(
        o, T_0=2, T_mult=2, eta_min=1e-3),
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


def step_both(step, params, optimizers, schedulers):
    """One step of two runs on the same gradients: each param list's grads set, then
    each optimizer and each scheduler stepped."""
    gs = grads(params[0], step)
    for ps in params:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
    for opt in optimizers:
        opt.step()
    for sched in schedulers:
        sched.step()


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
        step_both(step, (a, b), (opt_a, opt_b), (sched_a, sched_b))
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
        step_both(step, (a, resumed), (opt_a, opt_c), (sched_a, sched_c))
        assert lrs(sched_c) == lrs(sched_a)
    assert int(sched_c.last_epoch) == 9


@pytest.mark.parametrize("kept", [True, False], ids=["applied-steps-kept", "count-restarts"])
@pytest.mark.parametrize("saved_after", [1, 2, 3])
def test_a_resume_whose_count_restarts_steps_the_schedule_on(kept, saved_after):
    """torch.distributed.checkpoint keeps an optimizer's 'state' and 'param_groups' only:
    the applied-step count restarts at 0. Before, a scheduler whose saved _seen the new
    count reached (saved after one step: the count is 1 again after one) did not advance
    that step, and the schedule fell one step behind."""
    lrs_of = []
    for resume in (False, True):
        params = make_params(0)
        opt = optim.AdamW(groups(params), lr=0.1)
        sched = ours.StepLR(opt, step_size=1, gamma=0.5)
        seen = []
        for step in range(saved_after + 3):
            if resume and step == saved_after:
                saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
                if not kept:
                    del saved_opt["applied_steps"]
                params = make_params(0)
                opt = optim.AdamW(groups(params), lr=0.1)
                opt.load_state_dict(saved_opt)
                sched = ours.StepLR(opt, step_size=1, gamma=0.5)
                sched.load_state_dict(saved_sched)
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            opt.step()
            sched.step()
            seen.append(lrs(sched))
        lrs_of.append(seen)
    assert lrs_of[1] == lrs_of[0]


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


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_and_schedule(backend):
    """opt.step(); sched.step() compiled: the schedule runs as torch's does, not traced
    (AOT autograd dropped the in-place lr writes: the lr stood still under aot_eager and
    inductor)."""
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
    compiled = torch.compile(step, backend=backend)
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


# --- bad input: an error that names it, and nothing changed ---------------------------

def plain(value):
    """A state dict or param group as plain values (tensors as dtype and numbers), for ==."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if k != "params"}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def opt_state(opt):
    return plain(opt.param_groups)


def stepped(schedule, steps=4):
    """An optimizer (two groups) and a schedule of ours stepped `steps` applied steps."""
    params = make_params()
    opt = optim.SGD(groups(params), lr=0.1)
    sched = SCHEDULES[schedule](ours, opt)
    for step in range(steps):
        for p, g in zip(params, grads(params, step)):
            p.grad = g
        opt.step()
        sched.step()
    return opt, sched


def two_schedulers(o):
    return [ours.LinearLR(o, start_factor=0.1, total_iters=3),
            ours.CosineAnnealingLR(o, T_max=9)]


BAD_ARGUMENTS = {
    "StepLR-gamma-str": (lambda o: ours.StepLR(o, step_size=1, gamma="x"),
                         TypeError, "expected gamma to be a real number, got 'x'"),
    "StepLR-gamma-nan": (lambda o: ours.StepLR(o, step_size=1, gamma=float("nan")),
                         ValueError, "expected gamma to be a finite real number"),
    "StepLR-gamma-tensor": (lambda o: ours.StepLR(o, step_size=1, gamma=torch.ones(2)),
                            TypeError, "expected gamma to be a real number"),
    "StepLR-step_size-0": (lambda o: ours.StepLR(o, step_size=0),
                           ValueError, "expected step_size to be an int >= 1, got 0"),
    "StepLR-step_size-float": (lambda o: ours.StepLR(o, step_size=2.0),
                               TypeError, "expected step_size to be an int >= 1, got 2.0"),
    "StepLR-last_epoch-str": (lambda o: ours.StepLR(o, 2, last_epoch="0"),
                              TypeError, "expected last_epoch to be an int >= -1"),
    "MultiStepLR-milestones-str": (lambda o: ours.MultiStepLR(o, milestones=[3, "a"]),
                                   TypeError, "expected milestones to be ints >= 0, got 'a'"),
    "MultiStepLR-milestones-float": (lambda o: ours.MultiStepLR(o, milestones=[3, 4.0]),
                                     TypeError, "expected milestones to be ints >= 0, got 4.0"),
    "MultiStepLR-milestones-negative": (lambda o: ours.MultiStepLR(o, milestones=[3, -1]),
                                        ValueError, "expected milestones to be ints >= 0"),
    "MultiStepLR-milestones-int": (lambda o: ours.MultiStepLR(o, milestones=3),
                                   TypeError, "expected milestones to be an iterable of ints"),
    "MultiStepLR-gamma-None": (lambda o: ours.MultiStepLR(o, [2], gamma=None),
                               TypeError, "expected gamma to be a real number, got None"),
    "LinearLR-start_factor-str": (lambda o: ours.LinearLR(o, start_factor="x"),
                                  TypeError, "expected start_factor to be a real number"),
    "LinearLR-start_factor-0": (lambda o: ours.LinearLR(o, start_factor=0.0),
                                ValueError, r"expected start_factor in \(0, 1\]"),
    "LinearLR-end_factor-2": (lambda o: ours.LinearLR(o, end_factor=2),
                              ValueError, r"expected end_factor in \[0, 1\]"),
    "LinearLR-total_iters-0": (lambda o: ours.LinearLR(o, total_iters=0),
                               ValueError, "expected total_iters to be an int >= 1"),
    "CosineAnnealingLR-T_max-str": (lambda o: ours.CosineAnnealingLR(o, T_max="10"),
                                    TypeError, "expected T_max to be an int >= 1"),
    "CosineAnnealingLR-eta_min-str": (lambda o: ours.CosineAnnealingLR(o, 10, eta_min="0"),
                                      TypeError, "expected eta_min to be a real number"),
    "ConstantLR-factor-2": (lambda o: ours.ConstantLR(o, factor=2.0),
                            ValueError, r"expected factor in \[0, 1\], got 2.0"),
    "ConstantLR-total_iters-float": (lambda o: ours.ConstantLR(o, total_iters=2.5),
                                     TypeError, "expected total_iters to be an int >= 0"),
    "ExponentialLR-gamma-nan": (lambda o: ours.ExponentialLR(o, gamma=float("nan")),
                                ValueError, "expected gamma to be a finite real number"),
    "PolynomialLR-total_iters-0": (lambda o: ours.PolynomialLR(o, total_iters=0),
                                   ValueError, "expected total_iters to be an int >= 1"),
    "PolynomialLR-power-str": (lambda o: ours.PolynomialLR(o, power="2"),
                               TypeError, "expected power to be a real number"),
    "CosineAnnealingWarmRestarts-T_0-0": (lambda o: ours.CosineAnnealingWarmRestarts(o, 0),
                                          ValueError, "expected T_0 to be an int >= 1"),
    "CosineAnnealingWarmRestarts-T_mult-float": (
        lambda o: ours.CosineAnnealingWarmRestarts(o, 2, T_mult=1.5),
        TypeError, "expected T_mult to be an int >= 1"),
    "LambdaLR-lr_lambda-number": (lambda o: ours.LambdaLR(o, lr_lambda=0.5),
                                  TypeError, "expected lr_lambda to be a function"),
    "LambdaLR-lr_lambda-raises": (lambda o: ours.LambdaLR(o, lambda e: 1 / 0),
                                  ZeroDivisionError, "division by zero"),
    "SequentialLR-schedulers-one": (lambda o: ours.SequentialLR(
        o, ours.StepLR(o, 2), milestones=[]), TypeError, "expected schedulers to be a list"),
    "SequentialLR-milestones-str": (lambda o: ours.SequentialLR(
        o, two_schedulers(o), milestones=["3"]), TypeError,
        "expected milestones to be ints >= 0, got '3'"),
    "SequentialLR-milestones-count": (lambda o: ours.SequentialLR(
        o, two_schedulers(o), milestones=[3, 4]), ValueError, "expected 1 milestones"),
    "SequentialLR-milestones-order": (lambda o: ours.SequentialLR(
        o, two_schedulers(o) + [ours.StepLR(o, 2)], milestones=[5, 3]), ValueError,
        "expected milestones in increasing order"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_a_bad_argument_is_named_and_changes_nothing(case):
    make, error, message = BAD_ARGUMENTS[case]
    opt = optim.SGD(groups(make_params()), lr=0.1)
    if case.startswith("SequentialLR"):  # (its schedulers, built first, set the lrs)
        two_schedulers(opt)
    before = opt_state(opt)
    with pytest.raises(error, match=message):
        make(opt)
    assert opt_state(opt) == before


# Inputs torch's schedulers accept: each builds the same schedule from either module.
TORCH_STYLE = {
    "milestones-tuple": lambda L, o: L.MultiStepLR(o, (5, 2, 9)),
    "milestones-generator": lambda L, o: L.MultiStepLR(o, (m for m in [5, 2, 9])),
    "milestones-range": lambda L, o: L.MultiStepLR(o, range(2, 12, 3), gamma=0.5),
    "milestones-set": lambda L, o: L.MultiStepLR(o, {5, 2}, gamma=0.5),
    "milestones-numpy": lambda L, o: L.MultiStepLR(o, np.array([2, 5, 5]), gamma=0.5),
    "milestones-empty": lambda L, o: L.MultiStepLR(o, []),
    "gamma-int": lambda L, o: L.StepLR(o, 2, gamma=1),
    "gamma-numpy": lambda L, o: L.StepLR(o, 2, gamma=np.float32(0.5)),
    "gamma-tensor": lambda L, o: L.StepLR(o, 2, gamma=torch.tensor(0.5)),
    "step_size-numpy": lambda L, o: L.StepLR(o, np.int64(3), gamma=0.5),
    "eta_min-int": lambda L, o: L.CosineAnnealingLR(o, T_max=6, eta_min=0),
    "factors-int": lambda L, o: L.LinearLR(o, start_factor=1, end_factor=0, total_iters=4),
    "sequential-milestones-tuple": lambda L, o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=3), L.StepLR(o, 2, gamma=0.5)],
        milestones=(3,)),
}


@pytest.mark.parametrize("schedule", sorted(TORCH_STYLE))
def test_torch_style_arguments_are_accepted(schedule):
    a, b = make_params(), make_params()
    opt_a, opt_b = optim.SGD(groups(a), lr=0.1), torch.optim.SGD(groups(b), lr=0.1)
    sched_a, sched_b = TORCH_STYLE[schedule](ours, opt_a), TORCH_STYLE[schedule](theirs, opt_b)
    for step in range(12):
        step_both(step, (a, b), (opt_a, opt_b), (sched_a, sched_b))
        assert lrs(sched_a) == pytest.approx([float(x) for x in sched_b.get_last_lr()],
                                             rel=1e-6, abs=1e-15), step


@pytest.mark.parametrize("epoch, error, message", [
    ("3", TypeError, "expected epoch to be an int >= 0, got '3'"),
    (2.5, TypeError, "expected epoch to be an int >= 0, got 2.5"),
    (-1, ValueError, "expected epoch to be an int >= 0, got -1"),
    (torch.tensor(2.5), TypeError, "expected epoch to be an int >= 0 or a one-element "
                                   "integer tensor, got a torch.float32 tensor"),
    (torch.tensor([1, 2]), TypeError, "one-element integer tensor"),
])
def test_a_bad_epoch_is_named_and_changes_nothing(epoch, error, message):
    opt, sched = stepped("StepLR")
    before, before_opt = plain(sched.state_dict()), opt_state(opt)
    with pytest.raises(error, match=message):
        sched.step(epoch)
    assert plain(sched.state_dict()) == before and opt_state(opt) == before_opt
    sched.step(torch.tensor(6))  # an int tensor, or an int: as torch's step(epoch)
    assert lrs(sched) == pytest.approx([0.1 * 0.5**2, 0.05 * 0.5**2])
    sched.step(np.int64(3))
    assert lrs(sched) == pytest.approx([0.1 * 0.5, 0.05 * 0.5])


# (schedule, key, saved value, error, what the message says)
BAD_ENTRIES = [
    ("StepLR", "last_epoch", "abc", TypeError, "expected last_epoch to be an int >= -1, got "
                                               "'abc'"),
    ("StepLR", "last_epoch", -2, ValueError, "expected last_epoch to be an int >= -1, got -2"),
    ("StepLR", "last_epoch", 2.5, TypeError, "expected last_epoch to be an int >= -1"),
    ("StepLR", "last_epoch", torch.tensor(2.5), TypeError, "expected last_epoch to be an int"),
    ("StepLR", "last_epoch", torch.tensor([1, 2]), TypeError, "expected last_epoch"),
    ("StepLR", "_seen", None, TypeError, "expected _seen to be an int >= 0"),
    ("StepLR", "base_lrs", [0.1], ValueError, "expected base_lrs to be a list of 2, got 1 "
                                              "entries"),
    ("StepLR", "base_lrs", ["x", 0.05], TypeError, r"expected base_lrs\[0\] to be a real"),
    ("StepLR", "_last_lr", "x", TypeError, "expected _last_lr to be a list of 2, got 'x'"),
    ("StepLR", "_last_lr", [0.1, float("inf")], ValueError, r"expected _last_lr\[1\] to be "
                                                            "a finite real number"),
    ("StepLR", "step_size", 0, ValueError, "expected step_size to be an int >= 1, got 0"),
    ("StepLR", "gamma", "x", TypeError, "expected gamma to be a real number, got 'x'"),
    ("MultiStepLR", "milestones", [3, "a"], TypeError, "expected milestones to be ints"),
    ("MultiStepLR", "milestones", None, TypeError, "expected milestones to be an iterable"),
    ("MultiStepLR", "_marks", torch.tensor([1.5]), TypeError, "expected _marks to be ints"),
    ("MultiStepLR", "_marks", torch.tensor([1, 2]), ValueError, "expected _marks to hold the "
                                                                "milestones"),
    ("MultiStepLR", "gamma", None, TypeError, "expected gamma to be a real number"),
    ("LinearLR", "start_factor", 0, ValueError, r"expected start_factor in \(0, 1\]"),
    ("LinearLR", "end_factor", "1", TypeError, "expected end_factor to be a real number"),
    ("LinearLR", "total_iters", 0, ValueError, "expected total_iters to be an int >= 1"),
    ("CosineAnnealingLR", "T_max", 0, ValueError, "expected T_max to be an int >= 1"),
    ("CosineAnnealingLR", "eta_min", "x", TypeError, "expected eta_min to be a real number"),
    ("ConstantLR", "factor", -0.5, ValueError, r"expected factor in \[0, 1\]"),
    ("PolynomialLR", "power", float("inf"), ValueError, "expected power to be a finite"),
    ("CosineAnnealingWarmRestarts-T_mult", "T_mult", 0, ValueError, "expected T_mult to be an "
                                                                     "int >= 1"),
    ("LambdaLR", "lr_lambdas", [None], ValueError, "expected lr_lambdas to be a list of 2"),
    ("LambdaLR", "lr_lambdas", [5, None], TypeError, r"expected lr_lambdas\[0\] to be None "
                                                     "or a dict"),
    ("warmup-cosine", "_milestones", ["3"], TypeError, "expected _milestones to be ints"),
    ("warmup-cosine", "_milestones", [3, 4], ValueError, "expected 1 _milestones"),
    ("warmup-cosine", "_schedulers", [{}], ValueError, "expected _schedulers to be a list "
                                                       "of 2"),
    ("warmup-cosine", "_schedulers", "ab", TypeError, "expected _schedulers to be a list"),
    # The first scheduler's entries are good (and differ): not loaded either.
    ("warmup-cosine", "_schedulers", [{"start_factor": 0.5, "last_epoch": 9}, {"T_max": 0}],
     ValueError, r"_schedulers\[1\]: CosineAnnealingLR.load_state_dict: expected T_max"),
    ("warmup-cosine", "_schedulers", [{}, 3], TypeError, r"_schedulers\[1\]: .*expected "
                                                         "state_dict to be a dict"),
    ("StepLR", "optimizer", None, ValueError, "'optimizer' is not an entry"),
    ("StepLR", "step", 3, ValueError, "'step' is not an entry"),
    # (before: "__dict__" wiped the scheduler, and 10**30 overflowed in the tensor)
    ("StepLR", "__dict__", {}, ValueError, "'__dict__' is not an entry"),
    ("StepLR", "last_epoch", 10**30, ValueError, r"expected last_epoch to be an int < "
                                                 r"2\*\*63"),
]


@pytest.mark.parametrize("schedule, key, value, error, message", BAD_ENTRIES,
                         ids=[f"{s}-{k}-{i}" for i, (s, k, *_) in enumerate(BAD_ENTRIES)])
def test_a_bad_state_dict_entry_is_named_and_changes_nothing(schedule, key, value, error,
                                                             message):
    opt, sched = stepped(schedule)
    saved = sched.state_dict()
    before, before_opt = plain(saved), opt_state(opt)
    # A good entry first, then the bad one; and the bad one in the whole state dict.
    for bad in ({"last_epoch": 7, "base_lrs": [0.2, 0.3], key: value}, dict(saved, **{key: value})):
        with pytest.raises(error, match=f"{type(sched).__name__}.load_state_dict: .*{message}"):
            sched.load_state_dict(bad)
        assert plain(sched.state_dict()) == before
        assert opt_state(opt) == before_opt
    sched.load_state_dict(saved)  # the good one loads
    assert plain(sched.state_dict()) == before


def test_a_state_dict_that_is_not_a_dict():
    opt, sched = stepped("StepLR")
    before = plain(sched.state_dict())
    with pytest.raises(TypeError, match="StepLR.load_state_dict: expected state_dict to be a "
                                        "dict, got list"):
        sched.load_state_dict([("last_epoch", 3)])
    assert plain(sched.state_dict()) == before


@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("schedule", ["StepLR", "MultiStepLR", "LinearLR", "CosineAnnealingLR",
                                      "LambdaLR", "warmup-cosine", "ConstantLR", "ExponentialLR",
                                      "PolynomialLR", "CosineAnnealingWarmRestarts-T_mult"])
def test_torch_schedulers_state_dicts_load(schedule, steps):
    """A torch scheduler's state dict (an int last_epoch, float lrs, MultiStepLR's Counter
    of milestones; in SequentialLR's, last_epoch -1 for a scheduler not yet begun): loaded,
    the schedule continues as torch's."""
    b = make_params()
    opt_b = torch.optim.SGD(groups(b), lr=0.1)
    sched_b = SCHEDULES[schedule](theirs, opt_b)
    for step in range(steps):
        for q, g in zip(b, grads(b, step)):
            q.grad = g
        opt_b.step()
        sched_b.step()
    opt, sched = stepped(schedule, steps=0)
    sched.load_state_dict(sched_b.state_dict())
    assert int(sched.last_epoch) == steps
    assert lrs(sched) == pytest.approx(sched_b.get_last_lr(), rel=1e-12)
    sched.step(9)
    for _ in range(9 - steps):  # (torch's step(epoch) is deprecated)
        sched_b.step()
    assert lrs(sched) == pytest.approx(sched_b.get_last_lr(), rel=1e-12)


def test_a_lambda_of_one_element_tensors_is_taken_and_of_more_refused_first():
    """torch's LambdaLR takes an lr_lambda returning a one-element tensor of shape [1].
    Before, ours raised a shape error while writing the lrs, after the param groups had
    already been changed (lr made a tensor, initial_lr added)."""
    params = make_params(0)
    opt = optim.AdamW(params, lr=0.1)
    sched = ours.LambdaLR(opt, lambda e: torch.tensor([0.5], device=e.device))
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.05)
    other = optim.AdamW(make_params(0), lr=0.1)
    before = dict(other.param_groups[0])
    with pytest.raises(ValueError, match="expected lr_lambda of group 0 to return a number or "
                                         r"a one-element tensor, got shape \(2,\)"):
        ours.LambdaLR(other, lambda e: torch.tensor([0.5, 0.5]))
    assert other.param_groups[0].keys() == before.keys()
    assert other.param_groups[0]["lr"] == 0.1
    del sched


def test_chained_schedules_are_refused_before_anything_changes():
    """torch's ChainedScheduler (or two step() calls an iteration) over mixedprec's
    schedules would give the last one's lr, not the product: the scheduler stepped again
    after another one raises, and the lr and its epoch stay as they were."""
    params = make_params()
    opt = optim.SGD(params, lr=0.1)
    warmup = ours.LinearLR(opt, start_factor=0.5, total_iters=4)
    decay = ours.StepLR(opt, step_size=1, gamma=0.5)
    chained = theirs.ChainedScheduler([warmup, decay])
    for p, g in zip(params, grads(params, 0)):
        p.grad = g
    opt.step()
    chained.step()  # warmup, then decay: each once
    lr, epoch = opt.param_groups[0]["lr"].clone(), warmup.last_epoch.clone()
    opt.step()
    with pytest.raises(RuntimeError, match="LinearLR.step: StepLR has stepped this "
                                           "optimizer.*do not chain.*SequentialLR"):
        chained.step()
    assert torch.equal(opt.param_groups[0]["lr"], lr)
    assert torch.equal(warmup.last_epoch, epoch)


def test_a_scheduler_that_takes_over_for_good_is_not_chained():
    """One schedule after another by hand (the first never stepped again) is fine, and
    so are a scheduler's own steps, SequentialLR's, and a new optimizer's."""
    params = make_params()
    opt = optim.SGD(params, lr=0.1)
    first = ours.LinearLR(opt, start_factor=0.5, total_iters=2)
    second = ours.CosineAnnealingLR(opt, T_max=8)
    for i in range(6):
        for p, g in zip(params, grads(params, i)):
            p.grad = g
        opt.step()
        (first if i < 2 else second).step()
    assert lrs(second) == pytest.approx([0.1 * (1 + np.cos(np.pi * 4 / 8)) / 2])
    sequential = SCHEDULES["warmup-cosine"](ours, optim.SGD(make_params(), lr=0.1))
    for _ in range(3):
        sequential.step()
    with pytest.raises(RuntimeError, match="CosineAnnealingLR has stepped"):
        first.step()  # (replaced by `second` for good)


def sequential_with_torchs(L, o):
    """torch's own SequentialLR over the schedules of module ``L``: warmup, then cosine."""
    return theirs.SequentialLR(o, [L.LinearLR(o, start_factor=0.1, total_iters=3),
                                   L.CosineAnnealingLR(o, T_max=5, eta_min=1e-3)],
                               milestones=[3])


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_torch_sequential_lr_over_ours_equals_torch(opt_name):
    """torch's own SequentialLR over mixedprec's schedules (it undoes their first step,
    restarts the first with _initial_step and starts the next with _update_lr(0)) gives
    torch's lrs and parameters."""
    mine, torchs, kwargs = OPTIMIZERS[opt_name]
    a, b = make_params(), make_params()
    opt_a, opt_b = mine(groups(a), lr=0.1, **kwargs), torchs(groups(b), lr=0.1, **kwargs)
    sched_a, sched_b = sequential_with_torchs(ours, opt_a), sequential_with_torchs(theirs, opt_b)
    for step in range(10):
        assert lrs(sched_a) == pytest.approx(lrs(sched_b), rel=1e-12)
        step_both(step, (a, b), (opt_a, opt_b), (sched_a, sched_b))
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q)


def test_torch_sequential_lr_over_ours_resumes():
    """Its state dict, loaded into new schedulers after the optimizer's (torch's order:
    build both, then load both), carries on as the run without the resume."""
    a, b = make_params(), make_params()
    opt_a, opt_b = optim.AdamW(groups(a), lr=0.1), optim.AdamW(groups(b), lr=0.1)
    sched_a, sched_b = sequential_with_torchs(ours, opt_a), sequential_with_torchs(ours, opt_b)
    for step in range(10):
        if step in (2, 6):
            saved = opt_b.state_dict(), sched_b.state_dict()
            opt_b = optim.AdamW(groups(b), lr=0.1)
            sched_b = sequential_with_torchs(ours, opt_b)
            opt_b.load_state_dict(saved[0])
            sched_b.load_state_dict(saved[1])
        step_both(step, (a, b), (opt_a, opt_b), (sched_a, sched_b))
        assert lrs(sched_b) == lrs(sched_a)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("t_0, t_mult", [(3, 1), (2, 2), (5, 3)])
def test_warm_restarts_far_on_and_at_each_restart(t_0, t_mult):
    """CosineAnnealingWarmRestarts.step(epoch) against the cycles counted in Python ints,
    at every restart and beside it (torch's step(epoch) finds the cycle by a float
    logarithm), and far on."""
    opt = optim.SGD(make_params(), lr=0.1)
    sched = ours.CosineAnnealingWarmRestarts(opt, T_0=t_0, T_mult=t_mult, eta_min=0.01)
    epochs, start, length = [10**15 + 7, 10**15 + 8], 0, t_0
    for _ in range(12):  # (the first 12 restarts)
        epochs += [start - 1, start, start + 1]
        start, length = start + length, length * t_mult
    for epoch in filter(lambda e: e >= 0, epochs):
        start, length = 0, t_0
        while epoch >= start + length:
            if t_mult == 1:
                start += length * ((epoch - start) // length)
            else:
                start, length = start + length, length * t_mult
        want = 0.01 + (0.1 - 0.01) * (1 + np.cos(np.pi * (epoch - start) / length)) / 2
        sched.step(epoch)
        assert lrs(sched) == pytest.approx([want], rel=1e-12, abs=1e-15), epoch


def test_a_param_group_added_after_the_scheduler_is_named_before_anything_changes():
    """add_param_group after the scheduler (a fine-tuning callback unfreezing layers):
    torch's schedulers raise at the next step; ours say why, and change nothing, where
    they left the new group unscheduled."""
    params = make_params()
    opt = optim.SGD(params[:2], lr=0.1)
    sched = ours.LambdaLR(opt, lambda e: 0.5 ** e)
    opt.add_param_group({"params": params[2:], "lr": 0.01})
    for p, g in zip(params, grads(params, 0)):
        p.grad = g
    opt.step()
    before = plain(sched.state_dict()), opt_state(opt)
    with pytest.raises(ValueError, match="LambdaLR.step: the optimizer has 2 param groups, "
                                         "and this LambdaLR schedules 1"):
        sched.step()
    assert (plain(sched.state_dict()), opt_state(opt)) == before


def test_step_epoch_counts_the_next_step_from_there():
    """After step(epoch) (torch's SequentialLR starts each next scheduler with it), a
    step() without an applied optimizer step since holds: a step skipped right after a
    milestone of torch's SequentialLR keeps the lr."""
    params = make_params()
    opt = optim.SGD(params, lr=1.0)
    first, second = ours.ConstantLR(opt, factor=0.5, total_iters=10), ours.StepLR(opt, 1, 0.5)
    sched = theirs.SequentialLR(opt, [first, second], milestones=[2])
    for call in range(5):
        if call != 2:  # (call 2, right after the milestone: a step the scaler skipped)
            for p, g in zip(params, grads(params, call)):
                p.grad = g
            opt.step()
        sched.step()
        assert lrs(second if call >= 1 else first) == pytest.approx(
            [[0.5, 1.0, 1.0, 0.5, 0.25][call]]), call


def test_a_scheduler_gone_no_longer_replaces_one():
    """A learning-rate finder's temporary scheduler, stepped and deleted: the main one
    steps on (while it lives, the main one's step raises)."""
    params = make_params()
    opt = optim.SGD(params, lr=0.1)
    main = ours.StepLR(opt, step_size=2, gamma=0.5)
    main.step()
    finder = ours.ExponentialLR(opt, gamma=2.0)
    finder.step()
    with pytest.raises(RuntimeError, match="ExponentialLR that is done with can be deleted"):
        main.step()
    del finder
    main.step()
    assert int(main.last_epoch) == 0 and lrs(main) == pytest.approx([0.1])


def test_warm_restarts_with_cycles_past_int64_are_made():
    for t_0, t_mult in ((2**40, 2**30), (2**63 - 1, 2)):
        sched = ours.CosineAnnealingWarmRestarts(optim.SGD(make_params(), lr=0.1), t_0, t_mult)
        sched.step(5)
        assert lrs(sched)[0] == pytest.approx(0.05 * (1 + np.cos(np.pi * 5 / t_0)))
