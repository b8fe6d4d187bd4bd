"""Reductions over several groups: a value that needs summing over more than one group (a grad sharded over ``dp`` and ``tp``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradtx.comm.base import Comm, GroupKey, ReduceOp


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
    out = list(values)
    for group in order:
        idx = [i for i, gs in enumerate(groups) if group in gs]
        if idx:
            for i, r in zip(idx, comm.all_reduce([out[i] for i in idx], op, group)):
                out[i] = r
    return out
