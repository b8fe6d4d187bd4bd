"""apply_if_finite: skipping, untouched inner state, counting, and the consecutive-error limit."""

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_trees_equal


def _setup():
    params = {"w": torch.ones(3)}
    tx = gtx.apply_if_finite(gtx.adam(0.1), max_consecutive_errors=2)
    return params, tx, tx.init(params)


def test_finite_updates_pass_through_to_inner():
    params, tx, state = _setup()
    inner = gtx.adam(0.1)
    g = {"w": torch.tensor([1.0, -2.0, 3.0])}
    out, state = tx.update(g, state, params)
    ref, ref_state = inner.update(g, inner.init(params), params)
    assert_trees_equal(out, ref)
    assert_trees_equal(state.inner_state, ref_state)
    assert not bool(state.skipped) and int(state.total_skipped) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_step_is_skipped_with_inner_state_untouched(bad):
    params, tx, state = _setup()
    _, state = tx.update({"w": torch.ones(3)}, state, params)
    before = state.inner_state
    out, state = tx.update({"w": torch.tensor([1.0, bad, 0.0])}, state, params)
    assert_trees_equal(out, {"w": torch.zeros(3)})
    assert_trees_equal(state.inner_state, before)
    assert bool(state.skipped) and not bool(state.last_finite)
    assert int(state.notfinite_count) == 1 and int(state.total_skipped) == 1
    assert_trees_equal(gtx.apply_updates(params, out), params)


def test_after_max_consecutive_errors_the_update_is_applied():
    params, tx, state = _setup()
    nan = {"w": torch.full((3,), float("nan"))}
    skipped = []
    for _ in range(4):
        out, state = tx.update(nan, state, params)
        skipped.append(bool(state.skipped))
    # 2 skips allowed in a row; the 3rd consecutive bad step goes through (as optax), so it fails loudly.
    assert skipped == [True, True, False, False]
    assert bool(torch.isnan(out["w"]).all())
    out, state = tx.update({"w": torch.ones(3)}, state, params)
    assert int(state.notfinite_count) == 0 and int(state.total_skipped) == 2


def test_bf16_and_mixed_trees():
    params = {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(2)}
    tx = gtx.apply_if_finite(gtx.sgd(0.1), 1)
    g = {"a": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16), "b": torch.ones(2)}
    out, state = tx.update(g, tx.init(params), params)
    assert bool(state.skipped)
    assert out["a"].dtype == torch.bfloat16 and float(out["a"].abs().sum()) == 0.0


@pytest.mark.parametrize("bad, err", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_max_consecutive_errors(bad, err):
    with pytest.raises(err, match="max_consecutive_errors"):
        gtx.apply_if_finite(gtx.identity(), bad)


def test_accumulate_inside_is_rejected_with_advice():
    tx = gtx.apply_if_finite(gtx.accumulate(2), 1)
    with pytest.raises(ValueError, match="before it"):
        tx.update({"w": torch.ones(1)}, tx.init({"w": torch.ones(1)}))
