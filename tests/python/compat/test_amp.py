"""mixedprec.amp on the host: overflow reports (once, rate-limited, one summary at verbosity
1 and at exit), no host read of a device value in a step with a fused optimizer (the
SyncDetector, which ops/test_stochastic_rounding.py imports from here), and a legacy
Apex script run through ``python -m mixedprec.apex``. (The other amp tests:
test_amp_opt_levels.py, test_amp_initialize.py, test_amp_scale_loss.py,
test_amp_state_dict.py.)

Every test runs on the CPU; those taking the ``device`` fixture have a CUDA twin that
skips on a machine without a GPU."""

import contextlib
import linecache
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from amp_common import (
    FUSED,
    batch,
    loss_scale,
    make_mlp,
    poison,
    setup,
    train_step,
)

import mixedprec
from mixedprec import amp

pytestmark = pytest.mark.usefixtures("one_thread", "forget_pending_registrations")


REPO = Path(__file__).resolve().parents[3]
PKG_DIR = os.path.dirname(os.path.abspath(mixedprec.__file__))
THIS_FILE = os.path.abspath(__file__)


# --- overflow reporting ------------------------------------------------------------------------

def test_overflow_is_reported_once(caplog):
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    # A small initial scale: no step overflows unless told to.
    model, opt, _ = setup("O1", torch.float16, "SGD", "cpu", max_loss_scale=2.0**8,
                          verbosity=2)
    for step in range(4):
        train_step(model, opt, step)
    assert [r for r in caplog.records if r.name == "mixedprec.amp"] == []
    scale = loss_scale()
    train_step(model, opt, 4, overflow=True)
    records = [r for r in caplog.records if r.name == "mixedprec.amp"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "overflow" in message.lower() and f"{scale / 2:g}" in message


def test_overflow_reports_are_rate_limited(caplog):
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    model, opt, _ = setup("O2", torch.float16, "FusedAdam", "cpu", min_loss_scale=1.0,
                          max_loss_scale=2.0**8, verbosity=2)
    train_step(model, opt, 0)
    assert caplog.records == []
    for step in range(10):
        train_step(model, opt, step, overflow=True)
    records = [r for r in caplog.records if r.name == "mixedprec.amp"]
    assert 1 <= len(records) < 10, [r.getMessage() for r in records]
    assert all(r.levelno == logging.WARNING for r in records)
    # Once the interval has passed, the next message counts the skips in between.
    suppressed = 10 - len(records)
    amp._current.reporter.last_log = -float("inf")
    caplog.clear()
    train_step(model, opt, 10, overflow=True)
    records = [r for r in caplog.records if r.name == "mixedprec.amp"]
    assert len(records) == 1
    assert f"({suppressed} more since the last message)" in records[0].getMessage()


@pytest.mark.parametrize("opt_name", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("per_param", [False, True])
def test_verbosity_1_gives_one_summary(caplog, opt_name, per_param):
    """The default verbosity: no line per skipped step, one summary (at exit) of the
    skipped steps and the scale; overflow_report=True counts per parameter and names
    them."""
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    model, opt, _ = setup("O2", torch.float16, opt_name, "cpu", min_loss_scale=1.0,
                          max_loss_scale=2.0**8, verbosity=1, overflow_report=per_param)
    for step in range(8):
        train_step(model, opt, step, overflow=step in (2, 3, 6))
    assert [r for r in caplog.records if r.name == "mixedprec.amp"] == []
    report = amp.overflow_report()
    assert (report["steps"], report["skipped"]) == (8, 3)
    assert report["overflows"] == ({"fc1.weight": 3} if per_param else {})
    assert report["scale"] == dict(current=32.0, min=32.0, max=256.0, backoffs=3, growths=0)
    amp._current.log_summary()  # what runs at exit
    records = [r.getMessage() for r in caplog.records if r.name == "mixedprec.amp"]
    names = "; overflows: fc1.weight 3" if per_param else ""
    assert records == ["amp: 3 of 8 steps skipped (37.5%); scale 32 (min 32, max 256, 3 "
                       f"backoffs, 0 growths){names}"]


def test_verbosity_0_is_silent_and_counts_no_parameter(caplog):
    caplog.set_level(logging.WARNING, logger="mixedprec.amp")
    model, opt, _ = setup("O2", torch.float16, "FusedSGD", "cpu", max_loss_scale=2.0**8)
    for step in range(3):
        train_step(model, opt, step, overflow=step == 1)
    assert caplog.records == []
    report = amp.overflow_report(scale=False)
    assert report == {"steps": 3, "skipped": 1, "overflows": {}}
    with pytest.raises(ValueError, match="verbosity"):
        amp.initialize(make_mlp(0), opt_level="O2", verbosity=-1)


def test_the_summary_is_logged_at_exit(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import mixedprec
        from mixedprec import amp
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        opt = mixedprec.FusedAdam(model.parameters(), lr=1e-3)
        model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.0**8,
                                    overflow_report=True)
        for step in range(4):
            opt.zero_grad()
            with amp.scale_loss(model(torch.ones(2, 4)).float().sum(), opt) as scaled:
                scaled.backward()
                if step == 1:
                    model[1].weight.grad.view(-1)[0] = float("inf")
            opt.step()
        print("done")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(mixedprec.__file__).parents[1])),
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    assert "amp: 1 of 4 steps skipped (25.0%); scale 128 (min 128, max 256, 1 backoffs, " \
        "0 growths); overflows: 1.weight 1" in out.stderr


@pytest.mark.parametrize("per_param", [False, True])
def test_no_host_read_in_a_step_at_verbosity_1(monkeypatch, per_param):
    from helpers import forbid_host_sync
    model, opt, _ = setup("O2", torch.float16, "FusedAdam", "cpu", max_loss_scale=2.0**8,
                          verbosity=1, overflow_report=per_param)
    train_step(model, opt, 0)
    with forbid_host_sync(monkeypatch):
        for step in range(1, 4):
            train_step(model, opt, step, overflow=step == 2)
    report = amp.overflow_report()
    assert report["skipped"] == 1
    assert report["overflows"] == ({"fc1.weight": 1} if per_param else {})


# --- no host synchronisation with fused optimizers --------------------------------------------

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
                "__index__")


class SyncDetector:
    """Wraps torch.Tensor's host-reading methods. While armed, on the CPU it records every
    call made, directly or through torch, from mixedprec's code (its innermost frame in
    the package) on a line not marked ``# sync-ok``; on CUDA it also records every call on
    a device tensor."""

    def __init__(self, monkeypatch):
        self.armed = False
        self.calls = []
        for name in SYNC_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, original):
        detector = self

        def wrapper(tensor, *args, **kwargs):
            if detector.armed:
                detector._check(name, tensor)
            return original(tensor, *args, **kwargs)
        return wrapper

    def _check(self, name, tensor):
        if tensor.device.type != "cpu":
            self.calls.append((name, str(tensor.device), "any caller"))
        frame = sys._getframe(2)  # the caller of the wrapped method
        while frame is not None:
            filename = os.path.abspath(frame.f_code.co_filename)
            if filename == THIS_FILE:
                return
            if filename.startswith(PKG_DIR + os.sep):
                line = linecache.getline(filename, frame.f_lineno)
                if "# sync-ok" not in line:
                    self.calls.append((name, f"{filename}:{frame.f_lineno}", line.strip()))
                return
            frame = frame.f_back


@contextlib.contextmanager
def armed(detector, device):
    detector.armed = True
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        detector.armed = False
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def synced_steps(model, opt, device, detector, steps, overflow_at=()):
    """Training steps with the detector armed (and, on CUDA, the sync debug mode
    raising) around the scale_loss exit and the optimizer step."""
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, device)
        loss = F.mse_loss(model(x).float(), y)
        with contextlib.ExitStack() as stack:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if step in overflow_at:
                    poison(model)
                stack.enter_context(armed(detector, device))
            opt.step()


def add_host_read(monkeypatch, target, name):
    """Replaces ``target.name`` by a version that first calls ``.item()`` on its
    one-element tensor arguments, from code that claims to live in target's module file
    (as if someone had added the read there)."""
    filename = sys.modules[target.__module__].__file__
    namespace = {"original": getattr(target, name), "torch": torch}
    source = ("def patched(self, *args):\n"
              "    [a.item() for a in args if isinstance(a, torch.Tensor) and a.numel() == 1]\n"
              "    return original(self, *args)\n")
    exec(compile(source, filename, "exec"), namespace)
    monkeypatch.setattr(target, name, namespace["patched"])
    return os.path.abspath(filename)


@pytest.mark.parametrize("opt_name", FUSED)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_optimizers_never_read_device_values(device, level, opt_name, monkeypatch):
    model, opt, _ = setup(level, torch.float16, opt_name, device)
    detector = SyncDetector(monkeypatch)
    if device == "cuda":  # the loss scale moves to the device at the first scale_loss
        train_step(model, opt, 0, device)
    synced_steps(model, opt, device, detector, 6, overflow_at=(2, 3))
    assert detector.calls == [], detector.calls
    assert loss_scale() <= 2.0**14  # the overflows were seen

    # The check is not vacuous: a host read added to the scale_loss exit (the loss
    # scaler's update) or to the optimizer step (its op call, planned by the earlier
    # steps) is caught.
    for target, name in ((amp.LossScaler, "update"), (type(opt), "_run_plan")):
        with monkeypatch.context() as patch:
            filename = add_host_read(patch, target, name)
            detector.calls.clear()
            try:
                synced_steps(model, opt, device, detector, 1)
            except RuntimeError:  # CUDA's sync debug mode
                assert device == "cuda"
            else:
                assert any(c[1].startswith(filename) or device == "cuda" and c[2] == "any caller"
                           for c in detector.calls), f"an .item() in {name} went unnoticed"


# --- legacy Apex script ------------------------------------------------------------------------

LEGACY_SCRIPT = """
import torch
from apex import amp
from apex.optimizers import FusedAdam

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16),
                            torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = FusedAdam(model.parameters(), lr=1e-2)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
x = torch.randn(64, 4)
y = x.sum(1, keepdim=True)
losses = []
for _ in range(40):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
assert losses[-1] < 0.5 * losses[0], losses
assert model[0].weight.dtype == torch.float16
checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "amp": amp.state_dict()}
amp.load_state_dict(checkpoint["amp"])
print("LEGACY-AMP-OK", checkpoint["amp"]["loss_scaler0"]["loss_scale"])
"""


def test_legacy_apex_script_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LEGACY_SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "mixedprec.apex", str(script)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "LEGACY-AMP-OK" in result.stdout, result.stdout + result.stderr
