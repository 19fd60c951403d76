"""mixedprec.optim's own extras (master, state_dtype, seed, unscale_grads) given bad
values: each error names the argument and what it takes, at construction, in
``configure`` and in ``add_param_group``, and nothing changes. (The Apex faces' spellings
of the same errors: tests/python/compat/test_fused_optimizers.py.)"""

import pytest
import torch
from helpers import assert_bitwise_equal
from torch import nn

from mixedprec import optim

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3 = torch.float8_e4m3fn
LEAN = [optim.Adam, optim.AdamW, optim.SGD]  # the classes that take every mode
OTHERS = [optim.LAMB, optim.Adagrad, optim.NovoGrad]


def params(dtype=BF16, n=3):
    return [nn.Parameter(torch.linspace(-1, 1, n, dtype=dtype))]


def snapshot(opt):
    return (opt.master, opt.state_dtype, opt.precision.seed,
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            [list(g["params"]) for g in opt.param_groups])


@pytest.mark.parametrize("cls", LEAN + OTHERS)
@pytest.mark.parametrize("master", ["bf16", "FP32", None, 1, True])
def test_a_bad_master_names_the_modes(cls, master):
    with pytest.raises(ValueError, match=r"expected master to be one of \['fp32', 'none'"):
        cls(params(), master=master)


@pytest.mark.parametrize("cls", LEAN + OTHERS)
@pytest.mark.parametrize("state_dtype", [F16, torch.float64, torch.int8, "bf16", None])
def test_a_bad_state_dtype_names_the_dtypes(cls, state_dtype):
    with pytest.raises(TypeError, match="expected state_dtype to be torch.float32, "
                                        "torch.bfloat16 or torch.float8_e4m3fn"):
        cls(params(), state_dtype=state_dtype)


@pytest.mark.parametrize("cls", LEAN)
@pytest.mark.parametrize("master", ["kahan", "stochastic", "remainder"])
def test_fp16_params_under_a_bf16_mode_are_refused(cls, master):
    with pytest.raises(TypeError, match=f"master='{master}'.*got one of dtype torch.float16"
                                        ".*use master='fp32'"):
        cls(params(F16), master=master)
    opt = cls(params(BF16), master=master)  # bf16 and fp32 params are taken
    opt.add_param_group({"params": params(F32)})
    before = snapshot(opt)
    with pytest.raises(TypeError, match=f"master='{master}'"):
        opt.add_param_group({"params": params(F16)})
    assert snapshot(opt) == before


@pytest.mark.parametrize("cls", OTHERS)
@pytest.mark.parametrize("kwargs", [dict(master="kahan"), dict(master="stochastic"),
                                    dict(master="remainder"), dict(state_dtype=BF16),
                                    dict(state_dtype=E4M3)])
def test_the_lean_modes_are_for_adam_adamw_and_sgd(cls, kwargs):
    with pytest.raises(TypeError, match="take mixedprec.optim.Adam, AdamW or SGD, got "
                                        f"{cls.__name__}"):
        cls(params(), **kwargs)
    opt = cls(params())
    before = snapshot(opt)
    with pytest.raises(TypeError, match="take mixedprec.optim.Adam, AdamW or SGD"):
        opt.configure(**kwargs)
    assert snapshot(opt) == before


@pytest.mark.parametrize("cls", LEAN)
@pytest.mark.parametrize("seed, error, match", [
    (-1, ValueError, r"expected seed in \[0, 2\*\*63\), got -1"),
    (2**63, ValueError, r"expected seed in \[0, 2\*\*63\)"),
    (1.5, TypeError, "expected seed to be an int, got float"),
    (True, TypeError, "expected seed to be an int, got bool"),
    (torch.tensor(3), TypeError, "expected seed to be an int, got Tensor"),
])
def test_a_bad_seed_is_refused(cls, seed, error, match):
    with pytest.raises(error, match=match):
        cls(params(), master="stochastic", seed=seed)


@pytest.mark.parametrize("cls", LEAN)
def test_a_seed_without_rounding_is_refused(cls):
    with pytest.raises(ValueError, match="seed is for master='stochastic' or "
                                         "state_dtype=torch.float8_e4m3fn, got master='fp32'"):
        cls(params(), seed=3)
    for kwargs in (dict(master="stochastic"), dict(state_dtype=E4M3)):
        assert cls(params(), seed=3, **kwargs).precision.seed == 3


@pytest.mark.parametrize("cls", LEAN + OTHERS)
@pytest.mark.parametrize("value", [1, None, "yes"])
def test_unscale_grads_takes_a_bool(cls, value):
    with pytest.raises(TypeError, match=f"expected unscale_grads to be a bool, got {value!r}"):
        cls(params(), unscale_grads=value)


@pytest.mark.parametrize("cls", LEAN)
def test_configure_checks_everything_before_it_changes_anything(cls):
    p = params()
    opt = cls(p, master="fp32")
    before = snapshot(opt)
    for kwargs, error in ((dict(master="bf16"), ValueError),
                          (dict(master="none", state_dtype=F16), TypeError),
                          (dict(state_dtype=torch.float64), TypeError)):
        with pytest.raises(error, match=r"\.configure: expected"):
            opt.configure(**kwargs)
        assert snapshot(opt) == before
    opt.configure(master="remainder", check_only=True)
    assert snapshot(opt) == before
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        opt.configure("none")  # (keyword-only)


@pytest.mark.parametrize("cls", LEAN)
def test_configure_after_a_step_refuses_what_the_state_cannot_carry(cls):
    p = params()
    opt = cls(p, lr=1e-2, master="fp32", **({"momentum": 0.9} if cls is optim.SGD else {}))
    p[0].grad = torch.ones_like(p[0])
    opt.step()
    state = {k: v.clone() for k, v in opt.state[p[0]].items()}
    before = snapshot(opt)
    for kwargs in (dict(master="kahan"), dict(master="stochastic"), dict(state_dtype=BF16),
                   dict(state_dtype=E4M3)):
        with pytest.raises(ValueError, match="pass an optimizer that has not stepped yet"):
            opt.configure(**kwargs)
        assert snapshot(opt) == before
        for key, value in state.items():
            assert_bitwise_equal(opt.state[p[0]][key], value)
    opt.configure(master="remainder")  # (carried over exactly, at the next step)
    assert opt.master == "remainder"


@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW])
def test_8bit_moments_refuse_amsgrad_everywhere(cls):
    with pytest.raises(ValueError, match="amsgrad=True is not supported with "
                                         "state_dtype=torch.float8_e4m3fn"):
        cls(params(), amsgrad=True, state_dtype=E4M3)
    opt = cls(params(), amsgrad=True)
    before = snapshot(opt)
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.configure(state_dtype=E4M3)
    assert snapshot(opt) == before
    opt = cls(params(), state_dtype=E4M3)
    before = snapshot(opt)
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.add_param_group({"params": params(), "amsgrad": True})
    assert snapshot(opt) == before


NUMPY_SETTINGS = [
    pytest.param("Adam", {"lr": "float32"}, id="adam-lr-float32"),
    pytest.param("Adam", {"lr": "int64"}, id="adam-lr-int64"),
    pytest.param("AdamW", {"weight_decay": "float32"}, id="adamw-weight_decay-float32"),
    pytest.param("SGD", {"lr": "float32", "momentum": "float32"}, id="sgd-float32"),
    pytest.param("Adagrad", {"lr": "float32"}, id="adagrad-lr-float32"),
]


@pytest.mark.parametrize("name, numpy_settings", NUMPY_SETTINGS)
def test_numpy_numbers_are_taken_as_torch_takes_them(name, numpy_settings):
    """Settings that are numpy scalars (from a config or a numpy schedule), at
    construction and written into a group later: the same bits as Python numbers."""
    np = pytest.importorskip("numpy")
    plain = {"lr": 0.01 if "int64" not in numpy_settings.values() else 0, "momentum": 0.9,
             "weight_decay": 0.1}
    plain = {k: v for k, v in plain.items() if k in numpy_settings}
    given = {k: getattr(np, kind)(plain[k]) for k, kind in numpy_settings.items()}
    results = []
    for settings, later in ((plain, False), (given, False), (given, True)):
        p = nn.Parameter(torch.linspace(-1, 1, 16))
        opt = getattr(optim, name)([p], **(plain if later else settings))
        for i in range(3):
            if later and i == 1:
                opt.param_groups[0].update(settings)
            p.grad = torch.linspace(-1, 1, 16) * (i + 1)
            opt.step()
        results.append(p.detach().clone())
    assert_bitwise_equal(results[0], results[1])
    assert_bitwise_equal(results[0], results[2])
