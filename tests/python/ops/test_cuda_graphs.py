"""A whole training step captured in one CUDA graph and replayed: forward, backward,
loss scaling, the overflow check, the fused update (skipped on the device) and the
scale update. Replays must equal the same steps run eagerly, bit for bit, overflow
steps included: for the Apex faces and torch's scaler (RECIPES), and for the lean modes
of mixedprec.optim's AdamW and SGD on bf16 parameters (LEAN). The graph tests need
CUDA and skip without it; what they compare (the snapshot) and what they assume of the
eager steps are checked on the CPU too."""

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    assert_same_snapshot,
    live_tensors,
    make_model,
    randn,
)
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


def batch(step, dtype, device="cuda"):
    """Fresh inputs per step (drawn on the CPU); an overflow step's input holds an inf,
    so its loss and gradients do."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=gen)
    y = torch.randn(BATCH, OUT, generator=gen)
    if step in OVERFLOW_STEPS:
        x[step % BATCH, step % IN] = float("inf")
    return x.to(device, dtype), y.to(device, dtype)


# Each recipe: (param dtype, autocast, optimizer factory, scaler factory of a device).
RECIPES = {
    "fp16-masters-adam-mixedprec-scaler": (
        torch.float16, False,
        lambda ps: mixedprec.FusedAdam(ps, lr=1e-3, weight_decay=0.01, master_weights=True),
        lambda device: mixedprec.GradScaler(device, init_scale=2.0**10, growth_interval=3,
                                            hysteresis=2, min_scale=1.0, max_scale=2.0**12),
    ),
    "bf16-masters-sgd-mixedprec-scaler": (
        torch.bfloat16, False,
        lambda ps: mixedprec.FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                      master_weights=True),
        lambda device: mixedprec.GradScaler(device, init_scale=2.0**8, growth_interval=2),
    ),
    "fp32-autocast-adam-torch-scaler": (
        torch.float32, True,
        lambda ps: mixedprec.FusedAdam(ps, lr=1e-3, adam_w_mode=False, weight_decay=1e-4),
        lambda device: torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3),
    ),
}

# The lean modes (docs/lean-precision.md) of mixedprec.optim's AdamW and SGD(momentum) on
# bf16 parameters; seeds given, so that the eager and the graphed twin round alike.
LEAN_MODES = {
    "stochastic": dict(master="stochastic", seed=11),
    "remainder": dict(master="remainder"),
    "kahan": dict(master="kahan"),
    "8bit-fp32": dict(master="fp32", state_dtype=torch.float8_e4m3fn, seed=12),
    "8bit-remainder": dict(master="remainder", state_dtype=torch.float8_e4m3fn, seed=13),
}
LEAN_OPTIMIZERS = {
    "adamw": lambda ps, **kw: mixedprec.optim.AdamW(ps, lr=1e-3, **kw),
    "sgd": lambda ps, **kw: mixedprec.optim.SGD(ps, lr=0.01, momentum=0.9, **kw),
}
LEAN = {f"{opt}-{mode}": (opt, mode) for opt in LEAN_OPTIMIZERS for mode in LEAN_MODES}
# The first two take 8-bit moments (2-d, >= 4096 elements, rows of whole 32-element
# blocks), the others keep fp32 moments beside them.
LEAN_SHAPES = ((64, 64), (32, 160), (100,), (7, 5))


def lean_inputs(step, device="cuda"):
    """A step's gradients (before loss scaling), drawn on the CPU; an overflow step's
    hold an inf."""
    gen = torch.Generator().manual_seed(2000 + step)
    xs = [torch.randn(shape, generator=gen) for shape in LEAN_SHAPES]
    if step in OVERFLOW_STEPS:
        xs[step % len(xs)].view(-1)[step] = float("inf")
    return [x.to(device) for x in xs]


# --- what the graph tests compare ----------------------------------------------------------

def scaler_state(scaler):
    """{name: tensor} of a scaler's device state, the live tensors (none before its
    first scale()): mixedprec.GradScaler's loss-scale core (mixedprec/loss_scale.py:
    the scale and both trackers), torch.amp.GradScaler's scale and growth tracker."""
    if isinstance(scaler, mixedprec.GradScaler):
        core = scaler._core
        named = dict(scale=core.scale, growth_tracker=core.growth_tracker,
                     hysteresis_tracker=core.hysteresis_tracker)
    else:
        named = dict(scale=scaler._scale, growth_tracker=scaler._growth_tracker)
    return {name: t for name, t in named.items() if t is not None}


def live_state(model, opt, scaler):
    """{name: tensor}, the live tensors, of everything a training step may write: the
    params, the optimizer's per-parameter and per-group state and its count of applied
    steps, and the scaler's device state. test_the_snapshot_covers_every_state_tensor
    checks on the CPU that the optimizer and the scaler hold no other tensor."""
    tensors = live_tensors(model, opt)
    tensors["applied_steps"] = opt.applied_steps
    tensors.update(scaler_state(scaler))
    return tensors


def held_tensors(root, name):
    """{path: tensor} of every tensor reachable from ``root`` through dicts, lists,
    tuples and the attributes of ``root`` and of mixedprec's objects. An optimizer's
    plans are left out: they hold its state's tensors again, and rounding words
    (constants made from the parameters' layout)."""
    found, seen = {}, set()

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            found[path] = x
            return
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, dict):
            for i, (key, value) in enumerate(x.items()):
                walk(value, f"{path}[{i if isinstance(key, torch.Tensor) else repr(key)}]")
        elif isinstance(x, (list, tuple)):
            for i, value in enumerate(x):
                walk(value, f"{path}[{i}]")
        elif x is root or type(x).__module__.startswith("mixedprec"):
            for key, value in getattr(x, "__dict__", {}).items():
                if key != "plans":  # (the kept op calls: lists of the state above)
                    walk(value, f"{path}.{key}")

    walk(root, name)
    return found


# --- the steps ---------------------------------------------------------------------------

class Trainer:
    """One model, optimizer and scaler, and the step they take."""

    def __init__(self, recipe, device="cuda"):
        dtype, self.autocast, make_opt, make_scaler = RECIPES[recipe]
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = make_model(device, dtype, sizes=(IN, HIDDEN, HIDDEN, OUT),
                                activation=(nn.ReLU, nn.Tanh))
        self.opt = make_opt(self.model.parameters())
        self.scaler = make_scaler(device)

    def inputs(self, step):
        return batch(step, self.dtype, self.device)

    def loss(self, x, y):
        return nn.functional.mse_loss(self.model(x).float(), y.float())

    def step(self, *inputs):
        self.opt.zero_grad(set_to_none=True)
        # Autocast's weight cache must be off under capture (torch's CUDA graph notes).
        with torch.autocast(self.device.type, torch.float16, enabled=self.autocast,
                            cache_enabled=False):
            loss = self.loss(*inputs)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss

    def live_state(self):
        return live_state(self.model, self.opt, self.scaler)

    def snapshot(self):
        """Clones of :meth:`live_state` (created by the first step)."""
        return {name: t.detach().clone() for name, t in self.live_state().items()}


class LeanTrainer(Trainer):
    """bf16 parameters whose loss is ``sum(p * x)``, so that each step's gradients are
    its inputs (static gradients copied in, under a graph) times the loss scale; a lean
    mode of mixedprec.optim's AdamW or SGD; mixedprec's GradScaler."""

    def __init__(self, case, device="cuda"):
        optimizer, mode = LEAN[case]
        self.dtype, self.autocast = torch.bfloat16, False
        self.device = torch.device(device)
        self.model = nn.ParameterList(
            nn.Parameter(randn(shape, torch.bfloat16, device, seed=50 + i))
            for i, shape in enumerate(LEAN_SHAPES))
        self.opt = LEAN_OPTIMIZERS[optimizer](self.model.parameters(), **LEAN_MODES[mode])
        self.scaler = mixedprec.GradScaler(device, init_scale=2.0**8, growth_interval=2)

    def inputs(self, step):
        return lean_inputs(step, self.device)

    def loss(self, *xs):
        return sum((p.float() * x).sum() for p, x in zip(self.model, xs))


def make_trainer(case, device="cuda"):
    return LeanTrainer(case, device) if case in LEAN else Trainer(case, device)


CASES = list(RECIPES) + list(LEAN)


# --- on the CPU: the snapshot and the eager steps ----------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_the_snapshot_covers_every_state_tensor(case):
    """Every tensor the optimizer and the scaler hold after steps (an overflow step
    included) is in the snapshot the graph tests compare, under the names they read,
    but the scaler's last overflow flag (a new tensor each update, not state). On the
    CPU, so that a state tensor renamed or added fails here too, not first on a GPU."""
    trainer = make_trainer(case, "cpu")
    for step in range(OVERFLOW_STEPS[0] + 1):
        trainer.step(*trainer.inputs(step))
    live = trainer.live_state()
    assert {"param0", "applied_steps", "scale", "growth_tracker"} <= set(live)
    if isinstance(trainer.scaler, mixedprec.GradScaler):
        assert "hysteresis_tracker" in live
    covered = {id(t) for t in live.values()}
    if isinstance(trainer.scaler, mixedprec.GradScaler):
        covered.add(id(trainer.scaler.found_inf()))
    held = dict(held_tensors(trainer.opt, "opt"), **held_tensors(trainer.scaler, "scaler"))
    assert any(path.startswith("opt.state") for path in held)
    missing = sorted(path for path, t in held.items() if id(t) not in covered)
    assert not missing, f"tensors held but not in the snapshot: {missing}"


@pytest.mark.parametrize("case", CASES)
def test_the_eager_steps_the_replays_follow(case):
    """What the graph tests assume of the eager steps, on the CPU: the params move in
    every step but the overflow steps, which write nothing the snapshot holds but the
    scaler's state, and the scale both grows and backs off."""
    trainer = make_trainer(case, "cpu")
    for _ in range(2):  # (the graph tests' warm-up)
        trainer.step(*trainer.inputs(-1))
    scales = []
    for step in range(STEPS):
        before = trainer.snapshot()
        trainer.step(*trainer.inputs(step))
        after = trainer.snapshot()
        moved = [name for name in before if not torch.equal(after[name], before[name])
                 and name not in scaler_state(trainer.scaler)]
        if step in OVERFLOW_STEPS:
            assert moved == [], f"step {step}"
        else:
            assert any(name.startswith("param") for name in moved), f"step {step}"
        scales.append(trainer.scaler.get_scale())
    assert any(b > a for a, b in zip(scales, scales[1:])), scales
    assert any(b < a for a, b in zip(scales, scales[1:])), scales


# --- CUDA graphs -------------------------------------------------------------------------

def warm_up_and_capture(trainer, static, warmup=2):
    """``warmup`` steps on a side stream (optimizer state, plans, scale and trackers are
    created there), as torch's CUDA graph notes ask, then one step captured; returns
    the graph and the captured step's loss."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            trainer.step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    trainer.opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = trainer.step(*static)
    return graph, static_loss


@pytest.mark.parametrize("case", CASES)
def test_captured_step_replays_like_eager(cuda, case):
    eager, graphed = make_trainer(case), make_trainer(case)
    assert_same_snapshot(eager.snapshot(), graphed.snapshot(), "initial state")

    static = [t.clone() for t in eager.inputs(-1)]
    for _ in range(2):  # the same warm-up steps as the graphed twin's
        eager.step(*eager.inputs(-1))
    graph, static_loss = warm_up_and_capture(graphed, static)
    # Capturing records the step without running it.
    torch.cuda.synchronize()
    assert_same_snapshot(eager.snapshot(), graphed.snapshot(), "after warm-up and capture")

    scales = []
    for step in range(STEPS):
        inputs = eager.inputs(step)
        before = eager.snapshot()
        eager_loss = eager.step(*inputs)
        params_moved = any(not torch.equal(eager.snapshot()[name], before[name])
                           for name in before if name.startswith("param"))
        # The eager run itself skipped exactly the overflow steps.
        assert params_moved == (step not in OVERFLOW_STEPS), f"step {step}"
        for s, t in zip(static, inputs):
            s.copy_(t)
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
    static = [t.clone() for t in trainer.inputs(-1)]
    graph, _ = warm_up_and_capture(trainer, static)

    static[0].copy_(trainer.inputs(OVERFLOW_STEPS[0])[0])
    torch.cuda.synchronize()
    before = trainer.snapshot()
    graph.replay()
    torch.cuda.synchronize()
    after = trainer.snapshot()
    for name in before:
        if name not in scaler_state(trainer.scaler):  # the update was skipped on the device
            assert_bitwise_equal(after[name], before[name], msg=name)
    # hysteresis=2: the first overflow counts down the tracker but keeps the scale.
    assert_bitwise_equal(after["scale"], before["scale"], msg="scale")
    assert after["growth_tracker"].item() == 0
    assert after["hysteresis_tracker"].item() == 1
    graph.replay()  # the second overflow in a row backs off
    assert trainer.scaler.get_scale() == before["scale"].item() / 2


@pytest.mark.parametrize("case", list(LEAN))
def test_first_step_captured_makes_the_state_in_the_graph(cuda, case):
    """The very first step captured: the optimizer's state, its plan (rounding words
    included) and the scale are made inside the capture, with no host data. One replay
    gives the bits of the eager first step, and eager steps go on from what it left
    (overflow steps included). (The stochastic and 8-bit modes need rounding words made
    without host data: lean.py's _salts.)"""
    warm = make_trainer(case)  # another optimizer: the kernels loaded before the capture
    for step in range(2):
        warm.step(*warm.inputs(step))
    torch.cuda.synchronize()

    eager, graphed = make_trainer(case), make_trainer(case)
    static = graphed.inputs(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = graphed.step(*static)
    graph.replay()
    eager_loss = eager.step(*eager.inputs(0))
    torch.cuda.synchronize()
    assert_bitwise_equal(static_loss, eager_loss, msg="loss of the first step")
    assert_same_snapshot(eager.snapshot(), graphed.snapshot(), "after the replayed first step")

    for step in range(1, OVERFLOW_STEPS[1] + 2):
        eager.step(*eager.inputs(step))
        graphed.step(*graphed.inputs(step))
        torch.cuda.synchronize()
        assert_same_snapshot(eager.snapshot(), graphed.snapshot(), f"after step {step}")
