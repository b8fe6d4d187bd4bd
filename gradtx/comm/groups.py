"""Reductions over several groups at once: every collective started before the first wait.

A value may need summing over more than one group (a grad sharded over both
``dp`` and ``tp``). Sums and maxima over different groups commute, so the
groups are put in levels (two groups that some value needs together get
different levels; the fewest levels, in the plan's group order): every
collective of a level is started at once, one per group for every value that
needs it, and the next level starts when they are done. A plan whose values
each need one group (DDP, FSDP, TP alone, or TP and FSDP grads in different
buckets) starts everything before it waits, once. Every rank starts the same
collectives in the same order, because the levels depend only on the plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradtx.comm.base import Comm, GroupKey, PendingReduce, ReduceOp, start_all_reduce


def levels(groups: Sequence[tuple[GroupKey, ...]], order: Sequence[GroupKey]) -> list[list[GroupKey]]:
    """The groups of ``order`` in levels: no value's groups share a level; each group at the first level it can take."""
    level_of: dict[GroupKey, int] = {}
    for group in order:
        taken = {level_of[g] for gs in groups if group in gs for g in gs if g in level_of}
        level_of[group] = next(k for k in range(len(order) + 1) if k not in taken)
    out: list[list[GroupKey]] = [[] for _ in range(max(level_of.values(), default=-1) + 1)]
    for group in order:
        out[level_of[group]].append(group)
    return out


class PendingGroups:
    """Reductions over groups in flight (from :func:`start_reduce_over_groups`); :meth:`wait` finishes them."""

    def __init__(
        self,
        comm: Comm,
        values: Sequence[torch.Tensor],
        groups: Sequence[tuple[GroupKey, ...]],
        order: Sequence[GroupKey],
        op: ReduceOp,
    ) -> None:
        self._comm, self._op = comm, op
        self._values = list(values)
        self._groups = [tuple(gs) for gs in groups]
        self._levels = levels(self._groups, order)
        self._next = 0
        self._in_flight: list[tuple[list[int], PendingReduce]] = []
        self._start_level()

    def _start_level(self) -> None:
        if self._next >= len(self._levels):
            return
        for group in self._levels[self._next]:
            idx = [i for i, gs in enumerate(self._groups) if group in gs]
            if idx:
                pending = start_all_reduce(self._comm, [self._values[i] for i in idx], self._op, group)
                self._in_flight.append((idx, pending))
        self._next += 1

    def wait(self) -> list[torch.Tensor]:
        """Wait for every level in turn (starting each after the last); returns the reduced values, in order."""
        while self._in_flight:
            for idx, pending in self._in_flight:
                for i, r in zip(idx, pending.wait()):
                    self._values[i] = r
            self._in_flight = []
            self._start_level()
        return self._values


def start_reduce_over_groups(
    comm: Comm,
    values: Sequence[torch.Tensor],
    groups: Sequence[tuple[GroupKey, ...]],
    order: Sequence[GroupKey],
    op: ReduceOp,
) -> PendingGroups:
    """Start reducing ``values[i]`` over every group in ``groups[i]``: one collective per group, in ``order`` by level.

    The first level's collectives are started before this returns (in the
    background on an :class:`~gradtx.comm.AsyncComm`); work done before
    ``.wait()`` overlaps them.

    Returns:
      A :class:`PendingGroups`; its ``wait()`` returns the reduced values.
    """
    return PendingGroups(comm, values, groups, order, op)


def reduce_over_groups(
    comm: Comm,
    values: Sequence[torch.Tensor],
    groups: Sequence[tuple[GroupKey, ...]],
    order: Sequence[GroupKey],
    op: ReduceOp,
) -> list[torch.Tensor]:
    """Reduce ``values[i]`` over every group in ``groups[i]`` (see :func:`start_reduce_over_groups`), and wait."""
    return start_reduce_over_groups(comm, values, groups, order, op).wait()
