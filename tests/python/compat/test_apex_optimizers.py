"""Apex's optimizers beyond FusedAdam: FusedAdagrad (against torch.optim.Adagrad and a
float64 reference), FusedSGD's Apex options (wd_after_momentum, the lr default,
materialize_master_grads), and amp_C's multi_tensor_adagrad, multi_tensor_sgd with
wd_after_momentum and the capturable Adam entries. Several steps, fp32 params and
fp16/bf16 params over fp32 masters, a GradScaler's skip bit for bit, opcheck, bad
arguments and state_dict round trips."""

import copy
import inspect
import io

import pytest
import torch
from helpers import (
    TOLERANCES,
    adam_state,
    assert_bitwise_equal,
    assert_same_snapshot,
    full_snapshot,
    randn,
    scalar,
)
from references import ref_adagrad, ref_adam, ref_lamb, ref_novograd, ref_sgd
from torch import nn

from mixedprec import GradScaler, amp_C, ops
from mixedprec.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

TIGHT = TOLERANCES[torch.float32]
SHAPES = [(5,), (3, 4), (2, 3, 2, 2), (70,)]
STEPS = 6

MODEL_DTYPES = [
    pytest.param(torch.float32, False, id="fp32"),
    pytest.param(torch.float16, True, id="fp16-masters"),
    pytest.param(torch.bfloat16, True, id="bf16-masters"),
]


def make_params(dtype, device, seed=0):
    """A ParameterList (it has .parameters(), for helpers.full_snapshot)."""
    return nn.ParameterList(
        nn.Parameter(randn(s, torch.float32, "cpu", seed + i, scale=0.5).to(device, dtype))
        for i, s in enumerate(SHAPES))


def set_grads(params, step, scale=1.0):
    """Deterministic gradients of `step`, in each parameter's dtype (times `scale`)."""
    grads = []
    for i, p in enumerate(params):
        g = randn(p.shape, torch.float32, p.device, seed=1000 * (step + 1) + i) * scale
        p.grad = g.to(p.dtype)
        grads.append(p.grad)
    return grads


def targets_of(opt, params):
    """What the optimizer updates: the fp32 masters, or the fp32 params themselves."""
    return [opt.state[p].get("master_param", p).detach() for p in params]


def assert_model_is_cast_masters(opt, params):
    for p in params:
        if "master_param" in opt.state[p]:
            assert_bitwise_equal(p.detach(), opt.state[p]["master_param"].to(p.dtype))


def apex_optimizers():
    """``apex.optimizers`` under mixedprec's alias (installed for the import only)."""
    import importlib
    import sys

    # (importing mixedprec.apex the first time installs the alias)
    installed = "mixedprec.apex" in sys.modules and sys.modules["mixedprec.apex"].is_installed()
    import mixedprec.apex as alias
    alias.install()
    try:
        return importlib.import_module("apex.optimizers")
    finally:
        if not installed:
            alias.uninstall()


# --- FusedAdagrad ------------------------------------------------------------------------

ADAGRAD_CONFIGS = [
    pytest.param({"lr": 0.1}, id="plain"),
    pytest.param({"lr": 0.05, "weight_decay": 1e-2}, id="l2"),
    pytest.param({"lr": 0.1, "eps": 1e-6, "weight_decay": 1e-1}, id="eps-l2"),
]


def test_fused_adagrad_signature_follows_apex():
    sig = inspect.signature(FusedAdagrad).parameters
    assert list(sig) == ["params", "lr", "eps", "weight_decay", "set_grad_none",
                         "adagrad_w_mode", "master_weights"]
    assert {k: v.default for k, v in sig.items() if k != "params"} == {
        "lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "set_grad_none": True,
        "adagrad_w_mode": False, "master_weights": False}
    assert issubclass(FusedAdagrad, torch.optim.Optimizer)
    assert FusedAdagrad._step_supports_amp_scaling is True
    assert apex_optimizers().FusedAdagrad is FusedAdagrad


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("config", ADAGRAD_CONFIGS)
def test_fused_adagrad_tracks_torch_adagrad(device, dtype, master_weights, config):
    params = make_params(dtype, device)
    twin = [nn.Parameter(p.detach().float().clone()) for p in params]
    opt = FusedAdagrad(params, master_weights=master_weights, **config)
    twin_opt = torch.optim.Adagrad(twin, foreach=False, **config)
    for step in range(STEPS):
        grads = set_grads(params, step)
        for tp, g in zip(twin, grads):
            tp.grad = g.float()
        opt.step()
        twin_opt.step()
    for p, target, tp in zip(params, targets_of(opt, params), twin):
        assert target.dtype == torch.float32
        torch.testing.assert_close(target, tp.detach(), **TIGHT)
        assert opt.state[p]["sum"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["sum"], twin_opt.state[tp]["sum"], **TIGHT)
    assert ("master_param" in opt.state[params[0]]) == master_weights
    assert_model_is_cast_masters(opt, params)


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 1e-1])
def test_fused_adagrad_w_mode_matches_the_reference(device, dtype, master_weights,
                                                    weight_decay):
    """adagrad_w_mode (no torch counterpart): each of several steps against the
    float64 reference of one step from the optimizer's state before it."""
    params = make_params(dtype, device)
    opt = FusedAdagrad(params, lr=0.05, weight_decay=weight_decay, adagrad_w_mode=True,
                       master_weights=master_weights)
    for step in range(STEPS):
        grads = set_grads(params, step)
        before = [t.clone() for t in targets_of(opt, params)]
        sums = [opt.state[p]["sum"].clone() if "sum" in opt.state[p] else torch.zeros_like(
            t) for p, t in zip(params, before)]
        want_p, want_h = ref_adagrad(before, grads, sums, 0.05, 1e-10, weight_decay,
                                     decoupled_weight_decay=True)
        opt.step()
        for p, target, wp, wh in zip(params, targets_of(opt, params), want_p, want_h):
            torch.testing.assert_close(target.double(), wp, **TIGHT)
            torch.testing.assert_close(opt.state[p]["sum"].double(), wh, **TIGHT)
    assert_model_is_cast_masters(opt, params)


@pytest.mark.parametrize("adagrad_w_mode", [False, True])
@pytest.mark.parametrize("masters", [False, True], ids=["params", "masters"])
def test_fused_adagrad_op_matches_the_reference(device, adagrad_w_mode, masters):
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    sizes = [ops.CHUNK_SIZE + 3, 7, 130]
    if masters:
        params = [randn(n, f32, device, seed=i) for i, n in enumerate(sizes)]
        model = [torch.empty(n, dtype=dt, device=device) for n, dt in zip(sizes, [f16, bf16, f16])]
    else:
        params = [randn(n, dt, device, seed=i) for i, (n, dt) in enumerate(zip(sizes, [f32, f16,
                                                                                     bf16]))]
        model = []
    grads = [randn(n, dt, device, seed=10 + i, scale=256.0)
             for i, (n, dt) in enumerate(zip(sizes, [bf16, f32, f16]))]
    sums = [randn(n, f32, device, seed=20 + i).square() for i, n in enumerate(sizes)]
    want_p, want_h = ref_adagrad(params, grads, sums, 0.05, 1e-8, 1e-2, adagrad_w_mode,
                                 inv_scale=1 / 256)
    ops.fused_adagrad_(params, grads, sums, model, lr=0.05, eps=1e-8, weight_decay=1e-2,
                       decoupled_weight_decay=adagrad_w_mode, inv_scale=scalar(1 / 256, device),
                       found_inf=scalar(0.0, device))
    for i, (p, h) in enumerate(zip(want_p, want_h)):
        tol = TOLERANCES[params[i].dtype]
        torch.testing.assert_close(params[i].double(), p, **tol)
        torch.testing.assert_close(sums[i].double(), h, **TIGHT)
        if masters:
            assert_bitwise_equal(model[i], params[i].to(model[i].dtype))


def test_fused_adagrad_op_skips_on_found_inf(device):
    params = [randn(9, torch.float32, device, 1)]
    grads = [randn(9, torch.float16, device, 2)]
    sums = [randn(9, torch.float32, device, 3).square()]
    model = [torch.zeros(9, dtype=torch.float16, device=device)]
    before = [t.clone() for t in params + sums + model]
    ops.fused_adagrad_(params, grads, sums, model, lr=0.1, found_inf=scalar(1.0, device))
    for a, b in zip(params + sums + model, before):
        assert_bitwise_equal(a, b)


def _scaler_run(device, dtype, master_weights, overflow_at):
    params = make_params(dtype, device, seed=5)
    opt = FusedAdagrad(params, lr=0.05, weight_decay=1e-2, master_weights=master_weights)
    scaler = GradScaler(device, init_scale=2.0**10, growth_interval=1000)
    snapshots = []
    for step in range(4):
        opt.zero_grad()
        # A loss whose gradients are set_grads(params, step), scaled by the scaler.
        loss = sum((p.float() * randn(p.shape, torch.float32, device, seed=1000 * (step + 1) + i))
                   .sum() for i, p in enumerate(params))
        scaler.scale(loss).backward()
        if step == overflow_at:
            params[1].grad.view(-1)[2] = float("inf")
        snapshots.append((full_snapshot(params, opt), scaler.get_scale()))
        scaler.step(opt)
        scaler.update()
    return params, opt, scaler, snapshots


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
def test_fused_adagrad_skips_an_overflowed_step_with_grad_scaler(device, dtype, master_weights):
    params, opt, scaler, snaps = _scaler_run(device, dtype, master_weights, overflow_at=2)
    # The overflowed step (step 2) left everything bit for bit; the scale backed off.
    after_skip, _ = snaps[3]
    assert_same_snapshot(after_skip, snaps[2][0], "after the skipped step")
    assert snaps[3][1] == snaps[2][1] / 2
    # The steps taken are the unscaled ones of an optimizer without a scaler.
    plain_params = make_params(dtype, device, seed=5)
    plain = FusedAdagrad(plain_params, lr=0.05, weight_decay=1e-2, master_weights=master_weights)
    for step in (0, 1, 3):
        set_grads(plain_params, step)
        plain.step()
    for a, b in zip(targets_of(opt, params), targets_of(plain, plain_params)):
        torch.testing.assert_close(a, b, **TIGHT)


# --- FusedSGD as Apex's ------------------------------------------------------------------

@pytest.mark.parametrize("cls, old", [(FusedAdam, "moment_dtype"), (FusedSGD, "momentum_dtype")])
def test_a_renamed_keyword_names_its_new_name(cls, old):
    """A script written before the rename (state_dtype, 2026-11-25) gets an error that
    says what to pass instead; the signature shows only the new name."""
    p = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=f"{cls.__name__}: the keyword argument '{old}' was "
                                        f"renamed 'state_dtype': pass state_dtype=torch.bfloat16"):
        cls([p], **{old: torch.bfloat16})
    assert old not in inspect.signature(cls).parameters
    assert "state_dtype" in inspect.signature(cls).parameters
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        cls([p], bogus=1)
    assert cls([p], state_dtype=torch.bfloat16).state_dtype == torch.bfloat16


def test_fused_sgd_signature_follows_apex_and_torch():
    sig = {k: v for k, v in inspect.signature(FusedSGD).parameters.items()
           if v.kind is not v.KEYWORD_ONLY}  # (master, state_dtype: mixedprec's own)
    assert list(sig) == ["params", "lr", "momentum", "dampening", "weight_decay", "nesterov",
                         "wd_after_momentum", "materialize_master_grads", "set_grad_none",
                         "master_weights"]
    assert sig["lr"].default == inspect.signature(torch.optim.SGD).parameters["lr"].default
    assert {k: v.default for k, v in sig.items() if k not in ("params", "lr")} == {
        "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False,
        "wd_after_momentum": False, "materialize_master_grads": True, "set_grad_none": False,
        "master_weights": False}


def test_fused_sgd_takes_param_groups_without_a_top_level_lr(device):
    """NVIDIA DLRM's FusedSGD(param_groups): every group sets its own lr."""
    params = make_params(torch.float32, device)
    twin = [nn.Parameter(p.detach().clone()) for p in params]
    groups = [{"params": list(params)[:2], "lr": 0.1}, {"params": list(params)[2:], "lr": 0.01}]
    twin_groups = [{"params": twin[:2], "lr": 0.1}, {"params": twin[2:], "lr": 0.01}]
    opt = FusedSGD(groups, momentum=0.9)
    twin_opt = torch.optim.SGD(twin_groups, momentum=0.9, foreach=False)
    for step in range(3):
        grads = set_grads(params, step)
        for tp, g in zip(twin, grads):
            tp.grad = g.clone()
        opt.step()
        twin_opt.step()
    for p, tp in zip(params, twin):
        torch.testing.assert_close(p.detach(), tp.detach(), **TIGHT)
    # A group without an lr takes the default, as in torch.optim.SGD.
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, device=device))]})
    assert opt.param_groups[-1]["lr"] == 1e-3


SGD_WD_CONFIGS = [
    pytest.param({"lr": 0.1, "weight_decay": 1e-1}, id="no-momentum"),
    pytest.param({"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-1}, id="momentum"),
    pytest.param({"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 5e-2},
                 id="dampening"),
    pytest.param({"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-1},
                 id="nesterov"),
]


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("config", SGD_WD_CONFIGS)
def test_fused_sgd_wd_after_momentum_matches_the_reference(device, dtype, master_weights,
                                                           config):
    params = make_params(dtype, device)
    opt = FusedSGD(params, wd_after_momentum=True, master_weights=master_weights, **config)
    kw = {k: v for k, v in config.items() if k != "lr"}
    for step in range(STEPS):
        grads = set_grads(params, step)
        before = [t.clone() for t in targets_of(opt, params)]
        bufs = [opt.state[p].get("momentum_buffer") for p in params]
        want_p, want_b = ref_sgd(before, grads, bufs, config["lr"], first_run=step == 0,
                                 wd_after_momentum=True, **kw)
        opt.step()
        for i, p in enumerate(params):
            torch.testing.assert_close(targets_of(opt, params)[i].double(), want_p[i], **TIGHT)
            if want_b:
                torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), want_b[i],
                                           **TIGHT)
    assert_model_is_cast_masters(opt, params)


@pytest.mark.parametrize("config", SGD_WD_CONFIGS)
def test_fused_sgd_wd_before_momentum_is_torch_sgd(device, config):
    """wd_after_momentum=False (the default) keeps torch.optim.SGD's order, and
    wd_after_momentum=True gives other weights (so the test above can fail)."""
    results = {}
    for after in (False, True):
        params = make_params(torch.float32, device)
        twin = [nn.Parameter(p.detach().clone()) for p in params]
        opt = FusedSGD(params, wd_after_momentum=after, **config)
        twin_opt = torch.optim.SGD(twin, foreach=False, **config)
        for step in range(STEPS):
            grads = set_grads(params, step)
            for tp, g in zip(twin, grads):
                tp.grad = g.clone()
            opt.step()
            twin_opt.step()
        results[after] = (params, twin)
    for p, tp in zip(*results[False]):
        torch.testing.assert_close(p.detach(), tp.detach(), **TIGHT)
    differs = any(not torch.allclose(p, tp, **TIGHT) for p, tp in zip(*results[True]))
    assert differs == ("momentum" in config)  # without momentum the two orders agree


def test_fused_sgd_materialize_master_grads_changes_nothing(device):
    runs = []
    for materialize in (True, False):
        params = make_params(torch.float16, device)
        opt = FusedSGD(params, lr=0.05, momentum=0.9, master_weights=True,
                       materialize_master_grads=materialize)
        assert opt.materialize_master_grads is materialize
        for step in range(3):
            set_grads(params, step)
            opt.step()
        runs.append(full_snapshot(params, opt))
    assert_same_snapshot(runs[0], runs[1], "materialize_master_grads True vs False")


def test_fused_sgd_and_adagrad_options_survive_copies():
    p = [nn.Parameter(torch.zeros(3))]
    sgd = copy.deepcopy(FusedSGD(p, wd_after_momentum=True, materialize_master_grads=False))
    assert sgd.wd_after_momentum is True and sgd.materialize_master_grads is False
    adagrad = copy.deepcopy(FusedAdagrad(p, adagrad_w_mode=True))
    assert adagrad.adagrad_w_mode is True


# --- amp_C ---------------------------------------------------------------------------------

def flag(device, value=0):
    return torch.tensor([value], dtype=torch.int32, device=device)


def tensors(dtype, device, seed, sizes=(5, 130, 3), scale=1.0):
    return [randn(n, dtype, device, seed=seed + i, scale=scale) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("nesterov, dampening", [(False, 0.2), (True, 0.0)])
def test_amp_c_sgd_wd_after_momentum(device, nesterov, dampening):
    g = tensors(torch.float16, device, 1, scale=64.0)
    p = tensors(torch.float32, device, 10)
    mom = tensors(torch.float32, device, 20)
    model = [torch.empty_like(t, dtype=torch.float16) for t in p]
    want_p, want_b = ref_sgd(p, g, mom, 0.1, 0.9, dampening, 1e-1, nesterov, inv_scale=1 / 64,
                             wd_after_momentum=True)
    noop = flag(device)
    amp_C.multi_tensor_sgd(2048, noop, [g, p, mom, model], 1e-1, 0.9, dampening, 0.1, nesterov,
                           False, True, 1 / 64)
    for i in range(len(p)):
        torch.testing.assert_close(p[i].double(), want_p[i], **TIGHT)
        torch.testing.assert_close(mom[i].double(), want_b[i], **TIGHT)
        assert_bitwise_equal(model[i], p[i].half())
    assert noop.item() == 0


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_amp_c_adagrad(device, mode, dtype):
    g = tensors(dtype, device, 1)
    p = tensors(dtype, device, 10)
    h = [t.square().to(dtype) for t in tensors(torch.float32, device, 20)]  # Apex: p's dtype
    want_p, want_h = ref_adagrad(p, g, h, 0.05, 1e-10, 1e-2, decoupled_weight_decay=mode == 1)
    amp_C.multi_tensor_adagrad(2048, flag(device), [g, p, h], 0.05, 1e-10, mode, 1e-2)
    for i in range(len(p)):
        torch.testing.assert_close(p[i].double(), want_p[i], **TOLERANCES[dtype])
        torch.testing.assert_close(h[i].double(), want_h[i], **TOLERANCES[dtype])
        assert h[i].dtype == dtype
    before = [t.clone() for t in p + h]
    noop = flag(device, 1)
    amp_C.multi_tensor_adagrad(2048, noop, [g, p, h], 0.05, 1e-10, mode, 1e-2)
    for a, b in zip(p + h, before):
        assert_bitwise_equal(a, b)
    with pytest.raises(ValueError, match="mode"):
        amp_C.multi_tensor_adagrad(2048, flag(device), [g, p, h], 0.05, 1e-10, 2, 1e-2)
    with pytest.raises(ValueError, match="tensor_lists"):
        amp_C.multi_tensor_adagrad(2048, flag(device), [g, p], 0.05, 1e-10, 0, 1e-2)


def _capturable_args(device, lr, step, inv_scale):
    """Apex's capturable argument tensors: a 0-dim fp32 lr, an int32 step (the step
    number of this update) and a one-element fp32 inv_scale."""
    return (torch.tensor(lr, device=device), torch.tensor([step], dtype=torch.int32,
                                                          device=device),
            torch.tensor([inv_scale], device=device))


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_amp_c_adam_capturable(device, mode, dtype):
    g = tensors(dtype, device, 1, scale=512.0)
    p = tensors(dtype, device, 10)
    m, v = adam_state(p, device, seed=30)
    lr, step, inv_scale = _capturable_args(device, 2e-3, 3, 1 / 512)
    want_p, want_m, want_v, _ = ref_adam(p, g, m, v, 2, 2e-3, 0.9, 0.99, 1e-8, 1e-2,
                                         decoupled_weight_decay=mode == 1, inv_scale=1 / 512)
    g_before = [t.clone() for t in g]
    amp_C.multi_tensor_adam_capturable(2048, flag(device), [g, p, m, v], lr, 0.9, 0.99, 1e-8,
                                       step, mode, 1, 1e-2, inv_scale)
    for i in range(len(p)):
        torch.testing.assert_close(p[i].double(), want_p[i], **TOLERANCES[dtype])
        torch.testing.assert_close(m[i].double(), want_m[i], **TIGHT)
        torch.testing.assert_close(v[i].double(), want_v[i], **TIGHT)
        assert_bitwise_equal(g[i], g_before[i])  # documented: read, not written back
    assert step.item() == 3 and step.dtype == torch.int32  # the caller's step is left alone


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_amp_c_adam_capturable_master(device, half):
    g = tensors(half, device, 1, scale=64.0)
    masters = tensors(torch.float32, device, 10)
    p = [t.to(half) for t in masters]
    m, v = adam_state(masters, device, seed=30)
    lr, step, inv_scale = _capturable_args(device, 1e-3, 1, 1 / 64)
    want_p, want_m, want_v, _ = ref_adam(masters, g, m, v, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                                         decoupled_weight_decay=False, inv_scale=1 / 64)
    amp_C.multi_tensor_adam_capturable_master(2048, flag(device), [g, p, m, v, masters], lr, 0.9,
                                              0.999, 1e-8, step, 0, 1, 0.0, inv_scale)
    for i in range(len(p)):
        torch.testing.assert_close(masters[i].double(), want_p[i], **TIGHT)
        torch.testing.assert_close(m[i].double(), want_m[i], **TIGHT)
        assert_bitwise_equal(p[i], masters[i].to(half))


def test_amp_c_adam_capturable_reads_lr_and_noop_on_the_device(device):
    """A learning rate written into the lr tensor in place (as a scheduler does between
    graph replays) is the one used; a set noop_flag skips the update."""
    g = tensors(torch.float32, device, 1)
    p = tensors(torch.float32, device, 10)
    m, v = adam_state(p, device, seed=30)
    lr, step, inv_scale = _capturable_args(device, 1e-3, 1, 1.0)
    lr.fill_(4e-3)
    want_p, *_ = ref_adam(p, g, m, v, 0, 4e-3, 0.9, 0.999, 1e-8, 0.0, decoupled_weight_decay=True)
    before = [t.clone() for t in p + m + v]
    amp_C.multi_tensor_adam_capturable(2048, flag(device, 1), [g, p, m, v], lr, 0.9, 0.999,
                                       1e-8, step, 1, 1, 0.0, inv_scale)
    for a, b in zip(p + m + v, before):
        assert_bitwise_equal(a, b)
    amp_C.multi_tensor_adam_capturable(2048, flag(device), [g, p, m, v], lr, 0.9, 0.999, 1e-8,
                                       step, 1, 1, 0.0, inv_scale)
    for a, b in zip(p, want_p):
        torch.testing.assert_close(a.double(), b, **TIGHT)


def test_amp_c_capturable_bad_arguments_change_nothing():
    g, p = tensors(torch.float32, "cpu", 1), tensors(torch.float32, "cpu", 10)
    m, v = adam_state(p, "cpu", seed=30)
    lr, step, inv_scale = _capturable_args("cpu", 1e-3, 1, 1.0)
    before = [t.clone() for t in p + m + v]
    fn = amp_C.multi_tensor_adam_capturable
    with pytest.raises(TypeError, match="lr"):
        fn(2048, flag("cpu"), [g, p, m, v], 1e-3, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, inv_scale)
    with pytest.raises(TypeError, match="step"):
        fn(2048, flag("cpu"), [g, p, m, v], lr, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0, inv_scale)
    with pytest.raises(ValueError, match="inv_scale"):
        fn(2048, flag("cpu"), [g, p, m, v], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, torch.ones(2))
    with pytest.raises(ValueError, match="mode"):
        fn(2048, flag("cpu"), [g, p, m, v], lr, 0.9, 0.999, 1e-8, step, 2, 1, 0.0, inv_scale)
    with pytest.raises(ValueError, match="tensor_lists"):
        fn(2048, flag("cpu"), [g, p, m, v, p], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0,
           inv_scale)
    with pytest.raises(ValueError, match="beta1"):
        fn(2048, flag("cpu"), [g, p, m, v], lr, 1.5, 0.999, 1e-8, step, 1, 1, 0.0, inv_scale)
    for a, b in zip(p + m + v, before):
        assert_bitwise_equal(a, b)


# --- the ops' new arguments: opcheck, references, bad arguments -----------------------

def test_opcheck_new_arguments(device):
    f32, f16 = torch.float32, torch.float16
    params = tensors(f32, device, 1)
    grads = tensors(f16, device, 2)
    bufs = tensors(f32, device, 3)
    model = [torch.empty_like(t, dtype=f16) for t in params]
    torch.library.opcheck(torch.ops.mixedprec.fused_sgd_.default,
                          (params, grads, bufs, model, 0.1, 0.9, 0.0, 1e-2, False, False,
                           scalar(0.5, device), scalar(0.0, device), True))
    m, v = adam_state(params, device, seed=4)
    torch.library.opcheck(torch.ops.mixedprec.fused_adam_.default,
                          (params, grads, m, v, model, scalar(2.0, device), 0.0, 0.9, 0.999,
                           1e-8, 1e-2, True, True, None, scalar(0.0, device)),
                          {"lr_tensor": scalar(1e-3, device)})


def test_fused_adam_lr_tensor_replaces_lr(device):
    params = tensors(torch.float32, device, 1)
    grads = tensors(torch.bfloat16, device, 2)
    m, v = adam_state(params, device, seed=4)
    want = ref_adam(params, grads, m, v, 4, 3e-3, weight_decay=1e-2)
    step = scalar(4.0, device)
    ops.fused_adam_(params, grads, m, v, [], step=step, lr=99.0, weight_decay=1e-2,
                    lr_tensor=scalar(3e-3, device))
    for got, ref in zip(params + m + v, want[0] + want[1] + want[2]):
        torch.testing.assert_close(got.double(), ref, **TIGHT)
    with pytest.raises(TypeError, match="lr_tensor"):
        ops.fused_adam_(params, grads, m, v, [], step=step, lr=1e-3,
                        lr_tensor=scalar(1e-3, device, torch.float64))


def test_fused_sgd_op_wd_after_momentum_matches_the_reference(device):
    params = tensors(torch.float32, device, 1)
    grads = tensors(torch.bfloat16, device, 2, scale=8.0)
    bufs = tensors(torch.float32, device, 3)
    want_p, want_b = ref_sgd(params, grads, bufs, 0.1, 0.9, 0.1, 0.2, inv_scale=0.125,
                             wd_after_momentum=True)
    ops.fused_sgd_(params, grads, bufs, [], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.2,
                   inv_scale=scalar(0.125, device), wd_after_momentum=True)
    for got, ref in zip(params + bufs, want_p + want_b):
        torch.testing.assert_close(got.double(), ref, **TIGHT)


ADAGRAD_BAD_OPS = [
    pytest.param(dict(lr=-0.1), ValueError, "lr", id="negative-lr"),
    pytest.param(dict(eps=float("nan")), ValueError, "eps", id="nan-eps"),
    pytest.param(dict(weight_decay=-1.0), ValueError, "weight_decay", id="negative-wd"),
    pytest.param(dict(sums_dtype=torch.float16), TypeError, r"state_sums\[1\]", id="fp16-sums"),
    pytest.param(dict(sums_len=2), ValueError, "state_sums", id="short-sums"),
    pytest.param(dict(half_params_with_model=True), TypeError, r"params\[0\]",
                 id="half-masters"),
    pytest.param(dict(found_inf_dtype=torch.int32), TypeError, "found_inf", id="int-found-inf"),
]


@pytest.mark.parametrize("bad, error, name", ADAGRAD_BAD_OPS)
def test_fused_adagrad_op_bad_arguments_change_nothing(bad, error, name):
    params = tensors(torch.float32, "cpu", 1)
    grads = tensors(torch.float16, "cpu", 2)
    sums = [t.square() for t in tensors(torch.float32, "cpu", 3)]
    model = [torch.zeros_like(t, dtype=torch.float16) for t in params]
    if "sums_dtype" in bad:
        sums[1] = sums[1].to(bad["sums_dtype"])
    if "sums_len" in bad:
        sums = sums[:bad["sums_len"]]
    if bad.get("half_params_with_model"):
        params = [t.half() for t in params]
    found_inf = scalar(0.0, "cpu", bad.get("found_inf_dtype", torch.float32))
    before = [t.clone() for t in params + sums + model]
    with pytest.raises(error, match=name):
        ops.fused_adagrad_(params, grads, sums, model, lr=bad.get("lr", 0.1),
                           eps=bad.get("eps", 1e-10),
                           weight_decay=bad.get("weight_decay", 0.0),
                           decoupled_weight_decay=False,
                           found_inf=found_inf)
    for a, b in zip(params + sums + model, before):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("kwargs, error", [
    pytest.param({"lr": -0.1}, ValueError, id="negative-lr"),
    pytest.param({"eps": -1e-10}, ValueError, id="negative-eps"),
    pytest.param({"weight_decay": float("nan")}, ValueError, id="nan-wd"),
    pytest.param({"lr": torch.tensor(-0.1)}, ValueError, id="negative-tensor-lr"),
    pytest.param({"lr": torch.tensor([0.1, 0.2])}, TypeError, id="two-element-lr"),
    pytest.param({"lr": torch.tensor(1)}, TypeError, id="integer-tensor-lr"),
])
def test_fused_adagrad_bad_constructor_arguments(kwargs, error):
    with pytest.raises(error):
        FusedAdagrad([nn.Parameter(torch.zeros(3))], **kwargs)


def test_fused_adagrad_rejects_float64_and_sparse():
    with pytest.raises(TypeError, match="float64"):
        FusedAdagrad([nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    p = nn.Parameter(torch.zeros(3))
    opt = FusedAdagrad([p])
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


# --- state_dict -----------------------------------------------------------------------------

def resume_through_torch_save(cls, dtype, device, **config):
    """``cls(params, **config)`` after 3 steps, and another built on other values that
    loads the first's parameters and state dict through torch.save/torch.load."""
    params = make_params(dtype, device)
    opt = cls(params, **config)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_params = make_params(dtype, device, seed=77)
    with torch.no_grad():
        for p, s in zip(resumed_params, saved["model"]):
            p.copy_(s)
    resumed = cls(resumed_params, **config)
    resumed.load_state_dict(saved["opt"])
    return params, opt, resumed_params, resumed


def assert_resumes_like_uninterrupted(params, opt, resumed_params, resumed):
    """Steps 3-5 on both: the resumed run ends bit for bit where the first one does."""
    for step in range(3, 6):
        set_grads(params, step)
        set_grads(resumed_params, step)
        opt.step()
        resumed.step()
    assert_same_snapshot(full_snapshot(resumed_params, resumed), full_snapshot(params, opt),
                         "resumed vs uninterrupted")


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
def test_fused_adagrad_state_dict_round_trip_resumes_bit_for_bit(device, dtype, master_weights):
    params, opt, resumed_params, resumed = resume_through_torch_save(
        FusedAdagrad, dtype, device, lr=0.05, weight_decay=1e-2, master_weights=master_weights)
    for p in resumed_params:
        assert resumed.state[p]["sum"].dtype == torch.float32
    assert_resumes_like_uninterrupted(params, opt, resumed_params, resumed)


def test_fused_adagrad_load_state_dict_errors_change_nothing():
    params = make_params(torch.float32, "cpu")
    opt = FusedAdagrad(params)
    set_grads(params, 0)
    opt.step()
    before = full_snapshot(params, opt)
    adam_params = make_params(torch.float32, "cpu")
    adam = FusedAdam(adam_params)
    set_grads(adam_params, 0)
    adam.step()
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(adam.state_dict())
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0]["sum"] = bad["state"][0]["sum"].double()  # (fp16 sums load, widened)
    with pytest.raises(ValueError, match="float32"):
        opt.load_state_dict(bad)
    assert_same_snapshot(full_snapshot(params, opt), before, "after failed loads")


# --- FusedNovoGrad -------------------------------------------------------------------------

NOVOGRAD_CONFIGS = [
    pytest.param({"lr": 1e-2}, id="l2"),
    pytest.param({"lr": 1e-2, "weight_decay": 1e-1, "reg_inside_moment": True}, id="reg-inside"),
    pytest.param({"lr": 1e-2, "weight_decay": 1e-2, "norm_type": 0, "betas": (0.8, 0.9)},
                 id="inf-norm"),
    pytest.param({"lr": 1e-2, "init_zero": True, "grad_averaging": False}, id="init-zero"),
    pytest.param({"lr": 1e-2, "bias_correction": False, "norm_type": 0, "init_zero": True},
                 id="no-bias-correction"),
]
NOVOGRAD_KEYS = ("betas", "eps", "weight_decay", "bias_correction", "grad_averaging",
                 "reg_inside_moment", "norm_type", "init_zero")


def novograd_reference(opt, params, grads, config, inv_scale=None, stepped=None):
    """ref_novograd of the next step from the optimizer's state (one group), for the
    params at positions `stepped` (all by default)."""
    group = opt.param_groups[0]
    stepped = range(len(params)) if stepped is None else stepped
    device = params[0].device
    targets = targets_of(opt, params)
    v = group.get("exp_avg_sq", torch.zeros(len(params), device=device))
    step = group["step"].item() if "step" in group else 0
    m = [opt.state[params[i]].get("exp_avg", torch.zeros_like(targets[i])) for i in stepped]
    kw = {k: v for k, v in config.items() if k in NOVOGRAD_KEYS and k != "betas"}
    beta1, beta2 = config.get("betas", (0.9, 0.999))
    return ref_novograd([targets[i] for i in stepped], [grads[i] for i in stepped], m,
                        v[list(stepped)], step, config["lr"], beta1, beta2, inv_scale=inv_scale,
                        **kw)


def assert_novograd_state(opt, params, want, stepped=None):
    want_p, want_m, want_v, want_step = want
    stepped = list(range(len(params)) if stepped is None else stepped)
    targets = targets_of(opt, params)
    for j, i in enumerate(stepped):
        torch.testing.assert_close(targets[i].double(), want_p[j], **TIGHT)
        state = opt.state[params[i]]
        assert state["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(state["exp_avg"].double(), want_m[j], **TIGHT)
    group = opt.param_groups[0]
    torch.testing.assert_close(group["exp_avg_sq"][stepped].double(), want_v, **TIGHT)
    assert group["step"].item() == want_step


def test_fused_novograd_signature_follows_apex():
    sig = inspect.signature(FusedNovoGrad).parameters
    assert list(sig) == ["params", "lr", "bias_correction", "betas", "eps", "weight_decay",
                         "amsgrad", "reg_inside_moment", "grad_averaging", "norm_type",
                         "init_zero", "set_grad_none", "master_weights"]
    assert {k: v.default for k, v in sig.items() if k != "params"} == {
        "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
        "weight_decay": 0.0, "amsgrad": False, "reg_inside_moment": False,
        "grad_averaging": True, "norm_type": 2, "init_zero": False, "set_grad_none": True,
        "master_weights": False}
    assert FusedNovoGrad._step_supports_amp_scaling is True
    assert apex_optimizers().FusedNovoGrad is FusedNovoGrad
    assert FusedNovoGrad([nn.Parameter(torch.zeros(2))], reg_inside_moment=True).moment_mode == 0


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
@pytest.mark.parametrize("config", NOVOGRAD_CONFIGS)
def test_fused_novograd_matches_the_reference(device, dtype, master_weights, config):
    params = make_params(dtype, device)
    opt = FusedNovoGrad(params, master_weights=master_weights, **config)
    for step in range(STEPS):
        grads = set_grads(params, step)
        want = novograd_reference(opt, params, grads, config)
        opt.step()
        assert_novograd_state(opt, params, want)
    assert_model_is_cast_masters(opt, params)


@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("masters", [False, True], ids=["params", "masters"])
@pytest.mark.parametrize("start", [4, 20_000])
def test_fused_novograd_op_matches_the_reference(device, norm_type, masters, start):
    """From step 4, and from step 20,000, where both bias corrections round to 1 in
    float (the CPU then skips dividing by them: pointwise.h's `divided`)."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    sizes = [ops.CHUNK_SIZE + 3, 7, 0, 130]
    dtypes = [f32, f16, bf16, f16]
    if masters:
        params = [randn(n, f32, device, seed=i) for i, n in enumerate(sizes)]
        model = [torch.empty(n, dtype=dt, device=device) for n, dt in zip(sizes, dtypes)]
    else:
        params = [randn(n, dt, device, seed=i) for i, (n, dt) in enumerate(zip(sizes, dtypes))]
        model = []
    grads = [randn(n, dt, device, seed=10 + i, scale=256.0)
             for i, (n, dt) in enumerate(zip(sizes, [bf16, f32, f16, f16]))]
    exp_avgs = [randn(n, f32, device, seed=20 + i, scale=0.1) for i, n in enumerate(sizes)]
    exp_avg_sq = randn(len(sizes), f32, device, seed=30).abs() * 10
    step = scalar(float(start), device)
    kw = dict(beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=1e-2, norm_type=norm_type)
    want_p, want_m, want_v, _ = ref_novograd(params, grads, exp_avgs, exp_avg_sq, start, 1e-2,
                                             inv_scale=1 / 256, **kw)
    ops.fused_novograd_(params, grads, exp_avgs, model, exp_avg_sq=exp_avg_sq, step=step,
                        lr=1e-2, inv_scale=scalar(1 / 256, device),
                        found_inf=scalar(0.0, device), **kw)
    assert step.item() == start + 1
    torch.testing.assert_close(exp_avg_sq.double(), want_v, **TIGHT)
    for i in range(len(sizes)):
        torch.testing.assert_close(params[i].double(), want_p[i], **TOLERANCES[params[i].dtype])
        torch.testing.assert_close(exp_avgs[i].double(), want_m[i], **TIGHT)
        if masters:
            assert_bitwise_equal(model[i], params[i].to(model[i].dtype))
    # found_inf: nothing changes, the step and the second moments included.
    before = [t.clone() for t in params + exp_avgs + model + [exp_avg_sq, step]]
    ops.fused_novograd_(params, grads, exp_avgs, model, exp_avg_sq=exp_avg_sq, step=step,
                        lr=1e-2, found_inf=scalar(1.0, device), **kw)
    for a, b in zip(params + exp_avgs + model + [exp_avg_sq, step], before):
        assert_bitwise_equal(a, b)


def test_fused_novograd_params_without_grads_keep_their_moment(device):
    params = make_params(torch.float32, device)
    config = {"lr": 1e-2, "weight_decay": 1e-2}
    opt = FusedNovoGrad(params, **config)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    stepped = [0, 2, 3]
    grads = set_grads(params, 2)
    params[1].grad = None
    untouched = [params[1].detach().clone(), opt.param_groups[0]["exp_avg_sq"][1].clone()]
    want = novograd_reference(opt, params, grads, config, stepped=stepped)
    for _ in range(2):  # the full path, then the kept op call
        opt.step()
        assert_novograd_state(opt, params, want, stepped=stepped)
        assert_bitwise_equal(params[1].detach(), untouched[0])
        assert_bitwise_equal(opt.param_groups[0]["exp_avg_sq"][1], untouched[1])
        want = novograd_reference(opt, params, grads, config, stepped=stepped)


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
def test_fused_novograd_skips_an_overflowed_step_with_grad_scaler(device, dtype, master_weights):
    params = make_params(dtype, device, seed=5)
    opt = FusedNovoGrad(params, lr=1e-2, weight_decay=1e-2, master_weights=master_weights)
    scaler = GradScaler(device, init_scale=2.0**10, growth_interval=1000)
    plain_params = make_params(dtype, device, seed=5)
    plain = FusedNovoGrad(plain_params, lr=1e-2, weight_decay=1e-2,
                          master_weights=master_weights)
    for step in range(4):
        opt.zero_grad()
        loss = sum((p.float() * randn(p.shape, torch.float32, device, seed=1000 * (step + 1) + i))
                   .sum() for i, p in enumerate(params))
        scaler.scale(loss).backward()
        if step in (0, 2):  # the first step too: the moments must still start from its norms
            params[1].grad.view(-1)[2] = float("nan")
        before = full_snapshot(params, opt)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if step in (0, 2):
            after = full_snapshot(params, opt)
            # A skipped first step creates the state: zeros (step 0 included), and
            # masters that are the parameters' values.
            for name in set(after) - set(before):
                new = after.pop(name)
                if name.endswith(".master_param"):
                    param = before[f"param{name[len('state'):].split('.')[0]}"]
                    assert torch.equal(new, param.float()), name
                else:
                    assert not new.any(), name
            assert_same_snapshot(after, before, f"after skipped step {step}")
            assert scaler.get_scale() == scale / 2
        else:
            set_grads(plain_params, step)
            plain.step()
    for key in ("step", "exp_avg_sq"):
        torch.testing.assert_close(opt.param_groups[0][key], plain.param_groups[0][key], **TIGHT)
    for a, b in zip(targets_of(opt, params), targets_of(plain, plain_params)):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("mode", [0, 1])
def test_amp_c_novograd(device, norm_type, mode):
    g = tensors(torch.float16, device, 1)
    p = tensors(torch.float32, device, 10)
    m = [t.half() for t in tensors(torch.float32, device, 20, scale=0.1)]  # Apex: p's dtype
    norms = torch.tensor([1.0, 2.0, 0.5], device=device)
    want_p, want_m, want_v, _ = ref_novograd(
        p, g, m, norms, 2, 1e-2, 0.95, 0.98, 1e-8, 1e-2, True, True, reg_inside_moment=mode == 0,
        norm_type=norm_type, init_zero=True)
    amp_C.multi_tensor_novograd(2048, flag(device), [g, p, m], norms, 1e-2, 0.95, 0.98, 1e-8, 3,
                                1, 1e-2, 1, mode, norm_type)
    torch.testing.assert_close(norms.double(), want_v, **TIGHT)
    for i in range(len(p)):
        torch.testing.assert_close(p[i].double(), want_p[i], **TIGHT)
        torch.testing.assert_close(m[i].double(), want_m[i], **TOLERANCES[torch.float16])
    before = [t.clone() for t in p + m + [norms]]
    amp_C.multi_tensor_novograd(2048, flag(device, 1), [g, p, m], norms, 1e-2, 0.95, 0.98, 1e-8,
                                4, 1, 1e-2, 1, mode, norm_type)
    for a, b in zip(p + m + [norms], before):
        assert_bitwise_equal(a, b)
    with pytest.raises(ValueError, match="norm_type"):
        amp_C.multi_tensor_novograd(2048, flag(device), [g, p, m], norms, 1e-2, 0.95, 0.98,
                                    1e-8, 4, 1, 1e-2, 1, mode, 1)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        amp_C.multi_tensor_novograd(2048, flag(device), [g, p, m], norms[:2], 1e-2, 0.95, 0.98,
                                    1e-8, 4, 1, 1e-2, 1, mode, norm_type)
    for a, b in zip(p + m + [norms], before):
        assert_bitwise_equal(a, b)


NOVOGRAD_BAD_OPS = [
    pytest.param(dict(norm_type=1), ValueError, "norm_type", id="norm-type-1"),
    pytest.param(dict(beta2=1.0), ValueError, "beta2", id="beta2-1"),
    pytest.param(dict(lr=float("inf")), ValueError, "lr", id="inf-lr"),
    pytest.param(dict(exp_avg_sq=torch.zeros(2)), ValueError, "exp_avg_sq", id="short-moments"),
    pytest.param(dict(exp_avg_sq=torch.zeros(3, 1)), ValueError, "exp_avg_sq", id="moments-2d"),
    pytest.param(dict(exp_avg_sq=torch.zeros(3, dtype=torch.float16)), TypeError, "exp_avg_sq",
                 id="fp16-moments"),
    pytest.param(dict(step=torch.zeros(1, dtype=torch.int32)), TypeError, "step", id="int-step"),
    pytest.param(dict(exp_avgs_dtype=torch.bfloat16), TypeError, r"exp_avgs\[0\]",
                 id="bf16-exp-avgs"),
]


@pytest.mark.parametrize("bad, error, name", NOVOGRAD_BAD_OPS)
def test_fused_novograd_op_bad_arguments_change_nothing(bad, error, name):
    params = tensors(torch.float32, "cpu", 1)
    grads = tensors(torch.float16, "cpu", 2)
    exp_avgs = tensors(torch.float32, "cpu", 3)
    if "exp_avgs_dtype" in bad:
        exp_avgs[0] = exp_avgs[0].to(bad["exp_avgs_dtype"])
    exp_avg_sq = bad.get("exp_avg_sq", torch.ones(3))
    step = bad.get("step", torch.zeros(1))
    before = [t.clone() for t in params + exp_avgs + [exp_avg_sq, step]]
    kw = {k: bad[k] for k in ("norm_type", "beta2") if k in bad}
    with pytest.raises(error, match=name):
        ops.fused_novograd_(params, grads, exp_avgs, [], exp_avg_sq=exp_avg_sq, step=step,
                            lr=bad.get("lr", 1e-3), **kw)
    for a, b in zip(params + exp_avgs + [exp_avg_sq, step], before):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("kwargs", [
    pytest.param({"norm_type": 1}, id="norm-type-1"),
    pytest.param({"amsgrad": True}, id="amsgrad"),
    pytest.param({"betas": (0.9, 1.0)}, id="beta2-1"),
    pytest.param({"lr": -1.0}, id="negative-lr"),
])
def test_fused_novograd_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        FusedNovoGrad([nn.Parameter(torch.zeros(3))], **kwargs)


@pytest.mark.parametrize("dtype, master_weights", MODEL_DTYPES)
def test_fused_novograd_state_dict_round_trip_resumes_bit_for_bit(device, dtype,
                                                                  master_weights):
    params, opt, resumed_params, resumed = resume_through_torch_save(
        FusedNovoGrad, dtype, device, lr=1e-2, weight_decay=1e-2, norm_type=0,
        master_weights=master_weights)
    assert_resumes_like_uninterrupted(params, opt, resumed_params, resumed)
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["exp_avg_sq"] = torch.zeros(2)
    before = full_snapshot(params, opt)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.load_state_dict(bad)
    assert_same_snapshot(full_snapshot(params, opt), before, "after a failed load")


@pytest.mark.parametrize("face, core, kwargs", [
    (FusedSGD, "SGD", {"lr": 0.1, "momentum": 0.9}),
    (FusedAdam, "Adam", {"lr": 1e-3}),
    (FusedAdagrad, "Adagrad", {"lr": 1e-2}),
    (FusedNovoGrad, "NovoGrad", {"lr": 1e-2}),
])
def test_a_faces_step_runs_the_step_hooks_once_beside_the_core_class(face, core, kwargs):
    """An Apex face's step calls its core class's, whose step is wrapped too once the core
    class is in use in the process: the hooks run once a step, the face's."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import mixedprec.optim

    core_param = nn.Parameter(torch.randn(4))
    core_param.grad = torch.randn(4)
    getattr(mixedprec.optim, core)([core_param], **kwargs).step()
    param = nn.Parameter(torch.randn(4))
    param.grad = torch.randn(4)
    opt = face([param], **kwargs)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(type(o).__name__))
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global"))
    try:
        opt.step()
    finally:
        handle.remove()
    assert calls == ["global", face.__name__]


# Apex's FusedAdam and FusedLAMB advance a group's step count in every step(), before
# their loop over its parameters: a group with no gradient yet (a layer unfrozen later)
# still counts, and its first update takes the bias correction of the optimizer's step.
IDLE_GROUP_CLASSES = [
    pytest.param(FusedAdam, {}, id="FusedAdam"),
    pytest.param(FusedAdam, {"max_grad_norm": 1e3}, id="FusedAdam-2019-path"),
    pytest.param(FusedLAMB, {"weight_decay": 0.0}, id="FusedLAMB"),
    pytest.param(FusedMixedPrecisionLamb, {"weight_decay": 0.0}, id="FusedMixedPrecisionLamb"),
]


@pytest.mark.parametrize("cls, kwargs", IDLE_GROUP_CLASSES)
def test_a_group_without_gradients_still_counts_its_steps(device, cls, kwargs):
    a = nn.Parameter(randn(40, torch.float32, device, seed=1))
    b = nn.Parameter(randn(40, torch.float32, device, seed=2))
    b0 = b.detach().double().clone()
    opt = cls([{"params": [a]}, {"params": [b]}], lr=1e-2, **kwargs)
    grad = randn(40, torch.float32, device, seed=3)
    for i in range(4):  # b's first gradient at the 4th step (the 3rd and 4th use a plan)
        a.grad = randn(40, torch.float32, device, seed=10 + i)
        b.grad = grad.clone() if i == 3 else None
        opt.step()
    assert [float(g["step"]) for g in opt.param_groups] == [4.0, 4.0]
    zeros = [torch.zeros(40, dtype=torch.float64, device=device)]
    if cls is FusedAdam:
        (want,), *_ = ref_adam([b0], [grad.double()], zeros, [zeros[0].clone()], 3, 1e-2)
    else:
        (want,), *_ = ref_lamb([b0], [grad.double()], zeros, [zeros[0].clone()], 3, 1e-2,
                               weight_decay=0.0, global_grad_norm=float(grad.norm()))
    torch.testing.assert_close(b.detach().double(), want, **TIGHT)


def test_a_group_without_gradients_keeps_its_count_in_a_skipped_step(device):
    a = nn.Parameter(randn(40, torch.float32, device, seed=1))
    b = nn.Parameter(randn(40, torch.float32, device, seed=2))
    opt = FusedAdam([{"params": [a]}, {"params": [b]}], lr=1e-2)
    scaler = GradScaler(device, init_scale=4.0)
    for bad in (False, True, False):
        scaler.scale(a.sum()).backward()  # (the scaler's scale is made here)
        a.grad.fill_(float("inf") if bad else 1.0)
        scaler.step(opt)
        scaler.update()
    assert [float(g["step"]) for g in opt.param_groups] == [2.0, 2.0]


def test_an_empty_group_has_no_step_count(device):
    a = nn.Parameter(randn(40, torch.float32, device, seed=1))
    opt = FusedAdam([{"params": [a]}, {"params": []}], lr=1e-2)
    a.grad = torch.ones_like(a)
    opt.step()
    assert "step" not in opt.param_groups[1] and float(opt.param_groups[0]["step"]) == 1.0


# A one-element tensor lr, as Apex's kernels took one (and FusedAdam(capturable=True) made
# one): the same bits as the number, and written on the device afterwards it is followed.
TENSOR_LR_CLASSES = [
    pytest.param(FusedAdam, {}, torch.float32, id="FusedAdam"),
    pytest.param(FusedAdam, {"capturable": True}, torch.float32, id="FusedAdam-capturable"),
    pytest.param(FusedSGD, {"momentum": 0.9}, torch.float32, id="FusedSGD"),
    pytest.param(FusedLAMB, {}, torch.float32, id="FusedLAMB"),
    pytest.param(FusedMixedPrecisionLamb, {}, torch.bfloat16, id="FusedMixedPrecisionLamb"),
]


@pytest.mark.parametrize("cls, kwargs, dtype", TENSOR_LR_CLASSES)
def test_a_tensor_lr_steps_as_the_number(device, cls, kwargs, dtype):
    results = []
    for lr in (1e-2, torch.tensor(1e-2, device=device)):
        p = nn.Parameter(randn((8, 8), dtype, device, seed=1))
        opt = cls([p], lr=lr, **kwargs)
        for i in range(3):
            p.grad = randn((8, 8), dtype, device, seed=10 + i)
            opt.step()
        results.append(p.detach().clone())
    assert_bitwise_equal(*results)
    opt.param_groups[0]["lr"].fill_(0.0)  # (a tensor still: Apex's scripts write it so)
    opt.param_groups[0]["weight_decay"] = 0.0
    p.grad = randn((8, 8), dtype, device, seed=20)
    opt.step()
    assert_bitwise_equal(p.detach(), results[1])


def test_fused_adagrad_steps_a_tensor_lr_as_torch_adagrad(device):
    p = nn.Parameter(randn(16, torch.float32, device, seed=1))
    q = nn.Parameter(p.detach().clone())
    opt, ref = FusedAdagrad([p], lr=1e-2), torch.optim.Adagrad([q], lr=1e-2)
    for o in (opt, ref):
        o.param_groups[0]["lr"] = torch.tensor(3e-2)
    for i in range(3):
        p.grad = randn(16, torch.float32, device, seed=10 + i)
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), **TIGHT)


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD])
def test_a_tensor_setting_is_named_and_changes_nothing(device, cls):
    p = nn.Parameter(randn(16, torch.float32, device, seed=1))
    model = nn.ParameterList([p])
    opt = cls([p], lr=1e-2, momentum=0.9) if cls is FusedSGD else cls([p], lr=1e-2)
    p.grad = randn(16, torch.float32, device, seed=2)
    opt.step()
    before = full_snapshot(model, opt)
    opt.param_groups[0]["weight_decay"] = torch.tensor(0.1)
    with pytest.raises(TypeError, match=r"param group 0: expected weight_decay to be a float"):
        opt.step()
    opt.param_groups[0]["weight_decay"] = 0.0
    assert_same_snapshot(full_snapshot(model, opt), before)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad])
def test_amsgrad_is_refused_as_apex_refused_it(cls):
    p = nn.Parameter(torch.zeros(4))
    for error in (RuntimeError, ValueError):  # (Apex's RuntimeError, and a bad argument)
        with pytest.raises(error, match="does not support amsgrad"):
            cls([p], amsgrad=True)


# Apex's FusedLAMB, FusedAdam and FusedNovoGrad read these settings from the optimizer at
# every step: set on it after construction they apply to every group.
APEX_ATTRIBUTES = [
    pytest.param(FusedLAMB, "use_nvlamb", True, {"use_nvlamb": True}, id="lamb-use_nvlamb"),
    pytest.param(FusedLAMB, "adam_w_mode", 0, {"adam_w_mode": False}, id="lamb-adam_w_mode"),
    pytest.param(FusedAdam, "adam_w_mode", 0, {"adam_w_mode": False}, id="adam-adam_w_mode"),
    pytest.param(FusedNovoGrad, "reg_inside_moment", True, {"reg_inside_moment": True},
                 id="novograd-reg_inside_moment"),
    pytest.param(FusedNovoGrad, "moment_mode", 0, {"reg_inside_moment": True},
                 id="novograd-moment_mode"),
]


@pytest.mark.parametrize("cls, name, value, built", APEX_ATTRIBUTES)
def test_an_apex_attribute_set_later_applies_to_every_group(device, cls, name, value, built):
    results = []
    for later in (True, False):
        ps = [nn.Parameter(randn(16, torch.float32, device, seed=s)) for s in (1, 2)]
        groups = [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 2e-2}]
        opt = cls(groups, lr=1e-2, weight_decay=0.1, **({} if later else built))
        if later:
            setattr(opt, name, value)
            assert getattr(opt, name) == value
        for i in range(3):
            for j, p in enumerate(ps):
                p.grad = randn(16, torch.float32, device, seed=10 + 2 * i + j)
            opt.step()
        results.append([p.detach().clone() for p in ps])
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)
