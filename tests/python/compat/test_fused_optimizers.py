"""What only Apex's FusedSGD and FusedAdam do, as torch.optim.Optimizer objects: Apex's
signatures, argument checks and zero_grad default, float64 parameters and sparse gradients
refused, Adam without bias correction against a float64 reference, state dicts of other
optimizers refused, torch.compile; their master_weights beside the lean modes' master (and
FusedAdam's 2019 step in them), remainder and 8-bit state as mixedprec.optim keeps it; and
that they step bit for bit as mixedprec.optim's SGD, Adam and AdamW, which they are built
on (those classes' behaviour against torch.optim: optim/test_optimizer_objects.py)."""

import copy
import inspect

import pytest
import torch
from helpers import (
    DAMPENED_FIRST_STEP,  # noqa: F401 (scaler/test_grad_scaler.py imports it from here)
    TOLERANCES,
    assert_bitwise_equal,
    assert_same_snapshot,
    assert_state_dict_unchanged,
    backward,
    eager_and_compiled_steps,
    full_snapshot,
    make_model,
    named_snapshot,
    randn,
    state_dict_snapshot,
)
from references import ref_adam
from test_remainder import Pair, fixed_grads
from test_remainder import make_params as remainder_params
from test_state8 import E4M3, feed
from test_state8 import make_params as state8_params
from torch import nn

from mixedprec import FusedAdam, FusedSGD, optim

STEPS = 30
TIGHT = TOLERANCES[torch.float32]  # fp32 math against fp32 references: rtol 1e-5, atol 1e-6

MODEL_DTYPES = [
    pytest.param(torch.float32, False, id="fp32"),
    pytest.param(torch.float16, True, id="fp16-masters"),
    pytest.param(torch.bfloat16, True, id="bf16-masters"),
]
# One representative configuration of each optimizer, for the behaviour tests.
OPTIMIZERS = [
    pytest.param(FusedSGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}, id="sgd"),
    pytest.param(FusedAdam, {"lr": 1e-2, "weight_decay": 1e-2}, id="adamw"),
]


# --- the constructors ---------------------------------------------------------------------

def test_signatures_follow_apex():
    sgd = {k: v for k, v in inspect.signature(FusedSGD).parameters.items()
           if v.kind is not v.KEYWORD_ONLY}  # (master, state_dtype, seed: below)
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
    pytest.param(FusedSGD, {"lr": torch.tensor([0.1, 0.2])}, TypeError, id="sgd-two-element-lr"),
    pytest.param(FusedAdam, {"lr": -1e-3}, ValueError, id="adam-negative-lr"),
    pytest.param(FusedAdam, {"betas": (1.0, 0.999)}, ValueError, id="adam-beta1-1"),
    pytest.param(FusedAdam, {"betas": (-0.1, 0.999)}, ValueError, id="adam-beta1-negative"),
    pytest.param(FusedAdam, {"betas": (0.9, 1.5)}, ValueError, id="adam-beta2-above-1"),
    pytest.param(FusedAdam, {"eps": -1e-8}, ValueError, id="adam-negative-eps"),
    pytest.param(FusedAdam, {"weight_decay": -1.0}, ValueError, id="adam-negative-wd"),
    pytest.param(FusedAdam, {"amsgrad": True}, ValueError, id="adam-amsgrad"),
    pytest.param(FusedAdam, {"lr": torch.tensor(-1e-3)}, ValueError, id="adam-negative-tensor-lr"),
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


# --- what only FusedAdam computes ---------------------------------------------------------

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
            weight_decay=hp["weight_decay"], decoupled_weight_decay=adam_w_mode,
            bias_correction=False)

    for p, rp, rm, rv in zip(model.parameters(), ref_p, ref_m, ref_v):
        state = opt.state[p]
        master = state["master_param"] if master_weights else p.detach()
        torch.testing.assert_close(master.double(), rp, **TIGHT)
        torch.testing.assert_close(state["exp_avg"].double(), rm, **TIGHT)
        torch.testing.assert_close(state["exp_avg_sq"].double(), rv, **TIGHT)
        if master_weights:
            assert_bitwise_equal(p.detach(), master.to(dtype))


# --- torch.optim.Optimizer behaviour, as Apex's -------------------------------------------

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
    cannot trace; see mixedprec.optim.precision.Masters)."""
    results = eager_and_compiled_steps(lambda ps: cls(ps, lr=0.01, master_weights=True))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# --- the faces step as the mixedprec.optim classes they are built on -----------------------

# (the face, the mixedprec.optim class with the same update: Apex's defaults spelled out)
FACES = [
    pytest.param(lambda ps, m: FusedSGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2,
                                        master_weights=m == "fp32"),
                 lambda ps, m: optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2,
                                         master=m), id="sgd"),
    pytest.param(lambda ps, m: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                        master_weights=m == "fp32"),
                 lambda ps, m: optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, master=m),
                 id="sgd-nesterov"),
    pytest.param(lambda ps, m: FusedAdam(ps, lr=1e-2, adam_w_mode=False, weight_decay=1e-2,
                                         master_weights=m == "fp32"),
                 lambda ps, m: optim.Adam(ps, lr=1e-2, weight_decay=1e-2, master=m),
                 id="adam"),
    pytest.param(lambda ps, m: FusedAdam(ps, lr=1e-2, weight_decay=1e-2,
                                         master_weights=m == "fp32"),
                 lambda ps, m: optim.AdamW(ps, lr=1e-2, weight_decay=1e-2, master=m),
                 id="adamw"),
]


def assert_same_steps(model, opt, twin, twin_opt, msg):
    """Params and state bit for bit (FusedAdam counts its steps per group, in
    group["step"], mixedprec.optim's Adam per parameter: the counts are left out)."""
    for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
        assert_bitwise_equal(p.detach(), q.detach(), f"{msg}: param {i}")
        state, twin_state = opt.state[p], twin_opt.state[q]
        assert set(state) - {"step"} == set(twin_state) - {"step"}, msg
        for key, value in twin_state.items():
            if key != "step":
                assert_bitwise_equal(state[key], value, f"{msg}: param {i} {key}")


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("face, named", FACES)
def test_the_faces_step_as_mixedprec_optim(device, face, named, dtype, master_weights):
    """The face and its mixedprec.optim class, fed the same gradients: the same params,
    masters and moments after every step, a GradScaler's skipped step and scaled step
    included, and after each is resumed from its state dict."""
    master = "fp32" if master_weights else "none"
    model = make_model(device, dtype)
    twin = copy.deepcopy(model)
    opt, twin_opt = face(model.parameters(), master), named(twin.parameters(), master)

    def run(steps, start=0):
        for step in range(start, start + steps):
            scale = 64.0 if step in (3, 4) else 1.0  # step 3 overflows, step 4 does not
            for m, o in ((model, opt), (twin, twin_opt)):
                o.zero_grad(set_to_none=True)
                backward(m, step, scale=scale)
                if scale != 1.0:
                    o.grad_scale = torch.full((), scale, device=device)
                    o.found_inf = torch.full((), float(step == 3), device=device)
                o.step()
                if scale != 1.0:
                    del o.grad_scale, o.found_inf
            assert_same_steps(model, opt, twin, twin_opt, f"step {step}")

    run(6)
    saved = opt.state_dict(), twin_opt.state_dict()  # each resumed into a new one of its class
    opt, twin_opt = face(model.parameters(), master), named(twin.parameters(), master)
    opt.load_state_dict(saved[0])
    twin_opt.load_state_dict(saved[1])
    run(2, start=6)


# --- master_weights beside the lean modes' master ----------------------------------------

LEAN_SHAPES = [(37,), (5, 7), (300,)]  # (optim/test_lean.py's)
LEAN_ADAM = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 1e-2}
LEAN_SGD = {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}


def lean_params(device, dtype, seed=0):
    return [nn.Parameter(randn(shape, torch.float32, "cpu", seed=seed + i).to(dtype)
                         .to(device)) for i, shape in enumerate(LEAN_SHAPES)]


def set_lean_grads(params, step):
    for i, p in enumerate(params):
        p.grad = randn(p.shape, p.dtype, p.device, seed=1000 + 31 * step + i, scale=0.5)


def lean_model(device, dtype):
    return nn.ParameterList(lean_params(device, dtype))


def lean_train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        set_lean_grads(list(model.parameters()), step)
        opt.step()


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD])
def test_master_modes_and_master_weights(cls):
    p = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    assert cls(p).master == "none" and not cls(p).master_weights
    assert cls(p, master_weights=True).master == "fp32"
    assert cls(p, master="fp32").master_weights
    assert cls(p, master_weights=False, master="kahan").master == "kahan"
    opt = cls(p, master="none")
    opt.master_weights = True  # as mixedprec.amp.initialize does
    assert opt.master == "fp32"
    opt.master_weights = False
    assert opt.master == "none"


@pytest.mark.parametrize("cls, kwargs", [(FusedAdam, LEAN_ADAM), (FusedSGD, LEAN_SGD)])
def test_leaving_kahan_drops_the_compensations(cls, kwargs):
    model = lean_model("cpu", torch.bfloat16)
    opt = cls(model.parameters(), master="kahan", **kwargs)
    lean_train(model, opt, 2)
    assert all("kahan_comp" in opt.state[p] for p in model.parameters())
    opt.master_weights = True  # as mixedprec.amp.initialize does
    lean_train(model, opt, 1, first=2)
    for p in model.parameters():
        assert "kahan_comp" not in opt.state[p]
        assert_bitwise_equal(p.detach(), opt.state[p]["master_param"].bfloat16())
    cls(lean_model("cpu", torch.bfloat16).parameters(), master_weights=True,
        **kwargs).load_state_dict(opt.state_dict())  # no stale entry to reject


@pytest.mark.parametrize("cls, dtype_arg", [(FusedAdam, "state_dtype"),
                                            (FusedSGD, "state_dtype")])
def test_lean_argument_errors(cls, dtype_arg):
    bf16 = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match=r"master_weights=True conflicts with master='kahan'"):
        cls(bf16, master_weights=True, master="kahan")
    # master_weights=False is Apex's default: it says nothing beside a master
    assert cls(bf16, master_weights=False, master="fp32").master == "fp32"
    with pytest.raises(ValueError, match="expected master to be one of"):
        cls(bf16, master="bf16")
    with pytest.raises(ValueError, match="master_weights=True conflicts with "
                                         "master='stochastic'"):
        cls(bf16, master_weights=True, master="stochastic")
    with pytest.raises(TypeError, match=f"expected {dtype_arg} to be torch.float32, "
                                        "torch.bfloat16 or torch.float8_e4m3fn, got "
                                        "torch.float16"):
        cls(bf16, **{dtype_arg: torch.float16})
    for master in ("kahan", "stochastic"):
        with pytest.raises(TypeError, match=f"master='{master}'.*dtype torch.float16"):
            cls([nn.Parameter(torch.zeros(3, dtype=torch.float16))], master=master)


def test_kahan_rejects_a_cast_model_on_apex_2019_step_before_any_write():
    """FusedAdam's 2019 ``step(grads=...)`` checks every group before updating any."""
    model = lean_model("cpu", torch.bfloat16)
    params = list(model.parameters())
    opt = FusedAdam([{"params": params[:1]}, {"params": params[1:]}], master="kahan",
                    **LEAN_ADAM)
    lean_train(model, opt, 2)
    set_lean_grads(params, 2)
    late = params[-1]
    late.data = late.data.half()
    late.grad = late.grad.half()
    before = full_snapshot(model, opt)
    with pytest.raises(TypeError, match="master='kahan'.*float16"):
        opt.step(grads=[[p.grad for p in g["params"]] for g in opt.param_groups])
    assert_same_snapshot(full_snapshot(model, opt), before)


# --- remainder and 8-bit state, as mixedprec.optim keeps them -------------------------------
# (the harnesses of optim/test_remainder.py and optim/test_state8.py)

@pytest.mark.parametrize("cls, kwargs", [(FusedAdam, dict(lr=1e-3, weight_decay=1e-2)),
                                         (FusedSGD, dict(lr=0.02, momentum=0.9))])
def test_the_apex_faces_take_remainder(device, cls, kwargs):
    pair = Pair(remainder_params(device), remainder_params(device),
                lambda ps, master: cls(ps, master=master, **kwargs))
    for step in range(50):
        pair.feed([g.nan_to_num(0.0, 0.0, 0.0) for g in fixed_grads(pair.pr, step)])
        pair.opt32.step()
        pair.optr.step()
        pair.check(f"step {step}")


@pytest.mark.parametrize("face, named", [
    (lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01, state_dtype=E4M3, seed=5),
     lambda ps: optim.AdamW(ps, lr=1e-3, weight_decay=0.01, master="none",
                            state_dtype=E4M3, seed=5)),
    (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, state_dtype=E4M3, seed=5),
     lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, master="none", state_dtype=E4M3, seed=5))])
def test_the_apex_faces_take_8bit_moments(device, face, named):
    a, b = state8_params(device), state8_params(device)
    opt_a, opt_b = face(a), named(b)
    for step in range(3):
        feed(a, step)
        feed(b, step)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert_bitwise_equal(p.detach(), q.detach())
        for key, value in opt_b.state[q].items():
            if key != "step":
                assert_bitwise_equal(opt_a.state[p][key], value, key)
