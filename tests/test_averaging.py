"""ema, incremental_update and periodic_update against optax 0.2.8, step by step."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close, assert_trees_equal
from tests.optax_parity import grads_like, optax, params_tree, round_trip, run_both, to_jax, to_torch


@pytest.mark.parametrize("decay", [0.0, 0.9, 0.999])
@pytest.mark.parametrize("debias", [True, False])
def test_ema_matches_optax(decay, debias):
    run_both(gtx.ema(decay, debias), optax.ema(decay, debias), params_tree(), steps=25, with_params=False)


def test_ema_state_round_trips_and_is_pure():
    round_trip(gtx.ema(0.9), params_tree())
    assert_pure(gtx.ema(0.9), grads_like(params_tree(), 0), params_tree(), steps=3)


def test_ema_keeps_its_accumulator_dtype():
    tx = gtx.ema(0.5, accumulator_dtype=torch.float64)
    params = params_tree()
    u, state = tx.update(grads_like(params, 0), tx.init(params))
    assert state.ema["w"].dtype == torch.float64 and u["w"].dtype == torch.float32


def test_incremental_update_matches_optax_and_keeps_none():
    new, old = params_tree(1), params_tree(2)
    for step_size in (0.0, 0.01, 0.5, torch.tensor(0.25)):
        ref = optax.incremental_update(to_jax(new), to_jax(old), float(step_size))
        assert_trees_close(gtx.incremental_update(new, old, step_size), to_torch(ref), rtol=1e-6, atol=1e-7)
    with_none = {**new, "s": None}
    out = gtx.incremental_update(with_none, old, 0.5)
    assert out["s"] is None and torch.allclose(out["b"], 0.5 * new["b"] + 0.5 * old["b"])


@pytest.mark.parametrize("tensor_step", [False, True])
def test_periodic_update_matches_optax(tensor_step):
    new, old = params_tree(1), params_tree(2)
    for step in range(7):
        ref = optax.periodic_update(to_jax(new), to_jax(old), step, 3)
        got = gtx.periodic_update(new, old, torch.tensor(step) if tensor_step else step, 3)
        assert_trees_equal(got, to_torch(ref))


def test_ema_of_params_is_an_eval_copy():
    """Feeding params (not grads) to ema keeps a debiased average of them, as Polyak averaging does."""
    params = params_tree()
    tx = gtx.ema(0.5, debias=False)
    state = tx.init(params)
    seq = [params_tree(i) for i in range(3)]
    for p in seq:
        avg, state = tx.update(p, state)
    expected = {k: 0.5 * seq[2][k] + 0.25 * seq[1][k] + 0.125 * seq[0][k] for k in params}
    assert_trees_close(avg, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tensor_step", [False, True])
def test_periodic_update_of_params_trained_in_place_is_a_copy(tensor_step):
    """A DQN target network beside a model torch.optim trains in place: it holds the params of the last update step.

    With int steps it was the model's own tensors, so it followed the model on every step after the first update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = {k: v.detach().clone() for k, v in model.named_parameters()}
    for step in range(4):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            expected = {k: v.detach().clone() for k, v in model.named_parameters()}
        target = gtx.periodic_update(
            dict(model.named_parameters()), target, torch.tensor(step) if tensor_step else step, update_period=2
        )
        assert_trees_equal({k: v.detach() for k, v in target.items()}, expected)
