"""What the build checks before it compiles anything, each failure a one-line message
that names its cause and its fix. Used by setup.py (so every install path runs them:
`pip install --no-build-isolation .`, `pip wheel`, `setup.py build_ext`) and by the
Makefile; tests call the functions directly.

Run as a script it prints 1 when the CUDA kernels will be built, else 0, and exits
with the message when the build cannot go on.
"""

import importlib.util
import os
import re
import subprocess
import sys
from typing import List, Optional, Tuple

PIP = "python -m pip install"


class BuildError(Exception):
    """A build that cannot go on; str() is the one line to show."""


def missing_build_tools(find_spec=importlib.util.find_spec,
                        setuptools_version: Optional[str] = None) -> List[str]:
    """The pip names of the build requirements that are missing: setuptools, torch, and
    wheel where setuptools has no bdist_wheel of its own (before 70.1)."""
    missing = [name for name in ("setuptools", "torch") if find_spec(name) is None]
    if "setuptools" not in missing:
        if setuptools_version is None:
            import setuptools

            setuptools_version = setuptools.__version__
        major_minor = tuple(int(x) for x in re.findall(r"\d+", setuptools_version)[:2])
        if major_minor < (70, 1) and find_spec("wheel") is None:
            missing.append("wheel")
    return missing


def check_build_tools(**kwargs) -> None:
    missing = missing_build_tools(**kwargs)
    if missing:
        raise BuildError(f"mixedprec: the build needs {', '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed in this "
                         f"environment: run `{PIP} {' '.join(missing)}`, then build again")


def check_not_isolated_early(path=sys.path) -> None:
    """Before anything is imported: pip's isolated build environment is on the path.
    (pyproject.toml does not list torch as a build requirement, so pip does not download
    one into it; without this check the message would be a missing torch.)"""
    if any("pip-build-env-" in entry for entry in path):
        raise BuildError(
            "mixedprec: this build runs in pip's isolated build environment, which has no "
            "torch of yours; build with `pip install --no-build-isolation .` so that the "
            "extension is built against the torch you have")


def check_not_isolated(torch_file: str) -> None:
    """pip's build isolation installs a fresh torch (the newest on PyPI) into a
    temporary environment, and the extension would be built against it instead of the
    torch it will run with."""
    if "pip-build-env-" in torch_file:
        raise BuildError(
            "mixedprec: torch was imported from pip's isolated build environment "
            f"({os.path.dirname(torch_file)}), not from the environment mixedprec will run "
            "in; build with `pip install --no-build-isolation .` so that the extension is "
            "built against the torch you have")


def nvcc_version(cuda_home: str, run=subprocess.run) -> Tuple[str, str]:
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = run([nvcc, "--version"], capture_output=True, text=True, check=True)
        return re.search(r"release (\d+)\.(\d+)", out.stdout).group(1, 2)
    except (OSError, subprocess.CalledProcessError, AttributeError):
        raise BuildError(f"mixedprec: cannot run {nvcc} --version; set CUDA_HOME to a CUDA "
                         "toolkit, or build the CPU kernels only with MIXEDPREC_CUDA=0") from None


def want_cuda(env=os.environ, torch_cuda: Optional[str] = None,
              torch_version: str = "", cuda_home: Optional[str] = None,
              nvcc=nvcc_version) -> bool:
    """Whether to build the CUDA kernels: when the toolkit and a CUDA build of torch are
    present, unless MIXEDPREC_CUDA=0. A toolkit whose CUDA major version differs from
    torch's stops the build (such a build fails, or its kernels do not load), with the
    choices in the message."""
    if env.get("MIXEDPREC_CUDA", "1") == "0" or torch_cuda is None or cuda_home is None:
        return False
    major, minor = nvcc(cuda_home)
    torch_major = torch_cuda.split(".")[0]
    if major != torch_major:
        raise BuildError(
            f"mixedprec: nvcc in {cuda_home} is CUDA {major}.{minor} but torch "
            f"{torch_version} was built for CUDA {torch_cuda}; the major versions must "
            f"match. Choose one: build the CPU kernels only (`MIXEDPREC_CUDA=0 pip install "
            f"--no-build-isolation .`), point CUDA_HOME at a CUDA {torch_major}.x toolkit "
            f"(`{PIP} nvidia-cuda-nvcc-cu{torch_major}` gives one), or install a torch built "
            f"for CUDA {major}")
    return True


def default_max_jobs(cpus: Optional[int] = None, mem_bytes: Optional[int] = None,
                     cuda: bool = True) -> int:
    """Parallel compile jobs that fit the machine: one per core, at most one per 3 GiB
    of memory with CUDA (nvcc jobs of these kernels peak near 2.5 GiB), 1.5 GiB
    without."""
    cpus = cpus or os.cpu_count() or 1
    if mem_bytes is None:
        try:
            mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem_bytes = 0
    per_job = (3 if cuda else 1.5) * 2**30
    by_memory = int(mem_bytes // per_job) if mem_bytes else cpus
    return max(1, min(cpus, by_memory))


# The oldest torch the extension builds against: its 8-bit state's block scales are
# float8_e8m0fnu tensors (csrc/validate.cpp, mixedprec/optim/state8.py), a dtype torch
# has had since 2.7.
MIN_TORCH = (2, 7)


def torch_major_minor(torch_version: str) -> Tuple[int, int]:
    """(major, minor) of a torch version string such as "2.11.0+cu130"."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch_version).group(1, 2)
    return int(major), int(minor)


def check_torch_version(torch_version: str) -> None:
    """A torch older than MIN_TORCH: the build would fail deep in the compiler's
    output (2.6: at::kFloat8_e8m0fnu is not a member of at)."""
    if torch_major_minor(torch_version) < MIN_TORCH:
        want = ".".join(map(str, MIN_TORCH))
        raise BuildError(
            f"mixedprec: needs torch {want} or later (its 8-bit optimizer state's block "
            f"scales are torch.float8_e8m0fnu, new in {want}), found torch {torch_version}: "
            f'install a newer one (`{PIP} "torch>={want}"`), then build again')


def torch_requirement(torch_version: str) -> str:
    """The requirement a wheel built against ``torch_version`` carries: the same minor
    release (the extension links against torch's C++ library, whose ABI changes from
    one minor release to the next)."""
    major, minor = torch_major_minor(torch_version)
    return f"torch=={major}.{minor}.*"


def main() -> int:
    try:
        check_build_tools()
        import logging

        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        import torch
        from torch.utils import cpp_extension

        check_not_isolated(torch.__file__)
        check_torch_version(torch.__version__)
        return int(want_cuda(torch_cuda=torch.version.cuda, torch_version=torch.__version__,
                             cuda_home=cpp_extension.CUDA_HOME))
    except BuildError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    print(main())
