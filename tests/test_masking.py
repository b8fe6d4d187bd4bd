"""masked, partition, weight-decay masks and None leaves, against optax (cases ported from optax's own tests)."""

from __future__ import annotations

import dataclasses

import numpy as np
import optree
import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close, assert_trees_equal

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
jax.config.update("jax_platforms", "cpu")

STEPS = 6


def to_jax(tree):
    return optree.tree_map(lambda t: jnp.asarray(t.numpy()), tree)


def to_torch(tree):
    return optree.tree_map(lambda a: torch.from_numpy(np.array(a)), tree)


def _tree(structure, seed):
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(
        lambda shape: torch.randn(shape, generator=g),
        structure,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x),
    )


NESTED = {"a": (2,), "b": [(3,), (2, 2)], "c": {"d": (4,), "e": [(2, 3), (1,)]}}


def run_both(tx, ref, params, *, steps=STEPS, with_params=True, seed=1, grads_fn=None):
    """Run gradtx and optax side by side on the same grads; compare params (and updates) at every step."""
    state, ref_state = tx.init(params), ref.init(to_jax(params))
    p, rp = params, to_jax(params)
    for i in range(steps):
        g = (
            grads_fn(i)
            if grads_fn is not None
            else optree.tree_map(lambda x, k=i + 1: x * k, _tree_like(params, seed + i))
        )
        if with_params:
            u, state = tx.update(g, state, p)
            ru, ref_state = ref.update(to_jax(g), ref_state, rp)
        else:
            u, state = tx.update(g, state)
            ru, ref_state = ref.update(to_jax(g), ref_state)
        assert_trees_close(u, to_torch(ru), rtol=1e-5, atol=1e-5, msg=f"step {i} updates: ")
        p, rp = gtx.apply_updates(p, u), optax.apply_updates(rp, ru)
        assert_trees_close(p, to_torch(rp), rtol=1e-5, atol=1e-5, msg=f"step {i} params: ")
    return state, ref_state


def _tree_like(tree, seed):
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda t: torch.randn(t.shape, generator=g), tree)


INNERS = {
    "sgd": (lambda: gtx.sgd(0.5), lambda: optax.sgd(0.5)),
    "sgd_momentum": (lambda: gtx.sgd(0.5, momentum=0.9), lambda: optax.sgd(0.5, momentum=0.9)),
    "adam": (lambda: gtx.adam(0.1), lambda: optax.adam(0.1)),
    "decay": (lambda: gtx.add_decayed_weights(0.3), lambda: optax.add_decayed_weights(0.3)),
}


# --- masked -------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("use_fn", [False, True])
@pytest.mark.parametrize("with_params", [True, False])
def test_masked_matches_optax(inner, use_fn, with_params):
    if inner == "decay" and not with_params:
        pytest.skip("add_decayed_weights needs params")
    mask = {"a": True, "b": [False, True], "c": {"d": True, "e": [False, True]}}
    params = _tree(NESTED, 0)
    make, make_ref = INNERS[inner]
    arg = (lambda _: mask) if use_fn else mask
    run_both(gtx.masked(make(), arg), optax.masked(make_ref(), arg), params, with_params=with_params)


@pytest.mark.parametrize(
    "mask",
    [
        {"a": True, "b": False, "c": {"d": False, "e": True}},  # optax's prefix-mask case
        {"a": False, "b": True, "c": True},
        True,  # a single bool covers the whole tree
        False,
        ("not-a-dict-prefix",),
    ],
)
def test_prefix_masks_match_optax(mask):
    params = _tree({"a": (2,), "b": {"f": (3,)}, "c": {"d": (1,), "e": [[(2,), (2,)], (3,)]}}, 0)
    if mask == ("not-a-dict-prefix",):
        with pytest.raises(ValueError, match="mask is not a prefix of the params/updates tree at <root>"):
            gtx.masked(gtx.sgd(1.0), (True,)).init(params)
        return
    for make, make_ref in (INNERS["sgd_momentum"], INNERS["adam"]):
        run_both(gtx.masked(make(), mask), optax.masked(make_ref(), mask), params)


def test_mask_fn_of_the_params_matches_optax():
    params = _tree({"a": (1, 2), "b": [(1,), (1, 2, 3)]}, 0)
    run_both(
        gtx.masked(gtx.add_decayed_weights(0.1), lambda p: optree.tree_map(lambda x: x.ndim > 1, p)),
        optax.masked(optax.add_decayed_weights(0.1), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        params,
    )


def test_nested_masks_match_optax():  # optax issue 271
    params = _tree({f"linear_{i}": {"w": (i, i + 1), "b": (i + 1,)} for i in (1, 2, 3)}, 0)
    inner_mask = {k: {"w": True, "b": True} for k in params}
    inner_mask["linear_2"] = False
    run_both(
        gtx.masked(
            gtx.masked(gtx.sgd(1.0, momentum=0.5), inner_mask), lambda p: optree.tree_map(lambda x: x.ndim > 1, p)
        ),
        optax.masked(
            optax.masked(optax.sgd(1.0, momentum=0.5), inner_mask), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
        ),
        params,
    )


def test_masked_state_holds_none_at_each_leaf_where_optax_holds_a_masked_node():
    params = {"a": [torch.ones(1), (torch.ones(2), torch.ones(3))], "b": {"c": torch.ones(4), "d": torch.ones(5)}}
    tx = gtx.masked(gtx.sgd(1.0, momentum=0.9), {"a": [True, (True, False)], "b": False})
    trace = tx.init(params).inner_state[0].trace
    assert optree.tree_structure(trace, none_is_leaf=True) == optree.tree_structure(
        {"a": [0, (0, None)], "b": {"c": None, "d": None}}, none_is_leaf=True
    )


@dataclasses.dataclass
class _Module:
    """An equinox-style module: callable, and a pytree (registered with optree)."""

    w: object

    def __call__(self, x):
        return self.w * x


# optree's global namespace, the one gradtx flattens with (as equinox registers its modules with jax).
optree.register_pytree_node(
    _Module, lambda m: ((m.w,), None, ("w",)), lambda _, c: _Module(*c), namespace=optree.registry.__GLOBAL_NAMESPACE
)


def test_callable_pytree_is_a_tree_not_a_mask_function():  # optax issue 913
    module = _Module(torch.tensor([1.0, 2.0, 3.0]))
    assert callable(module)
    opt = gtx.masked(gtx.sgd(1.0), _Module(False))
    updates, _ = opt.update(module, opt.init(module))
    assert_trees_equal(updates, module)
    opt = gtx.masked(gtx.sgd(1.0), _Module(True))
    updates, _ = opt.update(module, opt.init(module))
    assert_trees_equal(updates, _Module(-module.w))
    labels = gtx.partition({"x": gtx.scale(2.0)}, _Module("x"))
    assert_trees_equal(labels.update(module, labels.init(module))[0], _Module(2 * module.w))


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_empty_trees(container):
    tx = gtx.masked(gtx.sgd(1.0), container())
    assert tx.update(container(), tx.init(container()))[0] == container()
    tx = gtx.partition({0: gtx.sgd(1.0)}, lambda _: 0)
    assert tx.update(container(), tx.init(container()))[0] == container()


@pytest.mark.parametrize("extra_key_in_mask", [False, True])
@pytest.mark.parametrize("use_fn", [False, True])
def test_tree_mismatch_fails_naming_the_path(extra_key_in_mask, use_fn):
    mask = {"a": True, "b": [False, True], "c": {"d": True, "e": (False, True)}}
    params = {
        "a": torch.ones(1),
        "b": [torch.ones(1), torch.ones(1)],
        "c": {"d": torch.ones(1), "e": (torch.ones(1), torch.ones(1))},
    }
    if extra_key_in_mask:
        mask["c"]["extra"] = True
    else:
        params["c"]["extra"] = torch.ones(1)
    tx = gtx.masked(gtx.sgd(1.0), (lambda _: mask) if use_fn else mask)
    with pytest.raises(ValueError, match=r"mask is not a prefix of the params/updates tree at \['c'\].*extra"):
        tx.init(params)


# --- partition ----------------------------------------------------------------------------------


def _first_letter_labels(tree):
    return {k: _first_letter_labels(v) if isinstance(v, dict) else k[0] for k, v in tree.items()}


@pytest.mark.parametrize("use_fn", [True, False])
@pytest.mark.parametrize("with_params", [True, False])
def test_partition_matches_optax(use_fn, with_params):
    params = _tree({"a1": (2,), "b1": (3,), "z1": {"a2": (2, 2), "z2": {"c1": (4,)}}}, 0)
    txs = {"a": gtx.scale(-1.0), "b": gtx.sgd(0.5, momentum=0.9), "c": gtx.adam(0.1)}
    refs = {"a": optax.scale(-1.0), "b": optax.sgd(0.5, momentum=0.9), "c": optax.adam(0.1)}
    labels = _first_letter_labels if use_fn else _first_letter_labels(params)
    run_both(gtx.partition(txs, labels), optax.partition(refs, labels), params, with_params=with_params)


def test_partition_prefix_labels_over_a_pair_of_subtrees():  # optax's GAN example
    params = (_tree({"w": (3, 2), "b": (2,)}, 0), _tree({"w": (2, 1), "b": (1,)}, 1))
    run_both(
        gtx.partition({"generator": gtx.adam(0.1), "discriminator": gtx.adam(0.5)}, ("generator", "discriminator")),
        optax.partition(
            {"generator": optax.adam(0.1), "discriminator": optax.adam(0.5)}, ("generator", "discriminator")
        ),
        params,
    )


@pytest.mark.parametrize("use_fn", [False, True])
def test_partition_labels_must_have_a_transform(use_fn):
    params = {
        "a": torch.ones(1),
        "b": [torch.ones(1), torch.ones(1)],
        "c": {"d": torch.ones(1), "e": (torch.ones(1), torch.ones(1))},
    }
    label_tree = {"a": 3, "b": [1, 0], "c": 1}  # a prefix of params, with a label (3) that has no transform
    transforms = {0: gtx.sgd(1.0), 1: gtx.adam(1.0), 2: gtx.trace(1.0)}
    if not use_fn:
        with pytest.raises(ValueError, match="label 3 has no transform"):  # a tree is checked when built
            gtx.partition(transforms, label_tree)
        return
    with pytest.raises(ValueError, match=r"label 3 at \['a'\] has no transform; known labels: \[0, 1, 2\]"):
        gtx.partition(transforms, lambda _: label_tree).init(params)


def test_partition_with_prefix_int_labels_matches_optax():
    params = _tree({"a": (1,), "b": [(2,), (3,)], "c": {"d": (2,), "e": [(1,), (2,)]}}, 0)
    labels = {"a": 0, "b": [1, 0], "c": 1}
    run_both(
        gtx.partition({0: gtx.sgd(1.0), 1: gtx.adam(0.1, b1=0.0), 2: gtx.trace(1.0)}, labels),
        optax.partition({0: optax.sgd(1.0), 1: optax.adam(0.1, b1=0.0), 2: optax.trace(1.0)}, labels),
        params,
    )


# --- weight-decay masks ---------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", ["tree", "prefix", "fn"])
def test_adamw_and_add_decayed_weights_masks_match_optax(mask_kind):
    params = _tree({"enc": {"w": (3, 2), "b": (3,)}, "head": {"w": (2, 3), "norm": (2,)}}, 0)
    masks = {
        "tree": {"enc": {"w": True, "b": False}, "head": {"w": True, "norm": False}},
        "prefix": {"enc": True, "head": False},
        "fn": None,
    }
    mask = masks[mask_kind]
    gmask = mask if mask is not None else (lambda p: optree.tree_map(lambda x: x.ndim > 1, p))
    jmask = mask if mask is not None else (lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    run_both(gtx.adamw(0.05, weight_decay=0.5, mask=gmask), optax.adamw(0.05, weight_decay=0.5, mask=jmask), params)
    run_both(gtx.add_decayed_weights(0.5, mask=gmask), optax.add_decayed_weights(0.5, mask=jmask), params)


def test_adamw_default_weight_decay_is_torchs():
    assert gtx.adamw(0.1).spec.weight_decay == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]


# --- None leaves ------------------------------------------------------------------------------


ALL_TRANSFORMS = {
    "sgd": (lambda: gtx.sgd(0.1), lambda: optax.sgd(0.1)),
    "sgd_momentum": (
        lambda: gtx.sgd(0.1, momentum=0.9, nesterov=True),
        lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    ),
    "adam": (lambda: gtx.adam(0.1), lambda: optax.adam(0.1)),
    "adamw": (lambda: gtx.adamw(0.1, weight_decay=0.1), lambda: optax.adamw(0.1, weight_decay=0.1)),
    "clip": (lambda: gtx.clip(0.3), lambda: optax.clip(0.3)),
    "clip_by_global_norm": (lambda: gtx.clip_by_global_norm(1.0), lambda: optax.clip_by_global_norm(1.0)),
    "adaptive_clip": (lambda: gtx.adaptive_clip(0.1), lambda: optax.adaptive_grad_clip(0.1)),
    "add_decayed_weights": (lambda: gtx.add_decayed_weights(0.1), lambda: optax.add_decayed_weights(0.1)),
    "scale_by_adam": (
        lambda: gtx.chain(gtx.scale_by_adam(), gtx.scale(0.1)),
        lambda: optax.chain(optax.scale_by_adam(), optax.scale(0.1)),
    ),
    "trace": (lambda: gtx.trace(0.5), lambda: optax.trace(0.5)),
    "masked": (
        lambda: gtx.masked(gtx.adam(0.1), {"a": True, "n": False, "z": {"b": False, "m": True}}),
        lambda: optax.masked(optax.adam(0.1), {"a": True, "n": False, "z": {"b": False, "m": True}}),
    ),
    "partition": (
        lambda: gtx.partition({"x": gtx.adam(0.1), "y": gtx.sgd(0.1)}, {"a": "x", "n": "y", "z": "y"}),
        lambda: optax.partition({"x": optax.adam(0.1), "y": optax.sgd(0.1)}, {"a": "x", "n": "y", "z": "y"}),
    ),
    "apply_if_finite": (
        lambda: gtx.apply_if_finite(gtx.adam(0.1), 2),
        lambda: optax.apply_if_finite(optax.adam(0.1), 2),
    ),
    "chain": (
        lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(0.1)),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1, weight_decay=0.01)),
    ),
    "lion": (lambda: gtx.lion(0.1), lambda: optax.lion(0.1)),
    "ema": (lambda: gtx.ema(0.9), lambda: optax.ema(0.9)),
    "schedule_free_adamw": (
        lambda: gtx.schedule_free_adamw(0.1, warmup_steps=2),
        lambda: optax.contrib.schedule_free_adamw(0.1, warmup_steps=2),
    ),
    "schedule_free_sgd": (
        lambda: gtx.schedule_free_sgd(0.1, warmup_steps=2),
        lambda: optax.contrib.schedule_free_sgd(0.1, warmup_steps=2),
    ),
}


@pytest.mark.parametrize("name", sorted(ALL_TRANSFORMS))
def test_none_params_and_grads_pass_through_as_in_optax(name):
    # 1-d leaves only, so AGC's units are the same in both layouts.
    torch.manual_seed(0)
    params = {"a": torch.randn(3), "n": None, "z": {"b": torch.randn(2), "m": None}}
    make, make_ref = ALL_TRANSFORMS[name]

    def grads(i):
        g = _tree_like(params, 10 + i)
        return optree.tree_map(lambda x: x * 3, g)

    run_both(make(), make_ref(), params, grads_fn=grads)
    u, _ = make().update(grads(0), make().init(params), params)
    assert u["n"] is None and u["z"]["m"] is None


@pytest.mark.parametrize("name", sorted(ALL_TRANSFORMS))
def test_a_param_without_a_gradient_is_left_alone(name):
    """A None grad where the params hold a tensor: that param, and its state, are untouched (torch.optim skips it)."""
    torch.manual_seed(0)
    params = {"a": torch.randn(3), "n": torch.randn(2), "z": {"b": torch.randn(2), "m": torch.randn(4)}}
    tx = ALL_TRANSFORMS[name][0]()
    state = tx.init(params)
    for i in range(3):
        g = _tree_like(params, i)
        g_none = {**g, "n": None, "z": {**g["z"], "m": None}}
        full_updates, _ = tx.update(g, state, params)
        updates, new_state = tx.update(g_none, state, params)
        assert updates["n"] is None and updates["z"]["m"] is None
        # Where a grad is given, the update is what the full tree gives, except through a global norm.
        if name not in ("clip_by_global_norm", "chain"):
            assert_trees_equal(updates["a"], full_updates["a"])
        new_params = gtx.apply_updates(params, updates)
        assert new_params["n"] is params["n"] and new_params["z"]["m"] is params["z"]["m"]
        # The state of the absent leaves did not move.
        before, after = optree.tree_leaves(state), optree.tree_leaves(new_state)
        paths = optree.tree_paths(state)
        for path, b, a in zip(paths, before, after):
            if any(k in ("n", "m") for k in path if isinstance(k, str)):
                assert_trees_equal(a, b)
        params, state = new_params, new_state


@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.9, False, 0.1), (0.9, True, 0.0)])
def test_intermittent_none_grads_match_torch_sgd(momentum, nesterov, wd):
    torch.manual_seed(0)
    params = {"a": torch.randn(3), "b": torch.randn(2, 2)}
    ref = [params["a"].clone().requires_grad_(), params["b"].clone().requires_grad_()]
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    tx = gtx.sgd(0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    state = tx.init(params)
    for i in range(8):
        g = _tree_like(params, i)
        if i % 3 == 1:
            g["b"] = None
        for p, gg in zip(ref, (g["a"], g["b"])):
            p.grad = None if gg is None else gg.clone()
        ref_opt.step()
        updates, state = tx.update(g, state, params)
        params = gtx.apply_updates(params, updates)
        assert_trees_close(params, {"a": ref[0].detach(), "b": ref[1].detach()}, rtol=1e-6, atol=1e-7)


def test_adam_with_a_param_that_never_gets_a_gradient_matches_torch():
    torch.manual_seed(0)
    params = {"used": torch.randn(3), "unused": torch.randn(2)}
    ref = [params["used"].clone().requires_grad_(), params["unused"].clone().requires_grad_()]
    ref_opt = torch.optim.AdamW(ref, lr=0.01)
    tx = gtx.adamw(0.01)
    state = tx.init(params)
    for i in range(5):
        g = {"used": torch.randn(3), "unused": None}
        ref[0].grad = g["used"].clone()
        ref_opt.step()
        params, state = gtx.update_and_apply(tx, g, state, params)
    assert_trees_close(params, {"used": ref[0].detach(), "unused": ref[1].detach()}, rtol=1e-6, atol=1e-7)
    assert_trees_equal(state[0].mu["unused"], torch.zeros(2))


def test_accumulate_with_none_grads():
    params = {"a": torch.randn(3), "n": torch.randn(2)}
    tx = gtx.chain(gtx.accumulate(2), gtx.sgd(1.0))
    state = tx.init(params)
    g1, g2 = {"a": torch.ones(3), "n": None}, {"a": 3 * torch.ones(3), "n": None}
    u, state = tx.update(g1, state, params)
    assert u is None
    u, state = tx.update(g2, state, params)
    assert_trees_close(u["a"], -2 * torch.ones(3)) and u["n"] is None
    with pytest.raises(ValueError, match=r"\['n'\]"):  # the pattern of None must hold across a window
        tx.update({"a": torch.ones(3), "n": torch.ones(2)}, tx.update(g1, state, params)[1], params)


# --- structure checks, construction checks, other transforms' states --------------------


def test_masked_and_partition_check_updates_against_the_params():
    params = {"w": torch.ones(2), "b": torch.ones(2), "norm": torch.ones(2)}
    grads = {"w": torch.ones(2), "norm": torch.ones(2)}  # "b" is missing: never route leaves by position
    for tx in (
        gtx.masked(gtx.sgd(1.0), {"w": True, "b": False, "norm": True}),
        gtx.partition({"x": gtx.sgd(1.0), "y": gtx.adam(1.0)}, {"w": "x", "b": "y", "norm": "x"}),
    ):
        state = tx.init(params)
        with pytest.raises(ValueError, match=r"updates does not match params at \['b'\]: missing"):
            tx.update(grads, state, params)
        with pytest.raises(ValueError, match=r"\['extra'\]: unexpected"):
            tx.update({**params, "extra": torch.ones(1)}, state, params)
        with pytest.raises(ValueError, match=r"\['w'\]: expected shape \(2,\), got \(3,\)"):
            tx.update({**params, "w": torch.ones(3)}, state, params)


def test_combinators_are_checked_when_built():
    with pytest.raises(TypeError, match="masked: inner must be a GradientTransformation, got str"):
        gtx.masked("x", {"w": True})
    with pytest.raises(TypeError, match="masked: mask must be a tree of bools or a function of the params, got a str"):
        gtx.masked(gtx.sgd(1.0), "x")
    with pytest.raises(TypeError, match="masked: mask must be a tree of bools.*int"):
        gtx.masked(gtx.sgd(1.0), {"w": 1})
    functions = {"w": lambda p: True, "b": lambda p: False}  # a tree of functions: neither a function nor a mask
    with pytest.raises(TypeError, match="masked: mask must be a tree of bools.*function leaf"):
        gtx.masked(gtx.sgd(1.0), functions)
    with pytest.raises(TypeError, match="freeze: mask must be a bool or a tree of bools.*function leaf"):
        gtx.freeze(functions)
    with pytest.raises(TypeError, match="selective_transform: freeze_mask must be .*function leaf"):
        gtx.selective_transform(gtx.sgd(1.0), freeze_mask=functions)
    with pytest.raises(TypeError, match=r"partition: transforms\['a'\] is a str"):
        gtx.partition({"a": "x"}, "a")
    with pytest.raises(TypeError, match="partition: transforms must be a mapping"):
        gtx.partition([gtx.sgd(1.0)], "a")
    with pytest.raises(TypeError, match=r"mask leaves must be bools, got int for \['w'\]"):
        gtx.masked(gtx.sgd(1.0), lambda p: {"w": 1}).init({"w": torch.ones(1)})


@pytest.mark.parametrize("make", [lambda: gtx.clip(1.0), lambda: gtx.adaptive_clip(0.1)])
def test_clips_refuse_another_transforms_state(make):
    params = {"w": torch.ones(2, 2)}
    with pytest.raises(TypeError, match="expected state of type EmptyState, got ScaleByAdamState"):
        make().update(params, gtx.scale_by_adam().init(params), params)
    with pytest.raises(ValueError, match="state is None; call init"):  # as every transform refuses it
        make().update(params, None, params)


def test_masked_and_partition_are_pure_with_none_grads():
    params = {"a": torch.randn(3), "n": torch.randn(2), "z": {"b": torch.randn(2), "m": torch.randn(4)}}
    grads = {"a": torch.randn(3), "n": None, "z": {"b": torch.randn(2), "m": torch.randn(4)}}
    for name in ("masked", "partition"):
        assert_pure(ALL_TRANSFORMS[name][0](), grads, params, steps=3)


def test_prefix_labels_over_the_wrappers_param_groups_match_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ref_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ref_model.load_state_dict(model.state_dict())

    def groups(m):
        return [{"params": list(m[0].parameters())}, {"params": list(m[1].parameters())}]

    # One label per param group: the wrapper's tree is [[group 0 params], [group 1 params]].
    tx = gtx.partition({"clipped": gtx.clip_by_global_norm(0.1), "free": gtx.identity()}, ["clipped", "free"])
    opt = gtx.TransformedOptimizer(torch.optim.SGD(groups(model), lr=0.1), tx)
    ref_opt = torch.optim.SGD(groups(ref_model), lr=0.1)
    for _ in range(3):
        x = torch.randn(5, 4)
        for m in (model, ref_model):
            m.zero_grad()
            m(x).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(ref_model[0].parameters(), 0.1)
        opt.step()
        ref_opt.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_mesh_groups_plans_count_a_param_without_a_gradient_as_zeros():
    from gradtx.comm import LocalComm

    torch.manual_seed(0)
    params = {"a": torch.randn(3, 2), "n": torch.randn(4, 2), "b": torch.randn(2)}
    grads = {"a": torch.randn(3, 2), "n": None, "b": torch.randn(2)}
    plan = gtx.mesh_groups(params, comm=LocalComm(), sharded={"a": gtx.Sharded("tp", dim=1)})
    zeros = {**grads, "n": torch.zeros(4, 2)}
    for make in (
        lambda p: gtx.clip_by_global_norm(0.5, mesh_groups=p),
        lambda p: gtx.adaptive_clip(0.05, mesh_groups=p),
    ):
        tx, ref = make(plan), make(None)
        u, _ = tx.update(grads, tx.init(params), params)
        r, _ = ref.update(zeros, ref.init(params), params)
        assert u["n"] is None
        assert_trees_close({k: u[k] for k in ("a", "b")}, {k: r[k] for k in ("a", "b")}, rtol=1e-6)


@pytest.mark.parametrize("name", ["sam", "sam_opaque", "lookahead"])
def test_sam_and_lookahead_leave_a_param_without_a_gradient_alone(name):
    """As every transform: a None update stays None, and the other leaves get what the tree without it gets."""
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    if name == "sam":
        make = lambda: gtx.sam(gtx.adam(0.1), gtx.scale(0.05), sync_period=2)
    elif name == "sam_opaque":
        make = lambda: gtx.sam(gtx.adam(0.1), gtx.scale(0.05), sync_period=2, opaque_mode=True)
    else:
        make = lambda: gtx.lookahead(gtx.adam(0.1), sync_period=2, slow_step_size=0.5)
    wrap = gtx.LookaheadParams.init_synced if name == "lookahead" else (lambda p: p)
    one = {"w": params["w"]}  # the same run on the tree without "b"
    tx, ref = make(), make()
    p, rp = wrap(params), wrap(one)
    state, ref_state = tx.init(p), ref.init(rp)
    for i in range(4):
        g = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(i)), "b": None}
        extra = {"grad_fn": lambda q, j: {"w": q["w"] * 0.5, "b": None}} if name == "sam_opaque" else {}
        ref_extra = {"grad_fn": lambda q, j: {"w": q["w"] * 0.5}} if name == "sam_opaque" else {}
        u, state = tx.update(g, state, p, **extra)
        ru, ref_state = ref.update({"w": g["w"]}, ref_state, rp, **ref_extra)
        for got, want in ([u.fast, ru.fast], [u.slow, ru.slow]) if name == "lookahead" else ([u, ru],):
            assert got["b"] is None
            assert_trees_equal(got["w"], want["w"])
        p, rp = gtx.apply_updates(p, u), gtx.apply_updates(rp, ru)
