"""Apex's ``fused_adam_cuda.adam`` (the one-tensor FusedAdam kernel of Apex's releases
before late 2019, which OpenNMT-py's ``-optim fusedadam`` and fairseq's ``FusedAdamV1``
import directly): against Apex's formula in float64, in both eps modes, with and
without bias correction and decay, fp16 gradients writing the fp16 model copy; through
the alias; bad arguments named with nothing changed."""

import numpy as np
import pytest
import torch

from mixedprec.compat import fused_adam_cuda


def apex_reference(p, m, v, g, lr, beta1, beta2, eps, scale, step, mode, bias_correction,
                   decay):
    """Apex's kernel in float64, with its float32 constants and step size."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    f32 = np.float32
    if bias_correction:
        bc1, bc2 = f32(1 - float(f32(beta1)) ** step), f32(1 - float(f32(beta2)) ** step)
        step_size = float(f32(f32(lr) * np.sqrt(bc2)) / bc1)
    else:
        step_size = float(f32(lr))
    w1, w2 = float(f32(1) - f32(beta1)), float(f32(1) - f32(beta2))
    beta1, beta2, eps, scale, decay = (float(f32(x)) for x in (beta1, beta2, eps, scale, decay))
    g = g / scale
    m = beta1 * m + w1 * g
    v = beta2 * v + w2 * g * g
    denom = (v + eps).sqrt() if mode == 0 else v.sqrt() + eps
    return p - step_size * (m / denom + decay * p), m, v


def tensors(device, grad_dtype=torch.float32, n=257, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    g = (torch.randn(n, generator=gen) * 64).to(grad_dtype)
    return [t.to(device) for t in (p, m, v, g)]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction, decay, step", [(1, 0.0, 1), (1, 0.01, 7),
                                                          (0, 0.01, 3)])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_one_step_is_apexs_formula(device, mode, bias_correction, decay, step, grad_dtype):
    p, m, v, g = tensors(device, grad_dtype)
    want_p, want_m, want_v = apex_reference(p, m, v, g, 1e-3, 0.9, 0.999, 1e-8, 64.0, step,
                                            mode, bias_correction, decay)
    copy = torch.empty(p.shape, dtype=torch.float16, device=device) \
        if grad_dtype == torch.float16 else torch.tensor([], device=device)
    fused_adam_cuda.adam(p, copy, m, v, g, 1e-3, 0.9, 0.999, 1e-8, 64.0, step, mode,
                         bias_correction, decay)
    torch.testing.assert_close(p.double(), want_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m.double(), want_m, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(v.double(), want_v, rtol=1e-6, atol=1e-10)
    if copy.numel():
        assert torch.equal(copy, p.half())


def test_an_optimizer_of_that_time_trains_as_torch_adam_without_decay():
    """A FusedAdam of Apex's 2019 shape (its own state, one call per parameter) in eps
    mode 1 with bias correction: torch's Adam differs by where eps meets the bias
    correction only (eps tiny against sqrt(v) here)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-12)
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()}
    for step in range(1, 6):
        x = torch.randn(16, 8)
        for net in (model, ref):
            net.zero_grad()
            net(x).pow(2).mean().backward()
        for p in model.parameters():
            m, v = state[p]
            fused_adam_cuda.adam(p.data, torch.tensor([]), m, v, p.grad, 1e-2, 0.9, 0.999,
                                 1e-12, 1.0, step, 1, 1, 0.0)
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


BAD = {
    "p-half": (dict(p=torch.zeros(4, dtype=torch.float16)), TypeError, "expected p to be float32"),
    "m-shape": (dict(m=torch.zeros(5)), ValueError, "expected m to be a torch.float32 tensor"),
    "g-int": (dict(g=torch.zeros(4, dtype=torch.int32)), ValueError, "expected g to be"),
    "p_copy-size": (dict(p_copy=torch.zeros(3, dtype=torch.float16)), ValueError,
                    "expected p_copy to be empty"),
    "lr-str": (dict(lr="1e-3"), TypeError, "expected lr to be a number"),
    "eps-nan": (dict(eps=float("nan")), ValueError, "expected eps to be finite"),
    "step-float": (dict(step=1.0), TypeError, "expected step to be an int"),
    "mode-2": (dict(mode=2), ValueError, "expected mode to be 0"),
    "bias_correction-2": (dict(bias_correction=2), ValueError, "expected bias_correction"),
    "scale-0": (dict(grad_scale=0.0), ValueError, "expected grad_scale to be nonzero"),
    "step-0": (dict(step=0), ValueError, "expected step >= 1 with bias_correction"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_argument_is_named_and_changes_nothing(case):
    change, error, message = BAD[case]
    args = dict(p=torch.ones(4), p_copy=torch.tensor([]), m=torch.zeros(4), v=torch.zeros(4),
                g=torch.ones(4), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, grad_scale=1.0,
                step=1, mode=0, bias_correction=1, decay=0.0)
    args.update(change)
    before = {k: t.clone() for k, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(error, match=f"fused_adam_cuda.adam: {message}"):
        fused_adam_cuda.adam(**args)
    for k, t in before.items():
        assert torch.equal(args[k], t), k


def test_the_alias_resolves_it():
    import mixedprec.apex as alias

    alias.install()
    try:
        import fused_adam_cuda as imported

        assert imported is fused_adam_cuda and imported.adam is fused_adam_cuda.adam
    finally:
        alias.uninstall()
