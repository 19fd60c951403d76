"""The server of forked.py: imports torch once, then runs each requested program in a
forked child, as ``python`` would run it in a fresh process. Not a test module.

Protocol, one JSON object per line: a request on stdin ({"argv": [...] after the
interpreter's own name, "cwd", "env", "stdout", "stderr": file paths}); the answer on
stdout, first {"pid": ...} (the child, the leader of its own process group), then
{"status": ...} (os.waitpid's) once it has ended.
"""

import json
import os
import sys

import torch  # noqa: F401  (what every run shares: the interpreter's slowest import)

# sys.path as the interpreter built it, less its first entry (this script's folder) and
# the PYTHONPATH entries: a child's are put back from its own PYTHONPATH.
_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_SITE_PATH = [p for p in sys.path[1:] if p not in _PYTHONPATH]


def _child(request):
    """Runs the request's program in this (forked) process and exits with its status."""
    import atexit
    import runpy
    import threading
    import traceback
    import types

    os.setpgrp()  # (so that a timeout kills the program and whatever it started)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
    argv = request["argv"]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if "random" in sys.modules:  # (a fresh interpreter seeds it from the OS)
        sys.modules["random"].seed()
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *pythonpath, *_SITE_PATH]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *pythonpath, *_SITE_PATH]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *pythonpath, *_SITE_PATH]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        if exit.code is None:
            code = 0
        elif isinstance(exit.code, int):
            code = exit.code
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # what the interpreter does at its exit: wait for threads, run the atexit functions
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def main():
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    main()
