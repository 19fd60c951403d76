"""mixedprec.normalization (apex.normalization): layer and RMS norm modules and
functions against float64 references, their output dtypes (input's, or the parameters'
for the mixed ones), gradients, autocast, Apex's constructor arguments and errors."""

import inspect

import pytest
import torch
from helpers import randn

from mixedprec import normalization as N


def ref_layer_norm(x, shape, weight, bias, eps):
    x = x.double()
    dims = tuple(range(-len(shape), 0))
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, unbiased=False, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def ref_rms_norm(x, shape, weight, eps):
    x = x.double()
    dims = tuple(range(-len(shape), 0))
    y = x / torch.sqrt(x.square().mean(dims, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float64: dict(atol=1e-12, rtol=1e-12)}


def params(shape, dtype, device):
    weight = randn(shape, torch.float32, device, seed=1, scale=0.5).add_(1.0).to(dtype)
    bias = randn(shape, torch.float32, device, seed=2, scale=0.5).to(dtype)
    return weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(16,), (3, 8)], ids=["last", "last2"])
def test_functions_match_reference(device, dtype, shape):
    x = randn((4, 5) + shape, torch.float32, device, seed=0, scale=3.0).add_(1.5).to(dtype)
    weight, bias = params(shape, dtype, device)
    eps = 1e-6
    cases = [
        (N.fused_layer_norm_affine(x, weight, bias, shape, eps),
         ref_layer_norm(x, shape, weight, bias, eps)),
        (N.fused_layer_norm(x, shape, eps), ref_layer_norm(x, shape, None, None, eps)),
        (N.fused_rms_norm_affine(x, weight, shape, eps), ref_rms_norm(x, shape, weight, eps)),
        (N.fused_rms_norm(x, shape, eps), ref_rms_norm(x, shape, None, eps)),
    ]
    for out, expected in cases:
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_dtype_functions_return_the_parameters_dtype(device, dtype):
    """Apex's mixed-dtype kernels: low-precision input, float32 parameters, float32
    output (the parameters' dtype), statistics in float32."""
    shape = (12,)
    x = randn((6, 12), torch.float32, device, seed=3, scale=2.0).to(dtype)
    weight, bias = params(shape, torch.float32, device)
    out = N.mixed_dtype_fused_layer_norm_affine(x, weight, bias, shape, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_layer_norm(x, shape, weight, bias, 1e-5),
                               atol=1e-5, rtol=1e-5)
    out = N.mixed_dtype_fused_rms_norm_affine(x, weight, shape, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_rms_norm(x, shape, weight, 1e-5),
                               atol=1e-5, rtol=1e-5)
    # The non-mixed functions return the input's dtype with the same parameters.
    assert N.fused_layer_norm_affine(x, weight, bias, shape).dtype == dtype
    assert N.fused_rms_norm_affine(x, weight, shape).dtype == dtype


@pytest.mark.parametrize("cls", [N.FusedLayerNorm, N.MixedFusedLayerNorm, N.FusedRMSNorm,
                                 N.MixedFusedRMSNorm])
def test_modules_forward_backward(device, cls):
    torch.manual_seed(0)
    rms = "RMS" in cls.__name__
    module = cls(10, eps=1e-4, memory_efficient=True).to(device)
    assert module.memory_efficient and module.eps == 1e-4
    assert module.normalized_shape == torch.Size([10])
    assert torch.equal(module.weight, torch.ones(10, device=device))
    assert ("bias" in dict(module.named_parameters())) != rms
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        if not rms:
            module.bias.uniform_(-1, 1)
    x = randn((3, 4, 10), torch.float32, device, seed=5).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    w64 = module.weight.detach().double().requires_grad_()
    if rms:
        expected = ref_rms_norm(x64, (10,), w64, 1e-4)
    else:
        expected = ref_layer_norm(x64, (10,), w64, module.bias.detach().double(), 1e-4)
    out = module(x)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    grad = randn((3, 4, 10), torch.float64, device, seed=6)
    out.backward(grad.float())
    expected.backward(grad)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(module.weight.grad.double(), w64.grad, atol=1e-4, rtol=1e-4)


def test_mixed_modules_keep_fp32_params_with_half_input(device):
    """Megatron's use: fp32 parameters, bf16 activations; the output is the
    parameters' dtype for the Mixed* modules, the input's for the plain ones."""
    x = randn((2, 8), torch.float32, device, seed=7).to(torch.bfloat16)
    for cls, out_dtype in [(N.MixedFusedLayerNorm, torch.float32),
                           (N.MixedFusedRMSNorm, torch.float32),
                           (N.FusedLayerNorm, torch.bfloat16), (N.FusedRMSNorm, torch.bfloat16)]:
        module = cls(8).to(device)
        assert module.weight.dtype == torch.float32
        assert module(x).dtype == out_dtype, cls.__name__
    half = N.MixedFusedLayerNorm(8).to(device).to(torch.bfloat16)
    assert half(x).dtype == torch.bfloat16  # a converted module: bf16 params, bf16 out


def test_autocast_casts_the_arguments_as_apex():
    module = N.MixedFusedLayerNorm(8)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    assert out.dtype == torch.bfloat16  # weight cast to bf16 too: bf16 output
    expected = ref_layer_norm(x.bfloat16(), (8,), module.weight.bfloat16(),
                              module.bias.bfloat16(), 1e-5)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_apex_signatures_and_errors():
    assert list(inspect.signature(N.FusedLayerNorm).parameters) == [
        "normalized_shape", "eps", "elementwise_affine", "memory_efficient"]
    sig = inspect.signature(N.MixedFusedRMSNorm)
    assert sig.parameters["memory_efficient"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(N.fused_layer_norm).parameters["eps"].default == 1e-6
    plain = N.FusedLayerNorm((2, 3), elementwise_affine=False)
    assert plain.weight is None and plain.bias is None
    assert "elementwise_affine=False" in repr(plain)
    assert N.MixedFusedLayerNorm(4, elementwise_affine=True).weight is not None
    with pytest.raises(ValueError, match="elementwise_affine"):
        N.MixedFusedLayerNorm(4, elementwise_affine=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        N.MixedFusedRMSNorm(4, bias=True)
    with pytest.raises(TypeError, match="normalized_shape"):
        N.FusedRMSNorm("8")
    with pytest.raises(TypeError, match="input"):
        N.fused_rms_norm([1.0, 2.0], 2)


def test_manual_rms_norm_dtypes():
    x = torch.randn(3, 6, dtype=torch.float16)
    w16 = torch.rand(6, dtype=torch.float16) + 0.5
    assert N.manual_rms_norm(x, (6,), w16, 1e-6).dtype == torch.float16
    out = N.manual_rms_norm(x, (6,), w16.float(), 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_rms_norm(x, (6,), w16, 1e-6), atol=1e-5,
                               rtol=1e-5)
    assert N.manual_rms_norm(x, (6,), None, 1e-6).dtype == torch.float32
