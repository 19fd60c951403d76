"""mixedprec.amp_C (Apex's calling convention) and mixedprec.multi_tensor_apply:
each function against a float64 reference on CPU and CUDA, the int32 noop_flag
(set on inf/NaN by scale/axpby/l2norm, skipping sgd/adam, never cleared, kept int32)."""

import numpy as np
import pytest
import torch
from helpers import (
    DTYPE_IDS,
    DTYPES,
    TOLERANCES,
    adam_state,
    assert_bitwise_equal,
    assert_unchanged,
    randn,
    scalar,
    snapshot,
)
from references import ref_adam, ref_l2norm, ref_sgd

from mixedprec import amp_C, ops
from mixedprec.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

# Sizes around the engine's chunk, so that tensors span chunks.
SIZES = [1, 7, ops.CHUNK_SIZE + 1, 1000]
MASTER_TOL = TOLERANCES[torch.float32]


def flag(device, value=0):
    """Apex's overflow buffer: a one-element int32 tensor."""
    return torch.tensor([value], dtype=torch.int32, device=device)


def assert_flag(noop_flag, value):
    assert noop_flag.dtype == torch.int32 and noop_flag.shape == (1,)
    assert noop_flag.item() == value


def tensors(dtype, device, seed, sizes=SIZES, scale=1.0):
    return [randn(n, dtype, device, seed=seed + i, scale=scale) for i, n in enumerate(sizes)]


def apply(fn, noop_flag, lists, *args):
    return multi_tensor_applier(fn, noop_flag, lists, *args)


# --- multi_tensor_applier ----------------------------------------------------------

def test_applier_passes_chunk_size_and_arguments():
    calls = []

    def op(*args):
        calls.append(args)
        return "result"

    noop_flag = flag("cpu")
    lists = [[torch.ones(2)]]
    assert multi_tensor_applier(op, noop_flag, lists, 1.5, True) == "result"
    assert calls == [(ops.CHUNK_SIZE, noop_flag, lists, 1.5, True)]
    assert MultiTensorApply.available
    MultiTensorApply(123)(op, noop_flag, lists)
    assert calls[-1][0] == 123


# --- multi_tensor_scale --------------------------------------------------------------

@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_scale_matches_reference(device, src_dtype, dst_dtype):
    src = tensors(src_dtype, device, seed=0)
    dst = [torch.full_like(s, 7, dtype=dst_dtype) for s in src]
    src_before = snapshot(src)
    noop_flag = flag(device)

    apply(amp_C.multi_tensor_scale, noop_flag, [src, dst], 0.25)

    for s, d in zip(src, dst):
        assert d.dtype == dst_dtype
        torch.testing.assert_close(d.double(), (s.double() * 0.25).to(dst_dtype).double(),
                                   **TOLERANCES[dst_dtype])
    assert_unchanged(src, src_before)
    assert_flag(noop_flag, 0)


def test_scale_in_place(device):
    t = tensors(torch.float16, device, seed=1)
    expected = [(x.double() * 2.0).half() for x in t]
    noop_flag = flag(device)
    apply(amp_C.multi_tensor_scale, noop_flag, [t, t], 2.0)
    for x, e in zip(t, expected):
        assert_bitwise_equal(x, e)  # scaling by a power of two is exact
    assert_flag(noop_flag, 0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")],
                         ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, -1], ids=["first", "last"])
def test_scale_sets_flag_on_non_finite(device, bad, where):
    src = tensors(torch.float16, device, seed=2)
    src[2][where] = bad
    dst = [torch.empty_like(s, dtype=torch.float32) for s in src]
    noop_flag = flag(device)

    apply(amp_C.multi_tensor_scale, noop_flag, [src, dst], 0.5)

    assert_flag(noop_flag, 1)
    # The output is written either way, as in Apex.
    torch.testing.assert_close(dst[0].double(), src[0].double() * 0.5, equal_nan=True)
    # A later finite call does not clear the flag.
    apply(amp_C.multi_tensor_scale, noop_flag, [[src[0]], [dst[0]]], 1.0)
    assert_flag(noop_flag, 1)


# --- multi_tensor_axpby --------------------------------------------------------------

@pytest.mark.parametrize("x_dtype, y_dtype, out_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.float16, torch.float32, torch.float32),
    (torch.float32, torch.bfloat16, torch.float16),
])
def test_axpby_matches_reference(device, x_dtype, y_dtype, out_dtype):
    x = tensors(x_dtype, device, seed=3)
    y = tensors(y_dtype, device, seed=30)
    out = [torch.empty_like(t, dtype=out_dtype) for t in x]
    noop_flag = flag(device)

    apply(amp_C.multi_tensor_axpby, noop_flag, [x, y, out], 0.5, -2.0, -1)

    for xi, yi, o in zip(x, y, out):
        expected = 0.5 * xi.double() - 2.0 * yi.double()
        torch.testing.assert_close(o.double(), expected, **TOLERANCES[out_dtype])
    assert_flag(noop_flag, 0)


def test_axpby_out_may_be_x(device):
    x = tensors(torch.float32, device, seed=4)
    y = tensors(torch.float32, device, seed=40)
    expected = [2.0 * a.double() + 3.0 * b.double() for a, b in zip(x, y)]
    apply(amp_C.multi_tensor_axpby, flag(device), [x, y, x], 2.0, 3.0, -1)
    for a, e in zip(x, expected):
        torch.testing.assert_close(a.double(), e, **MASTER_TOL)


@pytest.mark.parametrize("bad_in, arg_to_check, expected", [
    ("x", -1, 1), ("y", -1, 1), ("x", 0, 1), ("y", 0, 0), ("x", 1, 0), ("y", 1, 1),
])
def test_axpby_checks_the_chosen_argument(device, bad_in, arg_to_check, expected):
    x = tensors(torch.float16, device, seed=5)
    y = tensors(torch.float16, device, seed=50)
    ({"x": x, "y": y}[bad_in])[1][3] = float("inf")
    out = [torch.empty_like(t) for t in x]
    noop_flag = flag(device)
    apply(amp_C.multi_tensor_axpby, noop_flag, [x, y, out], 1.0, 1.0, arg_to_check)
    assert_flag(noop_flag, expected)


# --- multi_tensor_l2norm -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("per_tensor", [False, True], ids=["total", "per_tensor"])
def test_l2norm_matches_reference(device, dtype, per_tensor):
    ts = tensors(dtype, device, seed=6)
    noop_flag = flag(device)
    ref_norm, ref_per = ref_l2norm(ts, per_tensor=per_tensor)

    norm, per = apply(amp_C.multi_tensor_l2norm, noop_flag, [ts], per_tensor)

    assert norm.dtype == torch.float32 and norm.shape == (1,) and norm.device == ts[0].device
    torch.testing.assert_close(norm.double(), ref_norm, **MASTER_TOL)
    if per_tensor:
        assert per.shape == (len(ts),) and per.dtype == torch.float32
        torch.testing.assert_close(per.double(), ref_per, **MASTER_TOL)
    else:
        assert per.numel() == 0
    assert_flag(noop_flag, 0)


def test_l2norm_default_and_mp_and_unscale(device):
    ts = tensors(torch.float16, device, seed=7)
    ref_norm, _ = ref_l2norm(ts)
    norm, per = amp_C.multi_tensor_l2norm(2048, flag(device), [ts])
    assert per.numel() == 0
    torch.testing.assert_close(norm.double(), ref_norm, **MASTER_TOL)
    norm_mp, _ = amp_C.multi_tensor_l2norm_mp(2048, flag(device), [ts], False)
    assert_bitwise_equal(norm_mp, norm)
    scaled, per = amp_C.multi_tensor_unscale_l2norm(2048, flag(device), [ts],
                                                   scalar(0.5, device), True)
    torch.testing.assert_close(scaled.double(), ref_norm * 0.5, **MASTER_TOL)
    assert per.shape == (len(ts),)


def test_l2norm_sets_flag_on_non_finite(device):
    ts = tensors(torch.float32, device, seed=8)
    ts[1][0] = float("nan")
    noop_flag = flag(device)
    norm, _ = apply(amp_C.multi_tensor_l2norm, noop_flag, [ts], False)
    assert_flag(noop_flag, 1)
    assert not torch.isfinite(norm).all()


# --- multi_tensor_adam ---------------------------------------------------------------

ADAM_CASES = [
    pytest.param(0, 1, 0.0, id="l2_mode_no_decay"),
    pytest.param(0, 1, 1e-2, id="l2_mode"),
    pytest.param(1, 1, 1e-1, id="adamw_mode"),
    pytest.param(1, 0, 1e-2, id="adamw_no_bias_correction"),
]


@pytest.mark.parametrize("mode, bias_correction, weight_decay", ADAM_CASES)
def test_adam_matches_reference(device, mode, bias_correction, weight_decay):
    p = tensors(torch.float32, device, seed=10)
    g = tensors(torch.float32, device, seed=11)
    m, v = adam_state(p, device, seed=12)
    g_before = snapshot(g)
    step = 5  # Apex's convention: the step number after this update
    ref_p, ref_m, ref_v, _ = ref_adam(p, g, m, v, step - 1, lr=1e-2, beta1=0.9, beta2=0.99,
                                      eps=1e-6, weight_decay=weight_decay,
                                      decoupled_weight_decay=mode == 1,
                                      bias_correction=bool(bias_correction))
    noop_flag = flag(device)

    apply(amp_C.multi_tensor_adam, noop_flag, [g, p, m, v], 1e-2, 0.9, 0.99, 1e-6, step, mode,
          bias_correction, weight_decay)

    for a, b in [(p, ref_p), (m, ref_m), (v, ref_v)]:
        for x, rx in zip(a, b):
            torch.testing.assert_close(x.double(), rx, **MASTER_TOL)
    assert_unchanged(g, g_before)
    assert_flag(noop_flag, 0)


def test_adam_fp16_state(device):
    """Apex's all-fp16 case: params, grads, m and v in fp16."""
    p = tensors(torch.float16, device, seed=13)
    g = tensors(torch.float16, device, seed=14)
    m32, v32 = adam_state(p, device, seed=15)
    m, v = [t.half() for t in m32], [t.half() for t in v32]
    ref_p, ref_m, ref_v, _ = ref_adam(p, g, m, v, 0, lr=1e-3, decoupled_weight_decay=False)

    apply(amp_C.multi_tensor_adam, flag(device), [g, p, m, v], 1e-3, 0.9, 0.999, 1e-8, 1, 0, 1,
          0.0)

    for a, b in [(p, ref_p), (m, ref_m), (v, ref_v)]:
        for x, rx in zip(a, b):
            assert x.dtype == torch.float16
            torch.testing.assert_close(x.double(), rx, **TOLERANCES[torch.float16])


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_adam_with_master_list(device, model_dtype):
    """[g, p_model, m, v, p_master]: fp32 masters updated and cast into the model."""
    masters = tensors(torch.float32, device, seed=16)
    model = [t.to(model_dtype) for t in masters]
    g = tensors(model_dtype, device, seed=17)
    m, v = adam_state(masters, device, seed=18)
    ref_p, ref_m, ref_v, _ = ref_adam(masters, g, m, v, 2, lr=1e-2, weight_decay=1e-2)

    apply(amp_C.multi_tensor_adam, flag(device), [g, model, m, v, masters], 1e-2, 0.9, 0.999,
          1e-8, 3, 1, 1, 1e-2)

    for master, mod, rp in zip(masters, model, ref_p):
        torch.testing.assert_close(master.double(), rp, **MASTER_TOL)
        assert_bitwise_equal(mod, master.to(model_dtype))


def test_adam_skips_when_flag_set(device):
    p = tensors(torch.float32, device, seed=19)
    g = tensors(torch.float32, device, seed=20)
    m, v = adam_state(p, device, seed=21)
    before = snapshot([p, m, v])
    noop_flag = flag(device, 1)
    apply(amp_C.multi_tensor_adam, noop_flag, [g, p, m, v], 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert_unchanged([p, m, v], before)
    assert_flag(noop_flag, 1)


# --- multi_tensor_sgd ----------------------------------------------------------------

SGD_CASES = [
    pytest.param(dict(wd=0.0, momentum=0.0, dampening=0.0, nesterov=False), id="plain"),
    pytest.param(dict(wd=1e-2, momentum=0.9, dampening=0.0, nesterov=False), id="momentum"),
    pytest.param(dict(wd=1e-2, momentum=0.9, dampening=0.2, nesterov=False), id="dampening"),
    pytest.param(dict(wd=1e-3, momentum=0.9, dampening=0.0, nesterov=True), id="nesterov"),
]


def run_sgd(device, lists, c, first_run, scale, noop_flag=None):
    noop_flag = flag(device) if noop_flag is None else noop_flag
    apply(amp_C.multi_tensor_sgd, noop_flag, lists, c["wd"], c["momentum"], c["dampening"],
          0.05, c["nesterov"], first_run, False, scale)
    return noop_flag


@pytest.mark.parametrize("config", SGD_CASES)
@pytest.mark.parametrize("first_run", [False, True], ids=["running", "first_run"])
def test_sgd_matches_reference(device, config, first_run):
    p = tensors(torch.float32, device, seed=22)
    g = tensors(torch.float32, device, seed=23, scale=4.0)
    mom = tensors(torch.float32, device, seed=24)
    mom_before = snapshot(mom)
    ref_p, ref_b = ref_sgd(p, g, mom, lr=0.05, momentum=config["momentum"],
                           dampening=config["dampening"], weight_decay=config["wd"],
                           nesterov=config["nesterov"], first_run=first_run, inv_scale=0.25)

    noop_flag = run_sgd(device, [g, p, mom], config, first_run, 0.25)

    for x, rx in zip(p, ref_p):
        torch.testing.assert_close(x.double(), rx, **MASTER_TOL)
    if config["momentum"] == 0:
        assert_unchanged(mom, mom_before)  # Apex passes buffers it does not use
    else:
        for b, rb in zip(mom, ref_b):
            torch.testing.assert_close(b.double(), rb, **MASTER_TOL)
    assert_flag(noop_flag, 0)


def test_sgd_fp16_master_list(device):
    """[g fp16, p fp32, m fp32, p_model fp16]: Apex's master-weight case."""
    masters = tensors(torch.float32, device, seed=25)
    model = [t.half() for t in masters]
    g = tensors(torch.float16, device, seed=26, scale=1024.0)
    mom = tensors(torch.float32, device, seed=27)
    config = dict(wd=1e-2, momentum=0.9, dampening=0.0, nesterov=False)
    ref_p, _ = ref_sgd(masters, g, mom, lr=0.05, momentum=0.9, weight_decay=1e-2,
                       inv_scale=1 / 1024)

    run_sgd(device, [g, masters, mom, model], config, False, 1 / 1024)

    for master, mod, rp in zip(masters, model, ref_p):
        torch.testing.assert_close(master.double(), rp, **MASTER_TOL)
        assert_bitwise_equal(mod, master.half())


def test_sgd_all_fp16(device):
    """Apex's all-fp16 case: grads, params and momentum buffers in fp16."""
    p = tensors(torch.float16, device, seed=28)
    g = tensors(torch.float16, device, seed=29)
    mom = tensors(torch.float16, device, seed=30)
    ref_p, ref_b = ref_sgd(p, g, mom, lr=0.05, momentum=0.9)

    run_sgd(device, [g, p, mom], dict(wd=0.0, momentum=0.9, dampening=0.0, nesterov=False),
            False, 1.0)

    for a, b in [(p, ref_p), (mom, ref_b)]:
        for x, rx in zip(a, b):
            assert x.dtype == torch.float16
            torch.testing.assert_close(x.double(), rx, **TOLERANCES[torch.float16])


def test_sgd_skips_when_flag_set(device):
    p = tensors(torch.float32, device, seed=31)
    g = tensors(torch.float32, device, seed=32)
    mom = tensors(torch.float32, device, seed=33)
    before = snapshot([p, mom])
    noop_flag = run_sgd(device, [g, p, mom], dict(wd=1e-2, momentum=0.9, dampening=0.0,
                                                   nesterov=False), False, 1.0,
                        noop_flag=flag(device, 1))
    assert_unchanged([p, mom], before)
    assert_flag(noop_flag, 1)


# --- the skip pipeline, and the rest -------------------------------------------------

def test_overflow_in_scale_skips_the_following_step(device):
    """Apex's pattern: unscale with multi_tensor_scale, then step with the same flag."""
    p = tensors(torch.float32, device, seed=37)
    grads16 = tensors(torch.float16, device, seed=38)
    grads16[0][0] = float("inf")
    grads32 = [torch.empty_like(t, dtype=torch.float32) for t in grads16]
    mom = tensors(torch.float32, device, seed=39)
    before = snapshot([p, mom])
    noop_flag = flag(device)

    apply(amp_C.multi_tensor_scale, noop_flag, [grads16, grads32], 1 / 128)
    run_sgd(device, [grads32, p, mom], dict(wd=0.0, momentum=0.9, dampening=0.0,
                                           nesterov=False), False, 1.0, noop_flag=noop_flag)

    assert_unchanged([p, mom], before)
    assert_flag(noop_flag, 1)


def test_update_scale_hysteresis(device):
    scale = scalar(1024.0, device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hysteresis = torch.full((1,), 2, dtype=torch.int32, device=device)
    args = (2.0, 0.5, 2, 2)
    inf, ok = scalar(1.0, device), scalar(0.0, device)
    assert amp_C.update_scale_hysteresis(scale, growth, hysteresis, inf, *args) is scale
    assert scale.item() == 1024.0 and hysteresis.item() == 1  # hysteresis absorbs one
    amp_C.update_scale_hysteresis(scale, growth, hysteresis, inf, *args)
    assert scale.item() == 512.0
    amp_C.update_scale_hysteresis(scale, growth, hysteresis, ok, *args)
    amp_C.update_scale_hysteresis(scale, growth, hysteresis, ok, *args)
    assert scale.item() == 1024.0 and hysteresis.item() == 2 and growth.item() == 0


def test_missing_apex_function_is_named():
    with pytest.raises(AttributeError, match="multi_tensor_fused_adam"):
        getattr(amp_C, "multi_tensor_fused_adam")  # noqa: B009  (the lookup is the test)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="tensor_lists"):
        amp_C.multi_tensor_scale(2048, flag("cpu"), [[torch.ones(2)]], 1.0)
    with pytest.raises(ValueError, match="mode"):
        amp_C.multi_tensor_adam(2048, flag("cpu"), [[torch.ones(2)]] * 4, 1e-3, 0.9, 0.999,
                                1e-8, 1, 2, 1, 0.0)
    with pytest.raises(ValueError, match="arg_to_check"):
        amp_C.multi_tensor_axpby(2048, flag("cpu"), [[torch.ones(2)]] * 3, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match="noop_flag"):
        amp_C.multi_tensor_scale(2048, torch.zeros(2, dtype=torch.int32),
                                 [[torch.ones(2)], [torch.ones(2)]], 1.0)


def test_no_host_synchronization_on_cuda():
    """The flag is read and written on the device: no amp_C function waits for the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("the host-sync check needs CUDA")
    p = tensors(torch.float32, "cuda", seed=40)
    g16 = tensors(torch.float16, "cuda", seed=41)
    g = [torch.empty_like(t, dtype=torch.float32) for t in g16]
    m, v = adam_state(p, "cuda", seed=42)
    noop_flag = flag("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply(amp_C.multi_tensor_scale, noop_flag, [g16, g], 1 / 64)
        apply(amp_C.multi_tensor_axpby, noop_flag, [g, g, g], 0.5, 0.5, -1)
        apply(amp_C.multi_tensor_l2norm, noop_flag, [g], True)
        apply(amp_C.multi_tensor_adam, noop_flag, [g, p, m, v], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1,
              0.0)
        apply(amp_C.multi_tensor_sgd, noop_flag, [g, p, m], 0.0, 0.9, 0.0, 0.1, False, True,
              False, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_flag(noop_flag, 0)


@pytest.mark.parametrize("call, match", [
    (lambda z, a, b: amp_C.multi_tensor_scale(2048 * 32, z, [a, b], "x"),
     "multi_tensor_scale: expected scale to be a number, got str"),
    (lambda z, a, b: amp_C.multi_tensor_scale(2048 * 32, z, [[1.0], [2.0]], 2.0),
     r"multi_tensor_scale: expected tensor_lists\[0\]\[0\] to be a tensor, got float"),
    (lambda z, a, b: amp_C.multi_tensor_l2norm(2048 * 32, z, [a], "yes"),
     "multi_tensor_l2norm: expected per_tensor to be a bool, got 'yes'")])
def test_bad_scalars_and_list_entries_are_named(call, match):
    """Before: a bare ValueError (float('x')), an AttributeError ('device'), and a string
    per_tensor taken as True. Nothing is written."""
    z, a, b = torch.zeros(1, dtype=torch.int32), [torch.randn(3)], [torch.zeros(3)]
    with pytest.raises(TypeError, match=match):
        call(z, a, b)
    assert not b[0].any() and int(z) == 0


@pytest.mark.parametrize("scale", [2.0, 2, np.float32(2.0), torch.tensor(2.0)],
                         ids=["float", "int", "numpy", "tensor"])
def test_multi_tensor_scale_takes_what_apexs_binding_took(scale):
    z, a, b = torch.zeros(1, dtype=torch.int32), [torch.randn(3)], [torch.zeros(3)]
    amp_C.multi_tensor_scale(2048 * 32, z, [a, b], scale)
    assert torch.equal(b[0], a[0] * 2)
