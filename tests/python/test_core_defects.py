"""The loss-scale core, GradScaler's settings and the fused optimizers' edges that careful
users of torch hit: each test here failed before its fix."""

import copy
import math

import pytest
import torch
from torch import nn

from mixedprec import FusedAdam, FusedSGD, GradScaler
from mixedprec.loss_scale import DEFAULT_MIN_SCALE, LossScale

INF = math.inf
NAN = math.nan


def snapshot(model, opt):
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))


def assert_unchanged(model, opt, before):
    model_sd, opt_sd = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, model_sd[k]), k
    now = opt.state_dict()
    assert now["param_groups"] == opt_sd["param_groups"]
    assert {k for k, v in now["state"].items() if v} == set(opt_sd["state"])
    for pid, st in opt_sd["state"].items():
        for key, value in st.items():
            assert torch.equal(now["state"][pid][key], value), (pid, key)


# --- the loss scale: floor, and settings checked when given ---------------------------

@pytest.mark.parametrize("value", [0.0, -1.0, NAN, INF])
def test_grad_scaler_rejects_an_unusable_init_scale(value):
    with pytest.raises(ValueError, match="init_scale"):
        GradScaler("cpu", init_scale=value)


@pytest.mark.parametrize("kwargs, name", [
    (dict(backoff_factor=-1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=4.0, max_scale=2.0), "min_scale <= max_scale"),
    (dict(max_scale=NAN), "max_scale"),
    (dict(growth_factor=NAN), "growth_factor"),
])
def test_grad_scaler_checks_settings_at_construction(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        GradScaler("cpu", init_scale=2.0, **kwargs)


@pytest.mark.parametrize("setter, value", [
    ("set_backoff_factor", -1.0), ("set_growth_interval", 0), ("set_hysteresis", 0),
    ("set_min_scale", 0.0), ("set_max_scale", NAN), ("set_growth_factor", NAN),
])
def test_grad_scaler_setters_check_and_change_nothing(setter, value):
    scaler = GradScaler("cpu", init_scale=4.0)
    before = scaler.state_dict()
    with pytest.raises((ValueError, TypeError)):
        getattr(scaler, setter)(value)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("key, value", [
    ("hysteresis", 0), ("growth_interval", 0), ("backoff_factor", -1.0), ("scale", 0.0),
    ("scale", NAN), ("min_scale", 8.0), ("max_scale", NAN), ("_growth_tracker", -1),
])
def test_grad_scaler_load_state_dict_checks_first(key, value):
    source = GradScaler("cpu", init_scale=4.0, hysteresis=2, max_scale=64.0)
    sd = dict(source.state_dict(), **{key: value})
    target = GradScaler("cpu", init_scale=16.0)
    target.scale(torch.ones(()))  # placed: the tensors exist
    before = target.state_dict()
    with pytest.raises(ValueError):
        target.load_state_dict(sd)
    assert target.state_dict() == before


def overflowing_step(model, opt, scaler, device):
    opt.zero_grad()
    loss = model(torch.ones(1, 4, device=device)).sum() * torch.tensor(INF, device=device)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("optimizer", ["fused", "torch"])
def test_the_scale_stops_at_a_floor_above_zero(device, optimizer):
    """Before: 170 overflows in a row took the scale to 0, after which it never grew
    back and 1/scale wrote NaN."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = (FusedSGD(model.parameters(), lr=0.1) if optimizer == "fused"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler(device, init_scale=2.0**16)
    before = snapshot(model, opt)
    for _ in range(200):
        overflowing_step(model, opt, scaler, device)
    assert scaler.get_scale() == DEFAULT_MIN_SCALE > 0
    assert_unchanged(model, opt, before)  # every step at the floor was skipped
    # A clean step afterwards trains normally, with finite weights.
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 4, device=device)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(model.weight, before[0]["weight"])


def test_loss_scale_core_update_and_state():
    core = LossScale(8.0, growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=32.0)
    assert core.get() == 8.0 and core.scale is None
    flags = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    scales = []
    for f in flags:
        core.update(torch.tensor(float(f)))
        scales.append(core.get())
    # the first back-off after two overflows (hysteresis 2), then one per overflow until
    # a clean step; the floor 2; growth every 2 clean steps up to the ceiling 32
    assert scales == [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    state = dict(scale=core.get(), **core.trackers())
    other = LossScale(1.0)
    other.load(state["scale"], state["growth_tracker"], state["hysteresis_tracker"],
               growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=32.0)
    assert other.get() == 32.0 and other.trackers() == core.trackers()


def test_loss_scale_static_never_changes():
    core = LossScale(128.0, dynamic=False)
    for f in (1.0, 0.0, 1.0):
        core.update(torch.tensor(f))
    assert core.get() == 128.0


def test_loss_scale_rejects_init_outside_its_bounds():
    with pytest.raises(ValueError, match="init_scale"):
        LossScale(2.0**20, max_scale=2.0**16)
    LossScale(2.0**20, max_scale=2.0**16, dynamic=False)  # static: no bounds apply


# --- GradScaler: float64 gradients and what p.grad holds after step --------------------

def test_grad_scaler_takes_float64_gradients_as_torch_does(device):
    """Before: mixedprec.GradScaler rejected float64 gradients that torch's accepts."""
    results = []
    for scaler_cls in (torch.amp.GradScaler, GradScaler):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to(device, torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = scaler_cls(device, init_scale=1024.0)
        for step in range(3):
            opt.zero_grad()
            x = torch.full((1, 4), 0.5, dtype=torch.float64, device=device)
            loss = model(x).sum() * (INF if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (theirs, their_scale), (ours, our_scale) = results
    assert our_scale == their_scale
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, GradScaler])
@pytest.mark.parametrize("opt_cls", ["mixedprec", "torch-fused"])
def test_what_p_grad_holds_after_a_scaled_step(device, scaler_cls, opt_cls):
    """The documented contract: mixedprec's fused optimizers leave p.grad scaled (they
    read it and write nothing back), torch's fused ones unscale it in place; whichever
    scaler drives them."""
    if opt_cls == "torch-fused" and device == "cpu" and not hasattr(torch.optim, "AdamW"):
        pytest.skip("no fused AdamW")
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = (FusedAdam(model.parameters(), lr=0.1) if opt_cls == "mixedprec"
           else torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    scaler = scaler_cls(device, init_scale=256.0)
    scaler.scale(model(torch.ones(1, 4, device=device)).sum()).backward()
    scaled = model.weight.grad.clone()
    scaler.step(opt)
    scaler.update()
    expected = scaled if opt_cls == "mixedprec" else scaled / 256.0
    assert torch.equal(model.weight.grad, expected)


# --- the fused optimizers' edges ---------------------------------------------------------

@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
def test_a_gradient_with_other_strides_is_accepted(device, cls):
    """Before: group 1's transposed gradient raised after group 0 had been updated."""
    a = nn.Parameter(torch.ones(5, 3, device=device))
    b = nn.Parameter(torch.ones(3, 5, device=device))
    ref_a, ref_b = (nn.Parameter(t.detach().clone()) for t in (a, b))
    opt = cls([{"params": [a]}, {"params": [b]}], lr=0.1)
    torch_cls = torch.optim.SGD if cls is FusedSGD else torch.optim.AdamW
    kwargs = {} if cls is FusedSGD else dict(weight_decay=0.0)
    ref = torch_cls([{"params": [ref_a]}, {"params": [ref_b]}], lr=0.1, **kwargs)
    for p in (a, ref_a):
        p.grad = torch.arange(15.0, device=device).reshape(5, 3)
    for p in (b, ref_b):
        p.grad = torch.arange(15.0, device=device).reshape(5, 3).t()  # strides (1, 3)
    opt.step()
    ref.step()
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(b, ref_b)


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
@pytest.mark.parametrize("master_weights", [False, True])
def test_channels_last_after_the_optimizer_was_built(device, cls, master_weights):
    """Before: model.to(memory_format=channels_last) after building the optimizer made
    every step raise (with masters at once, without once exp_avg existed)."""
    dtype = torch.bfloat16 if master_weights else torch.float32

    def build():
        torch.manual_seed(0)
        return nn.Conv2d(3, 4, 3).to(device, dtype)

    kwargs = dict(lr=0.1, momentum=0.9) if cls is FusedSGD else dict(lr=0.01)
    model, reference = build(), build()
    opt = cls(model.parameters(), master_weights=master_weights, **kwargs)
    ref_opt = cls(reference.parameters(), master_weights=master_weights, **kwargs)
    x = torch.randn(2, 3, 8, 8, device=device, dtype=dtype)
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
        if step == 0:
            model.to(memory_format=torch.channels_last)
    assert model.weight.is_contiguous(memory_format=torch.channels_last)
    state = opt.state[model.weight]
    for key in ("master_param", "momentum_buffer", "exp_avg"):
        if key in state:
            assert state[key].stride() == model.weight.stride(), key
    torch.testing.assert_close(model.weight, reference.weight, atol=0, rtol=0)


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
def test_a_master_is_rebuilt_after_a_dtype_round_trip(device, cls):
    """Before: train in bf16, model.float(), train, .bfloat16(): the old fp32 master
    came back and the weights jumped back to it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device, torch.bfloat16)
    opt = cls(model.parameters(), lr=0.1, master_weights=True)
    x = torch.randn(2, 4, device=device)

    def step():
        opt.zero_grad()
        model(x.to(model.weight.dtype)).float().sum().backward()
        opt.step()

    step()
    model.float()
    for _ in range(3):
        step()
    trained = model.weight.detach().clone()
    model.bfloat16()
    assert opt.state[model.weight].get("master_param") is None  # fp32: its own master
    opt.zero_grad()
    model(x.bfloat16()).float().sum().backward()
    before = model.weight.detach().float().clone()
    opt.param_groups[0]["lr"] = 0.0  # a step that changes nothing must change nothing
    opt.step()
    torch.testing.assert_close(model.weight.float(), before, atol=0, rtol=0)
    torch.testing.assert_close(before, trained.bfloat16().float(), atol=0, rtol=0)


def test_a_master_follows_weights_loaded_into_the_model(device):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device, torch.float16)
    opt = FusedSGD(model.parameters(), lr=0.1, master_weights=True)
    x = torch.randn(2, 4, device=device, dtype=torch.float16)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().sum().backward()
        opt.step()
    fresh = nn.Linear(4, 3).to(device, torch.float16)
    model.load_state_dict(fresh.state_dict())  # an in-place copy into the parameters
    opt.zero_grad()
    model(x).float().sum().backward()
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    torch.testing.assert_close(model.weight, fresh.weight, atol=0, rtol=0)


@pytest.mark.parametrize("source, target", [
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), lambda ps: FusedAdam(ps, lr=0.1)),
    (lambda ps: FusedAdam(ps, lr=0.1), lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9)),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1), lambda ps: FusedAdam(ps, lr=0.1)),
], ids=["sgd-into-adam", "adam-into-sgd", "torch-adamw-into-adam"])
def test_load_state_dict_of_another_optimizer_is_refused(device, source, target):
    """Before: the other optimizer's state replaced this one's, then every step raised
    KeyError."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    src = source(list(model.parameters()))
    model(torch.ones(1, 4, device=device)).sum().backward()
    src.step()
    opt = target(list(model.parameters()))
    opt.step()
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="load_state_dict"):
        opt.load_state_dict(src.state_dict())
    assert_unchanged(model, opt, before)
    opt.step()  # still usable


# --- torch.compile --------------------------------------------------------------------

@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
def test_compiled_optimizer_step_matches_eager(cls):
    """Before: Dynamo raised an internal AssertionError ("Attempted setattr on a
    user-defined object") at the optimizer's own attribute write in step()."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).to(torch.bfloat16)
        opt = cls(model.parameters(), lr=0.01, master_weights=True)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
            step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_compiled_training_step_with_the_scaler_matches_eager():
    """A whole step compiled: forward, scaled backward, scaler.step, scaler.update."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = FusedAdam(model.parameters(), lr=0.01)
        scaler = GradScaler("cpu", init_scale=2.0**8)

        def train_step(x):
            opt.zero_grad()
            loss = model(x).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        run = torch.compile(train_step, backend="eager") if compiled else train_step
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            run(torch.randn(4, 8, generator=gen))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
def test_optimizer_step_compiles_in_one_graph(cls):
    """fullgraph=True: the step traces without a graph break (a compiled step skips the
    eager path's kept op calls and the version check of the masters, which Dynamo
    cannot trace; see _FusedOptimizer._master)."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).to(torch.bfloat16)
        opt = cls(model.parameters(), lr=0.01, master_weights=True)
        step = (torch.compile(opt.step, backend="eager", fullgraph=True) if compiled
                else opt.step)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
            step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_loss_scale_restores_a_hysteresis_tracker_below_zero():
    """update_loss_scale_ counts the tracker below 0 while overflows follow each other;
    such a state must load back."""
    core = LossScale(8.0, hysteresis=2)
    for _ in range(3):
        core.update(torch.tensor(1.0))
    saved = dict(scale=core.get(), **core.trackers())
    assert saved["hysteresis_tracker"] < 0
    other = LossScale(8.0, hysteresis=2)
    other.load(saved["scale"], saved["growth_tracker"], saved["hysteresis_tracker"],
               hysteresis=2)
    for c in (core, other):
        c.update(torch.tensor(1.0))
    assert other.get() == core.get() and other.trackers() == core.trackers()


def test_grad_scaler_flag_is_one_for_many_float64_overflows():
    """torch's fused optimizers subtract found_inf from their step counts: it must be 1."""
    params = [nn.Parameter(torch.zeros(3, dtype=torch.float64)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((3,), INF, dtype=torch.float64)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    flags = scaler._check_inf_per_device(opt)
    assert [float(f) for f in flags.values()] == [1.0]
