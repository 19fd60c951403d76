"""The environment `make test` / `make demo` build is usable for a person's own scripts."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_venv_imports_mixedprec_without_pythonpath():
    """Before: `.venv/bin/python -c "import mixedprec"` failed unless PYTHONPATH was set."""
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("runs in the repository's .venv (make test)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import mixedprec; print(mixedprec.__file__)"],
                         cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == REPO / "mixedprec" / "__init__.py"
