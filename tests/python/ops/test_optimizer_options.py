"""fused_adam_'s and fused_sgd_'s torch.optim options: maximize, amsgrad
(max_exp_avg_sqs), a device learning rate for SGD (lr_tensor) and the unscaled gradients
written back (unscale_grads): one step against the float64 references, many steps
against torch.optim, the lean modes, and skipping on found_inf."""

import pytest
import torch
from helpers import (
    TOLERANCES,
    adam_state,
    assert_bitwise_equal,
    assert_unchanged,
    randn,
    scalar,
    snapshot,
)
from references import ref_adam, ref_sgd, ref_unscaled_grads

from mixedprec import ops

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SHAPES = [(5,), (33, 7), (2, 3, 4, 5), (1000,)]
STEPS = 30
LOSS_SCALE = 2.0**10
MASTER_TOL = TOLERANCES[F32]


def make_params(dtype, device, seed=0):
    return [randn(s, dtype, device, seed=seed + i) for i, s in enumerate(SHAPES)]


def mixed_grads(params, device, seed, scale=1.0):
    """Gradients of every float dtype, one list."""
    return [randn(p.shape, (F32, F16, BF16)[i % 3], device, seed=seed + i, scale=scale)
            for i, p in enumerate(params)]


def max_state(exp_avg_sqs, seed):
    """amsgrad maxima of earlier steps: above exp_avg_sq in some places, below in others."""
    return [v * randn(v.shape, F32, v.device, seed=seed + i).abs().mul(2).to(v.dtype)
            for i, v in enumerate(exp_avg_sqs)]


# --- one step against the float64 references ------------------------------------------

@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("adamw", [False, True], ids=["l2", "adamw"])
@pytest.mark.parametrize("with_model", [False, True], ids=["params", "masters"])
def test_fused_adam_options_match_reference(device, amsgrad, maximize, adamw, with_model):
    params = make_params(F32, device)
    model = [p.to(BF16) for p in params] if with_model else []
    grads = mixed_grads(params, device, seed=10, scale=LOSS_SCALE)
    m, v = adam_state(params, device, seed=20)
    vmax = max_state(v, seed=30) if amsgrad else None
    step = scalar(4.0, device)
    inv_scale = scalar(1 / LOSS_SCALE, device)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=1e-2,
                 decoupled_weight_decay=adamw)
    expected = ref_adam(params, grads, m, v, 4.0, inv_scale=1 / LOSS_SCALE, maximize=maximize,
                        max_exp_avg_sqs=vmax, **hyper)

    ops.fused_adam_(params, grads, m, v, model, step=step, inv_scale=inv_scale, maximize=maximize,
                    max_exp_avg_sqs=vmax, **hyper)

    assert step.item() == 5.0
    for got, want in zip([params, m, v] + ([vmax] if amsgrad else []),
                         expected[:3] + expected[4:]):
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, **MASTER_TOL)
    for mod, p in zip(model, params):
        assert_bitwise_equal(mod, p.to(BF16))


@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("config", [
    pytest.param(dict(lr=0.1, weight_decay=1e-2), id="plain"),
    pytest.param(dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-2), id="dampening"),
    pytest.param(dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), id="nesterov"),
    pytest.param(dict(lr=0.05, momentum=0.9, weight_decay=1e-2, wd_after_momentum=True),
                 id="wd_after_momentum"),
])
def test_fused_sgd_maximize_matches_reference(device, maximize, config):
    params = make_params(F32, device)
    grads = mixed_grads(params, device, seed=10, scale=LOSS_SCALE)
    bufs = ([randn(p.shape, F32, device, seed=40 + i) for i, p in enumerate(params)]
            if config.get("momentum") else [])
    expected_p, expected_b = ref_sgd(params, grads, bufs, inv_scale=1 / LOSS_SCALE,
                                     maximize=maximize, **config)

    ops.fused_sgd_(params, grads, bufs, [], inv_scale=scalar(1 / LOSS_SCALE, device),
                   maximize=maximize, **config)

    for got, want in zip(params + bufs, expected_p + expected_b):
        torch.testing.assert_close(got.double(), want, **MASTER_TOL)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_maximize_is_the_step_on_the_negated_gradient(device, optimizer):
    """-(g * s) == (-g) * s in IEEE arithmetic: maximize on g gives the bits of a plain
    step on -g."""
    def run(grads, maximize):
        params = make_params(F32, device)
        if optimizer == "sgd":
            bufs = [torch.zeros_like(p) for p in params]
            ops.fused_sgd_(params, grads, bufs, [], lr=0.1, momentum=0.9, weight_decay=1e-2,
                           inv_scale=scalar(0.25, device), maximize=maximize)
            return params + bufs
        m, v = adam_state(params, device, seed=20)
        vmax = max_state(v, seed=30)
        ops.fused_adam_(params, grads, m, v, [], step=scalar(2.0, device), lr=1e-2,
                        weight_decay=1e-2, inv_scale=scalar(0.25, device), maximize=maximize,
                        max_exp_avg_sqs=vmax)
        return params + m + v + vmax

    grads = mixed_grads(make_params(F32, device), device, seed=10)
    negated = [-g for g in grads]
    for got, want in zip(run(grads, True), run(negated, False)):
        assert_bitwise_equal(got, want)
    assert not torch.equal(run(grads, True)[0], run(grads, False)[0])


# --- many steps against torch.optim ----------------------------------------------------

def step_grads(params, device, step):
    """fp32 gradients whose size falls after the first third of the steps, so that
    exp_avg_sq falls below its running maximum (amsgrad then differs from Adam)."""
    return [randn(p.shape, F32, device, seed=1000 * step + i, scale=1.0 if step < 10 else 0.1)
            for i, p in enumerate(params)]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("adamw", [False, True], ids=["l2", "adamw"])
def test_fused_adam_options_track_torch_adam(device, amsgrad, maximize, adamw):
    params = make_params(F32, device)
    torch_params = [p.clone().requires_grad_() for p in params]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(torch_params, lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-2, amsgrad=amsgrad,
              maximize=maximize, foreach=False)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    vmax = [torch.zeros_like(p) for p in params] if amsgrad else None
    step = scalar(0.0, device)

    for i in range(STEPS):
        grads = step_grads(params, device, i)
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        opt.step()
        ops.fused_adam_(params, grads, m, v, [], step=step, lr=1e-2, beta1=0.9, beta2=0.99,
                        weight_decay=1e-2, decoupled_weight_decay=adamw, maximize=maximize,
                        max_exp_avg_sqs=vmax)

    assert step.item() == STEPS
    for i, tp in enumerate(torch_params):
        state = opt.state[tp]
        torch.testing.assert_close(params[i], tp.detach(), **MASTER_TOL)
        torch.testing.assert_close(m[i], state["exp_avg"], **MASTER_TOL)
        torch.testing.assert_close(v[i], state["exp_avg_sq"], **MASTER_TOL)
        if amsgrad:
            torch.testing.assert_close(vmax[i], state["max_exp_avg_sq"], **MASTER_TOL)
            assert (vmax[i] > v[i]).any(), "the maximum never mattered"


@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_fused_sgd_maximize_tracks_torch_sgd(device, maximize, nesterov):
    params = make_params(F32, device)
    torch_params = [p.clone().requires_grad_() for p in params]
    config = dict(lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=nesterov)
    opt = torch.optim.SGD(torch_params, maximize=maximize, foreach=False, **config)
    bufs = [torch.zeros_like(p) for p in params]
    lr_tensor = scalar(0.05, device)

    for i in range(STEPS):
        grads = step_grads(params, device, i)
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        opt.step()
        # The learning rate read on the device, the host's ignored.
        ops.fused_sgd_(params, grads, bufs, [], first_run=i == 0, maximize=maximize,
                       lr_tensor=lr_tensor, **dict(config, lr=123.0))

    for p, b, tp in zip(params, bufs, torch_params):
        torch.testing.assert_close(p, tp.detach(), **MASTER_TOL)
        torch.testing.assert_close(b, opt.state[tp]["momentum_buffer"], **MASTER_TOL)


# --- lr_tensor -----------------------------------------------------------------------

@pytest.mark.parametrize("with_model", [False, True], ids=["params", "masters"])
def test_fused_sgd_lr_tensor_replaces_lr(device, with_model):
    """A float32 learning rate on the device gives the bits of the same rate given as
    `lr` (which fused_sgd_ rounds to float32), and follows writes to it."""
    def run(lrs, use_tensor):
        params = make_params(F32, device)
        model = [p.to(F16) for p in params] if with_model else []
        bufs = [torch.zeros_like(p) for p in params]
        lr_tensor = scalar(0.0, device)
        for i, lr in enumerate(lrs):
            grads = mixed_grads(params, device, seed=100 * i, scale=LOSS_SCALE)
            lr_tensor.fill_(lr)
            ops.fused_sgd_(params, grads, bufs, model, lr=99.0 if use_tensor else lr,
                           momentum=0.9, first_run=i == 0, inv_scale=scalar(1 / LOSS_SCALE,
                                                                             device),
                           lr_tensor=lr_tensor if use_tensor else None)
        return params + bufs + model

    lrs = [0.1, 0.05, 1 / 3]
    for got, want in zip(run(lrs, True), run(lrs, False)):
        assert_bitwise_equal(got, want)


# --- unscale_grads ---------------------------------------------------------------------

def optimizer_call(optimizer, device, params, grads, model=(), **kw):
    """(op, kwargs) of one step over params and grads, with fresh state."""
    if optimizer == "sgd":
        bufs = [randn(p.shape, F32, device, seed=40 + i) for i, p in enumerate(params)]
        return ops.fused_sgd_, dict(params=params, grads=grads, momentum_buffers=bufs,
                                    model_params=list(model), lr=0.1, momentum=0.9,
                                    weight_decay=1e-2, **kw)
    m, v = adam_state(params, device, seed=20)
    if params and params[0].dtype == BF16:  # the lean modes: bf16 moments
        m, v = [t.to(BF16) for t in m], [t.to(BF16) for t in v]
    return ops.fused_adam_, dict(params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v,
                                 model_params=list(model), step=scalar(2.0, device), lr=1e-2,
                                 weight_decay=1e-2, max_exp_avg_sqs=max_state(v, seed=30),
                                 **kw)


def cloned(kwargs):
    """An op call's keyword arguments with every tensor, alone or in a list, cloned."""
    def one(v):
        return v.clone() if isinstance(v, torch.Tensor) else v
    return {k: [one(t) for t in v] if isinstance(v, list) else one(v) for k, v in kwargs.items()}


def exact_unscaled_grads(grads, inv_scale):
    """What GradScaler.unscale_ leaves, from float64: ``g * inv_scale`` in float32 (the
    float64 product of two float32 values is exact, so rounding it once to float32 is
    float32's product), stored in the grad's dtype. (torch's own unscale kernel has no
    bfloat16 CUDA implementation, so it cannot be the reference on both devices.)"""
    return [(g.double() * inv_scale.double()).float().to(g.dtype) for g in grads]


def test_exact_unscaled_grads_is_fp32_math():
    """The float64 reference is eager fp32 math, bit for bit, and torch's unscale kernel
    (on the CPU, which has one for every dtype), on values whose products round."""
    grads = mixed_grads(make_params(F32, "cpu"), "cpu", seed=10, scale=LOSS_SCALE)
    inv_scale = scalar(1 / 3, "cpu")
    torch_unscaled = [g.clone() for g in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(torch_unscaled, scalar(0.0, "cpu"),
                                                     inv_scale)
    for want, fp32, by_torch in zip(exact_unscaled_grads(grads, inv_scale),
                                    ref_unscaled_grads(grads, inv_scale), torch_unscaled):
        assert_bitwise_equal(want, fp32)
        assert_bitwise_equal(want, by_torch)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("with_model", [False, True], ids=["params", "masters"])
def test_unscale_grads_leaves_the_unscaled_gradients(device, optimizer, maximize, with_model):
    """The grads hold what GradScaler.unscale_ would leave (not negated by maximize), and
    every other tensor the bits of the same step without unscale_grads."""
    params = make_params(F32, device)
    model = [p.to(F16) for p in params] if with_model else []
    grads = mixed_grads(params, device, seed=10, scale=LOSS_SCALE)
    inv_scale = scalar(1 / 3, device)  # not a power of two: the products round
    unscaled = ref_unscaled_grads(grads, inv_scale)
    exact = exact_unscaled_grads(grads, inv_scale)
    op, kwargs = optimizer_call(optimizer, device, params, grads, model, inv_scale=inv_scale,
                                found_inf=scalar(0.0, device), maximize=maximize)
    plain = cloned(kwargs)

    op(**kwargs, unscale_grads=True)
    op(**plain)

    for got, want, exact_want in zip(kwargs["grads"], unscaled, exact):
        assert_bitwise_equal(got, want)
        assert_bitwise_equal(got, exact_want)
    for name in kwargs:
        if name != "grads" and isinstance(kwargs[name], (list, torch.Tensor)):
            got = kwargs[name] if isinstance(kwargs[name], list) else [kwargs[name]]
            want = plain[name] if isinstance(plain[name], list) else [plain[name]]
            for g, w in zip(got, want):
                assert_bitwise_equal(g, w, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("found_inf", [0.0, 1.0], ids=["step", "skip"])
def test_grads_of_another_dtype_step_as_their_fp32_copies(device, optimizer, found_inf):
    """fp16 gradients of bf16 params (no kernel is built for them: dispatch.h's
    kStoredGrad) give the bits of the same step on fp32 copies of them, and are written
    back unscaled in fp16, or left as they were when the step is skipped."""
    params = make_params(BF16, device)
    grads = [randn(p.shape, F16, device, seed=10 + i, scale=LOSS_SCALE)
             for i, p in enumerate(params)]
    inv_scale = scalar(1 / 3, device)
    before = [g.clone() for g in grads]
    op, kwargs = optimizer_call(optimizer, device, params, grads, inv_scale=inv_scale,
                                found_inf=scalar(found_inf, device), unscale_grads=True)
    widened = cloned(kwargs)
    widened["grads"] = [g.float() for g in before]

    op(**kwargs)
    op(**widened)

    want = before if found_inf else exact_unscaled_grads(before, inv_scale)
    for got, w, fp32 in zip(kwargs["grads"], want, widened["grads"]):
        assert_bitwise_equal(got, w)
        assert_bitwise_equal(got, fp32.to(F16))
    for name in kwargs:
        if name != "grads" and isinstance(kwargs[name], list):
            for g, w in zip(kwargs[name], widened[name]):
                assert_bitwise_equal(g, w, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_unscale_grads_without_inv_scale_changes_no_grad(device, optimizer):
    params = make_params(F32, device)
    grads = mixed_grads(params, device, seed=10)
    before = [g.clone() for g in grads]
    op, kwargs = optimizer_call(optimizer, device, params, grads, unscale_grads=True)
    op(**kwargs)
    for g, b in zip(grads, before):
        assert_bitwise_equal(g, b)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("with_model", [False, True], ids=["params", "masters"])
def test_found_inf_skips_the_options_too(device, optimizer, with_model):
    """A skipped step writes nothing: no unscaled grad, no amsgrad maximum."""
    params = make_params(F32, device)
    model = [p.to(BF16) for p in params] if with_model else []
    grads = mixed_grads(params, device, seed=10, scale=LOSS_SCALE)
    grads[1].view(-1)[3] = float("inf")
    op, kwargs = optimizer_call(optimizer, device, params, grads, model,
                                inv_scale=scalar(0.5, device), found_inf=scalar(1.0, device),
                                maximize=True, unscale_grads=True)
    if optimizer == "sgd":
        kwargs["lr_tensor"] = scalar(0.1, device)
    before = snapshot(kwargs)
    op(**kwargs)
    assert_unchanged(kwargs, before)


# --- amsgrad and unscale_grads in the lean modes -----------------------------------------

def test_amsgrad_bf16_state_stores_the_rounded_fp32_state(device):
    """bf16 moments and maxima: the update is the fp32 one (from the same values), and the
    state stores its rounding."""
    params = make_params(F32, device)
    grads = mixed_grads(params, device, seed=10)
    m, v = ([t.to(BF16).float() for t in ts] for ts in adam_state(params, device, seed=20))
    vmax = [t.to(BF16).float() for t in max_state(v, seed=30)]
    lean = [t.to(BF16) for t in m], [t.to(BF16) for t in v], [t.to(BF16) for t in vmax]
    lean_params = [p.clone() for p in params]
    hyper = dict(lr=1e-2, weight_decay=1e-2, maximize=True)

    ops.fused_adam_(params, grads, m, v, [], step=scalar(3.0, device), max_exp_avg_sqs=vmax,
                    **hyper)
    ops.fused_adam_(lean_params, grads, lean[0], lean[1], [], step=scalar(3.0, device),
                    max_exp_avg_sqs=lean[2], **hyper)

    for lp, p in zip(lean_params, params):
        assert_bitwise_equal(lp, p)
    for lean_state, state in zip(lean, (m, v, vmax)):
        for got, want in zip(lean_state, state):
            assert_bitwise_equal(got, want.to(BF16))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_kahan_with_the_options_is_the_fp32_step_from_param_plus_compensation(device,
                                                                             optimizer):
    """bf16 params with compensations: p + comp steps as an fp32 master would (amsgrad,
    maximize and unscale_grads included); p is that value rounded, comp what it dropped."""
    params = [(randn(s, F32, device, seed=i) + 1).to(BF16) for i, s in enumerate(SHAPES)]
    comps = [randn(p.shape, F32, device, seed=50 + i, scale=1e-3).to(BF16)
             for i, p in enumerate(params)]
    masters = [p.float() + c.float() for p, c in zip(params, comps)]
    grads = mixed_grads(params, device, seed=10, scale=LOSS_SCALE)
    options = dict(inv_scale=scalar(1 / 3, device), maximize=True, unscale_grads=True)
    op, kwargs = optimizer_call(optimizer, device, params, grads, kahan_comps=comps,
                                **options)
    _, master_kwargs = optimizer_call(optimizer, device, masters, [g.clone() for g in grads],
                                      [torch.empty_like(p) for p in params], **options)
    if optimizer == "sgd":
        kwargs["momentum_buffers"] = [b.to(BF16).float() for b in kwargs["momentum_buffers"]]
        master_kwargs["momentum_buffers"] = [b.clone() for b in kwargs["momentum_buffers"]]
    else:  # the same (bf16) state values, in fp32 for the masters
        for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
            master_kwargs[key] = [t.float() for t in kwargs[key]]

    op(**kwargs)
    op(**master_kwargs)

    for p, c, master, model in zip(params, comps, masters, master_kwargs["model_params"]):
        assert_bitwise_equal(p, model)
        assert_bitwise_equal(c, (master - p.float()).to(BF16))
    for got, want in zip(grads, master_kwargs["grads"]):
        assert_bitwise_equal(got, want)


def test_amsgrad_with_stochastic_rounding(device):
    """Stochastic rounding of bf16 params with amsgrad: each value is one of the two bf16
    neighbours of the fp32 step's value (its bits cut to bf16, or one unit further from
    zero); the bf16 state is the fp32 step's, rounded to nearest."""
    params = [randn(s, F32, device, seed=i).to(BF16) for i, s in enumerate(SHAPES)]
    masters = [p.float() for p in params]
    grads = mixed_grads(params, device, seed=10)
    salts = ops.rounding_words([(i,) for i in range(len(SHAPES))], device)
    op, kwargs = optimizer_call("adam", device, params, grads, sr_salts=salts, sr_seed=99,
                                maximize=True)
    _, master_kwargs = optimizer_call("adam", device, masters, grads, maximize=True)
    for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        master_kwargs[key] = [t.float() for t in kwargs[key]]

    op(**kwargs)
    op(**master_kwargs)

    for p, master in zip(params, masters):
        cut = master.view(torch.int32) & -65536  # 0xffff0000
        got = p.float().view(torch.int32)
        assert ((got == cut) | (got == cut + 65536)).all()
    for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        for got, want in zip(kwargs[key], master_kwargs[key]):
            assert_bitwise_equal(got, want.to(BF16), msg=key)
