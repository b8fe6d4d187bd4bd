"""Run several multi-process programs, one after another, in the processes of one ``torchrun`` launch.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/torchrun_programs.py A.py B.py

Each rank imports torch once, then forks a process per program, which runs it as ``python A.py``
would under torchrun: as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` set for it, torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), and nothing left of the programs
before it (no process group, no device mesh, no module state). For a fresh rendezvous, rank 0
hosts a new store on a free port for every program and MASTER_PORT names it. A launch costs
seconds of CPU (torchrun and every rank import torch), so tests/distributed/test_programs.py runs
all the programs of one rank count in one launch.

Rank 0 prints ``::program I start::`` before program I and ``::program I ok::`` once every rank's
process for it has exited 0 (each flushes its output first). A program that raises, or exits
non-zero, ends every rank with exit code 1 (torchrun stops the others): the programs after it are
not run.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

import gradtx  # noqa: F401 - imported once here, before the fork, like torch

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.fork_server
from tests.fork_server import run_as_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(scripts: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    launch = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip  # torchrun's own store, for this driver's handshakes only
    for i, script in enumerate(scripts):
        key = f"gradtx-torchrun-programs/{i}"
        if rank == 0:
            launch.set(f"{key}/port", str(_free_port()))
            print(f"::program {i} start::", flush=True)
        os.environ["MASTER_PORT"] = launch.get(f"{key}/port").decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts the program's store
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(run_as_main(script, [], where=f"on rank {rank}"))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            print(f"{script} exited {code} on rank {rank}", file=sys.stderr, flush=True)
            os._exit(1)  # torchrun ends the other ranks
        sys.stdout.flush()
        sys.stderr.flush()
        launch.set(f"{key}/done/{rank}", "ok")
        if rank == 0:
            launch.wait([f"{key}/done/{r}" for r in range(world)])
            print(f"::program {i} ok::", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
