"""The optax-parity transforms' states through gradtx.checkpoint.functional.state_dict / load_state_dict (the DCP format)."""

from __future__ import annotations

import pytest

import gradtx as gtx
from gradtx.testing import assert_trees_equal
from tests.optax_parity import grads_like, params_tree


def _every_other(step):
    return step % 2 == 0


CASES = {
    "lion": (lambda: gtx.lion(1e-2), {}),
    "lamb": (lambda: gtx.lamb(1e-2, weight_decay=0.1), {}),
    "lars": (lambda: gtx.lars(0.1), {}),
    "ema": (lambda: gtx.ema(0.9), {}),
    "schedule_free_adamw": (lambda: gtx.schedule_free_adamw(1e-2), {}),
    "sam": (lambda: gtx.sam(gtx.adam(1e-2), gtx.scale(0.05)), {}),
    "monitor": (lambda: gtx.chain(gtx.monitor({"n": gtx.measure_with_ema(gtx.global_norm, 0.9)}), gtx.sgd(0.1)), {}),
    "reduce_on_plateau": (lambda: gtx.chain(gtx.sgd(0.1), gtx.reduce_on_plateau()), {"value": 1.0}),
    "conditionally_mask": (lambda: gtx.conditionally_mask(gtx.adam(0.1), _every_other), {}),
    "selective_transform": (
        lambda: gtx.selective_transform(gtx.adam(0.1), freeze_mask={"w": True, "b": False, "conv": False, "s": False}),
        {},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_round_trips_through_the_checkpoint_format(name):
    make, extra = CASES[name]
    tx, params = make(), params_tree()
    state = tx.init(params)
    for i in range(2):
        _, state = tx.update(grads_like(params, i), state, params, **extra)
    saved = gtx.checkpoint.state_dict(state, params, tx=tx)
    restored = gtx.checkpoint.load_state_dict(saved, tx.init(params), params, tx=tx)
    assert_trees_equal(restored, state)
    g = grads_like(params, 7)
    assert_trees_equal(tx.update(g, restored, params, **extra), tx.update(g, state, params, **extra))
