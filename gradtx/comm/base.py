"""The Comm protocol: the only way a transform talks to other processes.

A transform never imports ``torch.distributed``. It asks a :class:`Comm` to
reduce a list of tensors over a named group, and a :class:`LocalComm` answers
in one process, so every transform can be unit-tested without a process group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from enum import Enum
from typing import Protocol, runtime_checkable

import torch

GroupKey = Hashable


class ReduceOp(str, Enum):
    """The reductions a transform may ask for."""

    SUM = "sum"
    MAX = "max"


@runtime_checkable
class Comm(Protocol):
    """Collectives over named groups; every rank calls them in the same order."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
        """Reduce every tensor over ``group`` in one coalesced collective; returns new tensors."""
        ...

    def size(self, group: GroupKey) -> int:
        """The number of ranks in ``group``."""
        ...


class PendingReduce(Protocol):
    """A reduction in flight: :meth:`wait` blocks until it is done and returns its results."""

    def wait(self) -> list[torch.Tensor]:
        """The reduced tensors, in the order they were given; call it once."""
        ...


@runtime_checkable
class AsyncComm(Comm, Protocol):
    """A :class:`Comm` that can also start a reduction and let the caller work while it runs."""

    def all_reduce_async(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> PendingReduce:
        """Start what :meth:`Comm.all_reduce` does; every rank still starts them in the same order."""
        ...


class Done:
    """A :class:`PendingReduce` that has already finished (what a blocking comm returns)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)

    def wait(self) -> list[torch.Tensor]:
        return self._tensors


def start_all_reduce(comm: Comm, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> PendingReduce:
    """Start a reduction on ``comm``: in the background on an :class:`AsyncComm`, else done before it returns."""
    if isinstance(comm, AsyncComm):
        return comm.all_reduce_async(tensors, op, group)
    return Done(comm.all_reduce(tensors, op, group))


def check_comm(comm: object, *, name: str) -> None:
    """Raise ``TypeError`` unless ``comm`` implements :class:`Comm`."""
    if not isinstance(comm, Comm):
        raise TypeError(f"{name}: comm must implement gradtx.comm.Comm (all_reduce, size), got {type(comm).__name__}")
