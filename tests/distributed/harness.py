"""Run a test body in N real processes on CPU with the gloo backend, and return each rank's result.

Example:
    def body(rank, world_size, x):
        return some_tensor_result

    results = run_distributed(body, world_size=4, args=(x,))  # one result per rank
"""

from __future__ import annotations

import io
import os
import queue as queue_lib
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Serialise here: tensors shared through the queue would die with this process.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank.

    ``fn`` must be importable (a module-level function). Results travel back
    serialised with ``torch.save``, so return tensors or plain Python values.
    Any rank's exception, or no answer within ``timeout`` seconds, fails the
    caller with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world_size):
        try:
            rank, status, payload = queue.get(timeout=timeout)
        except queue_lib.Empty:
            errors.append(f"no result within {timeout:.0f} s (a rank hung or died)")
            break
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _run_parts(rank: int, world_size: int, parts: dict[str, Callable[[int], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, part in parts.items():
        try:
            out[name] = part(rank)
        except Exception:  # noqa: BLE001 - reported per part, so one failure does not hide the others
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()  # a failed part must not leave the next one mid-collective on another rank
    return out


def run_parts(parts: dict[str, Callable[[int], Any]], world_size: int) -> list[dict[str, Any]]:
    """Run several independent checks in one spawn (a spawn costs seconds); returns each rank's results by part.

    Each part is a module-level ``fn(rank)``. A part that raises is recorded,
    not fatal: :func:`part_results` fails the test that reads it.
    """
    # One answer per rank after all the parts: the suite's shared spawns run a minute or two of parts.
    return run_distributed(_run_parts, world_size, args=(parts,), timeout=600.0)


def part_results(ranks: list[dict[str, Any]], name: str) -> list[Any]:
    """The results of part ``name`` on every rank; fails the calling test with a rank's traceback if it raised."""
    import pytest

    results = [r[name] for r in ranks]
    for rank, res in enumerate(results):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"rank {rank}, part {name!r}:\n{res['error']}")
    return results


# --- one spawn per world size for the whole distributed suite -----------------------------------

_registered: dict[int, dict[str, Callable[[int], Any]]] = {}
_results: dict[int, list[dict[str, Any]]] = {}
_after: dict[int, set[int]] = {}


def _run_pending(world_size: int) -> list[dict[str, Any]]:
    """Run the parts of ``world_size`` not run yet (after the spawns they wait for); return all its results."""
    for first in sorted(_after.get(world_size, ())):
        _run_pending(first)
    registry = _registered.get(world_size, {})
    done = _results.setdefault(world_size, [{} for _ in range(world_size)])
    missing = {k: v for k, v in registry.items() if k not in done[0]}
    if missing:
        for rank, res in enumerate(run_parts(missing, world_size)):
            done[rank].update(res)
    return done


def share_spawn(
    parts: dict[str, Callable[[int], Any]], world_size: int, *, prefix: str, after: int | None = None
) -> Callable[[], list[dict[str, Any]]]:
    """Register ``parts`` for the suite's one spawn of ``world_size`` processes; returns ``ranks()`` for a fixture.

    Test modules call this at import, so by the time the first fixture runs every
    module's parts are known, and all of them run in a single spawn (a spawn of 4
    processes costs seconds of CPU). ``ranks()`` gives this module's results, by rank,
    keyed by the names in ``parts``, as :func:`run_parts` does; read them with :func:`part_results`.
    Parts run in the order they were registered. ``after=4`` makes the spawn of
    ``world_size`` wait for the spawn of 4 processes (parts that read what parts on
    4 ranks wrote, such as a checkpoint saved on 4 ranks and loaded on 2).
    """
    registry = _registered.setdefault(world_size, {})
    for name, part in parts.items():
        registry[f"{prefix}:{name}"] = part
    if after is not None:
        if after == world_size:
            raise ValueError(f"after={after} is the spawn's own world size")
        _after.setdefault(world_size, set()).add(after)
        _registered.setdefault(after, {})

    def ranks() -> list[dict[str, Any]]:
        done = _run_pending(world_size)
        return [{k.split(":", 1)[1]: v for k, v in r.items() if k.startswith(prefix + ":")} for r in done]

    return ranks
