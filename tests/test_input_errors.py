"""A clear error for every bad input: factories' arguments, grads of a wrong dtype, layout or device.

Each class of bad input is checked at its root (one validation layer, one tensor check), and
hypothesis sweeps every public factory and transform: a case either is genuinely valid, or
raises TypeError/ValueError naming the argument or the path, with the state untouched.
Dtypes that are valid (fp64, complex, fp16/bf16) are checked in ``tests/test_dtypes.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.testing import assert_trees_equal

# --- the factories and their numeric arguments ------------------------------------------------

# name -> (build(**kwargs), {argument: a valid value})
FACTORIES = {
    "clip": (lambda **kw: gtx.clip(**kw), {"max_delta": 0.5}),
    "clip_by_global_norm": (lambda **kw: gtx.clip_by_global_norm(**kw), {"max_norm": 1.0, "norm_type": 2.0}),
    "adaptive_clip": (lambda **kw: gtx.adaptive_clip(**kw), {"clipping": 0.01, "eps": 1e-3}),
    "scale": (lambda **kw: gtx.scale(**kw), {"step_size": 0.5}),
    "scale_by_learning_rate": (lambda **kw: gtx.scale_by_learning_rate(**kw), {"learning_rate": 0.1}),
    "scale_by_adam": (lambda **kw: gtx.scale_by_adam(**kw), {"b1": 0.9, "b2": 0.999, "eps": 1e-8}),
    "add_decayed_weights": (lambda **kw: gtx.add_decayed_weights(**kw), {"weight_decay": 0.1}),
    "trace": (lambda **kw: gtx.trace(**kw), {"decay": 0.9}),
    "sgd": (lambda **kw: gtx.sgd(**kw), {"learning_rate": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (lambda **kw: gtx.adam(**kw), {"learning_rate": 0.1, "b1": 0.9, "b2": 0.999, "eps": 1e-8}),
    "adamw": (lambda **kw: gtx.adamw(**kw), {"learning_rate": 0.1, "weight_decay": 0.01}),
    "accumulate": (lambda **kw: gtx.accumulate(**kw), {"k": 2}),
    "apply_if_finite": (
        lambda **kw: gtx.apply_if_finite(gtx.identity(), **kw),
        {"max_consecutive_errors": 3},
    ),
}

BAD_VALUES = [float("nan"), "0.1", None, [0.1], True, -1.0, -(10**9), float("-inf")]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(FACTORIES)),
    data=st.data(),
    bad=st.sampled_from(BAD_VALUES),
)
def test_every_factory_names_a_bad_argument(name, data, bad):
    build, valid = FACTORIES[name]
    arg = data.draw(st.sampled_from(sorted(valid)))
    kwargs = {**valid, arg: bad}
    try:
        build(**kwargs)
    except (TypeError, ValueError) as e:
        assert arg in str(e) and name.split("_by_")[0] in str(e), str(e)
        return
    # Accepted: only a value that is genuinely valid for that argument may pass (a negative step
    # size scales by a negative number, which `scale` allows).
    assert (name, arg, bad) in {("scale", "step_size", -1.0), ("scale", "step_size", -(10**9))}, (name, arg, bad)


# --- integer, bool and sparse tensors ------------------------------------------------------------

TRANSFORMS = {
    "clip": lambda: gtx.clip(0.5),
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(1.0),
    "adaptive_clip": lambda: gtx.adaptive_clip(0.01),
    "scale": lambda: gtx.scale(0.5),
    "scale_by_adam": lambda: gtx.scale_by_adam(),
    "add_decayed_weights": lambda: gtx.add_decayed_weights(0.1),
    "trace": lambda: gtx.trace(0.9),
    "sgd": lambda: gtx.sgd(0.1, momentum=0.9),
    "adamw": lambda: gtx.adamw(0.1),
    "accumulate": lambda: gtx.accumulate(1),
    "apply_if_finite": lambda: gtx.apply_if_finite(gtx.sgd(0.1), 2),
}


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g).to(dtype), "b": torch.randn(4, generator=g).to(dtype)}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("bad", ["int", "bool", "sparse"])
def test_int_bool_and_sparse_grads_are_refused_naming_the_path(name, bad):
    tx = TRANSFORMS[name]()
    params = _params()
    state = tx.init(params)
    before = copy.deepcopy(state)
    grads = {k: v.clone() for k, v in params.items()}
    grads["w"] = {
        "int": grads["w"].to(torch.int64),
        "bool": grads["w"] > 0,
        "sparse": grads["w"].to_sparse(),
    }[bad]
    with pytest.raises(TypeError, match=r"\['w'\].*(dtype torch\.(int64|bool)|sparse)"):
        tx.update(grads, state, params)
    assert_trees_equal(state, before)


@pytest.mark.parametrize("bad", ["int", "bool", "sparse"])
def test_skip_spikes_on_the_loss_refuses_int_bool_and_sparse_grads_naming_the_path(bad):
    """metric="loss" reads no grad norm, which is what checks the grads; with an inner that checks nothing (the
    wrapper's usual identity) a sparse grad reached torch.where's NotImplementedError."""
    tx = gtx.skip_spikes(gtx.identity(), metric="loss")
    params = _params()
    state = tx.init(params)
    before = copy.deepcopy(state)
    grads = {"w": {"int": params["w"].to(torch.int64), "bool": params["w"] > 0, "sparse": params["w"].to_sparse()}[bad]}
    with pytest.raises(TypeError, match=r"skip_spikes: updates leaf at \['w'\].*(dtype torch\.(int64|bool)|sparse)"):
        tx.update({**grads, "b": params["b"]}, state, params, loss=1.0)
    assert_trees_equal(state, before)


LEAFWISE = {  # transforms that step leaf by leaf (not through foreach groups): before, torch's RuntimeError
    "ema": lambda: gtx.ema(0.9),
    "scale_by_lion": lambda: gtx.scale_by_lion(),
    "lion": lambda: gtx.lion(0.1),
    "schedule_free_sgd": lambda: gtx.schedule_free_sgd(0.1),
    "schedule_free_adamw": lambda: gtx.schedule_free_adamw(0.1),
}


@pytest.mark.parametrize("name", ["scale_by_adam", "trace", "sgd", "adamw", "add_decayed_weights", *sorted(LEAFWISE)])
def test_grads_on_another_device_than_the_state_are_refused(name):
    tx = {**TRANSFORMS, **LEAFWISE}[name]()
    params = _params()
    state = tx.init(params)
    before = copy.deepcopy(state)
    grads = {k: torch.empty_like(v, device="meta") for k, v in params.items()}
    with pytest.raises(ValueError, match=r"\['b'\] is on meta.*cpu"):
        tx.update(grads, state, params)
    assert_trees_equal(state, before)


def test_accumulate_refuses_a_micro_batch_on_another_device():
    tx = gtx.accumulate(2)
    params = _params()
    _, state = tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match=r"\['b'\] is on meta"):
        tx.update({k: torch.empty_like(v, device="meta") for k, v in params.items()}, state)


def test_tokens_too_large_names_tokens():
    tx = gtx.accumulate(2, token_weighted=True)
    with pytest.raises(ValueError, match="tokens must be < 2\\*\\*62"):
        tx.update(_params(), tx.init(_params()), tokens=2**70)


@pytest.mark.parametrize("flush", ["no", 0, None, torch.tensor(True)])
def test_flush_must_be_a_bool_functional_and_wrapped(flush):
    # bool("no") is True: taken as it came, a string would close a window of 4 after 2 micro-steps.
    tx = gtx.accumulate(4)
    params = _params()
    _, state = tx.update(params, tx.init(params))
    before = copy.deepcopy(state)
    with pytest.raises(TypeError, match="flush must be True or False"):
        tx.update(params, state, flush=flush)
    assert_trees_equal(state, before)

    model = torch.nn.Linear(3, 1)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(4))
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    grads, tx_state = [p.grad.clone() for p in model.parameters()], copy.deepcopy(opt.tx_state)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(TypeError, match="flush must be True or False"):
        opt.step(flush=flush)
    assert_trees_equal(opt.tx_state, tx_state)
    assert not opt.emitted
    assert_trees_equal([p.grad for p in model.parameters()], [2 * g for g in grads])  # the window's sum, kept


NAN = float("nan")
REFUSED_AT_CONSTRUCTION = {  # found by review: each was accepted, or failed later naming something else
    "onecycle pct_start": (
        lambda: gtx.linear_onecycle_schedule(100, 1.0, pct_start=-1.0),
        r"linear_onecycle_schedule: pct_start must be in \[0, 1\]",
    ),
    "onecycle pct_start bool": (
        lambda: gtx.cosine_onecycle_schedule(100, 1.0, pct_start=True),
        "cosine_onecycle_schedule: pct_start must be a number",
    ),
    "onecycle div_factor": (
        lambda: gtx.cosine_onecycle_schedule(100, 1.0, div_factor=0.0),
        "cosine_onecycle_schedule: div_factor must be > 0",
    ),
    "onecycle final_div_factor": (
        lambda: gtx.linear_onecycle_schedule(100, 1.0, final_div_factor=NAN),
        "linear_onecycle_schedule: final_div_factor must not be NaN",
    ),
    "warmup peak_value": (
        lambda: gtx.warmup_exponential_decay_schedule(0.0, NAN, 10, 100, 0.5),
        "warmup_exponential_decay_schedule: peak_value",
    ),
    "exponential_decay rate": (
        lambda: gtx.exponential_decay(1.0, 10, -0.5),
        "exponential_decay: decay_rate must be >= 0",
    ),
    "polynomial power": (
        lambda: gtx.polynomial_schedule(1.0, 0.0, -1.0, 10),
        "polynomial_schedule: power must be >= 0",
    ),
    "cosine exponent": (
        lambda: gtx.cosine_decay_schedule(1.0, 10, exponent=-1.0),
        "cosine_decay_schedule: exponent must be >= 0",
    ),
    "ema int accumulator": (
        lambda: gtx.ema(0.9, accumulator_dtype=torch.int32),
        "ema: accumulator_dtype must be a floating",
    ),
    "ema decay 1 debiased": (lambda: gtx.ema(1.0), "ema: decay must be < 1 with debias=True"),
    "schedule_free int state": (
        lambda: gtx.schedule_free_sgd(0.1, state_dtype=torch.int64),
        "state_dtype must be a floating",
    ),
    "schedule_free_adamw b1": (
        lambda: gtx.schedule_free_adamw(1e-3, b1=1.5),
        r"schedule_free_adamw: b1 must be in \(0, 1\)",
    ),
    "schedule_free_sgd b1": (lambda: gtx.schedule_free_sgd(0.1, b1=0.0), r"schedule_free_sgd: b1 must be in \(0, 1\)"),
    "lion int moment": (lambda: gtx.lion(0.1, mu_dtype=torch.int32), "scale_by_lion: mu_dtype must be a floating"),
    "dpsgd momentum": (lambda: gtx.dpsgd(0.1, 1.0, 1.0, seed=0, momentum=-0.5), "dpsgd: momentum must be >= 0"),
    "add_noise seed": (lambda: gtx.add_noise(0.01, 0.55, seed=2**70), r"add_noise: seed must be < 2\*\*64"),
    "muon ns_coeffs NaN": (lambda: gtx.muon(0.02, ns_coeffs=(NAN, 1.0, 1.0)), "ns_coeffs must be finite"),
    "muon ns_coeffs bools": (lambda: gtx.muon(0.02, ns_coeffs=(True, False, True)), "ns_coeffs must be three numbers"),
    # a sweep of gtx.__all__ for bad arguments (before: torch's or optree's errors, the wrong name, or accepted)
    "muon adam_learning_rate": (lambda: gtx.muon(0.02, adam_learning_rate="3e-4"), "muon: adam_learning_rate must be"),
    "dpsgd nesterov": (lambda: gtx.dpsgd(0.1, 1.0, 1.0, seed=0, nesterov="no"), "dpsgd: nesterov must be a bool"),
    "newton_schulz int x": (
        lambda: gtx.newton_schulz(torch.ones(3, 3, dtype=torch.int64)),
        "newton_schulz: x .* has dtype torch.int64",
    ),
    "newton_schulz list x": (lambda: gtx.newton_schulz([[1.0]]), "newton_schulz: x .* is a list"),
    "newton_schulz ns_dtype": (
        lambda: gtx.newton_schulz(torch.ones(3, 3), ns_dtype=torch.int32),
        "newton_schulz: ns_dtype must be a floating",
    ),
    "no_sync sync None": (lambda: gtx.no_sync(torch.nn.Linear(2, 2), sync=None).__enter__(), "no_sync: sync must be"),
    "exchange_plan rank": (lambda: gtx.exchange_plan({"w": torch.ones(4, 3)}, rank=-1), "exchange_plan: rank must be"),
    "exchange_plan adaptive": (
        lambda: gtx.exchange_plan({"w": torch.ones(4, 3)}, adaptive="no"),
        "exchange_plan: adaptive must be a bool",
    ),
    "exchange_plan ns_steps": (
        lambda: gtx.exchange_plan({"w": torch.ones(4, 3)}, ns_steps="5"),
        "exchange_plan: ns_steps",
    ),
    "norm_audit check_replicas": (
        lambda: gtx.norm_audit({"w": torch.ones(2)}, check_replicas="no"),
        "norm_audit: check_replicas must be a bool",
    ),
    "incremental_update shape": (  # (3,) broadcast against (2, 3): a (2, 3) average came back
        lambda: gtx.incremental_update({"w": torch.ones(2, 3)}, {"w": torch.zeros(3)}, 0.1),
        r"incremental_update: new_tensors does not match old_tensors at \['w'\]: expected shape \(3,\), got \(2, 3\)",
    ),
    "incremental_update old None": (
        lambda: gtx.incremental_update({"w": torch.ones(2)}, {"w": None}, 0.1),
        r"incremental_update: new_tensors does not match old_tensors at \['w'\]",
    ),
    "periodic_update shape": (
        lambda: gtx.periodic_update({"w": torch.ones(2, 3)}, {"w": torch.zeros(3)}, torch.tensor(3), 2),
        r"periodic_update: old_tensors does not match new_tensors at \['w'\]: expected shape \(2, 3\), got \(3,\)",
    ),
    "conditionally_mask float leaf": (
        lambda: gtx.conditionally_mask(gtx.sgd(0.1), lambda step: True).update(
            {"b": 1.0}, gtx.conditionally_mask(gtx.sgd(0.1), lambda step: True).init({"b": torch.ones(2)})
        ),
        r"conditionally_mask: updates leaf at \['b'\] is a float",
    ),
    "conditionally_transform predicate float tensor": (  # before: torch.where's RuntimeError
        lambda: gtx.conditionally_transform(gtx.sgd(0.1), lambda step: torch.tensor(1.0)).update(
            {"b": torch.ones(2)},
            gtx.conditionally_transform(gtx.sgd(0.1), lambda step: True).init({"b": torch.ones(2)}),
        ),
        r"should_transform_fn must return a bool or a 0-d bool tensor, got torch.float32 of shape \(\)",
    ),
    "conditionally_mask predicate 1-d": (  # before: applied element by element where it broadcasts
        lambda: gtx.conditionally_mask(gtx.sgd(0.1), lambda step: torch.ones(2, dtype=torch.bool)).update(
            {"b": torch.ones(2)}, gtx.conditionally_mask(gtx.sgd(0.1), lambda step: True).init({"b": torch.ones(2)})
        ),
        r"should_transform_fn must return a bool or a 0-d bool tensor, got torch.bool of shape \(2,\)",
    ),
    "pp_reduce int grads": (  # before: accepted (summed across the stages as integers)
        lambda: gtx.pp_reduce(
            gtx.mesh_groups({"w": torch.ones(2)}, comm=gtx.comm.LocalComm(), pp_group="pp", tied={"w": "pp"})
        ).update({"w": torch.ones(2, dtype=torch.int64)}, gtx.EmptyState()),
        r"pp_reduce: updates leaf at \['w'\] has dtype torch.int64",
    ),
    "scalar_transformation factor": (  # before: accepted; "'str' object is not callable" at the first update
        lambda: gtx.scalar_transformation(gtx.init_empty_state, "halve"),
        "scalar_transformation: factor must be a function, got str",
    ),
    "clip complex": (
        lambda: gtx.clip(1.0).update({"b": torch.ones(2), "w": torch.ones(2, dtype=torch.complex64)}, gtx.EmptyState()),
        r"clip: updates leaf at \['w'\] is complex",
    ),
    "per_example_global_norm_clip complex": (
        lambda: gtx.per_example_global_norm_clip({"w": torch.ones(2, 3, dtype=torch.complex64)}, 1.0),
        r"per_example_global_norm_clip: grads leaf at \['w'\] is complex",
    ),
    "differentially_private_aggregate complex": (
        lambda: gtx.differentially_private_aggregate(1.0, 0.5, seed=0).update(
            {"w": torch.ones(2, 3, dtype=torch.complex64)}, gtx.differentially_private_aggregate(1.0, 0.5, 0).init(None)
        ),
        r"differentially_private_aggregate: grads leaf at \['w'\] is complex",
    ),
    # before: Python's own TypeError ("'<=' not supported", "'float' object is not iterable"), or, for an int
    # in argnames, that positional argument batched in silence
    "microbatch in_axes str": (lambda: gtx.microbatch(lambda x: x, 0, 2, in_axes="0"), "microbatch: in_axes must be"),
    "microbatch in_axes float": (lambda: gtx.microbatch(lambda x: x, 0, 2, in_axes=0.0), "microbatch: in_axes must be"),
    "microbatch argnames int": (lambda: gtx.microbatch(lambda x: x, (), 2, argnames=[0]), "microbatch: argnames must"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_AT_CONSTRUCTION))
def test_more_bad_arguments_are_refused_at_construction_naming_them(case):
    build, match = REFUSED_AT_CONSTRUCTION[case]
    with pytest.raises((ValueError, TypeError), match=match):
        build()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda s: gtx.scale_by_schedule(s), "scale_by_schedule: the schedule's value must be"),
        (lambda s: gtx.sgd(s), "scale_by_learning_rate: the schedule's value must be"),
        (lambda s: gtx.schedule_free(gtx.sgd(0.1), s), "schedule_free: the learning rate schedule's value must be"),
        (lambda s: gtx.sgd(gtx.join_schedules([s, gtx.constant_schedule(0.1)], [5])), "join_schedules: a schedule's"),
        (lambda s: gtx.inject_hyperparams(gtx.sgd)(learning_rate=s), "(inject_hyperparams|sgd): .* must be"),
    ],
)
@pytest.mark.parametrize("value", [torch.full((2,), 0.1), "0.1", None])
def test_a_schedule_whose_value_is_not_a_scalar_is_named(make, match, value):
    """Before: torch's RuntimeError ('scalar tensor expected to be 0 dim'), float()'s ValueError, or, in
    schedule_free, a (2,) learning rate taken silently (its state's max_lr became (2,))."""
    params = {"w": torch.ones(2)}
    with pytest.raises((TypeError, ValueError), match=match):
        tx = make(lambda count: value)
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize(
    "make",
    [
        gtx.scale_by_schedule,
        gtx.sgd,
        lambda s: gtx.sgd(gtx.join_schedules([s, gtx.constant_schedule(0.1)], [5])),
        lambda s: gtx.inject_hyperparams(gtx.sgd)(learning_rate=s),
    ],
)
def test_a_schedule_whose_value_is_a_0d_numpy_array_steps_as_its_number(make):
    """np.where(...) of a Python number gives a 0-d array, which float() takes (as every one of these did)."""
    import numpy as np

    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    txs = [make(lambda count, v=v: v) for v in (np.where(True, 0.25, 0.5), 0.25)]  # the array, and its number
    states = [tx.init(params) for tx in txs]
    for _ in range(2):
        (u, a), (v, b) = (tx.update(params, s, params) for tx, s in zip(txs, states))
        assert torch.equal(u["w"], v["w"]) and torch.equal(
            u["w"], -0.25 * params["w"] if make is not gtx.scale_by_schedule else 0.25 * params["w"]
        )
        states = [a, b]


def test_update_time_contracts_found_by_review():
    bad_verdict = gtx.skip_if(gtx.identity(), lambda updates, step, params: torch.tensor(False))
    with pytest.raises(TypeError, match="should_skip_update_fn must return \\(verdict, state\\)"):
        bad_verdict.init({"w": torch.ones(2)})
    for tx in (gtx.scale_by_shape(), gtx.orthogonalize()):
        with pytest.raises(TypeError, match=r"updates leaf at \['w'\] has dtype torch.int64"):
            tx.update({"w": torch.ones(3, 4, dtype=torch.int64)}, tx.init({"w": torch.ones(3, 4)}))


# --- the factories added with schedules, hyperparameters and spike handling --------------------------

MORE_FACTORIES = {
    "constant_schedule": (gtx.constant_schedule, {"value": 0.1}),
    "linear_schedule": (
        gtx.linear_schedule,
        {"init_value": 1.0, "end_value": 0.1, "transition_steps": 10, "transition_begin": 0},
    ),
    "cosine_decay_schedule": (gtx.cosine_decay_schedule, {"init_value": 1.0, "decay_steps": 10, "alpha": 0.0}),
    "exponential_decay": (gtx.exponential_decay, {"init_value": 1.0, "transition_steps": 10, "decay_rate": 0.5}),
    "polynomial_schedule": (
        gtx.polynomial_schedule,
        {"init_value": 1.0, "end_value": 0.1, "power": 2.0, "transition_steps": 10},
    ),
    "warmup_cosine_decay_schedule": (
        gtx.warmup_cosine_decay_schedule,
        {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 2, "decay_steps": 10},
    ),
    "warmup_constant_schedule": (
        gtx.warmup_constant_schedule,
        {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 2},
    ),
    "cosine_onecycle_schedule": (gtx.cosine_onecycle_schedule, {"transition_steps": 10, "peak_value": 1.0}),
    "zclip": (gtx.zclip, {"alpha": 0.97, "z_thresh": 2.5, "warmup_steps": 5}),
    "autoclip": (gtx.autoclip, {"percentile": 10.0, "history": 100}),
    "skip_spikes": (
        lambda **kw: gtx.skip_spikes(gtx.identity(), **kw),
        {"z_thresh": 6.0, "alpha": 0.98, "warmup_steps": 5},
    ),
    "clip_by_block_rms": (gtx.clip_by_block_rms, {"threshold": 1.0}),
    "inject_hyperparams": (
        lambda **kw: gtx.inject_hyperparams(gtx.sgd)(**kw).init({"w": torch.zeros(2)}),
        {"learning_rate": 0.1, "momentum": 0.9},
    ),
    # optax parity, second part
    "ema": (gtx.ema, {"decay": 0.9}),
    "scale_by_lion": (gtx.scale_by_lion, {"b1": 0.9, "b2": 0.99}),
    "lion": (gtx.lion, {"learning_rate": 1e-4, "b1": 0.9, "b2": 0.99, "weight_decay": 1e-3}),
    "scale_by_trust_ratio": (gtx.scale_by_trust_ratio, {"min_norm": 0.0, "trust_coefficient": 1.0, "eps": 0.0}),
    "lars": (gtx.lars, {"learning_rate": 0.1, "weight_decay": 0.0, "trust_coefficient": 0.001, "momentum": 0.9}),
    "lamb": (gtx.lamb, {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-6, "eps_root": 0.0}),
    "normalize_by_update_norm": (gtx.normalize_by_update_norm, {"scale_factor": 1.0, "eps": 1e-6}),
    "reduce_on_plateau": (
        gtx.reduce_on_plateau,
        {"factor": 0.1, "patience": 10, "rtol": 1e-4, "atol": 0.0, "cooldown": 0, "accumulation_size": 1},
    ),
    "lookahead": (lambda **kw: gtx.lookahead(gtx.sgd(0.1), **kw), {"sync_period": 5, "slow_step_size": 0.5}),
    "schedule_free_adamw": (
        gtx.schedule_free_adamw,
        {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    ),
    "sam": (lambda **kw: gtx.sam(gtx.sgd(0.1), gtx.scale(0.05), **kw), {"sync_period": 2}),
    "measure_with_ema": (lambda **kw: gtx.measure_with_ema(gtx.global_norm, **kw), {"decay": 0.9}),
}

# Wrong for any numeric argument, whatever its range.
BAD_FOR_ANY = [float("nan"), "0.1", None, [0.1], True]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(MORE_FACTORIES)), data=st.data(), bad=st.sampled_from(BAD_FOR_ANY))
def test_every_newer_factory_names_a_bad_argument(name, data, bad):
    build, valid = MORE_FACTORIES[name]
    arg = data.draw(st.sampled_from(sorted(valid)))
    assume(not (bad is None and (name, arg) == ("autoclip", "history")))  # None: an unbounded history
    # inject_hyperparams hands the values to the factory it wraps, which names them.
    who = {"inject_hyperparams": "sgd"}.get(name, name)
    with pytest.raises((TypeError, ValueError), match=f"{who}.*{arg}"):
        build(**{**valid, arg: bad})


@pytest.mark.parametrize("name", sorted(MORE_FACTORIES))
def test_every_newer_factory_builds_with_valid_arguments(name):
    build, valid = MORE_FACTORIES[name]
    build(**valid)


def _synced(params):
    return gtx.LookaheadParams.init_synced(params)


# A transform that reads a second tree leaf by leaf (params beside its state) checks it as it checks the updates.
SECOND_TREE = {
    "schedule_free": (lambda: gtx.schedule_free_sgd(0.1), lambda p: p, lambda p, bad: bad, "schedule_free: params"),
    "sam": (lambda: gtx.sam(gtx.sgd(0.1), gtx.sgd(0.05)), lambda p: p, lambda p, bad: bad, "sam: params"),
    "lookahead": (
        lambda: gtx.lookahead(gtx.sgd(0.1), 2, 0.5),
        _synced,
        lambda p, bad: gtx.LookaheadParams(p, bad),
        "lookahead: params.slow",
    ),
}


@pytest.mark.parametrize("name", sorted(SECOND_TREE))
@pytest.mark.parametrize("bad", ["misspelt key", "wrong shape"])
def test_a_params_tree_that_does_not_match_is_refused_naming_the_path(name, bad):
    build, init_arg, params_of, who = SECOND_TREE[name]
    p = {"a": torch.ones(2), "b": torch.full((2,), 5.0)}
    wrong = {"a": torch.ones(2), "c": p["b"]} if bad == "misspelt key" else {"a": torch.ones(2), "b": torch.ones(3, 2)}
    tx = build()
    state = tx.init(init_arg(p))
    before = copy.deepcopy(state)
    with pytest.raises(ValueError, match=rf"{who} does not match .*\['(b|c)'\]"):
        tx.update({"a": torch.ones(2), "b": torch.ones(2)}, state, params_of(p, wrong))
    assert_trees_equal(state, before)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda mb: mb(torch.randn(4)), "num_real_microbatches=5 is more than the 2"),
        (lambda mb: gtx.microbatch(lambda x: x.sum(), 3, 2)(torch.randn(4)), "batch argument 3 .* was not passed"),
        (lambda mb: gtx.microbatch(lambda x: x.sum(), 0, 2, argnames="y")(torch.randn(4)), "'y' .* was not passed"),
        (lambda mb: gtx.microbatch(lambda x: x.sum(), 0, 2, in_axes=3)(torch.randn(4, 2)), "in_axes 3 is out of range"),
        (lambda mb: gtx.microbatch(lambda x: x.sum(), 0, 2)(torch.tensor(3.0)), "in_axes 0 is out of range"),
    ],
)
def test_microbatch_names_the_argument_a_call_gets_wrong(call, match):
    mb = gtx.microbatch(lambda x: x.sum(), 0, 2, num_real_microbatches=5)
    with pytest.raises(ValueError, match=match):
        call(mb)


@pytest.mark.parametrize("name", sorted(SECOND_TREE))
def test_a_params_tree_on_another_device_is_refused_naming_the_path(name):
    build, init_arg, params_of, who = SECOND_TREE[name]
    p = {"a": torch.ones(2), "b": torch.full((2,), 5.0)}
    tx = build()
    state = tx.init(init_arg(p))
    before = copy.deepcopy(state)
    elsewhere = {"a": torch.ones(2), "b": torch.empty(2, device="meta")}  # meta stands in for another device
    with pytest.raises(ValueError, match=rf"\['b'\] is on cpu, {who} on meta"):
        tx.update({"a": torch.ones(2), "b": torch.ones(2)}, state, params_of(p, elsewhere))
    assert_trees_equal(state, before)


def test_apply_updates_names_an_update_on_another_device_than_its_param():
    params = _params()
    before = copy.deepcopy(params)
    updates = {"w": torch.ones(3, 4), "b": torch.empty(4, device="meta")}  # meta stands in for another device
    with pytest.raises(ValueError, match=r"updates leaf at \['b'\] is on meta, its param on cpu"):
        gtx.apply_updates(params, updates)
    assert_trees_equal(params, before)


def test_a_chain_refuses_a_members_state_as_long_as_the_chain_naming_both():
    """A member's NamedTuple state is a tuple: one as long as the chain passed the chain's check and reached the
    members field by field ("clip: expected state of type EmptyState, got Tensor", about the wrong transform)."""
    params = _params()
    tx = gtx.chain(gtx.clip(1.0), gtx.scale_by_adam(), gtx.scale(-0.1))
    state = gtx.scale_by_adam().init(params)  # count, mu, nu: three fields
    before = copy.deepcopy(state)
    with pytest.raises(ValueError, match="chain: expected a state tuple of 3 member states, got ScaleByAdamState"):
        tx.update(params, state, params)
    assert_trees_equal(state, before)


@pytest.mark.parametrize("bad", [torch.ones(3, dtype=torch.int64), "1"])
def test_a_corrupt_window_count_in_a_wrapper_checkpoint_is_named_and_nothing_changes(bad):
    model = torch.nn.Linear(3, 2)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(2))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # micro-step 1 of 2: the window is open, its partial sums in .grad
    saved, grads = copy.deepcopy(opt.state_dict()), [p.grad.clone() for p in model.parameters()]
    corrupt = copy.deepcopy(saved)
    counts = corrupt["state"][0]["gradtx"]["global"]
    (key,) = [k for k in counts if k.endswith("micro_step")]
    counts[key] = bad  # before: int() of it, "only one element tensors can be converted to Python scalars"
    with pytest.raises(ValueError, match=rf"global state '{key}' must be a one-element tensor"):
        opt.load_state_dict(corrupt)
    assert_trees_equal(opt.state_dict(), saved)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize(
    "name, init, who",
    [
        ("muon", lambda p: gtx.muon(0.1).init(p), r"muon \(adam\)"),
        ("sam", lambda p: gtx.sam(gtx.sgd(0.1), gtx.sgd(0.05)).init(p), "sam"),
        ("zero_nans", lambda p: gtx.zero_nans().init(p), "zero_nans"),
        ("init_synced", gtx.LookaheadParams.init_synced, r"LookaheadParams\.init_synced"),
    ],
)
def test_init_names_a_params_leaf_that_is_not_a_tensor(name, init, who):
    # Before: AttributeError ('int' object has no attribute 'ndim' / 'detach' / 'device'), naming no leaf.
    with pytest.raises(TypeError, match=rf"{who}: params leaf at \['n'\] is a int, not a torch.Tensor"):
        init({"w": torch.ones(2, 2), "n": 3})
