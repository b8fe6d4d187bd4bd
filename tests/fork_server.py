"""Run Python scripts as ``python SCRIPT ARGS...`` would, each in a process forked from one that imported torch once.

Importing torch and gradtx costs a few seconds of CPU, which dominates a short example run;
tests/test_examples.py runs a dozen. This server imports them once, then for each request forks a
child that runs the script as ``__main__`` (``sys.argv`` and ``sys.path[0]`` set as the
interpreter sets them, stdout and stderr to the files named, the working directory and
environment the server was started with) and reports its exit code. The child is a fresh process:
nothing one script does is seen by the next.

Protocol, one JSON object per line: the client writes ``{"argv": [script, *args], "stdout": path,
"stderr": path}`` on stdin; the server answers ``{"pid": pid}`` when the child starts and
``{"code": exit_code}`` when it ends. EOF on stdin stops the server.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

# Three examples set this before they import torch (OpenMP reads it when it loads); here torch is
# imported for them, so it is set first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: F401 - the point of the server: imported once, before the forks

import gradtx  # noqa: F401


def _child(argv: list[str], stdout: str, stderr: str) -> int:
    os.setpgrp()  # the client can end the script and whatever it started in one kill
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        target = os.open(path, flags | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
        os.dup2(target, fd)
        os.close(target)
    script = os.path.abspath(argv[0])
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        reply.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request["argv"], request["stdout"], request["stderr"]))
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        reply.write(json.dumps({"code": code}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
