"""freeze, selective_transform, conditionally_mask and conditionally_transform against optax 0.2.8."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure
from tests.optax_parity import grads_like, optax, params_tree, round_trip, run_both

MASK = {"w": True, "b": False, "conv": False, "s": True}


@pytest.mark.parametrize("mask", [MASK, True, False])
def test_freeze_matches_optax(mask):
    run_both(
        gtx.chain(gtx.adam(0.1), gtx.freeze(mask)), optax.chain(optax.adam(0.1), optax.freeze(mask)), params_tree()
    )


@pytest.mark.parametrize("mask", [MASK, True, False])
def test_selective_transform_matches_optax_and_keeps_no_state_for_frozen_leaves(mask):
    state, _, _, _ = run_both(
        gtx.selective_transform(gtx.adam(0.1), freeze_mask=mask),
        optax.selective_transform(optax.adam(0.1), freeze_mask=mask),
        params_tree(),
    )
    if mask is MASK:
        mu = state.inner_states["train"][0].mu
        assert mu.get("w") is None and mu["b"].shape == (3,)


def _every_third(step, **kw):
    return step % 3 == 0


def _every_third_jax(step, **kw):
    return step % 3 == 0


@pytest.mark.parametrize("which", ["conditionally_mask", "conditionally_transform"])
def test_conditionals_match_optax(which):
    run_both(
        getattr(gtx, which)(gtx.adam(0.1), _every_third),
        getattr(optax, which)(optax.adam(0.1), _every_third_jax),
        params_tree(),
    )


@pytest.mark.parametrize("which", ["conditionally_mask", "conditionally_transform"])
def test_conditionals_forward_extra_args_to_the_predicate(which):
    tx = getattr(gtx, which)(gtx.sgd(0.1), lambda step, loss: loss < 1.0, forward_extra_args=True)
    ref = getattr(optax, which)(optax.sgd(0.1), lambda step, loss: loss < 1.0, forward_extra_args=True)
    run_both(tx, ref, params_tree(), steps=6, extra=lambda i: {"loss": torch.tensor(0.5 + 0.2 * i)})


def test_a_python_bool_predicate_is_obeyed():
    tx = gtx.conditionally_mask(gtx.trace(0.9), lambda step: False)
    params = params_tree()
    u, state = tx.update(grads_like(params, 0), tx.init(params))
    assert all(float(v.abs().sum()) == 0 for v in u.values())
    assert all(float(v.abs().sum()) == 0 for v in state.inner_state.trace.values())


def test_states_round_trip_and_transforms_are_pure():
    for tx in (
        gtx.freeze(MASK),
        gtx.selective_transform(gtx.adam(0.1), freeze_mask=MASK),
        gtx.conditionally_mask(gtx.adam(0.1), _every_third),
        gtx.conditionally_transform(gtx.adam(0.1), _every_third),
    ):
        round_trip(tx, params_tree())
        assert_pure(tx, grads_like(params_tree(), 0), params_tree(), steps=3)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="freeze: mask"):
        gtx.freeze({"w": 1})
    with pytest.raises(TypeError, match="selective_transform: optimizer"):
        gtx.selective_transform(None, freeze_mask=True)
    with pytest.raises(TypeError, match="should_transform_fn"):
        gtx.conditionally_mask(gtx.sgd(0.1), 3)
