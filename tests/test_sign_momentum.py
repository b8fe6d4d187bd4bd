"""scale_by_lion and lion against optax 0.2.8, step by step, functional and in the wrapper."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close
from tests.optax_parity import grads_like, optax, params_tree, round_trip, run_both


@pytest.mark.parametrize("mode", ["hard", "smooth", "refined"])
def test_scale_by_lion_matches_optax(mode):
    run_both(
        gtx.scale_by_lion(b1=0.8, b2=0.95, mode=mode, smooth_beta=2.0),
        optax.scale_by_lion(b1=0.8, b2=0.95, mode=mode, smooth_beta=2.0),
        params_tree(),
        steps=20,
        with_params=False,
    )


@pytest.mark.parametrize("weight_decay", [0.0, 1e-3, 0.1])
def test_lion_matches_optax(weight_decay):
    run_both(gtx.lion(1e-2, weight_decay=weight_decay), optax.lion(1e-2, weight_decay=weight_decay), params_tree())


def test_lion_with_schedule_and_mask_matches_optax():
    mask = {"w": True, "b": False, "conv": True, "s": False}
    gtx_tx = gtx.lion(gtx.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1, mask=mask)
    ref = optax.lion(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1, mask=mask)
    run_both(gtx_tx, ref, params_tree())


def test_lion_state_round_trips_and_is_pure():
    round_trip(gtx.lion(1e-2), params_tree())
    assert_pure(gtx.lion(1e-2), grads_like(params_tree(), 0), params_tree(), steps=3)


def test_scale_by_lion_in_the_wrapper_matches_the_functional_lion():
    """In the wrapper the inner torch optimizer takes the step: SGD(lr) on Lion's direction is Lion."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), gtx.scale_by_lion())
    tx = gtx.lion(1e-2, weight_decay=0.0)
    state = tx.init(params)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        grads = torch.func.grad(lambda p: torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y))(
            params
        )
        u, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, u)
    assert_trees_close(dict(model.named_parameters()), params, rtol=1e-5, atol=1e-6)
