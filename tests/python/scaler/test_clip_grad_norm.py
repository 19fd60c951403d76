"""GradScaler.clip_grad_norm_: clipping by the global norm of the unscaled gradients,
for optimizers that unscale inside their step without writing the gradients first (so
the fp16 gradients of an fp16 model with fp32 masters too), against unscaling and
clipping in float32; torch's clip_grad_norm_ after unscale_ for other optimizers; an
overflow skips the step; the order of calls is checked; no host read."""

import contextlib

import pytest
import torch
from helpers import assert_bitwise_equal, forbid_host_sync, make_model, randn

import mixedprec
from mixedprec import GradScaler, grads, optim

SIZES = (16, 32, 8)
OPTIMIZERS = [(optim.AdamW, dict(lr=1e-2, weight_decay=0.01)),
              (optim.SGD, dict(lr=0.05, momentum=0.9)),
              (mixedprec.FusedAdam, dict(lr=1e-2, master_weights=True))]


def batch(step, device, dtype):
    return randn((4, SIZES[0]), torch.float32, "cpu", seed=300 + step).to(device, dtype)


def backward(model, scaler, step, device, dtype):
    out = model(batch(step, device, dtype)).float()
    scaler.scale(out.square().mean() * 10).backward()


def masters(opt, model):
    return [opt.state[p]["master_param"] for p in model.parameters()]


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_an_fp16_model_with_fp32_masters_clips_as_unscale_then_clip_in_float32(
        device, cls, kwargs):
    """Each step's norm is that of the fp16 gradients / scale, in float32; the masters
    step as an fp32 optimizer given those gradients unscaled and clipped (torch's
    clip_coef), to float32 rounding: the step divides by scale / clip_coef at once."""
    model = make_model(device, torch.float16, sizes=SIZES)
    opt = cls(model.parameters(), **kwargs)
    scaler = GradScaler(device, init_scale=2.0**10)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    if cls is mixedprec.FusedAdam:  # (Apex's defaults: weight_decay 0)
        ref_opt = optim.AdamW(reference, lr=kwargs["lr"], weight_decay=0.0)
    else:
        ref_opt = cls(reference, **kwargs)
    clipped = 0
    for step in range(6):
        opt.zero_grad()
        backward(model, scaler, step, device, torch.float16)
        inv = 1.0 / scaler.get_scale()
        unscaled = [p.grad.float() * inv for p in model.parameters()]
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in unscaled]))
        max_norm = float(expected) * (0.5 if step % 2 else 2.0)  # clipped every other step
        norm = scaler.clip_grad_norm_(opt, max_norm)
        assert norm.dtype == torch.float32 and norm.shape == () and norm.device == \
            scaler._scale.device
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        clipped += int(coef < 1)
        for r, g in zip(reference, unscaled):
            r.grad = g * coef
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        for m, r in zip(masters(opt, model), reference):
            torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-7)
    assert clipped == 3
    assert scaler.get_scale() == 2.0**10  # no overflow


def test_the_global_norm_takes_every_device_dtype_and_layout(device):
    gs = [randn((33, 7), torch.float16, device, seed=1),
          randn((5,), torch.bfloat16, device, seed=2),
          randn((8, 6), torch.float32, device, seed=3)[:, ::2],  # not dense
          randn((4,), torch.float64, device, seed=4),
          torch.sparse_coo_tensor([[0, 2, 2]], [1.0, 2.0, 3.0], (4,), device=device,
                                  check_invariants=True)]
    inv = torch.tensor(0.25, device=device)
    expected = torch.linalg.vector_norm(torch.cat([g.to_dense().double().flatten() for g in gs]))
    total = grads.global_norm(gs, inv)
    assert total.dtype == torch.float32 and total.shape == () and total.device == inv.device
    torch.testing.assert_close(total.double(), expected * 0.25, rtol=1e-6, atol=0)
    assert grads.global_norm([], inv).item() == 0.0
    gs[1][0] = float("inf")
    assert torch.isinf(grads.global_norm(gs, inv))


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS[:2])
def test_an_overflow_skips_the_clipped_step(device, cls, kwargs):
    model = make_model(device, torch.float16, sizes=SIZES)
    opt = cls(model.parameters(), **kwargs)
    scaler = GradScaler(device, init_scale=2.0**10)
    backward(model, scaler, 0, device, torch.float16)
    scaler.step(opt)  # (the state made)
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()] + [
        m.clone() for m in masters(opt, model)]
    opt.zero_grad()
    backward(model, scaler, 1, device, torch.float16)
    next(model.parameters()).grad[0, 0] = float("inf")
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert not torch.isfinite(norm)
    scaler.step(opt)
    scaler.update()
    after = [p.detach() for p in model.parameters()] + masters(opt, model)
    for a, b in zip(after, before):
        assert_bitwise_equal(a, b)
    assert scaler.get_scale() == 2.0**9
    assert float(scaler.found_inf()) == 1.0


def test_optimizers_that_unscale_outside_their_step_clip_as_torch(device):
    """torch.optim.SGD (not fused): unscale_ and torch's clip_grad_norm_, bit for bit as
    with torch's scaler."""
    runs = []
    for scaler_cls in (GradScaler, torch.amp.GradScaler):
        model = make_model(device, torch.float32, sizes=SIZES)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        scaler = scaler_cls(device, init_scale=2.0**8)
        for step in range(3):
            opt.zero_grad()
            backward(model, scaler, step, device, torch.float32)
            if scaler_cls is GradScaler:
                norm = scaler.clip_grad_norm_(opt, 0.5)
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        runs.append(([p.detach() for p in model.parameters()], norm))
    for a, b in zip(*(params for params, _ in runs)):
        assert_bitwise_equal(a, b)
    assert_bitwise_equal(runs[0][1], runs[1][1])


def test_after_unscale_the_unscaled_gradients_are_clipped(device):
    model = make_model(device, torch.float32, sizes=SIZES)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    scaler = GradScaler(device, init_scale=2.0**8)
    backward(model, scaler, 0, device, torch.float32)
    scaler.unscale_(opt)
    unscaled = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in unscaled]))
    norm = scaler.clip_grad_norm_(opt, float(expected) / 2)
    torch.testing.assert_close(norm, expected)
    for p, g in zip(model.parameters(), unscaled):
        torch.testing.assert_close(p.grad, g * (float(expected) / 2) / (expected + 1e-6))
    scaler.step(opt)


def test_the_order_of_calls_is_checked(device):
    model = make_model(device, torch.float16, sizes=SIZES)
    opt = optim.AdamW(model.parameters())
    scaler = GradScaler(device)
    backward(model, scaler, 0, device, torch.float16)
    with pytest.raises(TypeError, match="max_norm to be a number or a one-element tensor, "
                                        "got str"):
        scaler.clip_grad_norm_(opt, "1.0")
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()
    opt.zero_grad()
    backward(model, scaler, 1, device, torch.float16)
    scaler.clip_grad_norm_(opt, 1.0)  # (a new iteration: allowed again)
    scaler.step(opt)
    scaler.update()
    # fp16 gradients of an optimizer that does not unscale in its step: unscale_'s error
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    plain.zero_grad()
    backward(model, scaler, 2, device, torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.clip_grad_norm_(plain, 1.0)


def test_a_disabled_scaler_clips_as_torch(device):
    model = make_model(device, torch.float32, sizes=SIZES)
    opt = optim.AdamW(model.parameters())
    scaler = GradScaler(device, enabled=False)
    backward(model, scaler, 0, device, torch.float32)
    grads_before = [p.grad.clone() for p in model.parameters()]
    norm = scaler.clip_grad_norm_(opt, 0.1)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads_before]))
    torch.testing.assert_close(norm, expected)


def test_clipping_and_the_step_do_not_sync(device, monkeypatch):
    model = make_model(device, torch.float16, sizes=SIZES)
    opt = optim.AdamW(model.parameters())
    scaler = GradScaler(device)
    for step in range(2):
        opt.zero_grad()
        backward(model, scaler, step, device, torch.float16)
        with forbid_host_sync(monkeypatch):
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS[:2] + [(torch.optim.SGD, dict(lr=0.05))])
def test_a_tensor_max_norm_clips_as_the_number(device, monkeypatch, cls, kwargs):
    """torch's clip_grad_norm_ takes a tensor max_norm; so does this one (before, a
    TypeError), read on the device only: the step equals that with the number."""
    runs = []
    for as_tensor in (False, True):
        model = make_model(device, torch.float16 if cls is not torch.optim.SGD else
                           torch.float32, sizes=SIZES)
        opt = cls(model.parameters(), **kwargs)
        scaler = GradScaler(device, init_scale=2.0**10)
        dtype = next(model.parameters()).dtype
        backward(model, scaler, 0, device, dtype)
        max_norm = torch.tensor(0.05, device=device) if as_tensor else 0.05
        with forbid_host_sync(monkeypatch) if cls is not torch.optim.SGD else \
                contextlib.nullcontext():
            norm = scaler.clip_grad_norm_(opt, max_norm)
        scaler.step(opt)
        scaler.update()
        runs.append((norm, [p.detach().clone() for p in model.parameters()]))
    assert_bitwise_equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert_bitwise_equal(a, b)
    with pytest.raises(TypeError, match="expected a tensor max_norm to hold one float"):
        GradScaler(device).clip_grad_norm_(opt, torch.ones(2, device=device))
