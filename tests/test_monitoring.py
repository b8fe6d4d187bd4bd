"""snapshot, monitor and measure_with_ema against optax 0.2.8; measurements readable from the state and gtx.metrics."""

from __future__ import annotations

import copy

import optree
import torch

import gradtx as gtx
from gradtx.testing import assert_pure
from tests.optax_parity import grads_like, jnp, optax, params_tree, round_trip, to_jax, to_torch


def _norm(tree):
    return gtx.global_norm(tree)


def _norm_jax(tree):
    return optax.tree.norm(tree)


def _max_abs(tree):
    return torch.stack([t.abs().max() for t in optree.tree_leaves(tree)]).max()


def _max_abs_jax(tree):
    return jnp.max(jnp.stack([jnp.max(jnp.abs(t)) for t in optree.tree_leaves(tree)]))


def _run(tx, ref, steps=8):
    params = params_tree()
    state, ref_state = tx.init(params), ref.init(to_jax(params))
    p, rp = params, to_jax(params)
    for i in range(steps):
        g = grads_like(params, i, scale=1.0 + i)
        u, state = tx.update(g, state, p)
        ru, ref_state = ref.update(to_jax(g), ref_state, rp)
        p, rp = gtx.apply_updates(p, u), optax.apply_updates(rp, ru)
        yield state, ref_state


def test_snapshot_matches_optax_and_is_read_through_metrics():
    tx = gtx.chain(
        gtx.snapshot("raw_norm", _norm), gtx.clip_by_global_norm(1.0), gtx.snapshot("clipped", _norm), gtx.sgd(0.1)
    )
    ref = optax.chain(
        optax.snapshot("raw_norm", _norm_jax),
        optax.clip_by_global_norm(1.0),
        optax.snapshot("clipped", _norm_jax),
        optax.sgd(0.1),
    )
    for state, ref_state in _run(tx, ref):
        got = float(state[0].measurement["raw_norm"])
        assert abs(got / float(to_torch(ref_state[0].measurement["raw_norm"])) - 1) < 1e-6
        metrics = gtx.metrics(state)
        assert float(metrics["raw_norm"]) == got
        assert abs(float(metrics["clipped"]) - float(ref_state[2].measurement["clipped"])) < 1e-5


def test_snapshot_of_params_that_require_grad_holds_no_graph():
    """init measures the params; of a model's nn.Parameters (the usual params) the state must hold a value, not an
    autograd graph back to the weights: a graph keeps them alive, and a state that holds one cannot be deep-copied."""
    model = torch.nn.Linear(4, 3)
    params = dict(model.named_parameters())
    state = gtx.chain(gtx.snapshot("param_norm", gtx.global_norm), gtx.sgd(0.1)).init(params)
    norm = state[0].measurement["param_norm"]
    assert not norm.requires_grad and norm.grad_fn is None
    expected = torch.linalg.vector_norm(torch.cat([model.weight.detach().flatten(), model.bias.detach()]))
    torch.testing.assert_close(copy.deepcopy(state)[0].measurement["param_norm"], expected)


def test_monitor_and_measure_with_ema_match_optax():
    tx = gtx.chain(
        gtx.monitor({"norm": _norm, "max": _max_abs, "norm_ema": gtx.measure_with_ema(_norm, 0.9)}), gtx.adam(0.1)
    )
    ref = optax.chain(
        optax.monitor({"norm": _norm_jax, "max": _max_abs_jax, "norm_ema": optax.measure_with_ema(_norm_jax, 0.9)}),
        optax.adam(0.1),
    )
    for state, ref_state in _run(tx, ref):
        for name in ("norm", "max", "norm_ema"):
            want = float(ref_state[0].measurements[name])
            assert abs(float(state[0].measurements[name]) - want) <= 1e-5 * abs(want), name
            assert float(gtx.metrics(state)[name]) == float(state[0].measurements[name])


def test_monitor_state_has_its_structure_from_init_and_round_trips():
    tx = gtx.monitor({"norm": _norm, "norm_ema": gtx.measure_with_ema(_norm, 0.9)})
    params = params_tree()
    s0 = tx.init(params)
    _, s1 = tx.update(grads_like(params, 0), s0, params)
    assert optree.tree_structure(s0) == optree.tree_structure(s1)
    round_trip(tx, params)
    round_trip(gtx.snapshot("n", _norm), params)
    assert_pure(tx, grads_like(params, 0), params, steps=2)


def test_in_the_wrapper_measurements_reach_opt_metrics():
    """The raw gradient norm recorded ahead of a clip is torch's clip_grad_norm_ total norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    tx = gtx.chain(
        gtx.monitor({"raw_norm": gtx.global_norm}), gtx.clip_by_global_norm(0.1), gtx.snapshot("clipped", _norm)
    )
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
        total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        ref_opt.step()
        assert abs(float(opt.metrics["raw_norm"]) - float(total)) <= 1e-5 * float(total)
        assert abs(float(opt.metrics["clipped"]) - min(float(total), 0.1)) < 1e-5
    gtx.testing.assert_trees_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-5, atol=1e-6)


def test_a_measurement_of_the_updates_themselves_is_a_copy():
    # A measure may return the updates (the raw grads ahead of a clip); the state held them, shared with the input.
    tx = gtx.chain(gtx.monitor({"raw": lambda u: u}), gtx.snapshot("raw_too", lambda u: u), gtx.scale(2.0))
    assert_pure(tx, grads_like(params_tree(), 0), params_tree(), steps=2)
    # In the wrapper, the chain's result is written into .grad: the raw grads recorded must stay the raw grads.
    weight = torch.nn.Parameter(torch.ones(3))
    opt = gtx.TransformedOptimizer(torch.optim.SGD([weight], lr=0.1), tx)
    weight.grad = torch.tensor([1.0, -2.0, 3.0])
    opt.step()
    torch.testing.assert_close(weight.grad, torch.tensor([2.0, -4.0, 6.0]))
    for name in ("raw", "raw_too"):
        torch.testing.assert_close(opt.metrics[name][0][0], torch.tensor([1.0, -2.0, 3.0]))
