"""Every public factory's result pickles and copies: the rebuilt transform or schedule computes what the original does.

gradtx's transforms are closures, which pickle cannot store by themselves;
each factory's result pickles as the call that built it (``gradtx.core.base.factory``).
The reference is the original object, stepped side by side with its copy.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import gradtx as gtx
from gradtx.comm import LocalComm
from gradtx.core.base import factory
from gradtx.testing import assert_trees_equal


def _halve_init(params):
    return gtx.EmptyState()


def _halve_factor(updates, state, params=None, *, scale=None, **extra):
    return torch.tensor(0.5), state


@factory
def _user_factory(step: float, momentum: float = 0.5) -> gtx.GradientTransformation:
    def init(params):
        return gtx.trace(momentum).init(params)

    def update(updates, state, params=None, **extra):
        updates, state = gtx.trace(momentum).update(updates, state, params)
        return gtx.scale(step).update(updates, gtx.EmptyState())[0], state

    return gtx.GradientTransformation(init, update)


def _every_other(step):
    return step % 2 == 0


def _norm(tree):
    return gtx.global_norm(tree)


# name -> a call a user would write; every decorated public factory must be here (checked below).
TRANSFORMS = {
    "accumulate": lambda: gtx.accumulate(2),
    "adam": lambda: gtx.adam(1e-2, weight_decay=0.1),
    "adamw": lambda: gtx.adamw(gtx.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1),
    "adaptive_clip": lambda: gtx.adaptive_clip(0.05),
    "add_noise": lambda: gtx.add_noise(0.1, 0.55, seed=3),
    "add_decayed_weights": lambda: gtx.add_decayed_weights(0.1, mask={"w": True, "b": False}),
    "apply_if_finite": lambda: gtx.apply_if_finite(gtx.sgd(0.1), 3),
    "autoclip": lambda: gtx.autoclip(50.0, history=10),
    "centralize": lambda: gtx.centralize(),
    "chain": lambda: gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(0.5), gtx.sgd(0.1, momentum=0.9)),
    "clip": lambda: gtx.clip(0.3),
    "clip_by_block_rms": lambda: gtx.clip_by_block_rms(0.5),
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(0.5),
    "conditionally_mask": lambda: gtx.conditionally_mask(gtx.adam(1e-2), _every_other),
    "conditionally_transform": lambda: gtx.conditionally_transform(gtx.sgd(0.1, momentum=0.9), _every_other),
    "cp_reduce": lambda: gtx.cp_reduce("cp", comm=LocalComm()),
    "ema": lambda: gtx.ema(0.9),
    "freeze": lambda: gtx.freeze({"w": True, "b": False}),
    "identity": lambda: gtx.identity(),
    "inject_hyperparams": lambda: gtx.inject_hyperparams(gtx.adamw)(
        learning_rate=gtx.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1
    ),
    "lamb": lambda: gtx.lamb(1e-2, weight_decay=0.1),
    "lars": lambda: gtx.lars(0.1, weight_decay=1e-3),
    "lion": lambda: gtx.lion(1e-2),
    "lookahead": lambda: gtx.lookahead(gtx.adam(1e-2), 2, 0.5, reset_state=True),
    "masked": lambda: gtx.masked(gtx.trace(0.9), {"w": True, "b": False}),
    "muon": lambda: gtx.muon(
        0.02, weight_decay=0.1, muon_weight_dimension_numbers={"w": gtx.MuonDimensionNumbers(), "b": None}
    ),
    "measure_with_ema": lambda: gtx.chain(gtx.monitor({"n": gtx.measure_with_ema(_norm, 0.9)}), gtx.sgd(0.1)),
    "monitor": lambda: gtx.chain(gtx.monitor({"n": _norm}), gtx.sgd(0.1)),
    "named_chain": lambda: gtx.named_chain(("clip", gtx.clip_by_global_norm(1.0)), ("opt", gtx.sgd(0.1))),
    "normalize_by_update_norm": lambda: gtx.normalize_by_update_norm(2.0),
    "partition": lambda: gtx.partition({"a": gtx.sgd(0.1), "b": gtx.adam(1e-2)}, {"w": "a", "b": "b"}),
    "orthogonalize": lambda: gtx.orthogonalize(ns_steps=3, preconditioning="schatten"),
    "pp_reduce": lambda: gtx.pp_reduce(gtx.mesh_groups({"w": torch.zeros(3, 2), "b": torch.zeros(2)})),
    "reduce_on_plateau": lambda: gtx.chain(gtx.sgd(0.1), gtx.reduce_on_plateau(patience=1)),
    "sam": lambda: gtx.sam(gtx.adam(1e-2), gtx.chain(gtx.normalize_by_update_norm(eps=0.0), gtx.scale(0.05))),
    "scalar_transformation": lambda: gtx.scalar_transformation(_halve_init, _halve_factor),
    "scale": lambda: gtx.scale(-0.1),
    "scale_by_adam": lambda: gtx.scale_by_adam(b1=0.8),
    "scale_by_learning_rate": lambda: gtx.scale_by_learning_rate(gtx.exponential_decay(0.1, 2, 0.5)),
    "scale_by_muon": lambda: gtx.scale_by_muon(beta=0.9, nesterov=False),
    "scale_by_schedule": lambda: gtx.scale_by_schedule(gtx.cosine_decay_schedule(1.0, 10)),
    "scale_by_shape": lambda: gtx.scale_by_shape(consistent_rms=0.2),
    "scale_by_lion": lambda: gtx.scale_by_lion(b1=0.8),
    "scale_by_trust_ratio": lambda: gtx.scale_by_trust_ratio(min_norm=0.1),
    "schedule_free": lambda: gtx.schedule_free(gtx.sgd(0.1), 0.1),
    "schedule_free_adamw": lambda: gtx.schedule_free_adamw(1e-2, warmup_steps=2),
    "schedule_free_sgd": lambda: gtx.schedule_free_sgd(0.1, weight_decay=0.01),
    "selective_transform": lambda: gtx.selective_transform(gtx.adam(1e-2), freeze_mask={"w": False, "b": True}),
    "set_to_zero": lambda: gtx.set_to_zero(),
    "sgd": lambda: gtx.sgd(0.1, momentum=0.9, nesterov=True),
    "skip_if": lambda: gtx.skip_if(gtx.sgd(0.1), gtx.skip_not_finite),
    "skip_spikes": lambda: gtx.skip_spikes(gtx.sgd(0.1), warmup_steps=2),
    "snapshot": lambda: gtx.chain(gtx.snapshot("n", _norm), gtx.sgd(0.1)),
    "trace": lambda: gtx.trace(0.9),
    "track_norms": lambda: gtx.track_norms(),
    "zclip": lambda: gtx.zclip(warmup_steps=2),
    "zero_nans": lambda: gtx.zero_nans(),
}

SCHEDULES = {
    "constant_schedule": lambda: gtx.constant_schedule(0.1),
    "cosine_decay_schedule": lambda: gtx.cosine_decay_schedule(1.0, 10, alpha=0.1),
    "cosine_onecycle_schedule": lambda: gtx.cosine_onecycle_schedule(10, 1.0),
    "exponential_decay": lambda: gtx.exponential_decay(1.0, 3, 0.5, staircase=True),
    "join_schedules": lambda: gtx.join_schedules([gtx.constant_schedule(1.0), gtx.linear_schedule(1.0, 0.0, 5)], [3]),
    "linear_onecycle_schedule": lambda: gtx.linear_onecycle_schedule(10, 1.0),
    "linear_schedule": lambda: gtx.linear_schedule(1.0, 0.1, 8, transition_begin=2),
    "piecewise_constant_schedule": lambda: gtx.piecewise_constant_schedule(1.0, {3: 0.5, 6: 0.1}),
    "piecewise_interpolate_schedule": lambda: gtx.piecewise_interpolate_schedule("cosine", 1.0, {3: 0.5, 6: 0.1}),
    "polynomial_schedule": lambda: gtx.polynomial_schedule(1.0, 0.1, 2.0, 8),
    "sgdr_schedule": lambda: gtx.sgdr_schedule(
        [{"init_value": 1.0, "peak_value": 2.0, "warmup_steps": 2, "decay_steps": 5}] * 2
    ),
    "warmup_constant_schedule": lambda: gtx.warmup_constant_schedule(0.0, 1.0, 3),
    "warmup_cosine_decay_schedule": lambda: gtx.warmup_cosine_decay_schedule(0.0, 1.0, 3, 10),
    "warmup_exponential_decay_schedule": lambda: gtx.warmup_exponential_decay_schedule(0.0, 1.0, 3, 2, 0.5),
}


# Transforms of per-example grads (a leading example dim on every leaf), stepped on such grads.
PER_EXAMPLE = {
    "differentially_private_aggregate": lambda: gtx.differentially_private_aggregate(1.0, 0.5, seed=1),
    "dpsgd": lambda: gtx.dpsgd(0.1, 1.0, 0.5, seed=2, momentum=0.9),
}


def test_every_public_factory_is_covered():
    decorated = {
        name
        for name in gtx.__all__
        if inspect.isfunction(getattr(gtx, name))
        and inspect.signature(getattr(gtx, name)).return_annotation
        in ("GradientTransformation", "ScalarTransformation", "OptimizerChain", "Accumulation", "Guard", "Schedule")
    }
    assert decorated == (set(TRANSFORMS) | set(SCHEDULES) | set(PER_EXAMPLE)) - {"inject_hyperparams"}
    for name in decorated:
        assert hasattr(getattr(gtx, name), "__wrapped__"), f"{name} is not decorated with gradtx.core.base.factory"


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}


# What some transforms need beyond (grads, state, params): the value they monitor; params as a pair.
EXTRAS = {"reduce_on_plateau": {"value": 1.0}}
PARAMS = {"lookahead": gtx.LookaheadParams.init_synced}


def _side_by_side(tx: gtx.GradientTransformation, other: gtx.GradientTransformation, name: str = "") -> None:
    params = PARAMS.get(name, lambda p: p)(_grads(100))
    extra = EXTRAS.get(name, {})
    state, other_state = tx.init(params), other.init(params)
    assert_trees_equal(other_state, state)
    for seed in range(5):
        updates, state = tx.update(_grads(seed), state, params, **extra)
        other_updates, other_state = other.update(_grads(seed), other_state, params, **extra)
        assert_trees_equal(other_updates, updates)
        assert_trees_equal(other_state, state)
        if updates is not None:
            params = gtx.apply_updates(params, updates)


@pytest.mark.parametrize("name", sorted(PER_EXAMPLE))
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_pickled_per_example_transform_computes_what_the_original_does(name, how):
    tx = PER_EXAMPLE[name]()
    other = pickle.loads(pickle.dumps(tx)) if how == "pickle" else copy.deepcopy(tx)
    params = _grads(100)
    state, other_state = tx.init(params), other.init(params)
    for seed in range(3):
        per_example = {k: torch.stack([_grads(seed * 10 + i)[k] for i in range(4)]) for k in params}
        updates, state = tx.update(per_example, state, params)
        other_updates, other_state = other.update(per_example, other_state, params)
        assert_trees_equal(other_updates, updates)
        assert_trees_equal(other_state, state)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_pickled_transform_computes_what_the_original_does(name, how):
    tx = TRANSFORMS[name]()
    other = pickle.loads(pickle.dumps(tx)) if how == "pickle" else copy.deepcopy(tx)
    assert type(other) is type(tx) and other is not tx
    _side_by_side(tx, other, name)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_pickled_schedule_computes_what_the_original_does(name):
    schedule = SCHEDULES[name]()
    other = pickle.loads(pickle.dumps(schedule))
    counts = torch.arange(14)
    assert torch.equal(torch.stack([other(c) for c in counts]), torch.stack([schedule(c) for c in counts]))
    assert repr(other) == repr(schedule) and repr(schedule).startswith(name + "(")


def test_a_schedule_built_from_a_generator_pickles_and_copies_with_its_items():
    """sgdr_schedule takes its cycles as any iterable, as optax's does; from a generator (periods that double), the
    remembered call held the spent generator: pickle and copy.deepcopy raised "cannot pickle 'generator' object"."""
    cycles = [{"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 2, "decay_steps": 4 * 2**i} for i in range(3)]
    schedule = gtx.sgdr_schedule(dict(c) for c in cycles)
    counts = torch.arange(30)
    expected = torch.stack([gtx.sgdr_schedule(cycles)(c) for c in counts])
    for other in (schedule, copy.deepcopy(schedule), pickle.loads(pickle.dumps(schedule))):
        assert torch.equal(torch.stack([other(c) for c in counts]), expected)
    _side_by_side(gtx.sgd(schedule), pickle.loads(pickle.dumps(gtx.sgd(schedule))))


def test_torch_save_of_a_transform_and_its_state_resumes_the_run(tmp_path):
    tx = TRANSFORMS["chain"]()
    params = _grads(100)
    state = tx.init(params)
    _, state = tx.update(_grads(0), state, params)
    torch.save({"tx": tx, "state": state}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)  # a transform is code: not weights_only
    _side_by_side_from(tx, state, loaded["tx"], loaded["state"], params)


def _side_by_side_from(tx, state, other, other_state, params):
    for seed in range(1, 4):
        updates, state = tx.update(_grads(seed), state, params)
        other_updates, other_state = other.update(_grads(seed), other_state, params)
        assert_trees_equal(other_updates, updates)
        assert_trees_equal(other_state, state)


def test_a_user_factory_decorated_with_factory_pickles():
    tx = _user_factory(0.25)
    other = pickle.loads(pickle.dumps(tx))
    _side_by_side(tx, other)
    assert _user_factory.__name__ == "_user_factory" and "momentum" in str(inspect.signature(_user_factory))


def test_a_transform_passed_through_keeps_its_own_pickling():
    inner = gtx.sgd(0.1)
    outer = gtx.chain(inner)
    assert pickle.loads(pickle.dumps(inner)).__dict__["_gradtx_recipe"][0] is gtx.sgd
    _side_by_side(outer, pickle.loads(pickle.dumps(outer)))


@factory
def _first_of(pairs):
    return pairs[0][1]


@factory
def _with_opaque(opaque, step):
    del opaque  # stands for a process group: it neither pickles nor copies
    return gtx.scale(step)


class _Opaque:
    def __reduce__(self):
        raise TypeError("cannot pickle _Opaque")

    def __deepcopy__(self, memo):
        raise TypeError("cannot copy _Opaque")


def test_a_transform_found_deep_in_the_arguments_keeps_its_own_pickling():
    tx = gtx.sgd(0.1)
    assert _first_of((("opt", tx),)) is tx
    assert _first_of([{"a": 1}, ("opt", tx)][1:]) is tx
    _side_by_side(tx, pickle.loads(pickle.dumps(tx)))  # still pickles as sgd(0.1), not as _first_of(...)
    assert tx.__dict__["_gradtx_recipe"][0] is gtx.sgd


def test_the_remembered_call_does_not_follow_later_changes_to_its_arguments():
    boundaries = {3: 0.5}
    schedule = gtx.piecewise_constant_schedule(1.0, boundaries)
    boundaries[1] = 0.0
    again = pickle.loads(pickle.dumps(schedule))
    assert float(again(2)) == float(schedule(2)) == 1.0


def test_copies_share_the_functions_and_need_no_picklable_arguments():
    tx = _with_opaque(_Opaque(), 0.5)
    for other in (copy.copy(tx), copy.deepcopy(tx)):
        assert other == tx and other.update is tx.update and type(other) is type(tx)
        _side_by_side(tx, other)
    chained = gtx.chain(gtx.clip_by_global_norm(1.0), tx)
    deep = copy.deepcopy(chained)
    assert type(deep) is type(chained) and len(deep.members) == len(chained.members)
    _side_by_side(chained, deep)
    with pytest.raises(TypeError, match="cannot pickle _Opaque"):
        pickle.dumps(tx)


def test_a_closure_the_user_wrote_fails_to_pickle_as_pickle_does():
    tx = gtx.GradientTransformation(lambda params: gtx.EmptyState(), lambda u, s, p=None, **e: (u, s))
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(tx)
