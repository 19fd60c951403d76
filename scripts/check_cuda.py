"""Prints 1 when setup.py will build the CUDA kernels, else 0.

Exits with an error when it would build them with an nvcc whose CUDA major version
differs from the one torch was built for: such a build fails, or its kernels do not
load. MIXEDPREC_CUDA=0 (CPU kernels only) skips the check.
"""

import logging
import os
import re
import subprocess
import sys

logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402


def main():
    if os.environ.get("MIXEDPREC_CUDA", "1") == "0":
        return 0
    if torch.version.cuda is None:
        print(f"note: torch {torch.__version__} is a CPU build: CPU kernels only", file=sys.stderr)
        return 0
    if cpp_extension.CUDA_HOME is None:
        print("note: no CUDA toolkit found (nvcc, CUDA_HOME): CPU kernels only", file=sys.stderr)
        return 0
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
        nvcc_cuda = re.search(r"release (\d+)\.(\d+)", out.stdout).group(1, 2)
    except (OSError, subprocess.CalledProcessError, AttributeError):
        sys.exit(f"error: cannot run {nvcc} --version; set CUDA_HOME to a CUDA toolkit, "
                 "or build the CPU kernels only with MIXEDPREC_CUDA=0")
    torch_cuda = torch.version.cuda.split(".")
    if nvcc_cuda[0] != torch_cuda[0]:
        sys.exit(f"error: {nvcc} is CUDA {'.'.join(nvcc_cuda)} but torch {torch.__version__} "
                 f"was built for CUDA {torch.version.cuda}: the major versions must match. "
                 f"Point CUDA_HOME at a CUDA {torch_cuda[0]}.x toolkit, install a torch built "
                 f"for CUDA {nvcc_cuda[0]}, or build the CPU kernels only with MIXEDPREC_CUDA=0")
    return 1


if __name__ == "__main__":
    print(main())
