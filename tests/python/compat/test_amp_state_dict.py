"""Checkpoints through mixedprec.amp: model, optimizer and amp state dicts resume a run bit
for bit; amp.state_dict() (loss scalers, the masters of torch optimizers) and
load_state_dict's checks, all or nothing; the loss scalers as faces on LossScale.

Every test runs on the CPU; those taking the ``device`` fixture have a CUDA twin that
skips on a machine without a GPU."""

import itertools

import pytest
import torch
from amp_common import (
    HALF_DTYPES,
    OPTIMIZERS,
    assert_identical,
    clone_tree,
    level_kwargs,
    make_mlp,
    scaler_state,
    setup,
    snapshot,
    train_step,
)

from mixedprec import amp

pytestmark = pytest.mark.usefixtures("one_thread", "forget_pending_registrations")


# --- checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_name", ["Adam", "FusedAdam"])
def test_checkpoint_resume_is_bit_exact(device, opt_name, half, tmp_path):
    steps, k = 7, 4
    extra = dict(loss_scale="dynamic")  # bf16 too, so that the scale is checkpointed

    def run(model, opt, start, stop):
        return [train_step(model, opt, s, device, overflow=(s == 1)) for s in range(start, stop)]

    model, opt, _ = setup("O2", half, opt_name, device, **extra)
    ref_losses = run(model, opt, 0, steps)
    reference = snapshot(model, opt, buffers=True)
    ref_scale = scaler_state()

    model, opt, _ = setup("O2", half, opt_name, device, **extra)
    first = run(model, opt, 0, k)
    saved_scale = scaler_state()
    assert saved_scale[0] == 2.0**15  # the overflow at step 1
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "amp": amp.state_dict()}, path)
    del model, opt

    # Everything fresh (other initial weights), then the three state dicts.
    model, opt, _ = setup("O2", half, opt_name, device, seed=123, **extra)
    assert scaler_state() == (2.0**16, 0)
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    assert scaler_state() == saved_scale
    rest = run(model, opt, k, steps)

    assert_identical(first + rest, ref_losses, "losses")
    assert_identical(snapshot(model, opt, buffers=True), reference, "state after resuming")
    assert scaler_state() == ref_scale


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_a_model_loaded_after_initialize_is_what_trains(device, half):
    """O2 with a torch optimizer, resumed from the model's and the optimizer's state
    dicts without amp's (as GNMT resumes): the steps start from the loaded weights (Apex
    made the masters at the first scale_loss, from the model's weights then), as if
    those weights had been the model's at initialize. Before, the masters made at
    initialize wrote the other initial weights back at the first step."""
    model, opt, _ = setup("O2", half, "Adam", device)
    for s in range(3):
        train_step(model, opt, s, device)
    saved = clone_tree({"model": model.state_dict(), "optimizer": opt.state_dict()})

    def resume(model, opt):
        opt.load_state_dict(clone_tree(saved["optimizer"]))  # (torch's Adam steps its 'step')
        losses = [train_step(model, opt, s, device) for s in range(3, 6)]
        return losses, snapshot(model, opt)

    # (initial weights far from the saved ones: a master keeps its fp32 value where the
    # loaded weight is its rounding, as fp32 masters do after any write)
    model = make_mlp(123, device)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0).add_(5.0)
    model, opt = amp.initialize(model, OPTIMIZERS["Adam"](model.parameters()),
                                **level_kwargs("O2", half))
    model.load_state_dict(saved["model"])  # after initialize
    after = resume(model, opt)
    model = make_mlp(123, device)
    model.load_state_dict(saved["model"])  # before initialize (cast to fp32 exactly)
    model, opt = amp.initialize(model, OPTIMIZERS["Adam"](model.parameters()),
                                **level_kwargs("O2", half))
    assert_identical(after, resume(model, opt), "resumed run")


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_a_write_of_the_same_weights_keeps_the_exact_masters(device, half):
    """O2 with a torch optimizer: the model's own weights written again after
    initialize (DDP's first broadcast, a load of the same checkpoint) leave the fp32
    masters exact: the run is the undisturbed one's bit for bit."""
    runs = []
    for rewrite in (False, True):
        model, opt, _ = setup("O2", half, "Adam", device)
        if rewrite:
            model.load_state_dict(model.state_dict())
        losses = [train_step(model, opt, s, device) for s in range(3)]
        runs.append((losses, snapshot(model, opt)))
    assert_identical(runs[1], runs[0], "rewritten run")


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_a_cast_model_saves_fp32_as_apex_did(level, half):
    """Apex's O2StateDictHook: after initialize casts the model, model.state_dict() holds
    fp32 tensors of the same values (checkpoints keep their dtypes); loaded back into the
    cast model they give its weights bit for bit."""
    model, opt, _ = setup(level, half, "Adam", "cpu")
    train_step(model, opt, 0)
    live = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    cast = {k: v.detach().clone() for k, v in live.items() if v.dtype == half}
    assert cast, "the model was cast"
    saved = model.state_dict()
    assert_identical({k: saved[k] for k in cast}, {k: v.float() for k, v in cast.items()},
                     "saved")
    model.load_state_dict(saved)
    live = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    assert_identical({k: live[k].detach() for k in cast}, cast, "reloaded")
    amp.initialize(model, None, **level_kwargs(level, half))  # again: one hook, not two
    assert len(model._state_dict_hooks) == 1


def test_amp_state_dict_carries_masters_of_torch_optimizers():
    model, opt, before = setup("O2", torch.float16, "Adam", "cpu")
    sd = amp.state_dict()
    assert set(sd) == {"loss_scaler0", "master_params0"}
    assert sd["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": 0}
    # One master per fp16 parameter (batchnorm's fp32 parameters are their own), exact.
    assert_identical(sd["master_params0"], [before[i] for i in (0, 1, 4, 5)])
    fused_model, fused_opt, _ = setup("O2", torch.float16, "FusedAdam", "cpu")
    assert set(amp.state_dict()) == {"loss_scaler0"}  # fused masters live in the optimizer
    assert all("master_param" in fused_opt.state[p] for p in fused_model.fc1.parameters())


def test_state_dict_needs_initialize(monkeypatch):
    monkeypatch.setattr(amp, "_current", None)  # as in a process that never initialized
    with pytest.raises(RuntimeError, match="initialize"):
        amp.state_dict()
    with pytest.raises(RuntimeError, match="initialize"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


def test_load_state_dict_with_another_number_of_loss_scalers_loads_them_in_order():
    """Apex warned and loaded the saved scalers in order into the first ones: a
    num_losses=1 checkpoint resumes a num_losses=2 run (the second keeps its state), and
    a num_losses=2 checkpoint a num_losses=1 run (its first scaler)."""
    setup("O2", torch.float16, "Adam", "cpu")
    one = dict(amp.state_dict(), loss_scaler0={"loss_scale": 8.0, "unskipped": 3})
    setup("O2", torch.float16, "Adam", "cpu", num_losses=2)
    second = scaler_state(1)
    with pytest.warns(UserWarning, match="holds 1 loss scalers .*initialized with 2"):
        amp.load_state_dict(one)
    assert scaler_state(0) == (8.0, 3) and scaler_state(1) == second
    two = dict(amp.state_dict(), loss_scaler1={"loss_scale": 4.0, "unskipped": 5})
    setup("O2", torch.float16, "Adam", "cpu")
    with pytest.warns(UserWarning, match="holds 2 loss scalers .*initialized with 1"):
        amp.load_state_dict(two)
    assert scaler_state(0) == (8.0, 3)
    with pytest.raises(ValueError, match=r"unexpected keys \['optimizer'\]"):
        amp.load_state_dict(dict(two, optimizer={}))
    assert scaler_state(0) == (8.0, 3)


def test_load_state_dict_rejects_a_mismatch():
    setup("O2", torch.float16, "Adam", "cpu")
    sd = amp.state_dict()
    model, opt, _ = setup("O2", torch.float16, "Adam", "cpu", seed=1)
    snap = snapshot(model, opt)
    scale = scaler_state()
    bad = dict(sd, loss_scaler0={"loss_scale": 8.0, "unskipped": 3},
               master_params0=sd["master_params0"][:-1])
    with pytest.raises(ValueError, match="master_params0"):
        amp.load_state_dict(bad)
    assert_identical(snapshot(model, opt), snap)
    assert scaler_state() == scale


@pytest.mark.parametrize("bad,match", [
    ({"loss_scale": -1.0, "unskipped": 0}, r"loss_scaler1 .*finite and > 0, got -1"),
    ({"loss_scale": float("inf"), "unskipped": 0}, r"loss_scaler1 .*finite and > 0, got inf"),
    ({"loss_scale": "big", "unskipped": 0}, r"loss_scaler1 .*number, got str"),
    ({"loss_scale": 8.0, "unskipped": -2}, r"loss_scaler1 .*int in \[0, 2\*\*31 - 1\], got -2"),
    ({"loss_scale": 8.0}, "loss_scaler1"),
    (None, "loss_scaler1"),
])
def test_load_state_dict_applies_all_or_nothing(bad, match):
    """A bad second loss scaler entry after a good first one: nothing is loaded."""
    model, opt, _ = setup("O2", torch.float16, "Adam", "cpu", num_losses=2)
    sd = amp.state_dict()
    good = dict(sd, loss_scaler0={"loss_scale": 8.0, "unskipped": 3},
                master_params0=[m + 1 for m in sd["master_params0"]])
    snap, scales = snapshot(model, opt), (scaler_state(0), scaler_state(1))
    with pytest.raises(ValueError, match=match):
        amp.load_state_dict(dict(good, loss_scaler1=bad))
    assert_identical(snapshot(model, opt), snap)
    assert (scaler_state(0), scaler_state(1)) == scales
    with pytest.raises(ValueError, match="master_params0"):  # a master of another dtype
        amp.load_state_dict(dict(good, master_params0=[m.long() for m in sd["master_params0"]]))
    assert (scaler_state(0), scaler_state(1)) == scales
    amp.load_state_dict(good)  # and the good one loads whole
    assert scaler_state(0) == (8.0, 3)
    assert_identical(list(amp.state_dict()["master_params0"]), good["master_params0"])


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd["loss_scaler1"].pop("unskipped"), "loss_scaler1 has no 'unskipped'"),
    (lambda sd: sd["loss_scaler1"].pop("loss_scale"), "loss_scaler1 has no 'loss_scale'"),
    (lambda sd: sd.__setitem__("loss_scaler1", [8.0, 0]),
     "expected loss_scaler1 to be a dict with 'loss_scale' and 'unskipped'"),
    (lambda sd: sd.__setitem__("scaler", {}), r"unexpected keys \['scaler'\]"),
    # (before: taken for scaler 0, shifting the real entries by one)
    (lambda sd: sd.__setitem__("loss_scalerX", {"loss_scale": 4.0, "unskipped": 0}),
     r"unexpected keys \['loss_scalerX'\]"),
], ids=["no_unskipped", "no_loss_scale", "a_list", "unexpected_key", "loss_scaler_not_a_number"])
def test_load_state_dict_names_a_missing_key(change, match):
    """A key missing from amp's state dict (or from one of its entries) is named, and
    nothing is loaded."""
    model, opt, _ = setup("O2", torch.float16, "Adam", "cpu", num_losses=2)
    sd = clone_tree(amp.state_dict())
    sd["loss_scaler0"] = {"loss_scale": 8.0, "unskipped": 3}
    sd["master_params0"] = [m + 1 for m in sd["master_params0"]]
    change(sd)
    snap, scales = snapshot(model, opt), (scaler_state(0), scaler_state(1))
    with pytest.raises(ValueError, match=match):
        amp.load_state_dict(sd)
    assert_identical(snapshot(model, opt), snap)
    assert (scaler_state(0), scaler_state(1)) == scales


@pytest.mark.parametrize("bad", [None, [], "amp.pt"])
def test_load_state_dict_of_what_is_not_a_dict(bad):
    setup("O2", torch.float16, "SGD", "cpu")
    scale = scaler_state()
    with pytest.raises(ValueError, match="expected state_dict to be a dict"):
        amp.load_state_dict(bad)
    assert scaler_state() == scale


def test_load_state_dict_checks_each_scale_against_its_own_bounds():
    """A saved scale below the raised floor of the second scaler: nothing is loaded
    (before, the check ran against default bounds and the first scaler was loaded)."""
    setup("O2", torch.float16, "FusedAdam", "cpu", num_losses=2, min_loss_scale=4.0)
    sd = amp.state_dict()
    scales = (scaler_state(0), scaler_state(1))
    bad = dict(sd, loss_scaler0={"loss_scale": 8.0, "unskipped": 3},
               loss_scaler1={"loss_scale": 2.0, "unskipped": 0})
    with pytest.raises(ValueError, match="loss_scaler1"):
        amp.load_state_dict(bad)
    assert (scaler_state(0), scaler_state(1)) == scales


def test_loss_scalers_are_faces_on_loss_scale():
    from mixedprec.loss_scale import DEFAULT_MIN_SCALE, LossScale
    setup("O2", torch.float16, "FusedAdam", "cpu", num_losses=2)
    scalers = amp._amp_state.loss_scalers
    assert len(scalers) == 2 and all(isinstance(s.core, LossScale) for s in scalers)
    core = scalers[0].core
    assert (core.growth_factor, core.backoff_factor, core.growth_interval) == (2.0, 0.5, 2000)
    assert (core.min_scale, core.max_scale) == (DEFAULT_MIN_SCALE, 2.0**24)
    value = scalers[1].loss_scale()
    assert type(value) is float and value == 2.0**16
    # A floor above Apex's start (min(2**16, max_loss_scale)) raises the start.
    setup("O2", torch.float16, "SGD", "cpu", min_loss_scale=2.0**20)
    assert scaler_state() == (2.0**20, 0)
