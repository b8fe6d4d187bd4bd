"""Run Python scripts as ``python SCRIPT ARGS...`` would, each in a process forked from one that imported torch once.

Importing torch and gradtx costs a few seconds of CPU, which dominates a short example run;
tests/test_examples.py runs a dozen. This server imports them once, then for each request forks a
child that runs the script as ``__main__`` (``sys.argv`` and ``sys.path[0]`` set as the
interpreter sets them, stdout and stderr to the files named, the working directory and
environment the server was started with) and reports its exit code. The child is a fresh process:
nothing one script does is seen by the next.

Tests call :func:`run_script`; the server starts on the first call. Protocol, one JSON object per
line: the client writes ``{"argv": [script, *args], "stdout": path, "stderr": path}`` on stdin;
the server answers ``{"pid": pid}`` when the child starts and ``{"code": exit_code}`` when it
ends. EOF on stdin stops the server.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _child(argv: list[str], stdout: str, stderr: str) -> int:
    os.setpgrp()  # the client can end the script and whatever it started in one kill
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        target = os.open(path, flags | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
        os.dup2(target, fd)
        os.close(target)
    return run_as_main(argv[0], argv[1:])


def run_as_main(script: str, args: list[str], *, where: str = "") -> int:
    """Run ``script`` in this process as ``python SCRIPT ARGS...`` runs it; return its exit code.

    ``sys.argv`` and ``sys.path[0]`` are set as the interpreter sets them. An uncaught exception is
    printed to stderr (after ``where``, when given, e.g. which rank) and gives exit code 1, as the
    interpreter does; output is flushed before returning. Meant for a forked child: the script's
    module state stays in this process.
    """
    path = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(path)
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        if where:
            print(f"{path} raised {where}:", file=sys.stderr)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    # Three examples set this before they import torch (OpenMP reads it when it loads); here torch is
    # imported for them, so it is set first.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch  # noqa: F401 - the point of the server: imported once, before the forks

    import gradtx  # noqa: F401

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


# --- the client, in the test process ----------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


class _Client:
    """The server, started on first use, as a subprocess of the test process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ)
            # The package may not be installed into the interpreter (a plain checkout): import it from the repo.
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())],
                cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            )  # fmt: skip
            atexit.register(self.stop)
        return self.proc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: the server exits
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def _reply(self, proc: subprocess.Popen[str], deadline: float) -> dict:
        if not select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
            raise TimeoutError
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/fork_server.py ended (exit code {proc.wait()})")
        return json.loads(line)

    def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        proc = self.start()
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            proc.stdin.write(json.dumps({"argv": argv, "stdout": str(out), "stderr": str(err)}) + "\n")
            proc.stdin.flush()
            try:
                pid = self._reply(proc, deadline)["pid"]
                try:
                    code = self._reply(proc, deadline)["code"]
                except TimeoutError:
                    os.killpg(pid, signal.SIGKILL)  # the script and what it started
                    raise AssertionError(
                        f"{argv[0]} ran past {timeout:.0f} s:\n{out.read_text()}\n{err.read_text()}"
                    ) from None
            except BaseException:
                self.stop()  # out of step with the server: the next run starts a new one
                raise
            return code, out.read_text(), err.read_text()


_CLIENT = _Client()


def run_script(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """Run ``python argv[0] argv[1:]`` from the repo root (repo on PYTHONPATH); return exit code, stdout, stderr.

    Fails the caller if the script runs past ``timeout`` seconds (it is killed, with what it started).
    """
    return _CLIENT.run(argv, timeout)


if __name__ == "__main__":
    main()
