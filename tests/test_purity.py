"""Every public transform is pure: no input is mutated, and the same inputs give the same outputs."""

import inspect

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure


def _tree(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g).to(dtype),
        "b": torch.randn(4, generator=g).to(dtype),
        "nested": {"s": torch.randn((), generator=g).to(dtype)},
    }


def _local_plan(**kw):
    return gtx.mesh_groups(_tree(1), comm=gtx.comm.LocalComm(), pp_group="pp", **kw)


# name -> (factory, extras). Each factory builds one configured transform.
CASES = {
    "identity": (lambda: gtx.identity(), {}),
    "add_noise": (lambda: gtx.add_noise(0.1, 0.55, seed=0), {}),
    # Per-example transforms: the leaves under "w" are 4 examples of shape (3,).
    "differentially_private_aggregate": (
        lambda: gtx.masked(
            gtx.differentially_private_aggregate(1.0, 0.5, seed=0), {"w": True, "b": False, "nested": False}
        ),
        {},
    ),
    "dpsgd": (
        lambda: gtx.masked(gtx.dpsgd(0.1, 1.0, 0.5, seed=0), {"w": True, "b": False, "nested": False}),
        {},
    ),
    "chain": (lambda: gtx.chain(gtx.clip_by_global_norm(0.1), gtx.adam(0.1)), {}),
    "named_chain": (lambda: gtx.named_chain(("clip", gtx.clip(0.1)), ("sgd", gtx.sgd(0.1, momentum=0.9))), {}),
    "masked": (lambda: gtx.masked(gtx.adamw(0.1), lambda p: {"w": True, "b": False, "nested": {"s": True}}), {}),
    "partition": (
        lambda: gtx.partition(
            {"a": gtx.adam(0.1), "b": gtx.sgd(0.1, momentum=0.5)}, {"w": "a", "b": "b", "nested": {"s": "a"}}
        ),
        {},
    ),
    "clip": (lambda: gtx.clip(0.1), {}),
    "clip_by_global_norm": (lambda: gtx.clip_by_global_norm(0.1), {}),
    "clip_by_global_norm_inf": (lambda: gtx.clip_by_global_norm(0.1, norm_type=float("inf")), {}),
    "adaptive_clip": (lambda: gtx.adaptive_clip(0.01), {}),
    "adaptive_clip_tensorwise": (lambda: gtx.adaptive_clip(0.01, unitwise=False), {}),
    "accumulate": (lambda: gtx.accumulate(2), {}),
    "accumulate_k1": (lambda: gtx.accumulate(1), {}),
    "accumulate_token_weighted": (lambda: gtx.accumulate(2, token_weighted=True), {"tokens": 5}),
    "accumulate_flush": (lambda: gtx.accumulate(3), {"flush": True}),
    "apply_if_finite": (lambda: gtx.apply_if_finite(gtx.adam(0.1), 2), {}),
    "scale": (lambda: gtx.scale(0.5), {}),
    "scale_by_learning_rate": (lambda: gtx.scale_by_learning_rate(0.1), {}),
    "scale_by_learning_rate_schedule": (lambda: gtx.scale_by_learning_rate(lambda c: 0.1 / (1 + c)), {}),
    "scale_by_schedule": (lambda: gtx.scale_by_schedule(lambda c: 0.5 * (c + 1)), {}),
    "scale_by_adam": (lambda: gtx.scale_by_adam(), {}),
    "add_decayed_weights": (lambda: gtx.add_decayed_weights(0.1), {}),
    "trace": (lambda: gtx.trace(0.9), {}),
    "trace_nesterov": (lambda: gtx.trace(0.9, nesterov=True), {}),
    "sgd": (lambda: gtx.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1), {}),
    "adam": (lambda: gtx.adam(0.1, weight_decay=0.1), {}),
    "adamw": (lambda: gtx.adamw(0.1), {}),
    # One process: the plan's collectives go through a LocalComm, a one-rank world.
    "pp_reduce": (lambda: gtx.pp_reduce(_local_plan(tied={"w": "pp"})), {}),
    "cp_reduce": (lambda: gtx.cp_reduce("cp", comm=gtx.comm.LocalComm()), {}),
    "clip_by_global_norm_mesh_groups": (lambda: gtx.clip_by_global_norm(0.1, mesh_groups=_local_plan()), {}),
    "adaptive_clip_mesh_groups": (lambda: gtx.adaptive_clip(0.01, mesh_groups=_local_plan()), {}),
    # issue 10: spikes and adaptive clipping
    "zero_nans": (lambda: gtx.zero_nans(), {}),
    "skip_if": (lambda: gtx.skip_if(gtx.adam(0.1), gtx.skip_not_finite), {}),
    "skip_spikes": (lambda: gtx.skip_spikes(gtx.adam(0.1), warmup_steps=1), {}),
    "skip_spikes_loss": (lambda: gtx.skip_spikes(gtx.sgd(0.1), metric="loss", warmup_steps=1), {"loss": 2.0}),
    "zclip": (lambda: gtx.zclip(warmup_steps=1), {}),
    "autoclip": (lambda: gtx.autoclip(10, history=4), {}),
    "clip_by_block_rms": (lambda: gtx.clip_by_block_rms(0.1), {}),
    "track_norms": (lambda: gtx.track_norms(), {}),
    "zclip_mesh_groups": (lambda: gtx.zclip(warmup_steps=1, mesh_groups=_local_plan()), {}),
    "track_norms_mesh_groups": (lambda: gtx.track_norms(mesh_groups=_local_plan()), {}),
    "muon": (lambda: gtx.muon(0.02, weight_decay=0.1, adaptive=True), {}),
    "scale_by_muon": (lambda: gtx.scale_by_muon(nesterov=False), {}),
    "scale_by_shape": (lambda: gtx.scale_by_shape(consistent_rms=0.2), {}),
    "orthogonalize": (lambda: gtx.orthogonalize(ns_steps=3), {}),
    # optax parity, second part
    "set_to_zero": (lambda: gtx.set_to_zero(), {}),
    "freeze": (lambda: gtx.freeze({"w": True, "b": False, "nested": {"s": False}}), {}),
    "selective_transform": (
        lambda: gtx.selective_transform(gtx.adam(0.1), freeze_mask={"w": True, "b": False, "nested": False}),
        {},
    ),
    "conditionally_mask": (lambda: gtx.conditionally_mask(gtx.adam(0.1), lambda step: step % 2 == 0), {}),
    "conditionally_transform": (lambda: gtx.conditionally_transform(gtx.adam(0.1), lambda step: step % 2 == 1), {}),
    "ema": (lambda: gtx.ema(0.9), {}),
    "lookahead": (lambda: gtx.lookahead(gtx.adam(0.1), 2, 0.5, reset_state=True), {}),
    "scale_by_trust_ratio": (lambda: gtx.scale_by_trust_ratio(), {}),
    "lars": (lambda: gtx.lars(0.1, weight_decay=0.01), {}),
    "lamb": (lambda: gtx.lamb(0.1, weight_decay=0.01), {}),
    "scale_by_lion": (lambda: gtx.scale_by_lion(), {}),
    "lion": (lambda: gtx.lion(0.1), {}),
    "schedule_free": (lambda: gtx.schedule_free(gtx.sgd(0.1), 0.1), {}),
    "schedule_free_adamw": (lambda: gtx.schedule_free_adamw(0.1, warmup_steps=2), {}),
    "schedule_free_sgd": (lambda: gtx.schedule_free_sgd(0.1), {}),
    "snapshot": (lambda: gtx.snapshot("norm", gtx.global_norm), {}),
    "monitor": (lambda: gtx.monitor({"norm": gtx.global_norm}), {}),
    "measure_with_ema": (lambda: gtx.monitor({"norm": gtx.measure_with_ema(gtx.global_norm, 0.9)}), {}),
    "reduce_on_plateau": (lambda: gtx.reduce_on_plateau(patience=1), {"value": 1.0}),
    "normalize_by_update_norm": (lambda: gtx.normalize_by_update_norm(), {}),
    "centralize": (lambda: gtx.centralize(), {}),
    "sam": (lambda: gtx.sam(gtx.adam(0.1), gtx.chain(gtx.normalize_by_update_norm(eps=0.0), gtx.scale(0.05))), {}),
}

# Params other than the plain tree: lookahead trains a (fast, slow) pair.
PARAMS = {"lookahead": gtx.LookaheadParams.init_synced}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transform_is_pure(name, dtype):
    make, extra = CASES[name]
    grads, params = _tree(0, dtype), PARAMS.get(name, lambda p: p)(_tree(1, dtype))
    assert_pure(make(), grads, params, steps=3, **extra)


def test_every_public_transform_is_covered():
    """A new public transform must be added to CASES above."""
    factories = {
        name
        for name in gtx.__all__
        if inspect.isfunction(obj := getattr(gtx, name))
        and inspect.signature(obj).return_annotation in (gtx.GradientTransformation, "GradientTransformation")
    }
    covered = {name.split("_inf")[0] for name in CASES}
    covered |= {n for n in factories if any(c.startswith(n) for c in CASES)}
    assert factories - covered == set()


def test_assert_pure_catches_an_in_place_transform():
    def bad_update(updates, state, params=None, **extra):
        updates["b"].mul_(2)
        return updates, state

    bad = gtx.GradientTransformation(lambda p: gtx.EmptyState(), bad_update)
    with pytest.raises(AssertionError, match="modified in place"):
        assert_pure(bad, _tree(0), _tree(1))


def test_assert_pure_catches_state_mutation():
    def init(params):
        return {"count": torch.zeros(())}

    def bad_update(updates, state, params=None, **extra):
        state["count"].add_(1)
        return updates, state

    with pytest.raises(AssertionError, match="state"):
        assert_pure(gtx.GradientTransformation(init, bad_update), _tree(0), _tree(1))


def test_assert_pure_catches_nondeterminism():
    def noisy(updates, state, params=None, **extra):
        return {k: v + torch.rand(()) for k, v in updates.items()}, state

    with pytest.raises(AssertionError, match="deterministic"):
        assert_pure(gtx.GradientTransformation(lambda p: gtx.EmptyState(), noisy), {"a": torch.ones(2)})


@pytest.mark.parametrize("mutate", ["replace", "add a key", "replace in the updates"])
def test_assert_pure_catches_a_container_changed_in_place(mutate):
    """A leaf rebound or a key added inside the caller's state (or updates) is a mutation too, though no tensor
    moved: the caller's count below would run ahead of the steps taken."""

    def init(params):
        return {"count": torch.zeros(())}

    def bad_update(updates, state, params=None, **extra):
        if mutate == "replace":
            state["count"] = state["count"] + 1
        elif mutate == "add a key":
            state["seen"] = torch.ones(())
        else:
            updates["b"] = updates["b"] * 2
        return dict(updates), dict(state)

    with pytest.raises(AssertionError, match="in place"):
        assert_pure(gtx.GradientTransformation(init, bad_update), _tree(0), _tree(1))


@pytest.mark.parametrize("steps", [0, -1])
def test_assert_pure_refuses_steps_that_check_nothing(steps):
    with pytest.raises(ValueError, match="steps"):
        assert_pure(gtx.identity(), _tree(0), _tree(1), steps=steps)


def test_the_checkers_name_a_bad_argument():
    """Before: assert_pure("x", ...) raised AttributeError, and a tolerance that is not a number >= 0 made
    assert_trees_close raise torch.testing's RuntimeError (a test error, not a failure naming the argument)."""
    from gradtx.testing import assert_trees_close

    with pytest.raises(TypeError, match="assert_pure: tx must be a GradientTransformation"):
        assert_pure(gtx.identity, _tree(0))  # the factory, not the transform it builds
    for kw, error in [
        ({"rtol": "1e-6"}, TypeError),
        ({"rtol": -1.0}, ValueError),
        ({"atol": float("nan")}, ValueError),
    ]:
        with pytest.raises(error, match=f"assert_trees_close: {next(iter(kw))} must"):
            assert_trees_close(_tree(0), _tree(0), **kw)


@pytest.mark.parametrize(
    "actual, expected",
    [
        ({"n": 1, "t": torch.zeros(2)}, {"n": 2, "t": torch.zeros(2)}),  # a Python number in a state
        ({"n": 0.5}, {"n": 7.0}),
        ({"n": 1}, {"n": 1.0}),  # equal values, other types
        ({"s": "x"}, {"s": "y"}),
        ({"n": torch.tensor(1.0)}, {"n": 1.0}),  # a tensor against a number
    ],
)
def test_tree_comparisons_compare_leaves_that_are_not_tensors(actual, expected):
    from gradtx.testing import assert_trees_close, assert_trees_equal

    for compare in (assert_trees_equal, assert_trees_close):
        with pytest.raises(AssertionError, match="n|s"):
            compare(actual, expected)
    assert_trees_equal({"n": float("nan"), "k": 3}, {"n": float("nan"), "k": 3})  # NaNs equal, as for tensors


def test_assert_pure_catches_a_buffer_kept_between_calls():
    """Before: a transform that writes its result into a buffer it keeps across calls (an in-place "speed-up")
    passed, since both runs of a step returned the same object; the second run overwrote the first's result."""
    buffers: dict[str, torch.Tensor] = {}

    def cached_update(updates, state, params=None, **extra):
        out = buffers.setdefault("w", torch.empty_like(updates["w"]))
        torch.mul(updates["w"], 0.5, out=out)
        return {**updates, "w": out}, state

    with pytest.raises(AssertionError, match=r"first run's result .* at \[0\]\['w'\] was modified in place"):
        assert_pure(gtx.GradientTransformation(lambda p: gtx.EmptyState(), cached_update), _tree(0), _tree(1))


def test_assert_pure_checks_init_on_the_updates_when_there_are_no_params():
    """Before: with params=None, init(updates) zeroing a detached alias of the updates (``u.detach().zero_()``
    for a zero state) passed; the caller's grads were zeros afterwards."""

    def init(params):
        return {k: v.detach().zero_() for k, v in params.items()}  # the bug: zeros_like, not an alias

    tx = gtx.GradientTransformation(init, lambda u, s, p=None, **e: (u, s))
    with pytest.raises(AssertionError, match=r"init: updates at \['b'\] was modified in place"):
        assert_pure(tx, {"b": torch.randn(4), "w": torch.randn(4, 3)})


@pytest.mark.parametrize("where", ["init keeps the params", "update keeps the updates"])
def test_assert_pure_catches_a_state_that_holds_an_input(where):
    """Before: passed. An optax-style state that holds an input tensor itself (an anchor at the initial params, the
    last grad) is fine with JAX's immutable arrays, not in torch: the wrapper's inputs are the live params and
    .grad, which the inner optimizer and the next backward write in place, so the state moves with them."""

    def init(params):
        return {"kept": params["w"] if where.startswith("init") else torch.zeros(4, 3)}

    def update(updates, state, params=None, **extra):
        return updates, {"kept": state["kept"] if where.startswith("init") else updates["w"]}

    with pytest.raises(AssertionError, match=r"state at \['kept'\] shares memory with an input"):
        assert_pure(gtx.GradientTransformation(init, update), _tree(0), _tree(1))
