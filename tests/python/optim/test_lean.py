"""Lean precision modes of mixedprec.optim's AdamW and SGD (issue #11, part 1): bf16
moments and momentum buffers, master="none" (bf16 params rounded to nearest) and
master="kahan" (a bf16 compensation per bf16 param), each step against float64
references, and what must still hold for them: skipped steps, state_dict round trips,
load checks, errors. (Apex's master_weights beside master, the mode switched through
it, and FusedAdam's 2019 step: compat/test_fused_optimizers.py.)"""

import copy
import io

import pytest
import torch
from helpers import TOLERANCES, assert_bitwise_equal, assert_same_snapshot, full_snapshot, randn
from references import ref_adam, ref_kahan_start, ref_lean_update, ref_sgd, round_bf16
from torch import nn

from mixedprec import optim

# Sizes past the CPU engine's vector widths (8, 16 floats), with tails, and a matrix.
SHAPES = [(37,), (5, 7), (300,)]
STEPS = 5
TIGHT = TOLERANCES[torch.float32]
BF16_ULP = 2.0 ** -7  # a bf16 unit in the last place, relative to the value (at most)

ADAM = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 1e-2}
SGD = {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}


def make_params(device, dtype, seed=0):
    return [nn.Parameter(randn(shape, torch.float32, "cpu", seed=seed + i).to(dtype)
                         .to(device)) for i, shape in enumerate(SHAPES)]


def set_grads(params, step):
    for i, p in enumerate(params):
        p.grad = randn(p.shape, p.dtype, p.device, seed=1000 + 31 * step + i, scale=0.5)


def assert_within_bf16_ulp(actual, expected, msg):
    """bf16 `actual` is the float64 `expected` rounded to nearest, or a neighbour of
    it (fp32 math may land on the other side of a rounding boundary; atol: sums that
    cancel, exact in fp32, leave float64 a few 1e-17)."""
    torch.testing.assert_close(actual.double(), round_bf16(expected), rtol=BF16_ULP, atol=1e-6,
                               msg=msg)


def adam_ref_step(opt, params, step_before):
    """The float64 reference of AdamW's next step from its current state:
    (update start values, new values, new moments) per param."""
    beta1, beta2 = ADAM["betas"]
    starts, ms, vs, grads = [], [], [], []
    for p in params:
        state = opt.state.get(p, {})
        if opt.master == "kahan" and "kahan_comp" in state:
            start = ref_kahan_start([p], [state["kahan_comp"]])[0]
        else:
            start = state.get("master_param", p).double()
        starts.append(start)
        ms.append(state.get("exp_avg", torch.zeros_like(p, dtype=torch.float64)))
        vs.append(state.get("exp_avg_sq", torch.zeros_like(p, dtype=torch.float64)))
        grads.append(p.grad)
    new_p, new_m, new_v, _ = ref_adam(starts, grads, ms, vs, step_before, lr=ADAM["lr"],
                                      beta1=beta1, beta2=beta2, eps=ADAM["eps"],
                                      weight_decay=ADAM["weight_decay"])
    return starts, new_p, new_m, new_v


# (param dtype, master mode, moment dtype)
ADAM_MODES = [
    pytest.param(torch.float32, "none", torch.bfloat16, id="fp32-params-bf16-moments"),
    pytest.param(torch.bfloat16, "fp32", torch.bfloat16, id="bf16-fp32-master-bf16-moments"),
    pytest.param(torch.bfloat16, "none", torch.float32, id="bf16-params-none"),
    pytest.param(torch.bfloat16, "none", torch.bfloat16, id="bf16-params-none-bf16-moments"),
    pytest.param(torch.bfloat16, "kahan", torch.float32, id="bf16-params-kahan"),
    pytest.param(torch.bfloat16, "kahan", torch.bfloat16, id="bf16-params-kahan-bf16-moments"),
]


@pytest.mark.parametrize("dtype, master, state_dtype", ADAM_MODES)
def test_adam_modes_follow_the_float64_reference(device, dtype, master, state_dtype):
    params = make_params(device, dtype)
    opt = optim.AdamW(params, master=master, state_dtype=state_dtype, **ADAM)
    for step in range(STEPS):
        set_grads(params, step)
        _, new_p, new_m, new_v = adam_ref_step(opt, params, step)
        opt.step()
        for i, p in enumerate(params):
            state, where = opt.state[p], f"step {step} param {i}"
            for key, ref in (("exp_avg", new_m[i]), ("exp_avg_sq", new_v[i])):
                assert state[key].dtype == state_dtype
                if state_dtype == torch.bfloat16:  # the reference rounds the moments
                    assert_within_bf16_ulp(state[key], ref, f"{where} {key}")
                else:
                    torch.testing.assert_close(state[key].double(), ref, **TIGHT)
            if master == "fp32":
                torch.testing.assert_close(state["master_param"].double(), new_p[i], **TIGHT)
                assert_bitwise_equal(p.detach(), state["master_param"].to(dtype))
            elif dtype == torch.float32:
                torch.testing.assert_close(p.double(), new_p[i], **TIGHT, msg=where)
            else:
                assert_within_bf16_ulp(p, new_p[i], f"{where} param")
            if master == "kahan":
                comp = state["kahan_comp"]
                assert comp.dtype == torch.bfloat16 and comp.shape == p.shape
                # p + comp holds the fp32 update to bf16's precision of comp.
                torch.testing.assert_close(p.double() + comp.double(), new_p[i],
                                           rtol=2.0 ** -15, atol=1e-6, msg=where)
                _, ref_comp = ref_lean_update([p], [new_p[i]], [comp])
                if torch.equal(p.double(), round_bf16(new_p[i])):
                    torch.testing.assert_close(comp.double(), ref_comp[0],
                                               rtol=BF16_ULP, atol=1e-6, msg=where)
            else:
                assert "kahan_comp" not in state


# (param dtype, master mode, momentum dtype)
SGD_MODES = [
    pytest.param(torch.float32, "none", torch.bfloat16, id="fp32-params-bf16-momentum"),
    pytest.param(torch.bfloat16, "fp32", torch.bfloat16, id="bf16-fp32-master-bf16-momentum"),
    pytest.param(torch.bfloat16, "none", torch.float32, id="bf16-params-none"),
    pytest.param(torch.bfloat16, "kahan", torch.bfloat16, id="bf16-params-kahan-bf16-momentum"),
]


@pytest.mark.parametrize("dtype, master, state_dtype", SGD_MODES)
def test_sgd_modes_follow_the_float64_reference(device, dtype, master, state_dtype):
    params = make_params(device, dtype)
    opt = optim.SGD(params, master=master, state_dtype=state_dtype, **SGD)
    for step in range(STEPS):
        set_grads(params, step)
        states = [opt.state.get(p, {}) for p in params]
        if master == "kahan" and step > 0:
            starts = ref_kahan_start(params, [s["kahan_comp"] for s in states])
        else:
            starts = [s.get("master_param", p).double() for s, p in zip(states, params)]
        buffers = [s.get("momentum_buffer") for s in states]
        new_p, new_buf = ref_sgd(starts, [p.grad for p in params], buffers,
                                 first_run=step == 0, **SGD)
        opt.step()
        for i, p in enumerate(params):
            state, where = opt.state[p], f"step {step} param {i}"
            buf = state["momentum_buffer"]
            assert buf.dtype == state_dtype
            if state_dtype == torch.bfloat16:
                assert_within_bf16_ulp(buf, new_buf[i], f"{where} momentum_buffer")
            else:
                torch.testing.assert_close(buf.double(), new_buf[i], **TIGHT)
            if master == "fp32":
                torch.testing.assert_close(state["master_param"].double(), new_p[i], **TIGHT)
            elif dtype == torch.float32:
                torch.testing.assert_close(p.double(), new_p[i], **TIGHT, msg=where)
            else:
                assert_within_bf16_ulp(p, new_p[i], f"{where} param")
            if master == "kahan":
                torch.testing.assert_close(p.double() + state["kahan_comp"].double(), new_p[i],
                                           rtol=2.0 ** -15, atol=1e-6, msg=where)


def _quadratic_run(master, steps=500, lr=1e-3):
    """Adam on 0.5 * |p - target|^2 with bf16 params near 1 and a learning rate
    below half a bf16 unit there: the fp32 values each mode's params stand for."""
    target = torch.full((64,), 2.0)
    start = 1.0 + torch.linspace(0, 0.25, 64)
    p = nn.Parameter(start.to(torch.bfloat16))
    opt = optim.Adam([p], lr=lr, betas=(0.9, 0.999), master=master)
    for _ in range(steps):
        p.grad = (p.detach().float() - target).to(torch.bfloat16)
        opt.step()
    state = opt.state[p]
    if master == "fp32":
        return state["master_param"].double()
    if master == "kahan":
        return p.detach().double() + state["kahan_comp"].double()
    return p.detach().double()


def test_kahan_tracks_fp32_masters_where_round_to_nearest_stalls():
    reference = _quadratic_run("fp32")
    moved = (reference - (1.0 + torch.linspace(0, 0.25, 64).double())).abs().min().item()
    assert moved > 0.4  # 500 steps of about lr each: the fp32 masters did move
    none_error = (_quadratic_run("none") - reference).abs().max().item()
    kahan_error = (_quadratic_run("kahan") - reference).abs().max().item()
    assert none_error > 0.3, none_error  # each update is under half a bf16 unit: lost
    assert kahan_error < 2 ** -10, kahan_error  # an eighth of a bf16 unit there
    assert kahan_error < none_error / 100


# (the bf16-state cases' fp32 params are stepped alike with master="fp32", the default,
# and "none")
LEAN = [
    pytest.param(optim.AdamW, dict(ADAM, state_dtype=torch.bfloat16), torch.float32,
                 id="adam-bf16-moments"),
    pytest.param(optim.AdamW, dict(ADAM, master="kahan"), torch.bfloat16, id="adam-kahan"),
    pytest.param(optim.AdamW, dict(ADAM, master="kahan", state_dtype=torch.bfloat16),
                 torch.bfloat16, id="adam-kahan-bf16-moments"),
    pytest.param(optim.AdamW, dict(ADAM, master="none"), torch.bfloat16, id="adam-none"),
    pytest.param(optim.SGD, dict(SGD, state_dtype=torch.bfloat16), torch.float32,
                 id="sgd-bf16-momentum"),
    pytest.param(optim.SGD, dict(SGD, master="kahan", state_dtype=torch.bfloat16),
                 torch.bfloat16, id="sgd-kahan-bf16-momentum"),
]


class _Model(nn.Module):
    def __init__(self, device, dtype):
        super().__init__()
        self.ps = nn.ParameterList(make_params(device, dtype))


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        set_grads(list(model.parameters()), step)
        opt.step()


@pytest.mark.parametrize("cls, kwargs, dtype", LEAN)
def test_found_inf_skips_lean_steps_bit_for_bit(device, cls, kwargs, dtype):
    model = _Model(device, dtype)
    opt = cls(model.parameters(), **kwargs)
    _train(model, opt, 3)
    set_grads(list(model.parameters()), 3)
    opt.grad_scale = torch.full((), 64.0, device=device)
    opt.found_inf = torch.full((), 1.0, device=device)
    before = full_snapshot(model, opt)
    opt.step()
    assert_same_snapshot(full_snapshot(model, opt), before, "after a skipped step")
    opt.found_inf = torch.full((), 0.0, device=device)
    opt.step()
    assert not torch.equal(next(model.parameters()), before["param0"])


@pytest.mark.parametrize("cls, kwargs, dtype", LEAN)
def test_lean_state_dict_round_trip_resumes_bit_for_bit(device, cls, kwargs, dtype):
    model = _Model(device, dtype)
    opt = cls(model.parameters(), **kwargs)
    _train(model, opt, 4)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed_model = copy.deepcopy(model)
    resumed = cls(resumed_model.parameters(), **kwargs)
    resumed.load_state_dict(loaded)
    for p, rp in zip(model.parameters(), resumed_model.parameters()):
        assert sorted(resumed.state[rp]) == sorted(opt.state[p])
        for key, value in opt.state[p].items():
            assert_bitwise_equal(resumed.state[rp][key], value, msg=key)  # dtypes kept
    _train(model, opt, 3, first=4)
    _train(resumed_model, resumed, 3, first=4)
    assert_same_snapshot(full_snapshot(resumed_model, resumed), full_snapshot(model, opt))


def test_load_state_dict_checks_the_lean_dtypes():
    params = make_params("cpu", torch.bfloat16)
    lean = optim.AdamW(params, master="kahan", state_dtype=torch.bfloat16, **ADAM)
    set_grads(params, 0)
    lean.step()
    saved = lean.state_dict()
    plain = optim.AdamW(make_params("cpu", torch.bfloat16), master="none", **ADAM)  # fp32 moments
    with pytest.raises(ValueError, match="'kahan_comp'.* Kahan compensation, which "
                       "master='none' cannot keep exactly"):
        plain.load_state_dict(saved)  # (its bf16 moments would load, widened)
    assert not plain.state  # nothing loaded
    no_comps = copy.deepcopy(saved)
    for state in no_comps["state"].values():
        del state["kahan_comp"]
    plain.load_state_dict(no_comps)
    for i, p in enumerate(plain.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert plain.state[p][key].dtype == torch.float32
            assert torch.equal(plain.state[p][key], no_comps["state"][i][key].float())
    narrow = optim.AdamW(make_params("cpu", torch.bfloat16), master="none",
                         state_dtype=torch.bfloat16, **ADAM)
    with pytest.raises(ValueError, match=r"'exp_avg'.*float32.*expected torch.bfloat16.*load it "
                       r"with state_dtype=torch.float32"):
        narrow.load_state_dict(plain.state_dict())
    assert not narrow.state
    bad_comp = copy.deepcopy(saved)
    bad_comp["state"][0]["kahan_comp"] = bad_comp["state"][0]["kahan_comp"].float()
    fresh = optim.AdamW(make_params("cpu", torch.bfloat16), master="kahan",
                        state_dtype=torch.bfloat16, **ADAM)
    with pytest.raises(ValueError, match="kahan_comp.*float32, expected torch.bfloat16"):
        fresh.load_state_dict(bad_comp)
    fresh.load_state_dict(saved)
    assert fresh.state[fresh.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.bfloat16


# --- arguments --------------------------------------------------------------------------

def _mixed_params(device):
    """bf16 weights with fp32 ones between them (norms kept in fp32, as amp O2 keeps
    batchnorm): positions 0 and 2 bf16, 1 and 3 fp32."""
    bf16, fp32 = make_params(device, torch.bfloat16), make_params(device, torch.float32, 7)
    return [bf16[0], fp32[0], bf16[1], fp32[1]]


@pytest.mark.parametrize("cls, kwargs", [(optim.AdamW, ADAM), (optim.SGD, SGD)])
@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_fp32_params_beside_bf16_ones_are_updated_directly(device, cls, kwargs, master):
    """master='kahan'/'stochastic' on a group that mixes bf16 and fp32 params: the fp32
    ones step exactly as master='none' steps them alone, the bf16 ones exactly as when
    the fp32 ones have no gradient (one step count per optimizer step, the same salts),
    on the full path and on the reused op calls of later steps; a skipped step changes
    nothing."""
    mixed = _mixed_params(device)
    opt = cls(mixed, master=master, seed=5 if master == "stochastic" else None, **kwargs)
    lean = [p.detach().clone().requires_grad_() for p in mixed]
    lean_opt = cls(lean, master=master, seed=5 if master == "stochastic" else None, **kwargs)
    plain = [p.detach().clone().requires_grad_() for p in mixed[1::2]]
    plain_opt = cls(plain, master="none", **kwargs)
    for step in range(4):
        set_grads(mixed, step)
        for a, b in zip(lean, mixed):
            a.grad = b.grad.clone() if b.dtype == torch.bfloat16 else None
        for a, b in zip(plain, mixed[1::2]):
            a.grad = b.grad.clone()
        if step == 2:  # an overflowed step, skipped on the device
            for o in (opt, lean_opt, plain_opt):
                o.grad_scale = torch.full((), 8.0, device=device)
                o.found_inf = torch.full((), 1.0, device=device)
        before = full_snapshot(nn.ParameterList(mixed), opt)
        for o in (opt, lean_opt, plain_opt):
            o.step()
        if step == 2:
            assert_same_snapshot(full_snapshot(nn.ParameterList(mixed), opt), before,
                                 "after a skipped step")
            for o in (opt, lean_opt, plain_opt):
                del o.grad_scale, o.found_inf
        for p, q in zip(mixed[0::2], lean[0::2]):
            assert_bitwise_equal(p, q, msg=f"bf16 param after step {step}")
            if master == "kahan":
                assert_bitwise_equal(opt.state[p]["kahan_comp"], lean_opt.state[q]["kahan_comp"])
        for p, q in zip(mixed[1::2], plain):
            assert_bitwise_equal(p, q, msg=f"fp32 param after step {step}")
            assert "kahan_comp" not in opt.state[p]
    # one count per step, the skip not counted: AdamW's per parameter, SGD's (stochastic
    # rounding only) per group
    if cls is optim.AdamW:
        assert [opt.state[p]["step"].item() for p in mixed] == [3] * 4  # sync-ok: a test
    elif master == "stochastic":
        assert opt.param_groups[0]["step"].item() == 3  # sync-ok: a test
    assert len(opt.plans.plans) == 1  # the later steps reused the op calls


def test_kahan_rejects_a_model_cast_later_before_any_write():
    model = _Model("cpu", torch.bfloat16)
    opt = optim.AdamW(model.parameters(), master="kahan", **ADAM)
    _train(model, opt, 2)
    set_grads(list(model.parameters()), 2)
    late = model.ps[1]
    late.data = late.data.half()  # what model.half() does to a parameter
    late.grad = late.grad.half()
    before = full_snapshot(model, opt)
    with pytest.raises(TypeError, match="master='kahan'.*float16"):
        opt.step()
    assert_same_snapshot(full_snapshot(model, opt), before)


@pytest.mark.parametrize("master", ["kahan", "remainder"])
def test_a_parameter_zeroed_between_steps_stays_zero(device, master):
    """A pruning mask applied under no_grad between steps (planned ones around it): the
    zeroed elements are their masters' values, 0, at a step of lr 0; a compensation or
    remainder kept from before would have made them small values, or NaN."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(256, generator=gen).to(device, torch.bfloat16))
    opt = optim.AdamW([p], lr=1e-2, master=master)
    for _ in range(3):
        p.grad = torch.randn(256, generator=gen).to(device, torch.bfloat16)
        opt.step()
    with torch.no_grad():
        p.mul_((torch.arange(256, device=device) % 2).to(torch.bfloat16))
    opt.param_groups[0].update(lr=0.0, weight_decay=0.0)
    p.grad = torch.randn(256, generator=gen).to(device, torch.bfloat16)
    opt.step()
    assert torch.equal(p.detach()[::2].float().cpu(), torch.zeros(128))
