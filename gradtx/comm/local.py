"""LocalComm: the single-process Comm, where every group has one rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradtx.comm.base import Done, GroupKey, ReduceOp


class LocalComm:
    """A :class:`~gradtx.comm.Comm` for one process: every reduction is the identity."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
        del op, group
        return list(tensors)

    def all_reduce_async(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> Done:
        return Done(self.all_reduce(tensors, op, group))

    def size(self, group: GroupKey) -> int:
        del group
        return 1

    def rank(self, group: GroupKey) -> int:
        del group
        return 0

    def group_id(self, group: GroupKey) -> tuple:
        return ("key", group)

    def __repr__(self) -> str:
        return "LocalComm()"
