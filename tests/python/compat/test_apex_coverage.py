"""docs/apex-coverage.md, measured: every name its table lists imports through the Apex
alias, and its signature (parameter names and defaults) matches the Apex signature the
table records. ✓ rows match exactly (the same parameters in the same order); ◐ rows
take every Apex parameter by name with Apex's default and may add parameters that have
defaults; no row is ✗."""

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import required

DOC = Path(__file__).resolve().parents[3] / "docs" / "apex-coverage.md"
ROW = re.compile(r"^\| `([\w.]+)` \| `([^`]*)` \| (✓|◐|✗) \|(.*)\|\s*$")
STATUSES = ("✓", "◐", "✗")


def table_rows():
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            rows.append(match.groups())
        elif line.startswith("| `"):
            raise AssertionError(f"a table row that does not parse: {line!r}")
    return rows


ROWS = table_rows()


@pytest.fixture(scope="module")
def alias():
    import mixedprec.apex as alias

    alias.install()
    yield alias
    alias.uninstall()


def resolve(name):
    import importlib

    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def apex_signature(text):
    namespace = {"torch": torch, "required": required}
    exec(f"def apex{text}:\n    pass\n", namespace)
    return inspect.signature(namespace["apex"])


def same_default(a, b):
    # torch's `required` sentinel (Apex's FusedSGD lr) means: no default.
    a, b = (inspect.Parameter.empty if d is required else d for d in (a, b))
    if a is inspect.Parameter.empty or b is inspect.Parameter.empty:
        return a is b
    return a is b or (type(a) is type(b) and a == b) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float))
        and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def describe(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_table_lists_the_brief_s_modules():
    names = {name for name, *_ in ROWS}
    assert len(names) == len(ROWS), "a name is listed twice"
    for prefix, least in [("apex.amp.", 13), ("apex.fp16_utils.", 14), ("apex.parallel.", 14),
                          ("apex.optimizers.", 6), ("amp_C.", 17), ("apex.multi_tensor_apply.", 2),
                          ("apex.normalization.", 11), ("apex_C.", 2),
                          ("apex.contrib.optimizers.", 4)]:
        assert sum(n.startswith(prefix) for n in names) >= least, prefix


def test_no_name_is_missing():
    missing = [name for name, _, status, _ in ROWS if status == "✗"]
    assert not missing, f"✗ in docs/apex-coverage.md: {missing}"


def test_differences_are_documented():
    for name, _, status, note in ROWS:
        if status == "◐":
            assert note.strip(), f"{name}: ◐ without the difference"


@pytest.mark.parametrize("name,apex_text,status", [(n, s, st) for n, s, st, _ in ROWS],
                         ids=[n for n, *_ in ROWS])
def test_name_imports_with_apex_signature(alias, name, apex_text, status):
    obj = resolve(name)
    if apex_text == "—":  # not a callable with a signature of its own (ReduceOp)
        return
    ours = inspect.signature(obj)
    apex = apex_signature(apex_text)
    params = list(apex.parameters.values())
    if params and all(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params):
        # A C++ extension function: Apex took its arguments by position only.
        ours.bind(*range(len(params)))
        return
    if status == "✓":
        ours_list = [(n, k, d) for n, k, d in describe(ours)]
        apex_list = describe(apex)
        assert [n for n, *_ in ours_list] == [n for n, *_ in apex_list], name
        for (n, kind, default), (_, apex_kind, apex_default) in zip(ours_list, apex_list):
            assert kind == apex_kind, f"{name}({n}): {kind} vs Apex's {apex_kind}"
            assert same_default(default, apex_default), \
                f"{name}({n}={default!r}) vs Apex's {apex_default!r}"
        return
    # ◐: Apex's parameters by name with Apex's defaults; extra ones optional.
    ours_params = ours.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours_params.values())
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            assert any(q.kind is p.kind for q in ours_params.values()), f"{name}: {p}"
            continue
        if p.name not in ours_params:
            assert takes_kwargs and p.default is not inspect.Parameter.empty, \
                f"{name}: Apex's parameter {p.name!r} is missing"
            continue
        ours_default = ours_params[p.name].default
        apex_required = p.default is inspect.Parameter.empty or p.default is required
        # a default where Apex had none still takes every call Apex took
        assert same_default(ours_default, p.default) or (
            apex_required and ours_default is not inspect.Parameter.empty), \
            f"{name}({p.name}={ours_default!r}) vs Apex's {p.default!r}"
    for q in ours_params.values():
        if q.name not in apex.parameters and q.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            assert q.default is not inspect.Parameter.empty, \
                f"{name}: mixedprec's extra parameter {q.name!r} has no default"
