"""``per_rank``: run rank-dependent local code once for every rank this process plays.

A step whose local work depends on the rank (Muon's exchange: what each rank
sends, and which matrices it owns) runs once per process under ``torchrun``.
On a simulated mesh (torch's ``LocalTensorMode``, :func:`gradtx.testing.simulated_mesh`)
one process plays every rank, and such code must run once per simulated rank
with that rank's values. torch's ``maybe_run_for_local_tensor`` does exactly
that and nothing otherwise; this adapter is the one place gradtx names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_each: Callable[[Any], Any] | None
try:
    from torch.distributed._local_tensor import maybe_run_for_local_tensor as _each
except ImportError:  # pragma: no cover - a build without local tensors simulates nothing
    _each = None


def per_rank(fn: F) -> F:
    """``fn``, run once for each rank this process plays (once, in a real run).

    ``fn`` must be local (no collective, no side effect). Its tensor and int
    arguments are each rank's own (a rank from :meth:`~gradtx.comm.Comm.rank`,
    a DTensor's local shard); it returns a tensor, an int, or a flat tuple of
    them with one length on every rank, which come back as each rank's value.
    """
    return fn if _each is None else _each(fn)  # type: ignore[return-value]
