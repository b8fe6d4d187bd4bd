"""clip, clip_by_global_norm and adaptive_clip against torch.nn.utils and hand-worked numbers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal


def random_tree(seed: int, dtypes=(torch.float32,)):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3,), (4, 5), (2, 3, 4), (), (7, 1)]
    return {
        f"p{i}": (torch.randn(shape, generator=g) * (i + 1)).to(dtypes[i % len(dtypes)])
        for i, shape in enumerate(shapes)
    }


def torch_clipped(tree, max_norm, norm_type):
    copies = [t.clone().requires_grad_(False) for t in tree.values()]
    params = [torch.nn.Parameter(torch.zeros_like(c, dtype=torch.float32).to(c.dtype)) for c in copies]
    for p, c in zip(params, copies):
        p.grad = c
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=True)
    return norm, dict(zip(tree, (p.grad for p in params)))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("seed", [0, 1])
def test_clip_by_global_norm_matches_torch_fp32(norm_type, max_norm, seed):
    grads = random_tree(seed)
    tx = gtx.clip_by_global_norm(max_norm, norm_type=norm_type)
    out, state = tx.update(grads, tx.init(grads))
    ref_norm, ref = torch_clipped(grads, max_norm, norm_type)
    torch.testing.assert_close(state.grad_norm, ref_norm, rtol=1e-6, atol=0)
    assert_trees_close(out, ref, rtol=1e-6)
    assert state.grad_norm.dtype == torch.float32


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_by_global_norm_mixed_dtypes_accumulates_fp32_and_keeps_dtypes(norm_type):
    grads = random_tree(3, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    tx = gtx.clip_by_global_norm(1.0, norm_type=norm_type)
    out, state = tx.update(grads, tx.init(grads))
    # Reference: the exact norm of the fp32 upcast, then torch's own clip on the original dtypes.
    exact = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads.values()]), norm_type)
    torch.testing.assert_close(state.grad_norm, exact, rtol=1e-6, atol=0)
    ref_norm, ref = torch_clipped(grads, 1.0, norm_type)
    torch.testing.assert_close(state.grad_norm, ref_norm.float(), rtol=1e-2, atol=0)  # torch rounds per-dtype norms
    for k in grads:
        assert out[k].dtype == grads[k].dtype
        torch.testing.assert_close(out[k], ref[k], rtol=1e-2, atol=1e-3)


def test_clip_by_global_norm_bf16_norm_is_fp32_exact_where_bf16_would_overflow_precision():
    # 4096 elements of 1/64 in bf16: the true norm is 1.0; a bf16 running sum of squares loses it.
    g = {"w": torch.full((4096,), 1 / 64, dtype=torch.bfloat16)}
    tx = gtx.clip_by_global_norm(10.0)
    _, state = tx.update(g, tx.init(g))
    assert state.grad_norm.dtype == torch.float32
    assert float(state.grad_norm) == pytest.approx(1.0, rel=1e-6)


def test_clip_by_value_matches_torch():
    grads = random_tree(4)
    tx = gtx.clip(0.7)
    out, _ = tx.update(grads, tx.init(grads))
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads.values()]
    for p, t in zip(params, grads.values()):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_value_(params, 0.7)
    assert_trees_equal(out, dict(zip(grads, (p.grad for p in params))))


def test_clip_by_value_mixed_dtypes_matches_torch():
    grads = random_tree(5, dtypes=(torch.float32, torch.bfloat16))
    out, _ = gtx.clip(0.3).update(grads, gtx.EmptyState())
    for k, g in grads.items():
        assert_trees_equal(out[k], g.clamp(-0.3, 0.3))


def test_clip_by_global_norm_keeps_pre_clip_norm_and_coef_in_state_and_metrics():
    g = {"a": torch.tensor([3.0, 4.0])}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0))
    out, state = tx.update(g, tx.init(g))
    m = gtx.metrics(state)
    assert float(m["grad_norm"]) == pytest.approx(5.0)
    assert float(m["clip_coef"]) == pytest.approx(1.0 / (5.0 + 1e-6))
    torch.testing.assert_close(out["a"], torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)


def test_clip_by_global_norm_exposed_factor_equals_pure_path():
    grads = random_tree(6)
    tx = gtx.clip_by_global_norm(0.5)
    pure, _ = tx.update(grads, tx.init(grads))
    factor, _ = tx.factor(grads, tx.init(grads))
    assert_trees_close({k: v * factor for k, v in grads.items()}, pure, rtol=1e-6)
    # A pending scale on the updates: the clip sees the true updates, grads * 4.
    factor4, state4 = tx.factor(grads, tx.init(grads), scale=torch.tensor(4.0))
    true_norm = gtx.global_norm(grads) * 4.0
    torch.testing.assert_close(state4.grad_norm, true_norm)
    torch.testing.assert_close(factor4, torch.clamp(0.5 / (true_norm + 1e-6), max=1.0))


# --- hypothesis properties ---------------------------------------------------------------

tensors = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5), st.floats(0.01, 100.0)), min_size=1, max_size=4)


def _tree_from(spec, seed):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(a, b, generator=g) * s for i, (a, b, s) in enumerate(spec)}


@settings(max_examples=60, deadline=None)
@given(spec=tensors, seed=st.integers(0, 2**16), max_norm=st.floats(0.01, 50.0))
def test_property_clip_preserves_direction_and_bounds_norm(spec, seed, max_norm):
    grads = _tree_from(spec, seed)
    tx = gtx.clip_by_global_norm(max_norm)
    out, state = tx.update(grads, tx.init(grads))
    flat_in = torch.cat([g.flatten() for g in grads.values()])
    flat_out = torch.cat([g.flatten() for g in out.values()])
    assert float(torch.linalg.vector_norm(flat_out)) <= max_norm * (1 + 1e-5) or torch.equal(flat_in, flat_out)
    cos = torch.nn.functional.cosine_similarity(flat_in, flat_out, dim=0)
    assert float(cos) == pytest.approx(1.0, abs=1e-5)
    coef = float(state.clip_coef)
    assert 0 < coef <= 1.0


@settings(max_examples=60, deadline=None)
@given(spec=tensors, seed=st.integers(0, 2**16), clipping=st.floats(0.001, 2.0), unitwise=st.booleans())
def test_property_agc_bounds_every_unit(spec, seed, clipping, unitwise):
    grads = _tree_from(spec, seed)
    params = _tree_from(spec, seed + 1)
    eps = 1e-3
    tx = gtx.adaptive_clip(clipping, eps=eps, unitwise=unitwise)
    out, _ = tx.update(grads, tx.init(params), params)
    for k in grads:
        w, g = params[k], out[k]
        if unitwise:
            w_norm, g_norm = w.norm(dim=1), g.norm(dim=1)
        else:
            w_norm, g_norm = w.norm().reshape(1), g.norm().reshape(1)
        bound = clipping * torch.clamp(w_norm, min=eps)
        assert bool((g_norm <= bound * (1 + 1e-5) + 1e-7).all())
        # Units that were already small are untouched.
        small = (grads[k].norm(dim=1) if unitwise else grads[k].norm().reshape(1)) <= bound
        rows = grads[k] if unitwise else grads[k].reshape(1, -1)
        kept = g if unitwise else g.reshape(1, -1)
        assert torch.equal(kept[small], rows[small])


# --- AGC by hand -----------------------------------------------------------------------


def test_agc_hand_worked_rows():
    g = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    p = {"w": torch.ones(2, 2)}
    out, _ = gtx.adaptive_clip(1.0).update(g, gtx.EmptyState(), p)
    expected = torch.tensor([[0.6325, 1.2649], [0.8485, 1.1314]])
    torch.testing.assert_close(out["w"], expected, rtol=0, atol=1e-4)


def test_agc_units_are_output_rows_for_linear_and_conv():
    lin = torch.nn.Linear(3, 2)  # weight (out=2, in=3)
    conv = torch.nn.Conv2d(2, 4, 3)  # weight (out=4, in=2, 3, 3)
    for w in (lin.weight, conv.weight):
        norms = gtx.unitwise_norm(w.detach())
        assert norms.shape == (w.shape[0],) + (1,) * (w.ndim - 1)
        torch.testing.assert_close(norms.flatten(), w.detach().flatten(1).norm(dim=1))
    bias_norm = gtx.unitwise_norm(lin.bias.detach())
    assert bias_norm.shape == ()


def test_agc_per_tensor_and_eps_floor():
    g = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([1.0, 1.0])}
    p = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    out, _ = gtx.adaptive_clip(1.0, unitwise=False, eps=0.5).update(g, gtx.EmptyState(), p)
    # Whole tensor: ||g|| = sqrt(30) > ||w|| = 2, so g is scaled to norm 2.
    torch.testing.assert_close(out["w"].norm(), torch.tensor(2.0))
    # Zero weights: the floor eps=0.5 gives a bound of 0.5.
    torch.testing.assert_close(out["b"].norm(), torch.tensor(0.5))


def test_agc_keeps_dtype_and_needs_params():
    g = {"w": torch.randn(4, 3, dtype=torch.bfloat16)}
    out, _ = gtx.adaptive_clip(0.01).update(g, gtx.EmptyState(), {"w": torch.randn(4, 3)})
    assert out["w"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="adaptive_clip: update\\(\\) needs params"):
        gtx.adaptive_clip(0.01).update(g, gtx.EmptyState())
    with pytest.raises(ValueError, match=r"\['w'\]"):
        gtx.adaptive_clip(0.01).update(g, gtx.EmptyState(), {"w": torch.randn(3, 4)})


def test_agc_reads_a_tensor_clipping_in_its_own_precision():
    """fp64 params with an fp64 tensor threshold (inject_hyperparams makes one) clip as with the Python number."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64, generator=g)}
    grads = {"w": 10 * torch.randn(4, 3, dtype=torch.float64, generator=g)}  # every row clipped
    want, _ = gtx.adaptive_clip(0.1).update(grads, gtx.EmptyState(), params)
    got, _ = gtx.adaptive_clip(torch.tensor(0.1, dtype=torch.float64)).update(grads, gtx.EmptyState(), params)
    torch.testing.assert_close(got["w"], want["w"], rtol=1e-15, atol=0)


# --- bad hyperparameters -------------------------------------------------------------


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: gtx.clip_by_global_norm(0.0), "max_norm"),
        (lambda: gtx.clip_by_global_norm(-1.0), "max_norm"),
        (lambda: gtx.clip_by_global_norm(float("nan")), "max_norm"),
        (lambda: gtx.clip_by_global_norm(1.0, norm_type=0.0), "norm_type"),
        (lambda: gtx.clip_by_global_norm(1.0, norm_type=float("nan")), "norm_type"),
        (lambda: gtx.clip(-0.1), "max_delta"),
        (lambda: gtx.clip(float("nan")), "max_delta"),
        (lambda: gtx.adaptive_clip(0.0), "clipping"),
        (lambda: gtx.adaptive_clip(-1.0), "clipping"),
        (lambda: gtx.adaptive_clip(float("nan")), "clipping"),
        (lambda: gtx.adaptive_clip(0.1, eps=-1.0), "eps"),
    ],
)
def test_bad_hyperparameters_raise_value_error(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


@pytest.mark.parametrize("make", [lambda: gtx.clip_by_global_norm("1"), lambda: gtx.clip(None)])
def test_non_numbers_raise_type_error(make):
    with pytest.raises(TypeError):
        make()


def test_non_tensor_leaf_is_named():
    with pytest.raises(TypeError, match=r"\['b'\]"):
        gtx.clip(1.0).update({"a": torch.ones(1), "b": 3.0}, gtx.EmptyState())


def test_wrong_state_raises():
    tx = gtx.clip_by_global_norm(1.0)
    with pytest.raises(ValueError, match="call init"):
        tx.update({"a": torch.ones(1)}, None)
    with pytest.raises(TypeError, match="ClipByGlobalNormState"):
        tx.update({"a": torch.ones(1)}, gtx.EmptyState())


@pytest.mark.parametrize(
    "make, params", [(lambda: gtx.clip(0.5), None), (lambda: gtx.adaptive_clip(0.1), {"w": torch.ones(2, 2)})]
)
def test_stateless_clips_refuse_a_missing_or_foreign_state_as_every_transform_does(make, params):
    tx, grads = make(), {"w": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"state is None; call init"):
        tx.update(grads, None, params)
    with pytest.raises(TypeError, match=r"expected state of type EmptyState, got ScaleByAdamState"):
        tx.update(grads, gtx.scale_by_adam().init(grads), params)


def test_a_sparse_embedding_grad_through_the_wrapper_says_what_to_use():
    emb, head = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2)
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1), gtx.clip_by_global_norm(1.0)
    )
    head(emb(torch.tensor([1, 2]))).sum().backward()
    with pytest.raises(
        TypeError,
        match=r"leaf at \[0\]\[0\] is a torch.sparse_coo tensor of shape \(10, 3\).*"
        r"nn.Embedding\(sparse=True\).*sparse=False.*a chain with no norm",
    ):
        opt.step()
