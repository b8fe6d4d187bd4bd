"""Spike and non-finite handling: zero_nans, skip_not_finite, skip_large_updates against optax; skip_if
against optax's MultiSteps with should_skip_update_fn; skip_spikes against its formulas written out here.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import optree
import pytest
import torch

import gradtx as gtx
from gradtx.comm import ReduceOp
from gradtx.testing import RecordingComm, assert_pure

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

NAN, INF = float("nan"), float("inf")


def tree(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(5, 3, generator=g) * scale,
        "b": torch.randn(3, generator=g) * scale,
        "s": torch.randn((), generator=g) * scale,
    }


def to_jax(t):
    return optree.tree_map(lambda v: jnp.asarray(v.numpy()), t)


def poison(t: dict[str, torch.Tensor], key: str, index, value: float) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in t.items()}
    out[key][index] = value
    return out


# Parameterised bad inputs: (leaf, index, value); None means a clean tree.
BAD = [None, ("w", (0, 0), NAN), ("b", 2, INF), ("s", (), -INF), ("w", (4, 2), NAN)]


def grads_for(case) -> dict[str, torch.Tensor]:
    g = tree(1)
    return g if case is None else poison(g, *case)


# --- zero_nans ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", BAD)
def test_zero_nans_matches_optax(case):
    grads = grads_for(case)
    tx, ref = gtx.zero_nans(), optax.zero_nans()
    state = tx.init(tree(0))
    assert all(not bool(v) for v in state.found_nan.values())
    updates, state = tx.update(grads, state)
    ref_updates, ref_state = ref.update(to_jax(grads), ref.init(to_jax(tree(0))))
    for k in grads:
        np.testing.assert_array_equal(updates[k].numpy(), np.asarray(ref_updates[k]), err_msg=k)
        assert bool(state.found_nan[k]) == bool(ref_state.found_nan[k]), k
        assert updates[k].dtype == grads[k].dtype


def test_zero_nans_keeps_dtype_and_is_pure():
    grads = {"h": torch.tensor([1.0, NAN, INF], dtype=torch.bfloat16)}
    tx = gtx.zero_nans()
    out, _ = tx.update(grads, tx.init(grads))
    assert out["h"].dtype == torch.bfloat16
    assert torch.equal(out["h"].float(), torch.tensor([1.0, 0.0, INF]))
    assert_pure(tx, grads_for(("w", (0, 0), NAN)), tree(0))


# --- optax's should_skip_update_fn functions ----------------------------------------------------


@pytest.mark.parametrize("case", BAD + [("w", slice(None), NAN)])
def test_skip_not_finite_matches_optax(case):
    grads = grads_for(case)
    skip, info = gtx.skip_not_finite(grads, torch.tensor(0), None)
    ref_skip, ref_info = optax.skip_not_finite(to_jax(grads), jnp.asarray(0), None)
    assert skip.dtype == torch.bool and skip.shape == ()
    assert bool(skip) == bool(ref_skip)
    assert int(info["num_not_finite"]) == int(ref_info["num_not_finite"])
    assert set(info) == set(ref_info)


@pytest.mark.parametrize("scale", [0.1, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("max_squared_norm", [0.5, 10.0, 100.0])
def test_skip_large_updates_matches_optax(scale, max_squared_norm):
    grads = tree(2, scale)
    skip, info = gtx.skip_large_updates(grads, torch.tensor(0), None, max_squared_norm)
    ref_skip, ref_info = optax.skip_large_updates(to_jax(grads), jnp.asarray(0), None, max_squared_norm)
    assert bool(skip) == bool(ref_skip)
    np.testing.assert_allclose(float(info["norm_squared"]), float(ref_info["norm_squared"]), rtol=1e-6)


@pytest.mark.parametrize("case", BAD)
def test_skip_large_updates_skips_non_finite_like_optax(case):
    grads = grads_for(case)
    skip, _ = gtx.skip_large_updates(grads, 0, None, max_squared_norm=1e6)
    ref_skip, _ = optax.skip_large_updates(to_jax(grads), 0, None, max_squared_norm=1e6)
    assert bool(skip) == bool(ref_skip) == (case is not None)


def test_skip_large_updates_uses_the_plan_norm():
    # Four ranks holding identical shards of "w": the global norm counts w four times.
    class MirrorComm:
        def all_reduce(self, tensors, op, group):
            return [t * 4 if ReduceOp(op) is ReduceOp.SUM else t.clone() for t in tensors]

        def size(self, group):
            return 4

    grads = tree(3)
    plan = gtx.mesh_groups(grads, comm=MirrorComm(), sharded={"w": "tp"})
    _, info = gtx.skip_large_updates(grads, 0, None, 1.0, mesh_groups=plan)
    expected = 4 * grads["w"].square().sum() + grads["b"].square().sum() + grads["s"].square()
    torch.testing.assert_close(info["norm_squared"], expected, rtol=1e-6, atol=0)


# --- skip_if against optax.MultiSteps(every_k_schedule=1, should_skip_update_fn=...) -------------


def _optimizers(name: str):
    if name == "sgd":
        return gtx.sgd(0.05, momentum=0.9), optax.sgd(0.05, momentum=0.9)
    return gtx.adam(1e-2), optax.adam(1e-2)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("which", ["not_finite", "large"])
def test_skip_if_matches_optax_multisteps_over_many_steps(opt, which):
    if which == "not_finite":
        fn_t, fn_o = gtx.skip_not_finite, optax.skip_not_finite
    else:
        fn_t = functools.partial(gtx.skip_large_updates, max_squared_norm=30.0)
        fn_o = functools.partial(optax.skip_large_updates, max_squared_norm=30.0)
    inner, inner_ref = _optimizers(opt)
    tx = gtx.skip_if(inner, fn_t)
    ref = optax.MultiSteps(inner_ref, every_k_schedule=1, should_skip_update_fn=fn_o)
    params, jparams = tree(0), to_jax(tree(0))
    state, jstate = tx.init(params), ref.init(jparams)
    ref_update = jax.jit(ref.update)
    bad_steps = {3: ("w", (1, 1), NAN), 7: ("b", 0, INF), 8: ("s", (), NAN), 15: None}
    skipped = 0
    for step in range(25):
        grads = tree(100 + step)
        if step in bad_steps:
            grads = poison(grads, *bad_steps[step]) if bad_steps[step] else tree(100 + step, scale=10.0)
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        jupdates, jstate = ref_update(to_jax(grads), jstate, jparams)
        jparams = optax.apply_updates(jparams, jupdates)
        skipped += int(bool(state.skipped))
        assert int(state.gradient_step) == int(jstate.gradient_step), step
        for k in params:
            np.testing.assert_allclose(params[k].numpy(), np.asarray(jparams[k]), rtol=1e-5, atol=2e-6)
    expected_skips = 25 - int(jstate.gradient_step)  # optax's count of skipped steps
    assert expected_skips >= (3 if which == "not_finite" else 4)  # the NaN/inf steps (and the 10x one)
    assert skipped == int(state.total_skipped) == expected_skips
    assert int(gtx.metrics(state)["skipped"]) == expected_skips


def test_skipped_step_leaves_the_inner_state_untouched_and_returns_zeros():
    tx = gtx.skip_if(gtx.adam(1e-2), gtx.skip_not_finite)
    params = tree(0)
    state = tx.init(params)
    _, state = tx.update(tree(1), state, params)
    updates, new_state = tx.update(grads_for(("w", (0, 0), NAN)), state, params)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    for a, b in zip(optree.tree_leaves(new_state.inner_state), optree.tree_leaves(state.inner_state)):
        assert torch.equal(a, b)
    assert bool(new_state.skipped) and int(new_state.gradient_step) == 1


def test_skip_if_agrees_over_ranks_with_one_scalar_reduction():
    class OtherRankSkips(RecordingComm):
        """This rank sees finite grads, another rank does not: the MAX comes back 1."""

        def all_reduce(self, tensors, op, group):
            super().all_reduce(tensors, op, group)
            return [torch.ones_like(t) for t in tensors]

    comm = OtherRankSkips()
    tx = gtx.skip_if(gtx.sgd(0.1), gtx.skip_not_finite, comm=comm)
    params = tree(0)
    updates, state = tx.update(tree(1), tx.init(params), params)
    assert bool(state.skipped)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    assert [(c.op, c.group, c.num_tensors) for c in comm.calls] == [(ReduceOp.MAX, "world", 1)]


def test_skip_if_rejects_a_bad_should_skip_result():
    tx = gtx.skip_if(gtx.sgd(0.1), lambda u, s, p: (torch.tensor(1.0), {}))
    with pytest.raises(ValueError, match="0-d bool tensor"):
        tx.update(tree(1), tx.init(tree(0)), tree(0))
    with pytest.raises(TypeError, match="should_skip_update_fn must be callable"):
        gtx.skip_if(gtx.sgd(0.1), "skip")
    with pytest.raises(TypeError, match="inner must be a GradientTransformation"):
        gtx.skip_if(gtx.skip_not_finite, gtx.skip_not_finite)


def test_skip_if_is_pure():
    assert_pure(gtx.skip_if(gtx.adam(1e-2), gtx.skip_not_finite), tree(1), tree(0))


# --- skip_spikes against its formulas ------------------------------------------------------------


def reference_skip_spikes(values, *, z_thresh, alpha, warmup_steps, max_consecutive_skips, eps=1e-6):
    """The documented rule in float64: Welford over the warm-up's accepted values, EMA after."""
    n, mean, var, consecutive, decisions = 0, 0.0, 0.0, 0, []
    for x in values:
        finite = math.isfinite(x)
        warm = n < warmup_steps
        z = (x - mean) / (math.sqrt(var) + eps) if finite else math.nan
        outlier = (not finite) or (not warm and z > z_thresh)
        consecutive += 1
        accept = not outlier or (finite and max_consecutive_skips is not None and consecutive > max_consecutive_skips)
        if accept:
            consecutive = 0
            d = x - mean
            if warm:
                n_new = n + 1
                mean_new = mean + d / n_new
                var = var + (d * (x - mean_new) - var) / n_new
                mean = mean_new
            else:
                mean = mean + (1 - alpha) * d
                var = alpha * (var + (1 - alpha) * d * d)
            n += 1
        decisions.append((not accept, mean, var))
    return decisions


@pytest.mark.parametrize("as_number", [False, True])  # loss.item(): a NaN number raised instead of being skipped
@pytest.mark.parametrize("max_consecutive_skips", [None, 2])
@pytest.mark.parametrize("warmup_steps", [1, 5])
def test_skip_spikes_matches_its_formulas_on_a_loss_series(warmup_steps, max_consecutive_skips, as_number):
    rng = np.random.default_rng(0)
    losses = list(3.0 - 0.01 * np.arange(40) + 0.05 * rng.standard_normal(40))
    losses[3] = 9.0  # inside or after warm-up depending on warmup_steps
    losses[12] = 50.0
    losses[20:24] = [30.0, 31.0, 29.0, 30.0]  # a level shift that max_consecutive_skips lets through
    losses[30] = NAN
    kw = {"z_thresh": 4.0, "alpha": 0.9, "warmup_steps": warmup_steps, "max_consecutive_skips": max_consecutive_skips}
    expected = reference_skip_spikes(losses, **kw)
    tx = gtx.skip_spikes(gtx.sgd(0.1), metric="loss", **kw)
    params = tree(0)
    state = tx.init(params)
    for step, loss in enumerate(losses):
        _, state = tx.update(tree(step), state, params, loss=float(loss) if as_number else torch.tensor(loss))
        skip, mean, var = expected[step]
        assert bool(state.skipped) == skip, step
        np.testing.assert_allclose(float(state.mean), mean, rtol=1e-5, err_msg=f"mean at {step}")
        np.testing.assert_allclose(float(state.var), var, rtol=1e-4, atol=1e-9, err_msg=f"var at {step}")
    assert int(state.total_skipped) == sum(s for s, _, _ in expected)


def test_skip_spikes_on_the_grad_norm_skips_a_spike_and_keeps_state():
    tx = gtx.skip_spikes(gtx.adam(1e-2), z_thresh=5.0, warmup_steps=5)
    params = tree(0)
    state = tx.init(params)
    for step in range(10):
        _, state = tx.update(tree(step), state, params)
    assert int(state.total_skipped) == 0
    before = state
    updates, state = tx.update(tree(99, scale=100.0), state, params)
    assert bool(state.skipped)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    for a, b in zip(optree.tree_leaves(state.inner_state), optree.tree_leaves(before.inner_state)):
        assert torch.equal(a, b)
    assert torch.equal(state.mean, before.mean) and torch.equal(state.var, before.var)
    torch.testing.assert_close(state.value, gtx.global_norm(tree(99, scale=100.0)))


def test_skip_spikes_averages_the_loss_over_ranks():
    class TwoRanks(RecordingComm):
        """The other rank's loss is 3.0: SUM adds it, MAX takes the larger."""

        def all_reduce(self, tensors, op, group):
            super().all_reduce(tensors, op, group)
            if ReduceOp(op) is ReduceOp.SUM:
                return [t + 3.0 for t in tensors]
            return [t.clone() for t in tensors]

        def size(self, group):
            return 2

    comm = TwoRanks()
    tx = gtx.skip_spikes(gtx.sgd(0.1), metric="loss", comm=comm, warmup_steps=3)
    _, state = tx.update(tree(1), tx.init(tree(0)), tree(0), loss=torch.tensor(1.0))
    assert float(state.value) == 2.0
    assert [c.op for c in comm.calls] == [ReduceOp.SUM, ReduceOp.MAX]


def test_skip_spikes_bad_input():
    tx = gtx.skip_spikes(gtx.sgd(0.1), metric="loss")
    with pytest.raises(ValueError, match=r"needs the step's loss, as update\(\.\.\., loss=loss\)"):
        tx.update(tree(1), tx.init(tree(0)), tree(0))
    with pytest.raises(ValueError, match="alpha must be in"):
        gtx.skip_spikes(gtx.sgd(0.1), alpha=1.0)
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        gtx.skip_spikes(gtx.sgd(0.1), warmup_steps=0)
    with pytest.raises(ValueError, match="metric must be"):
        gtx.skip_spikes(gtx.sgd(0.1), metric="norm")
    with pytest.raises(TypeError, match="mesh_groups must be a plan"):
        gtx.skip_spikes(gtx.sgd(0.1), mesh_groups={"w": "tp"})


def test_skip_spikes_is_pure():
    assert_pure(gtx.skip_spikes(gtx.adam(1e-2), warmup_steps=1), tree(1), tree(0))


def test_states_round_trip_through_torch_save(tmp_path):
    tx = gtx.chain(gtx.zero_nans(), gtx.skip_spikes(gtx.skip_if(gtx.adam(1e-2), gtx.skip_not_finite), warmup_steps=2))
    params = tree(0)
    state = tx.init(params)
    for step in range(3):
        _, state = tx.update(tree(step), state, params)
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt")  # weights_only=True: the state classes are safe globals
    assert optree.tree_structure(loaded) == optree.tree_structure(state)
    for a, b in zip(optree.tree_leaves(loaded), optree.tree_leaves(state)):
        assert torch.equal(a, b)


# --- through the wrapper: a guard's veto skips the torch optimizer's step -----------------------------


@pytest.mark.parametrize(
    ("guard", "bad_factor"),
    [
        (lambda: gtx.skip_if(gtx.identity(), gtx.skip_not_finite), NAN),
        (lambda: gtx.skip_spikes(gtx.identity(), warmup_steps=2, z_thresh=4.0), 1e6),
    ],
    ids=["skip_if-nan", "skip_spikes-1e6"],
)
def test_wrapper_skips_the_torch_step_when_the_guard_vetoes(guard, bad_factor):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), guard())
    x = torch.randn(8, 4)
    for _ in range(4):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert opt.emitted and int(opt.metrics["skipped"]) == 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    (model(x).square().mean() * bad_factor).backward()
    opt.step()
    # The window closed (emitted), the guard vetoed: counted as skipped, and nothing moved.
    assert opt.emitted and int(opt.metrics["skipped"]) == 1
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        assert torch.equal(opt.state[p]["momentum_buffer"], momentum[n]), n


# --- params without grads: None updates pass through, as in optax ------------------------------


@pytest.mark.parametrize(
    "make",
    [
        gtx.zero_nans,
        lambda: gtx.skip_if(gtx.adamw(0.1), gtx.skip_not_finite),
        lambda: gtx.skip_if(gtx.sgd(0.1), functools.partial(gtx.skip_large_updates, max_squared_norm=1.0)),
        lambda: gtx.skip_spikes(gtx.adamw(0.1), warmup_steps=1),
        lambda: gtx.zclip(warmup_steps=1),
        lambda: gtx.autoclip(10, history=3),
        lambda: gtx.clip_by_block_rms(0.1),
        gtx.track_norms,
    ],
)
def test_none_updates_pass_through_and_the_state_keeps_its_structure(make):
    params = {"a": torch.randn(3), "b": torch.randn(2), "c": {"d": torch.randn(2)}}
    full = {"a": torch.randn(3), "b": torch.randn(2), "c": {"d": torch.randn(2)}}
    partial = {"a": full["a"], "b": None, "c": None}
    tx = make()
    state = tx.init(params)
    structure = optree.tree_structure(state)
    for grads in (partial, full, partial):
        updates, state = tx.update(grads, state, params)
        assert optree.tree_structure(state) == structure
    assert updates["b"] is None and updates["c"] is None
    # On its first step, the leaf that has a grad gets what it would get in a tree without the others.
    first, _ = make().update(partial, make().init(params), params)
    alone = make()
    only_a, _ = alone.update({"a": full["a"]}, alone.init({"a": params["a"]}), {"a": params["a"]})
    torch.testing.assert_close(first["a"], only_a["a"])
