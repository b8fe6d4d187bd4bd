"""schedule_free, schedule_free_adamw/sgd and schedule_free_eval_params against optax.contrib's."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close
from tests.optax_parity import grads_like, optax, params_tree, round_trip, run_both, to_torch


def _check_eval(state, ref_state, p, rp):
    got = gtx.schedule_free_eval_params(state, p)
    want = optax.contrib.schedule_free_eval_params(ref_state, rp)
    assert_trees_close(got, to_torch(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"learning_rate": 1e-2, "warmup_steps": 5, "weight_decay": 0.1, "b1": 0.8}],
    ids=["default", "warmup"],
)
def test_schedule_free_adamw_matches_optax(kwargs):
    tx, ref = gtx.schedule_free_adamw(**kwargs), optax.contrib.schedule_free_adamw(**kwargs)
    _check_eval(*run_both(tx, ref, params_tree(), steps=20))


@pytest.mark.parametrize(
    "kwargs", [{"learning_rate": 0.1}, {"learning_rate": 0.1, "warmup_steps": 4, "weight_decay": 0.01}]
)
def test_schedule_free_sgd_matches_optax(kwargs):
    tx, ref = gtx.schedule_free_sgd(**kwargs), optax.contrib.schedule_free_sgd(**kwargs)
    _check_eval(*run_both(tx, ref, params_tree(), steps=20))


def test_schedule_free_around_any_optimizer_matches_optax():
    lr = 0.05
    tx = gtx.schedule_free(gtx.sgd(lr, momentum=0.5), learning_rate=lr, b1=0.7, weight_lr_power=1.0)
    ref = optax.contrib.schedule_free(optax.sgd(lr, momentum=0.5), learning_rate=lr, b1=0.7, weight_lr_power=1.0)
    _check_eval(*run_both(tx, ref, params_tree(), steps=20))


def test_eval_params_found_inside_a_chain_and_in_the_wrapper():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.schedule_free_sgd(0.1))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), gtx.chain(tx, gtx.scale(-1.0)))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    fstate = tx.init(params)
    x = torch.randn(4, 3)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        u, fstate = tx.update(grads, fstate, params)
        params = gtx.apply_updates(params, u)
    # SGD(lr=1) on -updates applies the updates: the wrapper's params are the functional ones.
    assert_trees_close(dict(model.named_parameters()), params, rtol=1e-5, atol=1e-6)
    eval_wrapped = gtx.schedule_free_eval_params(opt.tx_state, opt.param_tree())
    eval_functional = gtx.schedule_free_eval_params(fstate, params)
    assert_trees_close(eval_wrapped[0], list(eval_functional.values()), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ScheduleFreeState"):
        gtx.schedule_free_eval_params(gtx.sgd(0.1).init(params), params)


def test_state_round_trips_and_is_pure():
    round_trip(gtx.schedule_free_adamw(1e-2), params_tree())
    assert_pure(gtx.schedule_free_adamw(1e-2), grads_like(params_tree(), 0), params_tree(), steps=3)


def test_adamw_second_moment_is_fp32_for_bf16_params():
    # As scale_by_adam's moments (docs/optax.md): in bf16, b2=0.999's increments round away once the moment reaches
    # half of g**2, and it stuck there (0.5, where the recurrence gives 1 - 0.999**t; and it no longer decayed).
    tx = gtx.schedule_free_adamw(1e-3)
    y = {"w": torch.zeros(3, dtype=torch.bfloat16)}
    state = tx.init(y)
    ones = {"w": torch.ones(3, dtype=torch.bfloat16)}
    for _ in range(1000):
        updates, state = tx.update(ones, state, y)
    nu = state.base_optimizer_state[0].nu["w"]
    assert nu.dtype == torch.float32 and updates["w"].dtype == torch.bfloat16
    torch.testing.assert_close(nu, torch.full((3,), 1 - 0.999**1000), rtol=1e-4, atol=0)


def test_the_average_weights_are_fp32_for_bf16_params():
    # In bf16 (optax's dtype here) the weight sum stopped growing at 4.0 (about 400 steps of lr**2 = 0.01), so
    # ck = lr**2 / weight_sum stayed near 1/400 where schedule-free averages with 1/t.
    tx = gtx.schedule_free_sgd(0.1)
    y = {"w": torch.zeros(2, dtype=torch.bfloat16)}
    state = tx.init(y)
    for _ in range(2000):
        _, state = tx.update({"w": torch.ones(2, dtype=torch.bfloat16)}, state, y)
    assert state.weight_sum.dtype == state.max_lr.dtype == state.b1.dtype == torch.float32
    torch.testing.assert_close(state.weight_sum, torch.tensor(2000 * 0.1**2), rtol=1e-4, atol=0)
