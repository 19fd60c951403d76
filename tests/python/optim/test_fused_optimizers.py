"""FusedSGD and FusedAdam as torch.optim.Optimizer objects: many steps on a small model
against torch.optim (fp32 params, and fp16/bf16 models over fp32 masters), param groups,
LR schedulers, zero_grad, add_param_group, state_dict round trips and load errors,
argument checks, and the grad_scale / found_inf hand-off a GradScaler uses; gradients
with other strides, channels_last, dtype round trips, foreign state dicts and
torch.compile (each of these last tests failed before its fix)."""

import copy
import inspect
import io

import pytest
import torch
from helpers import (
    IN,
    OUT,
    TOLERANCES,
    assert_bitwise_equal,
    assert_same_snapshot,
    assert_state_dict_unchanged,
    eager_and_compiled_steps,
    full_snapshot,
    make_model,
    named_snapshot,
    randn,
    state_dict_snapshot,
    torch_optimizer,
)
from references import ref_adam
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixedprec import FusedAdam, FusedSGD

BATCH = 8
STEPS = 30
TIGHT = TOLERANCES[torch.float32]  # fp32 math against fp32 torch.optim: rtol 1e-5, atol 1e-6

MODEL_DTYPES = [
    pytest.param(torch.float32, False, id="fp32"),
    pytest.param(torch.float16, True, id="fp16-masters"),
    pytest.param(torch.bfloat16, True, id="bf16-masters"),
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
    pytest.param({"lr": 1e-2, "adam_w_mode": False}, id="adam"),
    pytest.param({"lr": 1e-2, "adam_w_mode": False, "weight_decay": 1e-2}, id="adam_l2"),
    pytest.param({"lr": 1e-2, "weight_decay": 1e-1}, id="adamw"),
    pytest.param({"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 1e-2},
                 id="adamw_betas"),
]
# One representative configuration of each optimizer, for the behaviour tests.
OPTIMIZERS = [
    pytest.param(FusedSGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}, id="sgd"),
    pytest.param(FusedAdam, {"lr": 1e-2, "weight_decay": 1e-2}, id="adamw"),
]


# --- helpers.make_model: its loss and its torch.optim twin -------------------------------

def backward(model, step, scale=1.0):
    """Gradients of a regression loss on the batch of `step` (deterministic)."""
    device = model.fc1.weight.device
    x = randn((BATCH, IN), torch.float32, device, seed=10_000 + step)
    y = randn((BATCH, OUT), torch.float32, device, seed=20_000 + step)
    loss = (model(x) - y).pow(2).mean() * scale
    loss.backward()
    return loss


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


def group_steps(opt):
    return [g["step"].item() if "step" in g else 0.0 for g in opt.param_groups]


# --- the constructors ---------------------------------------------------------------------

def test_signatures_follow_apex():
    sgd = {k: v for k, v in inspect.signature(FusedSGD).parameters.items()
           if v.kind is not v.KEYWORD_ONLY}  # (master, state_dtype: optim/test_lean.py)
    assert list(sgd) == ["params", "lr", "momentum", "dampening", "weight_decay", "nesterov",
                         "wd_after_momentum", "materialize_master_grads", "set_grad_none",
                         "master_weights"]
    assert sgd["lr"].default == 1e-3  # torch.optim.SGD's (Apex required lr)
    assert {k: v.default for k, v in sgd.items() if k not in ("params", "lr")} == {
        "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False,
        "wd_after_momentum": False, "materialize_master_grads": True,
        "master_weights": False, "set_grad_none": False}
    adam = inspect.signature(FusedAdam).parameters
    # (Apex 2019's keyword-only arguments: tests/python/compat/test_apex_legacy.py)
    assert {k: v.default for k, v in adam.items()
            if k != "params" and v.kind is not v.KEYWORD_ONLY} == {
        "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
        "adam_w_mode": True, "weight_decay": 0.0, "amsgrad": False, "set_grad_none": True,
        "capturable": False, "master_weights": False}
    for cls in (FusedSGD, FusedAdam):
        assert issubclass(cls, torch.optim.Optimizer)
        assert cls._step_supports_amp_scaling is True


BAD_ARGS = [
    pytest.param(FusedSGD, {"lr": -0.1}, ValueError, id="sgd-negative-lr"),
    pytest.param(FusedSGD, {"lr": 0.1, "momentum": -0.5}, ValueError, id="sgd-negative-momentum"),
    pytest.param(FusedSGD, {"lr": 0.1, "weight_decay": -1e-2}, ValueError, id="sgd-negative-wd"),
    pytest.param(FusedSGD, {"lr": 0.1, "nesterov": True}, ValueError,
                 id="sgd-nesterov-no-momentum"),
    pytest.param(FusedSGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": True},
                 ValueError,
                 id="sgd-nesterov-dampening"),
    pytest.param(FusedSGD, {"lr": float("nan")}, ValueError, id="sgd-nan-lr"),
    pytest.param(FusedSGD, {"lr": torch.tensor(0.1)}, TypeError, id="sgd-tensor-lr"),
    pytest.param(FusedAdam, {"lr": -1e-3}, ValueError, id="adam-negative-lr"),
    pytest.param(FusedAdam, {"betas": (1.0, 0.999)}, ValueError, id="adam-beta1-1"),
    pytest.param(FusedAdam, {"betas": (-0.1, 0.999)}, ValueError, id="adam-beta1-negative"),
    pytest.param(FusedAdam, {"betas": (0.9, 1.5)}, ValueError, id="adam-beta2-above-1"),
    pytest.param(FusedAdam, {"eps": -1e-8}, ValueError, id="adam-negative-eps"),
    pytest.param(FusedAdam, {"weight_decay": -1.0}, ValueError, id="adam-negative-wd"),
    pytest.param(FusedAdam, {"amsgrad": True}, ValueError, id="adam-amsgrad"),
    pytest.param(FusedAdam, {"lr": torch.tensor(1e-3)}, TypeError, id="adam-tensor-lr"),
]


@pytest.mark.parametrize("cls, kwargs, error", BAD_ARGS)
def test_bad_constructor_arguments(cls, kwargs, error):
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(error):
        cls(params, **kwargs)


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_float64_params_are_rejected(cls, kwargs):
    with pytest.raises(TypeError, match="float64"):
        cls([nn.Parameter(torch.zeros(3, dtype=torch.float64))], **kwargs)


# --- many steps against torch.optim -----------------------------------------------------

@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_fused_sgd_tracks_torch_sgd(device, dtype, master_weights, config):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = FusedSGD(model.parameters(), master_weights=master_weights, **config)
    twin_opt = torch_optimizer(FusedSGD, twin.parameters(), config)

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    if dtype != torch.float32:  # and the model against the reference, within one rounding
        for p, tp in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.detach(), tp.detach().to(dtype))


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_fused_adam_tracks_torch_adam(device, dtype, master_weights, config):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = FusedAdam(model.parameters(), master_weights=master_weights, **config)
    twin_opt = torch_optimizer(FusedAdam, twin.parameters(), config)

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    step = opt.param_groups[0]["step"]
    assert step.dtype == torch.float32 and step.device.type == device and step.numel() == 1
    assert step.item() == STEPS
    if dtype != torch.float32:
        for p, tp in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.detach(), tp.detach().to(dtype))


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("adam_w_mode", [False, True], ids=["adam", "adamw"])
def test_fused_adam_without_bias_correction(device, dtype, master_weights, adam_w_mode):
    """Against a float64 Adam without bias correction fed the same gradients."""
    hp = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 1e-2}
    model = make_model(device, dtype)
    opt = FusedAdam(model.parameters(), bias_correction=False, adam_w_mode=adam_w_mode,
                    master_weights=master_weights, **hp)
    ref_p = [p.detach().double() for p in model.parameters()]
    ref_m = [torch.zeros_like(p) for p in ref_p]
    ref_v = [torch.zeros_like(p) for p in ref_p]

    for step in range(STEPS):
        opt.zero_grad()
        backward(model, step)
        grads = [p.grad.float() for p in model.parameters()]
        opt.step()
        ref_p, ref_m, ref_v, _ = ref_adam(
            ref_p, grads, ref_m, ref_v, step, hp["lr"], *hp["betas"], eps=hp["eps"],
            weight_decay=hp["weight_decay"], adamw=adam_w_mode, bias_correction=False)

    for p, rp, rm, rv in zip(model.parameters(), ref_p, ref_m, ref_v):
        state = opt.state[p]
        master = state["master_param"] if master_weights else p.detach()
        torch.testing.assert_close(master.double(), rp, **TIGHT)
        torch.testing.assert_close(state["exp_avg"].double(), rm, **TIGHT)
        torch.testing.assert_close(state["exp_avg_sq"].double(), rv, **TIGHT)
        if master_weights:
            assert_bitwise_equal(p.detach(), master.to(dtype))


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_param_groups_with_different_lr(device, dtype, master_weights, cls, kwargs):
    model = make_model(device, dtype)
    twin = fp32_twin(model)

    def groups(m):
        return [{"params": m.fc1.parameters()},
                {"params": m.fc2.parameters(), "lr": kwargs["lr"] / 7, "weight_decay": 0.0}]

    opt = cls(groups(model), master_weights=master_weights, **kwargs)
    twin_opt = torch_optimizer(cls, groups(twin), kwargs)
    assert opt.param_groups[1]["lr"] == kwargs["lr"] / 7

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    if cls is FusedAdam:
        assert group_steps(opt) == [STEPS, STEPS]


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_group_mixing_fp32_and_half_params(device, half, cls, kwargs):
    """fc1 in fp16/bf16 (over masters), fc2 in fp32 (its own master), one group."""
    model = make_model(device, half, fc2_dtype=torch.float32)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master_weights=True, **kwargs)
    twin_opt = torch_optimizer(cls, twin.parameters(), kwargs)
    assert len(opt.param_groups) == 1

    train(model, opt, twin, twin_opt, STEPS)

    assert_tracks_torch(model, opt, twin, twin_opt)
    assert "master_param" in opt.state[model.fc1.weight]
    assert "master_param" not in opt.state[model.fc2.weight]
    if cls is FusedAdam:  # one step count per group, incremented once per step
        assert group_steps(opt) == [STEPS]


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_params_without_grads_are_left_alone(device, dtype, master_weights, cls, kwargs):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master_weights=master_weights, **kwargs)
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

    if cls is FusedSGD:  # torch.optim.SGD skips such params too: the whole run agrees
        assert_tracks_torch(model, opt, twin, twin_opt)
    else:  # the group's step count differs from torch's per-param one for fc2.bias only
        assert group_steps(opt) == [12]
        for p, tp in zip(model.parameters(), twin.parameters()):
            if p is not frozen:
                master = opt.state[p].get("master_param", p.detach())
                torch.testing.assert_close(master, tp.detach(), **TIGHT)


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
              master_weights=True, **kwargs)
    op = "mixedprec::fused_sgd_" if cls is FusedSGD else "mixedprec::fused_adam_"
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
    opt = cls(model.parameters(), master_weights=True, **kwargs)
    plain_opt = cls(unscheduled.parameters(), master_weights=True, **kwargs)
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


@pytest.mark.parametrize("cls, default_to_none", [(FusedSGD, False), (FusedAdam, True)],
                         ids=["sgd", "adam"])
def test_zero_grad(device, cls, default_to_none):
    model = make_model(device)
    params = list(model.parameters())

    def grads_after(*args, **kwargs):
        for p in params:
            p.grad = torch.ones_like(p)
        cls(params, lr=0.1, **kwargs).zero_grad(*args)
        return [p.grad for p in params]

    for set_grad_none in (False, True):
        for grads, to_none in ((grads_after(set_grad_none=set_grad_none), set_grad_none),
                               (grads_after(True, set_grad_none=set_grad_none), True),
                               (grads_after(False, set_grad_none=set_grad_none), False)):
            if to_none:
                assert all(g is None for g in grads)
            else:
                assert all(g is not None and not g.any() for g in grads)
    default = grads_after()
    assert all(g is None for g in default) if default_to_none else all(
        g is not None and not g.any() for g in default)
    # zero_grad(set_to_none=...) by keyword, as torch.optim.Optimizer takes it.
    for p in params:
        p.grad = torch.ones_like(p)
    cls(params, lr=0.1).zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_add_param_group_later(device, dtype, master_weights, cls, kwargs):
    model = make_model(device, dtype)
    twin = fp32_twin(model)
    opt = cls(model.fc1.parameters(), master_weights=master_weights, **kwargs)
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
        if step == 5 and master_weights:  # the masters were taken before the update
            assert all("master_param" in opt.state[p] for p in model.fc2.parameters())

    assert_tracks_torch(model, opt, twin, twin_opt)
    if cls is FusedAdam:
        assert group_steps(opt) == [15, 10]


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_failed_add_param_group_changes_nothing(cls, kwargs):
    """A rejected group (float64 param) must not stay in param_groups, as with
    torch.optim, whose add_param_group checks before it appends."""
    model = make_model("cpu")
    opt = cls(model.fc1.parameters(), **kwargs)
    groups_before = [dict(g) for g in opt.param_groups]

    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.float64))]})

    assert opt.param_groups == groups_before


# --- state_dict ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_state_dict_round_trip_resumes_bit_for_bit(device, dtype, master_weights, cls, kwargs):
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master_weights=master_weights, **kwargs)
    for step in range(7):
        opt.zero_grad()
        backward(model, step)
        opt.step()

    saved = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        if master_weights:
            assert_bitwise_equal(saved["state"][i]["master_param"], opt.state[p]["master_param"])
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed_model = copy.deepcopy(model)
    resumed = cls(resumed_model.parameters(), master_weights=master_weights, **kwargs)
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
    if cls is FusedAdam:
        assert group_steps(resumed) == [12.0]


def _trained(device, cls, kwargs, steps):
    model = make_model(device, torch.float16)
    opt = cls(model.parameters(), master_weights=True, **kwargs)
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
    elif defect == "moment_fp16":
        sd["state"][1][key] = sd["state"][1][key].half()
    elif defect == "master_bf16":
        sd["state"][3]["master_param"] = sd["state"][3]["master_param"].bfloat16()
    return sd


@pytest.mark.parametrize("defect", ["extra_group", "missing_param", "master_shape",
                                    "moment_shape", "moment_fp16", "master_bf16"])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_load_state_dict_errors_change_nothing(device, cls, kwargs, defect):
    model, opt = _trained(device, cls, kwargs, steps=3)
    key = "momentum_buffer" if cls is FusedSGD else "exp_avg"
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


# --- errors in step ----------------------------------------------------------------------

@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_sparse_gradient_raises_and_changes_nothing(device, cls, kwargs):
    dense = make_model(device)
    embedding = nn.Embedding(10, 4, sparse=True).to(device)
    # The sparse param is in the last group: a group-by-group step would update the first.
    opt = cls([{"params": dense.parameters()}, {"params": embedding.parameters()}], **kwargs)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        backward(dense, step)
        opt.step()
    opt.zero_grad(set_to_none=True)
    backward(dense, 2)
    embedding(torch.tensor([1, 3, 3], device=device)).sum().backward()
    assert embedding.weight.grad.is_sparse
    before = named_snapshot([list(dense.parameters()), list(embedding.parameters()),
                             opt.state, opt.param_groups])

    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()

    after = named_snapshot([list(dense.parameters()), list(embedding.parameters()),
                            opt.state, opt.param_groups])
    assert_same_snapshot(after, before)


# --- grad_scale and found_inf, as a GradScaler sets them -------------------------------

def _skip_cases():
    cases = []
    layouts = ((torch.float32, False, "fp32"), (torch.float16, False, "fp16-params"),
               (torch.float16, True, "fp16-masters"), (torch.bfloat16, True, "bf16-masters"))
    for cls, configs in ((FusedSGD, SGD_CONFIGS), (FusedAdam, ADAM_CONFIGS[1:3])):
        for config in configs:
            for dtype, master_weights, name in layouts:
                cases.append(pytest.param(cls, config.values[0], dtype, master_weights,
                                          id=f"{cls.__name__}-{config.id}-{name}"))
    return cases


@pytest.mark.parametrize("cls, kwargs, dtype, master_weights", _skip_cases())
def test_found_inf_skips_the_step(device, cls, kwargs, dtype, master_weights):
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master_weights=master_weights, **kwargs)
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
    pytest.param(torch.float32, False, 1024.0, id="fp32"),
    pytest.param(torch.float32, False, 3000.0, id="fp32-not-power-of-2"),
    pytest.param(torch.float16, True, 1024.0, id="fp16-masters"),
    pytest.param(torch.bfloat16, True, 1024.0, id="bf16-masters"),
]


@pytest.mark.parametrize("dtype, master_weights, grad_scale", GRAD_SCALES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_grad_scale_unscales_in_the_update(device, cls, kwargs, dtype, master_weights,
                                           grad_scale):
    plain_model = make_model(device, dtype)
    scaled_model = copy.deepcopy(plain_model)
    plain = cls(plain_model.parameters(), master_weights=master_weights, **kwargs)
    scaled = cls(scaled_model.parameters(), master_weights=master_weights, **kwargs)

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
        if master_weights:
            torch.testing.assert_close(b["master_param"], a["master_param"], **TIGHT)
            assert_bitwise_equal(sp.detach(), b["master_param"].to(dtype))
        else:
            torch.testing.assert_close(sp.detach(), p.detach(), **TIGHT)
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in a:
                torch.testing.assert_close(b[key], a[key], **TIGHT, msg=key)
    if cls is FusedAdam:
        assert group_steps(scaled) == group_steps(plain) == [6.0]


DAMPENED_FIRST_STEP = (
    "documented: a step skipped on the device still creates FusedSGD's (zero) momentum "
    "buffers, so with dampening != 0 the next step dampens the gradient where "
    "torch.optim.SGD, which skips on the host, would start the buffer at the gradient "
    "(torch's own SGD(fused=True) creates its buffers the same way)")


@pytest.mark.parametrize("cls, config", [
    pytest.param(FusedSGD, c.values[0], id=f"sgd-{c.id}",
                 marks=[pytest.mark.xfail(strict=True, reason=DAMPENED_FIRST_STEP)]
                 if c.id == "dampening" else [])
    for c in SGD_CONFIGS[2:]
] + [pytest.param(FusedAdam, c.values[0], id=c.id) for c in ADAM_CONFIGS[1:3]])
def test_skipped_first_step_leaves_no_trace(device, cls, config):
    """A GradScaler often skips the very first step (the initial scale overflows).
    torch.optim then never saw a step, so the next step is its first: state such as
    the momentum buffer must start as it would have without the skipped step."""
    model = make_model(device, torch.float16)
    twin = fp32_twin(model)
    opt = cls(model.parameters(), master_weights=True, **config)
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
    if cls is FusedAdam:
        assert group_steps(opt) == [10.0]


def test_skipped_first_step_with_dampening_starts_from_a_zero_buffer(device):
    """The documented semantics behind DAMPENED_FIRST_STEP, exactly."""
    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = FusedSGD([p], lr=0.1, momentum=0.9, dampening=0.25)
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

def full_path_twin(cls, kwargs, model, master_weights):
    """A copy of `model` and an optimizer that forgets its kept op call before every
    step, so that every step takes the full path."""
    twin = copy.deepcopy(model)
    opt = cls(twin.parameters(), master_weights=master_weights, **kwargs)
    step = opt.step

    def full_step(*args, **kw):
        opt._invalidate_plans()
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


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_equals_the_full_path(device, cls, kwargs, dtype, master_weights):
    model = make_model(device, dtype)
    opt = cls(model.parameters(), master_weights=master_weights, **kwargs)
    twin, twin_opt = full_path_twin(cls, kwargs, model, master_weights)

    def vary(step, m, o):  # an LR schedule and a frozen bias at some steps
        o.param_groups[0]["lr"] = kwargs["lr"] * (1 + step % 3)
        if step in (4, 5):
            m.fc2.bias.requires_grad_(False)
        else:
            m.fc2.bias.requires_grad_(True)
    lockstep([(model, opt), (twin, twin_opt)], 10, between=vary)

    assert opt._plans, "the steps kept their op call"
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_after_load_state_dict_and_add_param_group(device, cls, kwargs):
    model, other = make_model(device, torch.float16), make_model(device, torch.float16, seed=7)
    opt = cls(model.parameters(), master_weights=True, **kwargs)
    other_opt = cls(other.parameters(), master_weights=True, **kwargs)
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


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_kept_op_call_after_the_model_is_cast_or_the_state_reset(device, cls, kwargs):
    model = make_model(device)
    opt = cls(model.parameters(), master_weights=True, **kwargs)
    twin, twin_opt = full_path_twin(cls, kwargs, model, True)
    lockstep([(model, opt), (twin, twin_opt)], 3)

    # The model cast to half after the optimizer stepped: masters start now.
    for m in (model, twin):
        m.half()
    lockstep([(model, opt), (twin, twin_opt)], 3, start=3)
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in model.parameters())
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))

    # The optimizer's state replaced by a new dict, as some scripts reset it.
    for o in (opt, twin_opt):
        o.state = type(o.state)(dict)
        if cls is FusedAdam:
            o.param_groups[0].pop("step")
    lockstep([(model, opt), (twin, twin_opt)], 3, start=6)
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, twin_opt))


def test_kept_op_call_follows_momentum_changes(device):
    model = make_model(device)
    opt = FusedSGD(model.parameters(), lr=0.1)
    twin, twin_opt = full_path_twin(FusedSGD, {"lr": 0.1}, model, False)
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
    opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    lockstep([(model, opt)], 2)
    model.cuda()
    lockstep([(model, opt)], 2, start=2)
    for p in model.parameters():
        assert opt.state[p]["master_param"].device == p.device
        assert_bitwise_equal(p, opt.state[p]["master_param"].half())


# --- strides, memory formats, dtype round trips, foreign state dicts ---------------------

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
    every step raise (with masters at once, without once exp_avg existed). Both models
    step on the reference's gradients (laid out as each parameter): torch's convolution
    need not give bit-equal weight gradients in the two memory formats (it does not with
    its AVX2 kernels)."""
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
    before = state_dict_snapshot(model, opt)
    with pytest.raises(ValueError, match="load_state_dict"):
        opt.load_state_dict(src.state_dict())
    assert_state_dict_unchanged(model, opt, before)
    opt.step()  # still usable


# --- torch.compile -----------------------------------------------------------------------

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


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
def test_optimizer_step_compiles_in_one_graph(cls):
    """fullgraph=True: the step traces without a graph break (a compiled step skips the
    eager path's kept op calls and the version check of the masters, which Dynamo
    cannot trace; see _FusedOptimizer._master)."""
    results = eager_and_compiled_steps(lambda ps: cls(ps, lr=0.01, master_weights=True))
    for a, b in zip(*results):
        assert torch.equal(a, b)
