"""mixedprec.amp's opt levels against Apex's O0-O3 property table (``apex/amp/frontend.py``):
the dtypes of parameters, buffers, outputs and masters at each level and the default loss
scale, MIXEDPREC_HALF_DTYPE (an unmodified fp16 script in bf16), cast_model_outputs,
keep_batchnorm_fp32, O1's function casts (half/float/promote_function, the registry,
disable_casts), and training to the fp32 loss at every level.

Every test runs on the CPU; those taking the ``device`` fixture have a CUDA twin that
skips on a machine without a GPU."""

import types
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from amp_common import (
    HALF_DTYPES,
    LEVELS,
    OPT_NAMES,
    OPTIMIZERS,
    assert_untouched,
    batch,
    fresh,
    level_kwargs,
    make_mlp,
    scaler_state,
    setup,
    train_step,
)
from torch import nn

from mixedprec import amp

pytestmark = pytest.mark.usefixtures("one_thread", "forget_pending_registrations")


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
