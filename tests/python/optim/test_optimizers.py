"""fused_sgd_ and fused_adam_: one step against the float64 references, many steps
against torch.optim (fp32 params, and fp16/bf16 models over fp32 masters), unscale
folded in, first_run, and skipping on found_inf."""

import math

import pytest
import torch
from helpers import (
    DTYPE_IDS,
    DTYPES,
    FLOAT_DTYPES,
    TOLERANCES,
    adam_state,
    assert_bitwise_equal,
    assert_unchanged,
    assert_within_eager_error,
    randn,
    scalar,
    snapshot,
)
from references import ref_adam, ref_sgd

from mixedprec import ops

SHAPES = [(5,), (33, 7), (2, 3, 4, 5), (1000,)]
STEPS = 30
LOSS_SCALE = 2.0**10  # a power of two: scaling fp16/bf16 gradients by it is exact
MASTER_TOL = TOLERANCES[torch.float32]  # fp32 math against an fp32 or fp64 reference

SGD_CONFIGS = [
    pytest.param(dict(lr=0.1), id="plain"),
    pytest.param(dict(lr=0.1, weight_decay=1e-2), id="weight_decay"),
    pytest.param(dict(lr=0.05, momentum=0.9), id="momentum"),
    pytest.param(dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-2), id="dampening"),
    pytest.param(dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), id="nesterov"),
]
ADAM_CONFIGS = [
    pytest.param(dict(lr=1e-2, decoupled_weight_decay=False), id="adam"),
    pytest.param(dict(lr=1e-2, decoupled_weight_decay=False, weight_decay=1e-2), id="adam_l2"),
    pytest.param(dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=1e-1), id="adamw"),
    pytest.param(dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, decoupled_weight_decay=True,
                      weight_decay=1e-2),
                 id="adamw_betas"),
]


def make_params(dtype, device, seed=0):
    return [randn(s, dtype, device, seed=seed + i) for i, s in enumerate(SHAPES)]


def make_grads(params, dtype, device, seed, scale=1.0):
    return [randn(p.shape, dtype, device, seed=seed + i, scale=scale)
            for i, p in enumerate(params)]


def momentum_buffers(params, config, device, seed=50):
    if config.get("momentum", 0.0) == 0.0:
        return []
    return [randn(p.shape, torch.float32, device, seed=seed + i) for i, p in enumerate(params)]


def sgd_kwargs(config):
    """Our keyword arguments as torch.optim.SGD's."""
    return dict(config, foreach=False)


def adam_class_and_kwargs(config):
    config = dict(config)
    cls = torch.optim.AdamW if config.pop("decoupled_weight_decay") else torch.optim.Adam
    betas = (config.pop("beta1", 0.9), config.pop("beta2", 0.999))
    return cls, dict(config, betas=betas, weight_decay=config.get("weight_decay", 0.0),
                     foreach=False)


# --- one step against the float64 references ------------------------------------------

@pytest.mark.parametrize("dtype, atol, rtol", FLOAT_DTYPES)
@pytest.mark.parametrize("config", SGD_CONFIGS)
@pytest.mark.parametrize("first_run", [False, True], ids=["running", "first_run"])
def test_fused_sgd_matches_reference(device, dtype, atol, rtol, config, first_run):
    params = make_params(dtype, device)
    grads = make_grads(params, dtype, device, seed=10)
    bufs = momentum_buffers(params, config, device)
    ref_p, ref_b = ref_sgd(params, grads, bufs, first_run=first_run, **config)

    ops.fused_sgd_(params, grads, bufs, [], first_run=first_run, **config)

    for p, rp in zip(params, ref_p):
        torch.testing.assert_close(p.double(), rp, atol=atol, rtol=rtol)
    for b, rb in zip(bufs, ref_b):
        torch.testing.assert_close(b.double(), rb, **MASTER_TOL)


@pytest.mark.parametrize("model_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_fused_sgd_masters_match_reference(device, model_dtype, config):
    masters = make_params(torch.float32, device)
    model = [p.to(model_dtype) for p in masters]
    grads = make_grads(masters, model_dtype, device, seed=10, scale=LOSS_SCALE)
    bufs = momentum_buffers(masters, config, device)
    grads_before = snapshot(grads)
    ref_p, ref_b = ref_sgd(masters, grads, bufs, inv_scale=1 / LOSS_SCALE, **config)

    ops.fused_sgd_(masters, grads, bufs, model, inv_scale=scalar(1 / LOSS_SCALE, device),
                   **config)

    for p, m, rp in zip(masters, model, ref_p):
        torch.testing.assert_close(p.double(), rp, **MASTER_TOL)
        assert_bitwise_equal(m, p.to(model_dtype))
    for b, rb in zip(bufs, ref_b):
        torch.testing.assert_close(b.double(), rb, **MASTER_TOL)
    assert_unchanged(grads, grads_before)


@pytest.mark.parametrize("dtype, atol, rtol", FLOAT_DTYPES)
@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_fused_adam_matches_reference(device, dtype, atol, rtol, config):
    params = make_params(dtype, device)
    grads = make_grads(params, dtype, device, seed=10)
    m, v = adam_state(params, device, seed=20)
    step = scalar(4.0, device)
    ref_p, ref_m, ref_v, ref_step = ref_adam(params, grads, m, v, 4.0, **config)

    ops.fused_adam_(params, grads, m, v, [], step=step, **config)

    assert step.item() == ref_step
    for p, mm, vv, rp, rm, rv in zip(params, m, v, ref_p, ref_m, ref_v):
        torch.testing.assert_close(p.double(), rp, atol=atol, rtol=rtol)
        # The moments come from the gradient as stored: fp32 math, fp32 storage.
        torch.testing.assert_close(mm.double(), rm, **MASTER_TOL)
        torch.testing.assert_close(vv.double(), rv, **MASTER_TOL)


@pytest.mark.parametrize("model_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_fused_adam_masters_match_reference(device, model_dtype, config):
    masters = make_params(torch.float32, device)
    model = [p.to(model_dtype) for p in masters]
    grads = make_grads(masters, model_dtype, device, seed=10, scale=LOSS_SCALE)
    m, v = adam_state(masters, device, seed=20)
    step = scalar(0.0, device)
    ref_p, ref_m, ref_v, _ = ref_adam(masters, grads, m, v, 0.0, inv_scale=1 / LOSS_SCALE,
                                      **config)

    ops.fused_adam_(masters, grads, m, v, model, step=step,
                    inv_scale=scalar(1 / LOSS_SCALE, device), **config)

    assert step.item() == 1.0
    for p, mod, mm, vv, rp, rm, rv in zip(masters, model, m, v, ref_p, ref_m, ref_v):
        torch.testing.assert_close(p.double(), rp, **MASTER_TOL)
        torch.testing.assert_close(mm.double(), rm, **MASTER_TOL)
        torch.testing.assert_close(vv.double(), rv, **MASTER_TOL)
        assert_bitwise_equal(mod, p.to(model_dtype))


@pytest.mark.parametrize("beta2", [0.999, 0.9999])
def test_fused_adam_moments_as_precise_as_eager(device, beta2):
    """From a fresh state, exp_avg_sq is (1 - beta2) * grad^2: its error against
    float64 must be that of eager fp32 torch.optim.Adam, whatever beta2."""
    params = make_params(torch.float32, device)
    grads = make_grads(params, torch.float32, device, seed=10)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    torch_params = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.Adam(torch_params, lr=1e-3, betas=(0.9, beta2), foreach=False)
    for tp, g in zip(torch_params, grads):
        tp.grad = g.clone()
    opt.step()
    _, ref_m, ref_v, _ = ref_adam(params, grads, m, v, 0.0, lr=1e-3, beta2=beta2)

    ops.fused_adam_(params, grads, m, v, [], step=scalar(0.0, device), lr=1e-3, beta2=beta2)

    for i, tp in enumerate(torch_params):
        assert_within_eager_error(m[i], ref_m[i], opt.state[tp]["exp_avg"])
        assert_within_eager_error(v[i], ref_v[i], opt.state[tp]["exp_avg_sq"])


@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
def test_fused_adam_without_bias_correction(device, adamw):
    params = make_params(torch.float32, device)
    grads = make_grads(params, torch.float32, device, seed=10)
    m, v = adam_state(params, device, seed=20)
    step = scalar(2.0, device)
    config = dict(lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=adamw, bias_correction=False)
    ref_p, ref_m, ref_v, _ = ref_adam(params, grads, m, v, 2.0, **config)
    with_correction, _, _, _ = ref_adam(params, grads, m, v, 2.0,
                                        **dict(config, bias_correction=True))

    ops.fused_adam_(params, grads, m, v, [], step=step, **config)

    assert step.item() == 3.0
    for p, rp, rc in zip(params, ref_p, with_correction):
        torch.testing.assert_close(p.double(), rp, **MASTER_TOL)
        assert not torch.allclose(p.double(), rc, **MASTER_TOL)  # the flag matters here


def _f32(x):
    """A double rounded to float, as the op's resolve() rounds its constants."""
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.parametrize("step", [4, 100_000])
@pytest.mark.parametrize("beta2", [0.999, 0.95])
@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_adam_is_fp32_math_bit_for_bit(device, dtype, adamw, beta2, step):
    """One step from step count `step`, bit for bit torch's fused step in IEEE float32
    (each operation in float64 rounded to float: correctly rounded; its constants formed
    in double and rounded once): early, and late, where sqrt(1 - beta2^step) rounds to 1
    in float and the CPU skips dividing by it."""
    lr, beta1, eps, wd = 1e-2, 0.9, 1e-8, 1e-2
    params = make_params(dtype, device)
    grads = make_grads(params, dtype, device, seed=10)
    m, v = adam_state(params, device, seed=20)
    bc2_sqrt = _f32(math.sqrt(1 - beta2 ** (step + 1)))
    assert (bc2_sqrt == 1.0) == (step > 10_000)
    step_size = _f32(lr / (1 - beta1 ** (step + 1)))
    w = _f32(1 - beta1)

    def f(x):  # (torch's own sqrt of a float tensor may not be correctly rounded: MKL's)
        return x.to(torch.float32).double()
    want = []
    for p, g, mm, vv in zip(params, grads, m, v):
        p, g, mm, vv = p.double(), g.double(), mm.double(), vv.double()
        if adamw:
            p = f(p * _f32(1 - lr * wd))
        else:
            g = f(g + f(_f32(wd) * p))
        mm = f(mm + f(w * f(g - mm)))
        vv = f(f(vv * _f32(beta2)) + f(_f32(1 - beta2) * f(g * g)))
        denom = f(f(f(vv.sqrt()) / bc2_sqrt) + _f32(eps))
        p = f(p - f(step_size * f(mm / denom)))
        want.append((p.to(dtype), mm.float(), vv.float()))

    ops.fused_adam_(params, grads, m, v, [], step=scalar(float(step), device), lr=lr,
                    beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                    decoupled_weight_decay=adamw)

    for got, wanted in zip(zip(params, m, v), want):
        for a, b in zip(got, wanted):
            assert_bitwise_equal(a, b)


def mixed_lists(device, seed=0):
    """fp32 masters; grads and model copies in all three dtypes, in turn."""
    masters = make_params(torch.float32, device, seed) + make_params(torch.float32, device,
                                                                     seed + 100)
    grads = [randn(p.shape, DTYPES[i % 3], device, seed=seed + 10 + i)
             for i, p in enumerate(masters)]
    model = [p.to(DTYPES[(i + 1) % 3]) for i, p in enumerate(masters)]
    return masters, grads, model


@pytest.mark.parametrize("with_model", [False, True], ids=["params", "masters"])
def test_optimizers_mixed_dtype_lists(device, with_model):
    masters, grads, model = mixed_lists(device)
    if not with_model:
        # The params themselves, in mixed dtypes, each with grads of another dtype.
        masters, model = model, []
    bufs = [randn(p.shape, torch.float32, device, seed=30 + i) for i, p in enumerate(masters)]
    sgd_ref_p, sgd_ref_b = ref_sgd(masters, grads, bufs, lr=0.1, momentum=0.9)
    sgd_p = [p.clone() for p in masters]
    sgd_model = [m.clone() for m in model]

    ops.fused_sgd_(sgd_p, grads, bufs, sgd_model, lr=0.1, momentum=0.9)

    m, v = adam_state(masters, device, seed=40)
    step = scalar(0.0, device)
    adam_ref_p, adam_ref_m, adam_ref_v, _ = ref_adam(masters, grads, m, v, 0.0, lr=1e-2)
    ops.fused_adam_(masters, grads, m, v, model, step=step, lr=1e-2)

    for i, p in enumerate(masters):
        tol = TOLERANCES[p.dtype]  # without masters the result is rounded to p's dtype
        torch.testing.assert_close(sgd_p[i].double(), sgd_ref_p[i], **tol)
        torch.testing.assert_close(bufs[i].double(), sgd_ref_b[i], **MASTER_TOL)
        torch.testing.assert_close(p.double(), adam_ref_p[i], **tol)
        torch.testing.assert_close(m[i].double(), adam_ref_m[i], **MASTER_TOL)
        torch.testing.assert_close(v[i].double(), adam_ref_v[i], **MASTER_TOL)
    for mod, p in zip(sgd_model, sgd_p):
        assert_bitwise_equal(mod, p.to(mod.dtype))
    for mod, p in zip(model, masters):
        assert_bitwise_equal(mod, p.to(mod.dtype))


# --- many steps against torch.optim --------------------------------------------------

@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_fused_sgd_tracks_torch_sgd_fp32(device, config):
    params = make_params(torch.float32, device)
    torch_params = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(torch_params, **sgd_kwargs(config))
    bufs = [torch.full_like(p, float("nan")) for p in params] if config.get("momentum") else []

    for step in range(STEPS):
        grads = make_grads(params, torch.float32, device, seed=1000 * step)
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        opt.step()
        ops.fused_sgd_(params, grads, bufs, [], first_run=step == 0, **config)

    for p, tp in zip(params, torch_params):
        torch.testing.assert_close(p, tp.detach(), **MASTER_TOL)
    for b, tp in zip(bufs, torch_params):
        torch.testing.assert_close(b, opt.state[tp]["momentum_buffer"], **MASTER_TOL)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_fused_sgd_masters_track_torch_sgd(device, model_dtype, config):
    model = make_params(model_dtype, device)
    masters = [p.float() for p in model]
    torch_params = [p.clone().requires_grad_() for p in masters]
    opt = torch.optim.SGD(torch_params, **sgd_kwargs(config))
    bufs = [torch.zeros_like(p) for p in masters] if config.get("momentum") else []
    inv_scale = scalar(1 / LOSS_SCALE, device)

    for step in range(STEPS):
        # Scaled gradients of the fp16/bf16 model; torch.optim gets them unscaled in fp32.
        grads = make_grads(masters, model_dtype, device, seed=1000 * step, scale=LOSS_SCALE)
        for tp, g in zip(torch_params, grads):
            tp.grad = g.float() * inv_scale
        opt.step()
        ops.fused_sgd_(masters, grads, bufs, model, first_run=step == 0, inv_scale=inv_scale,
                       **config)

    for p, mod, tp in zip(masters, model, torch_params):
        torch.testing.assert_close(p, tp.detach(), **MASTER_TOL)
        assert_bitwise_equal(mod, p.to(model_dtype))
        # And the model against the reference cast to its dtype, within one rounding.
        torch.testing.assert_close(mod, tp.detach().to(model_dtype))


@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_fused_adam_tracks_torch_adam_fp32(device, config):
    params = make_params(torch.float32, device)
    torch_params = [p.clone().requires_grad_() for p in params]
    cls, kwargs = adam_class_and_kwargs(config)
    opt = cls(torch_params, **kwargs)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    step = scalar(0.0, device)

    for i in range(STEPS):
        grads = make_grads(params, torch.float32, device, seed=1000 * i)
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        opt.step()
        ops.fused_adam_(params, grads, m, v, [], step=step, **config)

    assert step.item() == STEPS
    for p, mm, vv, tp in zip(params, m, v, torch_params):
        torch.testing.assert_close(p, tp.detach(), **MASTER_TOL)
        torch.testing.assert_close(mm, opt.state[tp]["exp_avg"], **MASTER_TOL)
        torch.testing.assert_close(vv, opt.state[tp]["exp_avg_sq"], **MASTER_TOL)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_fused_adam_masters_track_torch_adam(device, model_dtype, config):
    model = make_params(model_dtype, device)
    masters = [p.float() for p in model]
    torch_params = [p.clone().requires_grad_() for p in masters]
    cls, kwargs = adam_class_and_kwargs(config)
    opt = cls(torch_params, **kwargs)
    m = [torch.zeros_like(p) for p in masters]
    v = [torch.zeros_like(p) for p in masters]
    step = scalar(0.0, device)
    inv_scale = scalar(1 / LOSS_SCALE, device)

    for i in range(STEPS):
        grads = make_grads(masters, model_dtype, device, seed=1000 * i, scale=LOSS_SCALE)
        for tp, g in zip(torch_params, grads):
            tp.grad = g.float() * inv_scale
        opt.step()
        ops.fused_adam_(masters, grads, m, v, model, step=step, inv_scale=inv_scale, **config)

    assert step.item() == STEPS
    for p, mod, tp in zip(masters, model, torch_params):
        torch.testing.assert_close(p, tp.detach(), **MASTER_TOL)
        assert_bitwise_equal(mod, p.to(model_dtype))
        torch.testing.assert_close(mod, tp.detach().to(model_dtype))


# --- first_run, inv_scale and found_inf ----------------------------------------------

@pytest.mark.parametrize("config", [c for c in SGD_CONFIGS if "momentum" in c.values[0]])
def test_fused_sgd_first_run_ignores_old_buffers(device, config):
    """first_run starts the buffer as the gradient (no dampening), as torch.optim.SGD
    does on its first step; what the buffer held before is never read."""
    params = make_params(torch.float32, device)
    torch_params = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(torch_params, **sgd_kwargs(config))
    bufs = [torch.full_like(p, float("nan")) for p in params]
    grads = make_grads(params, torch.float32, device, seed=7)
    for tp, g in zip(torch_params, grads):
        tp.grad = g.clone()
    opt.step()

    ops.fused_sgd_(params, grads, bufs, [], first_run=True, **config)

    for p, b, tp in zip(params, bufs, torch_params):
        torch.testing.assert_close(p, tp.detach(), **MASTER_TOL)
        torch.testing.assert_close(b, opt.state[tp]["momentum_buffer"], **MASTER_TOL)


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=DTYPE_IDS)
def test_inv_scale_undoes_the_loss_scale(device, grad_dtype):
    """Grads scaled by S with inv_scale=1/S give bit for bit the unscaled result."""
    def run(grads, inv_scale):
        masters = make_params(torch.float32, device)
        model = [p.to(torch.float16) for p in masters]
        bufs = [torch.zeros_like(p) for p in masters]
        ops.fused_sgd_(masters, grads, bufs, model, lr=0.1, momentum=0.9, weight_decay=1e-2,
                       first_run=True, inv_scale=inv_scale)
        adam = make_params(torch.float32, device)
        m, v = adam_state(adam, device, seed=5)
        step = scalar(0.0, device)
        ops.fused_adam_(adam, grads, m, v, [], step=step, lr=1e-2, weight_decay=1e-2,
                        inv_scale=inv_scale)
        return masters + model + bufs + adam + m + v

    grads = make_grads(make_params(torch.float32, device), grad_dtype, device, seed=3)
    scaled = [(g.float() * LOSS_SCALE).to(grad_dtype) for g in grads]
    for s, g in zip(scaled, grads):  # the scaling itself is exact
        assert torch.equal((s.float() / LOSS_SCALE).to(grad_dtype), g)

    plain = run(grads, None)
    unscaled = run(scaled, scalar(1 / LOSS_SCALE, device))
    for a, b in zip(plain, unscaled):
        assert_bitwise_equal(a, b)


def test_zero_found_inf_is_no_skip(device):
    def run(found_inf):
        masters, grads, model = mixed_lists(device)
        bufs = [torch.ones_like(p) for p in masters]
        ops.fused_sgd_(masters, grads, bufs, model, lr=0.1, momentum=0.9, found_inf=found_inf)
        adam, _, adam_model = mixed_lists(device, seed=3)
        m, v = adam_state(adam, device, seed=5)
        step = scalar(0.0, device)
        ops.fused_adam_(adam, grads, m, v, adam_model, step=step, lr=1e-2, found_inf=found_inf)
        return masters + model + bufs + adam + adam_model + m + v + [step]

    zero = scalar(0.0, device)
    for a, b in zip(run(None), run(zero)):
        assert_bitwise_equal(a, b)
    assert zero.item() == 0.0


def skip_case(device, optimizer, with_model):
    """An optimizer step's arguments, with non-finite gradients."""
    if with_model:
        params, grads, model = mixed_lists(device)
    else:
        _, grads, params = mixed_lists(device)
        model = []
    grads[1].view(-1)[0] = float("nan")
    grads[-1].view(-1)[-1] = float("inf")
    if optimizer == "sgd":
        bufs = [randn(p.shape, torch.float32, device, seed=60 + i) for i, p in enumerate(params)]
        return ops.fused_sgd_, dict(params=params, grads=grads, momentum_buffers=bufs,
                                    model_params=model, lr=0.1, momentum=0.9, weight_decay=1e-2,
                                    nesterov=True, first_run=False)
    m, v = adam_state(params, device, seed=70)
    return ops.fused_adam_, dict(params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v,
                                 model_params=model, step=scalar(3.0, device), lr=1e-2,
                                 weight_decay=1e-2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("with_model", [False, True], ids=["params", "masters"])
@pytest.mark.parametrize("found_inf_value", [1.0, float("inf")], ids=["one", "inf"])
def test_found_inf_skips_everything(device, optimizer, with_model, found_inf_value):
    op, kwargs = skip_case(device, optimizer, with_model)
    kwargs.update(inv_scale=scalar(0.25, device), found_inf=scalar(found_inf_value, device))
    before = snapshot(kwargs)

    op(**kwargs)

    assert_unchanged(kwargs, before)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_without_found_inf_the_step_is_taken(device, optimizer):
    """The counterpart of test_found_inf_skips_everything: same arguments, flag 0."""
    op, kwargs = skip_case(device, optimizer, with_model=True)
    kwargs.update(inv_scale=scalar(0.25, device), found_inf=scalar(0.0, device))
    before = dict(snapshot(kwargs))

    op(**kwargs)

    changed = [name for name, t in snapshot(kwargs) if not torch.equal(t, before[name])]
    assert "params[0]" in changed and "model_params[0]" in changed
    if optimizer == "adam":
        assert kwargs["step"].item() == 4.0
