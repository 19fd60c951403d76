"""amp.initialize's lean precision keywords (issue #11): ``master`` ("fp32", "none",
"kahan", "stochastic", "remainder") for the cast weights of O2/O3, and ``state_dtype`` for the fused
optimizers' moments and momentum. amp is a face on the optimizers: a run through amp
must equal, bit for bit, the same model cast by hand (batchnorm kept fp32) and stepped
by the optimizer built with the same mode. Apex's opt levels without the keywords are
tested in test_amp.py."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise_equal
from torch import nn

import mixedprec
from mixedprec import amp
from mixedprec.fp16_utils import convert_network

ADAM = dict(lr=1e-2, weight_decay=1e-2)
SGD = dict(lr=0.05, momentum=0.9)


class Net(nn.Module):
    """Linear layers around a batchnorm (kept fp32 at O2)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def make_net(device):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net().to(device)


def batch(step, device):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 12, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    return x.to(device), y.to(device)


def loss_of(model, step, device):
    x, y = batch(step, device)
    return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


def amp_run(device, cls, kwargs, steps, opt_level="O2", **amp_kwargs):
    model = make_net(device)
    opt = cls(model.parameters(), **kwargs)
    torch.manual_seed(1)  # (master='stochastic' draws its seed at initialize)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **amp_kwargs)
    for step in range(steps):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, step, device), opt) as scaled:
            scaled.backward()
        opt.step()
    return model, opt


def hand_run(device, cls, kwargs, steps, **opt_kwargs):
    model = make_net(device)
    convert_network(model, torch.bfloat16)  # what O2 does: batchnorm stays fp32
    torch.manual_seed(1)
    opt = cls(model.parameters(), **kwargs, **opt_kwargs)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step, device).backward()
        opt.step()
    return model, opt


LEAN = [
    pytest.param(mixedprec.FusedAdam, ADAM, "kahan", torch.float32, "state_dtype",
                 id="adam-kahan"),
    pytest.param(mixedprec.FusedAdam, ADAM, "stochastic", torch.bfloat16, "state_dtype",
                 id="adam-stochastic-bf16-moments"),
    pytest.param(mixedprec.FusedAdam, ADAM, "none", torch.bfloat16, "state_dtype",
                 id="adam-none-bf16-moments"),
    pytest.param(mixedprec.FusedSGD, SGD, "kahan", torch.bfloat16, "state_dtype",
                 id="sgd-kahan-bf16-momentum"),
    pytest.param(mixedprec.FusedSGD, SGD, "stochastic", torch.float32, "state_dtype",
                 id="sgd-stochastic"),
    pytest.param(mixedprec.FusedAdam, ADAM, "remainder", torch.bfloat16, "state_dtype",
                 id="adam-remainder-bf16-moments"),
    pytest.param(mixedprec.FusedSGD, SGD, "remainder", torch.float32, "state_dtype",
                 id="sgd-remainder"),
]


@pytest.mark.parametrize("cls, kwargs, master, state_dtype, dtype_arg", LEAN)
def test_amp_lean_mode_is_the_optimizer_mode(device, cls, kwargs, master, state_dtype,
                                             dtype_arg):
    model, opt = amp_run(device, cls, kwargs, 5, cast_model_type=torch.bfloat16,
                         master=master, state_dtype=state_dtype)
    ref_model, ref_opt = hand_run(device, cls, kwargs, 5, master=master,
                                  **{dtype_arg: state_dtype})
    assert opt.master == master and opt.state_dtype == state_dtype
    assert model.bn.weight.dtype == torch.float32 and model.fc1.weight.dtype == torch.bfloat16
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_bitwise_equal(p, q, msg=name)
        assert sorted(opt.state[p]) == sorted(ref_opt.state[q]), name
        for key, value in opt.state[p].items():
            assert_bitwise_equal(value, ref_opt.state[q][key], msg=f"{name} {key}")
        assert "master_param" not in opt.state[p]
        for mode, key in (("kahan", "kahan_comp"), ("remainder", "remainder")):
            assert (key in opt.state[p]) == (master == mode and p.dtype == torch.bfloat16), name
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        assert group.get("seed") == ref_group.get("seed")


def test_amp_master_fp32_is_o2s_default_and_none_drops_the_masters(device):
    model, opt = amp_run(device, mixedprec.FusedAdam, ADAM, 2, master="fp32")
    assert opt.master == "fp32" and "master_param" in opt.state[model.fc1.weight]
    model, opt = amp_run(device, mixedprec.FusedAdam, ADAM, 2, master="none")
    assert opt.master == "none" and "master_param" not in opt.state[model.fc1.weight]
    # Apex's options are unchanged without the keywords
    model, opt = amp_run(device, mixedprec.FusedAdam, ADAM, 2)
    assert opt.master == "fp32" and opt.state_dtype == torch.float32


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_amp_state_dtype_at_fp32_weights(device, opt_level):
    """bf16 moments beside fp32 weights (torch's fused-Adam recipe), at any opt level."""
    model, opt = amp_run(device, mixedprec.FusedAdam, ADAM, 3, opt_level=opt_level,
                         state_dtype=torch.bfloat16)
    assert model.fc1.weight.dtype == torch.float32
    assert opt.state[model.fc1.weight]["exp_avg"].dtype == torch.bfloat16


def test_amp_lean_state_dict_resumes_bit_for_bit(device):
    kwargs = dict(cast_model_type=torch.bfloat16, master="stochastic",
                  state_dtype=torch.bfloat16)
    model, opt = amp_run(device, mixedprec.FusedAdam, ADAM, 3, **kwargs)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "amp": amp.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_opt = amp_run(device, mixedprec.FusedAdam, ADAM, 0, **kwargs)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    for m, o in ((model, opt), (resumed, resumed_opt)):
        for step in range(3, 5):
            o.zero_grad()
            with amp.scale_loss(loss_of(m, step, device), o) as scaled:
                scaled.backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert_bitwise_equal(p, q, msg=name)


def _errors_leave_everything_as_it_was(make, kwargs, error, match):
    model = make_net("cpu")
    opt = make(model)
    before = copy.deepcopy(model.state_dict())
    master, state_dtype = getattr(opt, "master", None), getattr(opt, "state_dtype", None)
    with pytest.raises(error, match=match):
        amp.initialize(model, opt, verbosity=0, **kwargs)
    for key, value in model.state_dict().items():
        assert_bitwise_equal(value, before[key], msg=key)
    assert getattr(opt, "master", None) == master
    assert getattr(opt, "state_dtype", None) == state_dtype


def adam(model):
    return mixedprec.FusedAdam(model.parameters(), **ADAM)


def stepped_adam(model):
    opt = adam(model)
    loss_of(model, 0, "cpu").backward()
    opt.step()
    return opt


BF16_O2 = dict(opt_level="O2", cast_model_type=torch.bfloat16)
ERRORS = [
    (adam, dict(BF16_O2, master="bf16"), ValueError, "master must be one of"),
    (adam, dict(opt_level="O1", master="kahan"), ValueError,
     "master='kahan' is for the 16-bit weights of opt_level O2 or O3; with O1"),
    (adam, dict(opt_level="O2", master="kahan"), ValueError,
     "master='kahan' keeps bfloat16 weights; expected cast_model_type=torch.bfloat16, "
     "got torch.float16"),
    (adam, dict(opt_level="O2", master="remainder"), ValueError,
     "master='remainder' keeps bfloat16 weights; expected cast_model_type=torch.bfloat16"),
    (lambda m: torch.optim.AdamW(m.parameters()), dict(BF16_O2, master="remainder"),
     TypeError, "master='remainder' and state_dtype=None take mixedprec.optim.Adam, AdamW or "
     "SGD"),
    (adam, dict(BF16_O2, master="stochastic", master_weights=True), ValueError,
     "master_weights=True conflicts with master='stochastic'"),
    (adam, dict(BF16_O2, master="fp32", master_weights=False), ValueError,
     "master_weights=False conflicts with master='fp32'"),
    (adam, dict(BF16_O2, state_dtype=torch.float16), ValueError,
     "state_dtype must be torch.float32, torch.bfloat16 or torch.float8_e4m3fn, got "
     "torch.float16"),
    (lambda m: torch.optim.AdamW(m.parameters()), dict(BF16_O2, master="kahan"), TypeError,
     "master='kahan' and state_dtype=None take mixedprec.optim.Adam, AdamW or SGD \\(or "
     "mixedprec.FusedAdam or FusedSGD\\), got AdamW"),
    (lambda m: mixedprec.FusedLAMB(m.parameters()), dict(BF16_O2, state_dtype=torch.bfloat16),
     TypeError, "take mixedprec.optim.Adam, AdamW or SGD, got FusedLAMB"),
    (stepped_adam, dict(BF16_O2, master="kahan"), ValueError,
     "pass an optimizer that has not stepped yet"),
]


@pytest.mark.parametrize("make, kwargs, error, match", ERRORS)
def test_amp_lean_errors_change_nothing(make, kwargs, error, match):
    _errors_leave_everything_as_it_was(make, kwargs, error, match)


def test_amp_master_fp32_or_none_with_torch_optimizers():
    """'fp32' and 'none' are Apex's master_weights: any optimizer takes them."""
    model = make_net("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", master="none", verbosity=0)
    assert opt.param_groups[0]["params"][0] is model.fc1.weight  # no masters


# --- 8-bit moments (state_dtype=torch.float8_e4m3fn, optim/test_state8.py) ----------------------

def test_amp_initialize_takes_state_dtype_float8(device):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)).to(device)
    opt = mixedprec.FusedAdam(model.parameters(), lr=1e-3)
    model, opt = mixedprec.amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                          cast_model_type=torch.bfloat16, master="remainder",
                                          state_dtype=torch.float8_e4m3fn)
    model(torch.randn(4, 64, device=device, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float8_e4m3fn
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32


def test_optimizers_without_8bit_moments_are_refused_naming_both():
    model = nn.Linear(64, 64)
    for opt in (mixedprec.FusedLAMB(model.parameters()), torch.optim.AdamW(model.parameters())):
        with pytest.raises(TypeError, match="master=None and state_dtype=torch.float8_e4m3fn"):
            mixedprec.amp.initialize(model, opt, opt_level="O0", verbosity=0,
                                     state_dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        mixedprec.optim.AdamW(model.parameters(), state_dtype=torch.float8_e5m2)
