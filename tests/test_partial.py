"""A Partial DTensor update (a pending sum) in transforms that work on local parts, on a simulated mesh.

Each rank holds one term P_i of G = sum P_i, and a transform's result is read as the sum of the ranks' outputs:
right only for a stateless map linear in G. Everything else refuses, naming the path, with its inputs untouched.
The numbers on real ranks, against one device, are in tests/distributed/test_optax_parity_sharded.py.
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.distributed._local_tensor import rank_map
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import gradtx as gtx
from gradtx.testing import assert_trees_equal

REFUSED = {
    "adam": lambda: gtx.adam(0.1),
    "adamw": lambda: gtx.adamw(0.1, weight_decay=0.1),
    "sgd_momentum": lambda: gtx.sgd(0.1, momentum=0.9),
    "sgd_weight_decay": lambda: gtx.sgd(0.1, weight_decay=0.5),
    "add_decayed_weights": lambda: gtx.add_decayed_weights(0.5),
    "clip": lambda: gtx.clip(2.0),
    "lion": lambda: gtx.lion(0.1),
    "ema": lambda: gtx.ema(0.5),
    "schedule_free_adamw": lambda: gtx.schedule_free_adamw(0.1),
    "sam": lambda: gtx.sam(gtx.sgd(0.1), gtx.sgd(0.05), sync_period=2),
    "zero_nans": gtx.zero_nans,  # a NaN term makes the whole sum NaN, which one rank's zeroing would not see
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_partial_update_is_refused_naming_its_path(name):
    with gtx.testing.simulated_mesh(2, ("tp",)) as mesh:
        term = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
        g = {"b": torch.ones(2), "w": DTensor.from_local(term.clone(), mesh, [Partial()], run_check=False)}
        params = {"b": torch.zeros(2), "w": DTensor.from_local(torch.ones(2, 2), mesh, [Replicate()], run_check=False)}
        tx = REFUSED[name]()
        state = tx.init(params)
        with pytest.raises(ValueError, match=r"leaf at \['w'\] is a Partial DTensor \(a pending sum\)"):
            tx.update(g, state, params)
        assert torch.equal(g["w"].to_local(), term) and g["w"].placements == (Partial(),)
        assert torch.equal(params["w"].to_local(), torch.ones(2, 2))


def test_a_stateless_linear_map_passes_a_partial_update_on():
    with gtx.testing.simulated_mesh(2, ("tp",)) as mesh:
        g = {"w": DTensor.from_local(torch.tensor([1.0, -2.0]), mesh, [Partial()], run_check=False)}
        for tx in (gtx.scale(-0.5), gtx.sgd(0.5)):
            u = tx.update(g, tx.init(g))[0]["w"]
            assert u.placements == (Partial(),) and torch.equal(u.to_local(), torch.tensor([-0.5, 1.0]))


def test_applying_a_partial_update_is_refused_naming_its_path():
    # sgd passes a Partial grad on, exactly; applied to a Replicate param, the sum would leave the param a pending sum
    # of world copies of itself. Reducing it is a collective, which the caller names: apply_updates refuses.
    with gtx.testing.simulated_mesh(2, ("tp",)) as mesh:
        term = torch.tensor([1.0, -2.0])
        # Each of the 2 simulated ranks holds its own copy of the term (a plain tensor would be one for all ranks).
        g = {"w": DTensor.from_local(rank_map(lambda r: term.clone()), mesh, [Partial()], run_check=False)}
        params = gtx.testing.distribute({"w": torch.ones(2)}, mesh, {"w": [Replicate()]})
        tx = gtx.sgd(0.5)
        updates = tx.update(g, tx.init(params), params)[0]
        with pytest.raises(ValueError, match=r"apply_updates: updates leaf at \['w'\] is a Partial DTensor"):
            gtx.apply_updates(params, updates)
        reduced = {"w": updates["w"].redistribute(placements=[Replicate()])}  # the user's collective
        new = gtx.apply_updates(params, reduced)["w"]
        assert new.placements == (Replicate(),)
        gtx.testing.assert_trees_close(new.to_local(), torch.ones(2) - 0.5 * (term + term), rtol=0, atol=0)
        assert params["w"].placements == (Replicate(),) and torch.equal(params["w"].full_tensor(), torch.ones(2))


@pytest.mark.parametrize("name", sorted(set(REFUSED) - {"clip", "zero_nans"}))  # elementwise and stateless
def test_an_update_placed_otherwise_than_its_state_is_refused_naming_its_path(name):
    """Grads sharded otherwise than the state (or params) a transform combines them with, shard by shard: where the
    local shapes agree, as (Shard(0), Replicate()) against (Replicate(), Shard(0)) for a 4x4 weight on a 2x2 mesh,
    each rank combined two different parts of the tensor and stepped wrong, silently."""
    with gtx.testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        full = torch.arange(16.0).reshape(4, 4)
        params = {"w": distribute_tensor(full, mesh, [Shard(0), Replicate()])}
        g = {"w": distribute_tensor(full / 10, mesh, [Replicate(), Shard(0)])}
        tx = REFUSED[name]()
        state = tx.init(params)
        before = optree.tree_map(torch.clone, state)
        with pytest.raises(
            ValueError, match=r"updates leaf at \['w'\] has placements \(Replicate\(\), Shard\(dim=0\)\)"
        ):
            tx.update(g, state, params)
        assert_trees_equal(state, before)
