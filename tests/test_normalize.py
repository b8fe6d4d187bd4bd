"""normalize_by_update_norm and centralize against optax 0.2.8."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close
from tests.optax_parity import grads_like, optax, params_tree, run_both


@pytest.mark.parametrize("kwargs", [{}, {"scale_factor": 3.0, "eps": 1e-2}])
def test_normalize_by_update_norm_matches_optax(kwargs):
    run_both(
        gtx.normalize_by_update_norm(**kwargs),
        optax.normalize_by_update_norm(**kwargs),
        params_tree(),
        steps=5,
        with_params=False,
    )


def test_normalize_by_update_norm_folds_into_a_chain_with_a_pending_scale():
    """After a scale, the executor hands the pending factor on; the result is still the normalised true update."""
    tx = gtx.chain(gtx.scale(-4.0), gtx.normalize_by_update_norm(2.0), gtx.scale_by_learning_rate(0.1))
    ref = optax.chain(optax.scale(-4.0), optax.normalize_by_update_norm(2.0), optax.scale_by_learning_rate(0.1))
    run_both(tx, ref, params_tree(), steps=3, with_params=False)
    g = grads_like(params_tree(), 0)
    updates, _ = tx.update(g, tx.init(g))
    assert abs(float(gtx.global_norm(updates)) - 0.2) < 1e-5


def test_centralize_matches_optax_and_leaves_vectors_alone():
    run_both(gtx.centralize(), optax.centralize(), params_tree(), steps=3, with_params=False)
    g = grads_like(params_tree(), 0)
    out, _ = gtx.centralize().update(g, gtx.centralize().init(g))
    assert torch.equal(out["b"], g["b"]) and torch.equal(out["s"], g["s"])
    assert_trees_close(out["w"].mean(dim=1), torch.zeros(4), atol=1e-6)


def test_both_are_pure():
    for tx in (gtx.normalize_by_update_norm(), gtx.centralize()):
        assert_pure(tx, grads_like(params_tree(), 0), params_tree(), steps=2)


# --- centralize on DTensors (simulated meshes) -----------------------------------------------------


def _mats(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"col": (6, 5), "row": (7, 5), "conv": (4, 3, 3, 2), "b": (6,)}  # uneven shards included
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


@pytest.mark.parametrize(
    "layout",
    [
        "tp_fsdp",  # FSDP2 over TP: colwise (_StridedShard(0), Shard(0)) and rowwise (Shard(0), Shard(1))
        {
            "col": [_StridedShard(0, split_factor=2), Shard(0)],
            "row": [_StridedShard(1, split_factor=2), Shard(1)],
            "conv": [Shard(2), Shard(0)],
        },
        {"col": [Replicate(), Shard(1)], "row": [Shard(0), Replicate()], "conv": [Shard(1), Shard(3)]},
    ],
    ids=["tp_fsdp", "rows_split_twice", "mixed"],
)
def test_centralize_on_sharded_rows_matches_one_device(layout):
    """Rows whole on a rank centralize where they are; rows cut over a mesh dim sum over its group first."""
    gtx.testing.assert_matches_single_device(
        gtx.centralize(), [_mats(1), _mats(2)], _mats(0), mesh_shape=(2, 2), names=("dp", "tp"), layout=layout,
        rtol=1e-12, atol=1e-12,
    )  # fmt: skip


def test_centralize_refuses_a_partial_update_naming_it():
    with gtx.testing.simulated_mesh(2, ("tp",)) as mesh:
        g = {"w": DTensor.from_local(torch.ones(2, 3), mesh, [Partial()], run_check=False)}
        with pytest.raises(ValueError, match=r"\['w'\].*Partial"):
            gtx.centralize().update(g, gtx.EmptyState())
