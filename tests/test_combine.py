"""chain, named_chain, masked, partition, apply_updates, identity, and metrics."""

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal


def recorder(name, log, factor=1.0):
    """A transform that multiplies by ``factor`` and logs the extras it saw."""

    def update(updates, state, params=None, **extra):
        log.append((name, dict(extra)))
        return {k: v * factor for k, v in updates.items()}, state + 1

    return gtx.GradientTransformation(lambda p: torch.zeros((), dtype=torch.int64), update)


def test_chain_applies_in_order_and_forwards_extras_to_every_member():
    log = []
    tx = gtx.chain(recorder("a", log, 2.0), recorder("b", log, 3.0))
    state = tx.init({"w": torch.ones(1)})
    out, state = tx.update({"w": torch.ones(1)}, state, tokens=5, anything="x")
    assert float(out["w"]) == 6.0
    assert [n for n, _ in log] == ["a", "b"]
    assert all(e == {"tokens": 5, "anything": "x"} for _, e in log)
    assert tuple(int(s) for s in state) == (1, 1)


def test_members_ignore_extras_they_do_not_use():
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.sgd(0.1))
    params = {"w": torch.ones(3)}
    out, _ = tx.update({"w": torch.ones(3)}, tx.init(params), params, tokens=7, flush=True, unknown=1)
    ref, _ = tx.update({"w": torch.ones(3)}, tx.init(params), params)
    assert_trees_equal(out, ref)


def test_named_chain_state_is_keyed_by_name():
    tx = gtx.named_chain(("clip", gtx.clip_by_global_norm(1.0)), ("opt", gtx.sgd(1.0)))
    params = {"w": torch.tensor([3.0, 4.0])}
    out, state = tx.update(params, tx.init(params), params)
    assert set(state) == {"clip", "opt"}
    assert float(state["clip"].grad_norm) == pytest.approx(5.0)
    assert_trees_close(out, {"w": torch.tensor([-0.6, -0.8])}, rtol=1e-5)
    with pytest.raises(ValueError, match="unique"):
        gtx.named_chain(("a", gtx.identity()), ("a", gtx.identity()))


def test_chain_rejects_wrong_state():
    tx = gtx.chain(gtx.identity(), gtx.identity())
    with pytest.raises(ValueError, match="call init"):
        tx.update({"w": torch.ones(1)}, None)
    with pytest.raises(ValueError, match="2 member states"):
        tx.update({"w": torch.ones(1)}, (gtx.EmptyState(),))
    with pytest.raises(TypeError, match="argument 1"):
        gtx.chain(gtx.identity(), "not a transform")


def test_masked_applies_only_to_masked_leaves_and_names_user_paths():
    params = {"w": torch.ones(2), "norm": {"scale": torch.ones(2)}}
    mask = {"w": True, "norm": {"scale": False}}
    tx = gtx.masked(gtx.add_decayed_weights(0.5), mask)
    out, state = tx.update({"w": torch.zeros(2), "norm": {"scale": torch.zeros(2)}}, tx.init(params), params)
    assert_trees_equal(out, {"w": torch.full((2,), 0.5), "norm": {"scale": torch.zeros(2)}})
    callable_mask = gtx.masked(gtx.add_decayed_weights(0.5), lambda p: {"w": True, "norm": {"scale": False}})
    out2, _ = callable_mask.update({"w": torch.zeros(2), "norm": {"scale": torch.zeros(2)}}, state, params)
    assert_trees_equal(out2, out)
    with pytest.raises(
        ValueError, match=r"mask is not a prefix of the params/updates tree at <root>.*extra key\(s\): \['norm'\]"
    ):
        gtx.masked(gtx.identity(), {"w": True}).init(params)


def test_masked_inner_sees_the_user_tree_with_none_at_masked_out_leaves():
    seen = []

    def update(updates, state, params=None, **extra):
        seen.append((updates, params))
        return updates, state

    inits = []
    inner = gtx.GradientTransformation(lambda p: inits.append(p) or gtx.EmptyState(), update)
    tx = gtx.masked(inner, {"a": True, "b": False})
    one = {"a": torch.ones(1), "b": torch.ones(1)}
    tx.update(one, tx.init(one), one)
    assert inits == [{"a": one["a"], "b": None}]
    assert seen[0][0] == {"a": one["a"], "b": None} and seen[0][1] == {"a": one["a"], "b": None}


def test_partition_routes_labels_to_their_transforms():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    labels = {"w": "decay", "b": "no_decay"}
    tx = gtx.partition({"decay": gtx.sgd(1.0, weight_decay=0.5), "no_decay": gtx.sgd(1.0)}, labels)
    grads = {"w": torch.ones(2), "b": torch.ones(2)}
    out, state = tx.update(grads, tx.init(params), params)
    assert_trees_close(out, {"w": torch.full((2,), -1.5), "b": torch.full((2,), -1.0)})
    assert set(state.inner_states) == {"decay", "no_decay"}
    with pytest.raises(ValueError, match=r"'no_decay' has no transform"):  # a labels tree is checked when built
        gtx.partition({"decay": gtx.identity()}, labels)
    bad = gtx.partition({"decay": gtx.identity()}, lambda p: labels)
    with pytest.raises(ValueError, match=r"'no_decay' at \['b'\]"):
        bad.init(params)


def test_partition_with_callable_labels_matches_explicit_labels():
    params = {"layer.weight": torch.randn(3), "layer.bias": torch.randn(3)}
    grads = {k: torch.randn(3) for k in params}

    def label_fn(p):
        return {k: "bias" if k.endswith("bias") else "weight" for k in p}

    txs = {"bias": gtx.adam(0.1), "weight": gtx.adamw(0.1)}
    a = gtx.partition(txs, label_fn)
    b = gtx.partition(txs, label_fn(params))
    assert_trees_equal(a.update(grads, a.init(params), params)[0], b.update(grads, b.init(params), params)[0])


def test_inner_hold_inside_masked_is_an_error():
    tx = gtx.masked(gtx.accumulate(2), {"w": True})
    with pytest.raises(ValueError, match="outer chain"):
        tx.update({"w": torch.ones(1)}, tx.init({"w": torch.ones(1)}))


def test_apply_updates_is_pure_and_keeps_param_dtype():
    params = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    updates = {"w": torch.full((3,), 0.5), "b": torch.ones(2)}
    new = gtx.apply_updates(params, updates)
    assert new["w"].dtype == torch.bfloat16 and float(new["w"][0]) == 1.5
    assert_trees_equal(params, {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2)})
    assert gtx.apply_updates(params, None) is params
    with pytest.raises(ValueError, match=r"\['c'\]"):
        gtx.apply_updates(params, {"w": torch.ones(3), "c": torch.ones(2)})


def test_identity_and_global_norm():
    tx = gtx.identity()
    g = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0], dtype=torch.bfloat16)}
    assert tx.update(g, tx.init(g))[0] is g
    n = gtx.global_norm(g)
    assert n.dtype == torch.float32 and float(n) == 5.0
    assert float(gtx.global_norm(g, norm_type=float("inf"))) == 4.0
    assert float(gtx.global_norm(g, norm_type=1)) == 7.0


def test_a_member_that_is_not_scalar_sees_the_scalar_members_before_it_applied():
    g = {"w": torch.tensor([3.0, 4.0])}
    seen = []

    def update(updates, state, params=None, **extra):
        seen.append(updates["w"].clone())
        return updates, state

    plain = gtx.GradientTransformation(lambda p: gtx.EmptyState(), update)
    tx = gtx.chain(gtx.scale(0.5), plain, gtx.scale(2.0))
    updates, _ = tx.update(g, tx.init(g))
    assert_trees_equal(seen[0], torch.tensor([1.5, 2.0]))  # the 0.5 was applied before `plain`
    assert_trees_equal(updates, {"w": torch.tensor([3.0, 4.0])})


def test_metrics_collects_named_scalars_from_nested_states():
    tx = gtx.chain(gtx.accumulate(1), gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.sgd(0.1)), 3))
    params = {"w": torch.ones(2)}
    _, state = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(params), params)
    m = gtx.metrics(state)
    assert {"grad_norm", "clip_coef", "micro_step", "tokens", "skipped"} <= set(m)
    assert float(m["grad_norm"]) == pytest.approx(5.0)
    assert int(m["skipped"]) == 0


def test_chain_state_round_trips_through_torch_save_with_weights_only(tmp_path):
    params = {"w": torch.randn(3), "b": torch.randn(2)}
    tx = gtx.chain(
        gtx.accumulate(2, token_weighted=True),
        gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(0.1)), 3),
        gtx.masked(gtx.trace(0.9), {"w": True, "b": False}),
        gtx.partition({"a": gtx.scale_by_learning_rate(lambda c: 0.1), "b": gtx.identity()}, {"w": "a", "b": "b"}),
    )
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({k: torch.ones_like(v) for k, v in params.items()}, state, params, tokens=4)
    torch.save(state, tmp_path / "state.pt")
    restored = torch.load(tmp_path / "state.pt")  # weights_only=True, torch's default
    assert_trees_equal(restored, state)
    g = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    assert_trees_equal(tx.update(g, restored, params, tokens=3), tx.update(g, state, params, tokens=3))


def test_metrics_star_exports_every_item_of_a_dict_field_by_its_key():
    from typing import NamedTuple

    @gtx.export_metrics(("values", "*"), ("n", "count"))
    class DictState(NamedTuple):
        values: dict
        n: torch.Tensor

    lr, wd = torch.tensor(0.1), torch.tensor(0.01)
    state = (
        DictState({"learning_rate": lr, "weight_decay": wd}, torch.tensor(3)),
        DictState({"learning_rate": torch.tensor(9.0)}, torch.tensor(4)),
    )
    found = gtx.metrics(state)
    assert found["learning_rate"] is lr and found["weight_decay"] is wd  # the first member in chain order wins
    assert int(found["count"]) == 3 and "*" not in found


@pytest.mark.parametrize("bad", ["b", ("b",), ("b", gtx.identity(), 1), (1, gtx.identity()), ("b", "tx")])
def test_named_chain_names_a_malformed_pair(bad):
    with pytest.raises(TypeError, match=r"named_chain: argument 1 must be a .*pair.*docs/chaining.md"):
        gtx.named_chain(("a", gtx.identity()), bad)


@pytest.mark.parametrize("updates", [{"w": None, "b": None}, {}], ids=["every-update-none", "empty"])
def test_an_update_with_no_tensor_leaves_the_params_as_they_are(updates):
    """A ``None`` update leaves its param as it is, also when no param has one (torch's foreach refuses [])."""
    params = {"w": torch.ones(3), "b": torch.ones(2)} if updates else {}
    out = gtx.apply_updates(params, updates)
    assert out.keys() == params.keys() and all(out[k] is params[k] for k in params)
    clipped, _ = gtx.clip(0.1).update(updates, gtx.clip(0.1).init(params))
    assert clipped == updates
    if not params:
        return
    masked = gtx.masked(gtx.clip(0.1), {"w": True, "b": False})
    grads = {"w": None, "b": torch.full((2,), 5.0)}
    assert torch.equal(masked.update(grads, masked.init(params), params)[0]["b"], grads["b"])
