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


@runtime_checkable
class ExchangeComm(Comm, Protocol):
    """A :class:`Comm` that can also move tensors between ranks: what sharded orthogonalization needs.

    A separate protocol, so a comm that only reduces (all a norm needs) still
    satisfies :class:`Comm`. :class:`~gradtx.comm.LocalComm` and
    :class:`~gradtx.comm.TorchComm` implement both.
    """

    def rank(self, group: GroupKey) -> int:
        """This process's rank within ``group`` (0 to ``size(group) - 1``)."""
        ...

    def all_to_all(
        self, tensors: Sequence[torch.Tensor], recv_numels: Sequence[int], group: GroupKey
    ) -> list[torch.Tensor]:
        """Send ``tensors[r]`` (1-d) to rank ``r`` of ``group`` and receive one 1-d tensor from every rank.

        ``recv_numels[r]`` is how many elements rank ``r`` sends here (every
        rank knows it from the shapes alone, so no sizes travel). All the
        tensors share one dtype and device. One collective, whatever the
        number of ranks; the inputs are not modified.
        """
        ...


def check_comm(comm: object, *, name: str) -> None:
    """Raise ``TypeError`` unless ``comm`` implements :class:`Comm`."""
    if not isinstance(comm, Comm):
        raise TypeError(f"{name}: comm must implement gradtx.comm.Comm (all_reduce, size), got {type(comm).__name__}")


def check_exchange_comm(comm: object, *, name: str) -> None:
    """Raise ``TypeError`` unless ``comm`` implements :class:`ExchangeComm`."""
    if not isinstance(comm, ExchangeComm):
        raise TypeError(
            f"{name}: comm must implement gradtx.comm.ExchangeComm (all_reduce, size, rank, all_to_all), "
            f"got {type(comm).__name__}"
        )
