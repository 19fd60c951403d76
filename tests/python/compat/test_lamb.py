"""LAMB: the fused op against a float64 reference, FusedLAMB and
FusedMixedPrecisionLamb (masters, clipping over all groups, skipping, state dicts), and
the amp_C entries against the optimizer."""

import copy
import io

import pytest
import torch
from helpers import (
    adam_state,
    assert_bitwise_equal,
    assert_same_snapshot,
    forbid_host_sync,
    full_snapshot,
    make_model,
    randn,
    scalar,
)
from references import ref_global_norm, ref_l2norm, ref_lamb

import mixedprec
from mixedprec import amp_C, ops
from mixedprec.optimizers import FusedLAMB, FusedMixedPrecisionLamb

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SHAPES = [(37,), (5, 7), (3, 2, 4), (1,)]
STEPS = 5
# fp32 math (and fp32 norms) against float64 over STEPS steps.
TOL = dict(rtol=1e-4, atol=1e-6)

CONFIGS = [
    pytest.param(dict(weight_decay=0.01), id="adamw"),
    pytest.param(dict(weight_decay=0.01, decoupled_weight_decay=False), id="l2"),
    pytest.param(dict(weight_decay=0.0), id="no-decay"),
    pytest.param(dict(weight_decay=0.0, use_nvlamb=True), id="nvlamb"),
    pytest.param(dict(weight_decay=0.01, grad_averaging=False, bias_correction=False),
                 id="no-averaging-no-bias-correction"),
]
# (param dtype, whether the params are fp32 masters of a model of that dtype)
PARAMS = [
    pytest.param(F32, False, id="fp32"),
    pytest.param(F16, True, id="fp16-masters"),
    pytest.param(BF16, True, id="bf16-masters"),
    pytest.param(BF16, False, id="bf16-no-masters"),
]


def lamb_lists(device, dtype, masters, seed):
    """(params, model_params, exp_avgs, exp_avg_sqs): fp32 masters with a model copy of
    `dtype`, or params of `dtype` and no model copy."""
    model = [randn(s, dtype, device, seed + i) for i, s in enumerate(SHAPES)]
    params = [p.float() for p in model] if masters else model
    m, v = adam_state(params, device, seed + 100)
    return params, (model if masters else []), m, v


@pytest.mark.parametrize("dtype, masters", PARAMS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("clip", [pytest.param(True, id="clipped"),
                                  pytest.param(False, id="unclipped")])
@pytest.mark.parametrize("start", [0, 20_000])
def test_op_tracks_the_float64_reference(device, dtype, masters, config, clip, start):
    """From step 0, and from step 20,000, where both bias corrections round to 1 in
    float (the CPU then skips dividing by them, and by the clip factor where nothing is
    clipped: pointwise.h's `divided`)."""
    params, model, m, v = lamb_lists(device, dtype, masters, seed=0)
    ref = [[t.double() for t in ts] for ts in (params, m, v)]
    step = scalar(float(start), device)
    inv_scale = 0.25
    for k in range(STEPS):
        grads = [randn(p.shape, (F16, BF16, F32)[i % 3], device, 1000 * k + i, scale=4.0)
                 for i, p in enumerate(params)]
        norm = ref_global_norm(grads, inv_scale)
        max_grad_norm = norm / 3 if clip else norm * 2
        ops.fused_lamb_(params, grads, m, v, model, step=step, lr=1e-2, **config,
                        global_grad_norm=scalar(norm, device), max_grad_norm=max_grad_norm,
                        inv_scale=scalar(inv_scale, device), found_inf=scalar(0.0, device))
        decoupled = config.get("decoupled_weight_decay", True)
        kwargs = {key: value for key, value in config.items()
                  if key != "decoupled_weight_decay"}
        ref_p, ref_m, ref_v, _ = ref_lamb(ref[0], grads, ref[1], ref[2], start + k, 1e-2,
                                          eps=1e-6,
                                          decoupled_weight_decay=decoupled,
                                          global_grad_norm=norm, max_grad_norm=max_grad_norm,
                                          inv_scale=inv_scale, **kwargs)
        ref = [ref_p, ref_m, ref_v]
    assert step.item() == start + STEPS
    tol = TOL if dtype == F32 or masters else dict(rtol=2e-2, atol=1e-3)
    for got, want in zip(params, ref[0]):
        torch.testing.assert_close(got.double(), want, **tol)
    for got, want in zip(m + v, ref[1] + ref[2]):
        torch.testing.assert_close(got.double(), want, **(TOL if dtype == F32 or masters
                                                           else dict(rtol=5e-2, atol=1e-4)))
    for p, mp in zip(params, model):
        assert_bitwise_equal(mp, p.to(dtype))


def test_trust_ratio_needs_both_norms_and_decay_or_nvlamb(device):
    """A zero parameter (||p|| = 0) moves by lr * u; so does every parameter without
    weight decay unless use_nvlamb; with it, ||p_new - p|| = lr * ||p||."""
    for wd, nvlamb in ((0.0, False), (0.0, True), (0.01, False)):
        params = [torch.zeros(10, device=device), randn(10, F32, device, 1)]
        before = [p.clone() for p in params]
        grads = [randn(10, F32, device, 2), randn(10, F32, device, 3)]
        m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        ops.fused_lamb_(params, grads, m, v, [], step=scalar(0.0, device), lr=0.1, weight_decay=wd,
                        use_nvlamb=nvlamb)
        zeros = [torch.zeros_like(p) for p in params]
        ref_p, _, _, _ = ref_lamb(before, grads, zeros, zeros, 0, 0.1, weight_decay=wd,
                                  use_nvlamb=nvlamb)
        for got, want in zip(params, ref_p):
            torch.testing.assert_close(got.double(), want, **TOL)
        moved = (params[1] - before[1]).norm().item()
        if wd != 0 or nvlamb:
            assert moved == pytest.approx(0.1 * before[1].norm().item(), rel=1e-4)
        else:
            assert moved != pytest.approx(0.1 * before[1].norm().item(), rel=1e-2)


def test_grads_are_read_not_written(device):
    params, model, m, v = lamb_lists(device, F16, True, seed=5)
    grads = [randn(p.shape, F16, device, 50 + i) for i, p in enumerate(params)]
    saved = [g.clone() for g in grads]
    ops.fused_lamb_(params, grads, m, v, model, step=scalar(0.0, device), lr=1e-2,
                    global_grad_norm=scalar(10.0, device))
    for g, s in zip(grads, saved):
        assert_bitwise_equal(g, s)


def test_found_inf_skips_everything_bit_for_bit(device):
    params, model, m, v = lamb_lists(device, F16, True, seed=6)
    grads = [randn(p.shape, F16, device, 60 + i) for i, p in enumerate(params)]
    grads[1].view(-1)[0] = float("inf")
    step = scalar(4.0, device)
    before = [t.clone() for t in params + model + m + v + [step]]
    ops.fused_lamb_(params, grads, m, v, model, step=step, lr=1e-2,
                    global_grad_norm=scalar(float("inf"), device),
                    inv_scale=scalar(0.5, device), found_inf=scalar(1.0, device))
    for got, want in zip(params + model + m + v + [step], before):
        assert_bitwise_equal(got, want)


# --- the optimizers ------------------------------------------------------------------

def backward(model, step, scale=1.0, scaler=None):
    device = model.fc1.weight.device
    x = randn((8, 6), F32, device, 10_000 + step)
    y = randn((8, 3), F32, device, 20_000 + step)
    loss = (model(x) - y).pow(2).mean()
    (scaler.scale(loss) if scaler is not None else loss * scale).backward()


def groups(model, decay=0.01):
    """Two groups: weights with weight decay, biases without (LAMB's usual split)."""
    return [dict(params=[model.fc1.weight, model.fc2.weight], weight_decay=decay),
            dict(params=[model.fc1.bias, model.fc2.bias], weight_decay=0.0)]


OPTIMIZER_CASES = [
    pytest.param(F32, {}, id="fp32"),
    pytest.param(F16, dict(master_weights=True), id="fp16-masters"),
    pytest.param(BF16, dict(master_weights=True), id="bf16-masters"),
    pytest.param(F32, dict(adam_w_mode=False, use_nvlamb=True), id="fp32-l2-nvlamb"),
]


@pytest.mark.parametrize("dtype, kwargs", OPTIMIZER_CASES)
def test_fused_lamb_tracks_the_reference(device, dtype, kwargs):
    """Several steps; gradients clipped by their global norm over both groups (small
    max_grad_norm); masters (or fp32 params) against float64."""
    model = make_model(device, dtype)
    opt = FusedLAMB(groups(model), lr=1e-2, max_grad_norm=0.05, **kwargs)
    adamw = kwargs.get("adam_w_mode", True)
    nvlamb = kwargs.get("use_nvlamb", False)
    ref = [[p.detach().double() for p in g["params"]] for g in opt.param_groups]
    ref_state = [[[torch.zeros_like(p) for p in g] for _ in range(2)] for g in ref]
    clipped = False
    for step in range(STEPS):
        opt.zero_grad()
        backward(model, step)
        grads = [[p.grad for p in g["params"]] for g in opt.param_groups]
        norm = ref_global_norm([g for gs in grads for g in gs])
        clipped |= norm > 0.05
        opt.step()
        for i, group in enumerate(opt.param_groups):
            ref[i], m, v, _ = ref_lamb(ref[i], grads[i], *ref_state[i], step, 1e-2,
                                       weight_decay=group["weight_decay"],
                                       decoupled_weight_decay=adamw,
                                       use_nvlamb=nvlamb, global_grad_norm=norm,
                                       max_grad_norm=0.05)
            ref_state[i] = [m, v]
    assert clipped
    for group, want in zip(opt.param_groups, ref):
        assert group["step"].item() == STEPS
        for p, w in zip(group["params"], want):
            state = opt.state[p]
            master = state.get("master_param", p.detach())
            assert master.dtype == F32
            torch.testing.assert_close(master.double(), w, **TOL)
            assert_bitwise_equal(p.detach(), master.to(dtype))
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == F32


def test_no_clipping_with_max_grad_norm_0(device):
    model = make_model(device, F32)
    opt = FusedLAMB(model.parameters(), lr=1e-2, max_grad_norm=0.0)
    before = [p.detach().double() for p in model.parameters()]
    backward(model, 0, scale=100.0)
    grads = [p.grad for p in model.parameters()]
    opt.step()
    want, _, _, _ = ref_lamb(before, grads, [torch.zeros_like(p) for p in before],
                             [torch.zeros_like(p) for p in before], 0, 1e-2)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach().double(), w, **TOL)


def test_mixed_precision_lamb_is_fused_lamb_with_masters(device):
    """FusedMixedPrecisionLamb(lr tensor, step start) gives FusedLAMB(master_weights=True)'s
    bits, its step count starting from Apex's `step`."""
    model = make_model(device, F16)
    twin = copy.deepcopy(model)
    opt = FusedMixedPrecisionLamb(groups(model), lr=torch.tensor(1e-2, device=device), step=3,
                                  reduced_precision_dtype=F16)
    ref = FusedLAMB(groups(twin), lr=torch.tensor(1e-2, device=device), master_weights=True)
    for group in ref.param_groups:
        group["step"] = torch.full((1,), 3.0, device=device)
    for step in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            backward(m, step)
            o.step()
    assert [g["step"].item() for g in opt.param_groups] == [6.0, 6.0]
    assert_same_snapshot(full_snapshot(model, opt), full_snapshot(twin, ref))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # set_grad_none, as Apex


def test_grad_scaler_skip_is_bit_for_bit(device):
    """mixedprec.GradScaler: an overflow leaves weights, moments, masters and the step
    count untouched; a finite step unscales (same result as an unscaled optimizer)."""
    model = make_model(device, F16)
    plain_model = copy.deepcopy(model)
    opt = FusedLAMB(groups(model), lr=1e-2, master_weights=True)
    plain = FusedLAMB(groups(plain_model), lr=1e-2, master_weights=True)
    scaler = mixedprec.GradScaler(device, init_scale=1024.0)
    for step in range(2):
        opt.zero_grad()
        plain.zero_grad()
        backward(model, step, scaler=scaler)
        backward(plain_model, step)
        scaler.step(opt)
        scaler.update()
        plain.step()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(opt.state[p]["master_param"],
                                   plain.state[q]["master_param"], **TOL)
    opt.zero_grad()
    backward(model, 2, scaler=scaler)
    model.fc2.weight.grad.view(-1)[3] = float("inf")
    before = full_snapshot(model, opt)
    scaler.step(opt)
    scaler.update()
    assert_same_snapshot(full_snapshot(model, opt), before, "after an overflow")
    assert scaler.get_scale() == 512.0


def test_state_dict_round_trip_resumes_bit_for_bit(device):
    model = make_model(device, BF16)
    opt = FusedLAMB(groups(model), lr=1e-2, master_weights=True)
    for step in range(4):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_model = copy.deepcopy(model)
    resumed = FusedLAMB(groups(resumed_model), lr=1e-2, master_weights=True)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(4, 7):
        for m, o in ((model, opt), (resumed_model, resumed)):
            o.zero_grad()
            backward(m, step)
            o.step()
    assert_same_snapshot(full_snapshot(resumed_model, resumed), full_snapshot(model, opt))
    assert [g["step"].item() for g in resumed.param_groups] == [7.0, 7.0]


def test_mixed_precision_lamb_state_dict_before_the_first_step(device):
    model = make_model(device, F16)
    opt = FusedMixedPrecisionLamb(model.parameters(), step=5)
    resumed = FusedMixedPrecisionLamb(copy.deepcopy(model).parameters())
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["step"] == 5
    copy.deepcopy(opt)  # picklable, with its Apex attributes


@pytest.mark.parametrize("cls, kwargs, error", [
    (FusedLAMB, dict(amsgrad=True), ValueError),
    (FusedLAMB, dict(lr=-1.0), ValueError),
    (FusedLAMB, dict(max_grad_norm=-1.0), ValueError),
    (FusedLAMB, dict(betas=(0.9, 1.0)), ValueError),
    (FusedLAMB, dict(eps="1e-6"), TypeError),
    (FusedMixedPrecisionLamb, dict(reduced_precision_dtype=torch.int8), TypeError),
    (FusedMixedPrecisionLamb, dict(step=-1), ValueError),
    (FusedMixedPrecisionLamb, dict(lr=torch.ones(2)), TypeError),
])
def test_bad_constructor_arguments(cls, kwargs, error):
    with pytest.raises(error):
        cls([torch.nn.Parameter(torch.ones(3))], **kwargs)


def test_bad_gradient_changes_nothing(device):
    model = make_model(device, F16)
    opt = FusedLAMB(groups(model), lr=1e-2, master_weights=True)
    backward(model, 0)
    opt.step()
    backward(model, 1)
    model.fc2.bias.grad = model.fc2.bias.grad.to_sparse()
    before = full_snapshot(model, opt)
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert_same_snapshot(full_snapshot(model, opt), before)


def test_signatures_follow_apex():
    import inspect
    lamb = inspect.signature(FusedLAMB).parameters
    assert list(lamb)[:12] == ["params", "lr", "bias_correction", "betas", "eps",
                               "weight_decay", "amsgrad", "adam_w_mode", "grad_averaging",
                               "set_grad_none", "max_grad_norm", "use_nvlamb"]
    assert (lamb["lr"].default, lamb["eps"].default, lamb["weight_decay"].default,
            lamb["max_grad_norm"].default) == (1e-3, 1e-6, 0.01, 1.0)
    mp = inspect.signature(FusedMixedPrecisionLamb).parameters
    assert list(mp) == ["params", "lr", "step", "bias_correction", "betas", "eps",
                        "weight_decay", "amsgrad", "adam_w_mode", "grad_averaging",
                        "max_grad_norm", "use_nvlamb", "reduced_precision_dtype"]


# --- amp_C ---------------------------------------------------------------------------

def test_amp_c_multi_tensor_lamb_is_the_optimizer(device):
    """Apex's FusedLAMB.step, written with amp_C (one fp32 group), gives FusedLAMB's bits."""
    model = make_model(device, F32)
    twin = copy.deepcopy(model)
    opt = FusedLAMB(twin.parameters(), lr=1e-2, max_grad_norm=0.05)
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    noop = torch.zeros(1, dtype=torch.int32, device=device)
    for step in range(1, 4):
        for p in params + list(twin.parameters()):
            p.grad = None
        backward(model, step)
        backward(twin, step)
        grads = [p.grad for p in params]
        norm = amp_C.multi_tensor_l2norm(2048, noop, [grads], False)[0]
        with torch.no_grad():
            amp_C.multi_tensor_lamb(2048, noop, [grads, params, m, v], 1e-2, 0.9, 0.999, 1e-6,
                                    step, 1, 0.01, 1, 1, norm, 0.05, False)
        opt.step()
    for i, (p, q) in enumerate(zip(params, twin.parameters())):
        assert_bitwise_equal(p.detach(), q.detach())
        assert_bitwise_equal(m[i], opt.state[q]["exp_avg"])
    # A set noop_flag skips the update.
    before = [p.detach().clone() for p in params]
    noop.fill_(1)
    amp_C.multi_tensor_lamb(2048, noop, [grads, params, m, v], 1e-2, 0.9, 0.999, 1e-6, 4, 1,
                            0.01, 1, 1, norm, 0.05, False)
    for p, b in zip(params, before):
        assert_bitwise_equal(p.detach(), b)


def test_amp_c_multi_tensor_lamb_mp_is_the_mixed_precision_optimizer(device):
    """Apex's FusedMixedPrecisionLamb.step with amp_C: fp16 model, fp32 masters, scaled
    gradients (norm and max_grad_norm scaled as Apex passes them), int step tensor."""
    model = make_model(device, F16)
    twin = copy.deepcopy(model)
    opt = FusedMixedPrecisionLamb(twin.parameters(), lr=1e-2, max_grad_norm=0.05)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    m = [torch.zeros_like(p) for p in masters]
    v = [torch.zeros_like(p) for p in masters]
    step = torch.zeros(1, dtype=torch.int32, device=device)
    lr = torch.tensor(1e-2, device=device)
    scale = torch.full((1,), 256.0, device=device)
    inv_scale = scale.double().reciprocal().float()
    for k in range(3):
        for p in params + list(twin.parameters()):
            p.grad = None
        backward(model, k, scale=256.0)
        backward(twin, k)
        grads = [p.grad for p in params]
        found_inf = torch.zeros(1, device=device)
        noop = torch.zeros(1, dtype=torch.int32, device=device)
        norm = amp_C.multi_tensor_l2norm_mp(2048, noop, [grads], False)[0]
        step += 1
        amp_C.multi_tensor_lamb_mp(2048, noop, [grads, masters, m, v, params], lr, 0.9, 0.999,
                                   1e-6, step, 1, 0.01, 1, 1, norm, 0.05 * scale, False,
                                   found_inf, inv_scale)
        opt.step()
    for p, q, master in zip(params, twin.parameters(), masters):
        torch.testing.assert_close(master, opt.state[q]["master_param"], rtol=1e-5, atol=1e-7)
        assert_bitwise_equal(p.detach(), master.to(F16))


def test_amp_c_multi_tensor_l2norm_scale(device):
    src = [randn(s, (F16, F32)[i % 2], device, i) for i, s in enumerate(SHAPES)]
    dst = [torch.empty_like(t, dtype=F32) for t in src]
    noop = torch.zeros(1, dtype=torch.int32, device=device)
    norm, per = amp_C.multi_tensor_l2norm_scale(2048, noop, [src, dst], 0.5, True)
    want_norm, want_per = ref_l2norm(src, per_tensor=True)
    torch.testing.assert_close(norm.double(), want_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(per.double(), want_per, rtol=1e-6, atol=0)
    for d, s in zip(dst, src):
        assert_bitwise_equal(d, s.float() * 0.5)
    assert noop.item() == 0
    src[0].view(-1)[0] = float("nan")
    amp_C.multi_tensor_l2norm_scale(2048, noop, [src, dst], 0.5)
    assert noop.item() == 1


def test_amp_c_lamb_stages_compose_to_lamb(device):
    """Apex's two LAMB stages (contrib's DistributedFusedLAMB), joined by the per-tensor
    norms, give the float64 LAMB step; a set noop_flag writes nothing."""
    params = [randn(s, F32, device, i) for i, s in enumerate(SHAPES)]
    grads = [randn(s, (F16, F32)[i % 2], device, 10 + i) for i, s in enumerate(SHAPES)]
    m, v = adam_state(params, device, seed=30)
    updates = [torch.empty_like(p) for p in params]
    wd, lr, step = 0.01, 1e-2, 3
    norm = ref_global_norm(grads)
    want_p, want_m, want_v, _ = ref_lamb(params, grads, m, v, step, lr, eps=1e-6,
                                         weight_decay=wd, global_grad_norm=norm,
                                         max_grad_norm=norm / 2)
    noop = torch.zeros(1, dtype=torch.int32, device=device)
    decay = torch.full((len(params),), wd, device=device)
    args = (decay, step, 0.9, 0.999, 1e-6, scalar(norm, device), norm / 2)
    frozen = [t.clone() for t in params + m + v]
    amp_C.multi_tensor_lamb_stage1_cuda(2048, noop + 1, [grads, params, m, v, updates], *args)
    for a, b in zip(params + m + v, frozen):
        assert_bitwise_equal(a, b)
    amp_C.multi_tensor_lamb_stage1_cuda(2048, noop, [grads, params, m, v, updates], *args)
    _, p_norms = ops.multi_tensor_l2norm(params, per_tensor=True)
    _, u_norms = ops.multi_tensor_l2norm(updates, per_tensor=True)
    amp_C.multi_tensor_lamb_stage2_cuda(2048, noop, [params, updates], p_norms, u_norms, lr, wd)
    for got, want in zip(params + m + v, want_p + want_m + want_v):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, kwargs", [
    pytest.param(FusedLAMB, dict(master_weights=True), id="lamb-masters"),
    pytest.param(FusedMixedPrecisionLamb, {}, id="mixed-precision-lamb"),
])
def test_no_host_sync(device, monkeypatch, cls, kwargs):
    model = make_model(device, F16)
    opt = cls(groups(model), lr=1e-2, **kwargs)
    scaler = mixedprec.GradScaler(device, init_scale=2.0**8)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        opt.zero_grad()
        backward(model, step, scaler=scaler)
        with forbid_host_sync(monkeypatch):
            scaler.step(opt)
            scaler.update()
    assert opt.param_groups[0]["step"].item() == 3
    for p, before in zip(model.parameters(), start):
        assert torch.isfinite(p).all() and not torch.equal(p, before)
