"""master="remainder" (issue #20, part 1): each bf16 parameter keeps an int16 remainder,
the low half of its fp32 master's bits, so that (param, remainder) is the fp32 master bit
for bit. Checked against the fp32-master mode step for step (the same gradients fed to
both), through skipped steps, state_dict round trips and conversions both ways; the split
rule (ties away from zero) against a reference written from the rounding's definition."""

import copy
import io

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    assert_unchanged,
    eager_and_compiled_steps,
    forbid_host_sync,
    make_model,
    randn,
    scalar,
    snapshot,
)
from torch import nn

import mixedprec
from mixedprec import FusedAdam, FusedSGD, masters, ops
from mixedprec.optim import SGD, Adam, AdamW

BF16 = torch.bfloat16
# Sizes past the CPU engine's vector widths, with tails, and a matrix large enough that
# exact ties (a low half of 0x8000: one in 2^16 values) occur in a 500-step run.
SHAPES = [(37,), (5, 7), (64, 64)]
STEPS = 500


# --- the split rule, against its definition ----------------------------------------------

def ref_bits(master):
    """bits(master) as int64 in [0, 2^32)."""
    return master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def ref_join(param, remainder):
    """The fp32 value of bits (bits(param) << 16) + remainder (mod 2^32)."""
    high = (param.view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    bits = (high + remainder.to(torch.int64)) % 2**32
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def ref_tie_round(master):
    """master rounded to bf16 to nearest, exact ties (low half 0x8000) away from zero:
    round to nearest even, then one unit further from zero where that kept an even
    high half at a tie."""
    rne = master.to(BF16)
    bits = ref_bits(master)
    tie = (bits & 0xFFFF) == 0x8000
    high = bits >> 16
    away = ((high + 1) & 0xFFFF)
    away = torch.where(away >= 2**15, away - 2**16, away).to(torch.int16).view(BF16)
    return torch.where(tie & (high % 2 == 0) & ~master.isnan(), away, rne)


def check_split(master, param, remainder, msg=""):
    """(param, remainder) is the split of master: joins back to it bit for bit (NaN to a
    NaN), and param is master rounded by the tie rule."""
    nan = master.isnan()
    joined = ref_join(param, remainder)
    assert torch.equal(ref_bits(joined)[~nan], ref_bits(master)[~nan]), f"{msg}: not exact"
    assert joined[nan].isnan().all() and (remainder[nan] == 0).all(), f"{msg}: NaN"
    assert_bitwise_equal(param[~nan], ref_tie_round(master)[~nan], msg)
    assert param[nan].isnan().all()


def special_masters():
    """Every remainder under a few high halves (zeros, +-1, the smallest subnormal,
    the largest finite, inf: NaNs past it), and the edge values themselves."""
    highs = torch.tensor([0x0000, 0x8000, 0x3F80, 0xBF80, 0x0001, 0x8001, 0x7F7F, 0xFF7F,
                          0x7F80, 0xFF80], dtype=torch.int64)
    rems = torch.arange(-2**15, 2**15, dtype=torch.int64)
    bits = ((highs[:, None] << 16) + rems[None, :]) % 2**32
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                          3.4028234663852886e38, -3.4028234663852886e38, 1.0, -1.0])
    return torch.cat([bits.view(torch.float32).reshape(-1), edges])


def random_masters(n, seed):
    """n fp32 values from uniformly random bit patterns, and their ties."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64)
    ties = (bits & ~0xFFFF) | 0x8000
    both = torch.cat([bits, ties])
    return torch.where(both >= 2**31, both - 2**32, both).to(torch.int32).view(torch.float32)


def test_split_remainder_is_exact_with_ties_away_from_zero():
    for master in (special_masters(), random_masters(1 << 18, seed=0)):
        param, remainder = masters.split_remainder(master)
        assert param.dtype == BF16 and remainder.dtype == torch.int16
        check_split(master, param, remainder)
        joined = masters.join_remainder(param, remainder)
        ok = ~master.isnan()
        assert torch.equal(ref_bits(joined)[ok], ref_bits(master)[ok])
    # The edges, spelled out: signed zeros and infinities keep their sign and a zero
    # remainder; the largest finite value splits into inf and -1.
    for value, high, rem in ((0.0, 0x0000, 0), (-0.0, -0x8000, 0), (float("inf"), 0x7F80, 0),
                             (-float("inf"), -0x0080, 0), (3.4028234663852886e38, 0x7F80, -1),
                             (1.0 + 2**-8, 0x3F81, -0x8000), (1.0 + 3 * 2**-8, 0x3F82, -0x8000)):
        param, remainder = masters.split_remainder(torch.tensor([value]))
        assert param.view(torch.int16).item() == high and remainder.item() == rem, value
    # An even high half at a tie: one unit up in magnitude, where bf16() keeps it.
    tie = torch.tensor([1.0 + 2**-8, -(1.0 + 2**-8)])
    param, _ = masters.split_remainder(tie)
    assert (param.abs().float() == 1.0 + 2**-7).all() and (tie.to(BF16).abs() == 1.0).all()


def test_the_kernels_split_as_the_rule(device):
    """fused_sgd_ with lr 1 from zero params and remainders and gradient -master: the new
    master is `master` (0 - 1 * -master), split by the op's CPU vector and scalar paths or
    its CUDA kernels."""
    for master in (special_masters(), random_masters(1 << 16, seed=1)):
        master = master[master != 0]  # (0 + -0 would be +0)
        master = master.to(device)
        params = [torch.zeros(master.shape, dtype=BF16, device=device)]
        rems = [torch.zeros(master.shape, dtype=torch.int16, device=device)]
        ops.fused_sgd_(params, [-master], [], [], lr=1.0, remainders=rems)
        check_split(master.cpu(), params[0].cpu(), rems[0].cpu())
        # Joined by the op: a zero update keeps both halves, bit for bit.
        before = [params[0].clone(), rems[0].clone()]
        ops.fused_sgd_(params, [torch.zeros_like(master)], [], [], lr=1.0, remainders=rems)
        assert_bitwise_equal(params[0], before[0])
        assert_bitwise_equal(rems[0], before[1])


# --- 500 steps against the fp32-master mode ----------------------------------------------

CONFIGS = [
    pytest.param(Adam, dict(lr=1e-3, weight_decay=1e-2), id="adam"),
    pytest.param(AdamW, dict(lr=1e-3), id="adamw"),
    pytest.param(Adam, dict(lr=1e-3, amsgrad=True, maximize=True), id="adam-amsgrad-maximize"),
    pytest.param(AdamW, dict(lr=1e-3, state_dtype=BF16), id="adamw-bf16-state"),
    pytest.param(SGD, dict(lr=0.02, momentum=0.9, dampening=0.1, weight_decay=1e-2),
                 id="sgd-momentum-wd"),
    pytest.param(SGD, dict(lr=0.02, momentum=0.9, nesterov=True, maximize=True,
                           weight_decay=1e-3), id="sgd-nesterov-maximize"),
]


def make_params(device, seed=0):
    return [nn.Parameter(randn(s, torch.float32, "cpu", seed=seed + i).to(BF16).to(device))
            for i, s in enumerate(SHAPES)]


def fixed_grads(params, step, scale=1.0):
    """The gradients of `step` (bf16, from a fixed sequence); every 37th step one holds
    an inf and every 53rd a NaN (those steps are skipped under a scaler)."""
    grads = [(randn(p.shape, torch.float32, p.device, seed=10_000 + 7 * step + i) * scale)
             .to(p.dtype) for i, p in enumerate(params)]
    if step % 37 == 5:
        grads[0].view(-1)[step % grads[0].numel()] = float("inf")
    if step % 53 == 7:
        grads[-1].view(-1)[step % grads[-1].numel()] = float("nan")
    return grads


class Pair:
    """The same parameters under master="fp32" and master="remainder", fed the same
    gradients, compared after every step."""

    def __init__(self, params32, params_r, make):
        self.p32, self.pr = params32, params_r
        self.opt32 = make(self.p32, "fp32")
        self.optr = make(self.pr, "remainder")
        self.ties = self.tie_moves = 0

    def feed(self, grads):
        for p, q, g in zip(self.p32, self.pr, grads):
            p.grad, q.grad = g.clone(), g.clone()

    def master32(self, p):
        return self.opt32.state[p]["master_param"] if p.dtype == BF16 else p.detach()

    def check(self, msg):
        for i, (p, q) in enumerate(zip(self.p32, self.pr)):
            master = self.master32(p)
            if q.dtype != BF16:  # (an fp32 param: updated directly in both modes)
                assert_bitwise_equal(q, p, f"{msg}, fp32 param {i}")
                continue
            rem = self.optr.state[q]["remainder"]
            assert rem.dtype == torch.int16 and rem.shape == q.shape
            assert_bitwise_equal(ref_join(q.detach().cpu(), rem.cpu()), master.cpu(),
                                 f"{msg}, master {i}")
            assert_bitwise_equal(q.detach().cpu(), ref_tie_round(master.cpu()),
                                 f"{msg}, param {i}")
            # The fp32 mode's param is bf16(master): it differs only at exact ties.
            bits = ref_bits(master.cpu())
            tie = (bits & 0xFFFF) == 0x8000
            differs = q.detach().cpu().view(torch.int16) != p.detach().cpu().view(torch.int16)
            assert torch.equal(differs, tie & ((bits >> 16) % 2 == 0)), f"{msg}, param {i}"
            self.ties += int(tie.sum())
            self.tie_moves += int(differs.sum())


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_remainder_is_the_fp32_master_bit_for_bit(device, cls, kwargs):
    """500 steps of plain bf16 training: after every step, (param, remainder) is the
    fp32-master mode's master bit for bit, and param its tie-rule rounding."""
    pair = Pair(make_params(device), make_params(device),
                lambda ps, master: cls(ps, master=master, **kwargs))
    for step in range(STEPS):
        grads = [g.nan_to_num(0.0, 0.0, 0.0) for g in fixed_grads(pair.pr, step)]
        pair.feed(grads)
        pair.opt32.step()
        pair.optr.step()
        pair.check(f"step {step}")
    assert pair.ties > 0  # (about 33 expected: 4168 elements x 500 steps / 2^16)
    print(f"{cls.__name__} {kwargs}: {pair.ties} exact ties, {pair.tie_moves} params "
          "one unit off bf16(master)")


@pytest.mark.parametrize("cls, kwargs", [CONFIGS[1], CONFIGS[4]])
def test_parameters_written_between_steps_keep_the_bit_identity(device, cls, kwargs):
    """Writes to the parameters between steps, under no_grad: half of each zeroed (a
    pruning mask), then the same values written again (a model's load_state_dict after
    the optimizer's, on resume). The remainders follow as the fp32 masters do: zeroed
    where the parameter was (a stale negative remainder joined to a zeroed bf16 made a
    NaN), kept where the values are the same; (param, remainder) stays the fp32 master
    bit for bit through the planned steps around them."""
    pair = Pair(make_params(device), make_params(device),
                lambda ps, master: cls(ps, master=master, **kwargs))
    for step in range(12):
        with torch.no_grad():
            for p in pair.p32 + pair.pr:
                if step == 4 and p.dtype == BF16:
                    mask = torch.arange(p.numel(), device=p.device).reshape(p.shape) % 2
                    p.mul_(mask.to(p.dtype))
                elif step == 8:
                    p.copy_(p.detach().clone())
        grads = [g.nan_to_num(0.0, 0.0, 0.0) for g in fixed_grads(pair.pr, step)]
        pair.feed(grads)
        pair.opt32.step()
        pair.optr.step()
        assert not any(q.isnan().any() for q in pair.pr), f"step {step}"
        pair.check(f"step {step}")


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_remainder_through_a_grad_scaler_with_overflows(device, cls, kwargs):
    """A scaled run (fp16-style: the loss scale backs off on the injected infs and NaNs
    and grows every 25 clean steps): skipped steps leave both modes as they were, and
    every step keeps the bit identity."""
    pair = Pair(make_params(device, seed=3), make_params(device, seed=3),
                lambda ps, master: cls(ps, master=master, **kwargs))
    scaler = mixedprec.GradScaler(device, init_scale=2.0**8, growth_interval=25)
    skipped = 0
    for step in range(STEPS):
        scale = scaler.scale(torch.ones((), device=device)).item()  # (a test: may sync)
        pair.feed(fixed_grads(pair.pr, step, scale=scale))
        before = snapshot([pair.pr, pair.optr.state_dict()["state"]])
        scaler.step(pair.opt32)
        scaler.step(pair.optr)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped += 1
            assert_unchanged([pair.pr, pair.optr.state_dict()["state"]], before)
        pair.check(f"step {step}")
    assert skipped == len([s for s in range(STEPS) if s % 37 == 5 or s % 53 == 7])


def test_remainder_on_a_real_model_with_fp32_layers(device):
    """A small model (fc1 bf16, fc2 fp32), gradients from its fp32-master twin's
    forward and backward, fed to both: bf16 params keep the bit identity, fp32 ones are
    updated directly in both modes."""
    model32 = make_model(device, BF16, fc2_dtype=torch.float32)
    model_r = copy.deepcopy(model32)
    pair = Pair(list(model32.parameters()), list(model_r.parameters()),
                lambda ps, master: AdamW(ps, lr=3e-3, master=master))
    for step in range(STEPS):
        x = randn((16, 6), torch.float32, device, seed=step)
        model32.zero_grad()
        model32(x).square().mean().backward()
        pair.feed([p.grad for p in model32.parameters()])
        pair.opt32.step()
        pair.optr.step()
        pair.check(f"step {step}")


def test_a_remainder_step_does_not_sync(device, monkeypatch):
    params = make_params(device)
    opt = AdamW(params, lr=1e-3, master="remainder")
    for step in range(3):
        for p, g in zip(params, fixed_grads(params, step + 100)):
            p.grad = g
        with forbid_host_sync(monkeypatch):
            opt.step()


@pytest.mark.parametrize("cls, kwargs", [(AdamW, dict(lr=0.01)),
                                         (SGD, dict(lr=0.01, momentum=0.9))])
def test_a_remainder_step_compiles_in_one_graph(cls, kwargs):
    results = eager_and_compiled_steps(lambda ps: cls(ps, master="remainder", **kwargs))
    for a, b in zip(*results):
        assert_bitwise_equal(b, a)


# --- state: round trips, conversions, bytes ---------------------------------------------

def _save_load(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _run(params, opt, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, fixed_grads(params, step)):
            p.grad = g.nan_to_num(0.0, 0.0, 0.0)
        opt.step()


@pytest.mark.parametrize("cls, kwargs", [(AdamW, dict(lr=1e-3, amsgrad=True)),
                                         (SGD, dict(lr=0.02, momentum=0.9))])
def test_state_dict_round_trip_keeps_the_bit_identity(device, cls, kwargs):
    params = make_params(device)
    opt = cls(params, master="remainder", **kwargs)
    _run(params, opt, 20)
    loaded = _save_load(opt.state_dict())
    # Into a fresh optimizer over a fresh copy of the params (a resumed run).
    fresh = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = cls(fresh, master="remainder", **kwargs)
    resumed.load_state_dict(loaded)
    for p, q in zip(params, fresh):
        assert_bitwise_equal(resumed.state[q]["remainder"], opt.state[p]["remainder"])
    _run(params, opt, 20, first=20)
    _run(fresh, resumed, 20, first=20)
    for p, q in zip(params, fresh):
        assert_bitwise_equal(q, p)
        for key, value in opt.state[p].items():
            assert_bitwise_equal(resumed.state[q][key], value, key)


@pytest.mark.parametrize("cls, kwargs", [(Adam, dict(lr=1e-3)),
                                         (SGD, dict(lr=0.02, momentum=0.9, nesterov=True))])
def test_conversion_both_ways_is_exact(device, cls, kwargs):
    """fp32 masters -> remainders -> fp32 masters mid-run: every run continues as the
    fp32-master run, bit for bit."""
    params32 = make_params(device)
    opt32 = cls(params32, master="fp32", **kwargs)
    _run(params32, opt32, 30)
    # To remainders: a remainder-mode optimizer over a copy of the params.
    params_r = [nn.Parameter(p.detach().clone()) for p in params32]
    converted = masters.masters_to_remainders(_save_load(opt32.state_dict()), params_r)
    opt_r = cls(params_r, master="remainder", **kwargs)
    opt_r.load_state_dict(converted)
    for p, q in zip(params32, params_r):
        master = opt32.state[p]["master_param"]
        assert "master_param" not in opt_r.state[q]
        assert_bitwise_equal(ref_join(q.detach().cpu(), opt_r.state[q]["remainder"].cpu()),
                             master.cpu())
        assert_bitwise_equal(q.detach().cpu(), ref_tie_round(master.cpu()))
    _run(params32, opt32, 30, first=30)
    _run(params_r, opt_r, 30, first=30)
    pair = Pair(params32, params_r, lambda ps, master: None)
    pair.opt32, pair.optr = opt32, opt_r
    pair.check("after the conversion to remainders")
    # And back: the params receive bf16(master), as the fp32 mode's.
    params_back = [nn.Parameter(p.detach().clone()) for p in params_r]
    back = masters.remainders_to_masters(_save_load(opt_r.state_dict()), params_back)
    opt_back = cls(params_back, master="fp32", **kwargs)
    opt_back.load_state_dict(back)
    for p, q in zip(params32, params_back):
        assert_bitwise_equal(q, p)
        assert_bitwise_equal(opt_back.state[q]["master_param"], opt32.state[p]["master_param"])
    _run(params32, opt32, 10, first=60)
    _run(params_back, opt_back, 10, first=60)
    for p, q in zip(params32, params_back):
        assert_bitwise_equal(q, p)
        for key, value in opt32.state[p].items():
            assert_bitwise_equal(opt_back.state[q][key], value, key)


def test_conversion_checks_before_writing():
    params = [nn.Parameter(torch.ones(4, dtype=torch.float16))]
    opt = Adam(params, lr=1e-3)
    params[0].grad = torch.ones(4, dtype=torch.float16)
    opt.step()
    before = snapshot(params)
    with pytest.raises(TypeError, match="master='remainder' keeps bfloat16"):
        masters.masters_to_remainders(opt.state_dict(), params)
    with pytest.raises(ValueError, match="expected params to be the optimizer's 1"):
        masters.masters_to_remainders(opt.state_dict(), params * 2)
    assert_unchanged(params, before)


def test_leaving_remainder_keeps_the_master():
    """configure(master="fp32") (fp32 masters) or a model cast to fp32 takes the whole
    master the pair held, not the bf16 param alone (a zero-gradient SGD step keeps it as
    it is)."""
    for leave in ("master_weights", "float"):
        params = make_params("cpu")
        opt = SGD(params, lr=0.02, master="remainder")
        _run(params, opt, 10)
        wanted = [ref_join(p.detach(), opt.state[p]["remainder"]) for p in params]
        assert any(not torch.equal(w, p.detach().float()) for w, p in zip(wanted, params))
        if leave == "master_weights":
            opt.configure(master="fp32")
        else:
            for p in params:
                p.data = p.data.float()
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, want in zip(params, wanted):
            assert "remainder" not in opt.state[p]
            if leave == "master_weights":
                assert_bitwise_equal(opt.state[p]["master_param"], want)
                assert_bitwise_equal(p.detach(), want.to(BF16))
            else:
                assert_bitwise_equal(p.detach(), want)


def test_adam_with_bf16_state_keeps_8_bytes_per_param(device):
    params = make_params(device)
    opt = Adam(params, lr=1e-3, master="remainder", state_dtype=BF16)
    _run(params, opt, 2)
    numel = sum(p.numel() for p in params)
    stored = sum(p.numel() * p.element_size() for p in params) + sum(
        t.numel() * t.element_size() for p in params for key, t in opt.state[p].items()
        if key != "step")
    assert sorted(opt.state[params[0]]) == ["exp_avg", "exp_avg_sq", "remainder", "step"]
    assert stored == 8 * numel  # 2 (param) + 2 (remainder) + 2 + 2 (moments)


# --- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [Adam, SGD, FusedAdam, FusedSGD])
def test_fp16_params_are_refused_naming_master(cls):
    fp16 = nn.Parameter(torch.ones(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="master='remainder' keeps exact fp32 masters in "
                                        "bfloat16 parameters.*torch.float16"):
        cls([fp16], lr=1e-3, master="remainder")
    bf16 = nn.Parameter(torch.ones(3, dtype=BF16))
    opt = cls([bf16], lr=1e-3, master="remainder")
    with pytest.raises(TypeError, match="master='remainder'"):
        opt.add_param_group({"params": [fp16]})
    bf16.grad = torch.ones_like(bf16)
    opt.step()
    before = snapshot([bf16, opt.state[bf16]])
    bf16.data = bf16.data.half()  # cast after construction: refused at the step
    bf16.grad = torch.ones_like(bf16)
    with pytest.raises(TypeError, match="master='remainder'"):
        opt.step()
    bf16.data = bf16.data.to(BF16)
    assert_unchanged([bf16, opt.state[bf16]], before)


def test_bad_combinations_name_both_arguments():
    p = nn.Parameter(torch.ones(3, dtype=BF16))
    with pytest.raises(ValueError, match="master_weights=True conflicts with "
                                         "master='remainder'"):
        FusedAdam([p], master_weights=True, master="remainder")
    with pytest.raises(ValueError, match="seed is for master='stochastic' or "
                                         r"state_dtype=torch.float8_e4m3fn, got "
                                         "master='remainder' and state_dtype=torch.float32"):
        Adam([p], master="remainder", seed=3)
    opt = Adam([p], lr=1e-3, master="remainder")
    p.grad = torch.ones_like(p)
    opt.step()
    kahan = Adam([p], lr=1e-3, master="kahan")
    with pytest.raises(ValueError, match=r"'remainder'\] is a remainder .*which "
                                         "master='kahan' cannot keep exactly; load it into "
                                         r"an optimizer with master in \['fp32', 'remainder'\]"):
        kahan.load_state_dict(opt.state_dict())
    assert kahan.state == {}


def test_the_op_refuses_bad_remainders_before_writing(device):
    params = [randn((5,), BF16, device, seed=0)]
    grads = [randn((5,), BF16, device, seed=1)]
    rems = [torch.zeros(5, dtype=torch.int16, device=device)]
    cases = [
        (dict(remainders=[torch.zeros(5, dtype=BF16, device=device)]), TypeError,
         r"remainders\[0\].*Int16"),
        (dict(remainders=[torch.zeros(4, dtype=torch.int16, device=device)]), ValueError,
         "remainders"),
        (dict(remainders=rems, kahan_comps=[torch.zeros_like(params[0])]), ValueError,
         "remainders .*expected no model_params, no kahan_comps and no sr_seed"),
        (dict(remainders=rems, sr_salts=ops.rounding_words([(0,)], device), sr_seed=1,
              step=scalar(1.0, device)), ValueError, "sr_seed"),
    ]
    for kwargs, error, match in cases:
        before = snapshot([params, grads, kwargs])
        with pytest.raises(error, match=match):
            ops.fused_sgd_(params, grads, [], [], lr=0.1, **kwargs)
        assert_unchanged([params, grads, kwargs], before)
    fp32 = [randn((5,), torch.float32, device, seed=2)]
    with pytest.raises(TypeError, match=r"remainders expected bfloat16 params.*params\[0\]"):
        ops.fused_adam_(fp32, grads, [torch.zeros(5, device=device)],
                        [torch.zeros(5, device=device)], [], step=scalar(0.0, device), lr=1e-3,
                        remainders=rems)
    with pytest.raises(ValueError, match="no model_params"):
        ops.fused_adam_([p.float() for p in params], grads, [torch.zeros(5, device=device)],
                        [torch.zeros(5, device=device)], params, step=scalar(0.0, device),
                        lr=1e-3, remainders=rems)
