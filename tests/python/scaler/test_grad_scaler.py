"""mixedprec.GradScaler against torch.amp.GradScaler and a plain Python reference of the
loss-scale algorithm; both scalers driving FusedSGD/FusedAdam; and no host
synchronisation in scale/step/update with the fused optimizers; settings checked when
given, the floor of the scale, float64 gradients and a compiled step (each of these last
tests failed before its fix)."""

import copy
import inspect
import io
import math

import numpy as np
import pytest
import torch
from helpers import (
    SYNC_METHODS,
    TOLERANCES,
    HostSyncError,
    assert_bitwise_equal,
    assert_same_snapshot,
    assert_state_dict_unchanged,
    forbid_host_sync,
    full_snapshot,
    make_model,
    randn,
    state_dict_snapshot,
    torch_optimizer,
)
from torch import nn

import mixedprec
from mixedprec import FusedAdam, FusedSGD, GradScaler
from mixedprec.loss_scale import DEFAULT_MIN_SCALE
from mixedprec.scaler import MissingStateKeys

INF = float("inf")
NAN = float("nan")
TIGHT = TOLERANCES[torch.float32]
TORCH_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
EXTRA_KEYS = {"hysteresis", "min_scale", "max_scale", "_hysteresis_tracker"}
SCALERS = [pytest.param(torch.amp.GradScaler, id="torch"),
           pytest.param(GradScaler, id="mixedprec")]
FUSED = [
    pytest.param(FusedSGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}, id="sgd"),
    pytest.param(FusedSGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.2}, id="sgd-dampening"),
    pytest.param(FusedSGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}, id="sgd-nesterov"),
    pytest.param(FusedAdam, {"lr": 1e-2, "adam_w_mode": False, "weight_decay": 1e-2}, id="adam"),
    pytest.param(FusedAdam, {"lr": 1e-2, "weight_decay": 1e-1}, id="adamw"),
]


# --- the loss of helpers.make_model, and what a skipped step may leave -------------------

def loss_of(model, step):
    device = model.fc1.weight.device
    x = randn((8, 6), torch.float32, device, seed=10_000 + step)
    y = randn((8, 3), torch.float32, device, seed=20_000 + step)
    return (model(x) - y).pow(2).mean()


def assert_untouched(model, opt, before, msg):
    """Nothing that existed in `before` (a full_snapshot) changed. State first created
    by the skipped step is allowed if it is zero (moments, a step count) or, for a
    master, the parameter's value; whether it then behaves like absent state is for
    the tests against torch.optim."""
    after = full_snapshot(model, opt)
    for name, then in before.items():
        assert_bitwise_equal(after.pop(name), then, msg=f"{msg} {name}")
    for name, new in after.items():
        if name.endswith(".master_param"):
            param = before[f"param{name[len('state'):].split('.')[0]}"]
            assert_bitwise_equal(new, param.float(), msg=f"{msg}: new master {name}")
        else:
            assert not new.any(), f"{msg}: new state {name} is not zero"


def train_with_scaler(model, opt, scaler, steps, inf_step, clip=None):
    """`steps` iterations of scale/backward/step/update with an inf in one gradient at
    `inf_step`; checks that this step is skipped and the scale backs off. Returns the
    scales after each update."""
    scales = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_of(model, step)).backward()
        if step == inf_step:
            model.fc2.weight.grad[1, 2] = INF
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = full_snapshot(model, opt)
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if step == inf_step:
            assert_untouched(model, opt, before, f"skipped step {step}")
            assert scales[-1] == scale_before * 0.5
    return scales


# --- the loss-scale algorithm, as a plain Python reference -----------------------------

def reference_states(flags, init_scale, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000, hysteresis=1, min_scale=DEFAULT_MIN_SCALE,
                     max_scale=INF):
    """(scale, growth_tracker, hysteresis_tracker) after each update, for overflow
    `flags`: the documented algorithm, the scale a float32."""
    f32 = np.float32
    scale, growth, tracker = f32(init_scale), 0, hysteresis
    states = []
    with np.errstate(over="ignore"):
        for overflow in flags:
            if overflow:
                tracker -= 1
                if tracker <= 0:
                    scale = max(scale * f32(backoff_factor), f32(min_scale))
                growth = 0
            else:
                tracker = hysteresis
                growth += 1
                if growth == growth_interval:
                    grown = min(scale * f32(growth_factor), f32(max_scale))
                    if np.isfinite(grown):
                        scale = grown
                    growth = 0
            states.append((float(scale), growth, tracker))
    return states


def run_flags(scaler, device, flags, optimizer="fused", init=True):
    """Steps `scaler` over overflow `flags` (an inf gradient or a clean one) and returns
    (scale, growth tracker, hysteresis tracker or None) after each update."""
    p = nn.Parameter(torch.zeros(5, device=device))
    opt = FusedSGD([p], lr=0.0) if optimizer == "fused" else torch.optim.SGD([p], lr=0.0)
    if init:
        scaler.scale(torch.ones((), device=device))
    states = []
    for overflow in flags:
        p.grad = torch.full_like(p, INF if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        sd = scaler.state_dict()
        states.append((scaler.get_scale(), sd["_growth_tracker"], sd.get("_hysteresis_tracker")))
    return states


def random_flags(seed, n=120, p_overflow=0.3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=gen) < p_overflow).tolist()


RUNS = [1] * 12 + [0] * 40 + [1, 0, 1, 1, 0, 1, 1, 1] + [0] * 10
SEQUENCES = [
    pytest.param({"growth_interval": 3}, random_flags(0), id="hysteresis1"),
    pytest.param({"growth_interval": 3, "hysteresis": 3}, random_flags(1), id="hysteresis3"),
    pytest.param({"growth_interval": 2, "hysteresis": 2}, RUNS, id="hysteresis2-runs"),
    pytest.param({"growth_interval": 3, "min_scale": 4.0, "max_scale": 2.0**12},
                 RUNS + random_flags(2), id="floor-ceiling"),
    pytest.param({"growth_interval": 3, "hysteresis": 2, "min_scale": 4.0, "max_scale": 1000.0},
                 RUNS + random_flags(3), id="floor-ceiling-hysteresis2"),
    pytest.param({"growth_interval": 1, "growth_factor": 4.0, "backoff_factor": 0.25,
                  "min_scale": 1.0}, random_flags(4, p_overflow=0.5), id="factors4"),
]


@pytest.mark.parametrize("optimizer", ["fused", "torch.optim"])
@pytest.mark.parametrize("config, flags", SEQUENCES)
def test_scale_sequence_follows_the_reference(device, config, flags, optimizer):
    scaler = GradScaler(device, init_scale=256.0, **config)

    states = run_flags(scaler, device, flags, optimizer)

    expected = reference_states(flags, 256.0, **config)
    for i, (got, want) in enumerate(zip(states, expected)):
        assert got == want, f"update {i} (overflow={flags[i]}): got {got}, expected {want}"
    assert len({s for s, _, _ in states}) > 3  # it both grew and backed off


TORCH_CONFIGS = [
    pytest.param({"init_scale": 2.0**16}, random_flags(5), id="defaults"),
    pytest.param({"init_scale": 256.0, "growth_interval": 3}, random_flags(6), id="interval3"),
    pytest.param({"init_scale": 2.0**120, "growth_interval": 1, "growth_factor": 4.0},
                 [0] * 8 + [1] + [0] * 8, id="growth-to-overflow"),
    # Factors that are not powers of two: torch rounds scale * factor (a double) to fp32.
    pytest.param({"init_scale": 1000.0, "growth_interval": 1, "growth_factor": 1.7,
                      "backoff_factor": 0.3}, [0, 0, 1, 0, 1, 1, 0, 0], id="factors-1.7-0.3"),
]


@pytest.mark.parametrize("optimizer", ["fused", "torch.optim"])
@pytest.mark.parametrize("config, flags", TORCH_CONFIGS)
def test_scale_sequence_equals_torch(device, config, flags, optimizer):
    ours = run_flags(GradScaler(device, **config), device, flags, optimizer)
    theirs = run_flags(torch.amp.GradScaler(device, **config), device, flags, optimizer)

    assert [s[:2] for s in ours] == [s[:2] for s in theirs]


# --- constructor, accessors, state_dict ---------------------------------------------

def test_constructor_follows_torch():
    ours = inspect.signature(GradScaler).parameters
    theirs = inspect.signature(torch.amp.GradScaler).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
    assert {k: v.default for k, v in ours.items() if k not in theirs} == {
        "hysteresis": 1, "min_scale": DEFAULT_MIN_SCALE, "max_scale": INF,
        "overflow_report": False, "skip_on_host": False}
    assert all(ours[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ours if k not in theirs)
    assert issubclass(GradScaler, torch.amp.GradScaler)


@pytest.mark.parametrize("kwargs", [
    {"hysteresis": 0}, {"hysteresis": -1}, {"hysteresis": 1.5}, {"hysteresis": True},
    {"hysteresis": "2"}, {"min_scale": -1.0}, {"min_scale": 8.0, "max_scale": 4.0},
    {"max_scale": -1.0}, {"min_scale": float("nan")}, {"max_scale": float("nan")},
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        GradScaler("cpu", **kwargs)


def test_accessors(device):
    scaler = GradScaler(device, init_scale=8.0, growth_factor=3.0, backoff_factor=0.25,
                        growth_interval=7, hysteresis=3, min_scale=1.0, max_scale=1024.0)
    assert scaler.is_enabled()
    assert scaler.get_scale() == 8.0  # before the scale tensor exists
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (3.0, 0.25, 7)
    assert (scaler.get_hysteresis(), scaler.get_min_scale(), scaler.get_max_scale()) == (
        3, 1.0, 1024.0)

    new = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2, "hysteresis": 2,
               "min_scale": 2.0, "max_scale": 32.0}
    scaler.set_growth_factor(2.0)
    scaler.set_backoff_factor(0.5)
    scaler.set_growth_interval(2)
    scaler.set_hysteresis(2)
    scaler.set_min_scale(2.0)
    scaler.set_max_scale(32.0)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval(),
            scaler.get_hysteresis(), scaler.get_min_scale(), scaler.get_max_scale()) == (
        2.0, 0.5, 2, 2, 2.0, 32.0)

    # The new values drive the updates (the first update is clean: it resets the
    # hysteresis tracker to the new hysteresis).
    flags = [0] + [0] * 6 + [1] * 8 + [0, 1, 0, 1, 1] + [0] * 4
    states = run_flags(scaler, device, flags)
    assert states == reference_states(flags, 8.0, **new)


def test_hysteresis_set_before_the_first_step(device):
    """set_hysteresis before training: that many consecutive overflows back off."""
    scaler = GradScaler(device, init_scale=64.0, hysteresis=2)
    scaler.set_hysteresis(3)

    states = run_flags(scaler, device, [1, 1, 1, 1])

    assert [s for s, _, _ in states] == [64.0, 64.0, 32.0, 16.0]


def test_state_dict_keys(device):
    scaler = GradScaler(device, init_scale=64.0, hysteresis=3, min_scale=2.0, max_scale=2.0**20)
    sd = scaler.state_dict()  # before the first scale(): the initial values
    assert set(sd) == TORCH_KEYS | EXTRA_KEYS
    assert sd == {"scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                  "growth_interval": 2000, "_growth_tracker": 0, "hysteresis": 3,
                  "min_scale": 2.0, "max_scale": 2.0**20, "_hysteresis_tracker": 3}

    run_flags(scaler, device, [0, 0, 1])
    sd = scaler.state_dict()
    assert sd["_growth_tracker"] == 0 and sd["_hysteresis_tracker"] == 2
    assert isinstance(sd["scale"], float) and isinstance(sd["_growth_tracker"], int)
    assert isinstance(sd["_hysteresis_tracker"], int)
    assert set(torch.amp.GradScaler(device).state_dict()) == TORCH_KEYS


@pytest.mark.parametrize("target_initialised", [False, True], ids=["fresh", "initialised"])
def test_state_dict_round_trip(device, target_initialised):
    config = {"init_scale": 256.0, "growth_interval": 3, "hysteresis": 3, "min_scale": 4.0,
                  "max_scale": 2.0**12}
    source = GradScaler(device, **config)
    run_flags(source, device, [0, 0, 1, 0, 0, 1, 1])  # stops mid-hysteresis
    sd = source.state_dict()
    assert sd["_hysteresis_tracker"] == 1 and sd["_growth_tracker"] == 0
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    target = GradScaler(device)
    if target_initialised:
        target.scale(torch.ones((), device=device))
    target.load_state_dict(loaded)

    assert target.state_dict() == sd
    flags = [1, 0, 0, 0, 1, 1, 1, 1] + random_flags(8, 40)
    assert run_flags(target, device, flags, init=not target_initialised) == run_flags(
        source, device, flags, init=False)


def test_load_a_torch_state_dict(device):
    theirs = torch.amp.GradScaler(device, init_scale=256.0, growth_interval=4)
    run_flags(theirs, device, [0, 0, 1, 0, 0, 0])
    sd = theirs.state_dict()
    assert sd["_growth_tracker"] == 3

    ours = GradScaler(device, hysteresis=1, max_scale=2.0**30)
    ours.load_state_dict(sd)

    mine = ours.state_dict()
    assert {k: mine[k] for k in TORCH_KEYS} == sd
    assert (mine["hysteresis"], mine["min_scale"], mine["max_scale"]) == (
        1, DEFAULT_MIN_SCALE, 2.0**30)
    flags = [0, 1, 0, 0, 0, 0] + random_flags(9, 40)
    assert [s[:2] for s in run_flags(ours, device, flags)] == [
        s[:2] for s in run_flags(theirs, device, flags, init=False)]


@pytest.mark.parametrize("device_arg", ["bogus", "cuda:x", ""])
def test_an_unknown_device_is_refused_at_construction(device_arg):
    # torch's scaler keeps any string and only fails (or not) at the first scale().
    with pytest.raises(ValueError, match=r"device .*%r" % device_arg):
        GradScaler(device=device_arg)


def test_a_device_that_is_no_string_is_refused():
    with pytest.raises(TypeError, match="device"):
        GradScaler(device=3.5)


@pytest.mark.parametrize("device_arg", ["cpu", "cpu:0", torch.device("cpu")], ids=str)
def test_device_spellings_torch_takes(device_arg):
    ours, theirs = GradScaler(device_arg), torch.amp.GradScaler(device_arg)
    assert ours._device == theirs._device
    x = torch.ones(2)
    assert torch.equal(ours.scale(x), theirs.scale(x))


def test_a_state_dict_missing_keys_names_them_and_loads_nothing(device):
    scaler = GradScaler(device, init_scale=32.0, growth_interval=5, hysteresis=2)
    run_flags(scaler, device, [0, 1])
    before = scaler.state_dict()
    partial = {"scale": 4.0, "growth_factor": 3.0, "hysteresis": 7}

    with pytest.raises(MissingStateKeys) as caught:
        scaler.load_state_dict(partial)

    message = str(caught.value)
    for key in ("backoff_factor", "growth_interval", "_growth_tracker"):
        assert key in message
    assert "growth_factor," not in message.split("has no")[1].split("(")[0]
    assert "nothing was loaded" in message
    # Code written against torch's scaler catches a KeyError; ours is one too.
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, ValueError)
    assert scaler.state_dict() == before


def test_a_fresh_scaler_given_a_partial_state_dict_is_unchanged():
    scaler = GradScaler("cpu", init_scale=16.0)
    before = scaler.state_dict()
    with pytest.raises(KeyError, match="_growth_tracker"):
        scaler.load_state_dict({k: v for k, v in before.items() if k != "_growth_tracker"})
    assert scaler.state_dict() == before and scaler._scale is None


@pytest.mark.parametrize("kwargs", [{"init_scale": 0.0}, {"growth_interval": 0},
                                    {"growth_factor": 0.5}, {"backoff_factor": 2.0},
                                    {"init_scale": 1e-30}], ids=str)
def test_a_disabled_scaler_takes_the_settings_torch_takes(kwargs):
    # Disabled, neither scaler uses or checks its settings; enabled, ours refuses them.
    ours = GradScaler("cpu", enabled=False, **kwargs)
    theirs = torch.amp.GradScaler("cpu", enabled=False, **kwargs)
    assert (ours.get_scale(), ours.is_enabled()) == (theirs.get_scale(), theirs.is_enabled())
    assert ours.state_dict() == theirs.state_dict() == {}
    # torch's disabled scaler has no growth settings at all (its getters raise
    # AttributeError); ours gives back what it was given.
    name, value = next(iter(kwargs.items()))
    if name != "init_scale":
        assert getattr(ours, f"get_{name}")() == value
    with pytest.raises(ValueError):
        GradScaler("cpu", **kwargs)


def test_a_scaler_disabled_for_want_of_cuda_takes_any_settings():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the scaler stays enabled")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler("cuda", init_scale=0.0)
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0


def test_a_growth_tracker_saved_as_a_whole_float_loads(device):
    scaler = GradScaler(device)
    sd = dict(GradScaler(device, init_scale=8.0).state_dict(), _growth_tracker=3.0)
    scaler.load_state_dict(sd)
    assert scaler.state_dict()["_growth_tracker"] == 3
    with pytest.raises(ValueError, match="growth_tracker"):
        scaler.load_state_dict(dict(sd, _growth_tracker=2.5))
    assert scaler.state_dict()["_growth_tracker"] == 3


def test_pickle_round_trip(device):
    scaler = GradScaler(device, init_scale=256.0, growth_interval=3, hysteresis=3)
    run_flags(scaler, device, [0, 1, 0, 0, 1])
    clone = copy.deepcopy(scaler)
    assert clone.state_dict() == scaler.state_dict()
    flags = [1, 1, 0, 0, 0, 1, 1, 1]
    assert run_flags(clone, device, flags) == run_flags(scaler, device, flags, init=False)


def test_disabled_is_a_pass_through(device):
    def run(scaler_cls):
        model = make_model(device)
        opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = scaler_cls(device, enabled=False)
        loss = loss_of(model, 0)
        assert scaler.scale(loss) is loss
        outputs = [loss, loss * 2]
        assert scaler.scale(outputs) is outputs
        loss.backward()
        model.fc2.weight.grad[0, 0] = 1e30  # no overflow check: the step is taken
        grads = [p.grad.clone() for p in model.parameters()]
        scaler.unscale_(opt)
        for p, g in zip(model.parameters(), grads):
            assert_bitwise_equal(p.grad, g)
        scaler.step(opt)
        scaler.update()
        assert not scaler.is_enabled()
        assert scaler.get_scale() == 1.0
        assert scaler.state_dict() == {}
        scaler.load_state_dict({"scale": 8.0})  # a no-op
        assert scaler.get_scale() == 1.0
        return full_snapshot(model, opt)

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert_same_snapshot(ours, theirs)
    assert GradScaler(device, enabled=False).found_inf() is None


# --- unscale_ ----------------------------------------------------------------------------

@pytest.mark.parametrize("inf_step", [None, 3])
def test_unscale_then_step_matches_torch_on_torch_sgd(device, inf_step):
    results = []
    for scaler_cls in (torch.amp.GradScaler, GradScaler):
        model = make_model(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        scaler = scaler_cls(device, init_scale=2.0**10, growth_interval=3)
        scales = train_with_scaler(model, opt, scaler, 8, inf_step, clip=0.05)
        results.append((scales, full_snapshot(model, opt)))

    assert results[0][0] == results[1][0]
    assert_same_snapshot(results[1][1], results[0][1])


@pytest.mark.parametrize("cls, kwargs", FUSED[:1] + FUSED[3:4])
def test_unscale_then_step_with_a_fused_optimizer(device, cls, kwargs):
    """unscale_ (then clipping) before step: the fused optimizer gets no grad_scale
    and matches torch.optim under torch's scaler."""
    model, twin = make_model(device), make_model(device)
    opt = cls(model.parameters(), **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    scales = train_with_scaler(model, opt, GradScaler(device, init_scale=2.0**10), 8, 3,
                               clip=0.05)
    twin_scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    twin_scales = train_with_scaler(twin, twin_opt, twin_scaler, 8, 3, clip=0.05)

    assert scales == twin_scales
    for p, tp in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, tp, **TIGHT)


def test_unscale_bf16_grads(device):
    model = make_model(device)
    model.fc1.to(torch.bfloat16)  # bf16 and fp32 gradients in one optimizer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(device, init_scale=8.0)
    scaler.scale(loss_of(model, 0)).backward()
    assert model.fc1.weight.grad.dtype == torch.bfloat16
    scaled = [p.grad.clone() for p in model.parameters()]

    scaler.unscale_(opt)

    for p, g in zip(model.parameters(), scaled):
        assert_bitwise_equal(p.grad, (g.float() * 0.125).to(g.dtype))
    scaler.step(opt)
    scaler.update()
    assert scaler.found_inf().item() == 0.0 and scaler.get_scale() == 8.0

    # An inf in a bf16 gradient is found: the step is skipped, the scale backs off.
    opt.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    model.fc1.weight.grad[2, 3] = INF
    before = [p.detach().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.found_inf().item() != 0.0 and scaler.get_scale() == 4.0
    for p, then in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), then)


@pytest.mark.parametrize("scaler_cls", SCALERS)
def test_unscale_refuses_fp16_grads_like_torch(device, scaler_cls):
    model = make_model(device, torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls(device)
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_found_inf(device):
    scaler = GradScaler(device, init_scale=16.0)
    assert scaler.found_inf() is None
    run_flags(scaler, device, [0])
    flag = scaler.found_inf()
    assert isinstance(flag, torch.Tensor) and flag.device.type == device
    assert flag.dtype == torch.float32 and flag.numel() == 1 and flag.item() == 0.0
    run_flags(scaler, device, [1], init=False)
    assert scaler.found_inf().item() != 0.0
    run_flags(scaler, device, [0], init=False)
    assert scaler.found_inf().item() == 0.0


# --- both scalers driving the fused optimizers -----------------------------------------

def skip_where_torch_cannot_check(scaler_cls, device, dtype):
    """torch.amp.GradScaler's CUDA overflow check (_amp_foreach_non_finite_check_and_unscale_)
    has no bfloat16 kernel; its CPU one has, and so has mixedprec's on both."""
    if scaler_cls is torch.amp.GradScaler and device == "cuda" and dtype == torch.bfloat16:
        pytest.skip("torch.amp.GradScaler cannot check bfloat16 gradients on CUDA")


@pytest.mark.parametrize("inf_step", [0, 4])
@pytest.mark.parametrize("dtype, master_weights", [
    pytest.param(torch.float32, False, id="fp32"),
    pytest.param(torch.float16, True, id="fp16-masters"),
    pytest.param(torch.bfloat16, True, id="bf16-masters"),
])
@pytest.mark.parametrize("cls, kwargs", FUSED)
def test_both_scalers_drive_fused_optimizers_alike(device, cls, kwargs, dtype, master_weights,
                                                    inf_step):
    skip_where_torch_cannot_check(torch.amp.GradScaler, device, dtype)
    results = []
    for scaler_cls in (torch.amp.GradScaler, GradScaler):
        model = make_model(device, dtype)
        opt = cls(model.parameters(), master_weights=master_weights, **kwargs)
        scaler = scaler_cls(device, init_scale=2.0**8, growth_interval=3)
        scales = train_with_scaler(model, opt, scaler, 10, inf_step)
        if cls is FusedAdam:
            assert opt.param_groups[0]["step"].item() == 9  # the skipped step is not counted
        results.append((scales, full_snapshot(model, opt)))

    assert results[0][0] == results[1][0]
    assert_same_snapshot(results[1][1], results[0][1])


@pytest.mark.parametrize("inf_step", [0, 4])
@pytest.mark.parametrize("cls, kwargs", FUSED)
def test_fused_optimizers_under_a_scaler_match_torch_optim(request, device, cls, kwargs,
                                                          inf_step):
    """An fp32 model: FusedSGD/FusedAdam under mixedprec's scaler against torch.optim
    under torch's (which skips the step on the host)."""
    if kwargs.get("dampening") and inf_step == 0:
        from test_fused_optimizers import DAMPENED_FIRST_STEP
        request.applymarker(pytest.mark.xfail(strict=True, reason=DAMPENED_FIRST_STEP))
    model, twin = make_model(device), make_model(device)
    opt = cls(model.parameters(), **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    scaler = GradScaler(device, init_scale=2.0**8, growth_interval=3)
    twin_scaler = torch.amp.GradScaler(device, init_scale=2.0**8, growth_interval=3)

    scales = train_with_scaler(model, opt, scaler, 10, inf_step)
    twin_scales = train_with_scaler(twin, twin_opt, twin_scaler, 10, inf_step)

    assert scales == twin_scales
    for p, tp in zip(model.parameters(), twin.parameters()):
        for key, value in twin_opt.state[tp].items():
            if key != "step":
                torch.testing.assert_close(opt.state[p][key], value, **TIGHT,
                                           msg=lambda m, key=key: f"{key}: {m}")
        torch.testing.assert_close(p, tp, **TIGHT)


# --- no host synchronisation ------------------------------------------------------------

SYNC_CALLS = [
    pytest.param(lambda t: t.sum().item(), id="item"),
    pytest.param(lambda t: bool(t.sum()), id="bool"),
    pytest.param(lambda t: float(t.sum()), id="float"),
    pytest.param(lambda t: int(t.sum()), id="int"),
    pytest.param(lambda t: t.tolist(), id="tolist"),
    pytest.param(lambda t: t.cpu(), id="cpu"),
    pytest.param(lambda t: torch._C.TensorBase.item(t.sum()), id="base-item"),
    pytest.param(lambda t: 1 if t.sum() > 0 else 0, id="if-tensor"),
    pytest.param(lambda t: torch.equal(t, t), id="equal"),
]


@pytest.mark.parametrize("call", SYNC_CALLS)
def test_the_guard_catches_host_syncs(device, monkeypatch, call):
    t = torch.ones(3, device=device)
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    with pytest.raises(HostSyncError), forbid_host_sync(monkeypatch):
        call(t)
    # Restored afterwards.
    assert all(getattr(torch.Tensor, name) is f for name, f in originals.items())
    call(t)


@pytest.mark.parametrize("scaler_cls", SCALERS)
def test_the_guard_catches_torch_optim_step(device, monkeypatch, scaler_cls):
    """A plain optimizer makes scaler.step read the overflow flag on the host: the guard
    must see that."""
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls(device)
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(HostSyncError), forbid_host_sync(monkeypatch):
        scaler.step(opt)


@pytest.mark.parametrize("dtype, master_weights, unscale_first", [
    pytest.param(torch.float32, False, False, id="fp32"),
    pytest.param(torch.float16, False, False, id="fp16-params"),
    pytest.param(torch.float16, True, False, id="fp16-masters"),
    pytest.param(torch.bfloat16, True, False, id="bf16-masters"),
    # unscale_ refuses fp16 gradients (as torch's does).
    pytest.param(torch.float32, False, True, id="fp32-unscale_"),
    pytest.param(torch.bfloat16, True, True, id="bf16-masters-unscale_"),
])
@pytest.mark.parametrize("cls, kwargs", FUSED[:1] + FUSED[4:])
@pytest.mark.parametrize("scaler_cls", SCALERS)
def test_no_host_sync(device, monkeypatch, scaler_cls, cls, kwargs, dtype, master_weights,
                      unscale_first):
    skip_where_torch_cannot_check(scaler_cls, device, dtype)
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master_weights=master_weights, **kwargs)
    scaler = scaler_cls(device, init_scale=2.0**8, growth_interval=2)
    start = [p.detach().clone() for p in model.parameters()]
    flags = []
    for step in range(5):
        opt.zero_grad()
        loss = loss_of(model, step)  # the batch is drawn on the host
        with forbid_host_sync(monkeypatch):
            scaled = scaler.scale(loss)
        scaled.backward()
        if step == 2:
            model.fc1.weight.grad[0, 1] = INF
        with forbid_host_sync(monkeypatch):
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            if scaler_cls is GradScaler:
                flags.append(scaler.found_inf().clone())
    # And plain steps, without a scaler.
    for step in range(5, 7):
        opt.zero_grad()
        loss_of(model, step).backward()
        with forbid_host_sync(monkeypatch):
            opt.step()

    # The work was done: the scale grew (step 1), backed off (step 2, skipped), grew.
    assert scaler.get_scale() == 2.0**9
    if flags:
        assert [f.item() != 0 for f in flags] == [False, False, True, False, False]
    if cls is FusedAdam:
        assert opt.param_groups[0]["step"].item() == 6
    for p, before in zip(model.parameters(), start):
        assert torch.isfinite(p).all() and not torch.equal(p, before)


# --- settings checked when given, and the floor of the scale -----------------------------

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
    # (the device's trackers and update_loss_scale_'s settings are int32)
    (dict(growth_interval=2**31), "growth_interval"),
    (dict(hysteresis=2**31), "hysteresis"),
])
def test_grad_scaler_checks_settings_at_construction(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        GradScaler("cpu", init_scale=2.0, **kwargs)


@pytest.mark.parametrize("setter, value", [
    ("set_backoff_factor", -1.0), ("set_growth_interval", 0), ("set_hysteresis", 0),
    ("set_min_scale", 0.0), ("set_max_scale", NAN), ("set_growth_factor", NAN),
    ("set_growth_factor", 1.0), ("set_backoff_factor", 1.0),
    ("set_growth_interval", 2**31), ("set_hysteresis", 2**70),
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
    ("_growth_tracker", 2**31), ("_hysteresis_tracker", 2**40), ("_hysteresis_tracker", -2**31 - 1),
    ("growth_interval", 2**31),
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


@pytest.mark.parametrize("value", [1e-30, 1e9, 0.0, -4.0, NAN, INF])
def test_update_refuses_a_new_scale_number_outside_the_floor_and_ceiling(value):
    """Before: 1e-30 (below the floor that init_scale must respect) was taken."""
    scaler = GradScaler("cpu", init_scale=4.0, max_scale=2.0**20)
    scaler.scale(torch.ones(()))
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(value)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("value, expected", [
    (0.0, DEFAULT_MIN_SCALE), (-4.0, DEFAULT_MIN_SCALE), (1e-30, DEFAULT_MIN_SCALE),
    (2.0**30, 2.0**20), (NAN, 4.0), (INF, 2.0**20), (8.0, 8.0)])
def test_update_holds_a_new_scale_tensor_to_the_floor_and_ceiling(device, monkeypatch,
                                                                   value, expected):
    """A tensor new_scale is read on the device only: held to [min_scale, max_scale]
    there (a NaN keeps the scale), where it was copied as it was (0, negative, NaN)."""
    scaler = GradScaler(device, init_scale=4.0, max_scale=2.0**20)
    scaler.scale(torch.ones((), device=device))
    new_scale = torch.tensor(value, device=device)
    with forbid_host_sync(monkeypatch):
        scaler.update(new_scale)
    assert scaler.get_scale() == expected


def test_update_with_a_tensor_before_the_first_scale_raises_torchs_error_and_places_nothing():
    """The range is applied without making or moving the scale: torch's assertion (no
    scale yet) still fires, with nothing created."""
    scaler = GradScaler("cpu", init_scale=4.0)
    with pytest.raises(AssertionError, match="_scale is None"):
        scaler.update(torch.tensor(8.0))
    assert scaler._scale is None and scaler.get_scale() == 4.0


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD([p], lr=0.1), lambda p: torch.optim.AdamW([p], fused=True),
    lambda p: mixedprec.optim.AdamW([p]), lambda p: mixedprec.optim.SGD([p], lr=0.1),
    lambda p: FusedAdam([p])], ids=["torch-sgd", "torch-fused-adamw", "adamw", "sgd",
                                    "apex-fused-adam"])
def test_a_step_that_checked_no_gradient_raises_as_torchs(make):
    """A forgotten backward(): torch's scaler raises (at step, or at update for an
    optimizer that unscales inside its step); mixedprec's counted a clean step and
    grew the scale. Both scalers now raise the same error, and the scale is unchanged."""
    raised = []
    for scaler_cls in (torch.amp.GradScaler, GradScaler):
        p = nn.Parameter(torch.randn(3))
        opt, scaler = make(p), scaler_cls("cpu", growth_interval=1)
        scaler.scale(p.sum())
        with pytest.raises(AssertionError, match="No inf checks were recorded") as error:
            scaler.step(opt)
            scaler.update()
        raised.append(str(error.value))
        assert scaler.get_scale() == 2.0**16
    assert raised[0] == raised[1]


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
    before = state_dict_snapshot(model, opt)
    for _ in range(200):
        overflowing_step(model, opt, scaler, device)
    assert scaler.get_scale() == DEFAULT_MIN_SCALE > 0
    assert_state_dict_unchanged(model, opt, before)  # every step at the floor was skipped
    # A clean step afterwards trains normally, with finite weights.
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 4, device=device)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(model.weight, before[0]["weight"])


# --- float64 gradients, what p.grad holds after step, a compiled step --------------------

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


@pytest.mark.parametrize("schedule", [False, True], ids=["", "with-a-schedule"])
def test_compiled_step_breaks_no_more_than_torchs(schedule):
    """A training step compiled without fullgraph: with mixedprec's GradScaler and
    optim.AdamW (and a StepLR of each), no more graphs and graph breaks than with torch's
    GradScaler and fused AdamW (torch._dynamo.explain's counts)."""
    counts = {}
    for kind in ("torch", "mixedprec"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        if kind == "torch":
            opt = torch.optim.AdamW(model.parameters(), fused=True)
            scaler = torch.amp.GradScaler("cpu")
            sched = torch.optim.lr_scheduler.StepLR(opt, 2) if schedule else None
        else:
            opt = mixedprec.optim.AdamW(model.parameters())
            scaler = GradScaler("cpu")
            sched = mixedprec.optim.lr_scheduler.StepLR(opt, 2) if schedule else None

        def train_step(x, y):
            loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            return loss

        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        train_step(x, y)
        explained = torch._dynamo.explain(train_step)(x, y)
        counts[kind] = (explained.graph_count, explained.graph_break_count)
    assert counts["mixedprec"][0] <= counts["torch"][0], counts
    assert counts["mixedprec"][1] <= counts["torch"][1], counts


@pytest.mark.parametrize("name", ["growth_factor", "backoff_factor"])
def test_grad_scaler_factor_of_one_is_one_rule(name):
    """torch asserts growth_factor > 1 and backoff_factor < 1 at construction; the
    constructor and the setters refuse 1.0 alike, naming the argument; a disabled
    scaler takes it (it never uses it)."""
    with pytest.raises(ValueError, match=name):
        GradScaler("cpu", **{name: 1.0})
    scaler = GradScaler("cpu")
    with pytest.raises(ValueError, match=name):
        getattr(scaler, f"set_{name}")(1.0)
    assert getattr(scaler, f"get_{name}")() == (2.0 if name == "growth_factor" else 0.5)
    assert getattr(GradScaler("cpu", enabled=False, **{name: 1.0}), f"get_{name}")() == 1.0


def test_skip_on_host_leaves_an_overflowing_step_uncalled(monkeypatch):
    """skip_on_host=True: the optimizer (which skips on the device) is not called on an
    overflowing step, the gradients are checked once per step (not again in torch's
    step), and parameters, optimizer state and scale end as without it."""
    from mixedprec import grads as grads_module

    runs = {}
    for skip_on_host in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = mixedprec.optim.AdamW(model.parameters(), lr=0.1)
        calls = []
        original = opt.step
        monkeypatch.setattr(opt, "step", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
        scaler = GradScaler("cpu", init_scale=2.0**4, skip_on_host=skip_on_host)
        checks = []
        check = grads_module.check_finite_
        monkeypatch.setattr(grads_module, "check_finite_",
                            lambda *a, **k: (checks.append(1), check(*a, **k))[1])
        for step in range(5):
            opt.zero_grad()
            loss = model(torch.full((2, 4), float(step + 1))).sum()
            scaler.scale(loss * (math.inf if step in (1, 3) else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
        monkeypatch.undo()
        assert len(checks) == 5
        assert len(calls) == (3 if skip_on_host else 5)
        runs[skip_on_host] = (model.state_dict(), opt.state_dict()["state"],
                              scaler.state_dict())
    (m0, s0, c0), (m1, s1, c1) = runs[False], runs[True]
    assert c0 == c1 and c1["scale"] == 2.0**2
    for k in m0:
        assert torch.equal(m0[k], m1[k]), k
    for i in s0:
        for k in s0[i]:
            assert torch.equal(s0[i][k], s1[i][k]), (i, k)
    with pytest.raises(TypeError, match="skip_on_host"):
        GradScaler("cpu", skip_on_host=1)


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
def test_a_step_that_raises_leaves_no_scale_on_the_optimizer(device, clip):
    """scaler.step(opt) whose optimizer step raises (a negative lr, refused before any
    update): torch's step deletes opt.grad_scale and opt.found_inf only after the step
    returns, so they stayed, and the retried step divided the gradients by the scale
    twice (failed before its fix). The retry, with the lr mended, steps as
    torch.optim.SGD under torch's scaler where nothing raised, the clip included."""
    model, ref = make_model(device), make_model(device)
    opt = mixedprec.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = GradScaler(device, init_scale=2.0**10)
    ref_scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    for step in range(4):
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            s.scale(loss_of(m, step)).backward()
            if clip and s is scaler:
                s.clip_grad_norm_(o, 0.05)
            elif clip:
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        if step == 1:
            before = full_snapshot(model, opt)
            opt.param_groups[0]["lr"] = -1.0
            with pytest.raises(ValueError, match="lr"):
                scaler.step(opt)
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            assert_same_snapshot(full_snapshot(model, opt), before, "after the error")
            opt.param_groups[0]["lr"] = 0.1
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TIGHT, msg=f"step {step}")
