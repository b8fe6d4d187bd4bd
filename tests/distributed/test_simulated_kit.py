"""gtx.testing's simulated mesh against real gloo processes, on the same cases.

The same ``assert_matches_single_device`` calls run under 4 gloo ranks (each rank checks its own part) and on
a simulated 2x2 mesh in the parent: a correct transform passes both, with even and uneven shards, and a
rank-inconsistent one fails both, at the same path. That is the kit's own check: what simulation reports is
what a real run does.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import gradtx as gtx
from gradtx import testing
from tests.distributed.harness import part_results, share_spawn

SHAPES = {"even": {"w": (8, 4), "v": (4, 8), "b": (4,)}, "uneven": {"w": (5, 3), "v": (3, 5), "b": (3,)}}


def _tree(shape: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shape.items()}


def _local_norm_clip() -> gtx.GradientTransformation:
    """A clip that measures only this rank's shard: right on one device, wrong on a mesh."""

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        local = [u.to_local() if isinstance(u, DTensor) else u for u in optree.tree_leaves(updates)]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in local]))
        return optree.tree_map(lambda u: u * torch.clamp(0.5 / (norm + 1e-6), max=1.0), updates), state

    return gtx.GradientTransformation(lambda p: gtx.EmptyState(), update)


CASES = {
    "adam_clip": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adam(0.1)),
    "zclip": lambda: gtx.zclip(warmup_steps=1, z_thresh=0.5),
    "local_norm_clip": _local_norm_clip,
}


def _check(name: str, kind: str, mesh: Any = None) -> str | None:
    """None when the check passes, else the failing message's first line (without its rank numbers)."""
    params, grads = _tree(SHAPES[kind], 0), [_tree(SHAPES[kind], 1 + i) for i in range(2)]
    kw: dict[str, Any] = {"mesh": mesh} if mesh is not None else {"mesh_shape": (2, 2), "names": ("dp", "tp")}
    try:
        testing.assert_matches_single_device(CASES[name](), grads, params, layout="tp_fsdp", **kw)
    except AssertionError as err:
        return str(err).split(":")[0] + ":" + str(err).split(":")[1]
    return None


def _gloo_part(rank: int) -> dict[str, str | None]:
    del rank
    return {f"{n}/{k}": _check(n, k) for n in CASES for k in SHAPES}


_SHARED = share_spawn({"kit": _gloo_part}, 4, prefix="simulated_kit")


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_simulation_reports_what_four_gloo_ranks_report(name, kind):
    real = [r[f"{name}/{kind}"] for r in part_results(_SHARED(), "kit")]
    simulated = _check(name, kind)
    if name == "local_norm_clip":
        assert simulated == "step 0: updates at ['b']", simulated
        assert any(r == "step 0: updates at ['b']" for r in real), real  # some rank sees its part differ
    else:
        assert simulated is None and real == [None] * 4, (simulated, real)
