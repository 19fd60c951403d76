"""master="stochastic" of FusedAdam and FusedSGD (issue #11, part 2a): bf16 params
without masters, the fp32 result rounded to bf16 stochastically with Philox4x32-10 bits
keyed by (seed, step) and counted by (the element's index in the full tensor, the
param's position in its group). The bits and rounding decisions against a Python
reference of Philox, a float64 reference of a step, unbiasedness over many draws,
thread counts, skipped steps, pieces of a tensor at their offsets, and bit-for-bit
resume from a weights_only state_dict."""

import copy
import io

import pytest
import torch
from helpers import assert_bitwise_equal, randn
from references import philox4x32_10, ref_adam, ref_round_bf16_stochastic, ref_rounding_bits
from torch import nn

from mixedprec import FusedAdam, FusedSGD, ops

# Past the CPU engine's vector widths (8, 16) with tails, and the CUDA block's 4-wide
# accesses; kept small, as the Python Philox is slow.
SHAPES = [(37,), (5, 7), (300,)]
ADAM = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 1e-2}
SGD = {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}


def make_params(device, seed=0):
    return [nn.Parameter(randn(shape, torch.float32, "cpu", seed=seed + i)
                         .bfloat16().to(device)) for i, shape in enumerate(SHAPES)]


def set_grads(params, step):
    for i, p in enumerate(params):
        p.grad = randn(p.shape, p.dtype, p.device, seed=1000 + 31 * step + i, scale=0.5)


def test_philox_reference_gives_the_known_answers():
    """The published known-answer vectors of Philox4x32-10 (Random123's kat_vectors):
    the Python reference, and through it the C++ one, is Philox itself."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
              (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        assert philox4x32_10(counter, key) == expected


def sgd_plain_step(device, seed, salts, step, lr=0.05):
    """One fused_sgd_ step (no momentum, no decay) with stochastic rounding; returns the
    params before and after, their grads, and lr."""
    params = [randn(s, torch.float32, device, seed=i).bfloat16() for i, s in enumerate(SHAPES)]
    grads = [randn(s, torch.float32, device, seed=50 + i) for i, s in enumerate(SHAPES)]
    before = [p.clone() for p in params]
    salt_tensors = ops.rounding_words([(s,) for s in salts], device)
    ops.fused_sgd_(params, grads, [], [], lr=lr, sr_salts=salt_tensors, sr_seed=seed,
                   step=torch.full((1,), float(step), device=device))
    return before, params, grads


@pytest.mark.parametrize("seed", [0, 12345, 2**63 - 1])
def test_sgd_rounds_as_the_reference_bit_for_bit(device, seed):
    """p - lr * g is formed in fp32 exactly as the op does (two roundings, no FMA), so
    every element must equal the reference's stochastic rounding of it, bit for bit;
    the salts and the step enter the counter."""
    salts, step, lr = [3, 0, 7], 5, 0.05
    before, after, grads = sgd_plain_step(device, seed, salts, step, lr)
    lr32 = torch.tensor(lr, dtype=torch.float32)
    for i, (p, new, g) in enumerate(zip(before, after, grads)):
        exact = p.float().cpu() - lr32 * g.cpu()
        bits = ref_rounding_bits(seed, salts[i], step, p.numel()).reshape(p.shape)
        expected = ref_round_bf16_stochastic(exact, bits)
        assert_bitwise_equal(new.cpu(), expected.bfloat16(), f"param {i}")
        nearest = exact.bfloat16()
        assert not torch.equal(new.cpu(), nearest), "some element must round the other way"


def test_the_bits_follow_seed_step_and_salt():
    base = sgd_plain_step("cpu", 1, [0, 1, 2], 1)[1]
    for seed, salts, step in ((2, [0, 1, 2], 1), (1, [0, 1, 2], 2), (1, [5, 1, 2], 1)):
        other = sgd_plain_step("cpu", seed, salts, step)[1]
        assert not torch.equal(other[0], base[0]), (seed, salts, step)


def test_non_finite_values_keep_their_class():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0, -1.5])
    # the largest finite fp32 value: beyond bf16's, it rounds to bf16's largest or inf
    bits = torch.tensor([0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF, 0])
    out = ref_round_bf16_stochastic(x, bits)
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()
    assert out[3] == 1.0 and out[4] == -1.5  # exact bf16 values never move
    # the op: a NaN whose payload lies in the low 16 bits stays NaN, inf stays inf
    nan_low = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    params = [torch.zeros(3, dtype=torch.bfloat16)]
    grads = [torch.cat([nan_low, torch.tensor([float("inf"), 1e-30])])]
    ops.fused_sgd_(params, grads, [], [], lr=1.0, sr_salts=ops.rounding_words([(0,)]), sr_seed=3,
                   step=torch.ones(1))
    assert params[0][0].isnan() and params[0][1] == -float("inf")
    assert params[0][2].abs() < 1e-29  # finite stays finite


def adam_state_copy(opt, params):
    return [dict(opt.state.get(p, {})) for p in params]


def test_adam_step_follows_the_float64_reference(device):
    """One FusedAdam step: the float64 reference's new value, rounded to fp32, then
    stochastically with the reference's Philox bits. The op's fp32 math differs from
    float64 by a few fp32 units, so a rounding decision is compared exactly where the
    reference's value is not within 64 fp32 units of the decision's threshold (most
    elements; the others must still be one of the two bf16 neighbours)."""
    params = make_params(device)
    opt = FusedAdam(params, master="stochastic", seed=99, **ADAM)
    seed = opt.param_groups[0]["seed"]
    assert seed == 99  # group 0: the seed itself
    for step in (1, 2):
        set_grads(params, step)
        states = adam_state_copy(opt, params)
        starts = [p.double().cpu() for p in params]
        ms = [s.get("exp_avg", torch.zeros(p.shape)).double().cpu() for s, p in
              zip(states, params)]
        vs = [s.get("exp_avg_sq", torch.zeros(p.shape)).double().cpu() for s, p in
              zip(states, params)]
        new, _, _, _ = ref_adam(starts, [p.grad.cpu() for p in params], ms, vs, step - 1,
                                lr=ADAM["lr"], beta1=ADAM["betas"][0], beta2=ADAM["betas"][1],
                                eps=ADAM["eps"], weight_decay=ADAM["weight_decay"])
        opt.step()
        assert opt.param_groups[0]["step"].item() == step
        robust = 0
        for i, (p, ref) in enumerate(zip(params, new)):
            x32 = ref.float()
            bits = ref_rounding_bits(seed, i, step, p.numel()).reshape(p.shape)
            expected = ref_round_bf16_stochastic(x32, bits)
            low = x32.view(torch.int32).to(torch.int64) & 0xFFFF
            safe = (low + bits - 0x10000).abs() > 64
            got = p.detach().cpu().float()
            assert torch.equal(got[safe], expected[safe]), f"param {i} at step {step}"
            down = x32.bfloat16().float()  # a neighbour; the other is one unit away
            assert ((got - x32).abs() <= (x32 - down).abs().clamp_min(0) +
                    x32.abs() * 2.0 ** -7).all()
            robust += int(safe.sum())
        assert robust >= 0.95 * sum(p.numel() for p in params)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.83])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased(device, fraction, sign):
    """FusedSGD moves every one of many elements at 1.0 (sign -1: -1.0) by `fraction` of
    a bf16 unit (2^-7 there): each rounds up with probability `fraction`, so the mean
    of the rounded values equals the fp32 value within its standard error. Round to
    nearest (master="none") misses it by far: the test tells the two apart."""
    n, seeds = 1 << 18, 4  # draws: n elements under each of 4 seeds
    unit = 2.0 ** -7
    x32 = torch.tensor(sign * (1.0 + fraction * unit), dtype=torch.float32).double()
    q = fraction
    std_err = unit * (q * (1 - q) / (n * seeds)) ** 0.5
    means = {}
    for master in ("stochastic", "none"):
        total = 0.0
        for seed in range(seeds):
            p = nn.Parameter(torch.full((n,), sign, dtype=torch.bfloat16, device=device))
            opt = FusedSGD([p], lr=fraction * unit, master=master,
                           **({"seed": seed} if master == "stochastic" else {}))
            p.grad = torch.full((n,), -sign, dtype=torch.bfloat16, device=device)
            opt.step()
            values = p.detach().double()
            assert set(values.unique().tolist()) <= {sign, sign * (1 + unit)}
            total += values.sum().item()
        means[master] = total / (n * seeds)
    assert abs(means["stochastic"] - x32.item()) < 4 * std_err, means
    assert abs(means["none"] - x32.item()) > 40 * std_err, means


def _train(opt, params, steps, first=0):
    for s in range(first, first + steps):
        set_grads(params, s)
        opt.step()


@pytest.mark.parametrize("key", ["seed", "sr_seed"], ids=["today", "before-2026-11-28"])
@pytest.mark.parametrize("cls, kwargs", [(FusedAdam, ADAM), (FusedSGD, SGD)])
def test_resume_continues_bit_for_bit(device, cls, kwargs, key):
    """Also from a state dict saved when the group's seed was named ``sr_seed``."""
    params = make_params(device)
    opt = cls(params, master="stochastic", **kwargs)
    _train(opt, params, 3)
    buffer = io.BytesIO()
    saved = opt.state_dict()
    saved["param_groups"] = [{(key if k == "seed" else k): v for k, v in group.items()}
                             for group in saved["param_groups"]]
    torch.save(saved, buffer)
    saved_params = [p.detach().clone() for p in params]
    _train(opt, params, 3, first=3)

    resumed = [nn.Parameter(p.clone()) for p in saved_params]
    opt2 = cls(resumed, master="stochastic", seed=1, **kwargs)  # the state_dict's seed wins
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt2.param_groups[0]["seed"] == opt.param_groups[0]["seed"]
    _train(opt2, resumed, 3, first=3)
    for i, (a, b) in enumerate(zip(params, resumed)):
        assert_bitwise_equal(b.detach(), a.detach(), f"param {i}")


def test_default_seed_comes_from_torchs_generator_and_groups_differ():
    torch.manual_seed(0)
    a = FusedAdam([{"params": make_params("cpu")}, {"params": make_params("cpu", 9)}],
                  master="stochastic")
    torch.manual_seed(0)
    b = FusedSGD(make_params("cpu"), master="stochastic")
    seed = a.param_groups[0]["seed"]
    assert b.param_groups[0]["seed"] == seed
    assert a.param_groups[1]["seed"] == seed + 1
    assert "seed" not in FusedAdam(make_params("cpu"), master="none").param_groups[0]


@pytest.mark.parametrize("cls, kwargs", [(FusedAdam, ADAM), (FusedSGD, SGD)])
def test_a_skipped_step_changes_nothing_and_is_not_counted(device, cls, kwargs):
    params = make_params(device)
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    opt = cls(params, master="stochastic", seed=5, **kwargs)
    ref = cls(ref_params, master="stochastic", seed=5, **kwargs)
    _train(opt, params, 2)
    _train(ref, ref_params, 2)
    before = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
    set_grads(params, 2)
    opt.found_inf = torch.ones(1, device=device)
    opt.step()
    del opt.found_inf
    for p, b in zip(params, before[0]):
        assert_bitwise_equal(p.detach(), b)
    assert opt.param_groups[0]["step"].item() == 2
    _train(opt, params, 2, first=2)
    _train(ref, ref_params, 2, first=2)
    for a, b in zip(params, ref_params):
        assert_bitwise_equal(a.detach(), b.detach())


@pytest.mark.parametrize("cls, kwargs", [(FusedAdam, ADAM), (FusedSGD, SGD)])
def test_the_bits_do_not_depend_on_the_thread_count(cls, kwargs):
    """Sizes over several chunks of the CPU engine (65536 elements), so threads split
    them differently."""
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            params = [nn.Parameter(randn((3 * 65536 + 5,), torch.float32, "cpu", 3)
                                   .bfloat16())]
            opt = cls(params, master="stochastic", seed=11, **kwargs)
            _train(opt, params, 2)
            results.append(params[0].detach().clone())
    finally:
        torch.set_num_threads(threads)
    assert_bitwise_equal(results[1], results[0])


ISA_SCRIPT = """
import sys
import torch
from mixedprec import ops
sizes = [1, 7, 8, 37, 1000, 4097, 65536 + 21]
params = [(torch.arange(n) * 0.37).sin().bfloat16() for n in sizes]
# non-finite lanes (and a NaN made by the step: inf - inf): their vectors take the whole
# rounding, the others its finite case alone (vec.h's round_bf16_stochastic_finite)
params[4][500], params[5][17], params[6][65540] = float("inf"), float("nan"), -float("inf")
grads = [(torch.arange(n) * 0.11).cos() for n in sizes]
grads[4][500] = float("inf")
# whole tensors, pieces at offsets off multiples of 8, runs (of rows) shorter and
# longer than the vectors
rows = [[(i,), (i, 8 * i + 3, 0, 0), (i, 5, 13 + 40 * (i % 2), 100)][i % 3]
        for i in range(len(sizes))]
salts = ops.rounding_words(rows)
ops.fused_sgd_(params, grads, [], [], lr=0.01, sr_salts=salts, sr_seed=2**40 + 3,
               step=torch.full((1,), 9.0))
torch.save(params, sys.argv[1])
"""


# The AVX-512 pass of stochastic rounding takes 32 lanes a step (4 Philox blocks per
# call), and the Fixed modes' passes draw several vectors' bits per call (vec_pair.h's
# PairedDraws: 256 elements on AVX-512 and 128 on AVX2, or 64 and 32 near a chunk's end
# or where a run is shorter): tensors around multiples of 32 and 128, shards at offsets that are
# multiples of 8 (4 blocks at once) or not, runs that end inside a 32-lane step but not
# a 16-lane one, and runs of 40 and 48 (two vectors' bits at once, not eight); through
# SGD's pass and through AdamW's.
SHARDS_32 = """
import sys
import torch
from mixedprec import ops
sizes = [31, 32, 33, 48, 95, 200, 1029, 4096 + 40, 300, 257, 1000, 640, 383, 129]
params = [(torch.arange(n) * 0.29).sin().bfloat16() for n in sizes]
params[5][70], params[6][33], params[7][4100] = float("inf"), float("nan"), -float("inf")
grads = [(torch.arange(n) * 0.13).cos() for n in sizes]
grads[5][70] = float("inf")
rows = [[(i,), (i, 8 * i, 0, 0), (i, 8 * i + 5, 0, 0), (i, 16, 24, 56), (i, 0, 48, 64),
         (i, 8, 40, 40)][i % 6] for i in range(len(sizes))]
salts = ops.rounding_words(rows)
"""
ISA_SCRIPT_32 = SHARDS_32 + """
ops.fused_sgd_(params, grads, [], [], lr=0.01, sr_salts=salts, sr_seed=2**33 + 11,
               step=torch.full((1,), 3.0))
torch.save(params, sys.argv[1])
"""
# With bf16 gradients, as autograd gives them to bf16 params: the engines' Fixed
# stochastic modes (pointwise.h's LeanModes, which fp32 gradients on bf16 params do not
# fit), whose passes draw several vectors' bits at once (vec_pair.h's PairedDraws).
ISA_SCRIPT_SGD_FIXED = SHARDS_32 + """
buffers = [torch.zeros(n) for n in sizes]
ops.fused_sgd_(params, [g.bfloat16() for g in grads], buffers, [], lr=0.01, momentum=0.9,
               first_run=True, sr_salts=salts, sr_seed=2**33 + 11, step=torch.full((1,), 3.0))
torch.save(params + buffers, sys.argv[1])
"""
ISA_SCRIPT_ADAM = SHARDS_32 + """
m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
grads = [g.bfloat16() for g in grads]
ops.fused_adam_(params, grads, m, v, [], step=torch.full((1,), 2.0), lr=0.01, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                bias_correction=True,
                sr_salts=salts, sr_seed=2**33 + 11)
torch.save(params + m + v, sys.argv[1])
"""

# With bf16 moments and momentum too, every streamed list 16 bits wide: on AVX2 the
# pass whose pair holds its elements even and odd (engine.h's kEvenOddPass), whose bits
# come split the same way (vec_pair.h's EvenOddDraws), drawn per vector where a shard
# or a run does not let it draw two.
ISA_SCRIPT_16_BIT_STATE = SHARDS_32 + """
grads = [g.bfloat16() for g in grads]
m = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
v = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
ops.fused_adam_(params, grads, m, v, [], step=torch.full((1,), 2.0), lr=0.01, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                bias_correction=True,
                sr_salts=salts, sr_seed=2**33 + 11)
sgd_params = [p.clone() for p in params]
buffers = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
ops.fused_sgd_(sgd_params, grads, buffers, [], lr=0.01, momentum=0.9, first_run=True,
               sr_salts=salts, sr_seed=2**33 + 12, step=torch.full((1,), 3.0))
torch.save(params + m + v + sgd_params + buffers, sys.argv[1])
"""


@pytest.mark.parametrize("script", [ISA_SCRIPT, ISA_SCRIPT_32, ISA_SCRIPT_SGD_FIXED,
                                    ISA_SCRIPT_ADAM, ISA_SCRIPT_16_BIT_STATE],
                         ids=["16_lanes", "32_lanes", "sgd_fixed_mode", "adam_fixed_mode",
                              "16_bit_state"])
def test_every_instruction_set_draws_the_same_bits(device, tmp_path, script):
    """The CPU engine's AVX-512 (Philox blocks per vector; for stochastic rounding 32
    lanes a step, 4 blocks per call, and in the Fixed modes two vectors' bits per call,
    vec_pair.h), AVX2 (in the Fixed modes eight vectors' bits per call, or two) and
    baseline loops
    (ATEN_CPU_CAPABILITY lowers the choice), vector lanes and tails, shards at offsets
    off multiples of 8 and runs (ending inside a 16- or 32-lane step): the same params
    bit for bit."""
    if device == "cuda":
        pytest.skip("the CPU engine's instruction sets")
    import os
    import subprocess
    import sys
    path = tmp_path / "isa.py"
    path.write_text(script)
    # The vector instruction sets this machine can run: torch's own kernels follow
    # ATEN_CPU_CAPABILITY=avx512 even on a CPU without it (and die there).
    vector = {"AVX2": ["avx2"], "AVX512": ["avx2", "avx512"]}.get(
        torch.backends.cpu.get_cpu_capability(), [])
    if not vector:
        pytest.skip("no vector instruction set to compare with the baseline loops")
    results = {}
    for capability in ["default", *vector]:
        out = tmp_path / f"{capability}.pt"
        subprocess.run([sys.executable, str(path), str(out)], check=True, timeout=120,
                       env=dict(os.environ, ATEN_CPU_CAPABILITY=capability))
        results[capability] = torch.load(out)
    for capability in vector:
        for i, (a, b) in enumerate(zip(results["default"], results[capability])):
            assert_bitwise_equal(b, a, msg=f"{capability} tensor {i}")


def test_a_large_tensor_counts_elements_past_the_first_chunk():
    """Elements past the CPU engine's first chunk and vector lanes are keyed by their
    own index: the reference bits of a slice far into the tensor."""
    n = 65536 + 100
    p = torch.full((n,), 1.0, dtype=torch.bfloat16)
    g = torch.full((n,), -0.37 * 2.0 ** -7)
    ops.fused_sgd_([p], [g], [], [], lr=1.0, sr_salts=ops.rounding_words([(2,)]), sr_seed=77,
                   step=torch.full((1,), 4.0))
    exact = torch.full((n,), 1.0) - g
    bits = torch.tensor([(philox4x32_10((i // 8, 0, 2, 4), (77, 0))[i % 8 // 2]
                          >> (16 * (i % 2))) & 0xFFFF for i in range(65530, n)])
    expected = ref_round_bf16_stochastic(exact[65530:], bits)
    assert_bitwise_equal(p[65530:].float(), expected)


def test_stochastic_argument_errors():
    bf16 = make_params("cpu")
    with pytest.raises(TypeError, match="expected seed to be an int"):
        FusedAdam(bf16, master="stochastic", seed=1.5)
    with pytest.raises(ValueError, match=r"expected seed in \[0, 2\*\*63\)"):
        FusedSGD(bf16, master="stochastic", seed=-1)
    with pytest.raises(ValueError, match="seed is for master='stochastic'"):
        FusedSGD(bf16, master="kahan", seed=3)


def test_apex_2019_step_arguments_round_as_the_fused_path():
    """FusedAdam.step(scale=...) (Apex 2019's path) keys the bits as step() does."""
    params, legacy = make_params("cpu"), make_params("cpu")
    opt = FusedAdam(params, master="stochastic", seed=4, **ADAM)
    opt_legacy = FusedAdam(legacy, master="stochastic", seed=4, **ADAM)
    for s in range(3):
        set_grads(params, s)
        set_grads(legacy, s)
        opt.step()
        opt_legacy.step(scale=1.0)
    for a, b in zip(params, legacy):
        assert_bitwise_equal(b.detach(), a.detach())
    with pytest.raises(ValueError, match="output_params with master='stochastic'"):
        opt_legacy.step(output_params=[torch.zeros_like(p) for p in legacy])


@pytest.mark.parametrize("cls, kwargs", [(FusedAdam, ADAM), (FusedSGD, SGD)])
def test_stochastic_steps_never_read_device_values(device, cls, kwargs, monkeypatch):
    """Full and planned steps, scaled and skipped, without a host read (test_amp's
    detector: on the CPU, calls from mixedprec's code; on CUDA, any call)."""
    from test_amp import SyncDetector, armed
    params = make_params(device)
    opt = cls(params, master="stochastic", **kwargs)
    detector = SyncDetector(monkeypatch)
    for s in range(4):
        set_grads(params, s)
        opt.grad_scale = torch.full((), 2.0, device=device)
        opt.found_inf = torch.full((1,), float(s == 2), device=device)
        with armed(detector, device):
            opt.step()
    assert detector.calls == [], detector.calls
    assert opt.param_groups[0]["step"].item() == 3


def sgd_rounded(params, device, rows, lr=0.01, seed=2**40 + 5, step=3.0):
    """One plain fused_sgd_ step of bf16 ``params`` (grads from their values, so that a
    piece sees the grads of its elements) with rounding words ``rows``, in place."""
    grads = [(p.float() * 1.7).cos() for p in params]
    ops.fused_sgd_(params, grads, [], [], lr=lr, sr_salts=ops.rounding_words(rows, device),
                   sr_seed=seed, step=torch.full((1,), step, device=device))
    return params


def test_pieces_with_their_offsets_draw_the_whole_tensors_bits(device):
    """A tensor updated whole, and the same tensor cut into pieces passed with their
    global offsets (one call): identical bits, whatever the cuts (off multiples of 8,
    across the CPU engine's chunks and vectors, the CUDA blocks' accesses)."""
    n = 2 * ops.CHUNK_SIZE + 37
    whole = (torch.arange(n, device=device) * 0.37).sin().bfloat16()
    cuts = [0, 3, 13, 40, 1000, ops.CHUNK_SIZE + 7, 2 * ops.CHUNK_SIZE + 1, n]
    pieces = [whole[a:b].clone() for a, b in zip(cuts, cuts[1:])]
    sgd_rounded([whole], device, [(4,)])
    sgd_rounded(pieces, device, [(4, a, 0, 0) for a in cuts[:-1]])
    assert_bitwise_equal(torch.cat(pieces), whole)
    # the salt still counts: another salt, other bits
    other = [(torch.arange(n, device=device) * 0.37).sin().bfloat16()]
    assert not torch.equal(sgd_rounded(other, device, [(5,)])[0], whole)


def test_runs_map_column_blocks_onto_the_whole_tensor(device):
    """Row-stride words (offset, run, stride): column blocks and a box of rows and
    columns of a 2-D tensor (tensor parallelism's Shard(1), on a mesh of two
    dimensions) draw the whole tensor's bits; runs shorter than the CPU vectors cross
    them (lanes mapped one by one)."""
    rows, cols = 37, 300
    whole = (torch.arange(rows * cols, device=device) * 0.11).cos().bfloat16().view(rows, cols)
    boxes = [(0, rows, 0, 5), (0, rows, 5, 133), (0, rows, 133, cols), (10, 20, 133, cols),
             (36, 37, 7, 290)]
    pieces = [whole[r0:r1, c0:c1].clone(memory_format=torch.contiguous_format)
              for r0, r1, c0, c1 in boxes]
    words = [(9, r0 * cols + c0, 0 if r1 - r0 == 1 else c1 - c0, cols)
             for r0, r1, c0, c1 in boxes]
    sgd_rounded([whole], device, [(9,)])
    sgd_rounded(pieces, device, words)
    for piece, (r0, r1, c0, c1) in zip(pieces, boxes):
        assert_bitwise_equal(piece, whole[r0:r1, c0:c1], msg=str((r0, r1, c0, c1)))


@pytest.mark.parametrize("values", [
    [], [5], [0, 0, 0], [3, 4, 5, 6], [9, 7, 5, 3, 1, 2, 2, 2], [0, 2**40, 2**62, 7],
    [2**63 - 1, 0, -2**63], list(range(0, 300, 3)) + [1] * 5 + [8, 6, 4]])
def test_int64_tensor_holds_the_values_made_on_the_device(device, values, monkeypatch):
    """ops.int64_tensor (rounding_words' columns): the values, made without a tensor
    from host data (the guard catches those), in few pieces for runs of equal steps."""
    from helpers import forbid_host_sync
    with forbid_host_sync(monkeypatch):
        made = ops.int64_tensor(values, device)
    assert made.dtype == torch.int64 and made.device.type == device
    assert made.cpu().tolist() == values


def test_rounding_words_are_the_rows_made_on_the_device(device, monkeypatch):
    from helpers import forbid_host_sync
    rows = [(4,), (0, 7, 3, 10), (2**32 - 1,), (5, 2**40, 0, 0), (6,)]
    with forbid_host_sync(monkeypatch):
        words = ops.rounding_words(rows, device)
    assert [w.shape for w in words] == [(1, 4)] * len(rows)
    assert all(w.is_contiguous() for w in words)
    assert [w.cpu().tolist()[0] for w in words] == [list(r) + [0] * (4 - len(r))
                                                   for r in rows]


def test_rounding_words_refuses_bad_rows():
    for row in [(-1,), (2**32,), (0, -8, 0, 0), (0, 0, -1, 4), (0, 1)]:
        with pytest.raises(ValueError, match="rounding_words"):
            ops.rounding_words([(0,), row])
    assert ops.rounding_words([]) == []
    words = ops.rounding_words([(3,), (2**32 - 1, 2**40, 5, 7)])
    assert [w.tolist() for w in words] == [[[3, 0, 0, 0]], [[2**32 - 1, 2**40, 5, 7]]]
