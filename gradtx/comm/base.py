"""The Comm protocol: the only way a transform talks to other processes.

A transform never imports ``torch.distributed``. It asks a :class:`Comm` to
reduce a list of tensors over a named group, and a :class:`LocalComm` answers
in one process, so every transform can be unit-tested without a process group.
:func:`reduce_over_groups` reduces values that need more than one group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch

GroupKey = Hashable


class ReduceOp(str, Enum):
    """The reductions a transform may ask for."""

    SUM = "sum"
    MAX = "max"


@runtime_checkable
class Comm(Protocol):
    """Collectives over named groups; every rank calls them in the same order.

    This is everything gradtx calls on a comm. A comm of your own needs only
    :meth:`all_reduce` and :meth:`size`: gradtx adapts it with :func:`as_comm`,
    which gives it one rank per group and names each group by its key.
    """

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
        """Reduce every tensor over ``group`` in one coalesced collective; returns new tensors."""
        ...

    def size(self, group: GroupKey) -> int:
        """The number of ranks in ``group``."""
        ...

    def rank(self, group: GroupKey) -> int:
        """This process's rank within ``group``."""
        ...

    def group_id(self, group: GroupKey) -> Hashable:
        """What ``group`` is, as a hashable: two keys with the same id name one group (and share one collective)."""
        ...


@runtime_checkable
class ExchangeComm(Comm, Protocol):
    """A :class:`Comm` that can also move tensors between ranks: what sharded orthogonalization needs.

    A separate protocol, so a comm that only reduces (all a norm needs) still
    satisfies :class:`Comm`. :class:`~gradtx.comm.LocalComm` and
    :class:`~gradtx.comm.TorchComm` implement both.
    """

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
    """Raise ``TypeError`` unless ``comm`` has what every comm needs: ``all_reduce`` and ``size``."""
    missing = [m for m in ("all_reduce", "size") if not callable(getattr(comm, m, None))]
    if missing:
        raise TypeError(
            f"{name}: comm must implement gradtx.comm.Comm (all_reduce, size), got {type(comm).__name__} "
            f"without {', '.join(missing)}"
        )


def as_comm(comm: object, *, name: str) -> Comm:
    """``comm`` as a full :class:`Comm`: itself when it has every method, else adapted (see :class:`MinimalComm`)."""
    check_comm(comm, name=name)
    if isinstance(comm, Comm):
        return comm
    return MinimalComm(comm)


class MinimalComm:
    """A :class:`Comm` around one that has only ``all_reduce`` and ``size``.

    Its groups are named by their keys (two keys are two groups), and
    :meth:`rank` is 0 in a group of one rank; in a larger group it raises,
    because nothing else can tell which rank this is.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
        return self.inner.all_reduce(tensors, op, group)

    def size(self, group: GroupKey) -> int:
        return self.inner.size(group)

    def rank(self, group: GroupKey) -> int:
        if self.inner.size(group) == 1:
            return 0
        raise TypeError(
            f"{type(self.inner).__name__} has no rank(group), and group {group!r} has {self.inner.size(group)} "
            "ranks; give the comm a rank(group) method (gradtx.comm.TorchComm has one)"
        )

    def group_id(self, group: GroupKey) -> Hashable:
        return ("key", group)

    def __repr__(self) -> str:
        return f"MinimalComm({self.inner!r})"


def check_exchange_comm(comm: object, *, name: str) -> None:
    """Raise ``TypeError`` unless ``comm`` implements :class:`ExchangeComm`."""
    if not isinstance(comm, ExchangeComm):
        raise TypeError(
            f"{name}: comm must implement gradtx.comm.ExchangeComm (all_reduce, size, rank, group_id, all_to_all), "
            f"got {type(comm).__name__}"
        )


class LocalComm:
    """A :class:`~gradtx.comm.Comm` for one process: every reduction is the identity."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
        ReduceOp(op)  # an op TorchComm refuses ("mean") fails here too, not first on a cluster
        return list(tensors)

    def size(self, group: GroupKey) -> int:
        return 1

    def rank(self, group: GroupKey) -> int:
        return 0

    def all_to_all(
        self, tensors: Sequence[torch.Tensor], recv_numels: Sequence[int], group: GroupKey
    ) -> list[torch.Tensor]:
        if len(tensors) != 1 or len(recv_numels) != 1 or tensors[0].numel() != recv_numels[0]:
            raise ValueError(
                "LocalComm.all_to_all: one process sends one tensor to itself; got "
                f"{len(tensors)} tensors and recv_numels={list(recv_numels)}"
            )
        return [tensors[0]]

    def group_id(self, group: GroupKey) -> tuple:
        return ("key", group)

    def __repr__(self) -> str:
        return "LocalComm()"


def reduce_over_groups(
    comm: Comm,
    values: Sequence[torch.Tensor],
    groups: Sequence[tuple[GroupKey, ...]],
    order: Sequence[GroupKey],
    op: ReduceOp,
) -> list[torch.Tensor]:
    """Reduce ``values[i]`` over every group in ``groups[i]``: one coalesced collective per group, in ``order``.

    Sums and maxima over different groups commute, so the groups go one after
    another; every rank issues the same collectives in the same order, because
    ``order`` and ``groups`` come from the plan.
    """
    if len(groups) != len(values):
        raise ValueError(f"reduce_over_groups: {len(values)} values but {len(groups)} groups; give one per value")
    out = list(values)
    for group in order:
        idx = [i for i, gs in enumerate(groups) if group in gs]
        if idx:
            for i, r in zip(idx, comm.all_reduce([out[i] for i in idx], op, group)):
                out[i] = r
    return out
