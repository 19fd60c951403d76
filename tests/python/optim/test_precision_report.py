"""The precision report (issue #32 part 2, mixedprec.optim.precision_report): against a
float64 count on parameters where bf16 loses updates, none lost with fp32 masters or
remainders, the step's bits unchanged by it in every master mode and state dtype,
accumulated on the device without host reads, nothing added by a skipped step, the same
inside backward, and what it refuses before any update."""

import pytest
import torch
from helpers import assert_unchanged, forbid_host_sync, randn, snapshot

from mixedprec import optim
from mixedprec.optim.precision_report import format_precision_report

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
# Sizes off the vector widths, and one over a CPU chunk (65536 elements) and a CUDA
# block's slice.
SHAPES = ((37,), (300, 4), (70001,))
MODES = [(master, state) for master in optim.MASTER_MODES for state in optim.STATE_DTYPES]


def make_params(device, dtype=BF16, seed=0):
    """Weights of mixed magnitudes: an Adam update of about lr moves the small ones in
    bf16 and rounds away on the large ones."""
    out = []
    for i, shape in enumerate(SHAPES):
        p = randn(shape, torch.float32, device, seed=seed + i, scale=2.0)
        out.append(torch.nn.Parameter(p.to(dtype)))
    return out


def set_grads(params, step):
    for i, p in enumerate(params):
        p.grad = randn(p.shape, torch.float32, p.device, seed=1000 * step + i).to(p.dtype)


def make_optimizer(params, master="none", state_dtype=torch.float32, cls=optim.AdamW, **kwargs):
    seed = 7 if master == "stochastic" or state_dtype == E4M3 else None
    extra = dict(momentum=0.9) if cls is optim.SGD else {}
    return cls(params, lr=1e-3, weight_decay=1e-2, master=master, state_dtype=state_dtype,
               seed=seed, **extra, **kwargs)


def words(opt, params):
    return torch.stack(opt.precision_report.tallies(params)).cpu().double()


def exact_update(opt, p, start, step):
    """The step's result in float64 from the fp32 state it left (AdamW's moments, SGD's
    momentum buffer: the kernel's own values)."""
    state = opt.state[p]
    if isinstance(opt, optim.SGD):  # (weight decay is in the buffer)
        return start - 1e-3 * state["momentum_buffer"].double().cpu()
    lr, wd, (beta1, beta2), eps = 1e-3, 1e-2, (0.9, 0.999), 1e-8
    m, v = state["exp_avg"].double().cpu(), state["exp_avg_sq"].double().cpu()
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return start * (1 - lr * wd) - lr / (1 - beta1**step) * m / denom


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD])
def test_counts_against_float64(device, cls):
    """master='none', fp32 state: the state after a step is the kernel's own, so the
    exact update is known in float64; the tallies match its count of lost updates and
    the sums of squares of the lost and applied parts. (An update counts as lost when
    it moved the fp32 result, which an update below fp32's spacing does not: the count
    is bracketed by the float64 counts of updates of at least two fp32 spacings and of
    any size, and those differ by a few elements.)"""
    params = make_params(device)
    opt = make_optimizer(params, cls=cls, precision_report=True)
    expected = torch.zeros(len(params), 3, dtype=torch.float64)
    low = torch.zeros(len(params), dtype=torch.float64)
    for step in range(1, 4):
        set_grads(params, step)
        start = [p.detach().double().cpu() for p in params]
        opt.step()
        for i, p in enumerate(params):
            exact = exact_update(opt, p, start[i], step)
            kept = p.detach().double().cpu()
            moved = (exact - start[i]).abs()
            spacing = torch.finfo(torch.float32).eps * start[i].abs()
            stuck = kept == start[i]
            low[i] += (stuck & (moved >= 2 * spacing)).sum()
            expected[i] += torch.stack([
                (stuck & (moved > 0)).sum().double(), ((exact - kept) ** 2).sum(),
                ((kept - start[i]) ** 2).sum()])
    got = words(opt, params)
    assert (low <= got[:, 0]).all() and (got[:, 0] <= expected[:, 0]).all(), (low, got[:, 0],
                                                                               expected[:, 0])
    assert (expected[:, 0] - low <= 0.01 * expected[:, 0] + 1).all()
    assert got[:, 3].tolist() == [3.0 * p.numel() for p in params]
    torch.testing.assert_close(got[:, 1:3], expected[:, 1:3], rtol=1e-3, atol=0)
    # Bf16 loses many of these updates, not all.
    assert 0 < got[:, 0].sum() < got[:, 3].sum()


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD])
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_exact_modes_lose_nothing(device, master, cls):
    params = make_params(device)
    opt = make_optimizer(params, master=master, cls=cls, precision_report=True)
    for step in range(1, 4):
        set_grads(params, step)
        opt.step()
    got = words(opt, params)
    assert got[:, 0].sum() == 0 and got[:, 1].sum() == 0
    assert (got[:, 2] > 0).all()
    assert got[:, 3].tolist() == [3.0 * p.numel() for p in params]
    assert all(r["keep_with"] is None and r["lost"] == 0
               for r in opt.precision_report.report().values())


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD])
@pytest.mark.parametrize("master,state_dtype", MODES)
def test_same_bits_with_the_report(device, master, state_dtype, cls):
    """The report only reads: params and every state tensor equal a run without it."""
    runs = []
    for report in (False, True):
        params = make_params(device)
        opt = make_optimizer(params, master=master, state_dtype=state_dtype, cls=cls,
                             precision_report=report)
        for step in range(1, 4):
            set_grads(params, step)
            opt.step()
        runs.append((params, opt))
    (plain, plain_opt), (reported, opt) = runs
    for a, b in zip(plain, reported):
        assert torch.equal(a, b)
        for key, value in plain_opt.state[a].items():
            assert torch.equal(value, opt.state[b][key]), key
    got = words(opt, reported)
    assert got[:, 3].tolist() == [3.0 * p.numel() for p in reported]
    assert (got[:, 0] <= got[:, 3]).all()
    if master in ("fp32", "remainder"):
        assert got[:, 1].sum() == 0
    if master == "none":
        assert got[:, 0].sum() > 0
    if master == "kahan":  # (the compensation keeps nearly everything)
        assert got[:, 1].sum() < 1e-4 * got[:, 2].sum()


def test_report_by_name_reset_and_format(device):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).to(
        device, BF16)
    with torch.no_grad():
        model[0].weight.mul_(40.0)  # (large weights: their updates round away)
    opt = optim.AdamW(model.parameters(), lr=1e-4, master="none", precision_report=True)
    for step in range(3):
        set_grads(list(model.parameters()), step)
        opt.step()
    report = opt.precision_report.report(model)
    assert list(report) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    first = report["0.weight"]
    assert first["elements"] == 3 * 64 * 64 and first["lost"] > 0.9 * first["elements"]
    assert first["lost_share"] == first["lost"] / first["elements"]
    assert first["lost_ratio"] > 1 and first["keep_with"] == "remainder"
    line = opt.precision_report.summary(model.named_parameters())
    assert line.startswith("lost updates: ") and "0.weight" in line and "remainder" in line
    assert format_precision_report({}) == "lost updates: none counted yet"
    for top in (-1, "x", 1.5, None):  # (before: wrong counts, or bare slice errors)
        with pytest.raises(ValueError, match="summary: expected top to be an int >= 0"):
            opt.precision_report.summary(model, top=top)
    unnamed = opt.precision_report.report()
    assert list(unnamed)[0] == "<param 0, shape (64, 64)>"
    opt.precision_report.reset()
    assert all(r["elements"] == 0 for r in opt.precision_report.report().values())
    set_grads(list(model.parameters()), 9)
    opt.step()  # (a planned step: the cached calls hold the same tallies)
    assert opt.precision_report.report(model)["0.weight"]["elements"] == 64 * 64


def test_no_host_reads_and_skipped_steps_add_nothing(device, monkeypatch):
    params = make_params(device)
    opt = make_optimizer(params, state_dtype=BF16, precision_report=True)
    set_grads(params, 1)
    opt.step()
    before = words(opt, params)
    set_grads(params, 2)
    with forbid_host_sync(monkeypatch):
        opt.step()
        opt.grad_scale = torch.ones((), device=device)
        opt.found_inf = torch.ones((), device=device)
        opt.step()  # skipped: nothing moves, nothing is counted
    del opt.grad_scale, opt.found_inf
    after = words(opt, params)
    assert after[:, 3].tolist() == [2.0 * p.numel() for p in params]
    assert (after[:, 0] >= before[:, 0]).all()


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD])
def test_every_nth_step(device, cls):
    """precision_report=3 counts steps 1, 4, 7: the same tallies as a report of every
    step over those steps alone (the others leave them as they are)."""
    params = make_params(device)
    sampled = make_optimizer(params, cls=cls, precision_report=3)
    twin = make_params(device)
    every = make_optimizer(twin, cls=cls, precision_report=True)
    expected = torch.zeros(len(params), 4, dtype=torch.float64)
    for step in range(1, 8):
        set_grads(params, step)
        set_grads(twin, step)
        before = words(every, twin) if step > 1 else torch.zeros_like(expected)
        sampled.step()
        every.step()
        if step % 3 == 1:
            expected += words(every, twin) - before
        for a, b in zip(params, twin):
            assert torch.equal(a, b)
    got = words(sampled, params)
    assert got[:, 3].tolist() == [3.0 * p.numel() for p in params]
    assert torch.equal(got[:, 0], expected[:, 0])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_inside_backward_tallies_as_step(device):
    """A bucket per parameter steps each with its own op call: the same tallies."""
    runs = []
    for inside in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 4)).to(device, BF16)
        opt = optim.AdamW(model.parameters(), lr=1e-3, master="none", precision_report=True)
        handle = optim.in_backward(opt, bucket_cap_mb=1e-9) if inside else None
        for step in range(3):
            x = randn((8, 16), torch.float32, device, seed=step).to(BF16)
            model(x).float().pow(2).mean().backward()
            if not inside:
                opt.step()
                opt.zero_grad()
        if handle is not None:
            handle.remove()
        runs.append(opt.precision_report.report(model))
    assert runs[0] == runs[1]


def test_refusals_change_nothing(device):
    half = make_params(device, torch.float16)
    opt = optim.AdamW(half, lr=1e-3, master="none", precision_report=True)
    set_grads(half, 1)
    before = snapshot(half)
    with pytest.raises(TypeError, match="precision_report=True.*float16"):
        opt.step()
    assert_unchanged(half, before)
    assert not opt.state
    for bad in ("yes", 0, -2, 1.5):
        with pytest.raises(ValueError, match="expected precision_report to be a bool or an int"):
            optim.AdamW(make_params(device), precision_report=bad)
    with pytest.raises(TypeError, match="precision_report"):
        optim.LAMB(make_params(device), precision_report=True)
    # fp16 with fp32 masters is followed (the masters lose nothing).
    opt = optim.AdamW(half, lr=1e-3, precision_report=True)
    opt.step()
    assert words(opt, half)[:, 1].sum() == 0


def test_pickle_keeps_the_option_not_the_counts():
    import pickle
    params = make_params("cpu")
    opt = make_optimizer(params, precision_report=True)
    set_grads(params, 1)
    opt.step()
    copy = pickle.loads(pickle.dumps(opt))
    assert copy.precision_report is not None and copy.precision_report.report() == {}
    assert pickle.loads(pickle.dumps(make_optimizer(params, precision_report=4))
                        ).precision_report.every == 4
    assert pickle.loads(pickle.dumps(make_optimizer(params))).precision_report is None
