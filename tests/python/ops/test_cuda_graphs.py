"""A whole training step captured in one CUDA graph and replayed: forward, backward,
loss scaling, the overflow check, the fused update (skipped on the device) and the
scale update. Replays must equal the same steps run eagerly, bit for bit, overflow
steps included. CUDA only: the tests skip on a machine without a GPU."""

import pytest
import torch
from helpers import assert_bitwise_equal, assert_same_snapshot, full_snapshot
from torch import nn

import mixedprec

STEPS = 12
OVERFLOW_STEPS = (3, 4, 8)  # two in a row: hysteresis=2 backs off on the second
IN, HIDDEN, OUT, BATCH = 48, 64, 16, 32


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    return torch.device("cuda")


def make_model(dtype, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                          nn.Tanh(), nn.Linear(HIDDEN, OUT))
    return model.to("cuda", dtype)


def batch(step, dtype):
    """Fresh inputs per step (drawn on the CPU); an overflow step's input holds an inf,
    so its loss and gradients do."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=gen)
    y = torch.randn(BATCH, OUT, generator=gen)
    if step in OVERFLOW_STEPS:
        x[step % BATCH, step % IN] = float("inf")
    return x.to("cuda", dtype), y.to("cuda", dtype)


# Each recipe: (param dtype, autocast, optimizer factory, scaler factory).
RECIPES = {
    "fp16-masters-adam-mixedprec-scaler": (
        torch.float16, False,
        lambda ps: mixedprec.FusedAdam(ps, lr=1e-3, weight_decay=0.01, master_weights=True),
        lambda: mixedprec.GradScaler("cuda", init_scale=2.0**10, growth_interval=3,
                                     hysteresis=2, min_scale=1.0, max_scale=2.0**12),
    ),
    "bf16-masters-sgd-mixedprec-scaler": (
        torch.bfloat16, False,
        lambda ps: mixedprec.FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                      master_weights=True),
        lambda: mixedprec.GradScaler("cuda", init_scale=2.0**8, growth_interval=2),
    ),
    "fp32-autocast-adam-torch-scaler": (
        torch.float32, True,
        lambda ps: mixedprec.FusedAdam(ps, lr=1e-3, adam_w_mode=False, weight_decay=1e-4),
        lambda: torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3),
    ),
}


class Trainer:
    """One model, optimizer and scaler, and the step they take."""

    def __init__(self, recipe):
        dtype, self.autocast, make_opt, make_scaler = RECIPES[recipe]
        self.dtype = dtype
        self.model = make_model(dtype)
        self.opt = make_opt(self.model.parameters())
        self.scaler = make_scaler()

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        # Autocast's weight cache must be off under capture (torch's CUDA graph notes).
        with torch.autocast("cuda", torch.float16, enabled=self.autocast, cache_enabled=False):
            loss = nn.functional.mse_loss(self.model(x).float(), y.float())
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss

    def snapshot(self):
        """Params, optimizer state and the scaler's device state (created by the first
        step)."""
        state = full_snapshot(self.model, self.opt)
        for name in ("_scale", "_growth_tracker", "_hysteresis_tracker"):
            value = getattr(self.scaler, name, None)
            if value is not None:
                state[name.lstrip("_")] = value.detach().clone()
        return state


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_captured_step_replays_like_eager(cuda, recipe):
    eager, graphed = Trainer(recipe), Trainer(recipe)
    assert_same_snapshot(eager.snapshot(), graphed.snapshot(), "initial state")

    # Warm-up steps (optimizer state, scale and trackers are created), on a side
    # stream for the one to be captured, as torch's CUDA graph notes ask.
    warmup = 2
    x0, y0 = batch(-1, eager.dtype)
    static_x, static_y = x0.clone(), y0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            graphed.step(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(warmup):
        eager.step(x0, y0)
    torch.cuda.synchronize()
    assert_same_snapshot(eager.snapshot(), graphed.snapshot(), "after warm-up")

    graph = torch.cuda.CUDAGraph()
    graphed.opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = graphed.step(static_x, static_y)
    # Capturing records the step without running it.
    assert_same_snapshot(eager.snapshot(), graphed.snapshot(), "after capture")

    scales = []
    for step in range(STEPS):
        x, y = batch(step, eager.dtype)
        before = eager.snapshot()
        eager_loss = eager.step(x, y)
        params_moved = any(not torch.equal(eager.snapshot()[name], before[name])
                           for name in before if name.startswith("param"))
        # The eager run itself skipped exactly the overflow steps.
        assert params_moved == (step not in OVERFLOW_STEPS), f"step {step}"
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(static_loss, eager_loss, msg=f"loss at step {step}")
        assert_same_snapshot(eager.snapshot(), graphed.snapshot(), f"after step {step}")
        scales.append(eager.scaler.get_scale())

    # The scale both grew and backed off over the replays.
    assert any(b > a for a, b in zip(scales, scales[1:])), scales
    assert any(b < a for a, b in zip(scales, scales[1:])), scales


def test_replayed_overflow_step_leaves_weights_untouched(cuda):
    trainer = Trainer("fp16-masters-adam-mixedprec-scaler")
    x, y = batch(-1, torch.float16)
    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            trainer.step(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    trainer.opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        trainer.step(static_x, static_y)

    bad_x, _ = batch(OVERFLOW_STEPS[0], torch.float16)
    static_x.copy_(bad_x)
    before = trainer.snapshot()
    graph.replay()
    torch.cuda.synchronize()
    after = trainer.snapshot()
    for name in before:
        if name.startswith(("param", "state")):  # the update was skipped on the device
            assert_bitwise_equal(after[name], before[name], msg=name)
    # hysteresis=2: the first overflow counts down the tracker but keeps the scale.
    assert_bitwise_equal(after["scale"], before["scale"], msg="scale")
    assert after["growth_tracker"].item() == 0
    assert after["hysteresis_tracker"].item() == 1
    graph.replay()  # the second overflow in a row backs off
    assert trainer.scaler.get_scale() == before["scale"].item() / 2
