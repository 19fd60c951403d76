"""forked.run_python: a program run in a child of the worker's fork server behaves as in
a fresh interpreter (subprocess.run), and a run the server cannot stand for takes one."""

import os
import subprocess
import sys
import textwrap

import pytest
from forked import default_env, forks, frozen_difference, run_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = textwrap.dedent("""
    import os, sys
    print("name", __name__)
    print("argv", sys.argv[1:], os.path.basename(sys.argv[0]))
    print("path0", os.path.realpath(sys.path[0] or os.getcwd()))
    print("cwd", os.path.realpath(os.getcwd()))
    print("var", os.environ.get("MIXEDPREC_PROBE"))
    print("fresh", "mixedprec" not in sys.modules)
    import mixedprec
    print("mixedprec", os.path.realpath(os.path.dirname(mixedprec.__file__)))
    import torch
    print("threads", torch.get_num_threads())
    print("main", type(sys.modules["__main__"]).__name__, getattr(sys.modules["__main__"],
          "__file__", None) is not None)
""")


def fresh(args, cwd, env):
    """The same run in a new interpreter."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=default_env(env),
                          capture_output=True, text=True, timeout=120)


def probe_env(**more):
    return dict(os.environ, PYTHONPATH=REPO, MIXEDPREC_PROBE="x", **more)


def test_a_script_runs_as_in_a_fresh_interpreter(tmp_path):
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = probe_env()
    args = [script, "a", "--b=1"]
    assert forks([str(a) for a in args], default_env(env)), frozen_difference(default_env(env))
    got = run_python(args, cwd=tmp_path, env=env, timeout=120)
    want = fresh(args, tmp_path, env)
    assert got.returncode == want.returncode == 0, got.stderr + want.stderr
    assert got.stdout == want.stdout
    assert "fresh True" in got.stdout and "var x" in got.stdout
    assert f"path0 {os.path.realpath(script.parent)}" in got.stdout


def test_module_and_code_runs_as_in_a_fresh_interpreter(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    env = probe_env()
    for args in (["-m", "probe_module", "x"], ["-c", PROBE, "y"]):
        assert forks(args, default_env(env)), frozen_difference(default_env(env))
        got = run_python(args, cwd=tmp_path, env=env, timeout=120)
        want = fresh(args, tmp_path, env)
        assert got.returncode == want.returncode == 0, got.stderr + want.stderr
        assert got.stdout == want.stdout


@pytest.mark.parametrize("code, status, err", [
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit('no good')", 1, "no good"),
    ("raise ValueError('bad value')", 1, "ValueError: bad value"),
    ("import atexit; atexit.register(print, 'at exit')", 0, ""),
    ("import os; os._exit(7)", 7, ""),
])
def test_exit_status_and_errors_are_a_fresh_interpreters(tmp_path, code, status, err):
    got = run_python(["-c", code], cwd=tmp_path, timeout=120)
    want = fresh(["-c", code], tmp_path, None)
    assert got.returncode == want.returncode == status
    assert err in got.stderr and err in want.stderr
    assert got.stdout == want.stdout


def test_a_spawned_child_process_finds_the_main_module(tmp_path):
    script = tmp_path / "spawner.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp

        def child(q):
            q.put(6 * 7)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print("got", q.get(timeout=60))
            p.join()
    """))
    got = run_python([script], cwd=tmp_path, timeout=120)
    assert got.returncode == 0 and "got 42" in got.stdout, got.stderr


def test_a_timeout_kills_the_run_and_the_server_runs_the_next(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(600)"],
                   cwd=tmp_path, timeout=3)
    assert run_python(["-c", "print('next')"], cwd=tmp_path, timeout=60).stdout == "next\n"


def test_a_variable_the_server_has_read_gets_a_fresh_interpreter(tmp_path):
    """OMP_NUM_THREADS was read when the server imported torch: a run that sets another
    value is not forked, and sees its own value."""
    threads = 2 if default_env()["OMP_NUM_THREADS"] == "1" else 1
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    code = "import torch; print(torch.get_num_threads())"
    assert not forks(["-c", code], default_env(env))
    assert run_python(["-c", code], cwd=tmp_path, env=env, timeout=120).stdout == f"{threads}\n"
    assert not forks(["-u", "-c", code], default_env())  # interpreter options


def test_check_raises_as_subprocess_does(tmp_path):
    with pytest.raises(subprocess.CalledProcessError):
        run_python(["-c", "raise SystemExit(2)"], cwd=tmp_path, timeout=60, check=True)
