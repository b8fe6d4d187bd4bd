"""lookahead (with LookaheadParams and init_synced) against optax 0.2.8, step by step."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close
from tests.optax_parity import grads_like, optax, params_tree, to_jax, to_torch


@pytest.mark.parametrize("reset_state", [False, True])
@pytest.mark.parametrize("sync_period", [1, 3])
def test_lookahead_matches_optax(sync_period, reset_state):
    tx = gtx.lookahead(gtx.adam(0.05), sync_period, 0.5, reset_state=reset_state)
    ref = optax.lookahead(optax.adam(0.05), sync_period, 0.5, reset_state=reset_state)
    base = params_tree()
    p = gtx.LookaheadParams.init_synced(base)
    rp = optax.LookaheadParams.init_synced(to_jax(base))
    state, ref_state = tx.init(p), ref.init(rp)
    update = torch.func.grad(lambda fast: sum((v**2).sum() + v.sin().sum() for v in fast.values()))
    for i in range(12):
        g = update(p.fast)
        u, state = tx.update(g, state, p)
        ru, ref_state = ref.update(to_jax(g), ref_state, rp)
        p, rp = gtx.apply_updates(p, u), optax.apply_updates(rp, ru)
        assert isinstance(p, gtx.LookaheadParams)
        assert_trees_close(p.fast, to_torch(rp.fast), rtol=1e-5, atol=1e-5, msg=f"step {i} fast: ")
        assert_trees_close(p.slow, to_torch(rp.slow), rtol=1e-5, atol=1e-5, msg=f"step {i} slow: ")
    assert int(state.steps_since_sync) == int(ref_state.steps_since_sync)


def test_init_synced_copies_and_init_accepts_fast_params_alone():
    base = params_tree()
    p = gtx.LookaheadParams.init_synced(base)
    assert p.fast["w"].data_ptr() != base["w"].data_ptr() and torch.equal(p.slow["w"], base["w"])
    tx = gtx.lookahead(gtx.sgd(0.1), 2, 0.5)
    gtx.testing.assert_trees_equal(tx.init(base), tx.init(p))


def test_lookahead_state_round_trips_and_is_pure(tmp_path):
    tx = gtx.lookahead(gtx.adam(0.05), 2, 0.5, reset_state=True)
    p = gtx.LookaheadParams.init_synced(params_tree())
    state = tx.init(p)
    _, state = tx.update(grads_like(params_tree(), 0), state, p)
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    g = grads_like(params_tree(), 1)
    gtx.testing.assert_trees_equal(tx.update(g, loaded, p), tx.update(g, state, p))
    assert_pure(tx, grads_like(params_tree(), 0), p, steps=3)


def test_lookahead_refuses_plain_params():
    tx = gtx.lookahead(gtx.sgd(0.1), 2, 0.5)
    with pytest.raises(TypeError, match="LookaheadParams"):
        tx.update(grads_like(params_tree(), 0), tx.init(params_tree()), params_tree())
