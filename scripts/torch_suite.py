"""Runs PyTorch's own tests with mixedprec's classes in place of torch's.

    python scripts/torch_suite.py --torch-tests /tmp/pytorch --suite gradscaler
    python scripts/torch_suite.py --torch-tests /tmp/pytorch --suite optim
    python scripts/torch_suite.py --torch-tests /tmp/pytorch --suite optim --optim-classes torch
    python scripts/torch_suite.py --torch-tests /tmp/pytorch --suite lrscheduler
    python scripts/torch_suite.py --torch-tests /tmp/pytorch --list --json /tmp/suite.json

``--torch-tests`` is a PyTorch checkout (the folder holding ``test/``, or ``test/``
itself); with ``--ref`` (e.g. ``v2.11.0``) the test files are taken from that commit of
the checkout's git history into a temporary folder, so the working tree may be at any
other commit. Nothing in the checkout is edited: this file is loaded into pytest as a
plugin (``-p torch_suite``) that swaps the classes before the test modules are imported
and keeps only the selected tests.

Suites (see docs/torch-suite.md):

* ``gradscaler``: test/test_torch.py, the tests whose names contain ``grad_scal`` or
  ``GradScaler`` (and, unless ``--by-name-only``, those whose source builds a
  GradScaler), on the CPU. ``torch.amp.GradScaler``, ``torch.amp.grad_scaler.GradScaler``
  and ``torch.GradScaler`` become ``mixedprec.GradScaler``; ``torch.cuda.amp.GradScaler``
  and ``torch.cpu.amp.GradScaler`` become subclasses of it with torch's signatures and
  deprecation warnings. ``--scaler torch`` leaves torch's class in place (the control).
* ``optim``: test/test_optim.py, the tests parametrised over Adam, AdamW, SGD and Adagrad on the
  CPU. The ``optim_cls`` of those entries of
  ``torch.testing._internal.common_optimizers.optim_db`` becomes ``mixedprec.optim``'s
  class of that name; ``--optim-classes torch`` puts torch's own classes there (the
  control, which must pass everything).
* ``lrscheduler`` and ``swa``: test/optim/test_lrscheduler.py and
  test/optim/test_swa_utils.py, every test (neither is parametrised over devices).
  ``torch.optim.Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` become ``mixedprec.optim``'s
  classes of those names before the file is imported (it takes them with ``from
  torch.optim import ...``), so torch's schedulers, SWALR and AveragedModel drive
  mixedprec's optimizers; ``--optim-classes torch`` leaves torch's (the control).

Only the CPU device is instantiated (``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu``). The
script prints passed/failed/error/skipped counts per suite and exits 1 if any selected
test failed; ``--json`` writes the counts and every selected test's outcome.
PyTorch's test utilities need ``expecttest`` (``pip install expecttest``).
"""

import argparse
import datetime
import inspect
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG_ENV = "MIXEDPREC_TORCH_SUITE"

SUITES = {
    "gradscaler": {"file": "test_torch.py",
                   "what": "GradScaler tests of test/test_torch.py on the CPU"},
    "optim": {"file": "test_optim.py",
              "what": "test/test_optim.py tests parametrised over Adam, AdamW, SGD, Adagrad "
                      "on the CPU"},
    "lrscheduler": {"file": os.path.join("optim", "test_lrscheduler.py"),
                    "what": "test/optim/test_lrscheduler.py, every test, with torch.optim's "
                            "Adam, AdamW, SGD, Adagrad replaced"},
    "swa": {"file": os.path.join("optim", "test_swa_utils.py"),
            "what": "test/optim/test_swa_utils.py, every test, with torch.optim's Adam, "
                    "AdamW, SGD, Adagrad replaced"},
}
# Files a suite's module imports from the test folder (test_optim.py imports optim/*).
SUITE_PATHS = {"gradscaler": ["test/test_torch.py"],
               "optim": ["test/test_optim.py", "test/optim"],
               "lrscheduler": ["test/optim/__init__.py", "test/optim/test_lrscheduler.py"],
               "swa": ["test/optim/__init__.py", "test/optim/test_swa_utils.py"]}
# The suites that replace torch.optim's classes themselves and keep every test of the file.
WHOLE_FILE = ("lrscheduler", "swa")
OPTIM_NAMES = ("Adam", "AdamW", "SGD", "Adagrad")

# The selection, on the name pytest gives a test function (after the last '::').
_SCALER_NAME = re.compile(r"grad_?scal|gradscaler", re.IGNORECASE)
_SCALER_SOURCE = re.compile(r"GradScaler|_run_scaling_case")
_OTHER_DEVICE = re.compile(r"_(cuda|mps|xpu|meta|lazy|hpu|privateuse1)(_|$)")
_OPTIM_NAME = re.compile(r"(?:^|_)(%s)_cpu(?:_|$)" % "|".join(OPTIM_NAMES))


def select_gradscaler(name: str, source: Optional[str], by_name_only: bool) -> Optional[str]:
    """Why a test of test_torch.py is in the gradscaler suite ('name' or 'source'), or
    None. ``name`` is the test function's name (device and dtype suffixes included)."""
    if _OTHER_DEVICE.search(name):
        return None
    if _SCALER_NAME.search(name):
        return "name"
    if not by_name_only and source is not None and _SCALER_SOURCE.search(source):
        return "source"
    return None


def select_optim(name: str) -> Optional[str]:
    """The optimizer a test of test_optim.py is parametrised over, if it is one of Adam,
    AdamW, SGD, Adagrad on the CPU; else None (so NAdam, RAdam, SparseAdam, Adamax stay out)."""
    match = _OPTIM_NAME.search(name)
    return match.group(1) if match else None


# --- the pytest plugin (active only when pytest loads this module with -p) -------------

def _config() -> Optional[dict]:
    raw = os.environ.get(CONFIG_ENV)
    return json.loads(raw) if raw else None


def _deprecated_scaler(base, device: str, old: str):
    """A subclass of ``base`` with the signature and FutureWarning of torch's
    ``torch.<device>.amp.GradScaler``."""
    import warnings

    class GradScaler(base):
        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000,
                     enabled: bool = True) -> None:
            warnings.warn(f"`{old}(args...)` is deprecated. Please use "
                          f"`torch.amp.GradScaler('{device}', args...)` instead.",
                          FutureWarning, stacklevel=2)
            super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             enabled=enabled)

    GradScaler.__qualname__ = GradScaler.__name__ = "GradScaler"
    GradScaler.__module__ = base.__module__
    return GradScaler


def substitute_scaler(which: str) -> str:
    """Puts the GradScaler named by ``which`` ('mixedprec' or 'torch') in torch's places;
    returns a description."""
    import torch
    import torch.amp.grad_scaler
    import torch.cpu.amp
    import torch.cpu.amp.grad_scaler
    import torch.cuda.amp
    import torch.cuda.amp.grad_scaler
    if which == "torch":
        return "torch.amp.GradScaler (unchanged)"
    from mixedprec import GradScaler
    for owner in (torch, torch.amp, torch.amp.grad_scaler):
        owner.GradScaler = GradScaler
    cuda = _deprecated_scaler(GradScaler, "cuda", "torch.cuda.amp.GradScaler")
    cpu = _deprecated_scaler(GradScaler, "cpu", "torch.cpu.amp.GradScaler")
    torch.cuda.amp.GradScaler = torch.cuda.amp.grad_scaler.GradScaler = cuda
    torch.cpu.amp.GradScaler = torch.cpu.amp.grad_scaler.GradScaler = cpu
    return f"{GradScaler.__module__}.GradScaler"


def substitute_optimizers(which: str) -> Dict[str, str]:
    """Sets the ``optim_cls`` of optim_db's Adam, AdamW, SGD and Adagrad entries to the classes
    of ``which`` ('mixedprec': mixedprec.optim, 'torch': torch.optim); returns
    {name: qualified class}."""
    import torch.optim
    from torch.testing._internal import common_optimizers
    if which == "torch":
        module = torch.optim
    else:
        import importlib
        module = importlib.import_module("mixedprec.optim")
    done = {}
    for info in common_optimizers.optim_db:
        name = info.optim_cls.__name__
        if name in OPTIM_NAMES and info.optim_cls is getattr(torch.optim, name):
            cls = getattr(module, name)
            if cls.__name__ != name:
                raise RuntimeError(f"{module.__name__}.{name} is named {cls.__name__}; the "
                                   "test names and optim_db's skips need the same name")
            info.optim_cls = cls
            done[name] = f"{cls.__module__}.{cls.__qualname__}"
    missing = set(OPTIM_NAMES) - set(done)
    if missing:
        raise RuntimeError(f"optim_db has no entry for {sorted(missing)}")
    return done


def substitute_torch_optim(which: str) -> Dict[str, str]:
    """Sets ``torch.optim.Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` to the classes of
    ``which`` ('mixedprec': mixedprec.optim, imported first so that its classes are built
    on torch's; 'torch': unchanged); returns {name: qualified class}."""
    import torch.optim
    if which == "torch":
        module = torch.optim
    else:
        import importlib
        module = importlib.import_module("mixedprec.optim")
    done = {}
    for name in OPTIM_NAMES:
        cls = getattr(module, name)
        setattr(torch.optim, name, cls)
        done[name] = f"{cls.__module__}.{cls.__qualname__}"
    return done


def pytest_configure(config):
    cfg = _config()
    if cfg is None:
        return
    config._torch_suite = {"cfg": cfg, "results": {}, "selected": {}, "deselected": 0,
                           "substituted": {}}
    state = config._torch_suite
    if cfg["suite"] == "gradscaler":
        state["substituted"]["GradScaler"] = substitute_scaler(cfg["scaler"])
    elif cfg["suite"] in WHOLE_FILE:
        state["substituted"].update(substitute_torch_optim(cfg["optim_classes"]))
    else:
        state["substituted"].update(substitute_optimizers(cfg["optim_classes"]))


_SELF_HELPER = re.compile(r"\bself\.(_\w+)\(")


def _function_source(func) -> Optional[str]:
    try:
        return inspect.getsource(inspect.unwrap(func))
    except (TypeError, OSError):
        return None


def _source(item) -> Optional[str]:
    """The test function's source followed by that of the private ``self._helper``
    methods it calls (a test may be one call to a shared helper that builds the
    GradScaler)."""
    source = _function_source(getattr(item, "function", None) or getattr(item, "obj", None))
    cls = getattr(item, "cls", None)
    if source is None or cls is None:
        return source
    helpers = [getattr(cls, name, None) for name in dict.fromkeys(_SELF_HELPER.findall(source))]
    return "\n".join([source] + [s for s in map(_function_source, helpers) if s])


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(session, config, items):
    state = getattr(config, "_torch_suite", None)
    if state is None:
        return
    cfg = state["cfg"]
    keep, drop = [], []
    for item in items:
        name = item.name.split("[")[0]
        if cfg["suite"] == "gradscaler":
            why = select_gradscaler(name, _source(item), cfg["by_name_only"])
        elif cfg["suite"] in WHOLE_FILE:
            why = "file"
        else:
            why = select_optim(name)
        if why:
            state["selected"][item.nodeid] = why
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    state["deselected"] = len(drop)
    items[:] = keep


def _outcome(report) -> Optional[str]:
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            return "xpassed" if report.passed else "xfailed"
        return {"passed": "passed", "failed": "failed", "skipped": "skipped"}[report.outcome]
    if report.failed:  # setup or teardown
        return "error"
    if report.when == "setup" and report.skipped:
        return "xfailed" if hasattr(report, "wasxfail") else "skipped"
    return None


def pytest_runtest_logreport(report):
    state = getattr(_session_config, "_torch_suite", None) if _session_config else None
    if state is None:
        return
    outcome = _outcome(report)
    if outcome is None:
        return
    entry = state["results"].setdefault(report.nodeid, {"outcome": outcome})
    if outcome in ("failed", "error") or entry["outcome"] not in ("failed", "error"):
        entry["outcome"] = outcome
    if outcome in ("failed", "error"):
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["message"] = (crash.message if crash else str(report.longrepr))[:2000]
    elif outcome == "skipped" and isinstance(report.longrepr, tuple):
        entry["message"] = str(report.longrepr[2])[:500]


_session_config = None


def pytest_sessionstart(session):
    global _session_config
    _session_config = session.config


def pytest_sessionfinish(session, exitstatus):
    state = getattr(session.config, "_torch_suite", None)
    if state is None:
        return
    cfg = state["cfg"]
    tests = {nodeid: state["results"].get(nodeid, {"outcome": "not run"})
             for nodeid in state["selected"]}
    for nodeid, why in state["selected"].items():
        tests[nodeid]["selected_by"] = why
    with open(cfg["report"], "w") as f:
        json.dump({"substituted": state["substituted"], "deselected": state["deselected"],
                   "tests": tests}, f, indent=1)


# --- the driver -------------------------------------------------------------------------

def _test_dir(path: str) -> str:
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "test", "test_torch.py")) or \
            os.path.isdir(os.path.join(path, "test")):
        return os.path.join(path, "test")
    return path


def _git_dir(path: str) -> Optional[str]:
    for candidate in (os.path.join(path, ".git"), path):
        if os.path.isdir(os.path.join(candidate, "objects")):
            return candidate
    return None


def checkout_at_ref(path: str, ref: str, suites: List[str], into: str) -> str:
    """The test folder of the checkout's commit ``ref``, written under ``into`` with
    ``git archive`` (only the files the suites need); returns that test folder."""
    git_dir = _git_dir(os.path.abspath(path))
    if git_dir is None:
        raise SystemExit(f"--ref {ref}: {path} is not a git checkout (no .git)")
    paths = [p for s in suites for p in SUITE_PATHS[s]]
    present = []
    for p in paths + ["version.txt"]:
        probe = subprocess.run(["git", f"--git-dir={git_dir}", "cat-file", "-e",
                                f"{ref}:{p}"], capture_output=True)
        if probe.returncode == 0:
            present.append(p)
    if not present:
        raise SystemExit(f"--ref {ref}: none of {paths} exists at that commit "
                         f"(git --git-dir={git_dir} tag -l 'v2.*' lists the release tags)")
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", ref, *present],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "test")


def check_version(test_dir: str) -> Optional[str]:
    """A warning if the checkout's version.txt names another minor version than the
    installed torch (its tests may need other internals), else None."""
    import torch
    version_file = os.path.join(os.path.dirname(test_dir), "version.txt")
    if not os.path.isfile(version_file):
        return (f"no version.txt beside {test_dir}: cannot tell which torch these tests "
                f"are for (installed: {torch.__version__})")
    with open(version_file) as f:
        theirs = f.read().strip()
    mine = torch.__version__.split("+")[0]
    if theirs.split(".")[:2] != mine.split(".")[:2]:
        tag = "v" + mine
        return (f"the checkout is torch {theirs}, the installed torch is {mine}: its tests "
                f"may need other internals; rerun with --ref {tag} if its history has "
                f"that tag (git tag -l '{tag}')")
    return None


def run_suite(suite: str, test_dir: str, args, tmp: str) -> dict:
    test_file = os.path.join(test_dir, SUITES[suite]["file"])
    if not os.path.isfile(test_file):
        return {"suite": suite, "error": f"{test_file} does not exist", "counts": {}}
    report = os.path.join(tmp, f"{suite}.json")
    ini = os.path.join(tmp, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")  # not the checkout's pytest.ini and its addopts
    cfg = {"suite": suite, "scaler": args.scaler, "optim_classes": args.optim_classes,
           "by_name_only": args.by_name_only, "report": report}
    env = dict(os.environ)
    env[CONFIG_ENV] = json.dumps(cfg)
    env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE, REPO, test_dir] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "pytest", "-p", "torch_suite", "-c", ini,
           "--rootdir", test_dir, "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short",
           test_file]
    if args.no_torch_conftest:
        cmd.append("--noconftest")
    if args.list:
        cmd.append("--collect-only")
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.pytest_args
    print(f"== {suite}: {SUITES[suite]['what']}", flush=True)
    print("   " + " ".join(cmd), flush=True)
    log_path = os.path.join(tmp, f"{suite}.log")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=test_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(log_path) as f:
        log_text = f.read()
    if args.verbose or not os.path.isfile(report):
        print(log_text[-20000:])
    if not os.path.isfile(report):
        return {"suite": suite, "error": f"pytest exited {proc.returncode} before reporting",
                "counts": {}, "log_tail": log_text[-5000:]}
    with open(report) as f:
        data = json.load(f)
    counts: Dict[str, int] = {}
    for entry in data["tests"].values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    counts["selected"] = len(data["tests"])
    counts["deselected"] = data["deselected"]
    return {"suite": suite, "test_file": test_file, "substituted": data["substituted"],
            "counts": counts, "pytest_exit": proc.returncode, "tests": data["tests"]}


def _print_result(result: dict, list_only: bool) -> None:
    suite = result["suite"]
    if "error" in result:
        print(f"{suite}: ERROR {result['error']}")
        if result.get("log_tail"):
            print(result["log_tail"])
        return
    c = result["counts"]
    if list_only:
        for nodeid, entry in sorted(result["tests"].items()):
            print(f"   {nodeid}  [{entry['selected_by']}]")
        print(f"{suite}: {c['selected']} selected, {c['deselected']} deselected "
              f"(substituting {result['substituted']})")
        return
    for nodeid, entry in sorted(result["tests"].items()):
        if entry["outcome"] in ("failed", "error", "not run"):
            print(f"   {entry['outcome'].upper():7} {nodeid}: "
                  f"{entry.get('message', '').splitlines()[0] if entry.get('message') else ''}")
    print(f"{suite}: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
          f"{c.get('error', 0)} errors, {c.get('skipped', 0)} skipped, "
          f"{c.get('xfailed', 0)} xfailed, {c.get('xpassed', 0)} xpassed "
          f"of {c['selected']} selected (substituting {result['substituted']})")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-tests", required=True,
                        help="a PyTorch checkout (the folder with test/) or its test/ folder")
    parser.add_argument("--ref", help="take the test files from this commit or tag of the "
                        "checkout's git history (e.g. v2.11.0)")
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--scaler", choices=["mixedprec", "torch"], default="mixedprec",
                        help="the GradScaler put in torch's places (torch: the control)")
    parser.add_argument("--optim-classes", choices=["mixedprec", "torch"], default="mixedprec",
                        help="the Adam/AdamW/SGD/Adagrad put in optim_db, or in torch.optim "
                        "for lrscheduler and swa (torch: the control)")
    parser.add_argument("--by-name-only", action="store_true",
                        help="gradscaler: only tests named grad_scal*/GradScaler, not those "
                        "whose source uses a GradScaler")
    parser.add_argument("--list", action="store_true", help="list the selected tests only")
    parser.add_argument("-k", help="a further pytest -k filter")
    parser.add_argument("--json", help="write the counts and each test's outcome here")
    parser.add_argument("--no-torch-conftest", action="store_true",
                        help="do not load the checkout's test/conftest.py")
    parser.add_argument("--verbose", action="store_true", help="print pytest's output")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)  # this checkout's mixedprec, as in the pytest process

    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils imports it)
    except ImportError:
        print("PyTorch's test utilities need expecttest: pip install expecttest",
              file=sys.stderr)
        return 2
    import torch

    suites = list(SUITES) if args.suite == "all" else [args.suite]
    if set(suites) & {"optim", *WHOLE_FILE} and args.optim_classes == "mixedprec":
        import importlib.util
        if importlib.util.find_spec("mixedprec.optim") is None:
            print("mixedprec.optim does not exist yet: run the optim suite with "
                  "--optim-classes torch (the control) until it does", file=sys.stderr)
            return 2
    tmp = tempfile.mkdtemp(prefix="torch-suite-")
    try:
        if args.ref:
            test_dir = checkout_at_ref(args.torch_tests, args.ref, suites, tmp)
        else:
            test_dir = _test_dir(args.torch_tests)
        warning = check_version(test_dir)
        if warning:
            print(f"warning: {warning}")
        results = [run_suite(s, test_dir, args, tmp) for s in suites]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for result in results:
        _print_result(result, args.list)
    if args.json:
        summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "torch": torch.__version__, "python": platform.python_version(),
                   "cpu": platform.processor() or platform.machine(),
                   "torch_tests": os.path.abspath(args.torch_tests), "ref": args.ref,
                   "version_warning": warning, "scaler": args.scaler,
                   "optim_classes": args.optim_classes, "suites": results}
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    def bad(result: dict) -> bool:
        counts = result["counts"]
        if "error" in result or counts.get("failed") or counts.get("error"):
            return True
        return bool(counts.get("not run")) and not args.list

    return 1 if any(bad(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
