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


def check_comm(comm: object, *, name: str) -> None:
    """Raise ``TypeError`` unless ``comm`` implements :class:`Comm`."""
    if not isinstance(comm, Comm):
        raise TypeError(f"{name}: comm must implement gradtx.comm.Comm (all_reduce, size), got {type(comm).__name__}")
