"""mixedprec.optim's SGD, Adam and AdamW as torch.optim.Optimizer objects: many steps on a
small model against torch.optim (fp32 params, and fp16/bf16 models over fp32 masters),
param groups, LR schedulers, add_param_group, state_dict round trips and load errors,
the grad_scale / found_inf hand-off a GradScaler uses and the op call kept from the last
step; gradients with other strides, channels_last and dtype round trips (each of these
last tests failed before its fix). What only Apex's FusedSGD and FusedAdam do (their
arguments, zero_grad, float64 and sparse refusals, Adam without bias correction), and
that they step as these classes: compat/test_fused_optimizers.py."""

import collections
import copy
import io

import pytest
import torch
from helpers import (
    DAMPENED_FIRST_STEP,
    TOLERANCES,
    assert_bitwise_equal,
    assert_same_snapshot,
    backward,
    full_snapshot,
    make_model,
    named_snapshot,
    torch_optimizer,
)
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from mixedprec import optim
from mixedprec.masters import join_remainder
from mixedprec.optim.state import ParamState, ParamStates

STEPS = 30
TIGHT = TOLERANCES[torch.float32]  # fp32 math against fp32 torch.optim: rtol 1e-5, atol 1e-6

# (model dtype, master mode): fp32 params have no master in either mode
MODEL_DTYPES = [
    pytest.param(torch.float32, "none", id="fp32"),
    pytest.param(torch.float16, "fp32", id="fp16-masters"),
    pytest.param(torch.bfloat16, "fp32", id="bf16-masters"),
]
HALF_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]

SGD_CONFIGS = [
    pytest.param({"lr": 0.1}, id="plain"),
    pytest.param({"lr": 0.1, "weight_decay": 1e-2}, id="weight_decay"),
    pytest.param({"lr": 0.05, "momentum": 0.9}, id="momentum"),
    pytest.param({"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-2},
                 id="dampening"),
    pytest.param({"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
                 id="nesterov"),
]
ADAM_CONFIGS = [
    pytest.param(optim.Adam, {"lr": 1e-2}, id="adam"),
    pytest.param(optim.Adam, {"lr": 1e-2, "weight_decay": 1e-2}, id="adam_l2"),
    pytest.param(optim.AdamW, {"lr": 1e-2, "weight_decay": 1e-1}, id="adamw"),
    pytest.param(optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6,
                               "weight_decay": 1e-2}, id="adamw_betas"),
]
# One representative configuration of each optimizer, for the behaviour tests.
OPTIMIZERS = [
    pytest.param(optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}, id="sgd"),
    pytest.param(optim.AdamW, {"lr": 1e-2, "weight_decay": 1e-2}, id="adamw"),
]


# --- helpers.make_model: its loss and its torch.optim twin -------------------------------

def fp32_twin(model):
    """An fp32 copy of `model` for torch.optim (the masters' starting values)."""
    return copy.deepcopy(model).float()


def feed_grads(model, twin):
    """twin's gradients := model's, cast to fp32 (None stays None)."""
    for p, tp in zip(model.parameters(), twin.parameters()):
        tp.grad = None if p.grad is None else p.grad.detach().float()


def train(model, opt, twin, twin_opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        twin_opt.zero_grad(set_to_none=True)
        backward(model, step)
        feed_grads(model, twin)
        opt.step()
        twin_opt.step()


def assert_tracks_torch(model, opt, twin, twin_opt, tol=TIGHT):
    """Masters (or fp32 params) and optimizer state against torch.optim's; the model
    is exactly the masters cast to its dtype."""
    for p, tp in zip(model.parameters(), twin.parameters()):
        state, twin_state = opt.state[p], twin_opt.state[tp]
        if p.dtype == torch.float32:
            assert "master_param" not in state
            torch.testing.assert_close(p.detach(), tp.detach(), **tol)
        else:
            master = state["master_param"]
            assert master.dtype == torch.float32
            torch.testing.assert_close(master, tp.detach(), **tol)
            assert_bitwise_equal(p.detach(), master.to(p.dtype))
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in twin_state:
                assert state[key].dtype == torch.float32, key
                torch.testing.assert_close(state[key], twin_state[key], **tol, msg=key)


def param_steps(opt):
    """Adam's step counts (one per parameter, as torch's), group by group; 0 for a
    parameter not stepped yet."""
    return [[opt.state[p]["step"].item() if "step" in opt.state.get(p, {}) else 0.0
             for p in g["params"]] for g in opt.param_groups]


# --- many steps against torch.optim -----------------------------------------------------

@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_sgd_tracks_torch_sgd(device, dtype, master, config):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = optim.SGD(model.parameters(), master=master, **config)
    twin_opt = torch_optimizer(optim.SGD, twin.parameters(), config)

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    if dtype != torch.float32:  # and the model against the reference, within one rounding
        for p, tp in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.detach(), tp.detach().to(dtype))


@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("cls, config", ADAM_CONFIGS)
def test_adam_tracks_torch_adam(device, dtype, master, cls, config):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master=master, **config)
    twin_opt = torch_optimizer(cls, twin.parameters(), config)

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    for p in model.parameters():
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.device.type == device and step.numel() == 1
        assert step.item() == STEPS
    if dtype != torch.float32:
        for p, tp in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.detach(), tp.detach().to(dtype))


@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_param_groups_with_different_lr(device, dtype, master, cls, kwargs):
    model = make_model(device, dtype)
    twin = fp32_twin(model)

    def groups(m):
        return [{"params": m.fc1.parameters()},
                {"params": m.fc2.parameters(), "lr": kwargs["lr"] / 7, "weight_decay": 0.0}]

    opt = cls(groups(model), master=master, **kwargs)
    twin_opt = torch_optimizer(cls, groups(twin), kwargs)
    assert opt.param_groups[1]["lr"] == kwargs["lr"] / 7

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    if cls is optim.AdamW:
        assert param_steps(opt) == [[STEPS] * 2, [STEPS] * 2]


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_group_mixing_fp32_and_half_params(device, half, cls, kwargs):
    """fc1 in fp16/bf16 (over masters), fc2 in fp32 (its own master), one group."""
    model = make_model(device, half, fc2_dtype=torch.float32)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    assert len(opt.param_groups) == 1

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    assert "master_param" in opt.state[model.fc1.weight]
    assert "master_param" not in opt.state[model.fc2.weight]
    if cls is optim.AdamW:  # each count incremented once per step
        assert param_steps(opt) == [[STEPS] * 4]


@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_params_without_grads_are_left_alone(device, dtype, master, cls, kwargs):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master=master, **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    frozen = model.fc2.bias

    for step in range(12):
        opt.zero_grad(set_to_none=True)
        twin_opt.zero_grad(set_to_none=True)
        backward(model, step)
        if step % 3 != 2:  # fc2.bias has no gradient in two steps out of three
            frozen.grad = None
        feed_grads(model, twin)
        before = named_snapshot([frozen, opt.state[frozen]])
        opt.step()
        twin_opt.step()
        if frozen.grad is None:
            after = named_snapshot([frozen, opt.state[frozen]])
            assert_same_snapshot(after, before, f"step {step}")

    # torch.optim skips such params too, and counts Adam's steps per parameter as these
    # classes do: the whole run agrees
    assert_tracks_torch(model, opt, twin, twin_opt)
    if cls is optim.AdamW:
        assert param_steps(opt) == [[12, 12, 12, 4]]


class _RecordOps(TorchDispatchMode):
    """Records the ops dispatched while active, and the in-place ATen ops that write
    into one of `watched` (by storage)."""

    def __init__(self, watched):
        super().__init__()
        self.watched = {t.untyped_storage().data_ptr() for t in watched}
        self.ops = []
        self.writes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}::{func.overloadpacket.__name__}"
        self.ops.append(name)
        if (func.namespace == "aten" and name.endswith("_") and args
                and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage().data_ptr() in self.watched):
            self.writes.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_one_fused_call_per_group_and_step(device, cls, kwargs):
    """Masters, moments and the model params of a group are updated by one op call:
    nothing else writes the model (no separate copy of the masters into it)."""
    model = make_model(device, torch.float16, fc2_dtype=torch.float32)
    extra = nn.Linear(4, 2).to(device=device, dtype=torch.bfloat16)
    opt = cls([{"params": model.parameters()}, {"params": extra.parameters(), "lr": 1e-3}],
              master="fp32", **kwargs)
    op = "mixedprec::fused_sgd_" if cls is optim.SGD else "mixedprec::fused_adam_"
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        extra(torch.ones(3, 4, device=device, dtype=torch.bfloat16)).float().sum().backward()
        with _RecordOps(list(model.parameters()) + list(extra.parameters())) as recorder:
            opt.step()
        assert [o for o in recorder.ops if o.startswith("mixedprec::")] == [op, op], step
        assert recorder.writes == [], f"step {step}: the model written by {recorder.writes}"


# --- torch.optim.Optimizer behaviour --------------------------------------------------

@pytest.mark.parametrize("scheduler", ["step", "lambda"])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_lr_scheduler(device, cls, kwargs, scheduler):
    def make_scheduler(opt):
        if scheduler == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.3)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1.0 + epoch))

    model = make_model(device, torch.float16)
    unscheduled = copy.deepcopy(model)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    plain_opt = cls(unscheduled.parameters(), master="fp32", **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    sched, twin_sched = make_scheduler(opt), make_scheduler(twin_opt)

    for step in range(12):
        for m, o in ((model, opt), (unscheduled, plain_opt)):
            o.zero_grad()
            backward(m, step)
            o.step()
        feed_grads(model, twin)
        twin_opt.step()
        sched.step()
        twin_sched.step()
        assert opt.param_groups[0]["lr"] == twin_opt.param_groups[0]["lr"]

    assert opt.param_groups[0]["lr"] < kwargs["lr"] / 2
    assert_tracks_torch(model, opt, twin, twin_opt)
    # The schedule changed the update.
    assert not torch.allclose(model.fc1.weight, unscheduled.fc1.weight)


@pytest.mark.parametrize("scheduler", ["one_cycle", "cyclic", "swa"])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS + [
    pytest.param(optim.Adam, {"lr": 1e-2}, id="adam")])
def test_schedules_that_rewrite_momentum_and_betas(device, cls, kwargs, scheduler):
    """torch's OneCycleLR and CyclicLR rewrite each group's momentum (SGD) or betas[0]
    (Adam) at every step, SWALR anneals lr towards swa_lr after a first schedule: the
    op call kept from the previous step must take each new value, as torch.optim does
    (PyTorch's test_lrscheduler.py only checks the values written, not the steps)."""
    def make_schedulers(opt):
        if scheduler == "one_cycle":
            return [torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=kwargs["lr"], total_steps=12, base_momentum=0.8,
                max_momentum=0.95)]
        if scheduler == "cyclic":
            return [torch.optim.lr_scheduler.CyclicLR(
                opt, base_lr=kwargs["lr"] / 10, max_lr=kwargs["lr"], step_size_up=3,
                base_momentum=0.8, max_momentum=0.95)]
        return [torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8),
                torch.optim.swa_utils.SWALR(opt, swa_lr=kwargs["lr"] / 5, anneal_epochs=3)]

    model = make_model(device, torch.bfloat16)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    scheds, twin_scheds = make_schedulers(opt), make_schedulers(twin_opt)
    momentum = "betas" if "betas" in opt.defaults else "momentum"
    seen = set()
    for step in range(12):
        opt.zero_grad()
        backward(model, step)
        feed_grads(model, twin)
        opt.step()
        twin_opt.step()
        # SWALR takes over from the first schedule after 5 steps
        which = 0 if len(scheds) == 1 or step < 5 else 1
        scheds[which].step()
        twin_scheds[which].step()
        group, twin_group = opt.param_groups[0], twin_opt.param_groups[0]
        assert group["lr"] == twin_group["lr"]
        assert group[momentum] == twin_group[momentum]
        seen.add((group["lr"], str(group[momentum])))
    assert len(seen) > 6  # (the schedule moved lr, and momentum or beta1 with it)
    assert_tracks_torch(model, opt, twin, twin_opt)


@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_add_param_group_later(device, dtype, master, cls, kwargs):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = cls(model.fc1.parameters(), master=master, **kwargs)
    twin_opt = torch_optimizer(cls, twin.fc1.parameters(), kwargs)
    fc2_before = [p.detach().clone() for p in model.fc2.parameters()]

    for step in range(5):
        model.zero_grad(set_to_none=True)
        backward(model, step)
        feed_grads(model, twin)
        opt.step()
        twin_opt.step()
    for p, before in zip(model.fc2.parameters(), fc2_before):  # not in the optimizer yet
        assert_bitwise_equal(p.detach(), before)

    new_group = {"lr": kwargs["lr"] / 3, "weight_decay": 0.0}
    opt.add_param_group(dict(params=list(model.fc2.parameters()), **new_group))
    twin_opt.add_param_group(dict(params=list(twin.fc2.parameters()), **new_group))
    for p in model.fc2.parameters():  # state, masters included, starts at the first step
        assert p not in opt.state or not opt.state[p]

    for step in range(5, 15):
        model.zero_grad(set_to_none=True)
        backward(model, step)
        feed_grads(model, twin)
        opt.step()
        twin_opt.step()
        if step == 5 and master == "fp32":  # the masters were taken before the update
            assert all("master_param" in opt.state[p] for p in model.fc2.parameters())

    assert_tracks_torch(model, opt, twin, twin_opt)
    if cls is optim.AdamW:
        assert param_steps(opt) == [[15, 15], [10, 10]]


# --- state_dict ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_state_dict_round_trip_resumes_bit_for_bit(device, dtype, master, cls, kwargs):
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master=master, **kwargs)
    for step in range(7):
        opt.zero_grad()
        backward(model, step)
        opt.step()

    saved = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        if master == "fp32":
            assert_bitwise_equal(saved["state"][i]["master_param"], opt.state[p]["master_param"])
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed_model = copy.deepcopy(model)
    resumed = cls(resumed_model.parameters(), master=master, **kwargs)
    resumed.load_state_dict(loaded)

    for p, rp in zip(model.parameters(), resumed_model.parameters()):
        for key, value in opt.state[p].items():
            assert_bitwise_equal(resumed.state[rp][key], value, msg=key)  # fp32 stays fp32
    for step in range(7, 12):
        for m, o in ((model, opt), (resumed_model, resumed)):
            o.zero_grad()
            backward(m, step)
            o.step()

    assert_same_snapshot(full_snapshot(resumed_model, resumed), full_snapshot(model, opt))
    assert [{k: v for k, v in g.items() if k not in ("params", "step")}
            for g in resumed.param_groups] == [
        {k: v for k, v in g.items() if k not in ("params", "step")} for g in opt.param_groups]
    if cls is optim.AdamW:
        assert param_steps(resumed) == [[12.0] * 4]


def _trained(device, cls, kwargs, steps):
    model = make_model(device, torch.float16)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    for step in range(steps):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    return model, opt


def _bad_state_dict(sd, defect, key):
    """Copy of `sd` with one defect; `key` is the moment of the optimizer."""
    sd = copy.deepcopy(sd)
    if defect == "extra_group":
        sd["param_groups"].append(dict(sd["param_groups"][0], params=[100]))
    elif defect == "missing_param":
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    elif defect == "master_shape":
        sd["state"][0]["master_param"] = sd["state"][0]["master_param"][:-1].clone()
    elif defect == "moment_shape":
        sd["state"][2][key] = sd["state"][2][key].reshape(1, -1).clone()
    elif defect == "moment_fp64":  # (wider than kept: 16-bit moments would load, widened)
        sd["state"][1][key] = sd["state"][1][key].double()
    elif defect == "master_bf16":
        sd["state"][3]["master_param"] = sd["state"][3]["master_param"].bfloat16()
    return sd


@pytest.mark.parametrize("defect", ["extra_group", "missing_param", "master_shape",
                                    "moment_shape", "moment_fp64", "master_bf16"])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_load_state_dict_errors_change_nothing(device, cls, kwargs, defect):
    model, opt = _trained(device, cls, kwargs, steps=3)
    key = "momentum_buffer" if cls is optim.SGD else "exp_avg"
    bad = _bad_state_dict(opt.state_dict(), defect, key)
    for step in range(3, 5):  # the optimizer moves on: a partial load would show
        opt.zero_grad()
        backward(model, step)
        opt.step()
    before = full_snapshot(model, opt)
    groups_before = [{k: v for k, v in g.items() if k not in ("params", "step")}
                     for g in opt.param_groups]
    params_before = [list(g["params"]) for g in opt.param_groups]

    with pytest.raises(ValueError):
        opt.load_state_dict(bad)

    assert_same_snapshot(full_snapshot(model, opt), before, defect)
    assert [{k: v for k, v in g.items() if k not in ("params", "step")}
            for g in opt.param_groups] == groups_before
    assert all(a is b for g, ps in zip(opt.param_groups, params_before)
               for a, b in zip(g["params"], ps))


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_load_state_dict_runs_the_optimizer_hooks(cls, kwargs):
    """torch.optim.Optimizer.load_state_dict runs the registered pre- and post-hooks."""
    _, opt = _trained("cpu", cls, kwargs, steps=2)
    calls = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))

    opt.load_state_dict(opt.state_dict())

    assert calls == ["pre", "post"]


# --- torch's step hooks and profiler range ----------------------------------------------
# torch.optim.Optimizer wraps each class's step to run the step hooks inside a profiler
# range; mixedprec's wrapper (torch_path.hook_step) enters torch's only when there is a
# hook, a profiler or a trace, the same calls in the same order.
HOOKED = OPTIMIZERS + [pytest.param(optim.LAMB, {"lr": 1e-2}, id="lamb")]  # (its own step)


def _hook_calls(opt, steps=2):
    calls = []
    handles = [
        register_optimizer_step_pre_hook(
            lambda o, a, k: calls.append(("global pre", type(o).__name__))),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", type(o).__name__))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", type(o).__name__))),
        register_optimizer_step_post_hook(
            lambda o, a, k: calls.append(("global post", type(o).__name__))),
    ]
    try:
        for _ in range(steps):
            opt.step()
    finally:
        for handle in handles:
            handle.remove()
    return calls


@pytest.mark.parametrize("cls, kwargs", HOOKED)
def test_step_hooks_run_once_a_step_as_torchs(cls, kwargs):
    model, opt = _trained("cpu", cls, kwargs, steps=1)
    twin = torch.optim.SGD(fp32_twin(model).parameters(), lr=0.1)
    backward(model, 1)
    for p in twin.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)

    name = cls.__name__
    assert _hook_calls(opt) == [(kind, name) for kind, _ in _hook_calls(twin)]
    assert [kind for kind, _ in _hook_calls(twin, steps=1)] == [
        "global pre", "pre", "post", "global post"]


@pytest.mark.parametrize("cls, kwargs", HOOKED)
def test_a_subclass_step_calling_the_base_step_runs_the_hooks_once(cls, kwargs):
    """A subclass whose step calls ``super().step()`` (the Apex faces, a user's class),
    with the base class also in use in the process (so its step is wrapped too): the
    hooks and the profiler range once a step, the subclass's (torch's wrappers run them
    at both levels)."""
    sub = type(f"My{cls.__name__}", (cls,), {"step": lambda self, closure=None:
                                                 super(sub, self).step(closure)})
    _trained("cpu", cls, kwargs, steps=1)  # the base class's step wrapped
    _, opt = _trained("cpu", sub, kwargs, steps=1)
    assert _hook_calls(opt, steps=1) == [
        ("global pre", sub.__name__), ("pre", sub.__name__), ("post", sub.__name__),
        ("global post", sub.__name__)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [event.name for event in prof.events() if event.name.startswith("Optimizer.step#")]
    assert names == [f"Optimizer.step#{sub.__name__}.step"]


@pytest.mark.parametrize("cls, kwargs", HOOKED)
def test_the_profiler_records_each_step_as_torchs(cls, kwargs):
    _, opt = _trained("cpu", cls, kwargs, steps=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            opt.step()
    names = [event.name for event in prof.events()]
    assert names.count(f"Optimizer.step#{cls.__name__}.step") == 3


@pytest.mark.parametrize("cls, kwargs", HOOKED)
def test_a_profiler_of_every_thread_still_sees_the_step(cls, kwargs, monkeypatch):
    """Without a profiler of this thread (``_profiler_enabled``: thread-local), the step
    runs in torch's fast range, which a profiler of every thread (an on-demand one)
    records: here this thread's profiler, hidden from the wrapper's check."""
    _, opt = _trained("cpu", cls, kwargs, steps=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        monkeypatch.setattr(torch._C._autograd, "_profiler_enabled", lambda: False)
        opt.step()
        monkeypatch.undo()
    names = [event.name for event in prof.events()]
    assert names.count(f"Optimizer.step#{cls.__name__}.step") == 1


@pytest.mark.parametrize("cls, kwargs", HOOKED)
def test_a_step_enters_no_profiler_range_unless_something_records(cls, kwargs, monkeypatch):
    """torch's wrapper enters a record_function at every step (host time); here only with a
    hook registered (or a profiler: above)."""
    _, opt = _trained("cpu", cls, kwargs, steps=1)
    entered = []
    real = torch.autograd.profiler.record_function

    def counted(name, *args):
        entered.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counted)
    opt.step()
    assert entered == []
    handle = opt.register_step_post_hook(lambda *a: None)
    opt.step()
    handle.remove()
    opt.step()
    assert entered == [f"Optimizer.step#{cls.__name__}.step"]


# --- grad_scale and found_inf, as a GradScaler sets them -------------------------------

def _skip_cases():
    cases = []
    layouts = ((torch.float32, "none", "fp32"), (torch.float16, "none", "fp16-params"),
               (torch.float16, "fp32", "fp16-masters"), (torch.bfloat16, "fp32", "bf16-masters"))
    configs = [(optim.SGD, c.values[0], c.id) for c in SGD_CONFIGS] + [
        (c.values[0], c.values[1], c.id) for c in ADAM_CONFIGS[1:3]]
    for cls, config, config_id in configs:
        for dtype, master, name in layouts:
            cases.append(pytest.param(cls, config, dtype, master,
                                      id=f"{cls.__name__}-{config_id}-{name}"))
    return cases


@pytest.mark.parametrize("cls, kwargs, dtype, master", _skip_cases())
def test_found_inf_skips_the_step(device, cls, kwargs, dtype, master):
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master=master, **kwargs)
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    opt.zero_grad()
    backward(model, 3, scale=64.0)
    opt.grad_scale = torch.full((), 64.0, device=device)
    opt.found_inf = torch.full((), 1.0, device=device)
    before = full_snapshot(model, opt)

    opt.step()

    assert_same_snapshot(full_snapshot(model, opt), before, "after a skipped step")
    # The counterpart: the same step with found_inf = 0 is taken.
    opt.found_inf = torch.full((), 0.0, device=device)
    opt.step()
    assert not torch.equal(model.fc1.weight, before["param0"])


# fp16/bf16 gradients are scaled exactly only by powers of two.
GRAD_SCALES = [
    pytest.param(torch.float32, "none", 1024.0, id="fp32"),
    pytest.param(torch.float32, "none", 3000.0, id="fp32-not-power-of-2"),
    pytest.param(torch.float16, "fp32", 1024.0, id="fp16-masters"),
    pytest.param(torch.bfloat16, "fp32", 1024.0, id="bf16-masters"),
]


@pytest.mark.parametrize("dtype, master, grad_scale", GRAD_SCALES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_grad_scale_unscales_in_the_update(device, cls, kwargs, dtype, master, grad_scale):
    plain_model = make_model(device, dtype)
    scaled_model = copy.deepcopy(plain_model)
    plain = cls(plain_model.parameters(), master=master, **kwargs)
    scaled = cls(scaled_model.parameters(), master=master, **kwargs)

    for step in range(6):
        plain.zero_grad()
        scaled.zero_grad()
        backward(plain_model, step)
        for p, sp in zip(plain_model.parameters(), scaled_model.parameters()):
            sp.grad = (p.grad.float() * grad_scale).to(dtype)
        scaled.grad_scale = torch.full((), grad_scale, device=device)
        scaled.found_inf = torch.full((), 0.0, device=device)
        plain.step()
        scaled.step()

    for p, sp in zip(plain_model.parameters(), scaled_model.parameters()):
        a, b = plain.state[p], scaled.state[sp]
        if master == "fp32":
            torch.testing.assert_close(b["master_param"], a["master_param"], **TIGHT)
            assert_bitwise_equal(sp.detach(), b["master_param"].to(dtype))
        else:
            torch.testing.assert_close(sp.detach(), p.detach(), **TIGHT)
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in a:
                torch.testing.assert_close(b[key], a[key], **TIGHT, msg=key)
    if cls is optim.AdamW:
        assert param_steps(scaled) == param_steps(plain) == [[6.0] * 4]


@pytest.mark.parametrize("cls, config", [
    pytest.param(optim.SGD, c.values[0], id=f"sgd-{c.id}",
                 marks=[pytest.mark.xfail(strict=True, reason=DAMPENED_FIRST_STEP)]
                 if c.id == "dampening" else [])
    for c in SGD_CONFIGS[2:]
] + [pytest.param(c.values[0], c.values[1], id=c.id) for c in ADAM_CONFIGS[1:3]])
def test_skipped_first_step_leaves_no_trace(device, cls, config):
    """A GradScaler often skips the very first step (the initial scale overflows).
    torch.optim then never saw a step, so the next step is its first: state such as
    the momentum buffer must start as it would have without the skipped step."""
    model = make_model(device, torch.float16)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master="fp32", **config)
    twin_opt = torch_optimizer(cls, twin.parameters(), config)

    opt.zero_grad()
    backward(model, 0)
    opt.grad_scale = torch.full((), 1.0, device=device)
    opt.found_inf = torch.full((), 1.0, device=device)
    opt.step()  # skipped; torch.optim does not step at all
    del opt.grad_scale, opt.found_inf

    train(model, opt, twin, twin_opt, 1, start=1)
    for p, tp in zip(model.parameters(), twin.parameters()):  # the first real step
        for key, value in twin_opt.state[tp].items():
            if key != "step":
                torch.testing.assert_close(opt.state[p][key], value, **TIGHT,
                                           msg=lambda m, key=key: f"{key} after the first "
                                           f"step taken (the one before was skipped): {m}")
    train(model, opt, twin, twin_opt, 9, start=2)

    assert_tracks_torch(model, opt, twin, twin_opt)
    if cls is not optim.SGD:  # the skipped step not counted
        assert param_steps(opt) == [[10.0] * 4]


def test_skipped_first_step_with_dampening_starts_from_a_zero_buffer(device):
    """The documented semantics behind DAMPENED_FIRST_STEP, exactly."""
    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.25)
    p.grad = torch.full((4,), 2.0, device=device)
    opt.grad_scale = torch.full((), 1.0, device=device)
    opt.found_inf = torch.full((), 1.0, device=device)
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert_bitwise_equal(p.detach(), torch.ones(4, device=device))
    assert_bitwise_equal(opt.state[p]["momentum_buffer"], torch.zeros(4, device=device))

    opt.step()
    buf = torch.full((4,), 0.75 * 2.0, device=device)  # 0.9 * 0 + (1 - 0.25) * g
    assert_bitwise_equal(opt.state[p]["momentum_buffer"], buf)
    assert_bitwise_equal(p.detach(), torch.ones(4, device=device) - 0.1 * buf)


# --- the op call kept from the last step -------------------------------------------------
#
# After a step, each param group keeps its op call's lists (masters, moments, buffers,
# model params); the next step reuses them and only gathers the gradients. Whatever
# those lists depend on must send the step back through the full path.

def full_path_twin(cls, kwargs, model, master):
    """A copy of `model` and an optimizer that forgets its kept op call before every
    step, so that every step takes the full path."""
    twin = copy.deepcopy(model)
    opt = cls(twin.parameters(), master=master, **kwargs)
    step = opt.step

    def full_step(*args, **kw):
        opt.plans.invalidate()
        return step(*args, **kw)
    opt.step = full_step
    return twin, opt


def lockstep(pairs, steps, start=0, between=None):
    """Trains every (model, optimizer) pair on the same batches; `between(step)` runs
    before each step's backward."""
    for step in range(start, start + steps):
        for model, opt in pairs:
            opt.zero_grad(set_to_none=True)
            if between is not None:
                between(step, model, opt)
            backward(model, step)
            opt.step()


@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_equals_the_full_path(device, cls, kwargs, dtype, master):
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master=master, **kwargs)
    twin, twin_opt = full_path_twin(cls, kwargs, model, master)

    def vary(step, m, o):  # an LR schedule and a frozen bias at some steps
        o.param_groups[0]["lr"] = kwargs["lr"] * (1 + step % 3)
        if step in (4, 5):
            m.fc2.bias.requires_grad_(False)
        else:
            m.fc2.bias.requires_grad_(True)
    lockstep([(model, opt), (twin, twin_opt)], 10, between=vary)

    assert opt.plans.plans, "the steps kept their op call"
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_reads_contiguous_gradients_of_other_strides(device, cls, kwargs):
    # A contiguous gradient whose strides differ from its parameter's only at a
    # dimension of size 1 is read as it is, by the full path and by the kept op call:
    # the steps after the first (SGD's: the second) reuse it, as with the parameter's
    # strides.
    p = torch.nn.Parameter(torch.randn(1, 5, device=device))
    twin = torch.nn.Parameter(p.detach().clone())
    opt, twin_opt = cls([p], **kwargs), cls([twin], **kwargs)
    for step in range(4):
        g = torch.randn(1, 5, device=device)
        p.grad = torch.empty_strided((1, 5), (1, 1), device=device).copy_(g)
        twin.grad = g
        assert p.grad.stride() != p.stride() and p.grad.is_contiguous()
        kept = opt.plans.planned(opt.param_groups, opt.state, opt.master, opt._plan_holds)
        assert (kept is not None) == (step >= 2) or step == 1, step  # (SGD's buffers start)
        opt.step()
        twin_opt.step()
        assert_bitwise_equal(p.detach(), twin.detach())


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_holds_its_tensor_lists_boxed_once(device, cls, kwargs):
    # torch.ops hands a torch.ScriptList to the op as it is, where a Python list is
    # converted tensor by tensor at every call: the kept lists of tensors are
    # ScriptLists, of the very tensors that the model and the state hold.
    model = make_model(device, torch.float16)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    lockstep([(model, opt)], 2)
    held = {id(p) for p in model.parameters()} | {
        id(v) for state in opt.state.values() for v in state.values()
        if isinstance(v, torch.Tensor)}
    boxed = []

    def walk(lists):
        if isinstance(lists, tuple):
            for item in lists:
                walk(item)
        elif isinstance(lists, torch.ScriptList):
            boxed.append(lists)
        elif isinstance(lists, list):
            assert not any(isinstance(t, torch.Tensor) for t in lists), "a list of tensors"
    for plan in opt.plans.plans.values():
        walk(plan.lists)
    assert len(boxed) >= 3  # (masters, moments or buffers, model params)
    assert all(id(t) in held for lst in boxed for t in lst)


def _contiguous_grad(p):
    p.grad = torch.randn(p.shape, device=p.device, dtype=p.dtype)


def _other_dtype_grad(p):
    p.grad_dtype = None  # (torch 2.11 refuses a gradient of another dtype without it)
    p.grad = p.grad.to(torch.float64 if p.dtype == torch.float32 else torch.float32)


def _new_storage(p):
    p.data = p.data.clone()


def _write(p):
    with torch.no_grad():
        p.mul_(0.5)


# What changes between two steps (applied to params[1]), and whether the plan's native
# check still hands the gradients back by itself (else the Python check answers).
PLAN_CHANGES = {
    "nothing": (lambda params, masters: None, True),
    "a gradient gone": (lambda params, masters: setattr(params[1], "grad", None), False),
    "a gradient added": (lambda params, masters: _contiguous_grad(params[2]), False),
    "a gradient's dtype": (lambda params, masters: _other_dtype_grad(params[1]), False),
    "a gradient transposed": (lambda params, masters: setattr(
        params[1], "grad", torch.randn_like(params[1]).t().contiguous().t()), False),
    "a channels_last gradient made contiguous": (
        lambda params, masters: _contiguous_grad(params[3]), False),
    "a sparse gradient": (lambda params, masters: setattr(
        params[1], "grad", params[1].grad.to_sparse()), False),
    "new storage": (lambda params, masters: _new_storage(params[1]), False),
    "a write outside a step": (lambda params, masters: _write(params[1]), False),
    "a master's gradient": (lambda params, masters: setattr(
        masters[0], "grad", torch.ones_like(masters[0])), False),
    "a parameter replaced by a tensor without storage": (
        lambda params, masters: params.__setitem__(1, torch.empty(
            params[1].shape, dtype=params[1].dtype, device="meta")), False),
}


@pytest.mark.parametrize("dtype, master", MODEL_DTYPES)
@pytest.mark.parametrize("change", list(PLAN_CHANGES))
def test_the_plans_native_check_answers_as_the_python_check(device, dtype, master, change):
    """A plan's native check (ops.PlanCheck) hands back the gradients only where the
    Python check's list comparisons would have, the very gradient tensors; anything
    else is the Python check's to answer (a plan that no longer holds, or a check
    gradient by gradient): the step's answer is the same with and without it."""
    from mixedprec.optim import plans
    params = [nn.Parameter(torch.randn(shape, device=device).to(dtype))
              for shape in ((4, 3), (3, 5), (2,), (2, 3, 2, 2))]
    params[3].data = params[3].data.contiguous(memory_format=torch.channels_last)
    opt = optim.SGD(params, lr=0.1, momentum=0.9, master=master)
    for _ in range(2):
        for p in params[:2] + params[3:]:
            p.grad = torch.randn_like(p)  # (params[3]'s: channels_last, as it is)
        opt.step()
    plan = opt.plans.plans[0]
    assert plan.check is not None and not plan.all_stepped
    assert not params[3].is_contiguous() and params[3].grad.is_contiguous(
        memory_format=torch.channels_last)
    masters = plan.with_masters
    assert bool(masters) == (master == "fp32")
    if not masters and change == "a master's gradient":
        pytest.skip("no masters")
    group = list(params)
    mutate, native_holds = PLAN_CHANGES[change]
    mutate(group, masters)
    if change == "a write outside a step" and not masters:
        native_holds = True  # (without masters the versions are not compared)
    native = plan.check.gradients(group)
    assert (native is not None) == native_holds
    ours = plans._planned_gradients(group, plan)
    python = plans._planned_gradients(group, plan._replace(check=None))
    assert (ours is None) == (python is None)
    if ours is not None:
        assert ours[1] == python[1] and len(ours[0]) == len(python[0])
        assert all(a is b for a, b in zip(ours[0], python[0]))
    if native is not None:
        assert all(a is p.grad for a, p in zip(native, params[:2] + params[3:]))


def test_the_plans_native_check_is_left_out_for_tensor_subclasses():
    """Parameters of a tensor subclass (DTensor, fake tensors) keep their own dispatch:
    their plans have the Python check only, and step as before."""
    class Tagged(torch.Tensor):
        pass
    param = nn.Parameter(torch.randn(3).as_subclass(Tagged))
    plain = nn.Parameter(param.detach().clone().as_subclass(torch.Tensor))
    opt, twin_opt = optim.SGD([param], lr=0.1), optim.SGD([plain], lr=0.1)
    for _ in range(3):
        param.grad = torch.ones(3)
        plain.grad = torch.ones(3)
        opt.step()
        twin_opt.step()
    assert opt.plans.plans[0].check is None and twin_opt.plans.plans[0].check is not None
    assert _planned(opt) is not None
    assert_bitwise_equal(param.detach().as_subclass(torch.Tensor), plain.detach())


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_after_load_state_dict_and_add_param_group(device, cls, kwargs):
    model, other = make_model(device, torch.float16), make_model(device, torch.float16, seed=7)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    other_opt = cls(other.parameters(), master="fp32", **kwargs)
    lockstep([(model, opt)], 3)
    lockstep([(other, other_opt)], 5, start=100)

    # load_state_dict: the next step uses the loaded masters and moments.
    opt.load_state_dict(other_opt.state_dict())
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    lockstep([(model, opt), (other, other_opt)], 2, start=200)
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(other, other_opt))

    # add_param_group: the new group is stepped from the next step on.
    extra = nn.Parameter(torch.ones(4, device=device, dtype=torch.float16))
    opt.add_param_group({"params": [extra]})
    opt.zero_grad(set_to_none=True)
    backward(model, 300)
    extra.grad = torch.ones_like(extra)
    opt.step()
    assert not torch.equal(extra, torch.ones_like(extra))
    assert opt.state[extra]["master_param"].dtype == torch.float32


@pytest.mark.parametrize("dtype, master", MODEL_DTYPES + [
    pytest.param(torch.bfloat16, "none", id="bf16-none"),
    pytest.param(torch.bfloat16, "remainder", id="bf16-remainder")])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_after_a_parameter_is_written_outside_a_step(device, cls, kwargs, dtype,
                                                                  master):
    # An in-place write under no_grad (its version counter moves): with fp32 masters or
    # remainders the next step takes the full path, whose masters take the written
    # values (Masters.get, Masters.follow_lean); without, the op call is kept (it reads
    # the parameters as they are, and nothing it holds was made from their values).
    # Either way the steps are the full path's.
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master=master, **kwargs)
    twin, twin_opt = full_path_twin(cls, kwargs, model, master)
    lockstep([(model, opt), (twin, twin_opt)], 3)
    for m, o in ((model, opt), (twin, twin_opt)):
        with torch.no_grad():
            m.fc1.weight.mul_(0.5)
        o.zero_grad(set_to_none=True)
        backward(m, 3)
    kept = opt.plans.planned(opt.param_groups, opt.state, opt.master, opt._plan_holds)
    masters = any(state.get("master_param") is not None for state in opt.state.values())
    assert masters == (dtype != torch.float32 and master == "fp32")
    assert (kept is None) == (dtype != torch.float32 and master in ("fp32", "remainder"))
    opt.step()
    twin_opt.step()
    lockstep([(model, opt), (twin, twin_opt)], 2, start=4)
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))


@pytest.mark.parametrize("how", ["float", "load"])
@pytest.mark.parametrize("master", ["fp32", "remainder", "kahan"])
def test_a_model_cast_to_fp32_takes_its_masters_values(device, master, how):
    """A bf16 model cast to fp32 mid-run (``model.float()``), or resumed in fp32 from a
    bf16 run's state dicts: each parameter takes the exact value its optimizer kept
    (the fp32 master, the joined remainder, the Kahan sum), not its bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(16, 16).to(device, torch.bfloat16)
    opt = optim.AdamW(lin.parameters(), lr=1e-2, master=master)
    x = torch.randn(8, 16, generator=gen).to(device, torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        lin(x).float().square().mean().backward()
        opt.step()
    state = opt.state[lin.weight]
    exact = {"fp32": lambda: state["master_param"].clone(),
             "remainder": lambda: join_remainder(lin.weight.detach(), state["remainder"]),
             "kahan": lambda: lin.weight.detach().float() + state["kahan_comp"].float()
             }[master]()
    assert not torch.equal(exact, lin.weight.detach().float())  # (bits below bf16's)
    if how == "load":
        saved = {"model": lin.state_dict(), "opt": opt.state_dict()}
        lin = nn.Linear(16, 16).to(device)
        lin.load_state_dict(saved["model"])
        opt = optim.AdamW(lin.parameters(), lr=1e-2, master=master)
        opt.load_state_dict(saved["opt"])
    else:
        lin.float()
    opt.param_groups[0].update(lr=0.0, weight_decay=0.0)
    opt.zero_grad()
    lin(x.float()).square().mean().backward()
    opt.step()
    assert_bitwise_equal(lin.weight.detach(), exact)


def test_a_state_mapped_by_pytree_is_torchs_defaultdict():
    """torch's pytree walks optimizer.state as the dict it is (tree_leaves: its tensors)
    and maps it back to a defaultdict(dict), as torch.optim's state: a parameter with no
    state yet then steps."""
    from torch.utils._pytree import tree_leaves, tree_map

    ps = [nn.Parameter(torch.ones(4)) for _ in range(2)]
    opt = optim.AdamW(ps, lr=0.1)
    ps[0].grad = torch.ones(4)
    opt.step()
    assert len(tree_leaves(opt.state)) == 3  # step, exp_avg, exp_avg_sq
    opt.state = tree_map(torch.clone, opt.state)
    assert isinstance(opt.state, collections.defaultdict) and opt.state.default_factory is dict
    ps[1].grad = torch.ones(4)
    opt.step()
    assert set(opt.state[ps[1]]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("how", ["deepcopy", "load"])
def test_an_edit_before_the_first_step_after_a_copy_or_a_load_is_kept(device, how):
    """fp32 masters that the optimizer has not stepped with yet (a deepcopy of it, a
    state dict loaded): a parameter written before that first step (a pruning mask
    under no_grad) keeps the write, and the other elements their exact masters."""
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(16, 16).to(device, torch.bfloat16)
    opt = optim.AdamW(lin.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=gen).to(device, torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        lin(x).float().square().mean().backward()
        opt.step()
    if how == "deepcopy":
        lin, opt = copy.deepcopy((lin, opt))
    else:
        saved = opt.state_dict()
        opt = optim.AdamW(lin.parameters(), lr=1e-2)
        opt.load_state_dict(saved)
    master = opt.state[lin.weight]["master_param"].clone()
    mask = (torch.arange(256, device=device) % 2).reshape(16, 16)
    with torch.no_grad():
        lin.weight.mul_(mask.to(torch.bfloat16))
    want = torch.where(mask.bool(), master, lin.weight.detach().float())
    opt.param_groups[0].update(lr=0.0, weight_decay=0.0)
    opt.zero_grad()
    lin(x).float().square().mean().backward()
    opt.step()
    # (values: the lr-0 step may turn a -0 into +0, as torch's Adam does)
    torch.testing.assert_close(opt.state[lin.weight]["master_param"], want, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.detach(), want.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_after_the_model_is_cast_or_the_state_reset(device, cls, kwargs):
    model = make_model(device)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    twin, twin_opt = full_path_twin(cls, kwargs, model, "fp32")
    lockstep([(model, opt), (twin, twin_opt)], 3)

    # The model cast to half after the optimizer stepped: masters start now.
    for m in (model, twin):
        m.half()
    lockstep([(model, opt), (twin, twin_opt)], 3, start=3)
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in model.parameters())
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))

    # The optimizer's state replaced by a new dict, as some scripts reset it (Adam's
    # step counts with it: they are per parameter).
    for o in (opt, twin_opt):
        o.state = type(o.state)(dict)
    lockstep([(model, opt), (twin, twin_opt)], 3, start=6)
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))


# Edits of a parameter's state between steps (pruning and re-initialisation code): each
# replaces or removes entries, which torch.optim reads at the next step. Before: the op
# call kept from the last step went on updating the old tensors (Adam's w 0.0036-0.05
# off torch's; the state shown and saved was not the state used).
STATE_EDITS = {
    "clear": lambda state, w: state[w].clear(),
    "assign-empty": lambda state, w: state.__setitem__(w, {}),
    "del": lambda state, w: state.__delitem__(w),
    "pop": lambda state, w: state.pop(w),
    "replace-moment": lambda state, w: state[w].__setitem__(
        "exp_avg" if "exp_avg" in state[w] else "momentum_buffer", torch.zeros_like(w)),
    "replace-step": lambda state, w: state[w].__setitem__("step", torch.tensor(0.0)),
    "buffer-none": lambda state, w: state[w].__setitem__("momentum_buffer", None),
    "pop-entry": lambda state, w: state[w].pop("momentum_buffer"),
    "update": lambda state, w: state[w].update(momentum_buffer=torch.zeros_like(w)),
}


_EDITED = [pytest.param(optim.Adam, {"lr": 0.05}, edit, id=f"Adam-{edit}")
           for edit in ("clear", "assign-empty", "del", "pop", "replace-moment",
                        "replace-step")] + \
          [pytest.param(optim.SGD, {"lr": 0.05, "momentum": 0.9}, edit, id=f"SGD-{edit}")
           for edit in sorted(STATE_EDITS) if edit != "replace-step"]


@pytest.mark.parametrize("cls, kwargs, edit", _EDITED)
def test_state_replaced_between_steps_is_read_as_torch_reads_it(cls, kwargs, edit):
    results = []
    for make in (cls, lambda ps, **kw: torch_optimizer(cls, ps, kw)):
        torch.manual_seed(0)
        w, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4))
        opt = make([w, b], **kwargs)
        for i in range(5):
            if i == 3:
                STATE_EDITS[edit](opt.state, w)
            w.grad = torch.full_like(w, 0.1 * (i + 1))
            b.grad = torch.full_like(b, -0.1 * (i + 1))
            opt.step()
        results.append((w.detach(), b.detach(), opt.state_dict()["state"]))
    (w, b, saved), (ref_w, ref_b, ref_saved) = results
    torch.testing.assert_close(w, ref_w, **TIGHT)
    torch.testing.assert_close(b, ref_b, **TIGHT)
    assert sorted(saved) == sorted(ref_saved)
    for key, state in saved.items():
        assert sorted(state) == sorted(ref_saved[key])
        for name, value in state.items():
            torch.testing.assert_close(value, ref_saved[key][name], **TIGHT)


def _planned(opt):
    return opt.plans.planned(opt.param_groups, opt.state, opt.master, opt._plan_holds)


def test_state_edits_are_seen_after_copies_and_a_rebound_state():
    """The state's containers count their edits after a deepcopy, a torch.save/load of
    the optimizer and in a state a script set as a plain defaultdict (counted again from
    its next step); steps that replace nothing reuse the op call (the count stays)."""
    model = make_model(dtype=torch.bfloat16)
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    lockstep([(model, opt)], 3)
    count = opt.state.edits.count
    lockstep([(model, opt)], 2, start=3)
    assert opt.state.edits.count == count and _planned(opt) is not None
    buffer = io.BytesIO()
    torch.save((model, opt), buffer)
    buffer.seek(0)
    rebound = copy.deepcopy((model, opt))
    rebound[1].state = collections.defaultdict(
        dict, {p: dict(s) for p, s in rebound[1].state.items()})
    pairs = [(model, opt), copy.deepcopy((model, opt)), torch.load(buffer, weights_only=False),
             rebound]
    for m, o in pairs:
        lockstep([(m, o)], 2, start=5)
        assert type(o.state) is ParamStates and _planned(o) is not None
        o.state[m.fc1.weight]["exp_avg"] = torch.zeros_like(o.state[m.fc1.weight]["exp_avg"])
        assert _planned(o) is None
        twin, twin_opt = copy.deepcopy((m, o))
        twin_opt.plans.invalidate()
        lockstep([(m, o), (twin, twin_opt)], 1, start=7)
        assert_same_snapshot(full_snapshot(m, o), full_snapshot(twin, twin_opt))


def test_a_state_dict_set_as_a_params_state_is_counted():
    """A plain dict set as a parameter's state is kept as a ParamState copy of it,
    whose edits count; a ParamState of another optimizer is copied too."""
    model = make_model()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    other = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lockstep([(model, opt)], 2)
    other.state[model.fc1.weight] = opt.state[model.fc1.weight]
    assert other.state[model.fc1.weight] is not opt.state[model.fc1.weight]
    opt.state[model.fc1.weight] = {"momentum_buffer": torch.zeros_like(model.fc1.weight)}
    assert type(opt.state[model.fc1.weight]) is ParamState
    lockstep([(model, opt)], 1, start=2)
    assert _planned(opt) is not None
    count = opt.state.edits.count
    opt.state[model.fc1.weight]["momentum_buffer"] = torch.zeros_like(model.fc1.weight)
    assert opt.state.edits.count == count + 1 and _planned(opt) is None


def test_kept_op_call_follows_momentum_changes(device):
    model = make_model(device)
    opt = optim.SGD(model.parameters(), lr=0.1, master="none")
    twin, twin_opt = full_path_twin(optim.SGD, {"lr": 0.1}, model, "none")
    lockstep([(model, opt), (twin, twin_opt)], 2)
    for o in (opt, twin_opt):
        o.param_groups[0]["momentum"] = 0.9  # buffers start at the next step
    lockstep([(model, opt), (twin, twin_opt)], 3, start=2)
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    for o in (opt, twin_opt):
        o.param_groups[0]["momentum"] = 0.0
    lockstep([(model, opt), (twin, twin_opt)], 2, start=5)
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))


def test_kept_op_call_follows_the_model_to_another_device():
    if not torch.cuda.is_available():
        pytest.skip("moving the model needs CUDA")
    model = make_model("cpu", torch.float16)
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, master="fp32")
    lockstep([(model, opt)], 2)
    model.cuda()
    lockstep([(model, opt)], 2, start=2)
    for p in model.parameters():
        assert opt.state[p]["master_param"].device == p.device
        assert_bitwise_equal(p, opt.state[p]["master_param"].half())


# --- strides, memory formats, dtype round trips -------------------------------------------

# (Apex's FusedAdam has weight_decay=0 by default: these tests kept its update)
STRIDE_OPTIMIZERS = [pytest.param(optim.SGD, {}, id="SGD"),
                     pytest.param(optim.AdamW, {"weight_decay": 0.0}, id="AdamW")]


@pytest.mark.parametrize("cls, kwargs", STRIDE_OPTIMIZERS)
def test_a_gradient_with_other_strides_is_accepted(device, cls, kwargs):
    """Before: group 1's transposed gradient raised after group 0 had been updated."""
    a = nn.Parameter(torch.ones(5, 3, device=device))
    b = nn.Parameter(torch.ones(3, 5, device=device))
    ref_a, ref_b = (nn.Parameter(t.detach().clone()) for t in (a, b))
    opt = cls([{"params": [a]}, {"params": [b]}], lr=0.1, **kwargs)
    ref = torch_optimizer(cls, [{"params": [ref_a]}, {"params": [ref_b]}], dict(lr=0.1, **kwargs))
    for p in (a, ref_a):
        p.grad = torch.arange(15.0, device=device).reshape(5, 3)
    for p in (b, ref_b):
        p.grad = torch.arange(15.0, device=device).reshape(5, 3).t()  # strides (1, 3)
    opt.step()
    ref.step()
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(b, ref_b)


@pytest.mark.parametrize("cls, kwargs", STRIDE_OPTIMIZERS)
@pytest.mark.parametrize("master", ["none", "fp32"])
def test_channels_last_after_the_optimizer_was_built(device, cls, kwargs, master):
    """Before: model.to(memory_format=channels_last) after building the optimizer made
    every step raise (with masters at once, without once exp_avg existed). Both models
    step on the reference's gradients (laid out as each parameter): torch's convolution
    need not give bit-equal weight gradients in the two memory formats (it does not with
    its AVX2 kernels)."""
    dtype = torch.bfloat16 if master == "fp32" else torch.float32

    def build():
        torch.manual_seed(0)
        return nn.Conv2d(3, 4, 3).to(device, dtype)

    kwargs = dict(kwargs, lr=0.1, momentum=0.9) if cls is optim.SGD else dict(kwargs, lr=0.01)
    model, reference = build(), build()
    opt = cls(model.parameters(), master=master, **kwargs)
    ref_opt = cls(reference.parameters(), master=master, **kwargs)
    x = torch.randn(2, 3, 8, 8, device=device, dtype=dtype)
    for step in range(3):
        ref_opt.zero_grad()
        reference(x).float().square().mean().backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            p.grad = torch.empty_like(p).copy_(r.grad)
        opt.step()
        ref_opt.step()
        if step == 0:
            model.to(memory_format=torch.channels_last)
    assert model.weight.is_contiguous(memory_format=torch.channels_last)
    state = opt.state[model.weight]
    for key in ("master_param", "momentum_buffer", "exp_avg"):
        if key in state:
            assert state[key].stride() == model.weight.stride(), key
    torch.testing.assert_close(model.weight, reference.weight, atol=0, rtol=0)


@pytest.mark.parametrize("cls, kwargs", STRIDE_OPTIMIZERS)
def test_a_master_is_rebuilt_after_a_dtype_round_trip(device, cls, kwargs):
    """Before: train in bf16, model.float(), train, .bfloat16(): the old fp32 master
    came back and the weights jumped back to it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device, torch.bfloat16)
    opt = cls(model.parameters(), lr=0.1, master="fp32", **kwargs)
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_a_master_follows_data_assigned_to_its_parameter(device, cls, kwargs, dtype):
    """``p.data = new`` after some steps (re-initialisation in legacy and fine-tuning
    scripts): the master takes the new values as from an in-place write under
    ``no_grad`` (bit for bit), and the run goes on as torch.optim's on an fp32 twin
    given the same values; the same values assigned in new storage (as ``model.to()``
    gives) keep the master's fp32 bits. Before: the next step wrote the old master
    back into p (|w| 0.25 where 5.0 was assigned)."""
    model = make_model(device, dtype)
    twin, other = fp32_twin(model), copy.deepcopy(model)
    opt = cls(model.parameters(), master="fp32", **kwargs)
    other_opt = cls(other.parameters(), master="fp32", **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    train(model, opt, twin, twin_opt, 3)
    lockstep([(other, other_opt)], 3)
    new = torch.full_like(model.fc1.weight, 0.5)
    new[0] = -0.25
    model.fc1.weight.data = new
    twin.fc1.weight.data = new.float()
    with torch.no_grad():
        other.fc1.weight.copy_(new)
    model.fc2.bias.data = model.fc2.bias.detach().clone()
    train(model, opt, twin, twin_opt, 3, start=3)
    assert_tracks_torch(model, opt, twin, twin_opt)
    lockstep([(other, other_opt)], 3, start=3)
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(other, other_opt))


@pytest.mark.parametrize("cls, kwargs", STRIDE_OPTIMIZERS)
def test_a_master_keeps_its_bits_when_the_model_is_converted_between_half_dtypes(
        device, cls, kwargs):
    """model.bfloat16() after fp16 steps gives each parameter new storage, which the
    master follows (retake_master): it keeps its fp32 value wherever the parameter
    holds it rounded through fp16 then bf16, here everywhere."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8).to(device, torch.float16)
    opt = cls(model.parameters(), lr=0.1, master="fp32", **kwargs)
    x = torch.randn(4, 16, device=device)
    for _ in range(3):
        opt.zero_grad()
        model(x.half()).float().sum().backward()
        opt.step()
    masters = [opt.state[p]["master_param"].clone() for p in model.parameters()]
    model.bfloat16()
    opt.zero_grad()
    model(x.bfloat16()).float().sum().backward()
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    for p, master in zip(model.parameters(), masters):
        assert_bitwise_equal(opt.state[p]["master_param"], master)


def test_a_master_follows_weights_loaded_into_the_model(device):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device, torch.float16)
    opt = optim.SGD(model.parameters(), lr=0.1, master="fp32")
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
