"""A transform written as optax writes them (its update *is* its new state) is correct in every path.

``my_trace`` below returns ``new`` and stores ``State(new)``: the same tensor. Every path that writes
into updates (the wrapper, compiled steps) must leave that state alone, with nothing declared. The reference is a hand-written loop: momentum, then each member by hand,
then SGD.
"""

from __future__ import annotations

from typing import NamedTuple

import optree
import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_trees_close

DECAY, LR, MAX_NORM, DELTA, STEPS = 0.9, 0.1, 0.5, 0.3, 4


class MyTraceState(NamedTuple):
    trace: dict


def my_trace(decay: float) -> gtx.GradientTransformation:
    """optax's trace, ported line by line: the returned update is the new state's tensor."""

    def init(params):
        return MyTraceState({k: torch.zeros_like(v) for k, v in params.items()})

    def update(updates, state, params=None, **extra):
        new = {k: decay * state.trace[k] + g for k, g in updates.items()}
        return new, MyTraceState(new)

    return gtx.GradientTransformation(init, update)


def _is_matrix(tree):
    return {k: v.ndim > 1 for k, v in tree.items()}


def _label(tree):
    return {k: "matrix" if v.ndim > 1 else "vector" for k, v in tree.items()}


# name -> (the member after my_trace, the same step by hand on a dict of updates)
AFTER = {
    "scale": (lambda: gtx.scale(0.5), lambda u: {k: v * 0.5 for k, v in u.items()}),
    "clip": (lambda: gtx.clip(DELTA), lambda u: {k: v.clamp(-DELTA, DELTA) for k, v in u.items()}),
    "masked": (
        lambda: gtx.masked(gtx.scale(0.5), _is_matrix),
        lambda u: {k: v * 0.5 if v.ndim > 1 else v for k, v in u.items()},
    ),
    "partition": (
        lambda: gtx.partition({"matrix": gtx.scale(2.0), "vector": gtx.clip(DELTA)}, _label),
        lambda u: {k: v * 2.0 if v.ndim > 1 else v.clamp(-DELTA, DELTA) for k, v in u.items()},
    ),
    "clip_by_global_norm": (lambda: gtx.clip_by_global_norm(MAX_NORM), lambda u: _clip_norm(u)),
}


def _clip_norm(u):
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in u.values()]))
    coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
    return {k: v * coef for k, v in u.items()}


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


def _grads():
    out = []
    for seed in range(STEPS):
        g = torch.Generator().manual_seed(seed + 1)
        out.append({"w": 3 * torch.randn(3, 4, generator=g), "b": 3 * torch.randn(4, generator=g)})
    return out


def _by_hand(member):
    params, trace = _params(), None
    for g in _grads():
        trace = g if trace is None else {k: DECAY * trace[k] + v for k, v in g.items()}
        u = member(trace)
        params = {k: params[k] - LR * u[k] for k in params}
    return params, trace


def _tx(name):
    return gtx.chain(my_trace(DECAY), AFTER[name][0](), gtx.scale(-LR))


@pytest.mark.parametrize("name", sorted(AFTER))
@pytest.mark.parametrize("path", ["pure", "nested"])
def test_optax_style_trace_then_a_member_matches_the_hand_loop(name, path):
    expected, expected_trace = _by_hand(AFTER[name][1])
    tx = gtx.chain(gtx.chain(my_trace(DECAY), AFTER[name][0]()), gtx.scale(-LR)) if path == "nested" else _tx(name)
    params = _params()
    state = tx.init(params)
    for g in _grads():
        params, state = gtx.update_and_apply(tx, g, state, params)
    assert_trees_close(params, expected, rtol=1e-6, atol=1e-7)
    trace_state = state[0][0] if path == "nested" else state[0]
    assert_trees_close(trace_state.trace, expected_trace, rtol=1e-6, atol=1e-7)


def _model():
    model = torch.nn.Module()
    p = _params()
    model.w = torch.nn.Parameter(p["w"].clone())
    model.b = torch.nn.Parameter(p["b"].clone())
    return model


def _wrapper_run(name, *, compiled=False):
    model = _model()
    named = {"w": model.w, "b": model.b}

    tx = gtx.chain(_list_trace(DECAY), AFTER_LIST[name]())
    opt = gtx.TransformedOptimizer(torch.optim.SGD([model.w, model.b], lr=LR), tx)

    def step(grads):
        model.w.grad, model.b.grad = grads["w"].clone(), grads["b"].clone()
        opt.step()
        opt.zero_grad(set_to_none=False)  # a zeroed .grad must not be anyone's state

    run = torch.compile(step, backend="aot_eager") if compiled else step
    for g in _grads():
        run(g)
    return {k: v.detach() for k, v in named.items()}, opt


def _list_trace(decay):
    """The same optax-style trace, on any tree (the wrapper's tree is a list of param groups)."""

    def init(params):
        return MyTraceState(optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None, **extra):
        new = optree.tree_map(lambda t, g: decay * t + g, state.trace, updates)
        return new, MyTraceState(new)

    return gtx.GradientTransformation(init, update)


def _is_trace(node):
    return isinstance(node, MyTraceState)


def _ndim_mask(tree):
    return optree.tree_map(lambda t: t.ndim > 1, tree)


def _ndim_label(tree):
    return optree.tree_map(lambda t: "matrix" if t.ndim > 1 else "vector", tree)


AFTER_LIST = {
    "scale": lambda: gtx.scale(0.5),
    "clip": lambda: gtx.clip(DELTA),
    "masked": lambda: gtx.masked(gtx.scale(0.5), _ndim_mask),
    "partition": lambda: gtx.partition({"matrix": gtx.scale(2.0), "vector": gtx.clip(DELTA)}, _ndim_label),
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(MAX_NORM),
}


@pytest.mark.parametrize("name", sorted(AFTER))
def test_optax_style_trace_in_the_wrapper_matches_the_hand_loop(name):
    expected, expected_trace = _by_hand(AFTER[name][1])
    params, opt = _wrapper_run(name)
    assert_trees_close(params, expected, rtol=1e-6, atol=1e-7)
    (trace,) = [s.trace for s in optree.tree_leaves(opt.tx_state, is_leaf=_is_trace) if _is_trace(s)]
    assert_trees_close([trace[0][0], trace[0][1]], [expected_trace["w"], expected_trace["b"]], rtol=1e-6, atol=1e-7)


def test_optax_style_trace_in_a_compiled_wrapper_step_matches_the_hand_loop():
    expected, _ = _by_hand(AFTER["clip_by_global_norm"][1])
    params, _ = _wrapper_run("clip_by_global_norm", compiled=True)
    assert_trees_close(params, expected, rtol=1e-6, atol=1e-7)
