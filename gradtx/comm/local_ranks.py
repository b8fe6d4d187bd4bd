"""The one adapter to torch's simulated ranks (``LocalTensorMode``, what :func:`gradtx.testing.simulated_mesh` runs).

Under ``LocalTensorMode`` one process is every rank at once: a tensor may be a
``LocalTensor`` holding one value per rank, and a rank is a ``SymInt`` over
one int per rank. torch leaves three places where code written for one rank
cannot run unchanged, and this module holds all three, so nothing else in
gradtx names the mode:

* a Python branch on a shard's size (shards differ per rank, empty ones
  included): :func:`per_rank` runs the function once per rank;
* a reduction of a plain tensor every rank shares (a token count): torch's
  local collectives reduce over a ``LocalTensor``'s ranks and leave a plain
  tensor as it is, so :func:`shared_to_ranks` gives it one copy per rank;
* this process's rank in a group, and a value's per-rank readings, for a
  diagnostic: :func:`group_rank`, :func:`rank_equals` and :func:`rank_values`.

Outside the mode every function here is the plain single-rank one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

try:
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode, maybe_run_for_local_tensor
except ImportError:  # pragma: no cover - a build without local tensors simulates nothing
    LocalTensor = None  # type: ignore[assignment,misc]

    def enabled_local_tensor_mode() -> Any:  # type: ignore[misc]
        return None

    def maybe_run_for_local_tensor(func):  # type: ignore[no-redef,misc]
        return func


_F = TypeVar("_F", bound=Callable[..., Any])


def per_rank(fn: _F) -> _F:
    """``fn``, run once per simulated rank on that rank's values (torch's ``maybe_run_for_local_tensor``)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if enabled_local_tensor_mode() is None:  # no simulated ranks (nor, traced, torch's wrapper: dynamo cannot)
            return fn(*args, **kwargs)
        return maybe_run_for_local_tensor(fn)(*args, **kwargs)

    return run  # type: ignore[return-value]


def shared_to_ranks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as one copy per simulated rank when every rank shares it as one plain tensor; else ``flat``."""
    mode = enabled_local_tensor_mode()
    if mode is None or isinstance(flat, LocalTensor):
        return flat
    return mode.rank_map(lambda r: flat.clone())


def group_rank(group: Any, rank: Callable[[Any], int]) -> int:
    """This process's rank in ``group`` (``rank(group)`` in a real run); on simulated ranks one per rank, as a SymInt.

    A mesh dim's ``ProcessGroup`` is rank 0's copy; every other simulated
    rank's group is a translate of it (torch's ``_prepare_collective_groups``).
    """
    mode = enabled_local_tensor_mode()
    if mode is None:
        return rank(group)
    import torch.distributed as dist
    from torch.distributed._local_tensor import _combine_int_rank_results
    from torch.distributed._local_tensor._c10d import _prepare_collective_groups

    ranks, offsets, _ = _prepare_collective_groups(group if group is not None else dist.group.WORLD)  # type: ignore[arg-type]
    within = {offset + r: i for offset in offsets for i, r in enumerate(ranks)}
    return _combine_int_rank_results({r: within[r] for r in sorted(mode.ranks)})  # type: ignore[return-value]


def rank_equals(rank: Any, value: int) -> bool | torch.Tensor:
    """``rank == value``: a bool, or on simulated ranks a per-rank 0-d bool tensor."""
    if isinstance(rank, int):
        return rank == value
    from torch.distributed._local_tensor import rank_map

    ranks = rank.node._local_ints
    return rank_map(lambda r: torch.tensor(ranks[r] == value))


def rank_values(t: torch.Tensor) -> list[float]:
    """The value of a 0-d (or one-element) tensor on each rank, read to the host: one float, or one per simulated rank."""
    mode = enabled_local_tensor_mode()
    if mode is None or not isinstance(t, LocalTensor):
        return [float(t)]
    with mode.disable():
        return [float(x) for _, x in sorted(t._local_tensors.items())]
