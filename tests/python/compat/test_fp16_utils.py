"""mixedprec.fp16_utils (the apex.fp16_utils replacement): conversions, FP16_Optimizer
against a plain-PyTorch reimplementation of the same steps, dynamic loss scaling
against Apex's rule, skipped steps, no host synchronisation, checkpoints, bad input."""

import contextlib
import copy
import io
import linecache
import math
import os
import sys

import pytest
import torch
from helpers import assert_bitwise_equal, assert_unchanged, make_model, snapshot
from torch import nn

from mixedprec import fp16_utils as fp16
from mixedprec.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from mixedprec.loss_scale import DEFAULT_MIN_SCALE, LossScale

HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]



def mixedprec_optimizers():
    """mixedprec.optimizers (written alongside this module): skip the test without it."""
    return pytest.importorskip("mixedprec.optimizers")


# Inner optimizers by name; each factory takes a list of parameters. The fused ones take
# the overflow flag as `optimizer.found_inf` (torch.amp.GradScaler's hand-off).
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
    "mixedprec_adam": lambda params: mixedprec_optimizers().FusedAdam(
        params, lr=1e-2, weight_decay=1e-3),
    "mixedprec_sgd": lambda params: mixedprec_optimizers().FusedSGD(
        params, lr=0.05, momentum=0.9),
}
SKIPPING_OPTIMIZERS = list(OPTIMIZERS)
# Those that skip an overflowed step on the device (_step_supports_amp_scaling).
FUSED = ["adam_fused", "sgd_fused", "mixedprec_adam", "mixedprec_sgd"]


def half_model(device, dtype, seed=0):
    """helpers.make_model's small MLP with a BatchNorm, converted by network_to_half (BN
    stays fp32)."""
    net = make_model(device, sizes=(8, 16, 4), activation=nn.ReLU, norm=nn.BatchNorm1d,
                     seed=seed)
    return net if dtype == torch.float32 else network_to_half(net, dtype)


def batch(step, device):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 8, generator=gen)
    y = torch.randn(32, 4, generator=gen)
    return x.to(device), y.to(device)


def loss_of(model, step, device):
    x, y = batch(step, device)
    return (model(x).float() - y).pow(2).mean()


def inject_inf(model_param):
    model_param.grad.view(-1)[:1].fill_(float("inf"))  # (no tensor from host data)


class ApexDynamicScale:
    """Apex's DynamicLossScaler.update_scale, written from its documentation."""

    def __init__(self, init_scale, scale_factor=2.0, scale_window=1000):
        self.scale, self.factor, self.window = init_scale, scale_factor, scale_window
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow):
        if overflow:
            self.scale = max(self.scale / self.factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.scale *= self.factor
        self.cur_iter += 1


class Reference:
    """FP16_Optimizer's arithmetic in plain PyTorch: fp32 masters, grad.float() * (1/S)
    (fp32 reciprocal), an ordinary torch optimizer, masters copied into the model, and
    an overflowed step skipped by not calling the optimizer."""

    def __init__(self, model, make_optimizer, scale, dynamic_args=None):
        self.model = model
        self.pairs = []
        group = []
        for p in model.parameters():
            if p.dtype in (torch.float16, torch.bfloat16):
                master = p.detach().clone().float().requires_grad_(True)
                self.pairs.append((p, master))
                group.append(master)
            else:
                group.append(p)
        self.fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
        self.optimizer = make_optimizer(group)
        self.masters = [m for _, m in self.pairs]
        self.dynamic = ApexDynamicScale(**dynamic_args) if dynamic_args else None
        self.scale = dynamic_args["init_scale"] if dynamic_args else scale

    def step(self, step, device, overflow_at=()):
        for p in self.model.parameters():
            p.grad = None
        (loss_of(self.model, step, device).float() * self.scale).backward()
        if step in overflow_at:
            inject_inf(self.pairs[0][0])
        inv = torch.reciprocal(torch.tensor([self.scale], dtype=torch.float32, device=device))
        overflow = False
        with torch.no_grad():
            for p, m in self.pairs:
                m.grad = p.grad.float() * inv
                overflow |= not torch.isfinite(m.grad).all().item()
            for p in self.fp32:
                p.grad.mul_(inv)
                overflow |= not torch.isfinite(p.grad).all().item()
        if self.dynamic is not None:
            self.dynamic.update(overflow)
            self.scale = self.dynamic.scale
            if overflow:
                return
        self.optimizer.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)


def wrapped(device, dtype, opt_name, seed=0, **kwargs):
    model = half_model(device, dtype, seed)
    kwargs.setdefault("verbose", False)
    return model, FP16_Optimizer(OPTIMIZERS[opt_name](list(model.parameters())), **kwargs)


def train_step(model, optimizer, step, device, overflow_at=()):
    optimizer.zero_grad()
    loss = loss_of(model, step, device)
    if step in overflow_at:
        optimizer.backward(loss, update_master_grads=False)
        inject_inf(next(p for p in model.parameters() if p.dtype != torch.float32))
        optimizer.update_master_grads()
    else:
        optimizer.backward(loss)
    optimizer.step()
    return loss


def assert_model_is_masters(optimizer):
    for p, m in zip(optimizer.all_fp16_params, optimizer.all_fp32_from_fp16_params):
        assert_bitwise_equal(p.detach(), m.detach().to(p.dtype), "model param vs cast master")


# ---------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------

def conv_net(device):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, affine=False),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
    ).to(device)


@pytest.mark.parametrize("dtype", HALF)
def test_network_to_half_keeps_affine_batchnorm_fp32(device, dtype):
    net = network_to_half(conv_net(device), dtype)
    assert isinstance(net[0], tofp16)
    body = net[1]
    for i in (0, 3, 6):
        assert {p.dtype for p in body[i].parameters()} == {dtype}
    bn, bn_plain = body[1], body[4]
    bn_tensors = (bn.weight, bn.bias, bn.running_mean, bn.running_var)
    assert {t.dtype for t in bn_tensors} == {torch.float32}
    assert bn.num_batches_tracked.dtype == torch.int64
    # As in Apex, only affine BatchNorm is kept in fp32.
    assert bn_plain.running_mean.dtype == dtype
    out = net(torch.randn(2, 3, 8, 8, device=device))
    assert out.dtype == dtype and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("dtype", HALF)
def test_convert_network_and_fp16_model(device, dtype):
    reference = conv_net(device)
    net = convert_network(copy.deepcopy(reference), dtype)
    assert net[0].weight.dtype == dtype and net[6].bias.dtype == dtype
    assert net[1].weight.dtype == torch.float32 and net[1].running_var.dtype == torch.float32
    assert net[4].running_mean.dtype == dtype

    model = FP16Model(copy.deepcopy(reference), dtype)
    assert model.network[0].weight.dtype == dtype and model.network[1].weight.dtype == torch.float32
    x = torch.randn(2, 3, 8, 8, device=device)
    out = model(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, model.network(x.to(dtype)), rtol=0, atol=0)

    # Integer inputs (token ids) are not cast, unlike Apex's t.half().
    emb = FP16Model(nn.Embedding(10, 3).to(device), dtype)
    ids = torch.tensor([1, 2, 3], device=device)
    assert emb(ids).dtype == dtype


@pytest.mark.parametrize("value", ["bfloat16", "bf16"])
def test_half_dtype_variable_makes_network_to_half_bf16(value, monkeypatch):
    """MIXEDPREC_HALF_DTYPE=bfloat16: Apex's network_to_half(model) and FP16Model(model),
    which take no dtype, cast to bf16; a dtype passed is kept."""
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", value)
    assert fp16.half_dtype() is torch.bfloat16
    net = network_to_half(conv_net("cpu"))
    assert net[0].dtype == torch.bfloat16 and net[1][0].weight.dtype == torch.bfloat16
    assert net[1][1].weight.dtype == torch.float32  # affine BatchNorm, as with fp16
    assert net(torch.randn(2, 3, 8, 8)).dtype == torch.bfloat16
    model = FP16Model(conv_net("cpu"))
    assert model.dtype == torch.bfloat16 and model.network[0].weight.dtype == torch.bfloat16
    assert network_to_half(conv_net("cpu"), torch.float16)[1][0].weight.dtype == torch.float16
    assert FP16Model(conv_net("cpu"), torch.float16).dtype == torch.float16
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", "float16")
    assert network_to_half(conv_net("cpu"))[1][0].weight.dtype == torch.float16
    monkeypatch.delenv("MIXEDPREC_HALF_DTYPE")
    assert network_to_half(conv_net("cpu"))[1][0].weight.dtype == torch.float16


@pytest.mark.parametrize("value", ["bfloat", "torch.bfloat16", "float32"])
def test_bad_half_dtype_variable_is_rejected_before_anything_changes(value, monkeypatch):
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", value)
    net = conv_net("cpu")
    with pytest.raises(ValueError, match=f"MIXEDPREC_HALF_DTYPE={value!r}: expected"):
        network_to_half(net)
    with pytest.raises(ValueError, match="MIXEDPREC_HALF_DTYPE"):
        FP16Model(net)
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    model = nn.Linear(4, 2).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="MIXEDPREC_HALF_DTYPE"):
        FP16_Optimizer(inner, verbose=False)
    assert inner.param_groups[0]["params"] == list(model.parameters())  # no masters put in


def test_fp16_optimizer_says_when_the_variable_cannot_reach_the_model(monkeypatch):
    """model.half() is torch's own: under MIXEDPREC_HALF_DTYPE=bfloat16, FP16_Optimizer
    warns that such a model trains in fp16; a model network_to_half made is bf16."""
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", "bfloat16")
    model = nn.Linear(4, 2).half()
    with pytest.warns(UserWarning, match="MIXEDPREC_HALF_DTYPE asks for bfloat16.*float16"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    import warnings

    net = network_to_half(nn.Sequential(nn.Linear(4, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), verbose=False)
    assert [p.dtype for p in optimizer.all_fp16_params] == [torch.bfloat16] * 2


def test_convert_module_casts_grads_and_only_its_own_tensors(device):
    net = nn.Sequential(nn.Linear(2, 2)).to(device)
    net[0].weight.grad = torch.ones(2, 2, device=device)
    weight = net[0].weight
    convert_module(net, torch.float16)  # the container holds no parameter itself
    assert weight.dtype == torch.float32
    convert_module(net[0], torch.float16)
    assert net[0].weight is weight and weight.dtype == torch.float16
    assert weight.grad.dtype == torch.float16
    assert BN_convert_float(nn.BatchNorm1d(2).half()).weight.dtype == torch.float32


# ---------------------------------------------------------------------------------------
# FP16_Optimizer against the plain-PyTorch reference
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", HALF)
def test_training_matches_reference_and_fp32(device, dtype, opt_name):
    steps, scale = 50, 128.0
    model, optimizer = wrapped(device, dtype, opt_name, static_loss_scale=scale)
    reference = Reference(half_model(device, dtype), OPTIMIZERS[opt_name], scale)
    fp32_model = half_model(device, torch.float32)
    fp32_optimizer = OPTIMIZERS[opt_name](list(fp32_model.parameters()))
    losses, fp32_losses = [], []
    for step in range(steps):
        losses.append(train_step(model, optimizer, step, device).item())
        reference.step(step, device)
        fp32_optimizer.zero_grad()
        loss = loss_of(fp32_model, step, device)
        loss.backward()
        fp32_optimizer.step()
        fp32_losses.append(loss.item())

    # Exactly the reference's arithmetic.
    for got, expected in zip(optimizer.all_fp32_from_fp16_params, reference.masters):
        assert_bitwise_equal(got.detach(), expected.detach(), "master")
    for got, expected in zip(optimizer.all_fp32_from_fp32_params, reference.fp32):
        assert_bitwise_equal(got.detach(), expected.detach(), "fp32 param")
    assert_model_is_masters(optimizer)
    assert optimizer.loss_scale == scale and not optimizer.overflow

    # Close to fp32 training: the loss falls alike and the weights stay near.
    assert losses[-1] < 0.9 * losses[0]
    tol = 0.05 if dtype == torch.float16 else 0.15
    assert abs(losses[-1] - fp32_losses[-1]) <= tol * fp32_losses[-1]
    fp32_weights = [p for p in fp32_model.parameters()]
    masters = optimizer.param_groups[0]["params"]
    for got, expected in zip(masters, fp32_weights):
        torch.testing.assert_close(got.detach(), expected.detach(), atol=tol, rtol=tol)


@pytest.mark.parametrize("opt_name", SKIPPING_OPTIMIZERS)
def test_dynamic_scaling_matches_apex_rule_and_skips(device, opt_name):
    dtype = torch.float16
    args = dict(init_scale=2.0**10, scale_factor=2.0, scale_window=3)
    overflow_at = {0, 4, 5, 11, 12, 13, 20}
    model, optimizer = wrapped(device, dtype, opt_name, dynamic_loss_scale=True,
                               dynamic_loss_args=args)
    reference = Reference(half_model(device, dtype), OPTIMIZERS[opt_name], None, args)
    scales = []
    for step in range(26):
        train_step(model, optimizer, step, device, overflow_at)
        reference.step(step, device, overflow_at)
        scales.append(optimizer.loss_scale)
        assert scales[-1] == reference.scale, f"step {step}"
        assert optimizer.overflow == (step in overflow_at)
    assert min(scales) < 2**10 and any(b > a for a, b in zip(scales, scales[1:]))  # grew too
    for got, expected in zip(optimizer.all_fp32_from_fp16_params, reference.masters):
        assert_bitwise_equal(got.detach(), expected.detach(), "master")
    for got, expected in zip(optimizer.all_fp32_from_fp32_params, reference.fp32):
        assert_bitwise_equal(got.detach(), expected.detach(), "fp32 param")
    assert_model_is_masters(optimizer)


@pytest.mark.parametrize("per_param", [False, True])
def test_overflow_report_and_summary(caplog, monkeypatch, per_param):
    """Overflows counted (per parameter with overflow_report=True) without a host read in
    a step; with ``verbose`` one summary (logged at exit) instead of a line per
    overflow."""
    import logging

    from helpers import forbid_host_sync
    caplog.set_level(logging.WARNING, logger="mixedprec.fp16_utils")
    model, optimizer = wrapped("cpu", torch.float16, "mixedprec_adam", verbose=True,
                               dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=2.0**10, scale_window=3),
                               overflow_report=per_param)
    scales = [optimizer.loss_scale]
    for step in range(8):
        with forbid_host_sync(monkeypatch) if step else contextlib.nullcontext():
            train_step(model, optimizer, step, "cpu", overflow_at={1, 4, 5})
        scales.append(optimizer.loss_scale)
    assert caplog.records == []
    first = next(n for n, p in model.named_parameters() if p.dtype != torch.float32)
    assert optimizer.overflow_report(model, scale=False) == {
        "steps": 8, "skipped": 3, "overflows": {first: 3} if per_param else {}}
    report = optimizer.overflow_report()
    assert report["overflows"] == ({"param_groups[0][0]": 3} if per_param else {})
    assert report["scale"] == dict(
        current=scales[-1], min=min(scales), max=max(scales), backoffs=3,
        growths=sum(b > a for a, b in zip(scales, scales[1:])))
    optimizer._log_summary()  # what runs at exit
    assert [r.getMessage() for r in caplog.records] == [
        "FP16_Optimizer: 3 of 8 steps skipped (37.5%); scale 128 (min 128, max 1024, 3 "
        "backoffs, 0 growths)" + ("; overflows: param_groups[0][0] 3" if per_param else "")]


@pytest.mark.parametrize("opt_name", SKIPPING_OPTIMIZERS)
def test_skipped_step_leaves_everything_bit_identical(device, opt_name):
    model, optimizer = wrapped(device, torch.float16, opt_name, dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=256.0, scale_window=2))
    # An overflow in the very first step: the inner optimizer creates no state.
    train_step(model, optimizer, 0, device, overflow_at={0})
    assert len(optimizer.state) == 0 and optimizer.loss_scale == 128.0
    for step in (1, 2, 3):
        train_step(model, optimizer, step, device)
    assert optimizer.loss_scale == 256.0  # grew back after scale_window good steps

    before = snapshot([list(model.parameters()), optimizer.all_fp32_from_fp16_params,
                       optimizer.optimizer.state_dict()["state"]])
    train_step(model, optimizer, 4, device, overflow_at={4})
    assert optimizer.overflow and optimizer.loss_scale == 128.0
    assert_unchanged([list(model.parameters()), optimizer.all_fp32_from_fp16_params,
                      optimizer.optimizer.state_dict()["state"]], before)
    assert optimizer.clip_master_grads(1.0).item() == -1  # Apex's overflow value
    with pytest.warns(UserWarning, match="overflowed"):
        assert optimizer.inspect_master_grad_data() is None


def test_groups_frozen_params_and_existing_state(device, capsys):
    model = half_model(device, torch.float16)
    first, bn, last = model[1][0], model[1][1], model[1][3]
    last.bias.requires_grad_(False)
    inner = torch.optim.SGD([
        {"params": [first.weight, first.bias], "lr": 0.1},
        {"params": [*bn.parameters(), last.weight, last.bias], "lr": 0.01},
    ], lr=0.05, momentum=0.9)
    loss_of(model, 0, device).backward()
    inner.step()  # momentum buffers in fp16, keyed by the fp16 parameters
    buffer = inner.state[first.weight]["momentum_buffer"].clone()
    optimizer = FP16_Optimizer(inner, dynamic_loss_scale=True)
    assert "FP16_Optimizer processing param group 1:" in capsys.readouterr().out

    assert [len(g) for g in optimizer.fp16_groups] == [2, 1]
    assert [len(g) for g in optimizer.fp32_from_fp32_groups] == [0, 2]
    master = optimizer.param_groups[0]["params"][0]
    assert master.dtype == torch.float32 and master is optimizer.fp32_from_fp16_groups[0][0]
    moved = optimizer.state[master]["momentum_buffer"]
    assert moved.dtype == torch.float32 and torch.equal(moved, buffer.float())
    assert first.weight not in optimizer.state
    assert optimizer.param_groups[1]["params"][-1] is last.bias  # frozen: left alone
    frozen = last.bias.detach().clone()
    for step in range(1, 4):
        train_step(model, optimizer, step, device, overflow_at={2})
    assert_bitwise_equal(last.bias.detach(), frozen)
    assert last.bias.grad is None
    assert_model_is_masters(optimizer)


def test_static_loss_scale_and_setter(device):
    model, optimizer = wrapped(device, torch.float16, "sgd", static_loss_scale=64.0)
    train_step(model, optimizer, 0, device)
    grads = optimizer.inspect_master_grad_data()
    # The master grads are unscaled: compare with fp32 backward of the same loss.
    ref_model = half_model(device, torch.float16)
    (loss_of(ref_model, 0, device) * 64.0).backward()
    for got, p in zip(grads[0], ref_model.parameters()):
        expected = p.grad.float() * (1 / 64.0) if p.dtype == torch.float16 else p.grad / 64.0
        assert_bitwise_equal(got, expected)
    optimizer.loss_scale = 32.0
    assert optimizer.loss_scale == 32.0 and optimizer.loss_scaler.loss_scale == 32.0
    assert not optimizer.overflow and not optimizer.dynamic_loss_scale


def test_multiple_losses_and_closure(device):
    model, optimizer = wrapped(device, torch.float16, "sgd", dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=2.0**40))
    optimizer.zero_grad()
    optimizer.backward(loss_of(model, 0, device), update_master_grads=False)
    optimizer.backward(loss_of(model, 1, device), update_master_grads=False)
    optimizer.update_master_grads()  # one scale update for both losses
    assert optimizer.overflow and optimizer.loss_scale == 2.0**39

    calls = []

    def closure():
        calls.append(optimizer.loss_scale)
        optimizer.zero_grad()
        loss = loss_of(model, 2, device)
        optimizer.backward(loss)
        return loss

    loss = optimizer.step(closure)
    # The closure is re-run while the gradients overflow, with a smaller scale each time.
    assert len(calls) > 1 and calls == sorted(calls, reverse=True)
    assert not optimizer.overflow and torch.isfinite(loss)
    assert all(torch.isfinite(m).all() for m in optimizer.all_fp32_from_fp16_params)
    assert_model_is_masters(optimizer)


@pytest.mark.parametrize("opt_name", FUSED)
def test_no_host_sync_in_the_step(device, opt_name, monkeypatch):
    model, optimizer = wrapped(device, torch.float16, opt_name, dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=256.0, scale_window=2))
    train_step(model, optimizer, 0, device)  # creates the optimizer state (host read)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation in the training step")

    with monkeypatch.context() as patch:
        for name in ("item", "__bool__", "cpu", "tolist"):
            patch.setattr(torch.Tensor, name, forbidden)
        for step in range(1, 7):
            if step == 3:
                before_skip = [m.detach().clone() for m in optimizer.all_fp32_from_fp16_params]
            train_step(model, optimizer, step, device, overflow_at={3})
            if step == 3:
                after_skip = [m.detach().clone() for m in optimizer.all_fp32_from_fp16_params]
        optimizer.clip_master_grads(1.0)
        with pytest.raises(AssertionError, match="host synchronisation"):
            optimizer.overflow  # noqa: B018 (proves the patch is in force)
    for got, expected in zip(after_skip, before_skip):
        assert_bitwise_equal(got, expected, f"{opt_name}: master changed by a skipped step")
    # 256 -> 512 (steps 0, 1) -> 256 (overflow at 3) -> 512 (4, 5) -> still 512 (6)
    assert optimizer.loss_scale == 512.0, opt_name
    assert_model_is_masters(optimizer)


FP16_UTILS_FILE = os.path.abspath(fp16.__file__)


class CallsFromFp16Utils:
    """Records (method, source line) for each call of the given torch.Tensor methods
    made directly from mixedprec/fp16_utils.py."""

    def __init__(self, monkeypatch, names):
        self.calls = []
        for name in names:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, original):
        calls = self.calls

        def wrapper(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            if os.path.abspath(frame.f_code.co_filename) == FP16_UTILS_FILE:
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
                calls.append((name, line.strip()))
            return original(tensor, *args, **kwargs)
        return wrapper


def count_inner_steps(monkeypatch, optimizer, record=lambda inner: None):
    """Wraps the inner optimizer's step; returns the list of what `record` saw at each."""
    inner, seen = optimizer.optimizer, []
    original = inner.step

    def step(*args, **kwargs):
        seen.append(record(inner))
        return original(*args, **kwargs)
    monkeypatch.setattr(inner, "step", step)
    return seen


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_other_optimizers_skip_after_one_host_read(device, opt_name, monkeypatch):
    """An optimizer that cannot skip on the device is not called on overflow (as in
    Apex): one host read per step, no copies; everything stays bit for bit."""
    model, optimizer = wrapped(device, torch.float16, opt_name, dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=256.0))
    for step in range(3):
        train_step(model, optimizer, step, device)
    inner_steps = count_inner_steps(monkeypatch, optimizer)
    calls = CallsFromFp16Utils(monkeypatch, ("item", "__bool__", "clone", "cpu", "tolist"))

    def watched():
        return [list(model.parameters()), optimizer.all_fp32_from_fp16_params,
                optimizer.optimizer.state_dict()["state"]]

    before = snapshot(watched())
    groups = copy.deepcopy(optimizer.optimizer.state_dict()["param_groups"])
    train_step(model, optimizer, 3, device, overflow_at={3})
    assert len(calls.calls) == 1 and calls.calls[0][0] == "item", calls.calls
    assert "# sync-ok" in calls.calls[0][1]
    assert optimizer.overflow and inner_steps == []
    assert_unchanged(watched(), before)
    assert optimizer.optimizer.state_dict()["param_groups"] == groups

    calls.calls.clear()
    train_step(model, optimizer, 4, device)
    assert inner_steps == [None] and [c[0] for c in calls.calls] == ["item"]
    assert_model_is_masters(optimizer)


@pytest.mark.parametrize("opt_name", FUSED)
def test_fused_optimizers_get_the_flag_for_their_step_only(device, opt_name, monkeypatch):
    model, optimizer = wrapped(device, torch.float16, opt_name, dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=256.0))
    train_step(model, optimizer, 0, device)  # each parameter's first step: host path
    inner = optimizer.optimizer
    seen = count_inner_steps(monkeypatch, optimizer, lambda o: (o.grad_scale, o.found_inf))
    calls = CallsFromFp16Utils(monkeypatch, ("item", "__bool__", "clone", "cpu", "tolist"))
    for step in (1, 2):
        train_step(model, optimizer, step, device, overflow_at={1})
    assert calls.calls == []
    assert len(seen) == 2 and all(scale is None and flag is optimizer._found_inf
                                  for scale, flag in seen)
    assert not hasattr(inner, "grad_scale") and not hasattr(inner, "found_inf")


def test_fused_optimizer_first_step_overflow_leaves_no_state(device, monkeypatch):
    """torch's SGD(fused=True) skipping on the device would create uninitialised
    momentum buffers: a parameter's first step goes through the host instead."""
    model, optimizer = wrapped(device, torch.float16, "sgd_fused", dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=256.0))
    inner_steps = count_inner_steps(monkeypatch, optimizer)
    train_step(model, optimizer, 0, device, overflow_at={0})
    assert inner_steps == [] and len(optimizer.state) == 0
    train_step(model, optimizer, 1, device)
    reference = Reference(half_model(device, torch.float16), OPTIMIZERS["sgd_fused"], 128.0)
    reference.step(1, device)
    for got, expected in zip(optimizer.all_fp32_from_fp16_params, reference.masters):
        assert_bitwise_equal(got.detach(), expected.detach(), "master")


# ---------------------------------------------------------------------------------------
# Clipping and helpers
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_master_grads_matches_torch(device, norm_type):
    model, optimizer = wrapped(device, torch.float16, "sgd", static_loss_scale=8.0)
    optimizer.zero_grad()
    optimizer.backward(loss_of(model, 0, device) * 100)
    params = [p for p in optimizer.param_groups[0]["params"]]
    clones = [p.detach().clone().requires_grad_(True) for p in params]
    for c, p in zip(clones, params):
        c.grad = p.grad.clone()
    max_norm = 0.5
    expected = torch.nn.utils.clip_grad_norm_(clones, max_norm, norm_type)
    total = optimizer.clip_master_grads(max_norm, norm_type)
    assert total.shape == () and total.dtype == torch.float32
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    assert expected.item() > max_norm  # the grads were clipped
    for c, p in zip(clones, params):
        torch.testing.assert_close(p.grad, c.grad, rtol=2e-5, atol=1e-7)
    assert to_python_float(total) == pytest.approx(expected.item(), rel=1e-5)
    assert fp16.clip_grad_norm(clones, 1e9, norm_type).item() == pytest.approx(max_norm, rel=1e-4)


def test_to_python_float():
    assert to_python_float(torch.tensor([2.5])) == 2.5
    assert to_python_float(torch.tensor(3)) == 3
    assert to_python_float(1.5) == 1.5
    assert to_python_float([4.0]) == 4.0


@pytest.mark.parametrize("flat_master", [False, True])
def test_manual_master_helpers(device, flat_master):
    model = half_model(device, torch.float16)  # fp16 Linear weights, fp32 BatchNorm
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    assert model_params == [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        assert len(master_params) == 1 and master_params[0].dtype == torch.float32
        assert master_params[0].numel() == sum(p.numel() for p in model_params)
        assert master_params[0].grad is not None
    else:
        assert all(m.dtype == torch.float32 and m.requires_grad and m.shape == p.shape
                   for m, p in zip(master_params, model_params))
    loss_of(model, 0, device).backward()
    model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
    expected = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    got = (master_params[0].grad if flat_master
           else torch.cat([m.grad.reshape(-1) for m in master_params]))
    assert_bitwise_equal(got, expected)

    with torch.no_grad():
        for m in master_params:
            m.add_(torch.linspace(-1, 1, m.numel(), device=device).view(m.shape))
    master_params_to_model_params(model_params, master_params, flat_master=flat_master)
    flat = master_params[0] if flat_master else torch.cat([m.reshape(-1) for m in master_params])
    offset = 0
    for p in model_params:
        piece = flat[offset:offset + p.numel()].view(p.shape)
        assert_bitwise_equal(p.detach(), piece.detach().to(p.dtype))
        offset += p.numel()

    with pytest.raises(ValueError, match="master"):
        master_params_to_model_params(model_params, master_params[:1] * 2, flat_master)


# ---------------------------------------------------------------------------------------
# Standalone scalers
# ---------------------------------------------------------------------------------------

def test_standalone_scalers(device):
    w = torch.ones(3, device=device, requires_grad=True)
    LossScaler(4.0).backward((w * 2).sum())
    assert_bitwise_equal(w.grad, torch.full((3,), 8.0, device=device))
    assert not LossScaler(4.0).has_overflow([w])

    scaler = DynamicLossScaler(init_scale=2.0**4, scale_factor=2.0, scale_window=2)
    apex = ApexDynamicScale(2.0**4, 2.0, 2)
    pattern = [0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    for flag in pattern:
        w.grad = torch.full((3,), float("inf") if flag else 1.0, device=device)
        overflow = scaler.has_overflow([w])
        assert overflow == bool(flag)
        scaler.update_scale(overflow)
        apex.update(overflow)
        assert scaler.loss_scale == apex.scale == scaler.cur_scale
    assert scaler.loss_scale >= 1.0  # Apex's floor was reached on the way
    # A device tensor works too, without a host read.
    scaler.update_scale(torch.ones(1, device=device))
    apex.update(True)
    assert scaler.loss_scale == apex.scale

    state = scaler.state_dict()
    clone = DynamicLossScaler(init_scale=1.0, scale_factor=2.0, scale_window=2)
    clone.load_state_dict(state)
    assert clone.loss_scale == scaler.loss_scale
    with pytest.raises(ValueError, match="static"):
        LossScaler().load_state_dict(state)


def test_scaler_arguments_are_checked():
    with pytest.raises(ValueError, match="scale_factor"):
        DynamicLossScaler(scale_factor=1.0)
    with pytest.raises(ValueError, match="scale_window"):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=-1)
    with pytest.raises(ValueError, match="scale"):
        LossScaler(float("inf"))


def round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_state(got, expected):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_bitwise_equal(got[key], value, key)
        else:
            assert got[key] == value, key


def test_scalers_are_faces_on_loss_scale(device):
    scaler = DynamicLossScaler(device=device)
    assert isinstance(scaler.core, LossScale) and scaler.core.dynamic
    assert scaler.device.type == device
    settings = (scaler.loss_scale, scaler.scale_factor, scaler.scale_window,
                scaler.min_loss_scale, scaler.max_loss_scale)
    assert settings == (2.0**32, 2.0, 1000, 1.0, math.inf)  # Apex's defaults
    static = LossScaler(8.0, device=device)
    assert isinstance(static.core, LossScale) and not static.core.dynamic

    # min_loss_scale=None: LossScale's floor 2**-24, never 0.
    scaler = DynamicLossScaler(init_scale=1.0, scale_window=5, min_loss_scale=None,
                               device=device)
    assert scaler.min_loss_scale == DEFAULT_MIN_SCALE
    for _ in range(200):
        scaler.update_scale(torch.ones((), device=device))
    assert scaler.loss_scale == 2.0**-24

    # The state dicts load with weights_only, into scalers of the same kind.
    for scaler, fresh in ((scaler, DynamicLossScaler(device=device)),
                          (static, LossScaler(device=device))):
        state = round_trip(scaler.state_dict())
        fresh.load_state_dict(state)
        assert_same_state(fresh.state_dict(), scaler.state_dict())


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale_factor=1.0), "scale_factor"),
    (dict(scale_factor=float("inf")), "scale_factor"),
    (dict(scale_window=0), "scale_window"),
    (dict(scale_window=2.5), "scale_window"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(min_loss_scale=0.0), "min_loss_scale"),
    (dict(max_loss_scale=float("nan")), "max_loss_scale"),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), "min_loss_scale"),
    (dict(init_scale=2.0**40, max_loss_scale=2.0**20), "init_scale"),
])
def test_bad_scaler_settings_are_rejected_everywhere(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=3)
    scaler.update_scale(False)
    good = scaler.state_dict()
    # The same setting in a state dict: rejected by load_state_dict, nothing changed.
    bad = dict(good)
    for key, value in kwargs.items():
        if key == "init_scale":
            bad["loss_scale"] = torch.tensor([value])
        else:
            bad[key] = value
    with pytest.raises(ValueError, match="loss_scale" if match == "init_scale" else match):
        scaler.load_state_dict(round_trip(bad))
    assert_same_state(scaler.state_dict(), good)
    # And set on its own.
    if len(kwargs) == 1 and "init_scale" not in kwargs:
        (name, value), = kwargs.items()
        with pytest.raises(ValueError, match=match):
            setattr(scaler, name, value)
        assert_same_state(scaler.state_dict(), good)
    # FP16_Optimizer rejects it before touching the optimizer.
    inner = torch.optim.SGD(nn.Linear(2, 2).half().parameters(), lr=0.1)
    params = list(inner.param_groups[0]["params"])
    with pytest.raises(ValueError, match=match):
        FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args=kwargs, verbose=False)
    assert all(a is b for a, b in zip(inner.param_groups[0]["params"], params))


def test_scaler_settings_and_overflow_checked_when_given(device):
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=3, device=device)
    scaler.scale_window, scaler.scale_factor, scaler.max_loss_scale = 5, 4.0, None
    scaler.min_loss_scale = None
    assert (scaler.scale_window, scaler.scale_factor) == (5, 4.0)
    assert (scaler.min_loss_scale, scaler.max_loss_scale) == (DEFAULT_MIN_SCALE, math.inf)
    good = scaler.state_dict()
    with pytest.raises(ValueError, match="overflow"):
        scaler.update_scale(torch.ones(2, device=device))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="loss_scale"):
            scaler.loss_scale = bad
        with pytest.raises(ValueError, match="scale"):
            LossScaler(bad)
    with pytest.raises(TypeError, match="loss_scale"):
        scaler.loss_scale = "big"
    assert_same_state(scaler.state_dict(), good)
    scaler.update_scale(torch.tensor(True, device=device))  # any nonzero value: overflow
    assert scaler.loss_scale == 16.0


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adam_fused"])
def test_state_dict_round_trip_resumes_bit_for_bit(device, opt_name, tmp_path):
    kwargs = dict(dynamic_loss_scale=True, dynamic_loss_args=dict(init_scale=512.0, scale_window=3))
    overflow_at = {2, 7}
    model, optimizer = wrapped(device, torch.bfloat16, opt_name, **kwargs)
    for step in range(10):
        train_step(model, optimizer, step, device, overflow_at)

    model_a, optimizer_a = wrapped(device, torch.bfloat16, opt_name, **kwargs)
    for step in range(5):
        train_step(model_a, optimizer_a, step, device, overflow_at)
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model_a.state_dict(), "optimizer": optimizer_a.state_dict()}, path)
    checkpoint = torch.load(path, weights_only=True)

    model_b, optimizer_b = wrapped(device, torch.bfloat16, opt_name, seed=1, **kwargs)
    model_b.load_state_dict(checkpoint["model"])
    optimizer_b.load_state_dict(checkpoint["optimizer"])
    assert optimizer_b.loss_scale == optimizer_a.loss_scale
    for step in range(5, 10):
        train_step(model_b, optimizer_b, step, device, overflow_at)

    assert optimizer_b.loss_scale == optimizer.loss_scale
    for got, expected in zip(model_b.state_dict().values(), model.state_dict().values()):
        assert_bitwise_equal(got, expected, "model")
    for got, expected in zip(optimizer_b.all_fp32_from_fp16_params,
                             optimizer.all_fp32_from_fp16_params):
        assert_bitwise_equal(got.detach(), expected.detach(), "master")
    state_b = snapshot(optimizer_b.optimizer.state_dict()["state"])
    assert_unchanged(optimizer.optimizer.state_dict()["state"], state_b)


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------

def test_rejects_what_is_not_an_optimizer(device):
    model = half_model(device, torch.float16)
    with pytest.raises(TypeError, match="init_optimizer"):
        FP16_Optimizer(list(model.parameters()))
    double = nn.Linear(2, 2).double().to(device)
    inner = torch.optim.SGD(double.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="float64"):
        FP16_Optimizer(inner, verbose=False)
    assert all(p.dtype == torch.float64 for p in inner.param_groups[0]["params"])


def test_sparse_gradients_rejected_before_anything_changes(device):
    model = nn.Embedding(10, 4, sparse=True).half().to(device)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               dynamic_loss_scale=True, verbose=False)
    before = snapshot([optimizer.all_fp32_from_fp16_params, optimizer.loss_scaler._scale,
                       optimizer._found_inf])
    with pytest.raises(TypeError, match="sparse"):
        optimizer.backward(model(torch.tensor([1, 2], device=device)).float().sum())
    assert_unchanged([optimizer.all_fp32_from_fp16_params, optimizer.loss_scaler._scale,
                      optimizer._found_inf], before)
    assert optimizer.all_fp32_from_fp16_params[0].grad is None


def _corrupt(state_dict, what):
    sd = copy.deepcopy(state_dict)
    if what == "groups":
        sd["fp32_from_fp16"].append([])
    elif what == "size":
        sd["fp32_from_fp16"][0][0] = torch.zeros(3)
    elif what == "dtype":
        sd["fp32_from_fp16"][0][0] = sd["fp32_from_fp16"][0][0].double()
    elif what == "state size":
        first = next(iter(sd["optimizer_state_dict"]["state"].values()))
        first["exp_avg"] = torch.zeros(7)
    elif what == "inner groups":
        sd["optimizer_state_dict"]["param_groups"].append(
            dict(sd["optimizer_state_dict"]["param_groups"][0], params=[]))
    elif what == "scaler dtype":
        sd["loss_scaler"]["loss_scale"] = sd["loss_scaler"]["loss_scale"].double()
    elif what == "missing key":
        del sd["loss_scaler"]
    elif what == "state kind":
        first = next(iter(sd["optimizer_state_dict"]["state"].values()))
        first.clear()
        first["momentum_buffer"] = torch.zeros(16, 8)
    elif what == "scale kind":  # a dynamic scaler's state said to be a static scale's
        sd["dynamic_loss_scale"] = False
    elif what.startswith("no "):  # "no <path to a key>": that key deleted
        *path, key = what[3:].split(".")
        owner = sd
        for part in path:
            owner = owner[int(part) if part.isdigit() else part]
        del owner[key]
    return sd


@pytest.mark.parametrize("what, match", [
    ("groups", "groups"), ("size", "size"), ("dtype", "dtype"), ("state size", "exp_avg"),
    ("inner groups", "parameter groups"), ("scaler dtype", "loss_scale"),
    ("missing key", "loss_scaler"), ("state kind", "another kind of optimizer"),
    ("scale kind", "'dynamic_loss_scale' disagrees with 'loss_scaler'"),
    # A missing key is named (before: a bare KeyError, a misleading message, or a load
    # whose next step failed).
    ("no loss_scaler.dynamic", r"state_dict\['loss_scaler'\] is missing 'dynamic'"),
    ("no loss_scaler.loss_scale", r"is missing 'loss_scale'"),
    ("no loss_scaler.growth_tracker", r"is missing 'growth_tracker'"),
    ("no loss_scaler.scale_window", r"is missing 'scale_window'"),
    ("no optimizer_state_dict.state", r"'optimizer_state_dict' has no 'state'"),
    ("no optimizer_state_dict.param_groups", r"'optimizer_state_dict' has no 'param_groups'"),
    ("no optimizer_state_dict.param_groups.0.params",
     r"parameter group 0 of the wrapped optimizer's state_dict has no 'params'"),
    ("no optimizer_state_dict.param_groups.0.lr",
     r"parameter group 0 of the wrapped optimizer's state_dict has no 'lr'"),
])
def test_load_state_dict_mismatch_changes_nothing(device, what, match):
    model, optimizer = wrapped(device, torch.float16, "adam", dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=64.0))
    train_step(model, optimizer, 0, device)
    good = copy.deepcopy(optimizer.state_dict())
    buffer = io.BytesIO()
    torch.save(_corrupt(good, what), buffer)
    buffer.seek(0)
    bad = torch.load(buffer, weights_only=True)
    train_step(model, optimizer, 1, device)

    def watched():
        return [list(model.parameters()), optimizer.all_fp32_from_fp16_params,
                optimizer.optimizer.state_dict()["state"], optimizer.loss_scaler._scale]

    before = snapshot(watched())
    scaler, started = optimizer.loss_scaler, set(optimizer._started)
    groups = copy.deepcopy(optimizer.optimizer.state_dict()["param_groups"])
    with pytest.raises(ValueError, match=match):
        optimizer.load_state_dict(bad)
    assert_unchanged(watched(), before)
    assert optimizer.loss_scaler is scaler and optimizer.dynamic_loss_scale is True
    assert optimizer._started == started
    assert optimizer.optimizer.state_dict()["param_groups"] == groups
    train_step(model, optimizer, 2, device)  # and it still trains


@pytest.mark.parametrize("opt_name", ["sgd", "sgd_fused", "mixedprec_sgd"])
@pytest.mark.parametrize("saved_dynamic", [True, False],
                         ids=["dynamic_into_static", "static_into_dynamic"])
def test_load_state_dict_of_the_other_kind_of_loss_scale(device, opt_name, saved_dynamic):
    """As Apex: the state's kind of loss scale (static or dynamic) replaces the
    optimizer's, whole, and the run continues bit for bit as the saved one. Before, the
    record of which parameters the inner optimizer holds state for was kept from before
    the load: a fused optimizer was then handed an overflow flag on a parameter's first
    step (which, skipped, still makes momentum state) where the saved run read the flag
    on the host, and the two runs parted."""
    dynamic = dict(dynamic_loss_scale=True, dynamic_loss_args=dict(init_scale=64.0,
                                                                   scale_window=2))
    static = dict(static_loss_scale=8.0)
    saved_kwargs, other_kwargs = (dynamic, static) if saved_dynamic else (static, dynamic)
    overflow_at = {0, 1} if saved_dynamic else set()  # static: never skips
    model_a, optimizer_a = wrapped(device, torch.float16, opt_name, **saved_kwargs)
    train_step(model_a, optimizer_a, 0, device, overflow_at)  # dynamic: skipped, no state
    saved = round_trip(optimizer_a.state_dict())
    model_b, optimizer_b = wrapped(device, torch.float16, opt_name, seed=1, **other_kwargs)
    for step in range(2):
        train_step(model_b, optimizer_b, step, device)
    model_b.load_state_dict(model_a.state_dict())
    optimizer_b.load_state_dict(saved)
    assert optimizer_b.dynamic_loss_scale is saved_dynamic
    assert type(optimizer_b.loss_scaler) is type(optimizer_a.loss_scaler)
    for step in range(1, 5):
        train_step(model_a, optimizer_a, step, device, overflow_at)
        train_step(model_b, optimizer_b, step, device, overflow_at)
        assert optimizer_b.loss_scale == optimizer_a.loss_scale, step
        for got, expected in zip(optimizer_b.all_fp32_from_fp16_params,
                                 optimizer_a.all_fp32_from_fp16_params):
            assert_bitwise_equal(got.detach(), expected.detach(), f"master after step {step}")
    assert_unchanged(optimizer_b.optimizer.state_dict()["state"],
                     snapshot(optimizer_a.optimizer.state_dict()["state"]))


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
@pytest.mark.parametrize("saved_with, loaded_with", [("sgd", "adam"), ("adam", "sgd")])
def test_load_state_dict_of_another_kind_of_optimizer(device, saved_with, loaded_with, trained):
    kwargs = dict(dynamic_loss_scale=True, dynamic_loss_args=dict(init_scale=64.0))
    model_a, optimizer_a = wrapped(device, torch.float16, saved_with, **kwargs)
    train_step(model_a, optimizer_a, 0, device)
    saved = round_trip(optimizer_a.state_dict())
    model, optimizer = wrapped(device, torch.float16, loaded_with, seed=1, **kwargs)
    if trained:
        train_step(model, optimizer, 0, device)

    def watched():
        return [list(model.parameters()), optimizer.all_fp32_from_fp16_params,
                optimizer.optimizer.state_dict()["state"], optimizer.loss_scaler._scale]

    before = snapshot(watched())
    groups = copy.deepcopy(optimizer.optimizer.state_dict()["param_groups"])
    with pytest.raises(ValueError, match="another kind of optimizer"):
        optimizer.load_state_dict(saved)
    assert_unchanged(watched(), before)
    assert optimizer.optimizer.state_dict()["param_groups"] == groups


def test_load_state_dict_takes_keys_of_schedulers_and_other_torch_versions(device):
    model, optimizer = wrapped(device, torch.float16, "adam", dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=64.0))
    train_step(model, optimizer, 0, device)
    sd = copy.deepcopy(optimizer.state_dict())
    group = sd["optimizer_state_dict"]["param_groups"][0]
    group["initial_lr"] = group["lr"]  # added by an LR scheduler
    del group["differentiable"]  # an option an older torch did not have
    optimizer.load_state_dict(sd)
    train_step(model, optimizer, 1, device)
    assert_model_is_masters(optimizer)
