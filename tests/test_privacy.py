"""Per-example clipping, gradient noise and DP-SGD against optax 0.2.8 and their formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, vmap

import gradtx as gtx
from gradtx.testing import assert_trees_close

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
jax.config.update("jax_platforms", "cpu")


def _grads(batch=6):
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(batch, 4, 3, generator=g), "b": torch.randn(batch, 5, generator=g) * 3}


def _j(tree):
    return [jnp.asarray(tree[k].numpy()) for k in sorted(tree)]


@pytest.mark.parametrize("batch", [6, 0])
@pytest.mark.parametrize("clip", [0.0, 1.25, 3.0, float("inf")])
def test_per_example_global_norm_clip_matches_optax(clip, batch):
    grads = _grads(batch)
    summed, clipped = gtx.per_example_global_norm_clip(grads, clip)
    want, want_clipped = optax.per_example_global_norm_clip(_j(grads), clip)
    for k, w in zip(sorted(grads), want):
        np.testing.assert_allclose(summed[k].numpy(), np.asarray(w), rtol=1e-6, atol=1e-6)
    assert int(clipped) == int(want_clipped)


@pytest.mark.parametrize("batch", [6, 0])
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("clip", [0.0, 1.25, 3.0, float("inf")])
def test_per_example_layer_norm_clip_matches_optax(clip, uniform, batch):
    grads = _grads(batch)
    summed, clipped = gtx.per_example_layer_norm_clip(grads, clip, uniform=uniform)
    if batch == 0:  # no example: zero sums, none clipped (optax's uniform=False reads example 0, and raises)
        for k, g in grads.items():
            assert torch.equal(summed[k], torch.zeros(g.shape[1:])) and int(clipped[k]) == 0
        return
    want, want_clipped = optax.per_example_layer_norm_clip(_j(grads), clip, uniform=uniform)
    for k, w, c in zip(sorted(grads), want, want_clipped):
        np.testing.assert_allclose(summed[k].numpy(), np.asarray(w), rtol=1e-6, atol=1e-6)
        assert int(clipped[k]) == int(c)


def test_per_example_clip_equals_vmap_of_clip_by_global_norm_then_sum():
    # The per-example clip is clip_by_global_norm's coefficient taken per example (its 1e-6 aside).
    grads = _grads()
    tx = gtx.clip_by_global_norm(1.0)
    state = tx.init({k: v[0] for k, v in grads.items()})
    clipped, _ = vmap(lambda g: tx.update(g, state))(grads)
    summed, _ = gtx.per_example_global_norm_clip(grads, 1.0)
    assert_trees_close(summed, {k: v.sum(0) for k, v in clipped.items()}, rtol=1e-5, atol=1e-5)


def test_per_example_clips_refuse_grads_without_a_common_example_dim():
    with pytest.raises(ValueError, match=r"\['b'\].*shape"):
        gtx.per_example_global_norm_clip({"a": torch.ones(4, 2), "b": torch.ones(3, 2)}, 1.0)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        gtx.per_example_global_norm_clip({"a": torch.ones(4, 2)}, -1.0)


def test_add_noise_follows_optax_variance_and_repeats_with_its_seed():
    eta, gamma, n = 0.5, 0.55, 20000
    tx = gtx.add_noise(eta, gamma, seed=7)
    zeros = {"w": torch.zeros(n)}
    state = tx.init(zeros)
    draws = []
    for _ in range(4):
        noise, state = tx.update(zeros, state)
        draws.append(noise["w"])
    for t, d in enumerate(draws):  # optax: std = sqrt(eta / (t + 1) ** gamma), t counted from 0
        want = (eta / (t + 1) ** gamma) ** 0.5
        assert float(d.std()) == pytest.approx(want, rel=0.03)
        assert abs(float(d.mean())) < 4 * want / n**0.5
    again, _ = tx.update(zeros, tx.init(zeros))
    torch.testing.assert_close(again["w"], draws[0])  # same seed, same noise
    other, _ = gtx.add_noise(eta, gamma, seed=8).update(zeros, gtx.add_noise(eta, gamma, seed=8).init(zeros))
    assert not torch.equal(other["w"], draws[0])
    assert int(state.count) == 4
    # The global generator is neither read nor advanced.
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    tx.update(zeros, tx.init(zeros))
    assert torch.equal(torch.rand(1), before)


def test_add_noise_with_zero_eta_is_identity_and_optax_agrees():
    g = _grads()
    tx = gtx.add_noise(0.0, 0.55, seed=0)
    out, _ = tx.update(g, tx.init(g))
    otx = optax.add_noise(0.0, 0.55, key=0)
    jg = {k: jnp.asarray(v.numpy()) for k, v in g.items()}
    want, _ = otx.update(jg, otx.init(jg))
    for k in g:
        np.testing.assert_allclose(out[k].numpy(), np.asarray(want[k]))


def test_add_noise_keeps_a_complex_leaf_complex_and_noises_both_parts_as_optax():
    """Before: the leaf was cast to the real noise's dtype, so its imaginary part was dropped (even with eta=0)."""
    g = {"w": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)}
    out, _ = gtx.add_noise(0.0, 0.55, seed=0).update(g, gtx.add_noise(0.0, 0.55, seed=0).init(g))
    torch.testing.assert_close(out["w"], g["w"], rtol=0, atol=0)
    zeros = {"w": torch.zeros(20000, dtype=torch.complex64)}
    noise, _ = gtx.add_noise(1.0, 0.0, seed=0).update(zeros, gtx.add_noise(1.0, 0.0, seed=0).init(zeros))
    otx = optax.add_noise(1.0, 0.0, key=0)  # jax draws complex normals: E|n|**2 = eta, half in each part
    want = otx.update({"w": jnp.zeros(20000, jnp.complex64)}, otx.init({"w": jnp.zeros(20000, jnp.complex64)}))[0]["w"]
    assert noise["w"].dtype == torch.complex64
    for part, jpart in ((noise["w"].real, np.asarray(want.real)), (noise["w"].imag, np.asarray(want.imag))):
        assert float(part.var()) == pytest.approx(float(jpart.var()), rel=0.06)
        assert float(part.var()) == pytest.approx(0.5, rel=0.06)


def test_dpsgd_without_noise_matches_optax_and_its_noise_has_the_right_scale():
    g = _grads(batch=8)
    params = {k: torch.zeros(v.shape[1:]) for k, v in g.items()}
    jparams = [jnp.zeros(v.shape[1:]) for _, v in sorted(g.items())]
    tx = gtx.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0, momentum=0.9)
    otx = optax.contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0, momentum=0.9)
    state, ostate = tx.init(params), otx.init(jparams)
    for _ in range(3):
        updates, state = tx.update(g, state, params)
        want, ostate = otx.update(_j(g), ostate, jparams)
        for k, w in zip(sorted(g), want):
            np.testing.assert_allclose(updates[k].numpy(), np.asarray(w), rtol=1e-6, atol=1e-7)
    # With noise: (sum of clipped + C * sigma * N(0, 1)) / batch, so the noise has std C * sigma / batch.
    big = {"w": torch.zeros(8, 50000)}
    agg = gtx.differentially_private_aggregate(2.0, 1.5, seed=3)
    noisy, _ = agg.update(big, agg.init(None))
    assert float(noisy["w"].std()) == pytest.approx(2.0 * 1.5 / 8, rel=0.03)


def test_dp_sgd_step_on_vmapped_per_example_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def loss(p, xi, yi):
        return ((functional_call(model, p, (xi[None],)) - yi[None]) ** 2).mean()

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    loop = [grad(loss)(params, x[i], y[i]) for i in range(16)]
    assert_trees_close(per_example, {k: torch.stack([g[k] for g in loop]) for k in params}, rtol=1e-5, atol=1e-6)
    tx = gtx.dpsgd(0.1, l2_norm_clip=0.5, noise_multiplier=0.0, seed=0)
    updates, _ = tx.update(per_example, tx.init(params), params)
    want, _ = gtx.per_example_global_norm_clip(per_example, 0.5)
    assert_trees_close(updates, {k: -0.1 * v / 16 for k, v in want.items()}, rtol=1e-5, atol=1e-7)
