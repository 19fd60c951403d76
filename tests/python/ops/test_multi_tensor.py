"""multi_tensor_unscale_, multi_tensor_unscale_to_, multi_tensor_check_finite_,
multi_tensor_copy_ and multi_tensor_l2norm against their float64 references."""

import pytest
import torch
from helpers import (
    DTYPE_IDS,
    DTYPES,
    FLOAT_DTYPES,
    assert_bitwise_equal,
    assert_within_eager_error,
    randn,
    scalar,
)
from references import ref_copy, ref_l2norm, ref_unscale

from mixedprec import ops

# Shapes of one list: odd sizes, a matrix and a channels_last batch (dense, permuted).
SHAPES = [(1,), (7,), (33, 5), (2, 3, 4, 5)]
INV_SCALE = 1 / 3  # not a power of two: the fp32 product must be rounded


def make_list(dtype, device, seed=0, scale=100.0):
    tensors = [randn(s, dtype, device, seed=seed + i, scale=scale) for i, s in enumerate(SHAPES)]
    tensors[-1] = tensors[-1].to(memory_format=torch.channels_last)
    return tensors


def make_mixed_list(device, seed=0, scale=100.0):
    """fp32, fp16 and bf16 tensors interleaved in one list."""
    return [
        randn(s, DTYPES[i % 3], device, seed=seed + i, scale=scale)
        for i, s in enumerate(SHAPES + SHAPES)
    ]


@pytest.mark.parametrize("dtype, atol, rtol", FLOAT_DTYPES)
def test_unscale_matches_reference(device, dtype, atol, rtol):
    tensors = make_list(dtype, device)
    inv_scale = scalar(INV_SCALE, device)
    expected, _ = ref_unscale(tensors, inv_scale.item())
    eager = [(t.float() * inv_scale).to(dtype) for t in tensors]
    found_inf = scalar(0.0, device)
    inv_scale_before = inv_scale.clone()

    ops.multi_tensor_unscale_(tensors, found_inf, inv_scale)

    for t, ref, e in zip(tensors, expected, eager):
        torch.testing.assert_close(t.double(), ref, atol=atol, rtol=rtol)
        assert_bitwise_equal(t, e)  # fp32 math, rounded once, like eager
    assert found_inf.item() == 0.0
    assert_bitwise_equal(inv_scale, inv_scale_before)


def test_unscale_mixed_dtypes(device):
    tensors = make_mixed_list(device)
    inv_scale = scalar(INV_SCALE, device)
    eager = [(t.float() * inv_scale).to(t.dtype) for t in tensors]
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_(tensors, found_inf, inv_scale)

    for t, e in zip(tensors, eager):
        assert_bitwise_equal(t, e)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 7, -1], ids=["first", "middle", "last"])
def test_check_finite_reads_only(device, bad, where):
    tensors = make_mixed_list(device)
    found_inf = scalar(0.0, device)
    ops.multi_tensor_check_finite_(tensors, found_inf)
    assert found_inf.item() == 0.0

    tensors[-1].view(-1)[where] = bad
    before = [t.clone() for t in tensors]
    ops.multi_tensor_check_finite_(tensors, found_inf)

    assert found_inf.item() == 1.0
    for t, b in zip(tensors, before):
        assert_bitwise_equal(t, b)


def test_check_finite_never_clears(device):
    found_inf = scalar(1.0, device)
    ops.multi_tensor_check_finite_(make_mixed_list(device), found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dst_dtype, atol, rtol", FLOAT_DTYPES)
def test_unscale_to_matches_reference(device, src_dtype, dst_dtype, atol, rtol):
    src = make_list(src_dtype, device)
    src_before = [s.clone() for s in src]
    dst = [torch.full_like(s, 7.0, dtype=dst_dtype) for s in src]
    inv_scale = scalar(INV_SCALE, device)
    expected, _ = ref_unscale(src, inv_scale.item())
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_to_(src, dst, found_inf, inv_scale)

    for s, s0, d, ref in zip(src, src_before, dst, expected):
        torch.testing.assert_close(d.double(), ref, atol=atol, rtol=rtol)
        assert_bitwise_equal(d, (s0.float() * inv_scale).to(dst_dtype))
        assert_bitwise_equal(s, s0, msg="src was modified")
    assert found_inf.item() == 0.0


def test_unscale_to_mixed_dtypes(device):
    src = make_mixed_list(device)
    dst = [torch.empty_like(s, dtype=DTYPES[(i + 1) % 3]) for i, s in enumerate(src)]
    inv_scale = scalar(INV_SCALE, device)
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_to_(src, dst, found_inf, inv_scale)

    for s, d in zip(src, dst):
        assert_bitwise_equal(d, (s.float() * inv_scale).to(d.dtype))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dst_dtype, atol, rtol", FLOAT_DTYPES)
def test_copy_matches_reference(device, src_dtype, dst_dtype, atol, rtol):
    src = make_list(src_dtype, device)
    src_before = [s.clone() for s in src]
    dst = [torch.zeros_like(s, dtype=dst_dtype) for s in src]
    expected = ref_copy(src)

    ops.multi_tensor_copy_(src, dst)

    for s, s0, d, ref in zip(src, src_before, dst, expected):
        torch.testing.assert_close(d.double(), ref, atol=atol, rtol=rtol)
        assert_bitwise_equal(d, torch.empty_like(d).copy_(s0))
        assert_bitwise_equal(s, s0, msg="src was modified")


def test_copy_mixed_dtypes(device):
    src = make_mixed_list(device)
    dst = [torch.empty_like(s, dtype=DTYPES[(i + 2) % 3]) for i, s in enumerate(src)]

    ops.multi_tensor_copy_(src, dst)

    for s, d in zip(src, dst):
        assert_bitwise_equal(d, s.to(d.dtype))


def eager_l2norm(tensors, inv_scale):
    """What eager PyTorch computes in fp32 for the same norms."""
    scaled = [t.float().flatten() * (1.0 if inv_scale is None else inv_scale) for t in tensors]
    per = torch.stack([torch.linalg.vector_norm(s) for s in scaled])
    return torch.linalg.vector_norm(torch.cat(scaled)).reshape(1), per


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inv_scale_value", [None, 1 / 1000], ids=["no_inv_scale", "inv_scale"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["total", "per_tensor"])
def test_l2norm_matches_reference(device, dtype, inv_scale_value, per_tensor):
    tensors = make_list(dtype, device, scale=30.0)
    tensors.append(randn(5000, dtype, device, seed=9, scale=1e-2))
    before = [t.clone() for t in tensors]
    inv_scale = None if inv_scale_value is None else scalar(inv_scale_value, device)
    inv = None if inv_scale is None else inv_scale.item()
    ref_norm, ref_per = ref_l2norm(tensors, inv, per_tensor=True)
    eager_norm, eager_per = eager_l2norm(tensors, inv)

    norm, per = ops.multi_tensor_l2norm(tensors, inv_scale, per_tensor=per_tensor)

    assert norm.dtype == torch.float32 and norm.shape == (1,) and norm.device.type == device
    assert per.dtype == torch.float32 and per.device.type == device
    assert_within_eager_error(norm, ref_norm.to(device), eager_norm)
    if per_tensor:
        assert per.shape == (len(tensors),)
        assert_within_eager_error(per, ref_per.to(device), eager_per)
    else:
        assert per.shape == (0,)
    for t, t0 in zip(tensors, before):
        assert_bitwise_equal(t, t0, msg="an input was modified")


def test_l2norm_mixed_dtypes(device):
    tensors = make_mixed_list(device)
    ref_norm, ref_per = ref_l2norm(tensors, per_tensor=True)
    eager_norm, eager_per = eager_l2norm(tensors, None)

    norm, per = ops.multi_tensor_l2norm(tensors, None, per_tensor=True)

    assert_within_eager_error(norm, ref_norm.to(device), eager_norm)
    assert_within_eager_error(per, ref_per.to(device), eager_per)


def test_l2norm_is_deterministic(device):
    # Many chunks, so that a reduction in completion order would show.
    tensors = [randn(3 * ops.CHUNK_SIZE + 11, torch.float32, device, seed=1),
               randn(ops.CHUNK_SIZE - 5, torch.float16, device, seed=2)]
    first = ops.multi_tensor_l2norm(tensors, None, per_tensor=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the CPU kernel must not depend on the thread count
        single = ops.multi_tensor_l2norm(tensors, None, per_tensor=True)
    finally:
        torch.set_num_threads(threads)
    again = ops.multi_tensor_l2norm(tensors, None, per_tensor=True)
    for a, b, c in zip(first, single, again):
        assert_bitwise_equal(a, b)
        assert_bitwise_equal(a, c)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "inf", "-inf"])
def test_unscale_to_sets_found_inf_without_touching_src(device, value):
    src = make_mixed_list(device)
    src[3].view(-1)[5] = value
    src_before = [s.clone() for s in src]
    dst = [torch.empty_like(s) for s in src]
    found_inf = scalar(0.0, device)

    ops.multi_tensor_unscale_to_(src, dst, found_inf, scalar(0.5, device))

    assert found_inf.item() == 1.0
    for s, s0, d in zip(src, src_before, dst):
        assert_bitwise_equal(s, s0)
        assert_bitwise_equal(d, (s0.float() * 0.5).to(d.dtype))
