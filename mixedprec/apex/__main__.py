"""``python -m mixedprec.apex script.py [args...]`` or ``python -m mixedprec.apex -m
module [args...]``: runs a legacy Apex script with ``apex``, ``amp_C`` and ``apex_C``
resolving to mixedprec (see :mod:`mixedprec.apex`).

``--half-dtype bfloat16`` (before the script) runs an fp16 script in bfloat16: it sets
``MIXEDPREC_HALF_DTYPE`` for the script and its child processes, so that amp's opt
levels, ``amp.init``, ``network_to_half`` and ``FP16Model`` cast to bfloat16 where the
script leaves the dtype to them, and torch's own ``Tensor.half()`` and ``Module.half()``
cast to bfloat16 too (loss scaling unchanged; see
:func:`mixedprec.fp16_utils.half_dtype` and
:func:`mixedprec.fp16_utils.redirect_half_casts`). ``--half-dtype float16`` sets it
back to Apex's float16.

The script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python
script.py args...`` would set them. For child Python processes (multiprocessing
spawn, ``torch.distributed.launch``, ``subprocess``), a temporary directory with
small files, ``apex/__init__.py``, ``amp_C.py``, ``apex_C.py`` and
``fused_adam_cuda.py``, goes first on
``PYTHONPATH`` and on ``sys.path``: when a child imports one of them, it installs the
alias there and hands over to what the name resolves to (mixedprec's module, or a real
Apex's when one is installed: see :mod:`mixedprec.apex`). The directory is removed
when the script ends.
"""

import os
import runpy
import site
import sys
import tempfile
from typing import List, Optional

import mixedprec

USAGE = ("usage: python -m mixedprec.apex [--half-dtype {bfloat16,float16}] "
         "(script.py | -m module) [args...]")
HALF_DTYPE_OPTION = "--half-dtype"

_SHIM = (
    "# Written by `python -m mixedprec.apex`: `import {name}` in a child process\n"
    "# resolves to mixedprec's Apex alias.\n"
    "from mixedprec.apex import _adopt\n"
    "_adopt(__name__)\n"
)


def _write_shim(directory: str) -> None:
    os.makedirs(os.path.join(directory, "apex"))
    with open(os.path.join(directory, "apex", "__init__.py"), "w") as f:
        f.write(_SHIM.format(name="apex"))
    for name in ("amp_C", "apex_C", "fused_adam_cuda"):
        with open(os.path.join(directory, f"{name}.py"), "w") as f:
            f.write(_SHIM.format(name=name))


def _child_pythonpath(shim: str) -> str:
    entries = [shim] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # Children must find mixedprec itself: add where it lives unless that is a
    # site-packages directory, which they search anyway.
    root = os.path.dirname(os.path.dirname(os.path.abspath(mixedprec.__file__)))
    site_dirs = site.getsitepackages() if hasattr(site, "getsitepackages") else []
    if root not in entries and root not in site_dirs:
        entries.append(root)
    return os.pathsep.join(entries)


def _take_half_dtype(argv: List[str]) -> List[str]:
    """Consumes a leading ``--half-dtype VALUE`` (or ``--half-dtype=VALUE``): checks VALUE
    and sets ``MIXEDPREC_HALF_DTYPE`` to it (exit status 2 for a bad or missing one);
    returns the arguments after it."""
    from mixedprec.compat.fp16_utils import HALF_DTYPE_VAR, half_dtype

    while argv and (argv[0] == HALF_DTYPE_OPTION or argv[0].startswith(HALF_DTYPE_OPTION + "=")):
        if argv[0] == HALF_DTYPE_OPTION:
            if len(argv) < 2:
                print(f"{USAGE}\nerror: {HALF_DTYPE_OPTION} expects a value: bfloat16 or "
                      "float16", file=sys.stderr)
                sys.exit(2)
            value, argv = argv[1], argv[2:]
        else:
            value, argv = argv[0].split("=", 1)[1], argv[1:]
        previous = os.environ.get(HALF_DTYPE_VAR)
        os.environ[HALF_DTYPE_VAR] = value
        try:
            half_dtype()
        except ValueError as err:
            if previous is None:
                del os.environ[HALF_DTYPE_VAR]
            else:
                os.environ[HALF_DTYPE_VAR] = previous
            print(f"{USAGE}\nerror: {HALF_DTYPE_OPTION} {value!r}: {err}", file=sys.stderr)
            sys.exit(2)
    return argv


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0)
    argv = _take_half_dtype(list(argv))
    if not argv or argv == ["-m"]:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    if argv[0].startswith("-") and argv[0] != "-m":  # (python's own options go before -m)
        print(f"python -m mixedprec.apex: unknown option {argv[0]!r} (pass python's options "
              "to python itself: python -u -m mixedprec.apex script.py)\n" + USAGE,
              file=sys.stderr)
        sys.exit(2)
    if argv[0] != "-m" and not os.path.exists(argv[0]):  # (as python: a message, exit 2)
        print(f"python -m mixedprec.apex: can't open file {os.path.abspath(argv[0])!r}: "
              "[Errno 2] No such file or directory", file=sys.stderr)
        sys.exit(2)
    from mixedprec.compat.fp16_utils import redirect_half_casts

    redirect_half_casts()
    with tempfile.TemporaryDirectory(prefix="mixedprec-apex-") as shim:
        _write_shim(shim)
        os.environ["MIXEDPREC_APEX_SHIM"] = shim
        os.environ["PYTHONPATH"] = _child_pythonpath(shim)
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path.insert(1, shim)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            # As `python script.py`: the script's directory first, not the cwd.
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            sys.path.insert(1, shim)
            runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
