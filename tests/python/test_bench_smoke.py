"""Smoke tests of the benchmarks (bench/ops.py, bench/train.py, bench/lean.py,
bench/q8_formats.py, bench/lean_speed.py, bench/host_step.py, bench/compile_step.py,
bench/memory.py) on the CPU.

They run each script's ``main`` with tiny settings into a temporary directory and
check what it writes: the JSON keys, the markdown tables (shaped like the seeds':
a Speed column and a 16/32 ratio per batch size) and the PNG chart. Nothing here is
timed. The GPU-only report paths (peak memory, largest batch, target verdicts) are
exercised on made-up numbers.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _load(name: str):
    module_name = f"mixedprec_bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@pytest.fixture(scope="module")
def bench_ops():
    return _load("ops")


@pytest.fixture(scope="module")
def bench_train():
    return _load("train")


def _needs_torchvision():
    return pytest.importorskip(
        "torchvision", reason="torchvision is not installed: the ResNet parts of the "
                              "benchmark smoke test are skipped")


ENV_KEYS = {"date", "device", "device_type", "driver", "torch", "cuda", "cudnn", "mixedprec"}


@pytest.mark.parametrize("name", ["ops", "train", "common", "lean", "q8_formats",
                                  "lean_speed", "host_step", "compile_step", "memory"])
def test_help(name):
    module = _load(name)
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0


def test_ops_smoke(bench_ops, tmp_path):
    threads = torch.get_num_threads()
    rc = bench_ops.main(["--device", "cpu", "--out", str(tmp_path), "--lists", "resnet50,flat-1b",
                         "--scale", "10000", "--warmup", "0", "--reps", "1"])
    assert rc == 0
    assert torch.get_num_threads() == threads  # restored
    data = json.loads((tmp_path / "ops-cpu.json").read_text())
    assert data["smoke"] is True
    assert ENV_KEYS <= set(data["env"])
    assert data["copy"]["gbps"] > 0
    assert data["checks"] and all(c["ok"] for c in data["checks"]), data["checks"]
    assert {c["name"] for c in data["checks"]} == set(bench_ops.CASES)

    results = data["results"]
    expected = {(lst, op, impl) for lst in ("resnet50", "flat-1b")
                for op, cases in bench_ops.CASES.items() for impl, _, _ in cases}
    assert {(r["list"], r["op"], r["impl"]) for r in results} == expected
    for r in results:
        assert "error" not in r, r
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["pct_copy"] > 0
        assert r["bytes"] == r["bytes_per_elem"] * r["numel"]
        assert not r.get("found_inf")
        if r["side"] == "mixedprec":
            assert r["speedup"] and r["speedup_vs_fastest_torch"] > 0
    assert data["config"]["lists"]["resnet50"]["tensors"] == 161
    assert data["config"]["bytes_per_elem"]["adam"]["mixedprec"] == 30  # DESIGN.md
    assert data["targets"] and all(t["passed"] is None for t in data["targets"])
    # The default --ops is every group, the modes too: on ResNet-50 only (flat 1B is
    # not one of their lists).
    assert list(data["modes"]["lists"]) == ["resnet50"]
    assert len(data["modes"]["rows"]) == len(bench_ops.mode_specs())

    md = (tmp_path / "ops-cpu.md").read_text()
    assert "CPU smoke run" in md
    assert "| Time (ms) | ResNet-50 | vs PyTorch | flat 1B | vs PyTorch |" in md
    assert "| adam: mixedprec check_finite_ + fused_adam_ |" in md
    assert "| Bandwidth | B/elem |" in md
    assert "Not evaluated: CPU smoke run." in md
    assert "## One optimizer step in every mode (`--ops modes`)" in md


def test_ops_lists(bench_ops):
    fixed = bench_ops.resnet50_shapes_fixed()
    assert len(fixed) == 161
    assert sum(bench_ops.numel(s) for s in fixed) == 25_557_032
    gpt = bench_ops.gpt2_medium_shapes()
    assert len(gpt) == 292
    assert 350e6 < sum(bench_ops.numel(s) for s in gpt) < 360e6
    small = bench_ops.scaled(gpt, 1000)
    assert len(small) == 292 and all(len(s) == 1 and s[0] >= 1 for s in small)
    # The modes group's smoke lists keep matrices 2-D (8-bit state takes only those),
    # the first dimension divided.
    kept = bench_ops.scaled(gpt, 1000, keep_dims=True)
    assert len(kept) == 292 and kept[:4] == [(50, 1024), (1, 1024), (1,), (1,)]
    assert [s for s in kept if len(s) == 2][:6] == [(50, 1024), (1, 1024), (1, 3072),
                                                     (1, 1024), (1, 4096), (4, 1024)]
    assert bench_ops.scaled(gpt, 1, keep_dims=True) == gpt


def test_ops_resnet50_shapes_match_torchvision(bench_ops):
    _needs_torchvision()
    shapes, source = bench_ops.resnet50_shapes()
    assert source == "torchvision"
    assert shapes == bench_ops.resnet50_shapes_fixed()


def test_ops_targets_on_gpu_numbers(bench_ops):
    """Target verdicts of a (made-up) GPU run: bandwidth on the large lists only (93%
    for adam), speed-up on every list (1.1x for adam, 1.3x on ResNet-50), and on
    ResNet-50 the optimizer-level call's latency; other rows are information only."""
    lists = {n: {"label": bench_ops.LIST_LABELS[n]} for n in ("resnet50", "gpt2-medium")}
    fused = "torch AdamW fused=True (+ check)"
    op_impl = "mixedprec check_finite_ + fused_adam_"
    opt_impl = "mixedprec FusedAdam.step (+ check)"
    results = [
        dict(list="resnet50", op="adam", side="mixedprec", impl=op_impl, median_ms=1.0,
             pct_copy=50.0, speedup={fused: 1.2}),
        dict(list="resnet50", op="adam", side="mixedprec", impl=opt_impl, median_ms=1.0,
             pct_copy=50.0, speedup={fused: 1.0}, latency_speedup={fused: 1.4}),
        dict(list="resnet50", op="unscale fp16", side="mixedprec", impl="x", median_ms=1.0,
             pct_copy=50.0, speedup={"t": 1.0}),
        dict(list="gpt2-medium", op="adam", side="mixedprec", impl=op_impl, median_ms=1.0,
             pct_copy=92.0, speedup={fused: 1.12}),
        dict(list="gpt2-medium", op="unscale fp16", side="mixedprec", impl="x", median_ms=1.0,
             pct_copy=90.0, speedup={"t": 0.99}),
        dict(list="gpt2-medium", op="adam", side="mixedprec", impl=opt_impl, median_ms=1.0,
             pct_copy=10.0, speedup={"x": 0.1}, latency_speedup={"x": 0.1}),
        dict(list="gpt2-medium", op="sum fp16", side="mixedprec", impl="mixedprec sum_fp32",
             median_ms=1.0, pct_copy=10.0, speedup={"x": 0.1}),
    ]
    targets = bench_ops.evaluate_targets(results, lists, smoke=False)
    verdicts = {t["target"]: t["passed"] for t in targets}
    assert verdicts == {
        f"adam on ResNet-50: >= 1.3x {fused}": False,
        f"adam on ResNet-50: {opt_impl} latency >= 1.3x {fused}'s": True,
        "unscale fp16 on ResNet-50: >= 1.0x t": True,
        "adam on GPT-2-medium: >= 93% of copy bandwidth": False,
        f"adam on GPT-2-medium: >= 1.1x {fused}": True,
        "unscale fp16 on GPT-2-medium: >= 90% of copy bandwidth": True,
        "unscale fp16 on GPT-2-medium: >= 1.0x t": False,
    }
    assert all(bench_ops.evaluate_targets(results, lists, smoke=True)[i]["passed"] is None
               for i in range(len(targets)))


# (stored, moved) bytes per element of every modes-group mode without 8-bit state:
# parameters + state, and what a step must move (params and state read and written,
# the gradient read; a parameter with an fp32 master only written).
MODE_BYTES = {
    ("AdamW", "torch", "fp32", None, "fp32"): (12, 28),
    ("AdamW", "torch", "bf16", None, "bf16"): (6, 14),
    ("AdamW", "mixedprec", "fp32", None, "fp32"): (12, 28),
    ("AdamW", "mixedprec", "fp32", None, "bf16"): (8, 20),
    ("AdamW", "mixedprec", "bf16", "fp32", "fp32"): (14, 28),
    ("AdamW", "mixedprec", "bf16", "fp32", "bf16"): (10, 20),
    ("AdamW", "mixedprec", "bf16", "none", "fp32"): (10, 22),
    ("AdamW", "mixedprec", "bf16", "none", "bf16"): (6, 14),
    ("AdamW", "mixedprec", "bf16", "kahan", "fp32"): (12, 26),
    ("AdamW", "mixedprec", "bf16", "kahan", "bf16"): (8, 18),
    ("AdamW", "mixedprec", "bf16", "stochastic", "fp32"): (10, 22),
    ("AdamW", "mixedprec", "bf16", "stochastic", "bf16"): (6, 14),
    ("AdamW", "mixedprec", "bf16", "remainder", "fp32"): (12, 26),
    ("AdamW", "mixedprec", "bf16", "remainder", "bf16"): (8, 18),
    ("SGD", "torch", "fp32", None, "fp32"): (8, 20),
    ("SGD", "torch", "bf16", None, "bf16"): (4, 10),
    ("SGD", "mixedprec", "fp32", None, "fp32"): (8, 20),
    ("SGD", "mixedprec", "fp32", None, "bf16"): (6, 16),
    ("SGD", "mixedprec", "bf16", "fp32", "fp32"): (10, 20),
    ("SGD", "mixedprec", "bf16", "fp32", "bf16"): (8, 16),
    ("SGD", "mixedprec", "bf16", "none", "fp32"): (6, 14),
    ("SGD", "mixedprec", "bf16", "none", "bf16"): (4, 10),
    ("SGD", "mixedprec", "bf16", "kahan", "fp32"): (8, 18),
    ("SGD", "mixedprec", "bf16", "kahan", "bf16"): (6, 14),
    ("SGD", "mixedprec", "bf16", "stochastic", "fp32"): (6, 14),
    ("SGD", "mixedprec", "bf16", "stochastic", "bf16"): (4, 10),
    ("SGD", "mixedprec", "bf16", "remainder", "fp32"): (8, 18),
    ("SGD", "mixedprec", "bf16", "remainder", "bf16"): (6, 14),
    ("LAMB", "mixedprec", "fp32", None, "fp32"): (12, 28),
    ("LAMB", "mixedprec", "bf16", "fp32", "fp32"): (14, 28),
    ("Adagrad", "torch", "fp32", None, "fp32"): (8, 20),  # fused and foreach
    ("Adagrad", "mixedprec", "fp32", None, "fp32"): (8, 20),
    ("Adagrad", "mixedprec", "bf16", "fp32", "fp32"): (10, 20),
    ("NovoGrad", "mixedprec", "fp32", None, "fp32"): (8, 20),
    ("NovoGrad", "mixedprec", "bf16", "fp32", "fp32"): (10, 20),
}


def _mode_id(row):
    return row["family"], row["impl"], row["params"], row["master"], row["state"]


def test_ops_modes_smoke(bench_ops, tmp_path):
    """``--ops modes``: every mode of every family steps on both lists (GPT-2-medium
    first; matrices kept 2-D, so some tensors take 8-bit state), bytes per element from
    what the storages hold, no step skipped, the roofline and the ratio to torch's
    fused AdamW on fp32, the targets listed but not evaluated on the CPU."""
    rc = bench_ops.main(["--device", "cpu", "--out", str(tmp_path), "--ops", "modes",
                         "--lists", "resnet50,gpt2-medium", "--warmup", "0", "--reps", "1"])
    assert rc == 0
    data = json.loads((tmp_path / "ops-cpu.json").read_text())
    assert data["results"] == [] and data["checks"] == []
    modes = data["modes"]
    assert list(modes["lists"]) == ["gpt2-medium", "resnet50"]
    assert modes["lists"]["gpt2-medium"]["tensors"] == 292
    assert modes["lists"]["resnet50"]["tensors"] == 161
    specs = bench_ops.mode_specs()
    assert len(specs) == 52 and len({s["key"] for s in specs}) == 52
    rows = modes["rows"]
    assert [(r["list"], r["key"]) for r in rows] == [
        (n, s["key"]) for n in ("gpt2-medium", "resnet50") for s in specs]
    stochastic = _stochastic_available()
    copy = data["copy"]["gbps"]
    for r in rows:
        if r["master"] == "stochastic" and not stochastic:
            assert r["status"].startswith("not available"), r
            continue
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["reps"] == 1
        assert r["bytes"] == pytest.approx(r["bytes_per_elem"] * r["numel"])
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["median_ms"] * 1e6))
        assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / copy)
        assert r["roofline_ms"] == pytest.approx(r["bytes"] / (copy * 1e6))
        # one step before the timing, then the timed ones; each counted where the
        # optimizer counts (torch's SGD does not)
        assert r["steps_called"] == 2
        assert r["steps_applied"] == (None if r["key"].startswith("torch SGD") else 2)
        assert "skipped_steps" not in r
        if r["state"] == "fp8":
            # some tensors hold 8-bit codes and a scale per 32: fewer bytes than fp32
            # moments, and not a whole number
            plain = next(x for x in rows if x["list"] == r["list"] and
                         _mode_id(x) == _mode_id(r)[:4] + ("fp32",))
            assert r["bytes_per_param"] < plain["bytes_per_param"], r["key"]
            assert r["bytes_per_param"] != round(r["bytes_per_param"]), r["key"]
        else:
            stored, moved = MODE_BYTES[_mode_id(r)]
            assert r["bytes_per_param"] == stored, r["key"]
            assert r["bytes_per_elem"] == moved, r["key"]
    for name in modes["lists"]:
        ref = next(r for r in rows if r["list"] == name and r["key"] == bench_ops.MODE_REFERENCE)
        assert ref["vs_torch_adamw_fp32"] == 1.0
    assert modes["copy_after"]["gbps"] > 0
    # a bandwidth line per mixedprec AdamW/SGD mode on GPT-2-medium, and the same-bytes
    # comparisons (AdamW, SGD: fp32 and bf16; Adagrad) on each list
    targets = modes["targets"]
    assert all(t["passed"] is None for t in targets)
    bandwidth = [t for t in targets if "% of copy at its" in t["target"]]
    assert len(bandwidth) == 36 and all("on GPT-2-medium" in t["target"] for t in bandwidth)
    same = [t["target"] for t in targets if "at the same bytes" in t["target"]]
    assert len(same) == 10
    # the precision report's cost: AdamW and SGD, every step and every 8th, each list
    report = [t["target"] for t in targets if "the speed without it" in t["target"]]
    assert len(report) == 8
    assert ("mixedprec.optim.AdamW(precision_report=8) (bf16 params, master none, bf16 "
            "state) on ResNet-50: costs <= 10% of the step (>= 0.91x the speed without "
            "it)") in report
    assert ("mixedprec.optim.AdamW (bf16 params, master none, bf16 state) on GPT-2-medium: "
            ">= 1.0x torch AdamW(fused=True) on bf16 params at the same bytes (14.00 vs "
            "14.00 B/elem)") in same

    md = (tmp_path / "ops-cpu.md").read_text()
    assert "CPU smoke run" in md and "## Time (median ms)" not in md
    assert "### GPT-2-medium: 292 tensors" in md and "matrices kept 2-D" in md
    assert ("| optimizer | params | master | state | B/param | B/elem | ms | at copy (ms) | "
            "GB/s | % copy | vs torch AdamW fp32 |") in md
    assert "| mixedprec.optim.AdamW | bf16 | remainder | bf16 | 8.00 | 18.00 |" in md
    assert "### Targets (modes; reported, not enforced)" in md
    assert md.count("Not evaluated: CPU smoke run.") == 1


def test_ops_modes_refused_skipped_and_failed(bench_ops, tmp_path, monkeypatch):
    """A combination the optimizer refuses (torch's fused Adagrad on CUDA: a RuntimeError
    at its first step) is "not available" and the run goes on; out of memory is an
    error, and a step the optimizer did not apply fails the run; modes past the time
    budget are skipped and marked."""
    cuda_message = ("`fused=True` requires all the params to be floating point Tensors of "
                    "supported devices: ['mps', 'xpu', 'hpu', 'cpu', 'mtia']")

    class Adagrad(torch.optim.Adagrad):
        def step(self, closure=None):
            if self.defaults.get("fused"):
                raise RuntimeError(cuda_message)
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "Adagrad", Adagrad)
    spec = next(s for s in bench_ops.mode_specs() if s["optimizer"].startswith("torch Adagrad(f"))
    shapes = bench_ops.scaled(bench_ops.resnet50_shapes_fixed(), 10000, keep_dims=True)
    cpu = torch.device("cpu")
    timer = bench_ops.C.Timer(cpu, warmup=0, min_reps=1, max_reps=1)
    row = bench_ops.run_mode(spec, shapes, cpu, timer, 1.0)
    assert row == {"status": f"not available: RuntimeError: {cuda_message}"}

    adamw = next(s for s in bench_ops.mode_specs() if s["key"] == bench_ops.MODE_REFERENCE)
    real = bench_ops._mode_optimizer

    def out_of_memory(spec, params):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(bench_ops, "_mode_optimizer", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        bench_ops.run_mode(adamw, shapes, cpu, timer, 1.0)

    class SkipsOne:  # drops its second step, as an overflow would
        def __init__(self, opt):
            self.opt, self.state, self.calls = opt, opt.state, 0

        def step(self):
            self.calls += 1
            if self.calls != 2:
                self.opt.step()

    monkeypatch.setattr(bench_ops, "_mode_optimizer", lambda s, p: SkipsOne(real(s, p)))
    row = bench_ops.run_mode(adamw, shapes, cpu, bench_ops.C.Timer(cpu, warmup=0, min_reps=2,
                                                                  max_reps=2), 1.0)
    assert (row["steps_called"], row["steps_applied"], row["skipped_steps"]) == (3, 2, 1)

    # Through main: the skipped step fails the run; a spent time budget marks the rest.
    rc = bench_ops.main(["--device", "cpu", "--out", str(tmp_path), "--ops", "modes",
                         "--lists", "resnet50", "--scale", "10000", "--warmup", "0",
                         "--reps", "2", "--time-budget", "0"])
    assert rc == 0  # (nothing ran: every mode past the budget)
    rows = json.loads((tmp_path / "ops-cpu.json").read_text())["modes"]["rows"]
    assert {r["status"] for r in rows} == {"skipped"}
    assert rows[0]["skipped"] == "time budget of 0 s spent"
    monkeypatch.setattr(bench_ops, "mode_specs", lambda: [adamw])
    rc = bench_ops.main(["--device", "cpu", "--out", str(tmp_path), "--ops", "modes",
                         "--lists", "resnet50", "--scale", "10000", "--warmup", "0",
                         "--reps", "2"])
    assert rc == 1
    md = (tmp_path / "ops-cpu.md").read_text()
    assert "(1 skipped!)" in md


def test_ops_modes_cpu_measurement_points_to_lean_speed(bench_ops):
    with pytest.raises(SystemExit, match="lean_speed.py"):
        bench_ops.main(["--device", "cpu", "--scale", "1", "--ops", "modes"])


def test_ops_modes_targets_on_gpu_numbers(bench_ops):
    """The modes' targets of a (made-up) GPU run: each mixedprec AdamW/SGD mode at
    least 85% of the copy at its own bytes on GPT-2-medium (not on ResNet-50), and at
    the same bytes as torch at least as fast as the fastest torch counterpart, on
    every list; torch's rows and LAMB get none; a mode with the precision report, at
    most 10% slower than the mode without it (here 2.5 ms against 2.0: missed)."""
    lists = {n: {"label": bench_ops.LIST_LABELS[n]} for n in ("gpt2-medium", "resnet50")}
    specs = {s["key"]: s for s in bench_ops.mode_specs()}
    none16 = "mixedprec.optim.AdamW | bf16 | none | bf16"
    torch16 = "torch AdamW(fused=True) | bf16 | - | bf16"
    lamb = "mixedprec.FusedLAMB | fp32 | - | fp32"
    rows = []
    for lname in lists:
        for key, ms, pct in ((none16, 2.0, 86.0), (torch16, 2.5, 70.0), (lamb, 9.0, 10.0)):
            rows.append(dict(list=lname, median_ms=ms, pct_copy=pct, bytes_per_elem=14.0,
                             **specs[key]))
    rows.append(dict(list="gpt2-medium", status="not available: x", **specs[
        "mixedprec.optim.AdamW | bf16 | remainder | fp8"]))
    report = "mixedprec.optim.AdamW(precision_report=True) | bf16 | none | bf16"
    rows.append(dict(list="gpt2-medium", median_ms=2.5, pct_copy=69.0, bytes_per_elem=14.0,
                     **specs[report]))
    targets = bench_ops.evaluate_mode_targets(rows, lists, smoke=False)
    verdicts = {t["target"]: (t["value"], t["passed"]) for t in targets}
    label = "mixedprec.optim.AdamW (bf16 params, master none, bf16 state)"
    assert verdicts == {
        "mixedprec.optim.AdamW(precision_report=True) (bf16 params, master none, bf16 "
        "state) on GPT-2-medium: costs <= 10% of the step (>= 0.91x the speed without "
        "it)": (0.8, False),
        f"{label} on GPT-2-medium: >= 85% of copy at its 14.00 B/elem": (86.0, True),
        f"{label} on GPT-2-medium: >= 1.0x torch AdamW(fused=True) on bf16 params at the "
        "same bytes (14.00 vs 14.00 B/elem)": (1.25, True),
        f"{label} on ResNet-50: >= 1.0x torch AdamW(fused=True) on bf16 params at the "
        "same bytes (14.00 vs 14.00 B/elem)": (1.25, True),
    }
    rows[0]["pct_copy"] = 80.0
    assert bench_ops.evaluate_mode_targets(rows, lists, smoke=False)[0]["passed"] is False
    assert all(t["passed"] is None for t in bench_ops.evaluate_mode_targets(rows, lists, True))
    data = dict(smoke=False, copy={"gbps": 4000.0},
                modes=dict(lists={n: dict(label=v["label"], tensors=1, numel=1, scale=1)
                                  for n, v in lists.items()},
                           copy_after={"gbps": 3990.0}, rows=rows, targets=targets))
    md = "\n".join(bench_ops.modes_markdown(data))
    assert "Copy: 4000.0 GB/s before the group, 3990.0 GB/s after it." in md
    assert "3 of 4 targets met." in md and "Not evaluated" not in md
    assert "| mixedprec.optim.AdamW | bf16 | remainder | fp8 |  |  | not available: x |" in md


def _check_train_outputs(bench_train, tmp_path, models, modes):
    data = json.loads((tmp_path / "train-cpu.json").read_text())
    assert data["smoke"] is True
    assert ENV_KEYS <= set(data["env"])
    runs = data["runs"]
    assert {(r["model"], r["mode"]) for r in runs} == {(m, o) for m in models for o in modes}
    for r in runs:
        assert r["status"] == "ok", r
        assert r["throughput"] > 0 and r["median_step_ms"] > 0 and r["batch"] == 2
        assert r["unit"] == ("img/s" if r["model"].startswith("resnet") else "tok/s")
        assert r["loss_end"] is not None
    assert data["max_batch"] == [] and "needs a GPU" in data["max_batch_note"]
    assert all(t["passed"] is None for t in data["targets"])
    md = (tmp_path / "train-cpu.md").read_text()
    assert "CPU smoke run" in md
    if HAS_MATPLOTLIB:
        png = (tmp_path / "train-cpu.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return data, md


def test_train_smoke_transformer(bench_train, tmp_path):
    modes = ["fp32", "amp", "o1", "o2", "none"]
    rc = bench_train.main(["--device", "cpu", "--out", str(tmp_path), "--models", "gpt-tiny",
                           "--lm-batch-sizes", "2", "--modes", ",".join(modes),
                           "--steps", "1", "--warmup", "0"])
    assert rc == 0
    data, md = _check_train_outputs(bench_train, tmp_path, ["gpt-tiny"], modes)
    assert data["config"]["dtype"] == "bfloat16"
    assert "| Speed (tok/s) | B=2 | 16/32 |" in md
    for label in ("GPTtiny-32", "GPTtiny-bf16 AMP", "GPTtiny-bf16 O1", "GPTtiny-bf16 O2"):
        assert f"| {label} |" in md
    o1 = next(r for r in data["runs"] if r["mode"] == "o1")
    assert o1["optimizer"] == "mixedprec.FusedAdam"
    # Mode none: bf16 without masters, its precision report in the results.
    none = next(r for r in data["runs"] if r["mode"] == "none")
    assert none["optimizer"] == "mixedprec.optim.AdamW(master='none')"
    assert none["precision"]["summary"].startswith("lost updates: ")
    assert 0 <= none["precision"]["lost_share"] <= 1 and none["precision"]["top"]
    assert o1["precision"] is None


def test_train_smoke_resnet(bench_train, tmp_path):
    _needs_torchvision()
    modes = ["fp32", "o1", "o2", "none"]
    rc = bench_train.main(["--device", "cpu", "--out", str(tmp_path), "--models", "resnet18",
                           "--batch-sizes", "2", "--image-size", "32", "--modes", ",".join(modes),
                           "--steps", "1", "--warmup", "0"])
    assert rc == 0
    data, md = _check_train_outputs(bench_train, tmp_path, ["resnet18"], modes)
    # shaped like the seeds: |   Speed   |  B=128 | 16/32 | ...
    assert "| Speed (img/s) | B=2 | 16/32 |" in md
    for label in ("Resnet18-32", "Resnet18-bf16 O1", "Resnet18-bf16 O2"):
        assert f"| {label} |" in md
    o2 = next(r for r in data["runs"] if r["mode"] == "o2")
    assert o2["channels_last"] is True
    assert o2["optimizer"] == "mixedprec.FusedSGD(momentum=0.9)"
    none = next(r for r in data["runs"] if r["mode"] == "none")
    assert none["channels_last"] is True and none["precision"]["top"]


def test_train_cpu_measure_is_a_result_with_torch_amp_beside_o1_o2(bench_train, tmp_path):
    """--measure on a CPU: not a smoke run, torch AMP beside O1/O2 by default."""
    rc = bench_train.main(["--device", "cpu", "--measure", "--out", str(tmp_path),
                           "--models", "gpt-tiny", "--lm-batch-sizes", "1", "--seq-len", "8",
                           "--steps", "1", "--warmup", "0"])
    assert rc == 0
    data = json.loads((tmp_path / "train-cpu.json").read_text())
    assert data["smoke"] is False
    assert data["config"]["modes"] == ["fp32", "amp", "o1", "o2"]
    md = (tmp_path / "train-cpu.md").read_text()
    assert "SMOKE" not in md and "the targets are the H100's" in md
    assert all(t["passed"] is None for t in data["targets"])


def test_train_report_on_gpu_numbers(bench_train, tmp_path):
    """The GPU-only parts of the report (peak memory, largest batch, target verdicts,
    chart) on made-up numbers."""
    def run(model, mode, batch, tput, mem):
        return dict(model=model, mode=mode, batch=batch, status="ok", throughput=tput,
                    unit="img/s", median_step_ms=1.0, peak_mem_gib=mem,
                    host_syncs_per_step=0 if mode != "o1" or batch == 128 else 2)
    runs = []
    for batch in (128, 256):
        for mode, speed in (("fp32", 1000), ("tf32", 1600), ("amp", 2600), ("o1", 2500),
                            ("o2", 2700), ("o3", 2900)):
            mem = 20.0 if mode in ("fp32", "tf32") else 11.0
            runs.append(run("resnet50", mode, batch, speed, mem))
    runs.append(dict(model="gpt2-small", mode="amp", batch=8, status="ok", throughput=100000.0,
                     unit="tok/s", median_step_ms=80.0, peak_mem_gib=30.0))
    runs.append(dict(model="gpt2-small", mode="o2", batch=8, status="ok", throughput=104000.0,
                     unit="tok/s", median_step_ms=78.0, peak_mem_gib=25.0))
    runs.append(dict(model="gpt2-small", mode="fp32", batch=8, status="oom", error="CUDA OOM"))
    maxb = [dict(model="resnet50", mode="fp32", status="ok", largest=700, smallest_failing=720,
                 exact=True, probes=[]),
            dict(model="resnet50", mode="o2", status="ok", largest=1400, smallest_failing=1440,
                 exact=True, probes=[])]
    targets = bench_train.evaluate_targets(runs, maxb, smoke=False)
    verdicts = {t["target"]: t["passed"] for t in targets}
    assert verdicts["Resnet50 B=128: O2 / AMP >= 1.05"] is False  # 2700 / 2600
    assert verdicts["Resnet50 B=256: O2 / AMP >= 1.05"] is False
    assert verdicts["Resnet50 B=256: O2 / FP32 >= 2.5"] is True
    assert verdicts["GPT2small B=8: O2 / AMP >= 1.05"] is False
    assert verdicts["Resnet50 largest batch: O2 / FP32 >= 1.8"] is True
    # One O1 run synchronised twice: the sync target fails on the worst run.
    sync_target = "O1/O2/O3: host syncs per step (most of any run, negated) >= 0"
    assert verdicts[sync_target] is False

    env = {"date": "2026-01-01T00:00:00+00:00", "device": "NVIDIA H100 80GB HBM3",
           "device_type": "cuda", "driver": "580", "torch": "2.11", "cuda": "13.0",
           "cudnn": 91900, "python": "3.12", "mixedprec": "0.1.0", "capability": "9.0",
           "multiprocessors": 132, "memory_gib": 79.2}
    data = dict(env=env, smoke=False, runs=runs, max_batch=maxb, max_batch_note="",
                targets=targets,
                config=dict(models=["resnet50", "gpt2-small"], modes=list(bench_train.MODES),
                            dtype="float16", steps=10, warmup=3, image_size=224))
    md = bench_train.markdown(data)
    assert "| Resnet50-16 O2 | 2,700 | 2.70 | 2,700 | 2.70 |" in md
    assert "| Memory (GiB) | B=128 | 16/32 | B=256 | 16/32 |" in md
    assert "| GPT2small-32 | oom |  |" in md
    assert "O2 / FP32: **2.00**" in md
    assert "| Resnet50-16 O1 | 256 | 2 |" in md
    assert "| Resnet50 largest batch: O2 / FP32 >= 1.8 | 2.00 | pass |" in md
    if HAS_MATPLOTLIB:
        assert bench_train.chart(data, tmp_path / "chart.png") is None
        assert (tmp_path / "chart.png").stat().st_size > 0


@pytest.fixture(scope="module")
def bench_lean():
    return _load("lean")


def _stochastic_available() -> bool:
    import mixedprec
    try:
        mixedprec.FusedAdam([torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)],
                            master="stochastic")
    except NotImplementedError:
        return False
    return True


def test_lean_quick(bench_lean, tmp_path):
    """``bench/lean.py --quick``: every model and mode runs (or stochastic rounding is
    reported unavailable, exactly when the build lacks it), the memory is measured from
    the tensors (bytes per parameter as docs/lean-precision.md counts them), and the
    markdown, JSON and PNG are written and parse."""
    pytest.importorskip("sklearn", reason="the digits model needs scikit-learn")
    models = ("digits,digits-mlp,lm,resnet18" if importlib.util.find_spec("torchvision")
              else "digits,digits-mlp,lm")
    # The bench at one thread (pytest runs a worker per core; bench/lean.py defaults to
    # two), the caller at another count, so that its restoring is seen whatever the
    # worker's share of the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert bench_lean.main(["--quick", "--device", "cpu", "--out", str(tmp_path),
                                "--threads", "1", "--models", models]) == 0
        assert torch.get_num_threads() == threads + 1  # restored
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "lean-cpu.json").read_text())
    assert data["smoke"] is True and ENV_KEYS <= set(data["env"])
    assert list(data["results"]) == models.split(",")
    stochastic = _stochastic_available()
    per_param = {"fp32": 12, "bf16-master": 14, "fp32-bf16mom": 8, "bf16-kahan": 12,
                 "bf16-stochastic": 10, "bf16-none": 10, "bf16-remainder": 12,
                 "bf16-remainder-bf16mom": 8, "bf16-master-bf16mom": 10,
                 "bf16-kahan-bf16mom": 8,
                 "bf16-stochastic-bf16mom": 6}  # Adam, fp32 moments unless named
    for model, res in data["results"].items():
        assert set(res) == set(bench_lean.MODES)
        for mode, r in res.items():
            if mode.startswith("bf16-stochastic") and not stochastic:
                assert r["status"] == bench_lean.UNAVAILABLE and not r["seeds"]
                continue
            assert r["status"] == "ok", (model, mode, r)
            assert not r["nonfinite"] and r["median_step_ms"] > 0
            numel = r["param_bytes"] // bench_lean.MODES[mode][0].itemsize
            assert r["numel"] == numel
            ref = bench_lean.counterpart(mode)
            if ref is None:
                assert r["q8_numel"] == 0
                assert r["total_bytes"] == per_param[mode] * numel, (model, mode)
            else:
                # 8-bit moments (e4m3 codes + an e8m0 scale per 32) in place of the two
                # fp32 moments, on the eligible parameters only (none of the digits CNN;
                # the digits MLP's two hidden weights: its quick head, 10 x 128, is small).
                q8 = r["q8_numel"]
                assert q8 % 32 == 0 and (q8 == 0) == (model == "digits"), (model, q8)
                if model == "digits-mlp":
                    h = data["config"]["mlp_hidden"]
                    assert q8 == 64 * h + h * h
                assert r["total_bytes"] == per_param[ref] * numel - 8 * q8 + 2 * q8 + q8 // 16
            seed = r["seeds"][0]
            assert len(seed["losses"]) == {"digits": data["config"]["digits_steps"],
                                           "digits-mlp": data["config"]["mlp_steps"],
                                           "lm": data["config"]["lm_steps"]}.get(
                model, data["config"]["rn_steps"] + data["config"]["rn_warmup"])
            if model in ("digits", "digits-mlp"):
                assert 0 <= r["metric_mean"] <= 100 and "accuracy_mean" not in r
            elif model == "lm":
                # Held-out loss, and next-byte accuracy beside it (per seed and per eval).
                assert 0 < r["metric_mean"] < 10 and seed["evals"]
                assert 0 <= r["accuracy_mean"] <= 100 and r["accuracy_spread"] == 0
                assert 0 <= seed["accuracy"] <= 100
                assert all(len(e) == 3 and 0 <= e[2] <= 100 for e in seed["evals"])
                assert seed["evals"][-1][1:] == [seed["metric"], seed["accuracy"]]
            else:
                assert r["metric_mean"] is None
    assert len(data["bar"]) == 6
    # 5 modes x (LM loss, LM accuracy, digits MLP, digits CNN)
    assert len(data["bar8"]) == 20
    assert {b["reference"] for b in data["bar8"]} == {
        "fp32", "bf16-master", "bf16-remainder", "bf16-kahan", "bf16-stochastic"}
    for b in data["bar8"]:
        assert (b["model"], b["metric"]) in {("lm", "metric"), ("lm", "accuracy"),
                                             ("digits-mlp", "metric"), ("digits", "metric")}
        if b["model"] == "digits":  # no eligible tensor: no verdict, not a pass
            assert b["passed"] is None and b["value"] is None
            assert b["status"].startswith(bench_lean.NO_ELIGIBLE)
        elif stochastic or "stochastic" not in b["mode"]:
            assert b["passed"] is not None and b["value"], b
    md = (tmp_path / "lean-cpu.md").read_text()
    assert "CPU smoke run" in md and "## The bar (issue #11)" in md
    assert "## The 8-bit moment bar (issue #20)" in md and "8-bit-moment modes:" in md
    assert "## Digits MLP, test accuracy (%)" in md
    assert "| mode | held-out loss (± half spread) | next-byte accuracy % (± half spread) |" in md
    assert "(LM next-byte accuracy)" in md and "(digits MLP test accuracy)" in md
    assert "no eligible tensor (8-bit moments on 0 of 3,866 elements" in md
    assert ("not available in this build" in md) == (not stochastic)
    if HAS_MATPLOTLIB:
        assert (tmp_path / "lean-cpu.png").stat().st_size > 0
    # --replot: the same markdown again from the JSON, without training.
    again = tmp_path / "replot"
    assert bench_lean.main(["--replot", str(tmp_path / "lean-cpu.json"), "--out", str(again)]) == 0
    assert (again / "lean-cpu.md").read_text() == md
    if HAS_MATPLOTLIB:
        assert (again / "lean-cpu.png").stat().st_size > 0


def test_lean_merge(bench_lean, tmp_path):
    """``--merge``: the modes run now replace the saved ones, the others (and the
    models not run now) are kept; a saved run of other sizes is refused."""
    pytest.importorskip("sklearn", reason="the digits model needs scikit-learn")
    base = ["--quick", "--device", "cpu", "--out", str(tmp_path), "--threads", "1"]
    assert bench_lean.main(base + ["--models", "digits,lm", "--modes", "fp32,bf16-master"]) == 0
    before = json.loads((tmp_path / "lean-cpu.json").read_text())
    assert bench_lean.main(base + ["--models", "digits", "--modes", "bf16-master,fp32-fp8mom",
                                   "--merge"]) == 0
    after = json.loads((tmp_path / "lean-cpu.json").read_text())
    assert list(after["results"]) == ["digits", "lm"]
    assert list(after["results"]["digits"]) == ["fp32", "bf16-master", "fp32-fp8mom"]
    assert after["results"]["lm"] == before["results"]["lm"]
    assert after["results"]["digits"]["fp32"] == before["results"]["digits"]["fp32"]
    assert after["results"]["digits"]["fp32-fp8mom"]["status"] == "ok"
    assert after["merged"]["kept"] == ["fp32"]  # (modes not run now)
    # Each result knows its run; step time ratios only within one run.
    assert after["results"]["digits"]["fp32"]["run_date"] == before["env"]["date"]
    assert after["results"]["digits"]["bf16-master"]["run_date"] == after["env"]["date"]
    assert "Runs merged here: " in (tmp_path / "lean-cpu.md").read_text()
    assert after["config"]["modes"] == ["fp32", "bf16-master", "fp32-fp8mom"]
    assert "Merged:" in (tmp_path / "lean-cpu.md").read_text()
    with pytest.raises(SystemExit, match="other sizes"):
        bench_lean.main(base + ["--models", "digits", "--modes", "fp32", "--seeds", "2",
                                "--merge"])
    # A saved run from before the digits MLP (no mlp_* sizes) and the LM's accuracy, on
    # another CPU: the new model is added in the models' order, the rest kept. (The saved
    # capability is one no machine reports, so that it differs from this machine's,
    # whichever instruction sets it has.)
    saved = json.loads((tmp_path / "lean-cpu.json").read_text())
    for k in [k for k in saved["config"] if k.startswith("mlp_")]:
        del saved["config"][k]
    saved["env"]["cpu_capability"] = "ELSEWHERE"
    lm_fp32 = saved["results"]["lm"]["fp32"]
    del lm_fp32["accuracy_mean"], lm_fp32["accuracy_spread"]
    for s in lm_fp32["seeds"]:
        del s["accuracy"]
    (tmp_path / "lean-cpu.json").write_text(json.dumps(saved))
    assert bench_lean.main(base + ["--models", "digits-mlp", "--modes", "fp32,fp32-fp8mom",
                                   "--merge"]) == 0
    last = json.loads((tmp_path / "lean-cpu.json").read_text())
    assert list(last["results"]) == ["digits", "digits-mlp", "lm"]
    assert list(last["results"]["digits-mlp"]) == ["fp32", "fp32-fp8mom"]
    assert last["results"]["digits"] == after["results"]["digits"]
    assert last["results"]["lm"]["fp32"] == lm_fp32
    assert last["merged"]["earlier_env"]["cpu_capability"] == "ELSEWHERE"
    assert last["merged"]["earlier_note"] == saved["note"]
    md = (tmp_path / "lean-cpu.md").read_text()
    assert "kept from the run of" in md and "digits (all its modes)" in md
    now = last["env"]["cpu_capability"]
    assert now == torch.backends.cpu.get_cpu_capability() != "ELSEWHERE"
    assert f"The kept run had another cpu_capability (ELSEWHERE; now {now})" in md
    assert "| fp32 | " in md and "| not measured |" in md  # the LM's fp32, kept
    bar8 = {(b["model"], b["metric"]): b for b in last["bar8"]}
    assert set(bar8) == {("digits-mlp", "metric"), ("digits", "metric")}  # (no LM fp8 mode)
    assert bar8["digits-mlp", "metric"]["passed"] is not None
    assert bar8["digits", "metric"]["passed"] is None


def test_lean_bar_on_made_up_numbers(bench_lean):
    """The bar's verdicts: 1% relative on the LM's loss, 0.5 points on digits' accuracy,
    the baseline visibly worse; a mode not run has no verdict."""
    def ok(v):
        return {"status": "ok", "metric_mean": v}
    results = {
        "lm": {"bf16-master": ok(2.0), "bf16-kahan": ok(2.019), "bf16-none": ok(2.05),
               "bf16-stochastic": {"status": bench_lean.UNAVAILABLE}},
        "digits": {"bf16-master": ok(97.0), "bf16-kahan": ok(96.4), "bf16-none": ok(96.8),
                   "bf16-stochastic": ok(97.5)},
    }
    got = {(b["model"], b["mode"]): b["passed"] for b in bench_lean.evaluate_bar(results)}
    assert got == {("lm", "bf16-kahan"): True, ("lm", "bf16-stochastic"): None,
                   ("lm", "bf16-none"): True, ("digits", "bf16-kahan"): False,
                   ("digits", "bf16-stochastic"): True, ("digits", "bf16-none"): False}


def test_lean_bar8_on_made_up_numbers(bench_lean):
    """Issue #20's bar: each fp8 mode against its fp32-moment counterpart, 0.5% relative
    on the LM's loss, 0.3 points on the accuracies (the LM's next-byte accuracy, the
    digits MLP's); better always passes; a model with no eligible tensor gets no verdict
    (not a pass), nor does a metric the kept run did not measure."""
    def ok(value, acc=None, q8=1024):
        seed = {"metric": value} if acc is None else {"metric": value, "accuracy": acc}
        r = {"status": "ok", "metric_mean": value, "numel": 2048, "q8_numel": q8,
             "seeds": [seed]}
        if acc is not None:
            r["accuracy_mean"] = acc
        return r
    results = {
        "lm": {"fp32": ok(2.0, 50.0), "fp32-fp8mom": ok(2.0098, 49.75),
               "bf16-master": ok(2.0, 50.0), "bf16-master-fp8mom": ok(2.0102, 49.65),
               "bf16-kahan": ok(2.0, 50.0), "bf16-kahan-fp8mom": ok(1.9, 51.0),
               "bf16-remainder": ok(2.0), "bf16-remainder-fp8mom": ok(2.0, 50.0),
               "bf16-stochastic": {"status": bench_lean.UNAVAILABLE},
               "bf16-stochastic-fp8mom": {"status": bench_lean.UNAVAILABLE}},
        "digits-mlp": {"fp32": ok(97.5), "fp32-fp8mom": ok(97.25),
                       "bf16-master": ok(97.5), "bf16-master-fp8mom": ok(97.1)},
        "digits": {"fp32": ok(97.3, q8=0), "fp32-fp8mom": ok(97.3, q8=0)},
    }
    bars = bench_lean.evaluate_bar8(results)
    got = {(b["model"], b["metric"], b["mode"]): b["passed"] for b in bars}
    assert got == {
        ("lm", "metric", "fp32-fp8mom"): True,  # +0.49%
        ("lm", "metric", "bf16-master-fp8mom"): False,  # +0.51%
        ("lm", "metric", "bf16-kahan-fp8mom"): True,  # better
        ("lm", "metric", "bf16-remainder-fp8mom"): True,
        ("lm", "metric", "bf16-stochastic-fp8mom"): None,  # not run
        ("lm", "accuracy", "fp32-fp8mom"): True,  # -0.25 points
        ("lm", "accuracy", "bf16-master-fp8mom"): False,  # -0.35 points
        ("lm", "accuracy", "bf16-kahan-fp8mom"): True,
        ("lm", "accuracy", "bf16-remainder-fp8mom"): None,  # not measured in the kept run
        ("lm", "accuracy", "bf16-stochastic-fp8mom"): None,
        ("digits-mlp", "metric", "fp32-fp8mom"): True,  # -0.25 points
        ("digits-mlp", "metric", "bf16-master-fp8mom"): False,  # -0.4 points
        ("digits", "metric", "fp32-fp8mom"): None,  # no eligible tensor
    }
    by = {(b["model"], b["metric"], b["mode"]): b for b in bars}
    assert by["lm", "metric", "fp32-fp8mom"]["value"] == "+0.49% (per seed: +0.49%)"
    assert by["lm", "accuracy", "bf16-master-fp8mom"]["value"] == "-0.35 pts (per seed: -0.35)"
    assert by["lm", "accuracy", "bf16-remainder-fp8mom"]["status"] == \
        "not measured in the run kept"
    assert by["lm", "metric", "bf16-stochastic-fp8mom"]["status"] == bench_lean.UNAVAILABLE
    assert by["digits", "metric", "fp32-fp8mom"]["status"] == (
        "no eligible tensor (8-bit moments on 0 of 2,048 elements: trains as fp32)")
    assert by["digits", "metric", "fp32-fp8mom"]["value"] is None


def test_lean_run_date_through_merges(bench_lean):
    """Results saved before ``run_date`` existed: their run is found through the chain
    of merge records (modes run now on the models run now: the file's date)."""
    data = {"env": {"date": "C"}, "results": {"lm": {"x": {}, "y": {}, "z": {"run_date": "Z"}}},
            "merged": {"run_now": ["x"], "models_now": ["lm"], "earlier_date": "B",
                       "earlier_merged": {"run_now": ["y"], "earlier_date": "A"}}}
    date = bench_lean.run_date
    assert [date(data, "lm", m) for m in ("x", "y", "z", "w")] == ["C", "B", "Z", "A"]
    assert date(data, "digits", "x") == "A"  # x was run on the LM only, then
    assert date(data, "digits", "y") == "B"  # (an old record without models_now: all)
    assert date({"env": {"date": "D"}}, "lm", "x") == "D"


def test_lean_digits_mlp_is_eligible(bench_lean):
    """The full-size digits MLP: every weight matrix takes 8-bit moments, only the
    biases keep fp32 moments (99.6% of the elements are eligible)."""
    from mixedprec.optim import state8
    model = bench_lean.digits_mlp(bench_lean.FULL["mlp_hidden"])
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    assert len(weights) == 3 and all(state8.eligible(p) for p in weights)
    assert not any(state8.eligible(p) for p in biases)
    share = sum(p.numel() for p in weights) / sum(p.numel() for p in model.parameters())
    assert share > 0.99


def test_sr_step_measures_every_mode(tmp_path, capsys):
    """``bench/sr_step.py`` on a tiny size: a row per (tensors, mode), ratios to 'none'."""
    threads = torch.get_num_threads()
    try:
        assert _load("sr_step").main(["--numel", "1003", "--tensors", "1", "3", "--reps", "2",
                                      "--threads", "1", "--json", str(tmp_path / "sr.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "sr.json").read_text())
    assert [(r["tensors"], r["mode"]) for r in data["rows"]] == [
        (t, m) for t in (1, 3) for m in ("none", "stochastic", "kahan", "fp32", "remainder",
                                         "torch-fused-fp32", "torch-fused-bf16")]
    assert all(r["median_ms"] > 0 for r in data["rows"])
    assert [r["ratio"] for r in data["rows"] if r["mode"] == "none"] == [1.0, 1.0]
    assert "| 1003 x 3 | stochastic |" in capsys.readouterr().out


@pytest.fixture(scope="module")
def bench_q8():
    return _load("q8_formats")


def test_q8_formats_quick(bench_q8, tmp_path):
    """``bench/q8_formats.py --quick`` on a few variants: every model and variant trains
    to a finite loss, the gaps to fp32 are paired per seed, and the markdown (tables,
    the per-axis comparison) and JSON are written; --replot adds the conclusions."""
    pytest.importorskip("sklearn", reason="the digits model needs scikit-learn")
    models = "digits,lm,resnet18" if importlib.util.find_spec("torchvision") else "digits,lm"
    variants = ["fp32-jitter", "e4m3-b32-pow2-sqrt-rn", "e4m3-b32-pow2-sqrt-sr",
                "e5m2-b32-pow2-v-rn",
                "int8-b128-absmax-sqrt-rn", "dyn-b32-absmax-v-rn"]
    threads = torch.get_num_threads()
    assert bench_q8.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--models",
                          models, "--variants", ",".join(variants), "--resnet-variants",
                          "e4m3-b32-pow2-sqrt-rn"]) == 0
    assert torch.get_num_threads() == threads  # restored
    data = json.loads((tmp_path / "q8-formats-cpu.json").read_text())
    assert data["smoke"] is True and ENV_KEYS <= set(data["env"])
    assert list(data["results"]) == models.split(",")
    for model, res in data["results"].items():
        expected = ["fp32"] + (variants if model != "resnet18" else [bench_q8.CHOSEN])
        assert list(res) == expected
        for name, r in res.items():
            assert len(r["seeds"]) == 1 and not r["nonfinite"], (model, name)
            seed = r["seeds"][0]
            assert seed["quantized_elems"] == (0 if name.startswith("fp32") else seed["elems"])
            stored_exactly = name.startswith("fp32")
            assert (seed["m_rel_err"] == 0) == stored_exactly, (model, name)
            assert (seed["v_rel_err"] == 0) == stored_exactly, (model, name)
            if not stored_exactly:  # the drift from the exact moments of the same grads
                assert seed["m_drift"] > 0 and 0 < seed["denom_ratio"] < 10
                assert 0 <= seed["denom_off"] <= 1
            if name == "fp32":
                assert "loss_gap_pct_mean" not in r or r["loss_gap_pct_mean"] == 0
            else:
                base = res["fp32"]["seeds"][0]
                assert r["loss_gap_pct_mean"] == pytest.approx(
                    100 * (seed["loss"] - base["loss"]) / base["loss"])
                assert r["acc_gap_mean"] == pytest.approx(seed["acc"] - base["acc"])
            assert 0 <= r["acc_mean"] <= 100
    md = (tmp_path / "q8-formats-cpu.md").read_text()
    assert "CPU smoke run" in md and "## Each choice against its alternatives" in md
    assert "| `e4m3-b32-pow2-sqrt-rn` (chosen) | 8.25 |" in md
    assert "| rounding | `e4m3-b32-pow2-sqrt-sr` |" in md
    assert "| block |" not in md  # no variant differs from the chosen one in block only
    # The probe: fp32 is the exact EMA of g^2 = 1 (then 0.01^2), a rounded-to-nearest
    # e4m3 root stops rising at a code (0.125: the step is below half a code), stochastic
    # rounding keeps moving.
    cfg, probe = data["config"], data["probe"]
    assert set(probe) == {"fp32", *variants, bench_q8.CHOSEN}
    rise = cfg["probe_rise"]
    for t, x in zip(cfg["probe_at"], probe["fp32"]):
        exact = (1 - 0.999 ** min(t, rise)) * 0.999 ** max(0, t - rise) + (
            0.0001 * (1 - 0.999 ** max(0, t - rise)))
        assert x == pytest.approx(exact ** 0.5, rel=1e-5), t
    assert probe[bench_q8.CHOSEN][1:] == [0.125] * (len(cfg["probe_at"]) - 1)
    assert len(set(probe["e4m3-b32-pow2-sqrt-sr"])) > 1
    assert "## The second moment of a gradient that rises, then shrinks" in md
    again = tmp_path / "replot"
    assert bench_q8.main(["--replot", str(tmp_path / "q8-formats-cpu.json"), "--out",
                          str(again), "--note", "The data say X."]) == 0
    assert "## Conclusions\n\nThe data say X." in (again / "q8-formats-cpu.md").read_text()


def test_q8_formats_chosen_codes_follow_the_spec(bench_q8):
    """The emulation of the chosen format: per block of 32, absmax * 2^-e in (224, 448]
    with e the scale exponent, every stored value an e4m3fn code times 2^e, dequantize
    -> requantize exact, an all-zero block stays zero; the other formats' codes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g) * torch.logspace(-20, 6, 40)[:, None]
    x[3] = 0
    chosen = bench_q8.Variant.parse(bench_q8.CHOSEN)
    assert chosen == bench_q8.Variant("e4m3", 32, "pow2", True, False)
    q = bench_q8.qdq(x, chosen)
    a = x.abs().amax(1, keepdim=True)
    e = bench_q8._pow2_exponent(a, 448.0)
    live = a.squeeze(1) > 0
    ratio = (a * torch.pow(2.0, -e)).squeeze(1)[live]
    assert bool(((ratio > 224) & (ratio <= 448)).all()), ratio
    codes = q / torch.pow(2.0, e)
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)
    assert torch.equal(codes, (x / torch.pow(2.0, e)).to(torch.float8_e4m3fn).float())
    assert torch.equal(bench_q8.qdq(q, chosen), q) and not q[3].any()
    int8 = bench_q8.qdq(x, bench_q8.Variant.parse("int8-b32-absmax-v-rn"))
    steps = int8 / (a / 127)
    torch.testing.assert_close(steps[live], steps[live].round(), rtol=0, atol=1e-4)
    assert steps.abs().amax(1)[live].round().eq(127).all()
    assert len(bench_q8.dynamic_map(True)) == 255 and len(bench_q8.dynamic_map(False)) == 256
    dyn = bench_q8.qdq(x, bench_q8.Variant.parse("dyn-b32-absmax-sqrt-rn"))
    table = bench_q8.dynamic_map(True).double()
    rel = (dyn[live] / a[live]).double().reshape(-1, 1)
    assert bool(((rel - table).abs().min(1).values < 1e-6).all())


@pytest.mark.parametrize("name", ["e4m3-b32-pow2-sqrt-sr", "int8-b32-absmax-v-sr"])
def test_q8_formats_stochastic_rounding_is_unbiased(bench_q8, name):
    """Stochastic rounding returns one of the two neighbouring codes, each as often as
    its distance says: the mean of 20,000 roundings of 0.3 (in a block whose absmax
    sets the scale) lies within 4 standard errors of 0.3."""
    x = torch.full((20000, 32), 0.3)
    x[:, 0] = 300.0
    q = bench_q8.qdq(x, bench_q8.Variant.parse(name), generator=torch.Generator().manual_seed(1))
    rest = q[:, 1:]
    lo, hi = rest.min().item(), rest.max().item()
    assert set(rest.unique().tolist()) == {lo, hi} and lo < 0.3 < hi
    p = (0.3 - lo) / (hi - lo)
    stderr = (hi - lo) * (p * (1 - p) / rest.numel()) ** 0.5
    assert abs(rest.mean().item() - 0.3) < 4 * stderr


def test_q8_formats_adamw_without_quantization_is_torch_adamw(bench_q8):
    """variant None (fp32 moments) follows torch.optim.AdamW(weight_decay=0.01) over
    steps with changing learning rates, on tensors of different sizes (the flat state
    buffers' padding included)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (33,), (3, 4, 4)]
    ours = [torch.randn(s, generator=g, dtype=torch.float64).float().requires_grad_()
            for s in shapes]
    ref = [p.detach().double().requires_grad_() for p in ours]
    opt = bench_q8.EmulatedAdamW(ours, lr=1e-2, variant=None)
    topt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01)
    for step in range(5):
        for o in (opt, topt):
            o.param_groups[0]["lr"] = 1e-2 / (step + 1)
        for p, r in zip(ours, ref):
            grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.grad, r.grad = grad.float(), grad
        opt.step()
        topt.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r.detach(), rtol=1e-5, atol=1e-6)


def test_q8_formats_spec_rule_keeps_other_tensors_exact(bench_q8):
    """``eligible="spec"``: only tensors with dim >= 2, numel >= 4096 and rows of whole
    32-blocks get 8-bit moments; the others' moments equal an fp32-moment run's."""
    shapes = [(128, 32), (64, 96), (4096,), (100, 50), (8, 8)]
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    runs = []
    for variant in (None, bench_q8.Variant.parse(bench_q8.CHOSEN)):
        params = [p.clone().requires_grad_() for p in init]
        opt = bench_q8.EmulatedAdamW(params, lr=1e-2, variant=variant, eligible="spec")
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr
            opt.step()
        runs.append((opt, params))
    (ref, ref_p), (q8, q8_p) = runs
    assert q8.quantized_elems == 128 * 32 + 64 * 96
    for i, (a, b) in enumerate(zip(ref_p, q8_p)):
        m, m_ref = (o.m[o.starts[i]:o.starts[i] + a.numel()] for o in (q8, ref))
        if i < 2:  # quantized: e4m3 codes are 2^-4 apart at best
            assert (m - m_ref).abs().max() > 1e-3 * m_ref.abs().max(), i
        else:  # the same fp32 arithmetic (vectorised differently: a few ulps)
            torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

# Parameters + optimizer state per parameter in each of bench/lean_speed.py's modes.
LEAN_SPEED_BYTES = {"torch": 12, "fp32": 14, "fp32+bf16": 10, "none": 10, "none+bf16": 6,
                    "kahan": 12, "kahan+bf16": 8, "stochastic": 10, "stochastic+bf16": 6,
                    "remainder": 12, "remainder+bf16": 8}


def test_lean_speed_quick(tmp_path):
    """``bench/lean_speed.py --quick``: every mode steps on both lists at 1 and 2 threads
    (stochastic rounding reported unavailable exactly when the build lacks it), bytes per
    parameter are what the tensors hold, torch's row is the 1.00x reference, and the
    markdown, JSON and PNG are written."""
    mod = _load("lean_speed")
    threads = torch.get_num_threads()
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # restored
    data = json.loads((tmp_path / "lean-speed-cpu.json").read_text())
    assert data["smoke"] is True and ENV_KEYS <= set(data["env"])
    assert list(data["results"]) == ["resnet50", "gpt2-medium"]
    stochastic = _stochastic_available()
    for name, res in data["results"].items():
        assert list(res["threads"]) == ["1", "2"]
        for rows in res["threads"].values():
            assert set(rows) == set(LEAN_SPEED_BYTES)
            for mode, row in rows.items():
                if mode.startswith("stochastic") and not stochastic:
                    assert row["status"].startswith(mod.UNAVAILABLE)
                    continue
                assert row["status"] == "ok", (name, mode, row)
                assert row["bytes_per_param"] == LEAN_SPEED_BYTES[mode], (name, mode)
                assert row["median_ms"] > 0 and row["ratio"] > 0
            assert rows["torch"]["ratio"] == 1.0
    md = (tmp_path / "lean-speed-cpu.md").read_text()
    assert "| remainder+bf16 | 8.0 | 18.0 |" in md
    if HAS_MATPLOTLIB:
        assert (tmp_path / "lean-speed-cpu.png").stat().st_size > 0
    # A 2-thread torch step slower than the 1-thread one is flagged (--replot rewrites
    # the markdown from the JSON).
    rows = data["results"]["resnet50"]["threads"]
    rows["2"]["torch"]["median_ms"] = rows["1"]["torch"]["median_ms"] * 10
    other = data["results"]["gpt2-medium"]["threads"]
    other["2"]["torch"]["median_ms"] = other["1"]["torch"]["median_ms"]  # not flagged
    saved = tmp_path / "saved" / "lean-speed-cpu.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps(data))
    assert mod.main(["--replot", str(saved)]) == 0
    md = saved.with_suffix(".md").read_text()
    assert md.count("the reference was disturbed") == 1 and "**2 threads: torch's step" in md


def test_lean_speed_start_step(tmp_path):
    """``--start-step``: torch's and mixedprec's step counts are set after the first step
    (each optimizer then at start + the steps taken), and the report says so."""
    mod = _load("lean_speed")
    grads = [torch.full((4, 8), 1e-2)]
    for mode in ("torch", "none+bf16"):
        case = mod.Case(mode, [(4, 8)], [g.to(mod.parse_mode(mode)["param_dtype"])
                                         for g in grads], seed=0, start_step=20_000)
        case.step()
        steps = {float(st["step"]) for st in case.opt.state_dict()["state"].values()}
        assert steps == {20_001.0}, mode
    assert mod.main(["--quick", "--out", str(tmp_path), "--lists", "resnet50", "--threads",
                     "1", "--modes", "none", "--start-step", "20000"]) == 0
    data = json.loads((tmp_path / "lean-speed-cpu.json").read_text())
    assert data["config"]["start_step"] == 20_000
    assert "start from step 20000" in (tmp_path / "lean-speed-cpu.md").read_text()


def test_lean_speed_mode_names(tmp_path, monkeypatch):
    """Modes are named MASTER[+STATE]: an unknown name is refused naming what is
    accepted; the 8-bit moments (STATE fp8) are a mode by name and run."""
    mod = _load("lean_speed")
    assert mod.parse_mode("remainder+bf16")["state_dtype"] == torch.bfloat16
    assert mod.parse_mode("kahan")["state_dtype"] == torch.float32
    assert mod.parse_mode("remainder+fp8")["state_dtype"] == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="STATE in"):
        mod.parse_mode("remainder+fp4")
    with pytest.raises(ValueError, match="MASTER in"):
        mod.parse_mode("fp16")
    with pytest.raises(SystemExit, match="unknown mode 'fp16'"):  # main: a message, no trace
        mod.main(["--quick", "--modes", "torch,fp16"])
    assert mod.main(["--quick", "--out", str(tmp_path), "--lists", "resnet50",
                     "--threads", "1", "--modes", "remainder+fp8"]) == 0
    data = json.loads((tmp_path / "lean-speed-cpu.json").read_text())
    assert data["config"]["modes"] == ["torch", "remainder+fp8"]
    row = data["results"]["resnet50"]["threads"]["1"]["remainder+fp8"]
    assert row["status"] == "ok"
    # The precision report beside a mode: "+report" every step, "+reportN" every N-th.
    assert mod.parse_mode("none+bf16+report")["precision_report"] is True
    assert mod.parse_mode("none+report8")["precision_report"] == 8
    assert mod.parse_mode("none+report8")["state_dtype"] == torch.float32
    assert mod.parse_mode("none")["precision_report"] is False
    assert mod.main(["--quick", "--out", str(tmp_path), "--lists", "resnet50",
                     "--threads", "1", "--modes", "none+report,none+bf16+report4"]) == 0
    rows = json.loads((tmp_path / "lean-speed-cpu.json").read_text())["results"]["resnet50"]
    assert all(r["status"] == "ok" for r in rows["threads"]["1"].values())


# bench/lean_speed.py's peers on two tensors: one the 8-bit peers quantize (>= 4096
# elements, whole blocks of 256), one they leave in bf16 (torchao) or fp32 (bitsandbytes).
PEER_SHAPES = [(64, 256), (10,)]


def _peer_bytes(mode: str) -> float:
    """Parameters + state per parameter over PEER_SHAPES: what the storages hold."""
    big, small = 64 * 256, 10
    n = big + small
    eight = 2 * (big + big // 256 * 4 + 256 * 4)  # codes, fp32 scales, a code map each
    state = {"optimi-kahan": 6 * n, "torchao-sr": 4 * n,
             "torchao-8bit": eight + 4 * small, "bnb-8bit": eight + 8 * small}[mode]
    return (2 * n + state) / n


def test_lean_speed_peers(tmp_path, monkeypatch):
    """The peers (optimi, torchao, bitsandbytes) are modes by name and by --peers: each
    steps where its library is installed, with its bytes per parameter read from what its
    state's storages hold (torchao's 8-bit subclass by its inner tensors), and is reported
    "not available (not installed)" where it is not; a library made unimportable is
    reported so and the run goes on."""
    mod = _load("lean_speed")
    for mode in mod.PEER_MODES:
        assert mod.parse_mode(mode)["kind"] == "peer"
    with pytest.raises(SystemExit, match="a peer"):
        mod.main(["--quick", "--modes", "torch,optimi"])
    monkeypatch.setattr(mod, "list_shapes",
                        lambda name, layers, quick: (PEER_SHAPES, "two tensors (test)"))
    assert mod.main(["--quick", "--out", str(tmp_path), "--lists", "resnet50",
                     "--threads", "1", "--modes", "torch", "--peers"]) == 0
    data = json.loads((tmp_path / "lean-speed-cpu.json").read_text())
    assert data["config"]["modes"] == ["torch", *mod.PEER_MODES]
    rows = data["results"]["resnet50"]["threads"]["1"]
    assert rows["torch"]["status"] == "ok"
    modules = {"torch-optimi": "optimi", "torchao": "torchao", "bitsandbytes": "bitsandbytes"}
    for mode, package in mod.PEER_MODES.items():
        if importlib.util.find_spec(modules[package]) is None:
            assert rows[mode]["status"].startswith(f"{mod.UNAVAILABLE} (not installed)")
            assert package not in data["peer_versions"]
            continue
        assert rows[mode]["status"] == "ok", (mode, rows[mode])
        assert rows[mode]["bytes_per_param"] == pytest.approx(_peer_bytes(mode)), mode
        assert rows[mode]["median_ms"] > 0 and package in data["peer_versions"]
    # Not installed (None in sys.modules makes the import fail): reported, the run goes on.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert mod.main(["--quick", "--out", str(tmp_path / "missing"), "--lists", "resnet50",
                     "--threads", "1", "--modes", "torch,bnb-8bit"]) == 0
    data = json.loads((tmp_path / "missing" / "lean-speed-cpu.json").read_text())
    rows = data["results"]["resnet50"]["threads"]["1"]
    assert rows["torch"]["status"] == "ok"
    assert rows["bnb-8bit"]["status"].startswith(f"{mod.UNAVAILABLE} (not installed)")
    assert "| bnb-8bit | not available (not installed)" in (
        tmp_path / "missing" / "lean-speed-cpu.md").read_text()


def test_lean_speed_mode_budget(tmp_path, monkeypatch):
    """--mode-budget bounds a slow mode's repetitions: with a budget of 0 s every mode
    stops at MIN_REPS, and the markdown gives that count beside the median."""
    mod = _load("lean_speed")
    monkeypatch.setattr(mod, "list_shapes",
                        lambda name, layers, quick: (PEER_SHAPES, "two tensors (test)"))
    assert mod.main(["--out", str(tmp_path), "--lists", "resnet50", "--threads", "1",
                     "--modes", "torch,remainder+bf16", "--reps", str(mod.MIN_REPS + 3),
                     "--warmup", "0", "--mode-budget", "0"]) == 0
    data = json.loads((tmp_path / "lean-speed-cpu.json").read_text())
    rows = data["results"]["resnet50"]["threads"]["1"]
    assert [rows[m]["reps"] for m in ("torch", "remainder+bf16")] == [mod.MIN_REPS] * 2
    assert f" ({mod.MIN_REPS}) |" in (tmp_path / "lean-speed-cpu.md").read_text()


def test_host_step_smoke(bench_ops, tmp_path, capsys):
    """``bench/host_step.py`` on 5 tensors, 2 repetitions: a row per case in each mode,
    its torch counterpart's ratio, the fake-CUDA op counts; ResNet-50's tensor count."""
    host_step = _load("host_step")
    assert host_step.RESNET50_TENSORS == len(bench_ops.resnet50_shapes_fixed())
    threads = torch.get_num_threads()
    try:
        assert host_step.main(["--device", "cpu", "--tensors", "5", "--reps", "2", "--inner",
                               "1", "--cases", "FusedSGD fp16+masters,optim.AdamW fp32",
                               "--json", str(tmp_path / "host.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "host.json").read_text())
    assert set(data["modes"]) == {"real", "noop"}
    for cases in data["modes"].values():
        assert set(cases) == {"FusedSGD fp16+masters", "optim.AdamW fp32", "torch SGD",
                              "torch AdamW"}
        assert all(r["host"]["median_ms"] > 0 for r in cases.values())
        assert cases["torch SGD"]["vs_torch"] is None
        assert cases["optim.AdamW fp32"]["vs_torch"] > 0
    assert data["ops_per_step"] == {"FusedSGD fp16+masters": 4, "optim.AdamW fp32": 4,
                                    "torch SGD": 1, "torch AdamW": 3}
    assert "| FusedSGD fp16+masters |" in capsys.readouterr().out


def test_compile_step_smoke(tmp_path, capsys):
    """``bench/compile_step.py`` on a tiny MLP with the eager backend, 2 repetitions: a
    row per stack with both times and dynamo's counts, mixedprec's no more than torch's."""
    compile_step = _load("compile_step")
    threads = torch.get_num_threads()
    try:
        assert compile_step.main(["--device", "cpu", "--backend", "eager", "--width", "16",
                                  "--depth", "1", "--batch", "4", "--reps", "2", "--inner",
                                  "1", "--json", str(tmp_path / "compile.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = {r["stack"]: r for r in json.loads((tmp_path / "compile.json").read_text())["rows"]}
    assert set(rows) == {"torch", "mixedprec"}
    assert all(r["eager_ms"] > 0 and r["compiled_ms"] > 0 for r in rows.values())
    assert rows["mixedprec"]["graphs"] <= rows["torch"]["graphs"]
    assert rows["mixedprec"]["breaks"] <= rows["torch"]["breaks"]
    assert "| mixedprec |" in capsys.readouterr().out


def test_memory_quick(tmp_path):
    """``bench/memory.py --quick``: the five configurations in the issue's order (then the
    comparison run), weights + grads + state adding up to the total, in bytes and per
    parameter; every gradient alive at step() in the ordinary runs, the in-backward run's
    gradient peak below the ordinary remainder run's and none left after backward; the
    remainder runs exact against fp32 masters stepped in lockstep (their bf16 parameters
    apart only at exact ties), the in-backward one bit for bit step()'s; the markdown's
    table, exact column and target line."""
    mod = _load("memory")
    threads = torch.get_num_threads()
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # restored
    data = json.loads((tmp_path / "memory-cpu.json").read_text())
    assert data["smoke"] is True and ENV_KEYS <= set(data["env"])
    res = data["results"]
    five = ["torch-fp32", "torch-bf16", "fp32-masters", "remainder-8bit",
            "remainder-8bit-in-backward"]
    assert list(res) == five + [mod.REFERENCE]
    n, tensors = data["config"]["params"], data["config"]["tensors"]
    for name, r in res.items():
        assert r["params"] == n and r["tensors"] == tensors
        assert r["total_bytes"] == r["weights_bytes"] + r["grads_bytes"] + r["state_bytes"]
        assert r["total_bpp"] == pytest.approx(r["weights_bpp"] + r["grads_bpp"]
                                               + r["state_bpp"])
        assert r["total_bpp"] == pytest.approx(r["total_bytes"] / n)
        assert r["weights_bytes"] == n * (4 if name == "torch-fp32" else 2)
        assert r["activations_bytes"] > 0
        assert r["tracked_peak_bytes"] > r["weights_bytes"] + r["state_bytes"]
        assert len(r["losses"]) == data["config"]["steps"]
        if name != "remainder-8bit-in-backward":
            assert r["grads_bytes"] == r["grads_after_backward_bytes"] == r["weights_bytes"]
    # torch's AdamW: two moments of the params' dtype and a 4-byte step count each.
    assert res["torch-fp32"]["state_bytes"] == 8 * n + 4 * tensors
    assert res["torch-bf16"]["state_bytes"] == 4 * n + 4 * tensors
    assert res["fp32-masters"]["state_bpp"] == pytest.approx(12, abs=0.05)
    step, inside = res["remainder-8bit"], res["remainder-8bit-in-backward"]
    assert inside["grads_bytes"] < step["grads_bytes"]
    assert inside["grads_after_backward_bytes"] == 0 and inside["buckets"] > 1
    # (the buckets split the step counts that step()'s op calls share: 4 bytes per call,
    # an 8-bit one and an fp32-moment one per bucket at most)
    assert 0 <= inside["state_bytes"] - step["state_bytes"] <= 2 * 4 * inside["buckets"]
    assert step["state_bytes"] < res[mod.REFERENCE]["state_bytes"]
    assert inside["total_bpp"] < step["total_bpp"] < res["torch-bf16"]["total_bpp"] + 0.5
    for r in (step, inside):
        assert r["exact"]["exact"] is True and r["exact"]["steps"] == data["config"]["steps"]
        assert r["exact"]["bf16_params_differ_off_ties"] == 0
    assert inside["same_as_step"] is True
    assert data["target"]["config"] == "remainder-8bit-in-backward"
    assert data["target"]["exact"] is True
    assert data["target"]["met"] == (inside["total_bpp"] <= 6.5)

    md = (tmp_path / "memory-cpu.md").read_text()
    assert "CPU smoke run" in md
    assert "| config | weights | grads (peak) | state | **total** | activations |" in md
    for i, name in enumerate(five):
        assert f"| {i + 1}. {res[name]['label']} |" in md
    assert md.count(" | yes |") == 2
    assert "**Target (issue 32): remainder-8bit-in-backward at <= 6.5 B/param" in md
    assert "CUDA figures (max_memory_allocated) at the next GPU run" in md

    # A GPU run's report (made-up allocator numbers): the CUDA columns beside the others.
    data["env"].update(device_type="cuda", device="NVIDIA H100 80GB HBM3", capability="9.0",
                       multiprocessors=132, memory_gib=79.1)
    for r in res.values():
        r["cuda_peak_bpp"], r["cuda_activations_bpp"] = r["total_bpp"] + 1.5, 1.5
    md = mod.markdown(data)
    assert "| step peak (tracked) | CUDA peak | activations (CUDA) | exact vs fp32 masters |" in md
    assert "next GPU run" not in md and "activations (CUDA): that less the total" in md
