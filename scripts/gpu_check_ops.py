"""Whether every registered mixedprec operator has a kernel for a dispatch key.

scripts/gpu_check.sh runs it with the key CUDA before any GPU test: a prebuilt
extension carried to the GPU machine must load there and hold its CUDA kernels.
tests/python/test_gpu_check.py runs the same code with the key CPU on machines without
a GPU, so that the check itself is tested where CI runs.

The operators are taken from the dispatcher (the schemas of csrc/ops.cpp's
TORCH_LIBRARY, registered when mixedprec loads), not from a Python list: a list of
Python names also holds helpers that are not operators (the 2026-11-27 run stopped on
one), and it would not notice an operator that was added to the C++ side only.

    python scripts/gpu_check_ops.py [--key CUDA] [--namespace mixedprec]

Prints one line; exits 0 when the namespace has at least one operator and each has a
kernel for the key, else 1 (no operator at all is a failure: the check must not pass
because it found nothing to check).
"""

import argparse
import sys
from typing import List, Optional, Sequence


def registered_ops(namespace: str = "mixedprec") -> List[str]:
    """The names of the operators registered in ``namespace``, as the dispatcher spells
    them (``mixedprec::fused_adam_``), sorted."""
    import torch

    prefix = f"{namespace}::"
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))


def ops_without_kernel(names: Sequence[str], key: str) -> List[str]:
    """The operators among ``names`` that have no kernel for dispatch key ``key``."""
    import torch

    return [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(n, key)]


def check(key: str = "CUDA", namespace: str = "mixedprec") -> int:
    """Prints the outcome of the check; returns the exit status."""
    # Loading the package loads mixedprec._C, which registers the operators.
    import mixedprec  # noqa: F401

    names = registered_ops(namespace)
    if not names:
        print(f"error: no operator is registered in the namespace '{namespace}' (did "
              "mixedprec._C load?): nothing to check, so the check fails")
        return 1
    missing = ops_without_kernel(names, key)
    short = [n.split("::", 1)[1] for n in missing]
    print(f"{namespace}: {key} kernels of {len(names) - len(missing)} of {len(names)} "
          "registered ops" + (f" (missing: {', '.join(short)})" if missing else ""))
    return 1 if missing else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--key", default="CUDA", help="dispatch key (default CUDA)")
    p.add_argument("--namespace", default="mixedprec",
                   help="operator namespace (default mixedprec)")
    args = p.parse_args(argv)
    return check(args.key, args.namespace)


if __name__ == "__main__":
    sys.exit(main())
