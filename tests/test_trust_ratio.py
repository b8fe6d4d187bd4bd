"""scale_by_trust_ratio, lars and lamb against optax 0.2.8, step by step."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure
from tests.optax_parity import grads_like, optax, params_tree, round_trip, run_both


def _with_zero_param():
    params = params_tree()
    params["b"] = torch.zeros(3)  # a zero-norm param keeps ratio 1, as optax's does
    return params


@pytest.mark.parametrize(
    "kwargs", [{}, {"min_norm": 0.5}, {"trust_coefficient": 0.01, "eps": 1e-3}], ids=["default", "min_norm", "coef"]
)
def test_scale_by_trust_ratio_matches_optax(kwargs):
    run_both(gtx.scale_by_trust_ratio(**kwargs), optax.scale_by_trust_ratio(**kwargs), _with_zero_param(), steps=10)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"weight_decay": 1e-2, "nesterov": True},
        {"weight_decay": 1e-2, "weight_decay_mask": {"w": True, "b": False, "conv": True, "s": False}},
    ],
    ids=["default", "decay_nesterov", "masked"],
)
def test_lars_matches_optax(kwargs):
    run_both(gtx.lars(0.5, **kwargs), optax.lars(0.5, **kwargs), _with_zero_param())


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"weight_decay": 0.1}, {"eps_root": 1e-8, "weight_decay": 0.01}],
    ids=["default", "decay", "eps_root"],
)
def test_lamb_matches_optax(kwargs):
    run_both(gtx.lamb(1e-2, **kwargs), optax.lamb(1e-2, **kwargs), params_tree())


def test_states_round_trip_and_transforms_are_pure():
    for tx in (gtx.scale_by_trust_ratio(), gtx.lars(0.1), gtx.lamb(1e-2, weight_decay=0.1)):
        round_trip(tx, params_tree())
        assert_pure(tx, grads_like(params_tree(), 0), params_tree(), steps=3)


def test_trust_ratio_needs_params():
    tx = gtx.scale_by_trust_ratio()
    with pytest.raises(ValueError, match="scale_by_trust_ratio: update\\(\\) needs params"):
        tx.update(grads_like(params_tree(), 0), tx.init(None))


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_the_hypergradient_through_a_zero_update_is_finite(name):
    """A leaf whose update is exactly 0 but which stays in the graph (a dead ReLU layer) keeps the ratio 1, and its
    backward stays finite: the gradient of the loss after two steps with respect to the learning rate matches a
    central difference."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "dead": torch.randn(2, 3, dtype=torch.float64)}
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)

    def loss(p):
        return ((x @ p["w"].T - y) ** 2).mean() + torch.relu(x @ p["dead"].T - 100.0).sum()

    def loss_after(lr):
        tx = getattr(gtx, name)(lr)
        p, state = params, tx.init(params)
        for _ in range(2):
            updates, state = tx.update(torch.func.grad(loss)(p), state, p)
            p = gtx.apply_updates(p, updates)
        return loss(p)

    lr = torch.tensor(0.05, dtype=torch.float64)
    got = torch.func.grad(loss_after)(lr)
    h = 1e-6
    expected = (loss_after(lr + h) - loss_after(lr - h)) / (2 * h)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8)
