"""The multi-tensor engine at its edges: chunk boundaries, more tensors than one
launch holds, more chunks than one launch holds, non-finite values at the first,
middle and last element of the last tensor, unaligned storage, zero-size tensors and
empty lists."""

import pytest
import torch
from helpers import (
    DTYPE_IDS,
    DTYPES,
    TOLERANCES,
    adam_state,
    assert_bitwise_equal,
    assert_unchanged,
    assert_within_eager_error,
    offset_copy,
    randn,
    scalar,
    snapshot,
)
from references import ref_adam, ref_l2norm, ref_sgd

from mixedprec import ops

C = ops.CHUNK_SIZE
EDGE_SIZES = [C - 1, C, C + 1, 2 * C + 1]
EDGE_IDS = ["chunk-1", "chunk", "chunk+1", "2chunk+1"]
MANY = ops.MAX_TENSORS_PER_LAUNCH + 9  # more tensors than one launch holds
INV_SCALE = 1 / 3

# Masters are fp32 whatever the model: fp32 math, compared tightly.
MASTER_TOL = TOLERANCES[torch.float32]


def edge_list(device, dtypes=DTYPES, seed=0):
    """One tensor of each edge size, dtypes taken in turn."""
    return [randn(n, dtypes[i % len(dtypes)], device, seed=seed + i, scale=10.0)
            for i, n in enumerate(EDGE_SIZES)]


def unscaled(t, inv_scale):
    return (t.float() * inv_scale).to(t.dtype)


# --- chunk boundaries -------------------------------------------------------------

@pytest.mark.parametrize("size", EDGE_SIZES, ids=EDGE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unscale_at_chunk_edges(device, size, dtype):
    tensors = [randn(size, dtype, device, seed=size)]
    expected = [unscaled(tensors[0], INV_SCALE)]
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_(tensors, found_inf, scalar(INV_SCALE, device))

    assert_bitwise_equal(tensors[0], expected[0])
    assert found_inf.item() == 0.0


def test_unscale_to_and_copy_at_chunk_edges(device):
    src = edge_list(device)
    dst = [torch.empty_like(s, dtype=DTYPES[(i + 1) % 3]) for i, s in enumerate(src)]
    copies = [torch.empty_like(s, dtype=DTYPES[(i + 2) % 3]) for i, s in enumerate(src)]
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_to_(src, dst, found_inf, scalar(INV_SCALE, device))
    ops.multi_tensor_copy_(src, copies)

    for s, d, c in zip(src, dst, copies):
        assert_bitwise_equal(d, (s.float() * INV_SCALE).to(d.dtype))
        assert_bitwise_equal(c, s.to(c.dtype))
    assert found_inf.item() == 0.0


def test_l2norm_at_chunk_edges(device):
    tensors = edge_list(device)
    ref_norm, ref_per = ref_l2norm(tensors, INV_SCALE, per_tensor=True)
    scaled = [t.float() * INV_SCALE for t in tensors]
    eager_per = torch.stack([torch.linalg.vector_norm(s) for s in scaled])
    eager_norm = torch.linalg.vector_norm(torch.cat(scaled)).reshape(1)

    norm, per = ops.multi_tensor_l2norm(tensors, scalar(INV_SCALE, device), per_tensor=True)

    assert_within_eager_error(norm, ref_norm.to(device), eager_norm)
    assert_within_eager_error(per, ref_per.to(device), eager_per)


@pytest.mark.parametrize("model_dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_sgd_at_chunk_edges(device, model_dtype):
    masters = edge_list(device, [torch.float32])
    grads = [randn(p.shape, model_dtype, device, seed=100 + i) for i, p in enumerate(masters)]
    bufs = [randn(p.shape, torch.float32, device, seed=200 + i) for i, p in enumerate(masters)]
    model = [p.to(model_dtype) for p in masters]
    hyper = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2)
    ref_p, ref_b = ref_sgd(masters, grads, bufs, inv_scale=INV_SCALE, **hyper)

    ops.fused_sgd_(masters, grads, bufs, model, inv_scale=scalar(INV_SCALE, device), **hyper)

    for p, b, m, rp, rb in zip(masters, bufs, model, ref_p, ref_b):
        torch.testing.assert_close(p.double(), rp, **MASTER_TOL)
        torch.testing.assert_close(b.double(), rb, **MASTER_TOL)
        assert_bitwise_equal(m, p.to(model_dtype))


@pytest.mark.parametrize("model_dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_adam_at_chunk_edges(device, model_dtype):
    masters = edge_list(device, [torch.float32])
    grads = [randn(p.shape, model_dtype, device, seed=100 + i) for i, p in enumerate(masters)]
    m, v = adam_state(masters, device, seed=200)
    model = [p.to(model_dtype) for p in masters]
    step = scalar(3.0, device)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                 decoupled_weight_decay=True)
    ref_p, ref_m, ref_v, _ = ref_adam(masters, grads, m, v, 3.0, inv_scale=INV_SCALE, **hyper)

    ops.fused_adam_(masters, grads, m, v, model, step=step, inv_scale=scalar(INV_SCALE, device),
                    **hyper)

    assert step.item() == 4.0
    for p, mm, vv, mod, rp, rm, rv in zip(masters, m, v, model, ref_p, ref_m, ref_v):
        torch.testing.assert_close(p.double(), rp, **MASTER_TOL)
        torch.testing.assert_close(mm.double(), rm, **MASTER_TOL)
        torch.testing.assert_close(vv.double(), rv, **MASTER_TOL)
        assert_bitwise_equal(mod, p.to(model_dtype))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_optimizer_options_at_chunk_edges(device, optimizer):
    """maximize, amsgrad's maxima (unaligned too) and the unscaled gradients written
    back, by the vector and the scalar paths."""
    masters = edge_list(device, [torch.float32])
    grads = [randn(p.shape, DTYPES[i % 3], device, seed=100 + i, scale=3.0)
             for i, p in enumerate(masters)]
    want_grads = [unscaled(g, INV_SCALE) for g in grads]
    inv_scale = scalar(INV_SCALE, device)
    if optimizer == "sgd":
        bufs = [randn(p.shape, torch.float32, device, seed=200 + i)
                for i, p in enumerate(masters)]
        hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-2, maximize=True)
        expected = ref_sgd(masters, grads, bufs, inv_scale=INV_SCALE, **hyper)
        ops.fused_sgd_(masters, grads, bufs, [], inv_scale=inv_scale, unscale_grads=True,
                       lr_tensor=scalar(0.1, device), **dict(hyper, lr=0.0))
        got = [masters, bufs]
    else:
        m, v = adam_state(masters, device, seed=200)
        vmax = [offset_copy(t * randn(t.shape, torch.float32, device, seed=300 + i).abs() * 2)
                for i, t in enumerate(v)]
        hyper = dict(lr=1e-2, beta2=0.99, weight_decay=0.1, maximize=True)
        ref_p, ref_m, ref_v, _, ref_max = ref_adam(masters, grads, m, v, 3.0,
                                                   inv_scale=INV_SCALE, max_exp_avg_sqs=vmax,
                                                   **hyper)
        expected = [ref_p, ref_m, ref_v, ref_max]
        ops.fused_adam_(masters, grads, m, v, [], step=scalar(3.0, device), inv_scale=inv_scale,
                        max_exp_avg_sqs=vmax, unscale_grads=True, **hyper)
        got = [masters, m, v, vmax]

    for tensors, refs in zip(got, expected):
        for t, r in zip(tensors, refs):
            torch.testing.assert_close(t.double(), r, **MASTER_TOL)
    for g, w in zip(grads, want_grads):
        assert_bitwise_equal(g, w)


# --- more tensors than one launch holds ----------------------------------------------

def many_tensors(device, seed=0, dtypes=DTYPES):
    """MANY small tensors of varied sizes, magnitudes and dtypes."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 40, (MANY,), generator=gen).tolist()
    return [randn(n, dtypes[i % len(dtypes)], device, seed=seed + i, scale=1.0 + i)
            for i, n in enumerate(sizes)]


def test_unscale_more_tensors_than_one_launch(device):
    tensors = many_tensors(device)
    tensors[-1][-1] = float("inf")  # only the last launch sees it
    expected = [unscaled(t, INV_SCALE) for t in tensors]
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_(tensors, found_inf, scalar(INV_SCALE, device))

    assert found_inf.item() == 1.0
    for t, e in zip(tensors, expected):
        assert_bitwise_equal(t, e)


def test_check_finite_more_tensors_than_one_launch(device):
    tensors = many_tensors(device)
    found_inf = scalar(0.0, device)
    ops.multi_tensor_check_finite_(tensors, found_inf)
    assert found_inf.item() == 0.0

    tensors[-1][-1] = float("nan")  # only the last launch sees it
    ops.multi_tensor_check_finite_(tensors, found_inf)
    assert found_inf.item() == 1.0


def test_unscale_to_more_tensors_than_one_launch(device):
    src = many_tensors(device)
    dst = [torch.empty_like(s, dtype=torch.float32) for s in src]
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_to_(src, dst, found_inf, scalar(INV_SCALE, device))

    assert found_inf.item() == 0.0
    for s, d in zip(src, dst):
        assert_bitwise_equal(d, s.float() * INV_SCALE)


def test_l2norm_per_tensor_more_tensors_than_one_launch(device):
    tensors = many_tensors(device)
    ref_norm, ref_per = ref_l2norm(tensors, per_tensor=True)

    norm, per = ops.multi_tensor_l2norm(tensors, None, per_tensor=True)

    # Each tensor has its own magnitude, so a norm in the wrong slot shows.
    torch.testing.assert_close(per.double(), ref_per.to(device), atol=0, rtol=1e-5)
    torch.testing.assert_close(norm.double(), ref_norm.to(device), atol=0, rtol=1e-5)


@pytest.mark.parametrize("with_model", [False, True], ids=["params", "masters"])
def test_fused_adam_more_tensors_than_one_launch(device, with_model):
    if with_model:
        params = many_tensors(device, dtypes=[torch.float32])
        grads = [randn(p.shape, DTYPES[i % 3], device, seed=5000 + i) for i, p in enumerate(params)]
        model = [p.to(DTYPES[(i + 1) % 3]) for i, p in enumerate(params)]
    else:
        params = many_tensors(device)
        grads = [randn(p.shape, torch.float32, device, seed=5000 + i) for i, p in enumerate(params)]
        model = []
    m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    step = scalar(0.0, device)
    hyper = dict(lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=False)
    ref_p, ref_m, ref_v, _ = ref_adam(params, grads, m, v, 0.0, **hyper)

    ops.fused_adam_(params, grads, m, v, model, step=step, **hyper)

    assert step.item() == 1.0
    for i, (p, rp) in enumerate(zip(params, ref_p)):
        tol = TOLERANCES[p.dtype]  # without masters the result is rounded to p's dtype
        torch.testing.assert_close(p.double(), rp, **tol, msg=f"params[{i}]")
        torch.testing.assert_close(m[i].double(), ref_m[i], **MASTER_TOL)
        torch.testing.assert_close(v[i].double(), ref_v[i], **MASTER_TOL)
    for mod, p in zip(model, params):
        assert_bitwise_equal(mod, p.to(mod.dtype))


def test_fused_sgd_more_tensors_than_one_launch(device):
    params = many_tensors(device, dtypes=[torch.float32])
    grads = [randn(p.shape, DTYPES[i % 3], device, seed=5000 + i) for i, p in enumerate(params)]
    bufs = [randn(p.shape, torch.float32, device, seed=6000 + i) for i, p in enumerate(params)]
    model = [p.to(DTYPES[(i + 1) % 3]) for i, p in enumerate(params)]
    hyper = dict(lr=0.05, momentum=0.9, nesterov=True)
    ref_p, ref_b = ref_sgd(params, grads, bufs, **hyper)

    ops.fused_sgd_(params, grads, bufs, model, **hyper)

    for p, b, mod, rp, rb in zip(params, bufs, model, ref_p, ref_b):
        torch.testing.assert_close(p.double(), rp, **MASTER_TOL)
        torch.testing.assert_close(b.double(), rb, **MASTER_TOL)
        assert_bitwise_equal(mod, p.to(mod.dtype))


# --- more chunks than one launch holds -------------------------------------------------

def test_unscale_and_l2norm_more_chunks_than_one_launch(device):
    n = ops.MAX_BLOCKS_PER_LAUNCH * C + 2  # the last element lands in a second launch
    t = torch.full((n,), 3.0, dtype=torch.float16, device=device)
    t[-1] = float("inf")
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_([t], found_inf, scalar(0.5, device))

    assert found_inf.item() == 1.0
    assert bool((t[:-1] == 1.5).all())
    t[-1] = 1.5
    norm, _ = ops.multi_tensor_l2norm([t], None, per_tensor=False)
    # Every chunk of 1.5s contributes exactly; 1.5 * sqrt(n) rounded once to fp32.
    assert norm.item() == pytest.approx(1.5 * n**0.5, rel=1e-6)


# --- non-finite values ------------------------------------------------------------

NON_FINITE = [float("nan"), float("inf"), -float("inf")]
NON_FINITE_IDS = ["nan", "inf", "-inf"]
POSITIONS = {"first": 0, "middle": C, "last": 2 * C}  # in a tensor of 2 * C + 1


@pytest.mark.parametrize("value", NON_FINITE, ids=NON_FINITE_IDS)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("last_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("out_of_place", [False, True], ids=["unscale_", "unscale_to_"])
def test_non_finite_in_last_tensor_sets_found_inf(device, value, position, last_dtype,
                                                   out_of_place):
    src = edge_list(device, dtypes=DTYPES[:3])
    src[-1] = src[-1].to(last_dtype)
    src[-1][POSITIONS[position]] = value
    expected = [(s.float() * INV_SCALE).to(torch.float32 if out_of_place else s.dtype)
                for s in src]
    found_inf = scalar(0.0, device)
    inv_scale = scalar(INV_SCALE, device)

    if out_of_place:
        dst = [torch.empty_like(s, dtype=torch.float32) for s in src]
        ops.multi_tensor_unscale_to_(src, dst, found_inf, inv_scale)
    else:
        dst = src
        ops.multi_tensor_unscale_(dst, found_inf, inv_scale)

    assert found_inf.item() == 1.0
    for d, e in zip(dst, expected):
        torch.testing.assert_close(d, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("out_of_place", [False, True], ids=["unscale_", "unscale_to_"])
def test_found_inf_is_never_cleared(device, out_of_place):
    src = edge_list(device)
    expected = [unscaled(s, INV_SCALE) for s in src]
    found_inf = scalar(1.0, device)
    inv_scale = scalar(INV_SCALE, device)

    if out_of_place:
        dst = [torch.empty_like(s) for s in src]
        ops.multi_tensor_unscale_to_(src, dst, found_inf, inv_scale)
    else:
        dst = src
        ops.multi_tensor_unscale_(dst, found_inf, inv_scale)

    assert found_inf.item() == 1.0
    for d, e in zip(dst, expected):
        assert_bitwise_equal(d, e)  # the data is unscaled all the same


# --- unaligned storage ------------------------------------------------------------

UNALIGNED_SIZES = [37, C + 3]


@pytest.mark.parametrize("size", UNALIGNED_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unscale_unaligned(device, size, dtype):
    t = offset_copy(randn(size, dtype, device, seed=size))
    expected = unscaled(t, INV_SCALE)
    guard = t._base[0].clone()  # the element before the view
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_([t], found_inf, scalar(INV_SCALE, device))

    assert_bitwise_equal(t, expected)
    assert_bitwise_equal(t._base[0], guard, msg="wrote before the view")
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("size", UNALIGNED_SIZES)
@pytest.mark.parametrize("src_offset, dst_offset", [(1, 0), (0, 1), (1, 3)])
def test_unscale_to_copy_and_l2norm_unaligned(device, size, src_offset, dst_offset):
    def place(t, offset):
        return offset_copy(t, offset) if offset else t

    src = [place(randn(size, dtype, device, seed=i), src_offset) for i, dtype in enumerate(DTYPES)]
    dst = [place(torch.zeros(size, dtype=DTYPES[(i + 1) % 3], device=device), dst_offset)
           for i in range(3)]
    copies = [place(torch.zeros(size, dtype=DTYPES[(i + 2) % 3], device=device), dst_offset)
              for i in range(3)]
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_to_(src, dst, found_inf, scalar(INV_SCALE, device))
    ops.multi_tensor_copy_(src, copies)
    norm, per = ops.multi_tensor_l2norm(src, None, per_tensor=True)

    for s, d, c in zip(src, dst, copies):
        assert_bitwise_equal(d, (s.float() * INV_SCALE).to(d.dtype))
        assert_bitwise_equal(c, s.to(c.dtype))
    ref_norm, ref_per = ref_l2norm(src, per_tensor=True)
    torch.testing.assert_close(norm.double(), ref_norm.to(device), atol=0, rtol=1e-5)
    torch.testing.assert_close(per.double(), ref_per.to(device), atol=0, rtol=1e-5)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("size", UNALIGNED_SIZES)
def test_optimizers_unaligned(device, size):
    """Masters, grads, state and model copy each at a different misalignment."""
    def lists(seed):
        masters = [offset_copy(randn(size, torch.float32, device, seed=seed), 1)]
        grads = [offset_copy(randn(size, torch.float16, device, seed=seed + 1), 3)]
        state = [offset_copy(randn(size, torch.float32, device, seed=seed + 2).abs(), 2)]
        model = [offset_copy(masters[0].to(torch.bfloat16), 1)]
        return masters, grads, state, model

    masters, grads, bufs, model = lists(0)
    ref_p, ref_b = ref_sgd(masters, grads, bufs, lr=0.1, momentum=0.9)
    ops.fused_sgd_(masters, grads, bufs, model, lr=0.1, momentum=0.9)
    torch.testing.assert_close(masters[0].double(), ref_p[0], **MASTER_TOL)
    torch.testing.assert_close(bufs[0].double(), ref_b[0], **MASTER_TOL)
    assert_bitwise_equal(model[0], masters[0].to(torch.bfloat16))

    masters, grads, _, model = lists(10)
    m, v = adam_state(masters, device, seed=20)
    m, v = [offset_copy(m[0], 2)], [offset_copy(v[0], 3)]
    step = scalar(0.0, device)
    ref_p, ref_m, ref_v, _ = ref_adam(masters, grads, m, v, 0.0, lr=1e-2)
    ops.fused_adam_(masters, grads, m, v, model, step=step, lr=1e-2)
    torch.testing.assert_close(masters[0].double(), ref_p[0], **MASTER_TOL)
    torch.testing.assert_close(m[0].double(), ref_m[0], **MASTER_TOL)
    torch.testing.assert_close(v[0].double(), ref_v[0], **MASTER_TOL)
    assert_bitwise_equal(model[0], masters[0].to(torch.bfloat16))


# --- zero-size tensors and empty lists ----------------------------------------------

def zero_size_mix(device, dtype=torch.float32, seed=0):
    return [torch.empty(0, dtype=dtype, device=device),
            randn((3, 4), dtype, device, seed=seed),
            torch.empty((0, 5), dtype=dtype, device=device)]


@pytest.mark.parametrize("initial", [0.0, 1.0])
def test_empty_lists_are_no_ops(device, initial):
    found_inf = scalar(initial, device)
    inv_scale = scalar(INV_SCALE, device)
    step = scalar(5.0, device)
    before = snapshot([found_inf, inv_scale, step])

    ops.multi_tensor_unscale_([], found_inf, inv_scale)
    ops.multi_tensor_unscale_to_([], [], found_inf, inv_scale)
    ops.multi_tensor_copy_([], [])
    ops.fused_sgd_([], [], [], [], lr=0.1, inv_scale=inv_scale, found_inf=found_inf)
    # The wrapper returns early on no params; the op itself must cope too.
    torch.ops.mixedprec.fused_sgd_.default([], [], [], [], 0.1, 0.0, 0.0, 0.0, False, False,
                                           inv_scale, found_inf)
    ops.fused_adam_([], [], [], [], [], step=step, lr=0.1, inv_scale=inv_scale, found_inf=found_inf)
    norm, per = ops.multi_tensor_l2norm([], inv_scale, per_tensor=True)

    assert_unchanged([found_inf, inv_scale, step], before)
    assert norm.tolist() == [0.0] and norm.device.type == device
    assert per.shape == (0,) and per.device.type == device


def test_zero_size_tensors_are_skipped(device):
    tensors = zero_size_mix(device)
    expected = unscaled(tensors[1], INV_SCALE)
    found_inf = scalar(0.0, device)
    inv_scale = scalar(INV_SCALE, device)

    ops.multi_tensor_unscale_(tensors, found_inf, inv_scale)
    assert_bitwise_equal(tensors[1], expected)

    dst = [torch.empty_like(t, dtype=torch.float16) for t in tensors]
    ops.multi_tensor_unscale_to_(tensors, dst, found_inf, inv_scale)
    ops.multi_tensor_copy_(dst, tensors)
    assert_bitwise_equal(tensors[1], (expected * INV_SCALE).half().float())

    norm, per = ops.multi_tensor_l2norm(tensors, None, per_tensor=True)
    assert per[0].item() == 0.0 and per[2].item() == 0.0
    torch.testing.assert_close(norm, torch.linalg.vector_norm(tensors[1]).reshape(1))
    torch.testing.assert_close(per[1], torch.linalg.vector_norm(tensors[1]))
    assert found_inf.item() == 0.0

    params = zero_size_mix(device, seed=1)
    grads = zero_size_mix(device, dtype=torch.float16, seed=2)
    bufs = [torch.zeros_like(p) for p in params]
    model = [p.to(torch.bfloat16) for p in params]
    ref_p, _ = ref_sgd(params, grads, bufs, lr=0.1, momentum=0.5)
    ops.fused_sgd_(params, grads, bufs, model, lr=0.1, momentum=0.5)
    torch.testing.assert_close(params[1].double(), ref_p[1], **MASTER_TOL)

    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    step = scalar(0.0, device)
    ref_p, _, _, _ = ref_adam(params, grads, m, v, 0.0, lr=0.1)
    ops.fused_adam_(params, grads, m, v, model, step=step, lr=0.1)
    torch.testing.assert_close(params[1].double(), ref_p[1], **MASTER_TOL)
    assert step.item() == 1.0
    assert_bitwise_equal(model[1], params[1].to(torch.bfloat16))


# --- a tensor of more than 2^31 elements ----------------------------------------------

BIG = 2**31 + 5  # an fp16 tensor of 4 GiB; its last elements lie past int32 indexing
TAIL = 8  # the last TAIL elements straddle index 2^31 and hold distinct values


@pytest.fixture
def big_device(device):
    """CUDA with room for two 4 GiB tensors and their checks; the CPU twin skips, to
    keep CI's memory and time (the CPU engine's indexing is the planner's, covered by
    the GoogleTest suite's plan tests)."""
    if device == "cpu":
        pytest.skip("tensors of 2^31 elements are checked on a GPU only")
    free, _ = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip(f"needs 16 GiB of free GPU memory, has {free / 2**30:.1f}")
    return device


def big_tensor(device, head, tail):
    t = torch.full((BIG,), head, dtype=torch.float16, device=device)
    t[-TAIL:] = torch.tensor(tail, dtype=torch.float16)
    assert BIG - TAIL < 2**31 < BIG - 1
    return t


def test_ops_on_a_tensor_of_more_than_2_31_elements(big_device):
    device = big_device
    tail = [float(k) for k in range(1, TAIL + 1)]
    t = big_tensor(device, 2.0, tail)
    found_inf = scalar(0.0, device)

    # The overflow check sees an inf at the very last element, and only there.
    ops.multi_tensor_check_finite_([t], found_inf)
    assert found_inf.item() == 0.0
    t[-1] = float("inf")
    ops.multi_tensor_check_finite_([t], found_inf)
    assert found_inf.item() == 1.0
    t[-1] = tail[-1]
    found_inf.zero_()

    # Unscale writes every element exactly once: none skipped, none twice.
    ops.multi_tensor_unscale_([t], found_inf, scalar(0.5, device))
    assert found_inf.item() == 0.0
    assert bool((t[:-TAIL] == 1.0).all())
    assert t[-TAIL:].tolist() == [k / 2 for k in tail]

    # The L2 norm counts every element once.
    norm, per = ops.multi_tensor_l2norm([t], None, per_tensor=True)
    expected = ((BIG - TAIL) + sum((k / 2) ** 2 for k in tail)) ** 0.5
    assert norm.item() == pytest.approx(expected, rel=1e-6)
    assert per.item() == pytest.approx(expected, rel=1e-6)

    # SGD on an fp16 parameter without masters: p -= lr * g / scale.
    grad = big_tensor(device, 4.0, [8.0] * TAIL)
    ops.fused_sgd_([t], [grad], [], [], lr=0.125, momentum=0.0, dampening=0.0, weight_decay=0.0,
                   nesterov=False, first_run=False, inv_scale=scalar(0.5, device), found_inf=None)
    del grad
    assert bool((t[:-TAIL] == 0.75).all())
    assert t[-TAIL:].tolist() == [k / 2 - 0.5 for k in tail]


# --- every instruction set gives the same bits (CPU) ---------------------------------

def vector_capabilities():
    """The ATEN_CPU_CAPABILITY values above "default" that this machine can run (torch's
    own kernels follow ATEN_CPU_CAPABILITY=avx512 even on a CPU without it, and die on
    its first AVX-512 instruction); skips the test where there is none."""
    have = torch.backends.cpu.get_cpu_capability()
    vector = {"AVX2": ["avx2"], "AVX512": ["avx2", "avx512"]}.get(have, [])
    if not vector:
        pytest.skip(f"torch's CPU capability is {have}: no vector instruction set to compare")
    return vector


ISA_SCRIPT = """
import sys, torch
from mixedprec import ops
# The inputs come from the parent: torch.randn itself differs between instruction sets.
inputs = torch.load(sys.argv[1])
out = {}
for dtype, (masters, grads, m, v, bufs, sgd) in inputs.items():
    model = [x.to(grads[0].dtype) for x in masters]
    step, inv = torch.tensor([3.0]), torch.tensor([0.25])
    ops.fused_adam_(masters, grads, m, v, model, step=step, lr=1e-2, beta1=0.9, beta2=0.99,
                    eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True, bias_correction=True,
                    inv_scale=inv)
    ops.fused_sgd_(sgd, grads, bufs, [], lr=0.1, momentum=0.9, dampening=0.1,
                   weight_decay=1e-2, inv_scale=inv)
    scaled = [x.clone() for x in grads]
    found = torch.zeros(1)
    ops.multi_tensor_unscale_(scaled, found, inv)
    copies = [torch.empty(x.numel(), dtype=torch.bfloat16) for x in masters]
    ops.multi_tensor_copy_(masters, copies)
    norm, per = ops.multi_tensor_l2norm(grads, inv, per_tensor=True)
    # torch.optim's options: maxima above and below exp_avg_sq (one NaN), maximize, the
    # unscaled gradients written back.
    vmax = [x.flip(0) for x in v]
    vmax[2][5] = float("nan")
    unscaled = [x.clone() for x in grads]
    ops.fused_adam_(masters, unscaled, m, v, [], step=step, lr=1e-2, maximize=True,
                    max_exp_avg_sqs=vmax, inv_scale=inv, unscale_grads=True)
    ops.fused_sgd_(sgd, unscaled, bufs, [], lr=0.1, momentum=0.9, inv_scale=inv, maximize=True,
                   unscale_grads=True)
    out[dtype] = [masters, m, v, model, sgd, bufs, scaled, copies, [norm, per, found], vmax,
                  unscaled]
torch.save(out, sys.argv[2])
"""


def test_every_instruction_set_gives_the_same_bits(device, tmp_path):
    """The CPU loops are built for AVX-512, AVX2 and baseline x86-64 and picked at run
    time (ATEN_CPU_CAPABILITY lowers the choice): each must give the same bits, the
    vector loops with their software prefetches and without (MIXEDPREC_CPU_PREFETCH, whose
    default depends on the CPU's maker: vec.h's software_prefetch)."""
    if device == "cuda":
        pytest.skip("the CPU engine's instruction sets")
    import os
    import subprocess
    import sys
    sizes = [1, 7, 1000, 4097, 70000]
    inputs = {}
    for i, dtype in enumerate(DTYPES):
        masters = [randn(n, torch.float32, "cpu", seed=10 * i + 1) for n in sizes]
        grads = [randn(n, dtype, "cpu", seed=10 * i + 2, scale=10.0) for n in sizes]
        m, v = adam_state(masters, "cpu", seed=10 * i + 3)
        bufs = [randn(n, torch.float32, "cpu", seed=10 * i + 4) for n in sizes]
        sgd = [randn(n, torch.float32, "cpu", seed=10 * i + 5) for n in sizes]
        inputs[str(dtype)] = (masters, grads, m, v, bufs, sgd)
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "isa.py"
    script.write_text(ISA_SCRIPT)
    vector = vector_capabilities()
    runs = [("default", "1")] + [(c, prefetch) for c in vector for prefetch in ("0", "1")]
    results = {}
    for capability, prefetch in runs:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, MIXEDPREC_CPU_PREFETCH=prefetch)
        path = tmp_path / f"{capability}-{prefetch}.pt"
        subprocess.run([sys.executable, str(script), str(tmp_path / "inputs.pt"), str(path)],
                       env=env, check=True, timeout=120)
        results[capability, prefetch] = torch.load(path)
    for run in runs[1:]:
        for dtype, lists in results[runs[0]].items():
            for i, (base, other) in enumerate(zip(lists, results[run][dtype])):
                for j, (a, b) in enumerate(zip(base, other)):
                    assert_bitwise_equal(b, a, msg=f"{run} {dtype} list {i}[{j}]")


# AdamW in every master mode and moment dtype, through the optimizer: the CPU engine
# compiles its common modes once each (engine.h's Fixed: flags as constants, lists
# known present or absent) and runs the others (maximize, amsgrad), like the baseline
# build, through its generic loops. Shapes: 8-bit eligible matrices, vector tails, and
# a tensor past the first chunk (65536 elements). The last step has an inv_scale, as
# under a GradScaler, so the unscaled grads are written back (a list the fixed modes
# may have or not).
LEAN_ISA_SCRIPT = """
import sys, torch
from mixedprec.optim import SGD, Adam, AdamW
inputs = torch.load(sys.argv[1])
out = {}
modes = [(m, s, {}) for m in ("fp32", "none", "kahan", "stochastic", "remainder")
         for s in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)]
modes += [("fp32", torch.float32, {"amsgrad": True}),
          ("remainder", torch.float32, {"maximize": True}),
          ("none", torch.float32, {"fp32_params": True})]
# the precision report, whose count and sums each instruction set computes in its own form
modes += [(m, s, {"precision_report": True})
          for m, s in (("none", torch.bfloat16), ("none", torch.float8_e4m3fn),
                       ("kahan", torch.float32), ("stochastic", torch.bfloat16))]
# gradients with inf and NaN: params and state that become NaN, whose stored bf16 is c10's
# 0x7fc0 whatever NaN the arithmetic made (x86's is negative: inf / inf)
modes += [(m, s, {"nonfinite": True})
          for m, s in (("none", torch.bfloat16), ("kahan", torch.bfloat16),
                       ("remainder", torch.float32), ("stochastic", torch.bfloat16),
                       ("stochastic", torch.float32), ("fp32", torch.bfloat16),
                       ("remainder", torch.float8_e4m3fn))]
# Adam's weight decay (added to the gradient), none, and a beta1 of one half or less (the
# other form of torch's lerp)
modes += [("none", torch.bfloat16, {"adam": True}), ("remainder", torch.bfloat16,
          {"weight_decay": 0.0}), ("kahan", torch.bfloat16, {"betas": (0.3, 0.99)})]
# a long run's steps, where sqrt(1 - beta2^step) is 1 in float and the CPU skips the
# division by it (each pass: the pair passes, the 8-bit block pass, the generic one)
modes += [(m, s, {"start_step": 20000})
          for m, s in (("none", torch.bfloat16), ("kahan", torch.float32),
                       ("stochastic", torch.bfloat16), ("remainder", torch.float8_e4m3fn))]
modes += [("fp32", torch.bfloat16, {"start_step": 20000, "amsgrad": True})]
# SGD with momentum, whose Fixed modes take the same passes, stores and splits
modes += [(m, s, {"sgd": True}) for m in ("fp32", "none", "kahan", "stochastic", "remainder")
          for s in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)]
modes += [(m, s, {"sgd": True, "nonfinite": True})
          for m, s in (("none", torch.bfloat16), ("remainder", torch.float32),
                       ("stochastic", torch.float32))]
for master, state_dtype, extra in modes:
    extra = dict(extra)
    dtype = torch.float32 if extra.pop("fp32_params", False) else torch.bfloat16
    nonfinite = extra.pop("nonfinite", False)
    sgd = extra.pop("sgd", False)
    adam = extra.pop("adam", False)
    start_step = extra.pop("start_step", 0)
    extra.setdefault("weight_decay", 0.1)
    params = [torch.nn.Parameter(x.to(dtype)) for x in inputs["params"]]
    if master == "stochastic" or state_dtype == torch.float8_e4m3fn:
        extra["seed"] = 7
    if sgd:
        opt = SGD(params, lr=1e-2, momentum=0.9, master=master,
                  state_dtype=state_dtype, **extra)
    else:
        opt = (Adam if adam else AdamW)(params, lr=1e-2, master=master,
                                        state_dtype=state_dtype, **extra)
    for k, grads in enumerate(inputs["grads"]):
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        if nonfinite and k == 1:  # both halves of a 16-lane pair, and a vector tail
            flat = params[0].grad.view(-1)
            flat[3], flat[25], flat[40] = float("inf"), -float("inf"), float("nan")
            params[4].grad[-11] = float("inf")  # (in the last 8-lane vector)
            # and a NaN of the largest payload in fp32 state, which the update carries
            # to the param (0x7fffffff: rounding's carry must not reach the sign)
            state = opt.state[params[0]].get("exp_avg" if not sgd else "momentum_buffer")
            if state is not None and state.dtype == torch.float32:
                state.view(-1)[77] = torch.tensor(0x7fffffff, dtype=torch.int32).view(torch.float32)
        if k == len(inputs["grads"]) - 1:  # as torch.amp.GradScaler sets them
            opt.grad_scale, opt.found_inf = torch.full((1,), 4.0), torch.zeros(1)
        opt.step()
        if start_step and k == 0:  # (through the state dict, as a resume)
            sd = opt.state_dict()
            for st in sd["state"].values():
                st["step"] = torch.full_like(st["step"], float(start_step))
            opt.load_state_dict(sd)
    grads = [p.grad for p in params]
    key = (f"{sgd} {adam} {master} {state_dtype} {sorted(extra.items())} {dtype} {nonfinite} "
           f"{start_step}")
    report = opt.precision_report
    tallies = [] if report is None else report.tallies(params)
    out[key] = [[p.detach() for p in params] + grads, opt.state_dict()["state"], tallies]
torch.save(out, sys.argv[2])
"""


def test_every_instruction_set_gives_the_same_bits_in_every_lean_mode(device, tmp_path):
    """The fixed-mode loops of the CPU engine (AVX2, AVX-512) against the baseline
    build's scalar loop: the same params and state, bit for bit, in every mode of AdamW
    and of SGD with momentum, also from gradients with inf and NaN; with the precision
    report, the same counts, and sums of squares to 1e-3 (each loop adds its elements in
    fp32, in its own order, then in float64)."""
    if device == "cuda":
        pytest.skip("the CPU engine's instruction sets")
    import os
    import subprocess
    import sys
    # (131, 64): 8-bit moments whose blocks do not end on a multiple of the four whose
    # bits the AVX2 block pass draws at once (vec_pair.h's blocks_bits)
    shapes = [(64, 96), (128, 32), (37,), (300, 7), (65536 + 77,), (131, 64)]
    inputs = {"params": [randn(s, torch.float32, "cpu", seed=40 + i)
                         for i, s in enumerate(shapes)],
              "grads": [[randn(s, torch.float32, "cpu", seed=100 * k + i, scale=1e-2)
                         for i, s in enumerate(shapes)] for k in range(3)]}
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "lean_isa.py"
    script.write_text(LEAN_ISA_SCRIPT)
    vector = vector_capabilities()
    results = {}
    for capability in ["default", *vector]:
        path = tmp_path / f"{capability}.pt"
        subprocess.run([sys.executable, str(script), str(tmp_path / "inputs.pt"), str(path)],
                       env=dict(os.environ, ATEN_CPU_CAPABILITY=capability), check=True,
                       timeout=300)
        results[capability] = torch.load(path)
    assert len(results["default"]) == 55
    for capability in vector:
        for key, (params, state, tallies) in results["default"].items():
            other_params, other_state, other_tallies = results[capability][key]
            assert len(other_tallies) == len(tallies)
            for j, (a, b) in enumerate(zip(tallies, other_tallies)):
                assert b[[0, 3]].tolist() == a[[0, 3]].tolist(), f"{capability} {key} tally {j}"
                torch.testing.assert_close(b[1:3], a[1:3], rtol=1e-3, atol=0,
                                           msg=f"{capability} {key} tally {j}")
            for j, (a, b) in enumerate(zip(params, other_params)):
                assert_bitwise_equal(b, a, msg=f"{capability} {key} param {j}")
            for j, entry in state.items():
                for name, value in entry.items():
                    if torch.is_tensor(value):
                        assert_bitwise_equal(other_state[j][name], value,
                                             msg=f"{capability} {key} state {j} {name}")
