"""Bad inputs to mixedprec.optim's torch-named optimizers raise an error that names them
and change nothing (load_state_dict and step check everything before they write);
checkpoints of one master mode load into another exactly, or are refused; and the
state-dict behaviours of torch.optim that PyTorch's own tests found missing (an Adam state
dict in AdamW, a torch-implemented group's step counts, the step's dtype)."""

import copy

import pytest
import torch
from helpers import assert_bitwise_equal, state_dict_snapshot

from mixedprec import optim
from mixedprec.masters import join_remainder, split_remainder

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
MODES = ("fp32", "none", "kahan", "stochastic", "remainder")


def new_params(device="cpu", dtype=BF16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
            for shape in ((64, 64), (7,), (3, 5))]


def feed(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)


def assert_params_and_state_same(before, after):
    """The params and every state tensor of two snapshots, bit for bit (the groups may
    differ: a test changed them)."""
    for a, b in zip(before[0], after[0]):
        assert_bitwise_equal(a, b, "param")
    for key, state in before[1]["state"].items():
        for name, value in state.items():
            assert_bitwise_equal(value, after[1]["state"][key][name], f"state {key} {name}")


def assert_same(before, after):
    (params_a, sd_a), (params_b, sd_b) = before, after
    for a, b in zip(params_a, params_b):
        assert_bitwise_equal(a, b, "param")
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for key, state in sd_a["state"].items():
        assert state.keys() == sd_b["state"][key].keys()
        for name, value in state.items():
            other = sd_b["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(value, other, f"state[{key}][{name}]")
            else:
                assert value == other
    assert_bitwise_equal(sd_a["applied_steps"], sd_b["applied_steps"], "applied_steps")


# --- load_state_dict: checked first, then written --------------------------------------

@pytest.mark.parametrize("value", [1.5, float("nan"), -1.0, "x", torch.tensor(2.5),
                                   torch.tensor([1.0, 2.0])])
@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW])
def test_a_bad_step_count_is_refused_with_nothing_loaded(cls, value):
    params = new_params()
    opt = cls(params, lr=1e-3)
    for step in range(2):
        feed(params, step)
        opt.step()
    saved = opt.state_dict()
    other = cls(params, lr=1e-2)  # another lr: a partial load would show in the groups
    feed(params, 5)
    other.step()
    before = state_dict_snapshot(params, other)
    bad = copy.deepcopy(saved)
    bad["state"][2]["step"] = value  # the last param: the others would load first
    with pytest.raises(ValueError, match=r"load_state_dict: state\[2\]\['step'\] must be a "
                                         "whole number >= 0"):
        other.load_state_dict(bad)
    assert_same(before, state_dict_snapshot(params, other))
    other.load_state_dict(saved)  # and a good one still loads
    assert other.param_groups[0]["lr"] == 1e-3


def _drop(key, param=2):
    return lambda state: state[param].pop(key)


def _set(key, value, param=2):
    return lambda state: state[param].__setitem__(
        key, value(state[param][key]) if callable(value) else value)


@pytest.mark.parametrize("cls, kwargs, edit, match", [
    (optim.AdamW, {}, _drop("step"), r"state of param 2 has no 'step'"),
    (optim.AdamW, {}, _drop("exp_avg"), r"state of param 2 has no 'exp_avg'"),
    (optim.AdamW, {}, _drop("exp_avg_sq"), r"has no 'exp_avg_sq' or 'exp_avg_sq_root'"),
    (optim.AdamW, dict(state_dtype=E4M3, seed=1), _drop("exp_avg_sq_root", param=0),
     r"state of param 0 has no 'exp_avg_sq' or 'exp_avg_sq_root'"),
    (optim.Adagrad, {}, _drop("sum"), r"state of param 2 has no 'sum'"),
    (optim.LAMB, {}, _drop("exp_avg_sq"), r"state of param 2 has no 'exp_avg_sq'"),
    (optim.AdamW, {}, _set("exp_avg", 5), r"state\[2\]\['exp_avg'\] must be a dense tensor, "
                                          "got int"),
    (optim.AdamW, {}, _set("exp_avg", torch.Tensor.to_sparse),
     r"state\[2\]\['exp_avg'\] must be a dense tensor, got a tensor of layout "
     "torch.sparse_coo"),
    (optim.SGD, dict(momentum=0.9), _set("momentum_buffer", "x"),
     r"\['momentum_buffer'\] must be a tensor or None, got str"),
])
def test_a_truncated_or_edited_state_is_refused_with_nothing_loaded(cls, kwargs, edit, match):
    """Before: a missing step count restarted at 1 over the old moments (the wrong bias
    correction), a missing moment restarted at zero, and an int or a sparse moment failed
    at the next step, all after load_state_dict had accepted them. torch.optim raises
    KeyError for the missing ones, at load or at the step."""
    params = new_params()
    opt = cls(params, lr=1e-3, **kwargs)
    for step in range(2):
        feed(params, step)
        opt.step()
    before = state_dict_snapshot(params, opt)
    bad = copy.deepcopy(opt.state_dict())
    edit(bad["state"])  # (mostly the last param: the others would load first)
    with pytest.raises(ValueError, match=f"{cls.__name__}.load_state_dict: .*{match}"):
        opt.load_state_dict(bad)
    assert_same(before, state_dict_snapshot(params, opt))


@pytest.mark.parametrize("bad, match", [
    (dict(state=None), "expected 'state' to be a dict"),
    (dict(param_groups=[{"lr": 0.1}]), "'param_groups' a list of dicts with 'params'"),
    (dict(state={2: [1.0]}), "the state of param 2 must be a dict, got list")])
def test_a_malformed_state_dict_is_refused_naming_what_it_lacks(bad, match):
    """Before: AttributeError, KeyError or TypeError from inside the load."""
    params = new_params()
    opt = optim.AdamW(params, lr=1e-3)
    feed(params, 0)
    opt.step()
    before = state_dict_snapshot(params, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(dict(opt.state_dict(), **bad))
    assert_same(before, state_dict_snapshot(params, opt))


def test_8bit_moments_with_amsgrad_are_refused_by_load_state_dict():
    params = new_params()
    opt = optim.Adam(params, lr=1e-3, state_dtype=E4M3, seed=1)
    feed(params, 0)
    opt.step()
    before = state_dict_snapshot(params, opt)
    bad = opt.state_dict()
    bad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"load_state_dict: amsgrad=True is not supported "
                                         "with state_dtype=torch.float8_e4m3fn"):
        opt.load_state_dict(bad)
    assert_same(before, state_dict_snapshot(params, opt))
    assert opt.param_groups[0]["amsgrad"] is False


def test_adamw_keeps_decoupled_weight_decay_when_loading_an_adam_state_dict():
    """As torch.optim.AdamW (PyTorch's test_adamw_serialization): the loaded groups stay
    AdamW's, and the steps after are torch.optim.AdamW's after the same load."""
    params = new_params(dtype=F32)
    adam = optim.Adam(params, lr=1e-2, weight_decay=0.1)
    feed(params, 0)
    adam.step()
    saved = adam.state_dict()
    assert saved["param_groups"][0]["decoupled_weight_decay"] is False
    ours, theirs = new_params(dtype=F32, seed=3), new_params(dtype=F32, seed=3)
    mine, torchs = optim.AdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    mine.load_state_dict(copy.deepcopy(saved))
    torchs.load_state_dict(copy.deepcopy(saved))
    assert mine.param_groups[0]["decoupled_weight_decay"] is True
    assert torchs.param_groups[0]["decoupled_weight_decay"] is True
    for step in range(3):
        feed(ours, step)
        feed(theirs, step)
        mine.step()
        torchs.step()
    for a, b in zip(ours, theirs):  # (torch's vector kernels may contract FMAs: not bitwise)
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    old = copy.deepcopy(saved)  # an AdamW state dict older than the key
    del old["param_groups"][0]["decoupled_weight_decay"]
    mine.load_state_dict(old)
    assert mine.param_groups[0]["decoupled_weight_decay"] is True


def test_master_none_is_refused_not_taken_for_none():
    with pytest.raises(ValueError, match=r"Adam: expected master to be one of \['fp32', "
                                         r"'none', .*got None"):
        optim.Adam(new_params(), master=None)


# --- step: every group checked before any is updated ---------------------------------

@pytest.mark.parametrize("bad, match", [
    (dict(lr=torch.tensor([1e-3, 1e-3])), r"param group 1: expected a tensor lr to hold one "
                                          "floating-point value, got torch.float32 of shape "
                                          r"\(2,\)"),
    (dict(lr=torch.tensor(1, dtype=torch.int64)), "param group 1: expected a tensor lr to "
                                                  "hold one floating-point value"),
    (dict(lr=float("nan")), "param group 1: expected lr to be a finite number >= 0 or a "
                            "tensor, got nan"),
    (dict(lr="0.1"), "param group 1: expected lr to be a finite number >= 0 or a tensor, "
                       "got '0.1'"),
    (dict(eps=-1.0), "param group 1: .*Invalid epsilon value: -1.0"),
    (dict(betas=(0.9, 1.5)), r"param group 1: .*Invalid beta parameter at index 1: 1.5"),
    (dict(weight_decay=-0.1), "param group 1: .*Invalid weight_decay value: -0.1"),
    (dict(differentiable=True), "param group 1: differentiable=True steps with torch.optim's "
                                "own implementation.*not fp32 masters of fp16/bf16")])
@pytest.mark.parametrize("planned", [False, True])
def test_a_bad_group_is_refused_before_any_group_is_updated(bad, match, planned):
    params = new_params()
    opt = optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    if planned:  # (the planned path, which reuses the op calls, checks the same)
        feed(params, 0)
        opt.step()
    before = state_dict_snapshot(params, opt)
    opt.param_groups[1].update(bad)
    feed(params, 1)
    with pytest.raises(ValueError, match=f"AdamW.step: {match}"):
        opt.step()
    assert_params_and_state_same(before, state_dict_snapshot(params, opt))


@pytest.mark.parametrize("cls, kwargs, key, value, error, match", [
    (optim.LAMB, {}, "grad_averaging", "yes", TypeError, "expected grad_averaging to be a bool"),
    (optim.NovoGrad, {}, "init_zero", None, TypeError, "expected init_zero to be a bool"),
    (optim.AdamW, dict(master="stochastic", seed=1), "seed", "1", TypeError,
     "expected seed to be an int"),
    (optim.SGD, dict(momentum=0.9, master="stochastic", seed=1), "seed", 2**70, ValueError,
     r"expected seed in \[0, 2\*\*63\)"),
    (optim.AdamW, {}, "lr", torch.tensor(1e-3, device="meta"), ValueError,
     "expected a tensor lr .* on the meta device"),
    (optim.AdamW, {}, "betas", (0.9,), ValueError, "expected betas to be two numbers")])
def test_other_group_values_are_refused_before_any_group_steps(cls, kwargs, key, value, error,
                                                                match):
    """Before: the op (or torch's constructor) raised a bare dispatcher error, a meta copy
    error or an IndexError, the first three after group 0 had stepped."""
    assert_refused_at_step(cls, kwargs, key, value, error, match, planned=True)


def assert_refused_at_step(cls, kwargs, key, value, error, match, planned):
    """Group 1 of two given ``key=value``: the step raises ``error`` matching ``match``
    (after "Class.step: param group 1: ") with nothing changed and no state made, after
    a first step (``planned``: the next one reuses its op calls) or before any."""
    params = new_params()
    opt = cls([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3, **kwargs)
    if planned:
        feed(params, 0)
        opt.step()
    before = state_dict_snapshot(params, opt)
    opt.param_groups[1][key] = value
    feed(params, 1)
    with pytest.raises(error, match=f"{cls.__name__}.step: param group 1: {match}"):
        opt.step()
    assert_params_and_state_same(before, state_dict_snapshot(params, opt))
    assert len(opt.state) == len(before[1]["state"])  # (no state made for the refused step)


def test_a_group_without_gradients_takes_any_setting():
    """A group that steps nothing takes any value, as torch's step does (PyTorch's
    test_cycle_lr_with_adam cycles beta1 over 1..22 without gradients); the same value
    is refused, with nothing changed, at the first step that would update the group."""
    params = new_params()
    opt = optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    feed(params, 0)
    opt.step()
    opt.param_groups[1]["betas"] = (22.0, 0.999)
    params[2].grad = None
    opt.step()  # (group 1 has no gradient: nothing of it changes)
    before = state_dict_snapshot(params, opt)
    feed(params, 1)
    with pytest.raises(ValueError, match="Adam.step: param group 1: Invalid beta parameter"):
        opt.step()
    assert_params_and_state_same(before, state_dict_snapshot(params, opt))


# Values torch's constructors take (inf; NaN where they test only `< 0`; a third beta)
# but the fused ops refuse: before, the op refused them inside step, after the earlier
# groups had stepped and every group's state had been made.
OP_REFUSED = [
    (optim.AdamW, {}, "eps", float("inf")), (optim.Adam, {}, "weight_decay", float("inf")),
    (optim.Adam, {}, "betas", (0.9, 0.99, 0.5)),
    (optim.SGD, dict(momentum=0.9), "momentum", float("nan")),
    (optim.SGD, dict(momentum=0.9), "momentum", float("inf")),
    (optim.SGD, {}, "weight_decay", float("nan")), (optim.Adagrad, {}, "eps", float("inf")),
    (optim.LAMB, {}, "eps", float("inf")), (optim.NovoGrad, {}, "weight_decay", float("inf"))]


@pytest.mark.parametrize("cls, kwargs, key, value", OP_REFUSED)
@pytest.mark.parametrize("planned", [False, True])
def test_a_group_value_the_op_refuses_is_refused_before_any_group_steps(cls, kwargs, key, value,
                                                                         planned):
    assert_refused_at_step(cls, kwargs, key, value, ValueError, f"expected {key}", planned)


@pytest.mark.parametrize("cls, kwargs, key, value", OP_REFUSED)
def test_a_value_the_op_refuses_is_refused_at_construction(cls, kwargs, key, value):
    with pytest.raises(ValueError, match=f"{cls.__name__}: expected {key}"):
        cls(new_params(), lr=1e-3, **dict(kwargs, **{key: value}))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e-3])
@pytest.mark.parametrize("cls, kwargs", [(optim.AdamW, {}), (optim.SGD, dict(momentum=0.9)),
                                         (optim.AdamW, dict(master="stochastic", seed=1))])
def test_a_bad_tensor_lr_skips_the_update_on_the_device(device, cls, kwargs, value):
    """A tensor lr is read on the device only: one that is not a finite number >= 0
    (written by hand) skips that group's update there, as an overflow does, instead of
    writing NaN into the weights; a good one in the next step steps again."""
    params = new_params(device)
    lr = torch.tensor(1e-3, device=device)
    opt = cls(params, lr=lr, **kwargs)
    feed(params, 0)
    opt.step()
    before = state_dict_snapshot(params, opt)
    lr.fill_(value)
    feed(params, 1)
    opt.step()
    assert_params_and_state_same(before, state_dict_snapshot(params, opt))
    lr.fill_(1e-3)
    opt.step()
    assert not torch.equal(params[0].detach(), before[0][0])


# --- master modes: a checkpoint of one mode in another ----------------------------------

def _trained(cls, kwargs, master, steps=3):
    params = new_params()
    opt = cls(params, lr=1e-2, master=master, **kwargs)
    for step in range(steps):
        feed(params, step)
        opt.step()
    return params, opt


def _whole(opt, p, master):
    """The fp32 value the optimizer keeps of bf16 ``p``."""
    state = opt.state[p]
    if master == "fp32":
        return state["master_param"]
    if master == "remainder":
        return join_remainder(p.detach(), state["remainder"])
    return p.detach().float() + state["kahan_comp"].float()


OPTIMIZERS = [pytest.param(optim.AdamW, dict(weight_decay=0.01), id="AdamW"),
              pytest.param(optim.SGD, dict(momentum=0.9), id="SGD")]


@pytest.mark.parametrize("source, target", [("fp32", "remainder"), ("remainder", "fp32"),
                                            ("kahan", "fp32"), ("kahan", "remainder")])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_a_checkpoint_loads_into_another_master_mode_exactly(cls, kwargs, source, target):
    """The loaded optimizer continues from the checkpoint's own fp32 values, bit for bit:
    its fp32 values after each step are those of the original optimizer continued
    (fp32 and remainder keep the same update of the same value), and its moments
    too. Kahan continues another way, so a Kahan checkpoint is compared through an
    fp32 optimizer that loaded it."""
    params, opt = _trained(cls, kwargs, source)
    start = [_whole(opt, p, source).clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    model = [p.detach().clone() for p in params]
    reference = "fp32" if source == "kahan" else source
    runs = {}
    for master in {target, reference}:
        ps = [m.clone().requires_grad_() for m in model]
        other = cls(ps, lr=1e-2, master=master, **kwargs)
        other.load_state_dict(copy.deepcopy(saved))
        runs[master] = (ps, other)
    # the first value each run starts its update from is the checkpoint's
    for master, (ps, other) in runs.items():
        feed(ps, 10)
        other.step()
    for step in range(11, 14):
        for master, (ps, other) in runs.items():
            feed(ps, step)
            other.step()
    (ps_t, opt_t), (ps_r, opt_r) = runs[target], runs[reference]
    for p_t, p_r, first in zip(ps_t, ps_r, start):
        assert_bitwise_equal(_whole(opt_t, p_t, target), _whole(opt_r, p_r, reference), "value")
        state_t, state_r = opt_t.state[p_t], opt_r.state[p_r]
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "step"):
            if key in state_r:
                assert_bitwise_equal(state_t[key], state_r[key], key)
        assert not torch.equal(_whole(opt_t, p_t, target), first)  # (it stepped)


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_an_fp32_checkpoint_in_remainder_mode_splits_the_masters_at_the_first_step(cls,
                                                                                     kwargs):
    """Before the first step the masters stay in the state (the model may be loaded
    after the optimizer); at it, each parameter takes its master's high half and the
    remainder the rest: they join to the master bit for bit."""
    params, opt = _trained(cls, kwargs, "fp32")
    masters = [opt.state[p]["master_param"].clone() for p in params]
    ps = [p.detach().clone().requires_grad_() for p in params]
    other = cls(ps, lr=1e-2, master="remainder", **kwargs)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    other.param_groups[0]["lr"] = 0.0  # (the values stay)
    assert all("master_param" in other.state[p] for p in ps)
    feed(ps, 0)
    other.step()
    for p, master in zip(ps, masters):
        high, remainder = split_remainder(master)
        assert "master_param" not in other.state[p]
        assert_bitwise_equal(p.detach(), high, "param")
        assert_bitwise_equal(other.state[p]["remainder"], remainder, "remainder")


@pytest.mark.parametrize("source, target", [
    (source, target) for source in ("fp32", "remainder", "kahan") for target in MODES
    if target != source and target in {"fp32": ("none", "kahan", "stochastic"),
                                       "remainder": ("none", "kahan", "stochastic"),
                                       "kahan": ("none", "stochastic")}[source]])
def test_a_checkpoint_that_a_mode_cannot_keep_exactly_is_refused(source, target):
    params, opt = _trained(optim.AdamW, {}, source, steps=1)
    ps = [p.detach().clone().requires_grad_() for p in params]
    other = optim.AdamW(ps, lr=1e-2, master=target, seed=2 if target == "stochastic" else None)
    feed(ps, 0)
    other.step()
    before = state_dict_snapshot(ps, other)
    with pytest.raises(ValueError, match=f"which master='{target}' cannot keep exactly; load "
                                         "it into an optimizer with master in"):
        other.load_state_dict(opt.state_dict())
    assert_same(before, state_dict_snapshot(ps, other))


# --- what PyTorch's test_optim found on CUDA, reproduced on the CPU ---------------------

@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW])
def test_a_torch_stepped_group_continues_identically_after_a_state_dict_round_trip(cls,
                                                                                   device):
    """Tensor betas send a group to torch's implementation, which advances each
    parameter's own step count: a loaded state must not share one count between
    parameters there (it was advanced once per parameter: PyTorch's
    test_state_dict_deterministic on CUDA, whose optim inputs have tensor betas)."""
    kwargs = dict(lr=torch.tensor(1e-3), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    weight = torch.randn(2, 3, device=device, requires_grad=True)
    bias = torch.randn(2, device=device, requires_grad=True)
    x = torch.randn(3, device=device)

    def closure(opt, w, b):
        opt.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        return loss

    opt = cls([weight, bias], **kwargs)
    for _ in range(5):
        opt.step(lambda: closure(opt, weight, bias))
    weight_c = weight.detach().clone().requires_grad_()
    bias_c = bias.detach().clone().requires_grad_()
    opt_c = cls([weight_c, bias_c], **kwargs)
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(5):
        opt.step(lambda: closure(opt, weight, bias))
        opt_c.step(lambda: closure(opt_c, weight_c, bias_c))
        assert_bitwise_equal(weight_c.detach(), weight.detach(), "weight")
        assert_bitwise_equal(bias_c.detach(), bias.detach(), "bias")
    steps = [opt_c.state[p]["step"] for p in (weight_c, bias_c)]
    assert steps[0] is not steps[1] and all(float(s) == 10 for s in steps)


@pytest.mark.parametrize("default, expected", [(torch.float16, torch.float32),
                                               (torch.float64, torch.float64)])
def test_torch_implemented_steps_count_in_torchs_dtype(default, expected):
    """float64 parameters go to torch's implementation, whose step count is float32
    unless the default dtype is float64 (PyTorch's
    test_set_default_dtype_works_with_foreach)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        p = torch.randn(3, dtype=torch.float64, requires_grad=True)
        opt = optim.Adam([p])
        p.grad = torch.ones_like(p)
        opt.step()
    finally:
        torch.set_default_dtype(previous)
    assert opt.state[p]["step"].dtype == expected


def test_a_conversion_of_a_tensor_subclass_parameter_is_refused():
    """The exact conversions split plain tensors; a subclass (a DTensor, whose local
    shard would have to be split) is refused with nothing loaded, not dropped."""
    class Sharded(torch.Tensor):
        pass

    params, opt = _trained(optim.AdamW, {}, "fp32", steps=1)
    ps = [torch.nn.Parameter(p.detach().clone().as_subclass(Sharded)) for p in params]
    other = optim.AdamW(ps, lr=1e-2, master="remainder")
    with pytest.raises(ValueError, match="takes from master='fp32' exactly for plain tensors "
                                         "only, not for a Sharded parameter"):
        other.load_state_dict(opt.state_dict())
    assert other.state == {}


# --- what torch's implementation would fail on, after the fused part had stepped --------

@pytest.mark.parametrize("cls, kwargs, match", [
    (optim.SGD, dict(momentum=0.9, weight_decay=0.1), "does not take weight_decay=0.1"),
    (optim.SGD, dict(momentum=0.9, nesterov=True), "nesterov=True over a dense momentum"),
    (optim.Adagrad, dict(weight_decay=0.1), "weight_decay option is not compatible with sparse"),
])
def test_a_sparse_gradient_torch_cannot_step_is_refused_first(cls, kwargs, match):
    """Before: the dense parameters, their state and applied_steps were updated, then
    torch's own step of the sparse gradient raised (add(sparse, dense), or Adagrad's
    refusal); torch.optim fails on the same inputs."""
    dense, sparse = (torch.randn(4, 3, requires_grad=True) for _ in range(2))
    opt = cls([dense, sparse], lr=0.1, **kwargs)
    dense.grad, sparse.grad = torch.randn(4, 3), torch.randn(4, 3)
    opt.step()  # (dense momentum buffers for both)
    before = state_dict_snapshot([dense, sparse], opt)
    dense.grad, sparse.grad = torch.randn(4, 3), torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert_same(before, state_dict_snapshot([dense, sparse], opt))
    theirs = torch.optim.SGD if cls is optim.SGD else torch.optim.Adagrad
    torch_opt = theirs([dense.detach().clone().requires_grad_(),
                        sparse.detach().clone().requires_grad_()], lr=0.1, **kwargs)
    for q, g in zip(torch_opt.param_groups[0]["params"], (torch.randn(4, 3),) * 2):
        q.grad = g
    torch_opt.step()
    torch_opt.param_groups[0]["params"][1].grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError):  # (torch's too, once it reaches that parameter)
        torch_opt.step()


def test_a_sparse_gradient_torch_can_step_still_steps():
    """SGD with momentum (no weight decay, no Nesterov) over a sparse gradient, as torch."""
    ours = [torch.randn(4, 3, requires_grad=True) for _ in range(2)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    mine, torchs = optim.SGD(ours, lr=0.1, momentum=0.9), torch.optim.SGD(theirs, lr=0.1,
                                                                         momentum=0.9)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen).to_sparse()]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        torchs.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_a_parameter_twice_in_a_group_is_refused_before_any_group_steps():
    """torch warns when such a group is added (so does mixedprec: torch's own warning) and
    steps the parameter twice; the fused op refused it inside step(), after the other
    groups had stepped and their state had been made."""
    params = new_params()
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = optim.AdamW([{"params": params[:2]}, {"params": [params[2], params[2]]}], lr=0.1)
    feed(params, 0)
    before = state_dict_snapshot(params, opt)
    with pytest.raises(ValueError, match=r"AdamW.step: a param group holds one parameter twice "
                                         r"\(at 0 and 1\)"):
        opt.step()
    assert_same(before, state_dict_snapshot(params, opt))
    assert not opt.state
