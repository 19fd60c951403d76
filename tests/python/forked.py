"""``run_python``: ``subprocess.run([sys.executable, *args], ...)`` with its output as text,
for the tests that run programs as a user would (the docs' recipes, the legacy Apex
scripts, the examples), where each run would otherwise spend most of its time
importing torch again (2-3 s of a core on the 2-core machines).

Each pytest worker starts one server (fork_server.py) that imports torch once; a run
is a child forked from it that sets the run's working directory, environment,
``sys.argv`` and ``sys.path`` (its PYTHONPATH) as a new interpreter would, runs the
program as ``__main__`` (a script, ``-m module`` or ``-c code``), then waits for its
threads and runs its atexit functions. The server has run nothing but that import:
no thread pool, no CUDA context, no seed drawn.

A run takes a fresh interpreter instead (``subprocess.run``, the same arguments) when
its environment differs from the server's in a variable that the interpreter or the
libraries the server loaded read when they start (``_READ_AT_START``: Python's, the
locale, the C runtime's, OpenMP's, BLAS's, torch's and CUDA's; not PYTHONPATH, which
the child applies, PYTHONUNBUFFERED, which it emulates, or CUDA_VISIBLE_DEVICES, which
nothing reads before CUDA starts, and the server never starts it), when it passes
interpreter options, or when ``MIXEDPREC_TEST_FORK=0``. The other variables are the
child's own, as a new process's would be. Every run gets ``OMP_NUM_THREADS`` (its
share of the cores beside the other workers, as tests/python/conftest.py gives the
workers themselves) unless the caller sets it.
"""

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence

_SERVER_SCRIPT = Path(__file__).resolve().parent / "fork_server.py"
# The variables a run may not change from the server's: those the interpreter, the C
# runtime and the libraries the server loaded (GNU OpenMP, which torch's wheels link,
# BLAS, torch and CUDA's libraries) read when they start, so that the server's values
# hold in every child. (Prefixes; CUDA_VISIBLE_DEVICES, PYTHONPATH and PYTHONUNBUFFERED
# are a child's: see the module docstring. Not KMP_*, Intel OpenMP's, which the server
# does not load: scikit-learn and joblib set two of them in the worker when imported.)
_READ_AT_START = ("PYTHON", "LANG", "LC_", "LD_", "MALLOC_", "TMPDIR", "OMP_", "GOMP_",
                  "MKL_", "OPENBLAS_", "GOTO_", "NUMEXPR_", "TORCH", "PYTORCH_", "ATEN_",
                  "CUDA", "CUBLAS", "CUDNN", "NCCL_", "NVIDIA_")
_CHILD_VARIABLES = ("PYTHONPATH", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES")


def worker_threads() -> int:
    """This pytest worker's share of the cores (pytest-xdist: a worker per core)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


def default_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's) with OMP_NUM_THREADS (worker_threads) set when it
    is not."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", str(worker_threads()))
    return env


def _frozen(env: Dict[str, str]) -> Dict[str, str]:
    """The variables of ``env`` a run may not change (``_READ_AT_START``)."""
    return {k: v for k, v in env.items()
            if k.startswith(_READ_AT_START) and k not in _CHILD_VARIABLES}


def frozen_difference(env: Dict[str, str]) -> List[str]:
    """The variables that keep a run with ``env`` from being forked."""
    frozen, server = _frozen(env), _get_server().frozen
    return sorted(k for k in frozen.keys() | server.keys() if frozen.get(k) != server.get(k))


class _Server:
    def __init__(self):
        env = default_env()
        self.proc = subprocess.Popen([sys.executable, str(_SERVER_SCRIPT)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.frozen = _frozen(env)
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def answer(self, timeout: Optional[float]) -> Optional[dict]:
        """The server's next answer, or None after ``timeout`` seconds."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if not line:
            raise RuntimeError("tests/python/fork_server.py ended")
        return json.loads(line)

    def _read(self) -> None:
        """Puts the server's lines in ``lines`` (one reader for the server's life)."""
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")


_server: Optional[_Server] = None
_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    if _server is None or not _server.alive():
        _server = _Server()
        atexit.register(_server.stop)
    return _server


def forks(args: Sequence[str], env: Dict[str, str]) -> bool:
    """Whether ``run_python`` runs ``args`` with ``env`` in a forked child."""
    if os.environ.get("MIXEDPREC_TEST_FORK", "1") == "0" or not args:
        return False
    if args[0].startswith("-") and args[0] not in ("-c", "-m"):
        return False  # interpreter options
    if args[0] in ("-c", "-m") and len(args) < 2:
        return False
    return not frozen_difference(env)


def run_python(args: Sequence, *, cwd=None, env: Optional[Dict[str, str]] = None,
               timeout: Optional[float] = None,
               check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout, check=check)``, in a child forked from the worker's
    server where that runs the same (the module docstring)."""
    args = [str(a) for a in args]
    env = default_env(env)
    cwd = str(cwd if cwd is not None else os.getcwd())
    command = [sys.executable, *args]
    with _lock:
        forked = forks(args, env)
        log = os.environ.get("MIXEDPREC_TEST_FORK_LOG")  # (a line per run: how it ran)
        if log:
            why = "" if forked else " ".join(frozen_difference(env))
            with open(log, "a") as f:
                f.write(f"{'forked' if forked else 'fresh'} {' '.join(args)[:80]!r} {why}\n")
        if not forked:
            return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=check)
        with tempfile.TemporaryDirectory(prefix="forked-") as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            server = _get_server()
            server.proc.stdin.write(json.dumps(dict(argv=args, cwd=cwd, env=env,
                                                    stdout=str(out), stderr=str(err))) + "\n")
            server.proc.stdin.flush()
            pid = server.answer(None)["pid"]
            done = server.answer(timeout)
            if done is None:  # past the timeout: the program and what it started
                for kill in (os.killpg, os.kill):  # (os.kill: before its setpgrp)
                    try:
                        kill(pid, signal.SIGKILL)
                        break
                    except ProcessLookupError:
                        pass
                server.answer(None)
            stdout = out.read_text(errors="replace") if out.exists() else ""
            stderr = err.read_text(errors="replace") if err.exists() else ""
    if done is None:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    code = os.waitstatus_to_exitcode(done["status"])
    result = subprocess.CompletedProcess(command, code, stdout, stderr)
    if check:
        result.check_returncode()
    return result
