"""mixedprec.optim.Adam/AdamW/SGD against torch.optim: optim_db's configurations step for
step, torch's fallback dtypes, per-parameter step counts, state_dict interchange both
ways, the scaler channel, argument errors, and differentiable=True (torch's own step)."""

import copy

import pytest
import torch
from helpers import (
    assert_state_dict_unchanged,
    eager_and_compiled_steps,
    forbid_host_sync,
    state_dict_snapshot,
)

import mixedprec
from mixedprec import optim

PAIRS = {"Adam": (optim.Adam, torch.optim.Adam), "AdamW": (optim.AdamW, torch.optim.AdamW),
         "SGD": (optim.SGD, torch.optim.SGD)}
# optim_db's CPU configurations of these classes (torch 2.11); importing torch's test
# utilities here would freeze the cudnn flags for the rest of the session.
DB = {"Adam": [{}, {"lr": 0.01}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "maximize": True},
               {"weight_decay": 0.1, "amsgrad": True}],
      "SGD": [{}, {"lr": 0.01}, {"lr": torch.tensor(0.001)}, {"weight_decay": 0.5},
              {"momentum": 0.9}, {"weight_decay": 0.1, "maximize": True},
              {"momentum": 0.9, "dampening": 0.5}, {"momentum": 0.9, "weight_decay": 0.1},
              {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}]}
DB["AdamW"] = DB["Adam"]


def db_inputs(device):
    return [pytest.param(name, kwargs, id=f"{name}-{i}") for name in sorted(DB)
            for i, kwargs in enumerate(DB[name])]


def model_params(dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    return [torch.randn(s, generator=gen, dtype=dtype).to(device).requires_grad_()
            for s in shapes]


def grads_for(params, step, frozen=()):
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        out.append(None if i in frozen else g.to(p.device))
    return out


def train(opt, params, steps, frozen_at=lambda step: ()):
    for step in range(steps):
        for p, g in zip(params, grads_for(params, step, frozen_at(step))):
            p.grad = None if g is None else g.clone()
        opt.step()


def clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


@pytest.mark.parametrize("name,kwargs", db_inputs("cpu"))
def test_optim_db_configurations_match_torch(name, kwargs, device):
    ours_cls, torch_cls = PAIRS[name]
    if isinstance(kwargs.get("lr"), torch.Tensor):
        kwargs = dict(kwargs, lr=kwargs["lr"].to(device))
    params = model_params(device=device)
    ref = clone(params)
    ours, theirs = ours_cls(params, **kwargs), torch_cls(ref, **copy.deepcopy(kwargs))
    train(ours, params, 6)
    train(theirs, ref, 6)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state["param_groups"][0].keys() == theirs_state["param_groups"][0].keys()
    for i, s in theirs_state["state"].items():
        assert ours_state["state"][i].keys() == s.keys()


@pytest.mark.parametrize("betas", [(0.3, 0.99), (0.5, 0.9), (0.9, 0.999)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_betas_and_weight_decay_step_as_torch(name, weight_decay, betas, device):
    """Both forms of torch's lerp for the first moment (for 1 - beta1 below one half,
    and at or above it) and both kinds of weight decay, none included, against
    torch.optim."""
    ours_cls, torch_cls = PAIRS[name]
    kwargs = {"lr": 0.01, "betas": betas, "weight_decay": weight_decay}
    params = model_params(device=device)
    ref = clone(params)
    ours, theirs = ours_cls(params, **kwargs), torch_cls(ref, **kwargs)
    train(ours, params, 6)
    train(theirs, ref, 6)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    ours_state = ours.state_dict()["state"]
    for i, s in theirs.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours_state[i][key], s[key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_signature_and_defaults_are_torchs(name):
    import inspect
    ours_cls, torch_cls = PAIRS[name]
    ours = inspect.signature(ours_cls.__init__).parameters
    theirs = inspect.signature(torch_cls.__init__).parameters
    for key, param in theirs.items():
        assert key in ours, key
        assert ours[key].default == param.default, key
        assert ours[key].kind == param.kind, key
    extras = [k for k in ours if k not in theirs]
    assert extras == ["master", "state_dtype", "seed", "unscale_grads", "precision_report"]
    assert all(ours[k].kind is inspect.Parameter.KEYWORD_ONLY for k in extras)
    assert getattr(mixedprec, name) is ours_cls


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_float64_and_complex_step_as_torch(name, dtype):
    ours_cls, torch_cls = PAIRS[name]
    kwargs = dict(lr=0.01, weight_decay=0.1)
    if name == "SGD":
        kwargs.update(momentum=0.9)
    params = model_params(dtype=dtype)
    ref = clone(params)
    train(ours_cls(params, **kwargs), params, 4)
    train(torch_cls(ref, **kwargs), ref, 4)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_group_stepped_in_part_by_torch_steps_every_time(name):
    """One group of float32 and float64 parameters: the fused op steps the first, torch's
    implementation the others, at every step (a planned step must not leave them out:
    it reads no parameter's version counter without fp32 masters, so such a group is
    never planned)."""
    ours_cls, torch_cls = PAIRS[name]
    kwargs = dict(lr=0.01, weight_decay=0.1, **({"momentum": 0.9} if name == "SGD" else {}))
    params = model_params() + model_params(dtype=torch.float64, seed=1)
    ref = clone(params)
    train(ours_cls(params, **kwargs), params, 5)
    train(torch_cls(ref, **kwargs), ref, 5)
    for p, r in zip(params, ref):
        tolerance = 0 if p.dtype == torch.float64 else 1e-6
        torch.testing.assert_close(p, r, rtol=tolerance, atol=tolerance)


def test_sgd_sparse_gradients_step_as_torch():
    weight = torch.randn(10, 3, requires_grad=True)
    ref = weight.detach().clone().requires_grad_()
    ours = optim.SGD([weight], lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for step in range(3):
        idx = torch.tensor([[step, 2, 7]])
        for p, opt in ((weight, ours), (ref, theirs)):
            p.grad = None
            torch.nn.functional.embedding(idx, p, sparse=True).sum().backward()
            opt.step()
    torch.testing.assert_close(weight, ref, rtol=0, atol=0)


def test_adam_sparse_gradients_are_refused_before_any_update():
    dense, sparse = torch.randn(4, requires_grad=True), torch.randn(10, 3, requires_grad=True)
    opt = optim.Adam([dense, sparse])
    dense.grad = torch.ones(4)
    torch.nn.functional.embedding(torch.tensor([[1]]), sparse, sparse=True).sum().backward()
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert torch.equal(dense, before) and not opt.state


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_per_parameter_steps_with_a_frozen_layer(name, device):
    ours_cls, torch_cls = PAIRS[name]
    params = model_params(device=device)
    ref = clone(params)
    # parameter 1 is frozen for steps 2..4, then resumes; parameter 3 starts at step 3
    frozen = lambda step: ({1} if 2 <= step <= 4 else set()) | ({3} if step < 3 else set())  # noqa: E731
    ours, theirs = ours_cls(params, lr=0.05), torch_cls(ref, lr=0.05)
    train(ours, params, 9, frozen)
    train(theirs, ref, 9, frozen)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    steps = [float(s["step"]) for s in ours.state_dict()["state"].values()]
    assert steps == [float(s["step"]) for s in theirs.state_dict()["state"].values()]
    assert steps == [9.0, 6.0, 9.0, 6.0]


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_state_dict_moves_to_torch_and_back(name):
    ours_cls, torch_cls = PAIRS[name]
    kwargs = dict(lr=0.02, weight_decay=0.01)
    if name == "SGD":
        kwargs.update(momentum=0.9)
    base = model_params()
    reference = clone(base)
    ref_opt = torch_cls(reference, **kwargs)
    train(ref_opt, reference, 8)
    # torch for 3 steps -> mixedprec for 3 -> torch for 2, against torch throughout
    a = clone(base)
    opt_a = torch_cls(a, **kwargs)
    train(opt_a, a, 3)
    b = clone(a)
    opt_b = ours_cls(b, **kwargs)
    opt_b.load_state_dict(opt_a.state_dict())
    for step in range(3, 6):
        for p, g in zip(b, grads_for(b, step)):
            p.grad = g
        opt_b.step()
    c = clone(b)
    opt_c = torch_cls(c, **kwargs)
    opt_c.load_state_dict(opt_b.state_dict())
    for step in range(6, 8):
        for p, g in zip(c, grads_for(c, step)):
            p.grad = g
        opt_c.step()
    for p, r in zip(c, reference):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_torchs_state_dict_of_a_16bit_model_loads_into_float32_moments(name, dtype):
    """torch.optim keeps a bf16 or fp16 model's moments in its dtype; mixedprec's
    optimizers keep float32 ones by default, and load torch's widened, exactly: they
    then step as if they had held those values all along."""
    ours_cls, torch_cls = PAIRS[name]
    kwargs = dict(lr=0.02, weight_decay=0.01, **({"momentum": 0.9} if name == "SGD" else {}))
    theirs_params = model_params(dtype)
    theirs = torch_cls(theirs_params, **kwargs)
    train(theirs, theirs_params, 3)
    saved = theirs.state_dict()
    before = copy.deepcopy(saved)
    params = clone(theirs_params)
    ours = ours_cls(params, **kwargs)
    ours.load_state_dict(saved)
    widened = {k: v.float() for k, v in saved["state"][0].items() if k != "step"}
    assert widened  # (moments or a momentum buffer)
    for key, value in widened.items():
        assert ours.state[params[0]][key].dtype == torch.float32
        assert torch.equal(ours.state[params[0]][key], value), key
    torch.testing.assert_close(saved, before, rtol=0, atol=0)  # the state dict is left as it is
    # then as torch.optim in float32 from those values (its load casts them to fp32 too)
    reference = [p.detach().float().requires_grad_() for p in theirs_params]
    ref_opt = torch_cls(reference, **kwargs)
    ref_opt.load_state_dict(saved)
    grads = grads_for(params, 3)
    for opt, ps in ((ours, params), (ref_opt, reference)):
        for p, g in zip(ps, grads):
            p.grad = g.to(p.dtype)
        opt.step()
    for p, r in zip(params, reference):
        torch.testing.assert_close(ours.state[p]["master_param"], r, rtol=1e-5, atol=1e-6)


def test_narrower_moments_are_refused_naming_the_state_dtype_to_load_them_with():
    theirs_params = model_params()
    theirs = torch.optim.AdamW(theirs_params)
    train(theirs, theirs_params, 1)
    params = clone(theirs_params)
    ours = optim.AdamW(params, master="none", state_dtype=torch.bfloat16)
    before = state_dict_snapshot(params, ours)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has dtype torch.float32, "
                       r"expected torch.bfloat16 .*never into narrower ones: load it with "
                       r"state_dtype=torch.float32"):
        ours.load_state_dict(theirs.state_dict())
    assert_state_dict_unchanged(params, ours, before)


def test_loaded_state_dict_steps_are_not_shared():
    params = model_params()
    opt = optim.Adam(params)
    train(opt, params, 2)
    saved = opt.state_dict()
    steps = [s["step"] for s in saved["state"].values()]
    assert len({id(s) for s in steps}) == len(steps)
    theirs = torch.optim.Adam(clone(params))
    theirs.load_state_dict(saved)  # torch advances each count in place
    train(theirs, list(theirs.param_groups[0]["params"]), 1)
    assert [float(s["step"]) for s in theirs.state.values()] == [3.0] * 4


@pytest.mark.parametrize("name,key,value", [
    ("Adam", "betas", (torch.tensor(0.9), torch.tensor(0.999))),
    ("Adam", "eps", torch.tensor(1e-8)),
    ("AdamW", "weight_decay", torch.tensor(0.01)),
    ("Adagrad", "lr_decay", 0.1),
], ids=["Adam-betas", "Adam-eps", "AdamW-weight_decay", "Adagrad-lr_decay"])
def test_a_group_sent_to_torchs_step_after_fused_steps_counts_each_parameter(name, key,
                                                                            value):
    """After fused steps (one step-count tensor shared by the group's parameters), a
    setting the fused ops do not take sends the group to torch's implementation, which
    advanced the shared count once per parameter (4 parameters: 4 a step; failed before
    its fix). Each parameter counts its own steps, one of them frozen in the first such
    step, as torch.optim's do, step for step."""
    ours_cls, torch_cls = getattr(optim, name), getattr(torch.optim, name)
    params = model_params()
    ref = clone(params)
    ours, theirs = ours_cls(params, lr=0.01), torch_cls(ref, lr=0.01, foreach=False)
    for step in range(5):
        if step == 2:
            ours.param_groups[0][key] = theirs.param_groups[0][key] = value
        frozen = (1,) if step == 2 else ()
        for p, q, g in zip(params, ref, grads_for(params, step, frozen)):
            p.grad, q.grad = (None, None) if g is None else (g.clone(), g.clone())
        ours.step()
        theirs.step()
        for p, q in zip(params, ref):
            assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]), step
            torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6, msg=f"step {step}")


def test_older_state_dict_gets_the_newer_keys():
    params = model_params()
    opt = optim.Adam(params)
    train(opt, params, 1)
    saved = opt.state_dict()
    for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                "decoupled_weight_decay"):
        del saved["param_groups"][0][key]
    opt2 = optim.Adam(clone(params))
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["maximize"] is False
    assert opt2.param_groups[0]["decoupled_weight_decay"] is False


def test_param_names_are_kept():
    params = model_params()
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = optim.AdamW(named)
    assert opt.param_groups[0]["param_names"] == ["p0", "p1", "p2", "p3"]
    train(opt, params, 1)
    saved = opt.state_dict()
    del saved["param_groups"][0]["param_names"]
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["param_names"] == ["p0", "p1", "p2", "p3"]


def test_sgd_without_momentum_keeps_no_state_and_zero_grad_sets_none():
    params = model_params()
    opt = optim.SGD(params, lr=0.1)
    train(opt, params, 2)
    assert len(opt.state) == 0
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    opt.step()  # no gradients: nothing moves
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_bf16_params_keep_fp32_masters_by_default(name):
    ours_cls, torch_cls = PAIRS[name]
    params = model_params()
    half = [p.detach().to(torch.bfloat16).requires_grad_() for p in params]
    ref = [p.detach().float().requires_grad_() for p in half]
    ours, theirs = ours_cls(half, lr=0.01), torch_cls(ref, lr=0.01)
    for step in range(5):
        grads = grads_for(params, step)
        for p, r, g in zip(half, ref, grads):
            p.grad, r.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        ours.step()
        theirs.step()
    for p, r in zip(half, ref):
        torch.testing.assert_close(ours.state[p]["master_param"], r, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, r.to(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_grad_is_unscaled_after_a_scaler_step(name):
    ours_cls, _ = PAIRS[name]
    params = model_params()
    opt = ours_cls(params, lr=0.01)
    scaler = mixedprec.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # (the scale is made at the first scale())
    grads = grads_for(params, 0)
    for p, g in zip(params, grads):
        p.grad = g * 1024.0
    scaler.step(opt)
    scaler.update()
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    kept = model_params()
    opt = ours_cls(kept, lr=0.01, unscale_grads=False)
    for p, g in zip(kept, grads):
        p.grad = g * 1024.0
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    for p, g in zip(kept, grads):
        torch.testing.assert_close(p.grad, g * 1024.0, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=float("inf")), "lr to be a finite number"),
    (dict(lr=-1.0), "Invalid learning rate"),
    (dict(differentiable=True, state_dtype=torch.bfloat16), "differentiable=True steps with "
                                                            "torch.optim's own"),
    (dict(unscale_grads=1), "unscale_grads to be a bool"),
    (dict(master="fp8"), "master to be one of"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        optim.Adam(model_params(), **kwargs)


def test_sgd_nan_dampening_is_refused():
    with pytest.raises(ValueError, match="dampening to be a finite number"):
        optim.SGD(model_params(), momentum=0.9, dampening=float("nan"))


def test_load_state_dict_without_state_changes_nothing():
    params = model_params()
    opt = optim.Adam(params)
    train(opt, params, 1)
    saved = opt.state_dict()
    before = copy.deepcopy(saved)
    with pytest.raises(ValueError, match="'state'"):
        opt.load_state_dict({"param_groups": saved["param_groups"]})
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, s in before["state"].items():
        for key, value in s.items():
            assert torch.equal(after["state"][i][key], value)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_strided_view_parameters_step_as_torch(name):
    ours_cls, torch_cls = PAIRS[name]
    base = torch.randn(10, 10)
    ref_base = base.clone()
    view, ref_view = base[:, ::2].requires_grad_(), ref_base[:, ::2].requires_grad_()
    ours, theirs = ours_cls([view], lr=0.01), torch_cls([ref_view], lr=0.01)
    for step in range(3):
        g = torch.randn(10, 5)
        view.grad, ref_view.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(view, ref_view, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_step_compiles_in_one_graph(name):
    ours_cls, _ = PAIRS[name]
    results = eager_and_compiled_steps(lambda ps: ours_cls(ps, lr=0.01))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_state_dict_keeps_entries_that_are_not_parameter_states(name):
    # A state_dict pre-hook may put a plain value under a key of its own in
    # optimizer.state; torch's state_dict passes it through, and so must ours.
    ours_cls, torch_cls = PAIRS[name]
    params = model_params()
    ref = clone(params)
    dicts = []
    for cls, ps in ((ours_cls, params), (torch_cls, ref)):
        opt = cls(ps, lr=0.01)
        train(opt, ps, 2)
        opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("note", 1))
        dicts.append(opt.state_dict())
    ours, theirs = dicts
    assert ours["state"]["note"] == theirs["state"]["note"] == 1
    assert ours["state"].keys() == theirs["state"].keys()


@pytest.mark.parametrize("fused", [None, True])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_meta_parameters_are_refused_before_any_update(name, fused):
    # Parameters on the meta device hold no values: a step used to go through on them
    # and leave meta moments behind.
    ours_cls, torch_cls = PAIRS[name]
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(3, 2)), torch.nn.Parameter(torch.empty(3))]
        for p in params:
            p.grad = torch.ones_like(p)
    opt = ours_cls(params, lr=0.01, momentum=0.9, fused=fused) if name == "SGD" else \
        ours_cls(params, lr=0.01, fused=fused)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                            for g in opt.param_groups])
    with pytest.raises(RuntimeError) as ours_error:
        opt.step()
    assert len(opt.state) == 0
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    if fused:  # torch.optim refuses them too, and the message is torch's
        with pytest.raises(RuntimeError) as torch_error:
            torch_cls(params, lr=0.01, fused=True).step()
        assert str(ours_error.value) == str(torch_error.value)
    else:
        assert "meta device" in str(ours_error.value)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_fp16_params_written_with_their_own_values_keep_their_masters(name, monkeypatch):
    # Writing a parameter outside the optimizer moves its version counter; elements
    # written with the value they had keep the master's fp32 value (so the steps keep
    # following torch's fp32 steps), elements written with another value take it.
    ours_cls, torch_cls = PAIRS[name]
    params = model_params()
    half = [p.detach().to(torch.float16).requires_grad_() for p in params]
    ref = [p.detach().float().requires_grad_() for p in half]
    ours, theirs = ours_cls(half, lr=0.01), torch_cls(ref, lr=0.01)
    for step in range(5):
        for p, r, g in zip(half, ref, grads_for(params, step)):
            p.grad, r.grad = g.to(torch.float16), g.to(torch.float16).float()
        with forbid_host_sync(monkeypatch):
            ours.step()
        theirs.step()
        with torch.no_grad():
            for p in half:
                p.copy_(p.clone())  # the same values
    for p, r in zip(half, ref):
        torch.testing.assert_close(ours.state[p]["master_param"], r, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, r.to(torch.float16))

    p = half[0]
    before = ours.state[p]["master_param"].clone()
    with torch.no_grad():
        p[0, 0] = 3.0  # another value
    for q in half:
        q.grad = torch.zeros_like(q)
    with forbid_host_sync(monkeypatch):
        ours.step()  # (lr * 0 gradient: for SGD the master is only brought up to p)
    master = ours.state[p]["master_param"]
    if name == "SGD":
        assert master[0, 0].item() == 3.0
        assert torch.equal(master.flatten()[1:], before.flatten()[1:])
    else:  # Adam's moments still move it: the element restarts from 3.0
        torch.testing.assert_close(master[0, 0], torch.tensor(3.0), rtol=0, atol=0.011)
        assert torch.equal(p, master.to(torch.float16))


# --- differentiable=True: torch.optim's own step, with autograd -------------------------

DIFFERENTIABLE = dict(PAIRS, Adagrad=(optim.Adagrad, torch.optim.Adagrad))


@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("dtype, master", [(torch.float32, "fp32"), (torch.bfloat16, "none")])
@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_a_differentiable_step_is_torchs_with_its_derivatives(name, dtype, master, foreach,
                                                              device):
    """differentiable=True: the step (a non-leaf parameter, as in meta-learning) is torch's
    for-loop step, bit for bit, with the state torch keeps, and autograd differentiates
    through it as through torch's: the derivatives with respect to the parameter's leaf and
    to the tensor its first gradient came from are the same. With foreach=True or left to
    its default, on every device: torch.optim.SGD on CUDA takes its foreach step even when
    differentiable (pytorch/pytorch#143947), which autograd cannot go back through once a
    weight decay is added (the H200 run of 2026-11-29 failed here), so the reference is
    torch's with foreach=False, the step differentiable=True stands for."""
    kwargs = dict(lr=0.1, weight_decay=0.01) | (dict(momentum=0.9) if name == "SGD" else {})
    results = []
    for cls, extra in zip(DIFFERENTIABLE[name],
                          (dict(master=master, foreach=foreach), dict(foreach=False))):
        gen = torch.Generator().manual_seed(0)
        leaf = torch.randn(4, 3, generator=gen).to(device, dtype).requires_grad_()
        source = torch.randn(4, 3, generator=gen).to(device, dtype).requires_grad_()
        param = leaf * 1.5
        opt = cls([param], differentiable=True, **kwargs, **extra)
        param.grad = source * 2
        opt.step()
        param.grad = torch.randn(4, 3, generator=gen).to(device, dtype)
        opt.step()
        assert param.requires_grad and param.grad_fn is not None  # autograd recorded it
        derivatives = torch.autograd.grad(param.float().square().sum(), (leaf, source),
                                          allow_unused=True)
        results.append((param.detach(), derivatives, opt.state[param]))
    (ours, ours_d, ours_state), (ref, ref_d, ref_state) = results
    assert torch.equal(ours, ref)
    for a, b in zip(ours_d, ref_d):
        assert (a is None and b is None) or torch.equal(a, b)
    assert ours_state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(ours_state[key], value), key
        assert ours_state[key].dtype == value.dtype, key


def test_a_differentiable_group_steps_beside_fused_ones():
    """Each group is stepped as it says: one with differentiable=False takes the fused op
    (no graph) beside differentiable ones, each matching torch.optim's step of it."""
    leaves, ref_leaves = model_params(), model_params()
    ours = optim.AdamW([{"params": leaves[:2], "differentiable": False},
                        {"params": [p * 1.0 for p in leaves[2:]]}], lr=0.01, differentiable=True)
    theirs = [torch.optim.AdamW(ref_leaves[:2], lr=0.01),
              torch.optim.AdamW([p * 1.0 for p in ref_leaves[2:]], lr=0.01, differentiable=True)]
    ours_params = [p for g in ours.param_groups for p in g["params"]]
    ref_params = [p for opt in theirs for p in opt.param_groups[0]["params"]]
    for step in range(3):
        for p, r, g in zip(ours_params, ref_params, grads_for(ours_params, step)):
            p.grad, r.grad = g.clone(), g.clone()
        for opt in [ours] + theirs:
            opt.step()
    for group, ref in zip(ours.param_groups, theirs):
        for p, r in zip(group["params"], ref.param_groups[0]["params"]):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
            assert (p.grad_fn is not None) == group["differentiable"]


@pytest.mark.parametrize("extra, why", [
    (dict(master="kahan"), "not master='kahan'"),
    (dict(master="remainder"), "not master='remainder'"),
    (dict(state_dtype=torch.bfloat16), "not state_dtype=torch.bfloat16"),
    (dict(state_dtype=torch.float8_e4m3fn), "not state_dtype=torch.float8_e4m3fn"),
    (dict(precision_report=True), "not precision_report"),
    ({}, r"not fp32 masters of fp16/bf16 parameters \(master='fp32'; master='none'")])
def test_differentiable_refuses_what_torchs_step_cannot_keep(extra, why):
    """A differentiable group is stepped by torch.optim's implementation: the lean modes,
    other state dtypes, the precision report and fp32 masters of bf16 parameters are
    refused, naming them, at construction, in add_param_group and in configure, with
    nothing changed."""
    message = f"differentiable=True steps with torch.optim's own implementation.*{why}"
    bf16 = model_params(torch.bfloat16)
    with pytest.raises(ValueError, match=f"AdamW: {message}"):
        optim.AdamW(bf16, differentiable=True, **extra)
    opt = optim.AdamW(bf16[:2], **extra)
    train(opt, bf16[:2], 1)
    before = state_dict_snapshot(bf16[:2], opt)
    with pytest.raises(ValueError, match=f"AdamW: {message}"):
        opt.add_param_group({"params": bf16[2:], "differentiable": True})
    assert len(opt.param_groups) == 1
    assert_state_dict_unchanged(bf16[:2], opt, before)
    if "master" not in extra and "state_dtype" not in extra:  # (configure changes those)
        return
    opt = optim.AdamW(model_params(torch.bfloat16), differentiable=True, master="none")
    with pytest.raises(ValueError, match=f"AdamW.configure: param group 0: {message}"):
        opt.configure(**{k: v for k, v in extra.items() if k != "precision_report"})
    assert (opt.master, opt.state_dtype) == ("none", torch.float32)


def strided_bf16(rows=6, seed=1):
    """A bf16 parameter that is every other column of a larger tensor: not dense."""
    base = torch.randn(rows, 10, generator=torch.Generator().manual_seed(seed))
    return torch.nn.Parameter(base.to(torch.bfloat16)[:, ::2])


@pytest.mark.parametrize("extra, why", [
    ({}, "not master='fp32'"),
    (dict(master="remainder"), "not master='remainder'"),
    (dict(master="none", state_dtype=torch.float8_e4m3fn),
     "not state_dtype=torch.float8_e4m3fn"),
    (dict(master="none", precision_report=True), "does not count for the precision report")])
def test_strided_bf16_parameters_refuse_what_torchs_step_cannot_keep(extra, why):
    """A parameter the fused ops do not take (not dense) is stepped by torch.optim's
    implementation, which keeps it as it is, with state of its dtype: fp32 masters, the
    bf16 modes, 8-bit state and the precision report are refused for an fp16/bf16 one,
    naming them and the fixes, at construction, in add_param_group, in configure and in
    a step after the parameter became one, with nothing changed (they were dropped)."""
    message = (r"a torch.bfloat16 parameter of shape \(6, 5\) is not dense \(strides "
               r"\(10, 2\)\), which the fused ops do not take, so it needs torch.optim's "
               f"implementation of the step, .*{why}" + r" \(make it contiguous or use "
               r"master='none' and state_dtype=torch.bfloat16\)")
    with pytest.raises(ValueError, match=f"^AdamW: {message}"):
        optim.AdamW([strided_bf16()], **extra)
    dense = model_params(torch.bfloat16)
    opt = optim.AdamW(dense, **extra)
    train(opt, dense, 1)
    before = state_dict_snapshot(dense, opt)
    with pytest.raises(ValueError, match=f"^AdamW: {message}"):
        opt.add_param_group({"params": [strided_bf16()]})
    assert len(opt.param_groups) == 1
    p = dense[0]  # now every other column of a larger tensor
    p.data = torch.randn(7, 10).to(torch.bfloat16)[:, ::2]
    p.grad = torch.ones_like(p)
    before = state_dict_snapshot(dense, opt)
    with pytest.raises(ValueError, match=r"^AdamW.step: a torch.bfloat16 parameter of shape "
                                         r"\(7, 5\) is not dense"):
        opt.step()
    assert_state_dict_unchanged(dense, opt, before)
    if "precision_report" in extra:  # (configure sets master and state_dtype)
        return
    opt = optim.AdamW([strided_bf16()], master="none", state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"^AdamW.configure: param group 0: {message}"):
        opt.configure(**{"master": "fp32", **extra})
    assert (opt.master, opt.state_dtype) == ("none", torch.bfloat16)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_strided_bf16_parameters_step_as_torch_without_masters(name, state_dtype):
    """What is kept: with master="none" and the default state or the parameter's dtype,
    torch.optim's step of the parameter as it is (state in bf16, as torch's)."""
    ours_cls, torch_cls = PAIRS[name]
    ours, ref = strided_bf16(), strided_bf16()
    a = ours_cls([ours], lr=0.01, master="none", state_dtype=state_dtype)
    b = torch_cls([ref], lr=0.01, foreach=False)
    for step in range(3):
        g = torch.randn(6, 5, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        ours.grad, ref.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert torch.equal(ours, ref)
    assert all(v.dtype == torch.bfloat16 for v in a.state[ours].values()
               if isinstance(v, torch.Tensor) and v.dim())


def test_tensor_hyperparameters_refuse_fp32_masters_of_bf16_parameters():
    """A group with a tensor where the fused ops take a number (Adam's betas) is torch's
    to step: its bf16 parameters get no fp32 masters there, which is refused, naming it;
    master="none" steps them as torch.optim does."""
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    with pytest.raises(ValueError, match=r"^AdamW: a torch.bfloat16 parameter of shape "
                                         r"\(7, 5\) is in a param group with a tensor where "
                                         r"the fused ops take a number, .*not master='fp32' "
                                         r"\(use master='none' and state_dtype=torch.bfloat16\)"):
        optim.AdamW(model_params(torch.bfloat16), betas=betas)
    params = model_params(torch.bfloat16)
    train(optim.AdamW(params, betas=betas, master="none"), params, 2)


@pytest.mark.parametrize("key,value", [
    ("betas", (torch.tensor(0.9), torch.tensor(0.999))),
    ("eps", torch.tensor(1e-8)),
    ("weight_decay", torch.tensor(0.01)),
])
def test_a_tensor_setting_after_fused_steps_refuses_their_fp32_moments(key, value):
    """master="none" with bf16 parameters keeps fp32 moments in the fused steps; a tensor
    setting then sends one group to torch's implementation, which takes state of the
    parameter's dtype only: it failed after the other group had stepped and
    applied_steps had advanced (failed before its fix). Refused before anything
    changes, naming the group and the setting; numbers again, it steps."""
    params = model_params(torch.bfloat16)
    opt = optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], master="none")
    train(opt, params, 2)
    opt.param_groups[1][key] = value
    for p, g in zip(params, grads_for(params, 2)):
        p.grad = g
    before = state_dict_snapshot(params, opt)
    steps = [float(s["step"]) for s in opt.state.values()]
    with pytest.raises(ValueError, match=rf"^AdamW.step: a torch.bfloat16 parameter .* "
                                         rf"not the torch.float32 'exp_avg' its fused steps "
                                         rf"made \(set {key} of param group 1 as numbers\)"):
        opt.step()
    assert_state_dict_unchanged(params, opt, before)
    assert int(opt.applied_steps) == 2
    assert [float(s["step"]) for s in opt.state.values()] == steps
    opt.param_groups[1][key] = optim.AdamW([torch.zeros(1)]).defaults[key]
    opt.step()
    assert int(opt.applied_steps) == 3


def test_in_backward_refuses_a_differentiable_group():
    params = model_params()
    opt = optim.AdamW([{"params": params[:2]}, {"params": params[2:], "differentiable": True}])
    with pytest.raises(ValueError, match="in_backward: AdamW has a param group with "
                                         "differentiable=True"):
        optim.in_backward(opt)
    assert opt.in_backward is None


@pytest.mark.parametrize("master", ["fp32", "remainder", "kahan", "stochastic", "none"])
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_every_master_mode_compiles_in_one_graph(name, master):
    """fullgraph=True in each master mode, equal to the eager steps (stochastic rounding
    broke the graph on a bool() of a list)."""
    ours_cls, _ = PAIRS[name]
    kwargs = dict(momentum=0.9) if name == "SGD" else {}
    if master == "stochastic":
        kwargs["seed"] = 3
    results = eager_and_compiled_steps(lambda ps: ours_cls(ps, lr=0.01, master=master,
                                                           **kwargs))
    for a, b in zip(*results):
        assert torch.equal(a, b)
