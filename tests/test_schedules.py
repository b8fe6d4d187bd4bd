"""Schedules against optax's, step by step, and as learning rates inside a compiled functional step.

optax (on jax's CPU backend) is the reference: every schedule is evaluated at
every step of a range that starts before 0 and runs past its last transition,
with the count given both as a 0-d int64 tensor and as a Python int. Values
must agree to fp32 rounding: a few ulps where transcendental functions
(``cos``, ``pow``) are involved, since XLA and ATen round those differently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtx as gtx
from gradtx import schedules

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

# (name, kwargs): optax's own test cases plus edge cases (negative begin, no transition, zero rate, bounds).
CASES = [
    ("constant_schedule", {"value": 0.3}),
    ("constant_schedule", {"value": 0.0}),
    ("polynomial_schedule", {"init_value": 10.0, "end_value": 20.0, "power": 1, "transition_steps": 10}),
    (
        "polynomial_schedule",
        {"init_value": 1.0, "end_value": 0.01, "power": 2, "transition_steps": 100, "transition_begin": 5},
    ),
    (
        "polynomial_schedule",
        {"init_value": 1.0, "end_value": 0.5, "power": 0.5, "transition_steps": 37, "transition_begin": -3},
    ),
    ("polynomial_schedule", {"init_value": 1.0, "end_value": 0.5, "power": 2, "transition_steps": 0}),
    ("polynomial_schedule", {"init_value": 1.0, "end_value": 0.5, "power": 2, "transition_steps": -4}),
    ("linear_schedule", {"init_value": 0.1, "end_value": 0.7, "transition_steps": 33}),
    ("linear_schedule", {"init_value": 1.0, "end_value": 0.0, "transition_steps": 50, "transition_begin": 20}),
    ("piecewise_constant_schedule", {"init_value": 0.1, "boundaries_and_scales": {10: 0.3, 50: 3.0, 80: 0.1}}),
    ("piecewise_constant_schedule", {"init_value": 0.1, "boundaries_and_scales": {0: 0.5, 7: 0.0}}),
    ("piecewise_constant_schedule", {"init_value": 0.25}),
    ("exponential_decay", {"init_value": 0.7, "transition_steps": 7, "decay_rate": 0.9}),
    (
        "exponential_decay",
        {
            "init_value": 0.7,
            "transition_steps": 7,
            "decay_rate": 0.9,
            "transition_begin": 3,
            "staircase": True,
            "end_value": 0.2,
        },
    ),
    ("exponential_decay", {"init_value": 0.7, "transition_steps": 7, "decay_rate": 1.1, "end_value": 1.5}),
    ("exponential_decay", {"init_value": 0.7, "transition_steps": 7, "decay_rate": 0.0}),
    ("exponential_decay", {"init_value": 0.7, "transition_steps": 0, "decay_rate": 0.5}),
    ("exponential_decay", {"init_value": 0.7, "transition_steps": 9, "decay_rate": 0.5, "transition_begin": -2}),
    ("cosine_decay_schedule", {"init_value": 0.3, "decay_steps": 77}),
    ("cosine_decay_schedule", {"init_value": 0.3, "decay_steps": 77, "alpha": 0.1, "exponent": 2.0}),
    ("cosine_decay_schedule", {"init_value": -0.5, "decay_steps": 1, "alpha": 0.5}),
    (
        "warmup_cosine_decay_schedule",
        {"init_value": 0.0, "peak_value": 1e-3, "warmup_steps": 13, "decay_steps": 150, "end_value": 1e-5},
    ),
    ("warmup_cosine_decay_schedule", {"init_value": 0.1, "peak_value": 0.0, "warmup_steps": 5, "decay_steps": 50}),
    (
        "warmup_cosine_decay_schedule",
        {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 0, "decay_steps": 60, "exponent": 3},
    ),
    ("warmup_constant_schedule", {"init_value": 0.0, "peak_value": 2.0, "warmup_steps": 13}),
    ("warmup_constant_schedule", {"init_value": 0.5, "peak_value": 2.0, "warmup_steps": 0}),
    ("cosine_onecycle_schedule", {"transition_steps": 150, "peak_value": 0.3}),
    ("cosine_onecycle_schedule", {"transition_steps": 150, "peak_value": 0.3, "pct_start": 0.25, "div_factor": 10.0}),
    ("cosine_onecycle_schedule", {"transition_steps": 3, "peak_value": 1.0, "pct_start": 0.0}),
    ("linear_onecycle_schedule", {"transition_steps": 150, "peak_value": 0.3}),
    (
        "piecewise_interpolate_schedule",
        {"interpolate_type": "linear", "init_value": 1.0, "boundaries_and_scales": {4: 0.1, 8: 0.01}},
    ),
    (
        "piecewise_interpolate_schedule",
        {"interpolate_type": "cosine", "init_value": 1.0, "boundaries_and_scales": {0: 0.5, 40: 0.1, 90: 3}},
    ),
    ("piecewise_interpolate_schedule", {"interpolate_type": "linear", "init_value": 2.0}),
    (
        "warmup_exponential_decay_schedule",
        {
            "init_value": 0.0,
            "peak_value": 1.0,
            "warmup_steps": 10,
            "transition_steps": 5,
            "decay_rate": 0.8,
            "transition_begin": 4,
            "end_value": 0.1,
        },
    ),
]
STEPS = list(range(-5, 210))


def optax_values(name: str, kwargs: dict) -> np.ndarray:
    fn = getattr(optax, name)(**kwargs)
    return np.array([np.float32(fn(jnp.asarray(s, dtype=jnp.int32))) for s in STEPS], dtype=np.float32)


def gradtx_values(fn, *, as_tensor: bool) -> np.ndarray:
    out = []
    for s in STEPS:
        v = fn(torch.tensor(s) if as_tensor else s)
        assert isinstance(v, torch.Tensor) and v.shape == () and v.dtype == torch.float32
        out.append(float(v))
    return np.array(out, dtype=np.float32)


def assert_fp32_close(actual: np.ndarray, expected: np.ndarray, *, what: str) -> None:
    # fp32 rounding: rtol of a few ulps, and an atol at a few ulps of the schedule's scale for values
    # that cancel to ~0 (1 + cos(pi) at the end of a cosine).
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=4e-7, atol=1e-6 * scale, err_msg=what)


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_schedule_matches_optax_at_every_step(name, kwargs):
    fn = getattr(gtx, name)(**kwargs)
    assert getattr(schedules, name) is getattr(gtx, name)  # re-exported at the top level, as optax does
    expected = optax_values(name, kwargs)
    from_tensor = gradtx_values(fn, as_tensor=True)
    assert_fp32_close(from_tensor, expected, what=f"{name}({kwargs})")
    # A Python int count gives exactly what the tensor count gives; so does a NumPy int (optax takes both).
    np.testing.assert_array_equal(gradtx_values(fn, as_tensor=False), from_tensor)
    np.testing.assert_array_equal([float(fn(np.int64(s))) for s in STEPS], from_tensor)


def test_join_schedules_matches_optax():
    parts_t = [gtx.constant_schedule(1.0), gtx.linear_schedule(1.0, 0.0, 10), gtx.exponential_decay(0.5, 3, 0.5)]
    parts_o = [optax.constant_schedule(1.0), optax.linear_schedule(1.0, 0.0, 10), optax.exponential_decay(0.5, 3, 0.5)]
    fn_t = gtx.join_schedules(parts_t, [5, 20])
    fn_o = optax.join_schedules(parts_o, [5, 20])
    expected = np.array([np.float32(fn_o(jnp.asarray(s, dtype=jnp.int32))) for s in STEPS], dtype=np.float32)
    assert_fp32_close(gradtx_values(fn_t, as_tensor=True), expected, what="join_schedules")


def test_join_schedules_accepts_a_user_schedule_returning_a_number():
    fn = gtx.join_schedules([lambda c: 2.0, gtx.constant_schedule(3.0)], [4])
    assert [float(fn(s)) for s in (0, 3, 4, 9)] == [2.0, 2.0, 3.0, 3.0]


def test_sgdr_matches_optax():
    cycles = [
        {"init_value": 0.0, "peak_value": 1e-3, "warmup_steps": 10, "decay_steps": 60},
        {"init_value": 1e-4, "peak_value": 5e-4, "warmup_steps": 5, "decay_steps": 80, "end_value": 1e-5},
    ]
    fn_o = optax.sgdr_schedule(cycles)
    expected = np.array([np.float32(fn_o(jnp.asarray(s, dtype=jnp.int32))) for s in STEPS], dtype=np.float32)
    assert_fp32_close(gradtx_values(gtx.sgdr_schedule(cycles), as_tensor=True), expected, what="sgdr_schedule")


def test_schedule_keeps_the_count_device_and_does_not_touch_the_count():
    count = torch.tensor(7)
    before = count.clone()
    v = gtx.warmup_cosine_decay_schedule(0.0, 1.0, 5, 20)(count)
    assert v.device == count.device and v.dtype == torch.float32
    assert torch.equal(count, before)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: gtx.cosine_decay_schedule(1.0, 0), ValueError, "decay_steps must be > 0"),
        (lambda: gtx.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10), ValueError, "must be > warmup_steps"),
        (lambda: gtx.piecewise_constant_schedule(1.0, {5: -0.1}), ValueError, "non-negative scale"),
        (lambda: gtx.piecewise_interpolate_schedule("cubic", 1.0), ValueError, "interpolate_type"),
        (lambda: gtx.cosine_onecycle_schedule(0, 1.0), ValueError, "transition_steps must be > 0"),
        (lambda: gtx.linear_schedule("1", 0.0, 10), TypeError, "init_value must be a number"),
        (lambda: gtx.linear_schedule(1.0, 0.0, 2.5), TypeError, "transition_steps must be an int"),
        (lambda: gtx.exponential_decay(1.0, 10, float("nan")), ValueError, "decay_rate must not be NaN"),
        (lambda: gtx.join_schedules([gtx.constant_schedule(1.0)], [3]), ValueError, "one fewer"),
        (lambda: gtx.join_schedules([1.0, 2.0], [3]), TypeError, r"schedules\[0\] must be callable"),
        (lambda: gtx.constant_schedule(1.0)("3"), TypeError, "step count"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- as learning rates ------------------------------------------------------------------------


def _tree(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _to_jax(tree):
    return {k: jnp.asarray(v.numpy()) for k, v in tree.items()}


@pytest.mark.parametrize("which", ["adamw", "sgd"])
def test_scheduled_learning_rate_matches_optax_over_steps(which):
    sched_args = {"init_value": 0.0, "peak_value": 0.05, "warmup_steps": 5, "decay_steps": 30, "end_value": 0.001}
    if which == "adamw":
        # optax's default weight_decay is 1e-4 and gradtx's 0.01 (torch's): pass it to compare.
        tx = gtx.adamw(learning_rate=gtx.warmup_cosine_decay_schedule(**sched_args), weight_decay=1e-4)
        ref = optax.adamw(learning_rate=optax.warmup_cosine_decay_schedule(**sched_args), weight_decay=1e-4)
    else:
        tx = gtx.sgd(gtx.warmup_cosine_decay_schedule(**sched_args), momentum=0.9)
        ref = optax.sgd(optax.warmup_cosine_decay_schedule(**sched_args), momentum=0.9)
    params, jparams = _tree(0), _to_jax(_tree(0))
    state, jstate = tx.init(params), ref.init(jparams)
    for step in range(30):
        grads = _tree(100 + step)
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        jupdates, jstate = ref.update(_to_jax(grads), jstate, jparams)
        jparams = optax.apply_updates(jparams, jupdates)
    # Adam's fp32 arithmetic runs in a different order from optax's (about 1 ulp per step, measured the same
    # with a constant learning rate), so over 30 steps of lr <= 0.05 the params drift apart by ~1e-5 at most.
    atol = 2e-5 if which == "adamw" else 1e-6
    for k in params:
        np.testing.assert_allclose(params[k].numpy(), np.asarray(jparams[k]), rtol=1e-5, atol=atol, err_msg=k)


def test_compiled_step_with_a_schedule_has_no_graph_break():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tx = gtx.chain(
        gtx.clip_by_global_norm(1.0),
        gtx.adamw(gtx.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=20)),
    )

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return gtx.apply_updates(params, updates), state

    compiled = torch.compile(step, fullgraph=True)  # fullgraph: a graph break would raise
    params, state = _tree(0), tx.init(_tree(0))
    eager_params, eager_state = _tree(0), tx.init(_tree(0))
    for i in range(6):
        grads = _tree(10 + i)
        params, state = compiled(params, grads, state)
        eager_params, eager_state = step(eager_params, grads, eager_state)
    assert sum(counters["graph_break"].values()) == 0
    for k in params:
        torch.testing.assert_close(params[k], eager_params[k], rtol=1e-6, atol=1e-7)


def test_every_schedule_compiles_fullgraph():
    # One compiled function evaluating every case: a graph break in any schedule would raise.
    fns = [getattr(gtx, name)(**kwargs) for name, kwargs in CASES]

    def all_values(count):
        return torch.stack([fn(count) for fn in fns])

    torch._dynamo.reset()
    compiled = torch.compile(all_values, fullgraph=True, dynamic=False)
    for s in (0, 3, 50, 500):
        torch.testing.assert_close(compiled(torch.tensor(s)), all_values(torch.tensor(s)), rtol=1e-6, atol=1e-9)


# --- random arguments ---------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
_values = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, width=32)
_steps = st.integers(min_value=-5, max_value=60)


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)  # the same cases on every run
@hypothesis.given(
    init=_values,
    end=_values,
    power=st.floats(min_value=0.25, max_value=4.0, width=32),
    steps=_steps,
    begin=_steps,
    rate=st.floats(min_value=0.0625, max_value=3.0, width=32),
    staircase=st.booleans(),
    alpha=st.floats(min_value=0.0, max_value=1.0, width=32),
)
def test_random_arguments_match_optax(init, end, power, steps, begin, rate, staircase, alpha):
    cases = [
        (
            "polynomial_schedule",
            {
                "init_value": init,
                "end_value": end,
                "power": power,
                "transition_steps": steps,
                "transition_begin": begin,
            },
        ),
        (
            "exponential_decay",
            {
                "init_value": init,
                "transition_steps": steps,
                "decay_rate": rate,
                "transition_begin": begin,
                "staircase": staircase,
            },
        ),
    ]
    if steps > 0:
        # exponent >= 1: with a fractional power, 1 + cos(pi * t / T) near t = T cancels to a few ulps,
        # and the power amplifies XLA's and ATen's different cos rounding to ~1e-5 relative (measured).
        cosine = {"init_value": init, "decay_steps": steps, "alpha": alpha, "exponent": max(power, 1.0)}
        cases.append(("cosine_decay_schedule", cosine))
    for name, kwargs in cases:
        expected = optax_values(name, kwargs)
        assert_fp32_close(
            gradtx_values(getattr(gtx, name)(**kwargs), as_tensor=True), expected, what=f"{name}({kwargs})"
        )


@pytest.mark.parametrize(
    "build, arg",
    [
        (lambda: gtx.piecewise_constant_schedule(1.0, [(10, 0.1)]), "boundaries_and_scales"),
        (lambda: gtx.piecewise_interpolate_schedule("linear", 1.0, [(10, 0.1)]), "boundaries_and_scales"),
        (lambda: gtx.join_schedules(None, [1]), "schedules"),
        (lambda: gtx.join_schedules([gtx.constant_schedule(1.0)] * 2, 5), "boundaries"),
    ],
)
def test_a_container_argument_of_the_wrong_kind_is_a_type_error_naming_it(build, arg):
    with pytest.raises(TypeError, match=arg):
        build()
