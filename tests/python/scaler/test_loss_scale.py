"""update_loss_scale_ over sequences of overflow flags, against a plain Python
reference of the contract; and LossScale, the Python core over it."""

import pytest
import torch
from helpers import scalar
from references import ref_update_loss_scale

from mixedprec import ops
from mixedprec.loss_scale import LossScale, inverse

F32_MAX = torch.finfo(torch.float32).max


def run_sequence(device, flags, initial_scale, **config):
    """Runs the op over `flags` and the reference alongside; returns the states the
    reference went through."""
    hysteresis = config.get("hysteresis", 1)
    scale = scalar(initial_scale, device)
    growth_tracker = scalar(0, device, torch.int32)
    hysteresis_tracker = scalar(hysteresis, device, torch.int32)
    state = (initial_scale, 0, hysteresis)
    seen = [state]
    for i, flag in enumerate(flags):
        found_inf = scalar(flag, device)
        ops.update_loss_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, **config)
        state = ref_update_loss_scale(state, flag, **config)
        got = (scale.item(), growth_tracker.item(), hysteresis_tracker.item())
        assert got == state, f"step {i} (found_inf={flag}): got {got}, expected {state}"
        assert found_inf.item() == flag  # read only
        seen.append(state)
    for t, dtype in ((scale, torch.float32), (growth_tracker, torch.int32),
                     (hysteresis_tracker, torch.int32)):
        assert t.dtype == dtype and t.shape == (1,) and t.device.type == device
    return seen


def test_inverse_has_the_bits_of_the_float64_reciprocal(device):
    """inverse's float32 reciprocal against torch.amp.GradScaler's
    ``scale.double().reciprocal().float()``: every exponent of both signs, with 16,417
    mantissas each (the first and last ones among them), so subnormal and overflowing
    quotients, zeros, infinities and NaNs too; and a 0-dim scale, as the scalers hold."""
    exponents = torch.arange(512, dtype=torch.int64).reshape(-1, 1) << 23
    mantissas = torch.cat([torch.arange(0, 2**23, 2**9 + 1), torch.arange(2**23 - 64, 2**23)])
    bits = (exponents | mantissas).flatten()
    scales = (bits - (bits >> 31 << 32)).to(torch.int32).view(torch.float32).to(device)
    got, expected = inverse(scales), scales.double().reciprocal().float()
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    for value in (1.0, 65536.0, 3.0, 2.0**-126, 2.0**-149):
        scale = torch.tensor(value, device=device)
        assert inverse(scale).shape == () and torch.equal(
            inverse(scale), scale.double().reciprocal().float())
    scale = torch.tensor(3.0, dtype=torch.float64, device=device)  # (a float64 divisor)
    assert inverse(scale).dtype == torch.float32 and inverse(scale).item() == float(
        torch.tensor(1 / 3.0, dtype=torch.float32))


def random_flags(seed, n, p_overflow):
    gen = torch.Generator().manual_seed(seed)
    return [float(f) for f in (torch.rand(n, generator=gen) < p_overflow).tolist()]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hysteresis", [1, 3])
def test_random_overflow_patterns(device, seed, hysteresis):
    config = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=4, hysteresis=hysteresis)
    seen = run_sequence(device, random_flags(seed, 300, 0.3), 2.0**16, **config)
    scales = {s for s, _, _ in seen}
    assert len(scales) > 3  # the pattern both grew and backed off


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_floor_and_ceiling(device, hysteresis):
    # Runs of overflows drive the scale to the floor, runs of clean steps to the ceiling.
    flags = ([1.0] * 12 + [0.0] * 40) * 3 + random_flags(7, 100, 0.4)
    config = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                  hysteresis=hysteresis, min_scale=4.0, max_scale=2.0**12)
    seen = run_sequence(device, flags, 256.0, **config)
    scales = [s for s, _, _ in seen]
    assert min(scales) == 4.0 and max(scales) == 2.0**12


def test_non_power_of_two_factors_and_bounds(device):
    config = dict(growth_factor=3.0, backoff_factor=0.3, growth_interval=2, hysteresis=2,
                  min_scale=1.7, max_scale=5000.5)
    flags = [1.0] * 10 + [0.0] * 30 + random_flags(11, 100, 0.35)
    seen = run_sequence(device, flags, 100.0, **config)
    scales = [s for s, _, _ in seen]
    assert min(scales) == pytest.approx(1.7) and max(scales) == pytest.approx(5000.5)


def test_hysteresis_delays_backoff(device):
    config = dict(growth_interval=1000, hysteresis=3)
    seen = run_sequence(device, [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], 1024.0, **config)
    assert [s for s, _, _ in seen] == [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 1024.0,
                                       512.0, 256.0]
    assert [h for _, _, h in seen] == [3, 2, 1, 3, 2, 1, 0, -1]


def test_growth_stops_where_the_scale_would_overflow(device):
    # Without a ceiling, 2^127 * 2 is inf in fp32: the scale stays, the tracker resets.
    seen = run_sequence(device, [0.0] * 6, 2.0**126, growth_interval=2)
    assert [s for s, _, _ in seen] == [2.0**126] * 2 + [2.0**127] * 5
    assert [g for _, g, _ in seen] == [0, 1, 0, 1, 0, 1, 0]

    # With a finite ceiling, the overflowing growth is capped to it.
    seen = run_sequence(device, [0.0] * 2, 2.0**127, growth_interval=1, max_scale=F32_MAX)
    assert [s for s, _, _ in seen] == [2.0**127, F32_MAX, F32_MAX]


def test_backoff_with_default_floor_reaches_small_scales(device):
    seen = run_sequence(device, [1.0] * 30, 1.0, backoff_factor=0.25)
    assert seen[-1][0] == 0.25**30


def test_defaults(device):
    # growth_interval 2000, factors 2 and 1/2, hysteresis 1, no floor, no ceiling.
    scale = scalar(8.0, device)
    growth_tracker = scalar(1998, device, torch.int32)
    hysteresis_tracker = scalar(1, device, torch.int32)
    clean, overflow = scalar(0.0, device), scalar(1.0, device)

    ops.update_loss_scale_(scale, growth_tracker, hysteresis_tracker, clean)
    assert (scale.item(), growth_tracker.item()) == (8.0, 1999)
    ops.update_loss_scale_(scale, growth_tracker, hysteresis_tracker, clean)
    assert (scale.item(), growth_tracker.item()) == (16.0, 0)
    ops.update_loss_scale_(scale, growth_tracker, hysteresis_tracker, overflow)
    assert (scale.item(), growth_tracker.item(), hysteresis_tracker.item()) == (8.0, 0, 0)


# --- LossScale, the Python core over the op ----------------------------------------------

def test_loss_scale_core_update_and_state():
    core = LossScale(8.0, growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=32.0)
    assert core.get() == 8.0 and core.scale is None
    flags = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    scales = []
    for f in flags:
        core.update(torch.tensor(float(f)))
        scales.append(core.get())
    # the first back-off after two overflows (hysteresis 2), then one per overflow until
    # a clean step; the floor 2; growth every 2 clean steps up to the ceiling 32
    assert scales == [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    state = dict(scale=core.get(), **core.trackers())
    other = LossScale(1.0)
    other.load(state["scale"], state["growth_tracker"], state["hysteresis_tracker"],
               growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=32.0)
    assert other.get() == 32.0 and other.trackers() == core.trackers()


def test_loss_scale_static_never_changes():
    core = LossScale(128.0, dynamic=False)
    for f in (1.0, 0.0, 1.0):
        core.update(torch.tensor(f))
    assert core.get() == 128.0


def test_loss_scale_rejects_init_outside_its_bounds():
    with pytest.raises(ValueError, match="init_scale"):
        LossScale(2.0**20, max_scale=2.0**16)
    LossScale(2.0**20, max_scale=2.0**16, dynamic=False)  # static: no bounds apply


def test_loss_scale_restores_a_hysteresis_tracker_below_zero():
    """update_loss_scale_ counts the tracker below 0 while overflows follow each other;
    such a state must load back."""
    core = LossScale(8.0, hysteresis=2)
    for _ in range(3):
        core.update(torch.tensor(1.0))
    saved = dict(scale=core.get(), **core.trackers())
    assert saved["hysteresis_tracker"] < 0
    other = LossScale(8.0, hysteresis=2)
    other.load(saved["scale"], saved["growth_tracker"], saved["hysteresis_tracker"],
               hysteresis=2)
    for c in (core, other):
        c.update(torch.tensor(1.0))
    assert other.get() == core.get() and other.trackers() == core.trackers()
