"""A compiled donated step stores into a donated DTensor only where the result has its placements."""

from __future__ import annotations

import functools

import torch

from tests.distributed.harness import part_results, share_spawn


def _body(rank: int, world_size: int) -> dict[str, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gradtx.optimizers import fused as executor

    mesh = init_device_mesh("cpu", (world_size,))
    donated = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    same = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    other = distribute_tensor(torch.full((4, 2), 2.0), mesh, [Replicate()])
    kept = executor._store_into({"a": donated}, {"a": other})["a"]
    stored = executor._store_into({"a": donated}, {"a": same})["a"]
    return {
        "other placements are returned as they are": kept is other and tuple(kept.placements) == (Replicate(),),
        "same placements are stored into the donated buffer": stored is donated
        and bool((donated.to_local() == 1.0).all()),
    }


_SHARED = share_spawn({"body": functools.partial(_body, world_size=2)}, 2, prefix="donated_store")


def test_store_into_respects_dtensor_placements():
    for result in part_results(_SHARED(), "body"):
        assert all(result.values()), result
