"""Lightning's Trainer with mixedprec (docs/integrations.md): ``precision="bf16-true"``
with fp32 masters and with each lean mode, ``16-mixed`` with ``mixedprec.GradScaler``
through ``MixedPrecision(scaler=...)``, and exact resume through Lightning's
checkpoints. The Trainer's result is compared, bit for bit, with the plain loop that
it stands for (same model, data, optimizer and steps). CPU, a tiny MLP, a few steps;
skipped without lightning."""

import math

import pytest
import torch
from helpers import assert_bitwise_equal, make_model
from torch.nn import functional as F

import mixedprec

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

BATCHES, BATCH = 4, 8  # an epoch
LR = 1e-2
SIZES = (8, 32, 1)  # the model: helpers.make_model's Sequential (Linear, Tanh, Linear)
INF_STEP = 5  # the 16-mixed runs' loss is inf at this (global) step: its update is skipped

# (master, state_dtype): fp32 masters, each lean mode, bf16 moments
MODES = [("fp32", torch.float32), ("kahan", torch.float32), ("stochastic", torch.float32),
         ("fp32", torch.bfloat16), ("kahan", torch.bfloat16)]
MODE_IDS = ["fp32-masters", "kahan", "stochastic", "fp32-masters-bf16-state",
            "kahan-bf16-state"]


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCHES * BATCH, 8, generator=g), torch.randn(BATCHES * BATCH, 1,
                                                                    generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def make_optimizer(params, master, state_dtype):
    seed = 7 if master == "stochastic" else None
    return mixedprec.optim.AdamW(params, lr=LR, weight_decay=0.1, master=master,
                                 state_dtype=state_dtype, seed=seed)


def loss_of(net, x, y, step, inject_inf):
    loss = F.mse_loss(net(x).float(), y.float())
    return loss * math.inf if inject_inf and step == INF_STEP else loss


class Module(L.LightningModule):
    def __init__(self, master="fp32", state_dtype=torch.float32, inject_inf=False):
        super().__init__()
        self.net = make_model(sizes=SIZES)
        self.master, self.state_dtype, self.inject_inf = master, state_dtype, inject_inf

    def training_step(self, batch, batch_idx):
        return loss_of(self.net, *batch, self.global_step, self.inject_inf)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.master, self.state_dtype)


class Snapshots(L.Callback):
    """The parameters after each step."""

    def __init__(self):
        self.params = []

    def on_train_batch_end(self, trainer, module, *args):
        self.params.append([p.detach().clone() for p in module.parameters()])


def trainer(epochs, precision=None, scaler=None, callbacks=(), tmp_path=None):
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if scaler is not None else None
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, precision=precision,
                     plugins=plugins, callbacks=list(callbacks), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path)


def plain_loop(epochs, master, state_dtype, dtype=None, scaler=None, inject_inf=False,
               clip=None):
    """What the Trainer stands for, written out: the parameters after `epochs`."""
    net = make_model(sizes=SIZES)
    if dtype is not None:
        net = net.to(dtype)
    opt = make_optimizer(net.parameters(), master, state_dtype)
    step = 0
    for _ in range(epochs):
        for x, y in data():
            if dtype is not None:
                x, y = x.to(dtype), y.to(dtype)
            opt.zero_grad()
            if scaler is None:
                loss_of(net, x, y, step, inject_inf).backward()
                opt.step()
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_of(net, x, y, step, inject_inf)
                scaler.scale(loss).backward()
                if clip is not None:
                    scaler.clip_grad_norm_(opt, clip)
                scaler.step(opt)
                scaler.update()
            step += 1
    return list(net.parameters()), opt


def assert_same_params(actual, expected):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_bitwise_equal(a.detach(), e.detach(), f"param {i}")


@pytest.mark.parametrize("master, state_dtype", MODES, ids=MODE_IDS)
def test_bf16_true_trains_bf16_weights_as_the_plain_loop(master, state_dtype):
    module = Module(master, state_dtype)
    trainer(2, precision="bf16-true").fit(module, data())
    params = list(module.parameters())
    expected, _ = plain_loop(2, master, state_dtype, dtype=torch.bfloat16)
    assert_same_params(params, expected)
    assert all(p.dtype == torch.bfloat16 for p in params)
    fresh = make_model(sizes=SIZES)[0].weight
    assert not torch.equal(params[0].float(), fresh.to(torch.bfloat16).float())
    # the optimizer Lightning stepped keeps what the mode says, beside the bf16 weights
    state = module.trainer.optimizers[0].state[params[0]]
    assert state["exp_avg"].dtype == state_dtype
    assert ("master_param" in state) == (master == "fp32")
    assert ("kahan_comp" in state) == (master == "kahan")
    if master == "fp32":
        assert state["master_param"].dtype == torch.float32
        assert_bitwise_equal(params[0].detach(), state["master_param"].to(torch.bfloat16))


def test_16_mixed_with_mixedprec_grad_scaler_skips_the_overflowing_step():
    scaler = mixedprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    snapshots = Snapshots()
    module = Module(inject_inf=True)
    trainer(2, scaler=scaler, callbacks=[snapshots]).fit(module, data())
    expected, _ = plain_loop(2, "fp32", torch.float32, inject_inf=True,
                             scaler=mixedprec.GradScaler("cpu", init_scale=2.0**10,
                                                         growth_interval=3))
    assert_same_params(module.parameters(), expected)
    # step INF_STEP changed nothing; the others did
    assert_same_params(snapshots.params[INF_STEP], snapshots.params[INF_STEP - 1])
    assert not torch.equal(snapshots.params[INF_STEP + 1][0], snapshots.params[INF_STEP][0])
    # steps 0-7: grows after the 3 clean steps 0-2 (x2), backs off at 5 (/2), and 6-7
    # are 2 clean steps: 2**10 again; the skipped step is not counted
    assert scaler.get_scale() == 2.0**10 and scaler._growth_tracker.item() == 2
    assert module.trainer.optimizers[0].state[module.net[0].weight]["step"] == 2 * BATCHES - 1


CLIP = 0.05  # below every step's gradient norm here: each step is clipped


class ClippingModule(Module):
    """Clips through the scaler: Lightning's own clip_gradients refuses, under 16-mixed,
    an optimizer that unscales inside its step."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        self.norms.append(self.trainer.precision_plugin.scaler.clip_grad_norm_(optimizer, CLIP))


def test_16_mixed_clips_through_the_scaler_in_configure_gradient_clipping():
    scaler = mixedprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    module = ClippingModule(inject_inf=True)
    module.norms = []
    trainer(2, scaler=scaler).fit(module, data())
    expected, _ = plain_loop(2, "fp32", torch.float32, inject_inf=True, clip=CLIP,
                             scaler=mixedprec.GradScaler("cpu", init_scale=2.0**10,
                                                         growth_interval=3))
    assert_same_params(module.parameters(), expected)
    assert len(module.norms) == 2 * BATCHES
    finite = [float(n) for i, n in enumerate(module.norms) if i != INF_STEP]
    assert min(finite) > CLIP and not math.isfinite(float(module.norms[INF_STEP]))
    unclipped, _ = plain_loop(2, "fp32", torch.float32, inject_inf=True,
                              scaler=mixedprec.GradScaler("cpu", init_scale=2.0**10,
                                                          growth_interval=3))
    assert not torch.equal(unclipped[0], expected[0])


RESUMES = [
    pytest.param("bf16-true", "fp32", torch.float32, id="bf16-true-fp32-masters"),
    pytest.param("bf16-true", "stochastic", torch.bfloat16, id="bf16-true-stochastic-bf16-state"),
    pytest.param("16-mixed", "fp32", torch.float32, id="16-mixed-grad-scaler"),
]


@pytest.mark.parametrize("precision, master, state_dtype", RESUMES)
def test_resume_from_a_lightning_checkpoint_is_exact(tmp_path, precision, master, state_dtype):
    def run(epochs, ckpt_path=None):
        scaler = None
        if precision == "16-mixed":  # (a fresh one: the checkpoint restores its state)
            scaler = mixedprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        module, steps = Module(master, state_dtype, inject_inf=precision == "16-mixed"), Snapshots()
        t = trainer(epochs, precision=None if scaler else precision, scaler=scaler,
                    callbacks=[steps], tmp_path=tmp_path)
        t.fit(module, data(), ckpt_path=ckpt_path)
        return t, module, scaler, len(steps.params)

    _, straight, straight_scaler, _ = run(3)
    first, _, _, _ = run(1)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    _, resumed, resumed_scaler, steps = run(3, ckpt_path=tmp_path / "epoch1.ckpt")
    assert steps == 2 * BATCHES and resumed.trainer.global_step == 3 * BATCHES
    assert_same_params(resumed.parameters(), straight.parameters())
    a = straight.trainer.optimizers[0].state_dict()["state"]
    b = resumed.trainer.optimizers[0].state_dict()["state"]
    for index in a:
        for key in a[index]:
            assert_bitwise_equal(b[index][key], a[index][key], f"state {index} {key}")
    if straight_scaler is not None:
        assert resumed_scaler.state_dict() == straight_scaler.state_dict()
