"""Every dtype torch's own clip and optimizers accept: fp64 is never rounded to fp32, complex does what torch does.

fp16/bf16 AGC keeps its factors in fp32, and every transform on every float dtype matches an fp64
reference or raises a clear error. References: torch.optim and torch.nn.utils on the same dtype,
and fp64 runs of the same transform.
"""

from __future__ import annotations

import copy
import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.testing import assert_trees_equal
from tests.test_input_errors import TRANSFORMS, _params

# --- fp64: nothing is rounded to fp32 --------------------------------------------------------------


def test_fp64_sgd_steps_by_exactly_the_learning_rate():
    params = _params(torch.float64)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    tx = gtx.sgd(0.001)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert_trees_equal(updates, {k: torch.full_like(v, -0.001) for k, v in params.items()})


# The same hyperparameters through torch.optim and through gradtx.
OPTIMIZER_PAIRS = {
    "adam": (lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1), lambda: gtx.adam(0.01, weight_decay=0.1)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), lambda: gtx.adamw(0.01, weight_decay=0.1)),
    "sgd": (
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1),
        lambda: gtx.sgd(0.01, momentum=0.9, nesterov=True, weight_decay=0.1),
    ),
}


def _against_torch(opt: str, start: dict, steps: int, *, rtol: float, atol: float) -> None:
    """``steps`` random steps of torch.optim and of gradtx from the same params; the params must agree."""
    make_torch, make_tx = OPTIMIZER_PAIRS[opt]
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    torch_opt, tx = make_torch(list(ref.values())), make_tx()
    params = {k: v.clone() for k, v in start.items()}
    state = tx.init(params)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, dtype=v.dtype, generator=gen) for k, v in params.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        params, state = gtx.update_and_apply(tx, grads, state, params)
    for k in params:
        torch.testing.assert_close(params[k], ref[k].detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("opt", sorted(OPTIMIZER_PAIRS))
def test_fp64_optimizers_match_torch_to_fp64_rounding(opt):
    _against_torch(opt, _params(torch.float64), 20, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("opt", sorted(OPTIMIZER_PAIRS))
@pytest.mark.parametrize("path", ["functional", "wrapper", "wrapper_cast_after_build"])
def test_fp64_clip_then_fused_step_keeps_fp64(opt, path):
    """torch's fused kernels read grad_scale as fp32: a folded fp64 clip factor must not round through it.

    Also when the params become fp64 after the wrapper is built (``model.double()``, which torch.optim allows
    before the first step: it makes its state then): torch's optimizer, built on fp32 params, is cast alike.
    """
    make_torch, make_tx = OPTIMIZER_PAIRS[opt]
    start = _params(torch.float64)
    cast_later = path == "wrapper_cast_after_build"
    dtype = torch.float32 if cast_later else torch.float64
    ref = {k: torch.nn.Parameter(v.to(dtype)) for k, v in start.items()}
    torch_opt = make_torch(list(ref.values()))
    ours = {k: torch.nn.Parameter(v.to(dtype)) for k, v in start.items()}
    if path != "functional":
        inner = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[opt]
        kwargs = {k: v for k, v in torch_opt.defaults.items() if k in ("lr", "weight_decay", "momentum", "nesterov")}
        wrapper = gtx.TransformedOptimizer(
            inner(list(ours.values()), fused=True, **kwargs), gtx.clip_by_global_norm(0.5)
        )
    else:
        tx = gtx.chain(gtx.clip_by_global_norm(0.5), make_tx())
        params = {k: v.detach().clone() for k, v in ours.items()}
        state = tx.init(params)
    if cast_later:  # as model.double() does: each param's data replaced, the param object kept
        for k in start:
            ref[k].data, ours[k].data = start[k].clone(), start[k].clone()
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        grads = {k: torch.randn(v.shape, dtype=v.dtype, generator=gen) for k, v in start.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)
        torch_opt.step()
        if path != "functional":
            for k, p in ours.items():
                p.grad = grads[k].clone()
            wrapper.step()
        else:
            params, state = gtx.update_and_apply(tx, {k: g.clone() for k, g in grads.items()}, state, params)
    got = {k: p.detach() for k, p in ours.items()} if path != "functional" else params
    for k, r in ref.items():
        torch.testing.assert_close(got[k], r.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_tensor_learning_rate_is_read_at_every_step_as_torch_reads_it(opt):
    """lr = torch.tensor(...), changed in place between steps: gradtx and torch.optim both follow it."""
    start = _params()
    lr, torch_lr = torch.tensor(0.1), torch.tensor(0.1)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    if opt == "sgd":
        torch_opt, tx = torch.optim.SGD(list(ref.values()), lr=torch_lr, momentum=0.9), gtx.sgd(lr, momentum=0.9)
    else:
        torch_opt, tx = torch.optim.AdamW(list(ref.values()), lr=torch_lr), gtx.adamw(lr)
    params = {k: v.clone() for k, v in start.items()}
    state = tx.init(params)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        if step == 2:
            lr.fill_(0.01)
            torch_lr.fill_(0.01)
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in start.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        params, state = gtx.update_and_apply(tx, grads, state, params)
    for k, r in ref.items():
        torch.testing.assert_close(params[k], r.detach(), rtol=1e-5, atol=1e-6)


def test_fp64_accumulation_keeps_fp64():
    tx = gtx.accumulate(2)
    a = torch.tensor([1.0 + 1e-12], dtype=torch.float64)
    b = torch.tensor([1.0], dtype=torch.float64)
    _, state = tx.update({"w": a}, tx.init({"w": a}))
    assert state.acc["w"].dtype == torch.float64
    out, _ = tx.update({"w": b}, state)
    assert out["w"].dtype == torch.float64 and float(out["w"]) == (1.0 + 1e-12 + 1.0) / 2


# --- complex: what torch does ---------------------------------------------------------------------


def _complex_params():
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(3, 2, dtype=torch.complex64, generator=g),
        "b": torch.randn(2, dtype=torch.complex64, generator=g),
    }


@pytest.mark.parametrize("opt", sorted(OPTIMIZER_PAIRS))
def test_complex_optimizers_match_torch(opt):
    _against_torch(opt, _complex_params(), 10, rtol=1e-5, atol=1e-6)


def test_complex_accumulation_keeps_the_imaginary_part():
    tx = gtx.accumulate(2)
    a, b = torch.tensor([1 + 2j]), torch.tensor([3 - 4j])
    _, state = tx.update({"w": a}, tx.init({"w": a}))
    out, _ = tx.update({"w": b}, state)
    assert out["w"].dtype == torch.complex64
    torch.testing.assert_close(out["w"], torch.tensor([2 - 1j]))


def test_complex_agc_measures_magnitudes():
    w = torch.tensor([[3 + 4j, 0j]], dtype=torch.complex64)  # |w_unit| = 5
    g = torch.tensor([[0 + 1j, 0 + 1j]], dtype=torch.complex64)  # |g_unit| = sqrt(2)
    tx = gtx.adaptive_clip(0.1)
    out, _ = tx.update({"w": g}, tx.init({"w": w}), {"w": w})
    # max norm 0.1 * 5 = 0.5 < sqrt(2): scaled to 0.5 / sqrt(2) (a real-part norm would see 0 and not clip)
    torch.testing.assert_close(out["w"], g * (0.5 / math.sqrt(2)), rtol=1e-6, atol=0)


def test_complex_schedule_free_adamw_steps_as_its_adam_on_pairs_of_reals():
    """Its base step is Adam without momentum on (re, im) pairs, as gtx.adam (docs/optax.md): the same step
    as schedule_free_adamw on the real view of the same params, not the phase-losing ``g * g`` moment."""
    p, g = _complex_params(), {k: v * 1.5 + 0.25j for k, v in _complex_params().items()}
    as_real = {k: torch.view_as_real(v) for k, v in p.items()}
    tx = gtx.schedule_free_adamw(0.1, b1=0.9)
    s, s_real = tx.init(p), tx.init(as_real)
    for _ in range(3):
        u, s = tx.update(g, s, p)
        u_real, s_real = tx.update({k: torch.view_as_real(v) for k, v in g.items()}, s_real, as_real)
        p, as_real = gtx.apply_updates(p, u), gtx.apply_updates(as_real, u_real)
        for k in p:
            torch.testing.assert_close(torch.view_as_real(p[k]), as_real[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["hard", "refined"])
def test_complex_lion_steps_along_the_gradients_phase(mode):
    """optax's lion takes ``g / |g|`` for a complex ``g`` (torch.sgn); torch.sign refuses complex tensors."""
    g = {"w": torch.tensor([1.0 + 1.0j, -3.0 + 0.5j, 0j])}
    tx = gtx.scale_by_lion(mode=mode)
    out, _ = tx.update(g, tx.init(g))
    mixed = 0.1 * g["w"]  # (1 - b1) * g + b1 * 0 on the first step
    expected = mixed / mixed.abs().clamp_min(1e-30) if mode == "hard" else mixed  # |mixed| < 1: kept as is
    torch.testing.assert_close(out["w"], torch.where(mixed.abs() > 0, expected, 0j))


# --- fp16/bf16 AGC: factors in fp32 -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_agc_clips_a_zero_weight_to_the_eps_floor(dtype):
    w = torch.zeros(4, 8, dtype=dtype)  # zero-initialised: the bound is clipping * eps = 1e-5
    g = torch.full((4, 8), 2.0, dtype=dtype)
    tx = gtx.adaptive_clip(0.01, eps=1e-3)
    out, _ = tx.update({"w": g}, tx.init({"w": w}), {"w": w})
    unit_norms = torch.linalg.vector_norm(out["w"].float(), dim=1)
    assert bool((unit_norms > 0).all()), "clipped to the floor, not zeroed"
    torch.testing.assert_close(unit_norms, torch.full((4,), 1e-5), rtol=1e-2, atol=0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    scale_w=st.floats(1e-3, 1e3),
    scale_g=st.floats(1e-3, 1e3),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
)
def test_agc_never_overshoots_its_bound_beyond_rounding(scale_w, scale_g, dtype):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(5, 7, generator=gen) * scale_w).to(dtype)
    g = (torch.randn(5, 7, generator=gen) * scale_g).to(dtype)
    tx = gtx.adaptive_clip(0.05)
    out, _ = tx.update({"w": g}, tx.init({"w": w}), {"w": w})
    bound = 0.05 * torch.clamp(torch.linalg.vector_norm(w.float(), dim=1), min=1e-3)
    got = torch.linalg.vector_norm(out["w"].float(), dim=1)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6}[dtype]
    assert bool((got <= bound * (1 + tol) + 1e-30).all())


# --- every transform, every float dtype: the fp64 reference or a clear error ------------------------


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(TRANSFORMS)),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    shape=st.sampled_from([(), (0,), (5,), (3, 4), (2, 0, 3)]),
)
def test_every_transform_on_every_float_dtype_matches_fp64(name, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    params64 = {"p": torch.randn(shape, dtype=torch.float64, generator=gen) + 0.5}
    grads64 = {"p": torch.randn(shape, dtype=torch.float64, generator=gen)}
    params = optree.tree_map(lambda t: t.to(dtype), params64)
    grads = optree.tree_map(lambda t: t.to(dtype), grads64)
    # The reference sees the same (rounded) inputs, in fp64.
    ref_params = optree.tree_map(lambda t: t.to(torch.float64), params)
    ref_grads = optree.tree_map(lambda t: t.to(torch.float64), grads)
    tx = TRANSFORMS[name]()
    state = tx.init(params)
    before = copy.deepcopy((params, grads, state))
    out, _ = tx.update(grads, state, params)
    assert_trees_equal((params, grads, state), before)  # pure
    ref, _ = tx.update(ref_grads, tx.init(ref_params), ref_params)
    assert out["p"].dtype == dtype and out["p"].shape == torch.Size(shape)
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(out["p"].to(torch.float64), ref["p"], rtol=tol, atol=tol)


# --- norms: fp64 and complex as torch computes them ------------------------------------------------


@pytest.mark.parametrize(
    "grad", [torch.tensor([1e200], dtype=torch.float64), torch.full((3, 3), 1e150, dtype=torch.float64)]
)
def test_a_finite_fp64_norm_does_not_overflow(grad):
    # Both are past fp32's range: rounded to fp32 the norm was inf and the update silently zeroed.
    g = {"w": grad}
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_([p], 1.0)
    tx = gtx.clip_by_global_norm(1.0)
    out, state = tx.update(g, tx.init(g))
    assert math.isfinite(float(ref_norm)) and float(state.grad_norm) == pytest.approx(float(ref_norm), rel=1e-12)
    torch.testing.assert_close(out["w"], p.grad, rtol=1e-12, atol=0)
    assert float(gtx.global_norm(g)) == pytest.approx(float(ref_norm), rel=1e-12)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_complex_clip_matches_torch(norm_type):
    grads = _complex_params()
    ps = [torch.nn.Parameter(torch.zeros_like(v)) for v in grads.values()]
    for p, g in zip(ps, grads.values()):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ps, 0.5, norm_type=norm_type)
    tx = gtx.clip_by_global_norm(0.5, norm_type=norm_type)
    out, state = tx.update(grads, tx.init(grads))
    torch.testing.assert_close(state.grad_norm, ref_norm, rtol=1e-6, atol=0, check_dtype=False)
    for (k, g), p in zip(out.items(), ps):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
    finite_tx = gtx.apply_if_finite(gtx.identity(), 1)
    _, fstate = finite_tx.update(grads, finite_tx.init(grads))
    assert not bool(fstate.skipped)
