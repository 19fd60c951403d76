"""mixedprec.amp: Apex's ``amp`` API (initialize, scale_loss, master_params,
state_dict/load_state_dict, the function-cast registry, disable_casts) against Apex's
semantics: the O0-O3 property table and override validation of
``apex/amp/frontend.py``, ``scale_loss`` of ``apex/amp/handle.py`` and the dynamic loss
scaler of ``apex/amp/scaler.py`` (start at 2**16, halve on overflow, double after 2000
clean steps, ``min_loss_scale`` floor, ``max_loss_scale`` ceiling), as a plain Python
reference below.

Every test runs on the CPU; those taking the ``device`` fixture have a CUDA twin that
skips on a machine without a GPU."""

import contextlib
import copy
import io
import linecache
import logging
import os
import subprocess
import sys
import textwrap
import types
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixedprec
from mixedprec import amp

REPO = Path(__file__).resolve().parents[3]
PKG_DIR = os.path.dirname(os.path.abspath(mixedprec.__file__))
THIS_FILE = os.path.abspath(__file__)

HALF_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
# (opt_level, the model's reduced precision type); O0 has none.
LEVELS = [
    pytest.param("O0", torch.float32, id="O0"),
    pytest.param("O1", torch.float16, id="O1-fp16"),
    pytest.param("O1", torch.bfloat16, id="O1-bf16"),
    pytest.param("O2", torch.float16, id="O2-fp16"),
    pytest.param("O2", torch.bfloat16, id="O2-bf16"),
    pytest.param("O3", torch.float16, id="O3-fp16"),
    pytest.param("O3", torch.bfloat16, id="O3-bf16"),
]

OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "FusedSGD": lambda params: mixedprec.FusedSGD(params, lr=0.05, momentum=0.9),
    "FusedAdam": lambda params: mixedprec.FusedAdam(params, lr=1e-2, adam_w_mode=False),
}
OPT_NAMES = list(OPTIMIZERS)
FUSED = ("FusedSGD", "FusedAdam")


# --- helpers ---------------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: intra-op threads only add contention (a loaded
    2-core machine runs this file several times slower with them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _forget_pending_registrations():
    """Function-cast registrations a test leaves pending must not reach another test's
    O1 initialize."""
    yield
    amp._registered_casts.clear()


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=32, d_out=1):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, d_out)
        self.tag = "mlp"

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def describe(self):
        return f"{self.tag}:{self.fc1.in_features}->{self.fc2.out_features}"


def make_mlp(seed, device="cpu", **kwargs):
    """An MLP with BatchNorm whose initial weights depend only on `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(**kwargs)
    return model.to(device)


def level_kwargs(level, half, **extra):
    kwargs = dict(opt_level=level, verbosity=0)
    kwargs.update(extra)
    if half is torch.bfloat16:
        kwargs["cast_model_type"] = torch.bfloat16
    return kwargs


def setup(level, half, opt_name, device, seed=0, **extra):
    """A fresh MLP and optimizer through amp.initialize; also the fp32 weights before."""
    model = make_mlp(seed, device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = OPTIMIZERS[opt_name](model.parameters())
    amp_model, opt = amp.initialize(model, opt, **level_kwargs(level, half, **extra))
    return amp_model, opt, before


def batch(step, device="cpu", n=16, d_in=8):
    """Synthetic regression data, a function of `step` only."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, d_in, generator=gen)
    y = 0.5 * x[:, :1] - torch.sin(2 * x[:, 1:2]) + 0.3 * x[:, 2:3] * x[:, 3:4]
    return x.to(device), y.to(device)


def poison(model):
    """Puts an inf into the first gradient (as an overflowing backward would)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.view(-1)[:1].fill_(float("inf"))  # (no tensor from host data)
            return
    raise AssertionError("no gradient to poison")


def train_step(model, opt, step, device="cpu", overflow=False, **scale_kwargs):
    opt.zero_grad()
    x, y = batch(step, device)
    loss = F.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt, **scale_kwargs) as scaled:
        scaled.backward()
        if overflow:
            poison(model)
    opt.step()
    return loss.detach()


def loss_scale(loss_id=0):
    return amp.state_dict()[f"loss_scaler{loss_id}"]["loss_scale"]


def scaler_state(loss_id=0):
    sd = amp.state_dict()[f"loss_scaler{loss_id}"]
    return sd["loss_scale"], sd["unskipped"]


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


def clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v) for v in value)
    return copy.deepcopy(value)


def assert_identical(a, b, path="value"):
    """Same structure, and tensors equal bit for bit (NaNs included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        bits_a = a.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        bits_b = b.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{path} differs:\n{a}\n{b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a)} vs {set(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def snapshot(model, opt, buffers=False):
    """What a step may change: the model's parameters (and its buffers, which a forward
    pass changes too, when `buffers`), the masters and the optimizer state."""
    weights = model.state_dict() if buffers else dict(model.named_parameters())
    return dict(model=clone_tree(weights),
                masters=[m.detach().clone() for m in amp.master_params(opt)],
                optimizer=clone_tree(opt.state_dict()))


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


# --- opt levels: dtypes of parameters, buffers, outputs and masters ----------------------

@pytest.mark.parametrize("opt_name", OPT_NAMES)
@pytest.mark.parametrize("level,half", LEVELS)
def test_opt_level_dtypes_and_masters(device, level, half, opt_name):
    model = make_mlp(0, device)
    before = [p.detach().clone() for p in model.parameters()]
    keys = list(model.state_dict())
    opt = OPTIMIZERS[opt_name](model.parameters())
    amp_model, opt_out = amp.initialize(model, opt, **level_kwargs(level, half))
    assert opt_out is opt
    assert amp_model is model  # the user's own object, as Apex returned it
    assert list(amp_model.state_dict()) == keys

    lin = [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias]
    bn = [model.bn.weight, model.bn.bias]
    stats = [model.bn.running_mean, model.bn.running_var]
    if level in ("O0", "O1"):  # O1 keeps fp32 weights and casts around functions
        expect_lin, expect_bn, expect_stats = torch.float32, torch.float32, torch.float32
    elif level == "O2":  # keep_batchnorm_fp32=True
        expect_lin, expect_bn, expect_stats = half, torch.float32, torch.float32
    else:  # O3: everything in half
        expect_lin, expect_bn, expect_stats = half, half, half
    assert [p.dtype for p in lin] == [expect_lin] * 4
    assert [p.dtype for p in bn] == [expect_bn] * 2
    assert [b.dtype for b in stats] == [expect_stats] * 2
    assert model.bn.num_batches_tracked.dtype == torch.int64

    # Masters: fp32 exact copies of the weights before the cast (O2), else the params.
    masters = list(amp.master_params(opt))
    params = list(model.parameters())
    assert len(masters) == len(params)
    for m, p, b in zip(masters, params, before):
        if level == "O2":
            assert m.dtype == torch.float32 and m.device == p.device
            assert torch.equal(m, b), "master is not an exact copy of the fp32 weight"
            if p.dtype != torch.float32:
                assert m is not p
        else:
            assert m is p
    if level == "O3":
        assert all(m.dtype == half for m in masters)

    # Default loss scale: dynamic (2**16) at O1 and fp16 O2; static 1.0 at O0, O3 and
    # for bf16 at O2/O3.
    dynamic = level in ("O1", "O2") and half is torch.float16  # bf16: a static 1.0
    assert scaler_state() == ((2.0**16 if dynamic else 1.0), 0)

    x, y = batch(0, device, n=8)
    amp_model.train()
    out = amp_model(x)
    expect_out = {"O0": torch.float32, "O1": torch.float32, "O2": torch.float32,
                  "O3": torch.float32}  # O1: fp32 outputs, for the loss (Apex ran it in fp32)
    assert out.dtype == expect_out[level]
    assert out.shape == (8, 1)

    # A few steps (the first ones may be skipped by an overflow at the initial scale).
    for step in range(4):
        train_step(amp_model, opt, step, device)
    masters = list(amp.master_params(opt))
    assert any(not torch.equal(m.float(), b) for m, b in zip(masters, before)), "never stepped"
    for m, p in zip(masters, model.parameters()):
        if level == "O2":
            assert m.dtype == torch.float32
            assert torch.equal(p.detach(), m.detach().to(p.dtype)), \
                "model weight is not the cast master"
        else:
            assert m is p
    assert [p.dtype for p in lin] == [expect_lin] * 4
    assert [p.dtype for p in bn] == [expect_bn] * 2


# --- MIXEDPREC_HALF_DTYPE: an unmodified fp16 script in bf16 ---------------------------------

class DtypeProbe(nn.Module):
    """A Linear that records the dtype its output had (O1's autocast dtype)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.seen = []

    def forward(self, x):
        out = self.fc(x)
        self.seen.append(out.dtype)
        return out


@pytest.mark.parametrize("value", ["bfloat16", "bf16", " BFloat16 "])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_half_dtype_variable_makes_the_opt_levels_bf16(level, value, monkeypatch):
    """With MIXEDPREC_HALF_DTYPE=bfloat16 an Apex script's opt level means bf16 where it
    meant fp16; the loss scale stays the opt level's (dynamic at O1/O2: the script did
    not ask for another)."""
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", value)
    model = make_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    weights = {"O1": torch.float32, "O2": torch.bfloat16, "O3": torch.bfloat16}[level]
    assert model.fc1.weight.dtype == weights
    assert model.bn.weight.dtype == (torch.bfloat16 if level == "O3" else torch.float32)
    assert scaler_state() == ((2.0**16 if level in ("O1", "O2") else 1.0), 0)
    if level == "O2":
        assert all(m.dtype == torch.float32 for m in amp.master_params(opt))
    probe = DtypeProbe()
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.05)
    probe, probe_opt = amp.initialize(probe, probe_opt, opt_level=level, verbosity=0)
    out = probe(torch.ones(2, 8))
    assert probe.seen == [torch.bfloat16] and out.dtype == torch.float32
    for step in range(2):  # trains (bf16 gradients into fp32 masters at O2)
        train_step(model, opt, step)


@pytest.mark.parametrize("value", ["float16", "fp16", "half", ""])
def test_half_dtype_variable_float16_or_empty_is_apex_s_fp16(value, monkeypatch):
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", value)
    model = make_mlp(0)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                   verbosity=0)
    assert model.fc1.weight.dtype == torch.float16


def test_half_dtype_variable_keeps_a_dtype_the_script_gives(monkeypatch):
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", "bfloat16")
    model = make_mlp(0)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                   cast_model_type=torch.float16, verbosity=0)
    assert model.fc1.weight.dtype == torch.float16
    assert scaler_state() == (2.0**16, 0)


@pytest.mark.parametrize("value", ["bfloat", "float32", "torch.bfloat16", "1"])
def test_bad_half_dtype_variable_is_rejected_before_anything_changes(value, monkeypatch):
    model, opt, before = fresh()
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", value)
    with pytest.raises(ValueError, match=r"MIXEDPREC_HALF_DTYPE=.*expected 'bfloat16' or "
                                         r"'float16'"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    monkeypatch.delenv("MIXEDPREC_HALF_DTYPE")
    assert_untouched(model, opt, before)


def test_half_dtype_variable_reaches_amp_init(monkeypatch):
    """amp.init (the 2018 handle): autocast in bf16; a bad value raises and leaves the
    live handle as it was."""
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", "bfloat16")
    handle = amp.init(verbose=False)
    try:
        assert torch.get_autocast_dtype(handle._device) == torch.bfloat16
        monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", "fp8")
        with pytest.raises(ValueError, match="MIXEDPREC_HALF_DTYPE='fp8'"):
            amp.init(verbose=False)
        assert handle.is_active() and amp._handle is handle
        assert torch.get_autocast_dtype(handle._device) == torch.bfloat16
    finally:
        handle._deactivate()


@pytest.mark.parametrize("level,half,outputs,expected", [
    ("O0", None, torch.float16, torch.float16),
    ("O1", torch.float16, torch.float32, torch.float32),
    ("O1", torch.bfloat16, None, torch.float32),
    ("O2", torch.float16, None, torch.float32),
    ("O2", torch.float16, torch.float16, torch.float16),
    ("O2", torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ("O3", torch.float16, None, torch.float32),
    ("O3", torch.bfloat16, torch.bfloat16, torch.bfloat16),
])
def test_cast_model_outputs(device, level, half, outputs, expected):
    Out = namedtuple("Out", "main aux")

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen = None

        def forward(self, x, index, scale=None):
            self.seen = (x.dtype, index.dtype, None if scale is None else scale.dtype)
            y = self.lin(x)
            return Out(y, {"double": y * 2, "index": index, "list": [y, index]})

    module = Nested().to(device)
    model = amp.initialize(module, **level_kwargs(level, half, cast_model_outputs=outputs))
    x = torch.randn(3, 4, device=device)
    index = torch.arange(3, device=device)
    out = model(x, index, scale=torch.ones(1, device=device))
    assert isinstance(out, Out)
    assert out.main.dtype == expected and out.aux["double"].dtype == expected
    assert out.aux["list"][0].dtype == expected
    assert out.aux["index"].dtype == torch.int64 and out.aux["list"][1].dtype == torch.int64
    # O2/O3 cast floating-point inputs (positional and keyword) to the model's type.
    model_type = half if level in ("O2", "O3") else torch.float32
    assert module.seen == (model_type, torch.int64, model_type)


@pytest.mark.parametrize("level,keep,bn_dtype", [
    ("O2", False, torch.float16),
    ("O2", "False", torch.float16),
    ("O3", True, torch.float32),
    ("O3", "True", torch.float32),
])
def test_keep_batchnorm_fp32_override(level, keep, bn_dtype):
    model = make_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_model, opt = amp.initialize(model, opt, opt_level=level, keep_batchnorm_fp32=keep,
                                    verbosity=0)
    assert model.fc1.weight.dtype == torch.float16
    assert model.bn.weight.dtype == bn_dtype and model.bn.running_var.dtype == bn_dtype
    train_step(amp_model, opt, 0)  # runs with batchnorm in either type


def test_initialize_lists_of_models_and_optimizers():
    m1, m2 = make_mlp(0), make_mlp(1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = mixedprec.FusedAdam(m2.parameters())
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    assert isinstance(models, list) and models[0] is m1 and models[1] is m2
    assert opts == [o1, o2]
    assert m1.fc1.weight.dtype == m2.fc1.weight.dtype == torch.float16
    alone = make_mlp(2)
    assert amp.initialize(alone, opt_level="O2", verbosity=0) is alone


# --- initialize returns the user's own models (the forward patch) -------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_initialize_returns_the_users_model(level):
    module = make_mlp(0)
    keys, names = list(module.state_dict()), [n for n, _ in module.named_parameters()]
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    model, opt = amp.initialize(module, opt, opt_level=level, verbosity=0)
    assert model is module and isinstance(model, MLP)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert model.tag == "mlp" and model.describe() == "mlp:8->1"
    # A checkpoint of the model loads into a plain module and back.
    plain = make_mlp(5)
    plain.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in model.state_dict().items()})
    other = amp.initialize(make_mlp(7), opt_level=level, verbosity=0)
    other.load_state_dict(model.state_dict())
    assert_identical(other.state_dict(), model.state_dict())
    train_step(model, opt, 0)


def test_initialize_returns_the_users_sequential():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    names = [n for n, _ in seq.named_parameters()]
    first, last = seq[0], seq[2]
    model = amp.initialize(seq, opt_level="O2", verbosity=0)
    assert model is seq and isinstance(model, nn.Sequential)
    assert model[0] is first and model[-1] is last and len(model) == 3
    assert list(model) == [first, seq[1], last]
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    out = model(torch.randn(2, 4))  # fp32 input cast to fp16, output cast back
    assert out.dtype == torch.float32 and model[0].weight.dtype == torch.float16


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_forward_patch_is_an_instance_attribute_around_the_original(level):
    calls = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            """Net's forward."""
            calls.append((x.dtype, torch.is_autocast_enabled("cpu")))
            return self.lin(x)

    net = Net()
    amp.initialize(net, opt_level=level, verbosity=0)
    assert "forward" in vars(net) and Net.forward.__doc__ == net.forward.__doc__
    assert net.forward.__name__ == "forward"
    # A second initialize replaces the wrapper: the original runs once, cast once.
    amp.initialize(net, opt_level=level, verbosity=0)
    assert net.forward.original.__func__ is Net.forward
    out = net(torch.randn(2, 4))
    expected = (torch.float32, True) if level == "O1" else (torch.float16, False)
    assert calls == [expected] and out.dtype == torch.float32
    # O0 afterwards removes the casts altogether.
    amp.initialize(net, opt_level="O0", verbosity=0)
    assert "forward" not in vars(net)
    calls.clear()
    assert net(torch.randn(2, 4)).dtype == torch.float32 and calls == [(torch.float32, False)]


def test_deepcopy_of_an_initialized_model_runs_the_copy():
    """An EMA copy made after initialize must run its own weights, not the original's."""
    model = amp.initialize(make_mlp(0), opt_level="O2", verbosity=0)
    model.eval()
    ema = copy.deepcopy(model)
    assert ema.forward.original.__self__ is ema and ema.forward.module is ema
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    x = torch.randn(3, 8)
    assert torch.equal(ema(x), torch.zeros(3, 1)) and not torch.equal(model(x), ema(x))
    # So does a whole-model checkpoint.
    buffer = io.BytesIO()
    torch.save(ema, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.forward.original.__self__ is loaded and torch.equal(loaded(x), ema(x))


# --- the dynamic loss scale against Apex's scaler ----------------------------------------

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


# --- training reaches the fp32 loss ----------------------------------------------------------

TRAIN_X = torch.randn(256, 8, generator=torch.Generator().manual_seed(7))
TRAIN_Y = (TRAIN_X @ torch.tensor([[0.8], [-0.6], [0.4], [0.0], [0.3], [-0.2], [0.0], [0.5]])
           + 0.5 * torch.tanh(2 * TRAIN_X[:, 1:2]))
_fp32_losses = {}


def train_mlp(level, half, opt_name, device, steps=60):
    model, opt, _ = setup(level, half, opt_name, device, seed=3)
    x_all, y_all = TRAIN_X.to(device), TRAIN_Y.to(device)
    model.train()
    for step in range(steps):
        idx = slice((step % 8) * 32, (step % 8 + 1) * 32)
        opt.zero_grad()
        loss = F.mse_loss(model(x_all[idx]).float(), y_all[idx])
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return F.mse_loss(model(x_all).float(), y_all).item()


def fp32_loss(opt_name, device):
    if (opt_name, device) not in _fp32_losses:
        _fp32_losses[opt_name, device] = train_mlp("O0", torch.float32, opt_name, device)
    return _fp32_losses[opt_name, device]


@pytest.mark.parametrize("opt_name", OPT_NAMES)
@pytest.mark.parametrize("level,half", [p for p in LEVELS if p.id != "O0"])
def test_training_reaches_fp32_loss(device, level, half, opt_name):
    if (level, half, opt_name) == ("O3", torch.float16, "Adam"):
        # Pure fp16 torch Adam (fp16 moments: eps and v underflow) diverges, as it does
        # under Apex's O3; FusedAdam keeps fp32 moments.
        pytest.skip("O3 fp16 with torch.optim.Adam diverges (Apex's documented O3 behaviour)")
    initial = F.mse_loss(torch.zeros_like(TRAIN_Y), TRAIN_Y).item()
    reference = fp32_loss(opt_name, device)
    got = train_mlp(level, half, opt_name, device)
    assert reference < 0.1 * initial  # the fp32 run learns
    assert got == got and got < 0.1 * initial, f"{level} {half} {opt_name}: {got}"
    assert abs(got - reference) <= 0.15 * reference + 0.005, \
        f"{level} {half} {opt_name}: loss {got}, fp32 {reference}"


# --- checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_name", ["Adam", "FusedAdam"])
def test_checkpoint_resume_is_bit_exact(device, opt_name, half, tmp_path):
    steps, k = 7, 4
    extra = dict(loss_scale="dynamic")  # bf16 too, so that the scale is checkpointed

    def run(model, opt, start, stop):
        return [train_step(model, opt, s, device, overflow=(s == 1)) for s in range(start, stop)]

    model, opt, _ = setup("O2", half, opt_name, device, **extra)
    ref_losses = run(model, opt, 0, steps)
    reference = snapshot(model, opt, buffers=True)
    ref_scale = scaler_state()

    model, opt, _ = setup("O2", half, opt_name, device, **extra)
    first = run(model, opt, 0, k)
    saved_scale = scaler_state()
    assert saved_scale[0] == 2.0**15  # the overflow at step 1
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "amp": amp.state_dict()}, path)
    del model, opt

    # Everything fresh (other initial weights), then the three state dicts.
    model, opt, _ = setup("O2", half, opt_name, device, seed=123, **extra)
    assert scaler_state() == (2.0**16, 0)
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    assert scaler_state() == saved_scale
    rest = run(model, opt, k, steps)

    assert_identical(first + rest, ref_losses, "losses")
    assert_identical(snapshot(model, opt, buffers=True), reference, "state after resuming")
    assert scaler_state() == ref_scale


def test_amp_state_dict_carries_masters_of_torch_optimizers():
    model, opt, before = setup("O2", torch.float16, "Adam", "cpu")
    sd = amp.state_dict()
    assert set(sd) == {"loss_scaler0", "master_params0"}
    assert sd["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": 0}
    # One master per fp16 parameter (batchnorm's fp32 parameters are their own), exact.
    assert_identical(sd["master_params0"], [before[i] for i in (0, 1, 4, 5)])
    fused_model, fused_opt, _ = setup("O2", torch.float16, "FusedAdam", "cpu")
    assert set(amp.state_dict()) == {"loss_scaler0"}  # fused masters live in the optimizer
    assert all("master_param" in fused_opt.state[p] for p in fused_model.fc1.parameters())


def test_state_dict_needs_initialize(monkeypatch):
    monkeypatch.setattr(amp, "_current", None)  # as in a process that never initialized
    with pytest.raises(RuntimeError, match="initialize"):
        amp.state_dict()
    with pytest.raises(RuntimeError, match="initialize"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


def test_load_state_dict_with_another_number_of_loss_scalers_loads_them_in_order():
    """Apex warned and loaded the saved scalers in order into the first ones: a
    num_losses=1 checkpoint resumes a num_losses=2 run (the second keeps its state), and
    a num_losses=2 checkpoint a num_losses=1 run (its first scaler)."""
    setup("O2", torch.float16, "Adam", "cpu")
    one = dict(amp.state_dict(), loss_scaler0={"loss_scale": 8.0, "unskipped": 3})
    setup("O2", torch.float16, "Adam", "cpu", num_losses=2)
    second = scaler_state(1)
    with pytest.warns(UserWarning, match="holds 1 loss scalers .*initialized with 2"):
        amp.load_state_dict(one)
    assert scaler_state(0) == (8.0, 3) and scaler_state(1) == second
    two = dict(amp.state_dict(), loss_scaler1={"loss_scale": 4.0, "unskipped": 5})
    setup("O2", torch.float16, "Adam", "cpu")
    with pytest.warns(UserWarning, match="holds 2 loss scalers .*initialized with 1"):
        amp.load_state_dict(two)
    assert scaler_state(0) == (8.0, 3)
    with pytest.raises(ValueError, match=r"unexpected keys \['optimizer'\]"):
        amp.load_state_dict(dict(two, optimizer={}))
    assert scaler_state(0) == (8.0, 3)


def test_load_state_dict_rejects_a_mismatch():
    setup("O2", torch.float16, "Adam", "cpu")
    sd = amp.state_dict()
    model, opt, _ = setup("O2", torch.float16, "Adam", "cpu", seed=1)
    snap = snapshot(model, opt)
    scale = scaler_state()
    bad = dict(sd, loss_scaler0={"loss_scale": 8.0, "unskipped": 3},
               master_params0=sd["master_params0"][:-1])
    with pytest.raises(ValueError, match="master_params0"):
        amp.load_state_dict(bad)
    assert_identical(snapshot(model, opt), snap)
    assert scaler_state() == scale


@pytest.mark.parametrize("bad,match", [
    ({"loss_scale": -1.0, "unskipped": 0}, r"loss_scaler1 .*finite and > 0, got -1"),
    ({"loss_scale": float("inf"), "unskipped": 0}, r"loss_scaler1 .*finite and > 0, got inf"),
    ({"loss_scale": "big", "unskipped": 0}, r"loss_scaler1 .*number, got str"),
    ({"loss_scale": 8.0, "unskipped": -2}, r"loss_scaler1 .*int >= 0, got -2"),
    ({"loss_scale": 8.0}, "loss_scaler1"),
    (None, "loss_scaler1"),
])
def test_load_state_dict_applies_all_or_nothing(bad, match):
    """A bad second loss scaler entry after a good first one: nothing is loaded."""
    model, opt, _ = setup("O2", torch.float16, "Adam", "cpu", num_losses=2)
    sd = amp.state_dict()
    good = dict(sd, loss_scaler0={"loss_scale": 8.0, "unskipped": 3},
                master_params0=[m + 1 for m in sd["master_params0"]])
    snap, scales = snapshot(model, opt), (scaler_state(0), scaler_state(1))
    with pytest.raises(ValueError, match=match):
        amp.load_state_dict(dict(good, loss_scaler1=bad))
    assert_identical(snapshot(model, opt), snap)
    assert (scaler_state(0), scaler_state(1)) == scales
    with pytest.raises(ValueError, match="master_params0"):  # a master of another dtype
        amp.load_state_dict(dict(good, master_params0=[m.long() for m in sd["master_params0"]]))
    assert (scaler_state(0), scaler_state(1)) == scales
    amp.load_state_dict(good)  # and the good one loads whole
    assert scaler_state(0) == (8.0, 3)
    assert_identical(list(amp.state_dict()["master_params0"]), good["master_params0"])


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd["loss_scaler1"].pop("unskipped"), "loss_scaler1 has no 'unskipped'"),
    (lambda sd: sd["loss_scaler1"].pop("loss_scale"), "loss_scaler1 has no 'loss_scale'"),
    (lambda sd: sd.__setitem__("loss_scaler1", [8.0, 0]),
     "expected loss_scaler1 to be a dict with 'loss_scale' and 'unskipped'"),
    (lambda sd: sd.__setitem__("scaler", {}), r"unexpected keys \['scaler'\]"),
], ids=["no_unskipped", "no_loss_scale", "a_list", "unexpected_key"])
def test_load_state_dict_names_a_missing_key(change, match):
    """A key missing from amp's state dict (or from one of its entries) is named, and
    nothing is loaded."""
    model, opt, _ = setup("O2", torch.float16, "Adam", "cpu", num_losses=2)
    sd = clone_tree(amp.state_dict())
    sd["loss_scaler0"] = {"loss_scale": 8.0, "unskipped": 3}
    sd["master_params0"] = [m + 1 for m in sd["master_params0"]]
    change(sd)
    snap, scales = snapshot(model, opt), (scaler_state(0), scaler_state(1))
    with pytest.raises(ValueError, match=match):
        amp.load_state_dict(sd)
    assert_identical(snapshot(model, opt), snap)
    assert (scaler_state(0), scaler_state(1)) == scales


@pytest.mark.parametrize("bad", [None, [], "amp.pt"])
def test_load_state_dict_of_what_is_not_a_dict(bad):
    setup("O2", torch.float16, "SGD", "cpu")
    scale = scaler_state()
    with pytest.raises(ValueError, match="expected state_dict to be a dict"):
        amp.load_state_dict(bad)
    assert scaler_state() == scale


def test_load_state_dict_checks_each_scale_against_its_own_bounds():
    """A saved scale below the raised floor of the second scaler: nothing is loaded
    (before, the check ran against default bounds and the first scaler was loaded)."""
    setup("O2", torch.float16, "FusedAdam", "cpu", num_losses=2, min_loss_scale=4.0)
    sd = amp.state_dict()
    scales = (scaler_state(0), scaler_state(1))
    bad = dict(sd, loss_scaler0={"loss_scale": 8.0, "unskipped": 3},
               loss_scaler1={"loss_scale": 2.0, "unskipped": 0})
    with pytest.raises(ValueError, match="loss_scaler1"):
        amp.load_state_dict(bad)
    assert (scaler_state(0), scaler_state(1)) == scales


def test_loss_scalers_are_faces_on_loss_scale():
    from mixedprec.loss_scale import DEFAULT_MIN_SCALE, LossScale
    setup("O2", torch.float16, "FusedAdam", "cpu", num_losses=2)
    scalers = amp._amp_state.loss_scalers
    assert len(scalers) == 2 and all(isinstance(s.core, LossScale) for s in scalers)
    core = scalers[0].core
    assert (core.growth_factor, core.backoff_factor, core.growth_interval) == (2.0, 0.5, 2000)
    assert (core.min_scale, core.max_scale) == (DEFAULT_MIN_SCALE, 2.0**24)
    value = scalers[1].loss_scale()
    assert type(value) is float and value == 2.0**16
    # A floor above Apex's start (min(2**16, max_loss_scale)) raises the start.
    setup("O2", torch.float16, "SGD", "cpu", min_loss_scale=2.0**20)
    assert scaler_state() == (2.0**20, 0)


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


# --- several losses and gradient accumulation -----------------------------------------------

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


# --- function casts ----------------------------------------------------------------------------

def _dtypes_and_sum(a, b):
    out = a + b
    return (a.dtype, b.dtype, torch.is_autocast_enabled(a.device.type), out.dtype), out


class Calls(nn.Module):
    """Calls `fn(linear(x), x)` in its forward: a half and an fp32 tensor under O1."""

    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x), x)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_half_float_promote_functions_under_o1(device, half):
    cases = {
        amp.half_function: (half, half, half),
        amp.float_function: (torch.float32, torch.float32, torch.float32),
        amp.promote_function: (torch.float32, torch.float32, torch.float32),
    }
    for wrap, (a_dtype, b_dtype, out_dtype) in cases.items():
        wrapped = wrap(_dtypes_and_sum)
        assert wrapped.__name__ == "_dtypes_and_sum"
        model = amp.initialize(Calls(wrapped).to(device), opt_level="O1", verbosity=0,
                               cast_model_type=half if half is torch.bfloat16 else None)
        (seen_a, seen_b, autocast_inside, inner), out = model(torch.randn(2, 4, device=device))
        assert (seen_a, seen_b, inner) == (a_dtype, b_dtype, out_dtype), wrap.__name__
        assert not autocast_inside, wrap.__name__
        assert out.dtype == torch.float32  # O1's model outputs leave as fp32
        # Outside autocast the wrapped function is the function itself.
        x = torch.randn(2, 4, device=device)
        (seen_a, seen_b, _, _), out = wrapped(x, x.to(half))
        assert (seen_a, seen_b) == (torch.float32, half)
    # promote_function of two half tensors stays half.
    both_half = amp.promote_function(lambda a, b: (a.dtype, b.dtype))
    model = amp.initialize(Calls(lambda a, b: both_half(a, b.to(a.dtype))).to(device),
                           opt_level="O1", verbosity=0,
                           cast_model_type=half if half is torch.bfloat16 else None)
    assert model(torch.randn(2, 4, device=device)) == (half, half)


def test_register_functions_apply_at_o1_initialize(device):
    ns = types.SimpleNamespace(
        half_op=lambda a, b: (a.dtype, b.dtype),
        float_op=lambda a, b: (a.dtype, b.dtype),
        promote_op=lambda a, b: (a.dtype, b.dtype),
    )
    originals = dict(vars(ns))
    amp.register_half_function(ns, "half_op")
    amp.register_float_function(ns, "float_op")
    amp.register_promote_function(ns, "promote_op")
    with pytest.raises(ValueError, match="no_such_op"):
        amp.register_half_function(ns, "no_such_op")
    assert vars(ns) == originals  # registering changes nothing yet

    amp.initialize(make_mlp(0), opt_level="O2", verbosity=0)
    assert vars(ns) == originals  # only an O1 initialize applies the registry

    class Uses(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)  # half under autocast
            return ns.half_op(x, x), ns.float_op(h, h), ns.promote_op(h, x)

    model = amp.initialize(Uses().to(device), opt_level="O1", verbosity=0)
    assert all(getattr(ns, k) is not v for k, v in originals.items())
    half_seen, float_seen, promote_seen = model(torch.randn(2, 4, device=device))
    assert half_seen == (torch.float16, torch.float16)
    assert float_seen == (torch.float32, torch.float32)
    assert promote_seen == (torch.float32, torch.float32)
    # Applied once: a later O1 initialize does not wrap again.
    wrapped = dict(vars(ns))
    amp.initialize(make_mlp(1), opt_level="O1", verbosity=0)
    assert dict(vars(ns)) == wrapped


def test_disable_casts_turns_autocast_off(device):
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            before = (self.lin(x).dtype, torch.is_autocast_enabled(x.device.type))
            with amp.disable_casts():
                inside = (self.lin(x).dtype, torch.is_autocast_enabled(x.device.type))
            after = (self.lin(x).dtype, torch.is_autocast_enabled(x.device.type))
            return before, inside, after

    model = amp.initialize(Inner().to(device), opt_level="O1", verbosity=0)
    before, inside, after = model(torch.randn(2, 4, device=device))
    assert before == (torch.float16, True)
    assert inside == (torch.float32, False)
    assert after == (torch.float16, True)


# --- bad input ---------------------------------------------------------------------------------

def assert_untouched(model, opt, before):
    """Nothing was cast or registered: the optimizer can still be initialized."""
    assert "forward" not in vars(model)  # not patched
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    amp_model, _ = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.fc1.weight.dtype == torch.float16


def fresh():
    model = make_mlp(0)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), \
        [p.detach().clone() for p in model.parameters()]


def test_optimizer_passed_twice_is_rejected():
    m1 = make_mlp(0)
    opt = torch.optim.SGD(m1.parameters(), lr=0.1)
    amp.initialize(m1, opt, opt_level="O2", verbosity=0)
    m2 = make_mlp(1)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(ValueError, match="already passed to amp.initialize"):
        amp.initialize(m2, opt, opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float32 for p in m2.parameters())
    assert all(torch.equal(p, b) for p, b in zip(m2.parameters(), before))

    model, opt, before = fresh()
    with pytest.raises(ValueError, match="listed twice"):
        amp.initialize(model, [opt, opt], opt_level="O2", verbosity=0)
    assert_untouched(model, opt, before)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_optimizer_of_another_model_is_rejected_before_any_cast(level):
    """An optimizer built on another instance (or a copy) of the model: Apex cast the
    model and returned, and the model never learned. A ValueError naming the optimizer,
    nothing cast, the registry and both objects as they were."""
    model, _, before = fresh()
    other = make_mlp(0)
    foreign = torch.optim.SGD(other.parameters(), lr=0.1)
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    functions = types.SimpleNamespace(add=lambda a, b: a + b)
    original = functions.add
    amp.register_half_function(functions, "add")  # pending: applied by an O1 initialize
    with pytest.raises(ValueError, match=r"optimizers\[1\] \(SGD\) to hold parameters "
                                         r"of the models given"):
        amp.initialize(model, [mine, foreign], opt_level=level, verbosity=0)
    assert functions.add is original and len(amp._registered_casts) == 1
    assert all(p.dtype == torch.float32 for p in other.parameters())
    assert [p for g in foreign.param_groups for p in g["params"]] == list(other.parameters())
    assert foreign not in amp._optimizer_amp and mine not in amp._optimizer_amp
    amp._registered_casts.clear()
    assert_untouched(model, mine, before)


def test_optimizer_with_the_models_and_extra_parameters_is_accepted():
    """A subset of the model's parameters (frozen layers) or some of its own beside
    them (a learnable loss temperature) is still the model's optimizer."""
    model = make_mlp(0)
    temperature = nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([{"params": model.fc1.parameters()}, {"params": [temperature]}],
                          lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.fc1.weight.dtype == torch.float16 and temperature.dtype == torch.float32
    assert opt.param_groups[1]["params"] == [temperature]


def test_ddp_wrapped_model_is_rejected(tmp_path):
    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    model, opt, before = fresh()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(ValueError, match="DistributedDataParallel"):
            amp.initialize(ddp, opt, opt_level="O2", verbosity=0)
    finally:
        dist.destroy_process_group()
    assert_untouched(model, opt, before)


def test_data_parallel_model_is_rejected():
    model, opt, _ = fresh()
    wrapped = nn.DataParallel(model)  # with one GPU, this moves the model onto it
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="DataParallel"):
        amp.initialize(wrapped, opt, opt_level="O2", verbosity=0)
    assert_untouched(model, opt, before)


@pytest.mark.parametrize("kwargs,match", [
    (dict(opt_level="01"), "opt_level"),
    (dict(opt_level="o2"), "opt_level"),
    (dict(opt_level="O1", cast_model_type=torch.float16), "cast_model_type"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
    (dict(opt_level="O1", keep_batchnorm_fp32="False"), "keep_batchnorm_fp32"),
    (dict(opt_level="O1", master_weights=True), "master_weights"),
    (dict(opt_level="O2", patch_torch_functions=True), "patch_torch_functions"),
    (dict(opt_level="O3", patch_torch_functions="True"), "patch_torch_functions"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32"),
    (dict(opt_level="O2", loss_scale="huge"), "loss_scale"),
    (dict(opt_level="O2", loss_scale=0), "loss_scale"),
    (dict(opt_level="O2", cast_model_type=torch.int8), "cast_model_type"),
    (dict(opt_level="O2", cast_model_outputs=torch.int32), "cast_model_outputs"),
    (dict(opt_level="O2", num_losses=0), "num_losses"),
    (dict(opt_level="O2", loss_scale=float("inf")), "loss_scale"),
    (dict(opt_level="O2", loss_scale=float("nan")), "loss_scale"),
    (dict(opt_level="O2", loss_scale="-8"), "loss_scale"),
    (dict(opt_level="O2", min_loss_scale=float("nan")), "min_loss_scale"),
    (dict(opt_level="O2", min_loss_scale=0.0), "min_loss_scale"),
    (dict(opt_level="O2", min_loss_scale=-1.0), "min_loss_scale"),
    (dict(opt_level="O2", max_loss_scale=float("nan")), "max_loss_scale"),
    (dict(opt_level="O2", max_loss_scale=0.0), "max_loss_scale"),
    (dict(opt_level="O2", min_loss_scale=2.0**10, max_loss_scale=2.0**8),
     "min_loss_scale <= max_loss_scale"),
])
def test_rejected_options_change_nothing(kwargs, match):
    model, opt, before = fresh()
    with pytest.raises(ValueError, match=match) as info:
        amp.initialize(model, opt, verbosity=0, **kwargs)
    if "opt_level" in match:
        assert "'O0'" in str(info.value) and repr(kwargs["opt_level"]) in str(info.value)
    assert_untouched(model, opt, before)


@pytest.mark.parametrize("kwargs,check", [
    (dict(opt_level="O2", master_weights="False"),
     lambda model, opt: all(m is p for m, p in zip(amp.master_params(opt), model.parameters()))),
    (dict(opt_level="O2", master_weights="True"),
     lambda model, opt: all(m.dtype == torch.float32 for m in amp.master_params(opt))),
    (dict(opt_level="O2", loss_scale="128.0"),
     lambda model, opt: scaler_state() == (128.0, 0)),
    (dict(opt_level="O3", loss_scale="dynamic"),
     lambda model, opt: scaler_state() == (2.0**16, 0)),
    (dict(opt_level="O2", patch_torch_functions="False"),
     lambda model, opt: model.fc1.weight.dtype == torch.float16),
    (dict(opt_level="O2", keep_batchnorm_fp32="True"),
     lambda model, opt: model.bn.weight.dtype == torch.float32),
])
def test_string_overrides_are_accepted(kwargs, check):
    model = make_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_model, opt = amp.initialize(model, opt, verbosity=0, **kwargs)
    assert check(model, opt)
    train_step(amp_model, opt, 0)


@pytest.mark.parametrize("bad", ["sgd", [object()], {"lr": 0.1}])
def test_non_optimizer_is_a_type_error(bad):
    model, opt, before = fresh()
    with pytest.raises(TypeError, match="Optimizer"):
        amp.initialize(model, bad, opt_level="O2", verbosity=0)
    with pytest.raises(TypeError, match="Optimizer"):
        amp.initialize(model, [opt, bad], opt_level="O2", verbosity=0)
    with pytest.raises(TypeError, match="nn.Module"):
        amp.initialize(object(), opt, opt_level="O2", verbosity=0)
    assert_untouched(model, opt, before)


# --- enabled=False -----------------------------------------------------------------------------

def check_disabled(model, opt, before):
    out_model, out_opt = amp.initialize(model, opt, enabled=False, opt_level="O2")
    assert out_model is model and out_opt is opt
    assert amp.initialize(model, enabled=False, opt_level="O2") is model
    models, opts = [model], [opt]
    got_models, got_opts = amp.initialize(models, opts, enabled=False, opt_level="O3")
    assert got_models is models and got_opts is opts
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    loss = model(torch.randn(4, 8)).float().mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.allclose(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, grads))


def test_enabled_false_returns_inputs_unchanged(monkeypatch):
    monkeypatch.setattr(amp, "_current", None)  # as in a process that never enabled amp
    check_disabled(*fresh())


def test_enabled_false_after_an_enabled_initialize():
    """A disabled initialize after an enabled one (e.g. a second training run in the
    same process): the disabled optimizer's scale_loss still yields the loss itself."""
    first = make_mlp(1)
    amp.initialize(first, torch.optim.SGD(first.parameters(), lr=0.1), opt_level="O1",
                   verbosity=0)
    check_disabled(*fresh())


# --- overflow reporting ------------------------------------------------------------------------

def test_overflow_is_reported_once(caplog):
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    # A small initial scale: no step overflows unless told to.
    model, opt, _ = setup("O1", torch.float16, "SGD", "cpu", max_loss_scale=2.0**8,
                          verbosity=2)
    for step in range(4):
        train_step(model, opt, step)
    assert [r for r in caplog.records if r.name == "mixedprec.amp"] == []
    scale = loss_scale()
    train_step(model, opt, 4, overflow=True)
    records = [r for r in caplog.records if r.name == "mixedprec.amp"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "overflow" in message.lower() and f"{scale / 2:g}" in message


def test_overflow_reports_are_rate_limited(caplog):
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    model, opt, _ = setup("O2", torch.float16, "FusedAdam", "cpu", min_loss_scale=1.0,
                          max_loss_scale=2.0**8, verbosity=2)
    train_step(model, opt, 0)
    assert caplog.records == []
    for step in range(10):
        train_step(model, opt, step, overflow=True)
    records = [r for r in caplog.records if r.name == "mixedprec.amp"]
    assert 1 <= len(records) < 10, [r.getMessage() for r in records]
    assert all(r.levelno == logging.WARNING for r in records)
    # Once the interval has passed, the next message counts the skips in between.
    suppressed = 10 - len(records)
    amp._current.reporter.last_log = -float("inf")
    caplog.clear()
    train_step(model, opt, 10, overflow=True)
    records = [r for r in caplog.records if r.name == "mixedprec.amp"]
    assert len(records) == 1
    assert f"({suppressed} more since the last message)" in records[0].getMessage()


@pytest.mark.parametrize("opt_name", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("per_param", [False, True])
def test_verbosity_1_gives_one_summary(caplog, opt_name, per_param):
    """The default verbosity: no line per skipped step, one summary (at exit) of the
    skipped steps and the scale; overflow_report=True counts per parameter and names
    them."""
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    model, opt, _ = setup("O2", torch.float16, opt_name, "cpu", min_loss_scale=1.0,
                          max_loss_scale=2.0**8, verbosity=1, overflow_report=per_param)
    for step in range(8):
        train_step(model, opt, step, overflow=step in (2, 3, 6))
    assert [r for r in caplog.records if r.name == "mixedprec.amp"] == []
    report = amp.overflow_report()
    assert (report["steps"], report["skipped"]) == (8, 3)
    assert report["overflows"] == ({"fc1.weight": 3} if per_param else {})
    assert report["scale"] == dict(current=32.0, min=32.0, max=256.0, backoffs=3, growths=0)
    amp._current.log_summary()  # what runs at exit
    records = [r.getMessage() for r in caplog.records if r.name == "mixedprec.amp"]
    names = "; overflows: fc1.weight 3" if per_param else ""
    assert records == ["amp: 3 of 8 steps skipped (37.5%); scale 32 (min 32, max 256, 3 "
                       f"backoffs, 0 growths){names}"]


def test_verbosity_0_is_silent_and_counts_no_parameter(caplog):
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    model, opt, _ = setup("O2", torch.float16, "FusedSGD", "cpu", max_loss_scale=2.0**8)
    for step in range(3):
        train_step(model, opt, step, overflow=step == 1)
    assert caplog.records == []
    report = amp.overflow_report(scale=False)
    assert report == {"steps": 3, "skipped": 1, "overflows": {}}
    with pytest.raises(ValueError, match="verbosity"):
        amp.initialize(make_mlp(0), opt_level="O2", verbosity=-1)


def test_the_summary_is_logged_at_exit(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import mixedprec
        from mixedprec import amp
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        opt = mixedprec.FusedAdam(model.parameters(), lr=1e-3)
        model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.0**8,
                                    overflow_report=True)
        for step in range(4):
            opt.zero_grad()
            with amp.scale_loss(model(torch.ones(2, 4)).float().sum(), opt) as scaled:
                scaled.backward()
                if step == 1:
                    model[1].weight.grad.view(-1)[0] = float("inf")
            opt.step()
        print("done")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(mixedprec.__file__).parents[1])),
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    assert "amp: 1 of 4 steps skipped (25.0%); scale 128 (min 128, max 256, 1 backoffs, " \
        "0 growths); overflows: 1.weight 1" in out.stderr


@pytest.mark.parametrize("per_param", [False, True])
def test_no_host_read_in_a_step_at_verbosity_1(monkeypatch, per_param):
    from helpers import forbid_host_sync
    model, opt, _ = setup("O2", torch.float16, "FusedAdam", "cpu", max_loss_scale=2.0**8,
                          verbosity=1, overflow_report=per_param)
    train_step(model, opt, 0)
    with forbid_host_sync(monkeypatch):
        for step in range(1, 4):
            train_step(model, opt, step, overflow=step == 2)
    report = amp.overflow_report()
    assert report["skipped"] == 1
    assert report["overflows"] == ({"fc1.weight": 1} if per_param else {})


# --- no host synchronisation with fused optimizers --------------------------------------------

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
                "__index__")


class SyncDetector:
    """Wraps torch.Tensor's host-reading methods. While armed, on the CPU it records every
    call made, directly or through torch, from mixedprec's code (its innermost frame in
    the package) on a line not marked ``# sync-ok``; on CUDA it also records every call on
    a device tensor."""

    def __init__(self, monkeypatch):
        self.armed = False
        self.calls = []
        for name in SYNC_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, original):
        detector = self

        def wrapper(tensor, *args, **kwargs):
            if detector.armed:
                detector._check(name, tensor)
            return original(tensor, *args, **kwargs)
        return wrapper

    def _check(self, name, tensor):
        if tensor.device.type != "cpu":
            self.calls.append((name, str(tensor.device), "any caller"))
        frame = sys._getframe(2)  # the caller of the wrapped method
        while frame is not None:
            filename = os.path.abspath(frame.f_code.co_filename)
            if filename == THIS_FILE:
                return
            if filename.startswith(PKG_DIR + os.sep):
                line = linecache.getline(filename, frame.f_lineno)
                if "# sync-ok" not in line:
                    self.calls.append((name, f"{filename}:{frame.f_lineno}", line.strip()))
                return
            frame = frame.f_back


@contextlib.contextmanager
def armed(detector, device):
    detector.armed = True
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        detector.armed = False
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def synced_steps(model, opt, device, detector, steps, overflow_at=()):
    """Training steps with the detector armed (and, on CUDA, the sync debug mode
    raising) around the scale_loss exit and the optimizer step."""
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, device)
        loss = F.mse_loss(model(x).float(), y)
        with contextlib.ExitStack() as stack:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if step in overflow_at:
                    poison(model)
                stack.enter_context(armed(detector, device))
            opt.step()


def add_host_read(monkeypatch, target, name):
    """Replaces ``target.name`` by a version that first calls ``.item()`` on its
    one-element tensor arguments, from code that claims to live in target's module file
    (as if someone had added the read there)."""
    filename = sys.modules[target.__module__].__file__
    namespace = {"original": getattr(target, name), "torch": torch}
    source = ("def patched(self, *args):\n"
              "    [a.item() for a in args if isinstance(a, torch.Tensor) and a.numel() == 1]\n"
              "    return original(self, *args)\n")
    exec(compile(source, filename, "exec"), namespace)
    monkeypatch.setattr(target, name, namespace["patched"])
    return os.path.abspath(filename)


@pytest.mark.parametrize("opt_name", FUSED)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_optimizers_never_read_device_values(device, level, opt_name, monkeypatch):
    model, opt, _ = setup(level, torch.float16, opt_name, device)
    detector = SyncDetector(monkeypatch)
    if device == "cuda":  # the loss scale moves to the device at the first scale_loss
        train_step(model, opt, 0, device)
    synced_steps(model, opt, device, detector, 6, overflow_at=(2, 3))
    assert detector.calls == [], detector.calls
    assert loss_scale() <= 2.0**14  # the overflows were seen

    # The check is not vacuous: a host read added to the scale_loss exit (the loss
    # scaler's update) or to the optimizer step (its op call, planned by the earlier
    # steps) is caught.
    for target, name in ((amp.LossScaler, "update"), (type(opt), "_run_plan")):
        with monkeypatch.context() as patch:
            filename = add_host_read(patch, target, name)
            detector.calls.clear()
            try:
                synced_steps(model, opt, device, detector, 1)
            except RuntimeError:  # CUDA's sync debug mode
                assert device == "cuda"
            else:
                assert any(c[1].startswith(filename) or device == "cuda" and c[2] == "any caller"
                           for c in detector.calls), f"an .item() in {name} went unnoticed"


# --- legacy Apex script ------------------------------------------------------------------------

LEGACY_SCRIPT = """
import torch
from apex import amp
from apex.optimizers import FusedAdam

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16),
                            torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = FusedAdam(model.parameters(), lr=1e-2)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
x = torch.randn(64, 4)
y = x.sum(1, keepdim=True)
losses = []
for _ in range(40):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
assert losses[-1] < 0.5 * losses[0], losses
assert model[0].weight.dtype == torch.float16
checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "amp": amp.state_dict()}
amp.load_state_dict(checkpoint["amp"])
print("LEGACY-AMP-OK", checkpoint["amp"]["loss_scaler0"]["loss_scale"])
"""


def test_legacy_apex_script_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LEGACY_SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "mixedprec.apex", str(script)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "LEGACY-AMP-OK" in result.stdout, result.stdout + result.stderr


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
