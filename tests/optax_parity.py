"""Shared helpers for running a gradtx transform and its optax 0.2.8 counterpart side by side (jax on CPU)."""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_trees_close

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
jax.config.update("jax_platforms", "cpu")


def to_jax(tree):
    return optree.tree_map(lambda t: jnp.asarray(t.detach().numpy()), tree)


def to_torch(tree):
    return optree.tree_map(lambda a: torch.from_numpy(np.array(a)), tree)


def params_tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g),
        "conv": torch.randn(2, 3, 2, 2, generator=g),
        "s": torch.randn((), generator=g),
    }


def grads_like(params, seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(1000 + seed)
    return optree.tree_map(lambda t: scale * torch.randn(t.shape, generator=g), params)


def run_both(tx, ref, params, *, steps=20, with_params=True, extra=None, grads_fn=None, rtol=1e-5, atol=1e-5, jit=True):
    """Step both for ``steps`` steps on the same grads; compare updates and params at every step.

    ``extra(i)`` gives the keyword arguments of step ``i`` (the same for both).
    Returns the final gradtx and optax states and params.
    """
    state, ref_state = tx.init(params), ref.init(to_jax(params))
    ref_update = jax.jit(ref.update) if jit else ref.update  # one trace, then fast steps (lax.cond traces per call)
    p, rp = params, to_jax(params)
    for i in range(steps):
        g = grads_fn(i, p) if grads_fn is not None else grads_like(params, i)
        kw = extra(i) if extra is not None else {}
        kw_jax = {k: (to_jax(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        if with_params:
            u, state = tx.update(g, state, p, **kw)
            ru, ref_state = ref_update(to_jax(g), ref_state, rp, **kw_jax)
        else:
            u, state = tx.update(g, state, **kw)
            ru, ref_state = ref_update(to_jax(g), ref_state, **kw_jax)
        assert_trees_close(u, to_torch(ru), rtol=rtol, atol=atol, msg=f"step {i} updates: ")
        p, rp = gtx.apply_updates(p, u), optax.apply_updates(rp, ru)
        assert_trees_close(p, to_torch(rp), rtol=rtol, atol=atol, msg=f"step {i} params: ")
    return state, ref_state, p, rp


def round_trip(tx, params, steps=3, extra=None):
    """Step ``tx``, save its state with torch.save (weights_only load), and check the loaded copy steps identically."""
    import io

    state = tx.init(params)
    p = params
    for i in range(steps):
        u, state = tx.update(grads_like(params, i), state, p, **(extra(i) if extra else {}))
        p = gtx.apply_updates(p, u)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    g = grads_like(params, 99)
    kw = extra(steps) if extra else {}
    u1, s1 = tx.update(g, state, p, **kw)
    u2, s2 = tx.update(g, loaded, p, **kw)
    gtx.testing.assert_trees_equal(u2, u1)
    gtx.testing.assert_trees_equal(s2, s1)
