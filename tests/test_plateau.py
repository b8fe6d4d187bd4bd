"""reduce_on_plateau against optax.contrib's, fed a loss curve with plateaus, improvements and cooldowns."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure
from tests.optax_parity import grads_like, optax, params_tree, round_trip, run_both, to_torch

# Improves, stalls long enough to cut the scale twice, improves again, stalls.
LOSSES = [5.0, 4.0, 3.0] + [3.0] * 8 + [2.0, 1.9, 1.0] + [1.0] * 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"patience": 2},
        {"patience": 2, "cooldown": 3, "factor": 0.5},
        {"patience": 1, "accumulation_size": 3, "min_scale": 0.05},
        {"patience": 2, "rtol": 0.0, "atol": 0.5},
    ],
    ids=["patience", "cooldown", "accumulation", "atol"],
)
def test_reduce_on_plateau_matches_optax(kwargs):
    tx = gtx.chain(gtx.sgd(0.1), gtx.reduce_on_plateau(**kwargs))
    ref = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(**kwargs))
    state, ref_state, _, _ = run_both(
        tx, ref, params_tree(), steps=len(LOSSES), extra=lambda i: {"value": torch.tensor(LOSSES[i])}
    )
    got, want = state[1], ref_state[1]
    for field in ("scale", "best_value", "plateau_count", "cooldown_count", "count", "avg_value"):
        assert float(getattr(got, field)) == pytest.approx(float(to_torch(getattr(want, field))), rel=1e-6), field
    assert float(got.scale) < 1.0  # the curve really plateaued
    assert float(gtx.metrics(state)["plateau_scale"]) == float(got.scale)


def test_a_nan_value_given_as_a_number_is_no_improvement_as_in_optax():
    """A NaN loss given as a number (a diverged batch's loss.item()) raised 'value must not be NaN'; optax (and a NaN
    tensor here) take it as a value that does not improve."""
    losses = [3.0, 2.0, float("nan"), 2.0, float("nan"), 1.0, float("nan"), float("nan"), float("nan")]
    kwargs = {"patience": 2, "cooldown": 1, "accumulation_size": 1}
    tx = gtx.chain(gtx.sgd(0.1), gtx.reduce_on_plateau(**kwargs))
    ref = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(**kwargs))
    state, ref_state, _, _ = run_both(tx, ref, params_tree(), steps=len(losses), extra=lambda i: {"value": losses[i]})
    for field in ("scale", "best_value", "plateau_count", "cooldown_count"):
        assert float(getattr(state[1], field)) == pytest.approx(float(to_torch(getattr(ref_state[1], field)))), field
    assert float(state[1].scale) == pytest.approx(0.01)  # cut twice: after a NaN and a 2.0, then after two NaNs


def test_value_is_required_and_named():
    tx = gtx.reduce_on_plateau()
    with pytest.raises(ValueError, match="reduce_on_plateau: update\\(\\) needs value="):
        tx.update(grads_like(params_tree(), 0), tx.init(params_tree()))


def test_state_round_trips_and_is_pure():
    round_trip(gtx.reduce_on_plateau(patience=1), params_tree(), extra=lambda i: {"value": 1.0})
    assert_pure(gtx.reduce_on_plateau(patience=1), grads_like(params_tree(), 0), params_tree(), steps=3, value=2.0)


def test_in_the_wrapper_the_scale_multiplies_the_grads():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.reduce_on_plateau(patience=1))
    for _ in range(4):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step(value=1.0)  # never improves after the first: the scale drops on every second value
    assert float(opt.tx_state[0].scale) == pytest.approx(0.1**3)
