"""LocalComm: the single-process Comm, where every group has one rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradtx.comm.base import GroupKey, ReduceOp


class LocalComm:
    """A :class:`~gradtx.comm.Comm` for one process: every reduction is the identity."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
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
