"""sum_fp32: fp32 accumulation and result for fp16/bf16/fp32 input, any dims and
strides, and its autograd formula."""

import pytest
import torch
from helpers import DTYPE_IDS, DTYPES, assert_within_eager_error, randn
from references import ref_sum_fp32

from mixedprec import ops

DIMS = [
    pytest.param(None, False, id="all"),
    pytest.param(None, True, id="all-keepdim"),
    pytest.param([1], False, id="dim1"),
    pytest.param([0, 2], False, id="dims02"),
    pytest.param([-1], True, id="neg-keepdim"),
    pytest.param([-3, 1], False, id="neg-and-pos"),
    pytest.param([2, 0, 1], True, id="every-dim-keepdim"),
]


def test_seed_case_is_exact(device):
    x = torch.full((4095,), 4.0, dtype=torch.float16, device=device)
    assert x.sum().item() == 16384.0  # what fp16 accumulation gives

    out = ops.sum_fp32(x)

    assert out.dtype == torch.float32 and out.shape == () and out.device.type == device
    assert out.item() == 16380.0


@pytest.mark.parametrize("dim, keepdim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_sum_matches_reference(device, dim, keepdim, dtype, layout):
    x = randn((6, 70, 50), dtype, device, seed=1, scale=100.0) + 50  # no cancellation to 0
    if layout == "transposed":
        x = x.transpose(0, 2).contiguous().transpose(0, 2)
    elif layout == "strided":
        x = (randn((6, 140, 100), dtype, device, seed=1, scale=100.0) + 50)[:, ::2, 1::2]
    assert x.is_contiguous() == (layout == "contiguous")
    before = x.clone()
    expected = ref_sum_fp32(x, dim, keepdim)
    eager = torch.sum(x, dim, keepdim, dtype=torch.float32)

    out = ops.sum_fp32(x, dim, keepdim)

    assert out.dtype == torch.float32 and out.device.type == device
    assert out.shape == expected.shape
    assert_within_eager_error(out, expected, eager)
    assert torch.equal(x, before)


def test_large_fp16_sum_does_not_overflow(device):
    # 2^17 values of 1.0: fp16 accumulation stalls at 2048 (and overflows beyond 65504).
    x = torch.ones((4, 1 << 15), dtype=torch.float16, device=device)
    assert ops.sum_fp32(x).item() == float(1 << 17)
    assert ops.sum_fp32(x, [1]).tolist() == [float(1 << 15)] * 4


def test_scalar_and_empty_inputs(device):
    x = torch.tensor(3.5, dtype=torch.bfloat16, device=device)
    out = ops.sum_fp32(x)
    assert out.shape == () and out.dtype == torch.float32 and out.item() == 3.5

    empty = torch.empty((0, 3), dtype=torch.float16, device=device)
    assert ops.sum_fp32(empty).item() == 0.0
    assert ops.sum_fp32(empty, [0]).tolist() == [0.0, 0.0, 0.0]
    assert ops.sum_fp32(empty, [1], True).shape == (0, 1)


def test_float64_stays_float64(device):
    x = randn((5, 7), torch.float64, device, seed=2)
    out = ops.sum_fp32(x, [0])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x.sum(0), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dim, keepdim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward(device, dim, keepdim, dtype):
    x = randn((3, 4, 5), dtype, device, seed=3).requires_grad_()
    out = ops.sum_fp32(x, dim, keepdim)
    grad_out = randn(out.shape, torch.float32, device, seed=4)

    (grad_x,) = torch.autograd.grad(out, x, grad_out)

    assert grad_x.dtype == dtype and grad_x.shape == x.shape
    # The reference: autograd of torch.sum over the same dims, in fp32.
    x32 = x.detach().float().requires_grad_()
    (expected,) = torch.autograd.grad(ref_sum_fp32(x32, dim, keepdim).float(), x32, grad_out)
    torch.testing.assert_close(grad_x, expected.to(dtype), rtol=0, atol=0)


def test_backward_non_contiguous(device):
    base = randn((4, 10), torch.float16, device, seed=5).requires_grad_()
    x = base[:, ::2]
    out = ops.sum_fp32(x, [0])
    out.backward(torch.arange(5.0, device=device))
    expected = torch.zeros(4, 10, dtype=torch.float16, device=device)
    expected[:, ::2] = torch.arange(5.0, device=device)
    assert base.grad.dtype == torch.float16
    torch.testing.assert_close(base.grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dim, keepdim", [(None, False), ([1], False), ([0, -1], True)])
def test_gradcheck(device, dim, keepdim):
    x = randn((3, 4, 2), torch.float64, device, seed=6).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ops.sum_fp32(t, dim, keepdim), (x,))
    assert torch.autograd.gradgradcheck(lambda t: ops.sum_fp32(t, dim, keepdim), (x,))
