"""amp.scale_loss and the step after it, against ``apex/amp/handle.py`` and the dynamic loss
scaler of ``apex/amp/scaler.py`` (start at 2**16, halve on overflow, double after 2000
clean steps, ``min_loss_scale`` floor, ``max_loss_scale`` ceiling), as a plain Python
reference below: skipped steps, the fused optimizers' one straight path (no gradient
rescaled, no overflow pass at a static scale), clipping through master_params, several
losses and gradient accumulation, and O2 with model.zero_grad() against Apex's O2.

Every test runs on the CPU; those taking the ``device`` fixture have a CUDA twin that
skips on a machine without a GPU."""

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_common import (
    FUSED,
    OPT_NAMES,
    OPTIMIZERS,
    assert_identical,
    batch,
    loss_scale,
    make_mlp,
    poison,
    scaler_state,
    setup,
    snapshot,
    train_step,
)
from torch import nn

import mixedprec
from mixedprec import amp

pytestmark = pytest.mark.usefixtures("one_thread", "forget_pending_registrations")


# --- the dynamic loss scale against Apex's scaler ----------------------------------------

class ApexDynamicScaler:
    """Apex's ``LossScaler.update_scale`` for a dynamic scale, in plain Python."""

    def __init__(self, init_scale=2.0**16, scale_window=2000, min_loss_scale=None,
                 max_loss_scale=2.0**24):
        self.scale = min(max_loss_scale, init_scale)
        self.unskipped = 0
        self.window = scale_window
        self.min = min_loss_scale
        self.max = max_loss_scale

    def update(self, overflow):
        if overflow:
            self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.scale = min(self.max, self.scale * 2.0)
            self.unskipped = 0
        return overflow  # should_skip

    def state(self):
        return self.scale, self.unskipped


def run_scale_sequence(model, opt, flags, reference, device="cpu"):
    """Steps with an overflow where `flags` says, checking the scale after each. The
    loss is the sum of the weights (no forward pass: thousands of steps stay cheap)."""
    weights = list(model.parameters())
    for i, flag in enumerate(flags):
        opt.zero_grad()
        loss = sum(w.float().sum() for w in weights) * 1e-3
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if flag:
                poison(model)
        opt.step()
        reference.update(flag)
        got = scaler_state()
        assert got == reference.state(), f"step {i} (overflow={flag}): {got} vs {reference.state()}"


@pytest.mark.parametrize("level,opt_name", [("O2", "SGD"), ("O2", "FusedAdam"), ("O1", "FusedSGD")])
def test_dynamic_loss_scale_matches_apex(device, level, opt_name):
    model = nn.Linear(4, 1).to(device)
    opt = OPTIMIZERS[opt_name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert scaler_state() == (2.0**16, 0)
    flags = [1, 1, 0, 1] + [0] * 2000 + [1, 0, 0]
    run_scale_sequence(model, opt, flags, ApexDynamicScaler(), device)
    assert loss_scale() == 2.0**13  # 2**16 / 8 * 2 / 2


def test_min_loss_scale_is_a_floor(device):
    model = nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", min_loss_scale=2.0**13, verbosity=0)
    run_scale_sequence(model, opt, [1] * 6 + [0, 0, 1],
                       ApexDynamicScaler(min_loss_scale=2.0**13), device)
    assert loss_scale() == 2.0**13


def test_max_loss_scale_is_a_ceiling(device):
    model = nn.Linear(4, 1).to(device)
    opt = mixedprec.FusedAdam(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O1", max_loss_scale=2.0**12, verbosity=0)
    assert scaler_state() == (2.0**12, 0)  # Apex starts at min(2**16, max_loss_scale)
    run_scale_sequence(model, opt, [0] * 2000 + [1, 0],
                       ApexDynamicScaler(max_loss_scale=2.0**12), device)
    assert scaler_state() == (2.0**11, 1)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("opt_name", ["SGD", "FusedSGD"])
def test_scaled_loss_overflow_halves_until_finite(device, level, opt_name):
    """No injected inf: the scaled loss's gradient itself overflows fp16 (3 * scale >
    65504) until the scale is small enough, and those steps leave the weight alone."""
    model = nn.Linear(1, 1, bias=False).to(device)
    with torch.no_grad():
        model.weight.fill_(0.5)
    opt = OPTIMIZERS[opt_name](model.parameters())
    amp_model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    reference = ApexDynamicScaler()
    weights = []
    x = torch.ones(1, 1, device=device)
    for step in range(4):
        opt.zero_grad()
        loss = 3.0 * amp_model(x).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        overflow = torch.tensor(3.0 * reference.scale).half().isinf().item()
        opt.step()
        reference.update(overflow)
        assert scaler_state() == reference.state(), f"step {step}"
        weights.append(next(iter(amp.master_params(opt))).item())
    assert weights[:2] == [0.5, 0.5]  # 3 * 2**16 and 3 * 2**15 overflow: skipped
    assert weights[2] < 0.5 and weights[3] < weights[2]
    assert loss_scale() == 2.0**14


def test_static_loss_scale_never_changes():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.ones(2, 4)
    for overflow in (False, True, False):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().mean(), opt) as scaled:
            assert torch.allclose(scaled.detach().float().reshape(()),
                                  model(x).float().mean().detach() * 128)
            scaled.backward()
            if overflow:
                poison(model)
        opt.step()
        assert scaler_state() == (128.0, 0)


def test_scaled_loss_has_the_shape_of_the_loss():
    """Apex yields ``loss.float() * loss_scale``: a 0-dim loss stays 0-dim."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    loss = model(torch.ones(2, 4)).float().mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32
        assert scaled.shape == loss.shape, f"scaled loss has shape {tuple(scaled.shape)}"
        scaled.backward(torch.ones_like(loss))  # fails when the shapes differ


@pytest.mark.parametrize("args, kwargs, match", [
    (("loss", "opt"), dict(loss_id="0"), "expected loss_id to be an int, got '0'"),
    (("loss", "opt"), dict(loss_id=0.5), "expected loss_id to be an int, got 0.5"),
    ((3.0, "opt"), {}, "expected loss to be a tensor, got float"),
    (("loss", None), {}, r"expected optimizers to be a torch.optim.Optimizer \(or a LARC "
                         r"around one\) or a list of them, got NoneType")])
def test_scale_loss_names_a_bad_argument(args, kwargs, match):
    """Before: a bare TypeError from a comparison or an index, an AttributeError
    ('device'), or 'cannot create weak reference to NoneType'."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    loss = model(torch.ones(2, 4)).float().mean()
    given = {"loss": loss, "opt": opt}
    args = tuple(given.get(a, a) if isinstance(a, str) else a for a in args)
    with pytest.raises(TypeError, match=f"amp.scale_loss: {match}"):
        with amp.scale_loss(*args, **kwargs):
            pass


# --- skipped steps ---------------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", OPT_NAMES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_skipped_step_changes_nothing(device, level, opt_name):
    model, opt, _ = setup(level, torch.float16, opt_name, device, loss_scale="dynamic",
                          min_loss_scale=1.0)
    for step in range(3):
        train_step(model, opt, step, device)
    before = snapshot(model, opt)
    scale = loss_scale()
    train_step(model, opt, 3, device, overflow=True)
    assert loss_scale() == scale / 2
    assert_identical(snapshot(model, opt), before, "after the skipped step")
    # The next clean step does update (and does not see the skipped step's gradients).
    train_step(model, opt, 4, device)
    after = snapshot(model, opt)
    assert not torch.equal(after["masters"][0], before["masters"][0])
    assert all(torch.isfinite(m).all() for m in after["masters"])


@pytest.mark.parametrize("opt_name", ["SGD", "FusedAdam"])
def test_overflow_in_one_optimizer_skips_every_optimizer_of_the_loss(opt_name):
    """Apex: an overflow in a scale_loss over several optimizers skips all their steps."""
    m1, m2 = nn.Linear(4, 4), nn.Linear(4, 1)
    o1 = OPTIMIZERS[opt_name](m1.parameters())
    o2 = OPTIMIZERS[opt_name](m2.parameters())
    (m1, m2), (o1, o2) = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    x = torch.ones(2, 4)
    models = {"m1": m1, "m2": m2}
    for overflow_in in (None, "m2", "m1"):
        before = [snapshot(m1, o1), snapshot(m2, o2)]
        o1.zero_grad()
        o2.zero_grad()
        loss = m2(m1(x)).float().mean() * 1e-3
        with amp.scale_loss(loss, [o1, o2]) as scaled:
            scaled.backward()
            if overflow_in is not None:
                poison(models[overflow_in])
        o1.step()
        o2.step()
        if overflow_in is not None:
            for name, model, opt, snap in (("m1", m1, o1, before[0]), ("m2", m2, o2, before[1])):
                assert_identical(snapshot(model, opt), snap,
                                 f"{name}'s step after an overflow in {overflow_in}'s gradients")


def test_default_floor_keeps_the_scale_above_zero():
    """min_loss_scale=None: the floor is DEFAULT_MIN_SCALE (2**-24), not 0 (Apex)."""
    model = nn.Linear(4, 1)
    opt = mixedprec.FusedSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    # 2**16 halved 45 times would be 2**-29 (and on, 0).
    run_scale_sequence(model, opt, [1] * 40, ApexDynamicScaler())
    assert loss_scale() == 2.0**-24
    run_scale_sequence(model, opt, [1] * 5, ApexDynamicScaler(init_scale=2.0**-24,
                                                              min_loss_scale=2.0**-24))
    assert scaler_state() == (2.0**-24, 0)


# --- the amp step ------------------------------------------------------------------------------

def count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("opt_name", FUSED)
def test_fused_step_is_one_straight_path(level, opt_name, monkeypatch):
    """Scale, backward, one read-only check, grad_scale/found_inf handed over at the
    exit and removed after the step: the gradients are never rescaled (also not the
    zeros that zero_grad(set_to_none=False) leaves)."""
    model, opt, _ = setup(level, torch.float16, opt_name, "cpu")
    train_step(model, opt, 0)
    unscale = count_calls(monkeypatch, mixedprec.ops, "multi_tensor_unscale_")
    check = count_calls(monkeypatch, mixedprec.ops, "multi_tensor_check_finite_")
    opt.zero_grad(set_to_none=False)
    x, y = batch(1)
    with amp.scale_loss(F.mse_loss(model(x).float(), y) * 1e-3, opt) as scaled:
        scaled.backward()
        grads = [p.grad.clone() for p in model.parameters()]
    assert_identical([p.grad for p in model.parameters()], grads, "gradients at the exit")
    assert unscale == [] and check == ["multi_tensor_check_finite_"]
    assert torch.equal(opt.grad_scale, torch.tensor(2.0**16))
    assert torch.equal(opt.found_inf.reshape(()), torch.tensor(0.0))
    opt.step()
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_torch_optimizer_at_o2_uses_the_masters_helper(monkeypatch):
    import mixedprec.masters as masters
    model, opt, _ = setup("O2", torch.float16, "SGD", "cpu")
    into = count_calls(monkeypatch, masters, "unscale_into_masters")
    back = count_calls(monkeypatch, masters, "copy_to_model")
    train_step(model, opt, 0)
    assert (into, back) == (["unscale_into_masters"], ["copy_to_model"])
    assert all(p.grad is None for p in (model.fc1.weight, model.fc2.weight))


@pytest.mark.parametrize("opt_name", ["FusedSGD", "FusedAdam"])
def test_clipping_through_master_params_updates_from_the_clipped_gradient(opt_name):
    """With a fused optimizer, master_params() unscales into the fp32 masters' .grad
    and sets grad_scale to None: the update reads the clipped, unscaled gradient."""
    model = nn.Linear(8, 1, bias=False)
    opt = OPTIMIZERS[opt_name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.zero_grad()
    with amp.scale_loss(model(torch.ones(2, 8)).float().sum() * 2.0**-10, opt) as scaled:
        scaled.backward()
    assert torch.equal(opt.grad_scale, torch.tensor(2.0**16))
    (master,) = amp.master_params(opt)
    assert opt.grad_scale is None and model.weight.grad is None
    assert master.dtype == torch.float32
    assert torch.equal(master.grad, torch.full((1, 8), 2.0**-9))
    torch.nn.utils.clip_grad_norm_([master], max_norm=1e-3)
    before = master.detach().clone()
    opt.step()
    update = before - master.detach()
    if opt_name == "FusedSGD":  # lr * momentum-free first step of the clipped gradient
        expected = 0.05 * torch.full((1, 8), 1e-3 / 8**0.5)
        assert torch.allclose(update, expected, rtol=1e-4)
    assert torch.equal(model.weight.detach(), master.detach().half())


def test_a_static_scale_reads_no_gradient_for_an_overflow_check(monkeypatch):
    """bf16 O2 at its static scale of 1 never skips a step, so with a fused optimizer
    the read-only overflow pass over every gradient is left out."""
    model, opt, _ = setup("O2", torch.bfloat16, "FusedAdam", "cpu")
    calls = []
    monkeypatch.setattr(mixedprec.ops, "multi_tensor_check_finite_",
                        lambda *a: calls.append(a))
    x, y = batch(0)
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert calls == []


# --- several losses and gradient accumulation -----------------------------------------------

def moments(opt):
    """The fp32 optimizer state that holds the (unscaled) gradients of the first step:
    momentum buffers or Adam's first and second moments, in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                if key in state:
                    out.append(state[key].detach().float().clone())
    return out


def grads_close(got, expected, what):
    assert len(got) == len(expected) > 0
    for i, (g, e) in enumerate(zip(got, expected)):
        tol = 2e-2 * e.abs().max().item() + 1e-6
        assert torch.allclose(g, e, rtol=2e-2, atol=tol), \
            f"{what}[{i}]: max diff {(g - e).abs().max().item()}"


@pytest.mark.parametrize("opt_name", OPT_NAMES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_two_losses_match_one_combined_loss(device, level, opt_name):
    x, y = batch(0, device)

    model, opt, _ = setup(level, torch.float16, opt_name, device, num_losses=2)
    for _ in range(2):
        opt.zero_grad()
        out = model(x).float()
        # Small losses: no overflow at the initial scale, so no step is skipped.
        l0, l1 = F.mse_loss(out, y) * 1e-3, out.abs().mean() * 1e-3
        with amp.scale_loss(l0, opt, loss_id=0) as scaled:
            scaled.backward(retain_graph=True)
        with amp.scale_loss(l1, opt, loss_id=1) as scaled:
            scaled.backward()
        opt.step()
    two = (moments(opt), [m.detach().clone() for m in amp.master_params(opt)])
    assert scaler_state(0) == scaler_state(1) == (2.0**16, 2)

    model, opt, _ = setup(level, torch.float16, opt_name, device)
    for _ in range(2):
        opt.zero_grad()
        out = model(x).float()
        with amp.scale_loss((F.mse_loss(out, y) + out.abs().mean()) * 1e-3, opt) as scaled:
            scaled.backward()
        opt.step()
    one = (moments(opt), [m.detach().clone() for m in amp.master_params(opt)])
    assert scaler_state() == (2.0**16, 2)
    grads_close(two[0], one[0], "optimizer state")
    if "SGD" in opt_name:  # Adam's first steps are +-lr whatever the gradient's size
        grads_close(two[1], one[1], "masters")


@pytest.mark.parametrize("opt_name", ["SGD", "FusedAdam"])
def test_each_loss_has_its_own_scaler(device, opt_name):
    model, opt, _ = setup("O2", torch.float16, opt_name, device, num_losses=2)
    x, y = batch(0, device)
    for step, overflow_in in enumerate((None, 1, 1, 0)):
        before = snapshot(model, opt)
        opt.zero_grad()
        out = model(x).float()
        for loss_id, loss in enumerate((F.mse_loss(out, y) * 1e-3, out.abs().mean() * 1e-3)):
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id == 0)
                if overflow_in == loss_id:
                    poison(model)
        opt.step()
        if overflow_in is not None:
            assert_identical(snapshot(model, opt), before, f"step {step}")
    assert scaler_state(0) == (2.0**15, 0)  # 1 clean, 2 clean, 3 clean, overflow
    assert scaler_state(1) == (2.0**14, 1)  # 1 clean, overflow, overflow, clean
    with pytest.raises(ValueError, match="loss_id"):
        with amp.scale_loss(out.sum(), opt, loss_id=2):
            pass


@pytest.mark.parametrize("delay_unscale", [True, False], ids=["delay_unscale", "unscale_each"])
@pytest.mark.parametrize("opt_name", OPT_NAMES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accumulated_gradients_match_combined_loss(device, level, opt_name, delay_unscale):
    """Two micro-batches, the first with delay_unscale=True (Apex's accumulation
    idiom) or unscaled on its own, then one step: the combined loss's update."""
    (xa, ya), (xb, yb) = batch(0, device), batch(1, device)

    model, opt, _ = setup(level, torch.float16, opt_name, device)
    for _ in range(2):
        opt.zero_grad()
        # Small losses: no overflow at the initial scale, so no step is skipped.
        with amp.scale_loss(F.mse_loss(model(xa).float(), ya) * 1e-3, opt,
                            delay_unscale=delay_unscale) as s:
            s.backward()
        with amp.scale_loss(F.mse_loss(model(xb).float(), yb) * 1e-3, opt) as s:
            s.backward()
        opt.step()
    accumulated = (moments(opt), [m.detach().clone() for m in amp.master_params(opt)])
    # Each scale_loss exit without delay_unscale is one clean step of the scaler.
    assert scaler_state() == (2.0**16, 2 if delay_unscale else 4)

    model, opt, _ = setup(level, torch.float16, opt_name, device)
    for _ in range(2):
        opt.zero_grad()
        loss = F.mse_loss(model(xa).float(), ya) + F.mse_loss(model(xb).float(), yb)
        with amp.scale_loss(loss * 1e-3, opt) as s:
            s.backward()
        opt.step()
    combined = (moments(opt), [m.detach().clone() for m in amp.master_params(opt)])
    assert scaler_state() == (2.0**16, 2)
    grads_close(accumulated[0], combined[0], "optimizer state")
    if "SGD" in opt_name:
        grads_close(accumulated[1], combined[1], "masters")


@pytest.mark.parametrize("opt_name", OPT_NAMES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_delayed_micro_batch_after_an_unscaled_one(level, opt_name):
    """Micro-batch 1 unscaled on its own, 2 with delay_unscale, 3 unscaled: the
    gradients set aside before 2 (unscaled for torch optimizers, scaled for fused ones)
    are brought to 2's scale, and the step is the combined loss's."""
    batches = [batch(i) for i in range(3)]
    model, opt, _ = setup(level, torch.float16, opt_name, "cpu")
    opt.zero_grad()
    for i, (x, y) in enumerate(batches):
        with amp.scale_loss(F.mse_loss(model(x).float(), y) * 1e-3, opt,
                            delay_unscale=i == 1) as s:
            s.backward()
    opt.step()
    accumulated = (moments(opt), [m.detach().clone() for m in amp.master_params(opt)])

    model, opt, _ = setup(level, torch.float16, opt_name, "cpu")
    opt.zero_grad()
    loss = sum(F.mse_loss(model(x).float(), y) for x, y in batches)
    with amp.scale_loss(loss * 1e-3, opt) as s:
        s.backward()
    opt.step()
    grads_close(accumulated[0], moments(opt), "optimizer state")
    if "SGD" in opt_name:
        grads_close(accumulated[1], [m.detach() for m in amp.master_params(opt)], "masters")


@pytest.mark.parametrize("opt_name", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_in_a_delayed_micro_batch_skips_the_step(level, opt_name):
    model, opt, _ = setup(level, torch.float16, opt_name, "cpu")
    train_step(model, opt, 0)
    train_step(model, opt, 1)
    before = snapshot(model, opt)
    scale = loss_scale()
    (xa, ya), (xb, yb) = batch(2), batch(3)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(xa).float(), ya) * 1e-3, opt, delay_unscale=True) as s:
        s.backward()
        poison(model)
    assert loss_scale() == scale  # nothing checked or updated yet
    with amp.scale_loss(F.mse_loss(model(xb).float(), yb) * 1e-3, opt) as s:
        s.backward()
    opt.step()
    assert loss_scale() == scale / 2
    assert_identical(snapshot(model, opt), before)


@pytest.mark.parametrize("opt_name", OPT_NAMES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_master_params_grads_are_unscaled_for_clipping(device, level, opt_name):
    """Apex's clipping idiom: between the scale_loss exit and step, the gradients of
    ``amp.master_params(optimizer)`` are the unscaled fp32 gradients (mixedprec's
    docstring says so too), so ``clip_grad_norm_`` sees the true norm."""
    x, y = batch(0, device)
    reference = make_mlp(0, device)
    (F.mse_loss(reference(x), y) * 1e-2).backward()
    ref_grads = [p.grad for p in reference.parameters()]

    model, opt, _ = setup(level, torch.float16, opt_name, device)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y) * 1e-2, opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    missing = [i for i, m in enumerate(masters) if m.grad is None]
    assert not missing, f"master params {missing} have no .grad"
    grads_close([m.grad.float() for m in masters], ref_grads, "master grads")
    norm = torch.nn.utils.clip_grad_norm_(masters, max_norm=1e9)
    ref_norm = torch.nn.utils.get_total_norm(ref_grads)
    assert torch.allclose(norm.float(), ref_norm, rtol=1e-2), (norm, ref_norm)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads_none", "grads_zeroed"])
@pytest.mark.parametrize("opt_name", ["SGD", "FusedSGD"])
def test_small_gradients_keep_their_precision_at_o2(device, opt_name, set_to_none):
    """Loss scaling exists for gradients that fp16 cannot hold unscaled: ~1e-6 here
    (fp16 subnormals). At O2 each step's update must keep the precision of the scaled
    fp16 gradient (~1e-3 relative), whether the gradients were set to None or zeroed
    (FusedSGD's zero_grad() default) before the backward."""
    model = nn.Linear(64, 1, bias=False).to(device)
    with torch.no_grad():
        model.weight.zero_()
    opt = (torch.optim.SGD if opt_name == "SGD" else mixedprec.FusedSGD)(model.parameters(),
                                                                         lr=1.0)
    amp_model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x = (torch.linspace(-1, 1, 64, device=device).reshape(1, 64) * 1e-3).half().float()
    expected = (1e-3 * x).double()  # d(1e-3 * w.x)/dw, exactly representable in fp32
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        before = next(iter(amp.master_params(opt))).detach().double().clone()
        with amp.scale_loss(amp_model(x).float().sum() * 1e-3, opt) as scaled:
            scaled.backward()
        opt.step()
        update = before - next(iter(amp.master_params(opt))).detach().double()
        error = ((update - expected).abs().max() / expected.abs().max()).item()
        assert error < 2e-3, f"step {step}: relative error {error:.3g} of the update"


# Every kind of optimizer amp O2 takes: torch's (fp32 masters in its param_groups) and
# mixedprec's fused ones (masters in their state; the step reads a master's .grad once
# master_params() has put one there for clipping).
O2_OPTIMIZERS = dict(
    OPTIMIZERS,
    AdamW=lambda params: torch.optim.AdamW(params, lr=1e-2),
    FusedLAMB=lambda params: mixedprec.optimizers.FusedLAMB(params, lr=1e-2),
    FusedAdagrad=lambda params: mixedprec.optimizers.FusedAdagrad(params, lr=1e-2),
    FusedNovoGrad=lambda params: mixedprec.optimizers.FusedNovoGrad(params, lr=1e-2),
    FusedMixedPrecisionLamb=lambda params: mixedprec.optimizers.FusedMixedPrecisionLamb(
        params, lr=1e-2),
)


def apex_o2_reference(opt_name, steps, clip, scale):
    """Apex's O2 written out: an fp16 model (batchnorm fp32), fp32 masters stepped by the
    optimizer, each step's model gradients unscaled into fresh master gradients, the
    masters copied into the model, then the masters' gradients cleared (Apex's patched
    ``step``: "clear the master grads that wouldn't be zeroed by model.zero_grad()").
    The masters start from the fp32 weights, as mixedprec takes them (Apex took the
    fp16 weights). The masters after each step."""
    model = make_mlp(0)
    half = mixedprec.fp16_utils.convert_network(copy.deepcopy(model), torch.float16)
    masters = [p.detach().clone().requires_grad_(True) if h.dtype == torch.float16 else h
               for h, p in zip(half.parameters(), model.parameters())]
    opt = O2_OPTIMIZERS[opt_name](masters)
    history = []
    for step in range(steps):
        x, y = batch(step)
        (F.mse_loss(half(x.half()).float(), y) * scale).backward()
        for h, m in zip(half.parameters(), masters):
            if m is h:
                h.grad.mul_(1.0 / scale)
            else:
                m.grad = h.grad.float() * (1.0 / scale)
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, max_norm=0.5)
        opt.step()
        with torch.no_grad():
            for h, m in zip(half.parameters(), masters):
                if m is not h:
                    h.copy_(m)
                    m.grad = None
        half.zero_grad()
        history.append([m.detach().clone() for m in masters])
    return history


@pytest.mark.parametrize("clip", [False, True], ids=["no_clip", "clip_master_params"])
@pytest.mark.parametrize("opt_name", list(O2_OPTIMIZERS))
def test_o2_with_model_zero_grad_matches_apex(opt_name, clip):
    """The loop of transformers 2.x (Trainer, run_glue.py): scale_loss, clipping of
    amp.master_params, optimizer.step(), then model.zero_grad(), never the optimizer's.
    Apex's O2 step cleared the masters' gradients, so each step used that step's
    gradients; masters whose gradients kept the running sum of all steps so far made
    transformers 2.9's Trainer never learn at O2."""
    steps, scale = 4, 128.0
    expected = apex_o2_reference(opt_name, steps, clip, scale)
    model = make_mlp(0)
    opt = O2_OPTIMIZERS[opt_name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=scale, verbosity=0)
    for step in range(steps):
        x, y = batch(step)
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=0.5)
        opt.step()
        model.zero_grad()
        masters = list(amp.master_params(opt))
        for i, (got, want) in enumerate(zip(masters, expected[step])):
            assert got.dtype == want.dtype == torch.float32
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), \
                f"step {step}, master {i}: max difference {(got - want).abs().max():.3g}"
        assert [i for i, m in enumerate(masters) if m.grad is not None] == [], \
            f"step {step}: master gradients left after the step and model.zero_grad()"
        for p, m in zip(model.parameters(), masters):
            assert torch.equal(p.detach(), m.detach().to(p.dtype))
