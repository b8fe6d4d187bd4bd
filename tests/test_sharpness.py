"""sam (transparent and opaque) against optax.contrib's, step by step."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close
from tests.optax_parity import grads_like, jax, optax, params_tree, round_trip, to_jax, to_torch


def _loss(p):
    return sum((v**2).sum() * 0.5 + v.sin().sum() for v in p.values())


def _loss_jax(p):
    import jax.numpy as jnp

    return sum((v**2).sum() * 0.5 + jnp.sin(v).sum() for v in p.values())


def _adv():
    return gtx.chain(gtx.normalize_by_update_norm(eps=0.0), gtx.scale(0.05))


def _adv_jax():
    return optax.chain(optax.contrib.normalize(), optax.scale(0.05))


@pytest.mark.parametrize("sync_period", [2, 3])
@pytest.mark.parametrize("reset_state", [True, False])
def test_transparent_sam_matches_optax(sync_period, reset_state):
    tx = gtx.sam(gtx.adam(0.05), gtx.chain(gtx.trace(0.5), _adv()), sync_period=sync_period, reset_state=reset_state)
    ref = optax.contrib.sam(
        optax.adam(0.05), optax.chain(optax.trace(0.5), _adv_jax()), sync_period=sync_period, reset_state=reset_state
    )
    p, rp = params_tree(), to_jax(params_tree())
    state, ref_state = tx.init(p), ref.init(rp)
    grad = torch.func.grad(_loss)
    for i in range(12):
        g = grad(p)
        u, state = tx.update(g, state, p)
        ru, ref_state = ref.update(to_jax(g), ref_state, rp)
        p, rp = gtx.apply_updates(p, u), optax.apply_updates(rp, ru)
        assert_trees_close(p, to_torch(rp), rtol=1e-5, atol=1e-5, msg=f"step {i}: ")


@pytest.mark.parametrize("reset_state", [True, False])
def test_sync_period_one_is_the_outer_optimizer(reset_state):
    # No adversarial step: every step is the outer optimizer's, as opaque mode and plain adam take it (optax's
    # transparent mode lags here: it measures each step from the previous step's params, so they never accumulate).
    p = q = r = params_tree()
    tx, opaque, ref = (
        gtx.sam(gtx.adam(0.05), _adv(), sync_period=1, reset_state=reset_state),
        gtx.sam(gtx.adam(0.05), _adv(), sync_period=1, reset_state=reset_state, opaque_mode=True),
        gtx.adam(0.05),
    )
    state, opaque_state, ref_state = tx.init(p), opaque.init(q), ref.init(r)
    grad = torch.func.grad(_loss)
    for i in range(4):
        u, state = tx.update(grad(p), state, p)
        v, opaque_state = opaque.update(grad(q), opaque_state, q, grad_fn=lambda x, _: grad(x))
        w, ref_state = ref.update(grad(r), ref_state, r)
        p, q, r = gtx.apply_updates(p, u), gtx.apply_updates(q, v), gtx.apply_updates(r, w)
        assert_trees_close(q, r, rtol=1e-6, atol=1e-6, msg=f"opaque, step {i}: ")
        assert_trees_close(p, r, rtol=1e-6, atol=1e-6, msg=f"transparent, step {i}: ")


def test_opaque_sam_matches_optax():
    tx = gtx.sam(gtx.sgd(0.1), _adv(), sync_period=3, opaque_mode=True)
    ref = optax.contrib.sam(optax.sgd(0.1), _adv_jax(), sync_period=3, opaque_mode=True)
    p, rp = params_tree(), to_jax(params_tree())
    state, ref_state = tx.init(p), ref.init(rp)
    grad, grad_jax = torch.func.grad(_loss), jax.grad(_loss_jax)
    for i in range(6):
        u, state = tx.update(grad(p), state, p, grad_fn=lambda q, _: grad(q))
        ru, ref_state = ref.update(grad_jax(rp), ref_state, rp, grad_fn=lambda q, _: grad_jax(q))
        p, rp = gtx.apply_updates(p, u), optax.apply_updates(rp, ru)
        assert_trees_close(p, to_torch(rp), rtol=1e-5, atol=1e-5, msg=f"step {i}: ")


def test_sam_state_round_trips_and_is_pure():
    tx = gtx.sam(gtx.adam(0.05), _adv())
    round_trip(tx, params_tree())
    assert_pure(tx, grads_like(params_tree(), 0), params_tree(), steps=3)
    with pytest.raises(ValueError, match="grad_fn"):
        opaque = gtx.sam(gtx.sgd(0.1), _adv(), opaque_mode=True)
        opaque.update(grads_like(params_tree(), 0), opaque.init(params_tree()), params_tree())
