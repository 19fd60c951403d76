"""GradScaler(overflow_report=...): per-parameter overflow counts exact for infs and NaNs
injected into chosen parameters, steps, skipped steps and the scale's history (against
the scale read on the host each step), names from a module or named_parameters, no host
read in a step, and the errors."""

import pickle

import pytest
import torch
from helpers import forbid_host_sync, make_model

import mixedprec
from mixedprec.overflow import OverflowReport, format_report

SIZES = (6, 8, 3)  # helpers.make_model's Sequential: 0 (Linear), 1 (Tanh), 2 (Linear)
# step -> the parameters (by name) whose gradient gets an inf (or a NaN: "!" suffix)
INJECT = {1: ["2.weight"], 3: ["0.bias!", "2.weight"], 4: ["2.bias"], 7: ["2.weight"],
          8: ["0.weight!"]}


def run(model, opt, scaler, steps=10, monkeypatch=None, scales=None, first=0):
    named = dict(model.named_parameters())
    for step in range(first, first + steps):
        opt.zero_grad()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).to(
            next(model.parameters()).dtype)
        scaler.scale(model(x).float().pow(2).mean()).backward()
        for name in INJECT.get(step, []):
            named[name.rstrip("!")].grad.view(-1)[1] = float("nan" if "!" in name else "inf")
        if monkeypatch is not None:
            with forbid_host_sync(monkeypatch):
                scaler.step(opt)
                scaler.update()
        else:
            scaler.step(opt)
            scaler.update()
        if scales is not None:
            scales.append(scaler.get_scale())


def expected_counts():
    counts = {}
    for names in INJECT.values():
        for name in names:
            counts[name.rstrip("!")] = counts.get(name.rstrip("!"), 0) + 1
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", ["mixedprec.AdamW", "torch.SGD"])
def test_counts_are_exact(dtype, optimizer):
    model = make_model(dtype=dtype, sizes=SIZES)
    opt = (mixedprec.optim.AdamW(model.parameters(), lr=1e-3) if optimizer ==
           "mixedprec.AdamW" else torch.optim.SGD(model.parameters(), lr=1e-3))
    scaler = mixedprec.GradScaler("cpu", init_scale=2.0**8, growth_interval=2,
                                  overflow_report=model)
    scales = [scaler.get_scale()]
    run(model, opt, scaler, scales=scales)
    report = scaler.report()
    assert report["steps"] == 10 and report["skipped"] == len(INJECT)
    assert report["overflows"] == expected_counts()
    assert list(report["overflows"]) == ["2.weight", "0.weight", "0.bias", "2.bias"]
    history = report["scale"]
    assert history == dict(
        current=scales[-1], min=min(scales), max=max(scales),
        backoffs=sum(b < a for a, b in zip(scales, scales[1:])),
        growths=sum(b > a for a, b in zip(scales, scales[1:])))
    assert history["backoffs"] == len(INJECT) and history["growths"] >= 1


def test_no_host_read_in_a_step(monkeypatch):
    model = make_model(dtype=torch.bfloat16, sizes=SIZES)
    opt = mixedprec.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = mixedprec.GradScaler("cpu", init_scale=2.0**8, overflow_report=True)
    run(model, opt, scaler, monkeypatch=monkeypatch)
    report = scaler.report(model.named_parameters())  # names given here instead
    assert report["overflows"] == expected_counts()
    assert int(opt.applied_steps) == 10 - len(INJECT)


def test_names_and_summary():
    model = make_model(dtype=torch.float32, sizes=SIZES)
    opt = mixedprec.optim.Adam(model.parameters())
    scaler = mixedprec.GradScaler("cpu", overflow_report=True)
    assert scaler.report() == {"steps": 0, "skipped": 0, "overflows": {}, "scale": None}
    run(model, opt, scaler)
    unnamed = scaler.report(scale=False)
    assert "scale" not in unnamed
    assert set(unnamed["overflows"]) == {"<param 0, shape (8, 6)>", "<param 1, shape (8,)>",
                                         "<param 2, shape (3, 8)>", "<param 3, shape (3,)>"}
    line = scaler.overflow_report.summary(model, top=2)
    assert line.startswith("5 of 10 steps skipped (50.0%); scale ")
    assert line.endswith("overflows: 2.weight 3, 0.weight 1 and 2 more")
    assert "5 backoffs" in line
    assert format_report({"steps": 0, "skipped": 0, "overflows": {}}) == "0 of 0 steps skipped"
    # (before: -1 named all but one and said "and 7 more", "x" or 1.5 gave a bare slice
    # error, None a comparison error)
    for top in (-1, "x", 1.5, None, True):
        with pytest.raises(ValueError, match="summary: expected top to be an int >= 0"):
            scaler.overflow_report.summary(model, top=top)


def test_off_by_default_and_errors():
    scaler = mixedprec.GradScaler("cpu")
    assert scaler.overflow_report is None
    with pytest.raises(RuntimeError, match="overflow_report=True"):
        scaler.report()
    with pytest.raises(TypeError, match="overflow_report.*named_parameters"):
        mixedprec.GradScaler("cpu", overflow_report="yes")
    with pytest.raises(TypeError, match="overflow_report.*got an item"):
        mixedprec.GradScaler("cpu", overflow_report=[torch.zeros(1)])
    report = OverflowReport()
    with pytest.raises(TypeError, match="report.*named_parameters"):
        report.report(names=3)


def test_pickled_scaler_keeps_an_empty_report():
    model = make_model(dtype=torch.float32, sizes=SIZES)
    opt = mixedprec.optim.Adam(model.parameters())
    scaler = mixedprec.GradScaler("cpu", overflow_report=model)
    run(model, opt, scaler, steps=2)
    again = pickle.loads(pickle.dumps(scaler))
    assert again.report()["steps"] == 0 and scaler.report()["steps"] == 2


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_the_counts_carry_over_a_resume(named):
    """state_dict() holds the report's counts, and a new scaler (a new model: the same
    names, or the same order for unnamed parameters) carries them on: the report after 4
    steps, a resume and 6 more equals that of 10 steps in one run; a torch GradScaler
    loads the state dict too."""
    def fresh(model):
        return mixedprec.GradScaler("cpu", init_scale=2.0**8, growth_interval=2,
                                    overflow_report=model if named else True)

    whole_model = make_model(sizes=SIZES)
    whole = fresh(whole_model)
    run(whole_model, torch.optim.SGD(whole_model.parameters(), lr=1e-3), whole)

    model = make_model(sizes=SIZES)
    first = fresh(model)
    run(model, torch.optim.SGD(model.parameters(), lr=1e-3), first, steps=4)
    saved = first.state_dict()
    assert saved["overflow_report"] == first.report()
    model = make_model(sizes=SIZES)  # (new parameters)
    second = fresh(model)
    second.load_state_dict(saved)
    assert second.report()["steps"] == 4 and second.report()["scale"] is not None
    run(model, torch.optim.SGD(model.parameters(), lr=1e-3), second, steps=6, first=4)
    names = model if not named else None
    assert second.report(names) == whole.report(whole_model if not named else None)
    torch.amp.GradScaler("cpu").load_state_dict(saved)


@pytest.mark.parametrize("report, error, message", [
    ({"steps": 3, "skipped": 4, "overflows": {}}, ValueError, "expected skipped <= steps"),
    ({"steps": -1, "skipped": 0, "overflows": {}}, ValueError, "expected steps to be an int"),
    ({"steps": 3, "skipped": 1}, TypeError, "expected a dict with steps"),
    ({"steps": 3, "skipped": 1, "overflows": {"a": 1.5}}, ValueError,
     r"expected overflows\['a'\] to be an int"),
    ({"steps": 3, "skipped": 1, "overflows": {}, "scale": {"current": 0.0}}, ValueError,
     r"expected scale\['current'\] to be a finite number > 0"),
])
def test_a_bad_saved_report_is_named_and_changes_nothing(report, error, message):
    model = make_model(sizes=SIZES)
    scaler = mixedprec.GradScaler("cpu", init_scale=2.0**8, overflow_report=model)
    run(model, torch.optim.SGD(model.parameters(), lr=1e-3), scaler, steps=3)
    before, state = scaler.report(), scaler.state_dict()
    with pytest.raises(error, match=f"overflow_report.load_state_dict: {message}"):
        scaler.load_state_dict(dict(state, scale=state["scale"] * 2, overflow_report=report))
    assert scaler.report() == before and scaler.get_scale() == state["scale"]
