"""Functional steps as JAX users write them: vmap over transforms, hypergradients, schedules of k.

References: a Python loop over examples (vmap), finite differences and optax's
``jax.grad`` through ``optax.inject_hyperparams`` (hypergradients), optax's
``MultiSteps(every_k_schedule=...)`` (scheduled accumulation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import vmap

import gradtx as gtx
from gradtx.testing import assert_trees_close

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
jax.config.update("jax_platforms", "cpu")

BATCH = 5


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g, dtype=dtype), "b": torch.randn(3, generator=g, dtype=dtype)}


def _per_example(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(BATCH, 4, 3, generator=g, dtype=dtype) * 2,
        "b": torch.randn(BATCH, 3, generator=g, dtype=dtype),
    }


VMAP_TXS = {
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(1.0),
    "clip": lambda: gtx.clip(0.5),
    "scale": lambda: gtx.scale(-0.3),
    "sgd": lambda: gtx.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: gtx.adam(1e-2),
    "adamw": lambda: gtx.adamw(1e-2, weight_decay=0.1),
    "adamw_tensor_betas": lambda: gtx.adamw(torch.tensor(1e-2), b1=torch.tensor(0.8), b2=torch.tensor(0.99)),
    "chain": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2)),
    "scale_by_learning_rate": lambda: gtx.scale_by_learning_rate(gtx.linear_schedule(0.1, 0.01, 5)),
}


@pytest.mark.parametrize("name", VMAP_TXS)
def test_vmap_over_examples_equals_a_loop(name):
    tx = VMAP_TXS[name]()
    params, grads = _params(), _per_example()
    state = tx.init(params)
    # Two steps, so the state a step returns (per example) goes back in.
    step = vmap(lambda g, s: tx.update(g, s, params), in_dims=(0, None))
    got_u, got_s = step(grads, state)
    got_u2, got_s2 = vmap(lambda g, s: tx.update(g, s, params))(grads, got_s)
    for i in range(BATCH):
        g_i = {k: v[i] for k, v in grads.items()}
        want_u, want_s = tx.update(g_i, state, params)
        want_u2, want_s2 = tx.update(g_i, want_s, params)

        def pick(tree, i=i):
            return gtx.tree.tree_map(lambda t: t[i], tree)

        assert_trees_close(pick(got_u), want_u, rtol=1e-6, atol=1e-7)
        assert_trees_close(pick(got_u2), want_u2, rtol=1e-6, atol=1e-7)
        assert_trees_close(pick(got_s2), want_s2, rtol=1e-6, atol=1e-7)


def test_vmap_global_norm_equals_a_loop():
    grads = _per_example()
    got = vmap(gtx.global_norm)(grads)
    want = torch.stack(
        [torch.linalg.vector_norm(torch.cat([v[i].flatten() for v in grads.values()])) for i in range(BATCH)]
    )
    torch.testing.assert_close(got, want)


def test_vmap_clip_state_holds_each_examples_norm():
    grads = _per_example()
    tx = gtx.clip_by_global_norm(1.0)
    state = tx.init(_params())
    _, state = vmap(lambda g: tx.update(g, state))(grads)
    torch.testing.assert_close(state.grad_norm, vmap(gtx.global_norm)(grads))


# --- hypergradients --------------------------------------------------------------------------

STEPS = 3


def _data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64))
            for _ in range(STEPS + 1)]  # fmt: skip


def _loss(p, x, y):
    return ((x @ p["w"] + p["b"] - y) ** 2).mean()


def _jloss(p, x, y):
    return ((x @ p["w"] + p["b"] - y) ** 2).mean()


# (gradtx factory, optax factory, hyperparameter, its value, other arguments)
HYPER = {
    "sgd-lr": (gtx.sgd, optax.sgd, "learning_rate", 0.1, {"momentum": 0.9}),
    "sgd-momentum": (gtx.sgd, optax.sgd, "momentum", 0.9, {"learning_rate": 0.1}),
    "adam-lr": (gtx.adam, optax.adam, "learning_rate", 0.05, {}),
    "adam-b1": (gtx.adam, optax.adam, "b1", 0.8, {"learning_rate": 0.05}),
    "adam-eps": (gtx.adam, optax.adam, "eps", 1e-2, {"learning_rate": 0.05}),
    "adamw-lr": (gtx.adamw, optax.adamw, "learning_rate", 0.05, {"weight_decay": 0.1}),
    "adamw-wd": (gtx.adamw, optax.adamw, "weight_decay", 0.1, {"learning_rate": 0.05}),
    "clip_by_global_norm": (gtx.clip_by_global_norm, optax.clip_by_global_norm, "max_norm", 0.3, {}),
}


def _final_loss(factory, name, value, kw, data):
    params = _params(torch.float64)
    params = {"w": torch.cat([params["w"], params["w"][:1]])[:4], "b": params["b"]}
    tx = gtx.inject_hyperparams(factory)(**{name: 0.5}, **kw)
    state = tx.init(params)
    state = state._replace(hyperparams={**state.hyperparams, name: value})
    for x, y in data[:-1]:
        grads = torch.func.grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
    return _loss(params, *data[-1])


def _optax_final_loss(factory, name, value, kw, data):
    p = _params(torch.float64)
    params = {k: jnp.asarray(v.numpy()) for k, v in p.items()}
    tx = optax.inject_hyperparams(factory)(**{name: 0.5}, **kw)
    state = tx.init(params)
    state.hyperparams[name] = value
    for x, y in data[:-1]:
        grads = jax.grad(_jloss)(params, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return _jloss(params, jnp.asarray(data[-1][0].numpy()), jnp.asarray(data[-1][1].numpy()))


@pytest.mark.parametrize("case", HYPER)
def test_hypergradient_matches_finite_differences_and_optax(case):
    factory, ofactory, name, value, kw = HYPER[case]
    data = _data()
    h = torch.tensor(value, dtype=torch.float64)
    got = torch.func.grad(lambda v: _final_loss(factory, name, v, kw, data))(h)
    # autograd gives the same as torch.func
    leaf = h.clone().requires_grad_()
    _final_loss(factory, name, leaf, kw, data).backward()
    torch.testing.assert_close(leaf.grad, got)
    eps = 1e-6 * max(1.0, value)
    fd = (_final_loss(factory, name, h + eps, kw, data) - _final_loss(factory, name, h - eps, kw, data)) / (2 * eps)
    torch.testing.assert_close(got, fd, rtol=1e-5, atol=1e-9)
    with jax.enable_x64(True):
        want = jax.jit(jax.grad(lambda v: _optax_final_loss(ofactory, name, v, kw, data)))(jnp.float64(value))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-9)


def test_hypergradient_on_a_step_under_no_grad_raises_saying_why():
    params = _params()
    tx = gtx.inject_hyperparams(gtx.sgd)(learning_rate=0.1)
    state = tx.init(params)
    state = state._replace(hyperparams={**state.hyperparams, "learning_rate": torch.tensor(0.1, requires_grad=True)})
    grads = gtx.tree.tree_map(torch.ones_like, params)
    # Under no_grad no gradient could reach the learning rate.
    with torch.no_grad(), pytest.raises(ValueError, match=r"hyperparams\['learning_rate'\] requires grad.*no_grad"):
        gtx.update_and_apply(tx, grads, state, params)
    # The pure step is differentiable, with closure tensors too.
    updates, _ = tx.update(grads, state, params)
    assert updates["w"].requires_grad
    lr = torch.tensor(0.1, requires_grad=True)
    updates, _ = gtx.sgd(lr).update(grads, gtx.sgd(lr).init(params), params)
    (g,) = torch.autograd.grad(updates["w"].sum(), lr)
    assert float(g) == -grads["w"].sum()


# --- every_k_schedule ----------------------------------------------------------------------


def test_every_k_schedule_matches_optax_multisteps():
    def schedule(n):  # written once for both: 1, 1, then 2, then 3 micro-steps per window
        return 1 + (n >= 2) * 1 + (n >= 3) * 1

    g = torch.Generator().manual_seed(3)
    grads_seq = [{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in range(14)]
    params = _params()
    tx = gtx.chain(gtx.accumulate(every_k_schedule=schedule), gtx.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    jparams = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    otx = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=lambda n: schedule(n))
    ostate = otx.init(jparams)
    ostep = jax.jit(otx.update)
    emitted = []
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        emitted.append(updates is not None)
        ou, ostate = ostep({k: jnp.asarray(v.numpy()) for k, v in grads.items()}, ostate, jparams)
        jparams = optax.apply_updates(jparams, ou)
        for k in params:
            np.testing.assert_allclose(params[k].numpy(), np.asarray(jparams[k]), rtol=1e-5, atol=1e-6)
    assert emitted[:8] == [True, True, False, True, False, False, True, False]


def test_every_k_schedule_and_k_are_exclusive_and_a_bad_schedule_fails_at_once():
    with pytest.raises(ValueError, match="exactly one"):
        gtx.accumulate(2, every_k_schedule=lambda n: 2)
    with pytest.raises(ValueError, match="exactly one"):
        gtx.accumulate()
    with pytest.raises(ValueError, match="every_k_schedule"):
        gtx.accumulate(every_k_schedule=lambda n: 0)
    with pytest.raises(TypeError, match="every_k_schedule"):
        gtx.accumulate(every_k_schedule=3)


@pytest.mark.parametrize("value", [torch.tensor(2.5), torch.tensor(1.5), torch.tensor(True)])
def test_a_schedule_tensor_that_is_not_a_whole_count_is_refused_as_the_python_number_is(value):
    # int() of a tensor truncates: 2.5 made windows of 2 (optax's MultiSteps closes one at mini_step >= k - 1: 3).
    with pytest.raises(ValueError, match=r"every_k_schedule\(0\) must be an integer >= 1"):
        gtx.accumulate(every_k_schedule=lambda n: value)
    with pytest.raises(ValueError, match="every_k_schedule"):
        gtx.accumulate(every_k_schedule=lambda n: value.tolist())
    tx = gtx.accumulate(every_k_schedule=lambda n: torch.tensor(3.0) if n == 0 else value)  # a whole float: fine
    state = tx.init({"w": torch.zeros(())})
    emitted = []
    for _ in range(3):
        out, state = tx.update({"w": torch.tensor(1.0)}, state)
        emitted.append(out is not None)
    assert emitted == [False, False, True]
    with pytest.raises(ValueError, match=r"every_k_schedule\(1\)"):  # the next window's length is checked too
        tx.update({"w": torch.tensor(1.0)}, state)
