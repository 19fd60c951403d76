"""Smoke tests of the examples: each runs as a user would run it (a subprocess with
PYTHONPATH at the repository), cut down to seconds: the digits job of ``make demo``,
the ImageNet recipe on synthetic data (one process, and two under torchrun with
gloo) and the FP16_Optimizer recipe; and that scripts/gpu_check.sh parses. They
skip when an example's dependencies (torchvision, scikit-learn, matplotlib, tqdm)
are not installed."""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked import run_python
from helpers import missing_modules

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT = 240


def needs(*modules):
    missing = missing_modules(*modules)
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def run(args, cwd, timeout=TIMEOUT, expect_rc=0):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"  # tiny models; more threads only fight over the cores
    env["PYTHONUNBUFFERED"] = "1"  # a run that hangs still shows how far it got
    try:  # (as a new process runs it: forked.run_python)
        proc = run_python(args, cwd=cwd, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        output = "".join(s if isinstance(s, str) else (s or b"").decode(errors="replace")
                         for s in (e.stdout, e.stderr))
        raise AssertionError(f"timed out after {timeout} s; its output:\n{output[-6000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, (
        f"exit status {proc.returncode}, expected {expect_rc}:\n{output[-6000:]}")
    return output


# --- examples/digits (make demo) -----------------------------------------------------

@needs("sklearn", "matplotlib")
def test_digits_job_writes_table_plot_and_json(tmp_path):
    out = tmp_path / "digits"
    # Two epochs: enough for every run to be within a point of fp32, so that the
    # job's own accuracy check runs as in make demo.
    log = run([EXAMPLES / "digits" / "train.py", "--epochs", "2", "--out", out], tmp_path)

    runs = ["fp32", "O1-fp16", "O1-bf16", "O2-fp16", "O2-bf16", "bf16-none", "bf16-remainder"]
    for name in runs:
        assert name in log
    assert "PASS" in log
    table = (out / "table.txt").read_text()
    assert table.splitlines()[0].split()[:3] == ["run", "opt", "dtype"]
    assert [line.split()[0] for line in table.splitlines()[2:]] == runs

    png = (out / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    results = json.loads((out / "results.json").read_text())
    assert results["check"] == {"passed": True, "failures": []}
    by_name = {r["name"]: r for r in results["runs"]}
    assert list(by_name) == runs
    steps = 2 * math.ceil(1437 / 64)  # 2 epochs of 1437 training images, batch 64
    for r in results["runs"]:
        assert r["steps"] == steps
        assert len(r["history"]["step_loss"]) == len(r["history"]["loss_scale"]) == steps
        assert len(r["history"]["epoch_test_accuracy"]) == 2
        assert r["test_accuracy"] > 85.0
        assert r["test_accuracy"] >= by_name["fp32"]["test_accuracy"] - 3.0
    # Static scale 1 in fp32 and for bf16 weights; dynamic (from 2**16) otherwise.
    assert set(by_name["fp32"]["history"]["loss_scale"]) == {1.0}
    assert set(by_name["O2-bf16"]["history"]["loss_scale"]) == {1.0}
    assert by_name["O1-fp16"]["loss_scale_initial"] == 2.0**16
    for name in ("O1-fp16", "O2-fp16"):
        r = by_name[name]
        assert 2.0**10 <= r["loss_scale_final"] <= 2.0**16
        halvings = sum(1 for a, b in zip([r["loss_scale_initial"]] + r["history"]["loss_scale"],
                                         r["history"]["loss_scale"]) if b < a)
        assert r["skipped_steps"] == halvings
    for r in results["runs"]:  # amp's overflow report: a skipped step names its layers
        assert (r["skipped_steps"] == 0) == (r["overflows"] == {})
        assert all(0 < n <= r["skipped_steps"] for n in r["overflows"].values())
    # The bf16 runs' precision report, in their progress lines and results: bf16 without
    # masters loses updates, the remainders none.
    none, remainder = by_name["bf16-none"]["precision"], by_name["bf16-remainder"]["precision"]
    assert none["summary"] in log and remainder["summary"] in log
    assert sum(r["lost"] for r in none["layers"].values()) > 0
    assert all(r["lost"] == 0 for r in remainder["layers"].values())
    assert by_name["fp32"]["precision"] is None


@needs("sklearn")
def test_digits_job_fails_when_accuracy_drops(tmp_path):
    sys.path.insert(0, str(EXAMPLES / "digits"))
    try:
        import train as digits
    finally:
        sys.path.remove(str(EXAMPLES / "digits"))
        sys.modules.pop("train", None)

    def result(name, acc, losses=(1.0, 0.5)):
        return {"name": name, "test_accuracy": acc, "test_loss": losses[-1],
                "history": {"step_loss": list(losses)}}

    assert digits.check([result("fp32", 97.0), result("O2-fp16", 94.5)], 3.0) == []
    failures = digits.check([result("fp32", 97.0), result("O2-fp16", 93.9)], 3.0)
    assert len(failures) == 1 and "O2-fp16" in failures[0] and "3.10 points" in failures[0]
    failures = digits.check([result("fp32", 97.0), result("O1-fp16", 97.0, (1.0, float("nan")))],
                            3.0)
    assert failures == ["O1-fp16: a loss is not finite"]


# --- examples/imagenet/main_amp.py ---------------------------------------------------

MAIN_AMP = EXAMPLES / "imagenet" / "main_amp.py"
TINY = ["-a", "resnet18", "-b", "4", "-j", "0", "--epochs", "1", "--image-size", "32",
        "--synthetic-size", "16", "--num-batches", "2", "-p", "1", "--no-progress"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, script, *args, cwd):
    """`script` under torchrun, `nproc` processes on this host: a fixed local port rather
    than --standalone, whose rendezvous can hang at exit in sandboxes; --log-dir, as
    torchrun's agent otherwise leaves a torchelastic_* directory in /tmp."""
    return run(["-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                "--log-dir", cwd / "torchrun", script, *args], cwd)


def check_main_amp_log(log, iterations=2):
    assert f"Epoch: [0][{iterations}/{iterations}]" in log
    assert "images/s" in log
    prec = [line for line in log.splitlines() if line.startswith(" * Prec@1")]
    assert len(prec) == 1 and "Prec@5" in prec[0]


@needs("torchvision", "tqdm")
def test_main_amp_O0_synthetic(tmp_path):
    log = run([MAIN_AMP, *TINY, "--opt-level", "O0", "--checkpoint-dir", tmp_path / "ckpt"],
              tmp_path)
    assert "opt_level = O0" in log
    check_main_amp_log(log)
    checkpoint = torch.load(tmp_path / "ckpt" / "checkpoint.pth.tar", weights_only=False)
    assert checkpoint["epoch"] == 1 and checkpoint["opt_level"] == "O0"
    assert checkpoint["amp"]["loss_scaler0"]["loss_scale"] == 1.0


@needs("torchvision", "tqdm")
def test_main_amp_O2_bf16_synthetic_and_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    log = run([MAIN_AMP, *TINY, "--opt-level", "O2", "--bf16", "--channels-last",
               "--checkpoint-dir", ckpt], tmp_path)
    check_main_amp_log(log)
    checkpoint = torch.load(ckpt / "checkpoint.pth.tar", weights_only=False)
    # O2 in bf16: the model's state dict as fp32 (Apex's O2 state dict hook), fp32
    # masters in the amp state.
    state = checkpoint["state_dict"]
    assert state["conv1.weight"].dtype == torch.float32
    assert state["bn1.weight"].dtype == torch.float32
    masters = checkpoint["amp"]["master_params0"]
    assert masters and all(m.dtype == torch.float32 for m in masters)

    # Resume for a second epoch, then evaluate the resumed checkpoint.
    log = run([MAIN_AMP, *TINY, "--opt-level", "O2", "--bf16", "--epochs", "2",
               "--resume", ckpt / "checkpoint.pth.tar", "--checkpoint-dir", ckpt], tmp_path)
    assert "=> loaded checkpoint" in log and "(epoch 1)" in log
    assert "Epoch: [1][2/2]" in log and "Epoch: [0]" not in log
    assert torch.load(ckpt / "checkpoint.pth.tar", weights_only=False)["epoch"] == 2


@needs("torchvision", "tqdm")
def test_main_amp_torchrun_two_processes_gloo(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    log = torchrun(2, MAIN_AMP, *TINY, "--cpu", "--opt-level", "O2", "--bf16",
                   "--checkpoint-dir", tmp_path / "ckpt", cwd=tmp_path)
    check_main_amp_log(log)
    # Two processes of batch 4: the reported speed counts both.
    assert log.count("Epoch: [0][2/2]") == 1  # rank 0 prints, rank 1 does not
    assert (tmp_path / "ckpt" / "checkpoint.pth.tar").exists()


# --- examples/fp16_optimizer ---------------------------------------------------------

def test_fp16_optimizer_recipe(tmp_path):
    # fp16 convolutions are slow on CPUs: a few steps of the static-scale recipe...
    log = run([EXAMPLES / "fp16_optimizer" / "train.py", "--steps", "20", "--print-freq", "10",
               "--save", tmp_path / "fp16.pt"], tmp_path)
    assert "float16 model with fp32 masters, static loss scale 256" in log
    assert "step   20" in log and "loss scale 256" in log
    assert "reloaded" in log


def test_fp16_optimizer_recipe_dynamic_bf16(tmp_path):
    # ... and a longer dynamic-scale run in bf16, which must learn.
    log = run([EXAMPLES / "fp16_optimizer" / "train.py", "--steps", "40", "--bf16",
               "--dynamic-loss-scale", "--print-freq", "20"], tmp_path)
    assert "bfloat16 model with fp32 masters, dynamic loss scale from 65536" in log
    assert "step   40" in log


def test_gpu_check_script_parses_and_rejects_unknown_steps(tmp_path):
    """scripts/gpu_check.sh only runs on GPU machines; here: its syntax, and that a
    misspelt step fails at once, naming the steps, before building anything."""
    script = REPO / "scripts" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    proc = subprocess.run(["bash", str(script), "pytest", "benchmarks"], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, OUT=str(tmp_path)))
    assert proc.returncode == 2
    assert "unknown step 'benchmarks'" in proc.stderr
    assert "selfcheck pytest ctest memcheck racecheck synccheck bench-ops" in proc.stderr
    proc = subprocess.run(["bash", str(script), "pytest+memcheck+benchmark"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OUT=str(tmp_path)))
    assert proc.returncode == 2
    assert "unknown step 'benchmark'" in proc.stderr
    assert not (tmp_path / "gpu_check.log").exists()


# --- examples/fsdp -------------------------------------------------------------------

FSDP_TRAIN = EXAMPLES / "fsdp" / "train.py"
FSDP_TINY = ["--dim", "32", "--layers", "2", "--seq", "32", "--batch", "4", "--save-every", "3"]


def fsdp_run(nproc, *args, cwd):
    return torchrun(nproc, FSDP_TRAIN, *FSDP_TINY, *args, cwd=cwd)


def losses(log):
    return [line.split(" (")[0].strip() for line in log.splitlines()
            if line.strip().startswith("step ") and " loss " in line]


@needs("tqdm")
@pytest.mark.parametrize("precision", [["fp16"], ["bf16-masters"],
                                       ["bf16-lean", "--lean", "stochastic"]],
                         ids=["fp16", "bf16-masters", "bf16-lean-stochastic"])
def test_fsdp_example_resumes_from_its_checkpoint(tmp_path, precision):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    precision = ["--precision", *precision]
    straight = fsdp_run(2, "--steps", "6", *precision, "--checkpoint-dir", tmp_path / "a",
                        cwd=tmp_path)
    # The run interrupted after step 3: its checkpoint is the straight run's of step 3
    # (the schedule does not depend on --steps), taken instead of a third launch.
    shutil.copytree(tmp_path / "a" / "step_3", tmp_path / "b" / "step_3")
    (tmp_path / "b" / "latest").write_text("step_3")
    resumed = fsdp_run(2, "--steps", "6", *precision, "--resume",
                       "--checkpoint-dir", tmp_path / "b", cwd=tmp_path)
    assert "from step 3" in resumed
    # the interrupted run continues exactly: the same loss, to the printed digits
    assert losses(straight) == ["step 3 loss " + losses(straight)[0].split()[-1],
                                losses(resumed)[-1]]
    assert losses(resumed)[-1].startswith("step 6 loss ")
    # ... and a checkpoint of two processes loads into one (resharded by DCP) and trains on
    single = fsdp_run(1, "--steps", "8", *precision, "--resume",
                      "--checkpoint-dir", tmp_path / "a", cwd=tmp_path)
    assert "from step 6" in single and losses(single)[-1].startswith("step 8 loss ")
