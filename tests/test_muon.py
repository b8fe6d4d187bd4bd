"""Muon on one device: against optax.contrib.muon, torch.optim.Muon, and orthogonalizing pieces by hand."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from optax.contrib import MuonDimensionNumbers as OptaxDN
from optax.contrib import muon as optax_muon
from optax.contrib import scale_by_muon as optax_scale_by_muon
from optax.contrib._muon import scale_by_shape as optax_scale_by_shape
from torch.distributed.tensor import Shard

import gradtx as gtx
from gradtx.comm import LocalComm
from gradtx.testing import assert_pure

DN = gtx.MuonDimensionNumbers
STEPS = 6


def _tree(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (16, 8), "v": (6, 10), "sq": (7, 7), "b": (8,), "heads": (3, 5, 4)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _grads(n: int = STEPS) -> list[dict[str, torch.Tensor]]:
    return [_tree(seed=100 + i) for i in range(n)]


def _jax(tree):
    return {k: jnp.asarray(v.numpy()) for k, v in tree.items()}


def _run_gtx(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = gtx.apply_updates(params, updates)
    return params, state


def _run_optax(tx, params, grads):
    params = _jax(params)
    state = tx.init(params)
    update = jax.jit(tx.update)  # one compile instead of hundreds of eager ones
    for g in grads:
        updates, state = update(_jax(g), state, params)
        params = optax.apply_updates(params, updates)
    return {k: torch.from_numpy(np.asarray(v).copy()) for k, v in params.items()}, state


# optax's layout: every 2-d leaf (in, out); the heads leaf (H, in, out) with H a batch axis.
OPTAX_LAYOUT = {"w": (0, 1), "v": (0, 1), "sq": (0, 1), "b": None, "heads": (1, 2)}


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"nesterov": False, "adaptive": True, "preconditioning": "spectral"},
        {
            "consistent_rms": 0.2,
            "weight_decay": 0.05,
            "preconditioning": "aol",
            "beta": 0.9,
            "weight_decay_mask": {"w": True, "v": False, "sq": True, "b": False, "heads": False},
        },
        {
            "preconditioning": "schatten",
            "ns_steps": 3,
            "adam_b1": 0.8,
            "adam_weight_decay": 0.01,
            "adam_learning_rate": 0.003,
            "adam_eps_root": 1e-8,
        },
        {"ns_coeffs": "dion"},
    ],
    ids=lambda kw: ",".join(kw) or "defaults",
)
def test_muon_matches_optax(kw):
    dims = {k: DN(*v) if v else None for k, v in OPTAX_LAYOUT.items()}
    odims = {k: OptaxDN(*v) if v else None for k, v in OPTAX_LAYOUT.items()}
    got, state = _run_gtx(gtx.muon(0.02, muon_weight_dimension_numbers=dims, **kw), _tree(), _grads())
    want, ostate = _run_optax(optax_muon(0.02, muon_weight_dimension_numbers=odims, **kw), _tree(), _grads())
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=2e-6, msg=k)
    mu = state[0].inner_states["muon"][0].mu
    omu = ostate.inner_states["muon"].inner_state[0].mu
    torch.testing.assert_close(mu["w"], torch.from_numpy(np.asarray(omu["w"]).copy()), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["jax", "torch"])
def test_aol_on_square_matrices_matches_optax(layout):
    """AOL scales rows, so a square matrix's side matters; given the same dimension numbers, it is optax's."""
    g = torch.Generator().manual_seed(3)
    shapes = {"sq": (7, 7), "w": (9, 5), "sq_heads": (2, 6, 6)}
    tree = lambda: {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    params, grads = tree(), [tree() for _ in range(4)]
    axes = {"sq": (0, 1), "w": (0, 1), "sq_heads": (1, 2)}
    if layout == "torch":  # (out, in): reduction axis last
        axes = {k: (b, a) for k, (a, b) in axes.items()}
    dims = {k: DN(*v) for k, v in axes.items()}
    odims = {k: OptaxDN(*v) for k, v in axes.items()}
    got, _ = _run_gtx(gtx.muon(0.02, preconditioning="aol", muon_weight_dimension_numbers=dims), params, grads)
    want, _ = _run_optax(optax_muon(0.02, preconditioning="aol", muon_weight_dimension_numbers=odims), params, grads)
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=2e-6, msg=k)


def test_default_dimension_numbers_read_torch_layout():
    """gtx's default on a torch (out, in) weight is optax's default on the (in, out) transpose."""
    params = {k: v for k, v in _tree().items() if k in ("w", "v", "sq", "b")}
    grads = [{k: v for k, v in g.items() if k in params} for g in _grads()]
    got, _ = _run_gtx(gtx.muon(0.02), params, grads)
    tr = lambda t: {k: v.T.contiguous() if v.ndim == 2 else v for k, v in t.items()}
    want, _ = _run_optax(optax_muon(0.02), tr(params), [tr(g) for g in grads])
    for k in got:
        torch.testing.assert_close(got[k], tr(want)[k], rtol=1e-5, atol=2e-6, msg=k)


def test_scale_by_muon_matches_optax_with_mu_dtype():
    g = _grads(4)
    dims = {k: DN(*v) if v else None for k, v in OPTAX_LAYOUT.items()}
    tx = gtx.scale_by_muon(weight_dimension_numbers=dims, mu_dtype=torch.float64)
    state = tx.init(_tree())
    otx = optax_scale_by_muon(
        weight_dimension_numbers={k: OptaxDN(*v) for k, v in OPTAX_LAYOUT.items() if v},
    )
    ostate = otx.init({k: v for k, v in _jax(_tree()).items() if k != "b"})
    update = jax.jit(otx.update)
    for step in g:
        u, state = tx.update(step, state)
        ou, ostate = update({k: v for k, v in _jax(step).items() if k != "b"}, ostate)
    assert state.mu["w"].dtype == torch.float64 and int(state.count) == 4
    for k in ou:
        torch.testing.assert_close(u[k], torch.from_numpy(np.asarray(ou[k]).copy()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u["b"], g[-1]["b"])  # a None leaf passes through


def test_a_lower_mu_dtype_only_stores_the_first_moments_as_in_optax():
    """mu_dtype=bf16 on fp32 grads: optax computes both members in fp32 and keeps only their first moments in bf16.

    Adam's second moment stays fp32: in bf16, ``0.999 * v`` rounds back to ``v`` and it would stop decaying.
    """
    params = {"w": _tree()["w"], "b": torch.zeros(8)}
    g = torch.Generator().manual_seed(5)
    grads = [{"w": torch.randn(16, 8, generator=g), "b": torch.full((8,), 10.0 if i < 5 else 1.0)} for i in range(60)]
    kw = {"mu_dtype": torch.bfloat16, "muon_weight_dimension_numbers": {"w": DN(0, 1), "b": None}}
    tx = gtx.muon(0.02, **kw)
    otx = optax_muon(
        0.02, **{**kw, "mu_dtype": jnp.bfloat16, "muon_weight_dimension_numbers": {"w": OptaxDN(), "b": None}}
    )
    state, ostate, oupdate = tx.init(params), otx.init(_jax(params)), jax.jit(otx.update)
    for i, step in enumerate(grads):
        u, state = tx.update(step, state, params)
        ou, ostate = oupdate(_jax(step), ostate, _jax(params))
        if i == 0:  # one step: the same update (a bf16 momentum is rounded only when it is stored)
            for k in u:
                torch.testing.assert_close(u[k], torch.from_numpy(np.asarray(ou[k]).copy()), rtol=1e-5, atol=1e-7)
    muon, adam = state[0].inner_states["muon"][0], state[0].inner_states["adam"][0]
    assert muon.mu["w"].dtype == adam.mu["b"].dtype == torch.bfloat16 and adam.nu["b"].dtype == torch.float32
    onu = np.asarray(ostate.inner_states["adam"].inner_state[0].nu["b"]).copy()
    torch.testing.assert_close(adam.nu["b"], torch.from_numpy(onu), rtol=1e-6, atol=0)


@pytest.mark.parametrize("adjust_lr_fn, rms", [(None, None), ("match_rms_adamw", 0.2)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_optim_muon(adjust_lr_fn, rms, nesterov):
    params = [p for p in _tree().values() if p.ndim == 2]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    tx = gtx.muon(
        0.02, beta=0.9, eps=1e-7, weight_decay=0.1, nesterov=nesterov, bias_correction=False,
        ns_dtype=torch.bfloat16, consistent_rms=rms,
    )  # fmt: skip
    state = tx.init(params)
    for step in _grads():
        grads = [v for v in step.values() if v.ndim == 2]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)


def _by_hand(x: torch.Tensor) -> torch.Tensor:
    return gtx.newton_schulz(x)


def test_heads_and_fused_qkv_against_pieces_by_hand():
    d, h = 8, 4
    g = torch.Generator().manual_seed(3)
    qkv, proj, heads = torch.randn(3 * d, d, generator=g), torch.randn(d, d, generator=g), torch.randn(h, 6, 5)
    dims = {
        "qkv": DN(output_split=3),  # Q, K, V apart
        "qkv_heads": DN(output_split=3 * h),  # every head of Q, K and V apart
        "proj": DN(reduction_split=h),  # the attention output, one matrix per head's input columns
        "heads": DN(2, 1),  # (H, out, in), H a batch axis
    }
    updates = {"qkv": qkv, "qkv_heads": qkv, "proj": proj, "heads": heads}
    tx = gtx.orthogonalize(weight_dimension_numbers=dims)
    out, _ = tx.update(updates, tx.init(updates))
    torch.testing.assert_close(out["qkv"], torch.cat([_by_hand(p) for p in qkv.chunk(3)]))
    torch.testing.assert_close(out["qkv_heads"], torch.cat([_by_hand(p) for p in qkv.chunk(3 * h)]))
    torch.testing.assert_close(out["proj"], torch.cat([_by_hand(p) for p in proj.chunk(h, dim=1)], dim=1))
    torch.testing.assert_close(out["heads"], torch.stack([_by_hand(p) for p in heads]))
    # The whole fused matrix is something else: the split is not a no-op.
    assert not torch.allclose(out["qkv"], _by_hand(qkv), atol=1e-3)
    # Shape scaling reads each piece: a (d, d) piece has no width factor.
    scaled, _ = gtx.scale_by_shape(dims).update(updates, gtx.EmptyState())
    torch.testing.assert_close(scaled["qkv"], qkv)


@pytest.mark.parametrize("ns_dtype, tol", [(None, 1e-6), (torch.bfloat16, 1e-4)])
def test_stacked_iteration_equals_one_matrix_at_a_time(ns_dtype, tol):
    """Same-shape matrices iterated as one bmm stack give the per-matrix numbers."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(5)
    shapes = {
        "a": (24, 8), "a2": (24, 8), "b": (8, 24), "b2": (8, 24), "sq": (8, 8), "sq2": (8, 8), "sq3": (8, 8),
        "odd": (5, 9),
    }  # fmt: skip
    params = {**{k: torch.randn(s, generator=g) for k, s in shapes.items()}, "bias": torch.randn(8, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(3)]
    kw = {"weight_decay": 0.1, "ns_dtype": ns_dtype}
    want, want_state = _run_gtx(gtx.muon(0.02, ns_batch=1, **kw), params, grads)
    for batch in (2, 16):  # 2: the three squares go in two stacks
        got, state = _run_gtx(gtx.muon(0.02, ns_batch=batch, **kw), params, grads)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=tol, msg=k)
        torch.testing.assert_close(state, want_state, rtol=0, atol=0)  # the momentum is the same ops either way
    # And it does stack: one batched iteration per stack instead of 2-d matmuls per matrix.
    tx = gtx.orthogonalize(ns_dtype=ns_dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tx.update(grads[0], gtx.EmptyState())
    names = [e.name for e in prof.events()]
    assert names.count("aten::addmm") == 2 * 5  # "odd" alone: 2 addmm per iteration, 5 iterations
    # Three stacks: (a, a2) and (b, b2) apart, as their wide views differ in memory layout; (sq, sq2, sq3).
    assert names.count("aten::baddbmm") == 2 * 3 * 5


def test_newton_schulz_orthogonalizes():
    x = torch.randn(32, 64, dtype=torch.float64)
    s = torch.linalg.svdvals(gtx.newton_schulz(x, ns_steps=10))
    assert bool(((s > 0.6) & (s < 1.25)).all())
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    # ``spectral`` with the classic cubic (1.5, -0.5, 0) converges to U Vᵀ exactly.
    exact = gtx.newton_schulz(x, (1.5, -0.5, 0.0), 60, preconditioning="spectral")
    torch.testing.assert_close(exact, u @ vh, rtol=0, atol=1e-8)


def test_orthogonalize_chains_with_own_momentum_and_is_pure():
    params = {k: v for k, v in _tree().items() if k in ("w", "v")}
    tx = gtx.chain(gtx.trace(0.9), gtx.orthogonalize(ns_steps=4), gtx.scale_by_learning_rate(0.1))
    grads = [{k: g[k] for k in params} for g in _grads(3)]
    state = tx.init(params)
    tr = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        updates, state = tx.update(g, state, params)
        tr = {k: 0.9 * tr[k] + g[k] for k in tr}
        for k in params:
            torch.testing.assert_close(updates[k], -0.1 * gtx.newton_schulz(tr[k], ns_steps=4))


def test_purity_none_grads_and_inject_hyperparams():
    params = _tree()
    grads = _grads(3)
    assert_pure(gtx.muon(0.02, weight_decay=0.1), params, grads[0])
    # A param with no gradient keeps its state, as torch.optim does.
    tx = gtx.muon(0.02)
    state = tx.init(params)
    updates, new = tx.update({**grads[0], "w": None}, state, params)
    assert updates["w"] is None
    assert torch.equal(new[0].inner_states["muon"][0].mu["w"], state[0].inner_states["muon"][0].mu["w"])
    # inject_hyperparams: tensors in the state, the same numbers.
    inj = gtx.inject_hyperparams(gtx.muon, static_args=("ns_steps",))(0.02, beta=0.9, weight_decay=0.1)
    got, istate = _run_gtx(inj, params, grads)
    want, _ = _run_gtx(gtx.muon(0.02, beta=0.9, weight_decay=0.1), params, grads)
    assert set(istate.hyperparams) >= {"learning_rate", "beta", "weight_decay"}
    for k in got:
        torch.testing.assert_close(got[k], want[k])
    with pytest.raises(TypeError, match="static_args"):
        _run_gtx(gtx.inject_hyperparams(gtx.muon)(0.02), params, grads)


def test_functional_step_and_checkpoint_roundtrip(tmp_path):
    params, grads = _tree(), _grads(4)
    tx = gtx.muon(0.02, weight_decay=0.1)
    want, _ = _run_gtx(tx, params, grads)
    p, state = _run_gtx(tx, params, grads[:2])
    sd = gtx.checkpoint.state_dict(state, p, tx=tx)
    torch.save(sd, tmp_path / "s.pt")
    fresh = tx.init(params)
    state = gtx.checkpoint.load_state_dict(torch.load(tmp_path / "s.pt"), fresh, p, tx=tx)
    for g in grads[2:]:
        p, state = gtx.update_and_apply(tx, g, state, p)
    for k in want:
        torch.testing.assert_close(p[k], want[k])
    restored = pickle.loads(pickle.dumps(tx))
    got, _ = _run_gtx(restored, params, grads)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_muon_steps_compile_in_one_graph():
    """torch.compile(fullgraph=True): a functional step of Muon's transforms on a dict (against optax), and the
    wrapper's Muon direction before SGD (against torch.optim.Muon)."""
    params = {k: v for k, v in _tree().items() if k in ("w", "v", "b")}
    grads = [{k: g[k] for k in params} for g in _grads(3)]
    dims = {"w": DN(0, 1), "v": DN(0, 1), "b": None}
    tx = gtx.chain(
        gtx.scale_by_muon(weight_dimension_numbers=dims), gtx.scale_by_shape(dims), gtx.scale_by_learning_rate(0.02)
    )
    step = torch.compile(lambda g, s, p: gtx.update_and_apply(tx, g, s, p), backend="aot_eager", fullgraph=True)
    p, state = params, tx.init(params)
    for g in grads:
        p, state = step(g, state, p)
    odims = {"w": OptaxDN(), "v": OptaxDN()}
    otx = optax.chain(
        optax_scale_by_muon(weight_dimension_numbers=odims),
        optax_scale_by_shape(weight_dimension_numbers=odims),
        optax.scale_by_learning_rate(0.02),
    )
    mats = lambda t: {k: v for k, v in t.items() if k != "b"}
    want, _ = _run_optax(otx, mats(params), [mats(g) for g in grads])
    for k in want:
        torch.testing.assert_close(p[k], want[k], rtol=1e-5, atol=2e-6, msg=k)
    torch.testing.assert_close(p["b"], params["b"] - 0.02 * sum(g["b"] for g in grads))  # passed through

    w = [params["w"], params["v"]]
    ref = [x.clone().requires_grad_() for x in w]
    opt = torch.optim.Muon(ref, lr=0.02, momentum=0.9, weight_decay=0.1)
    mine = [torch.nn.Parameter(x.clone()) for x in w]
    muon_dir = gtx.chain(
        gtx.scale_by_muon(beta=0.9, eps=1e-7, bias_correction=False, ns_dtype=torch.bfloat16), gtx.scale_by_shape()
    )
    wrapped = gtx.TransformedOptimizer(torch.optim.SGD(mine, lr=0.02, weight_decay=0.1), muon_dir)
    # A closure, not the bound wrapped.step: dynamo keeps state on a compiled bound method's code past its reset, and
    # a later test's compiled training step would then trace the wrapper's step as a frame of its own.
    compiled = torch.compile(lambda: wrapped.step(), backend="aot_eager", fullgraph=True)
    for g in grads:
        for a, b, k in zip(ref, mine, ("w", "v")):
            a.grad, b.grad = g[k].clone(), g[k].clone()
        opt.step()
        compiled()
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.detach(), b.detach())


def test_wrapper_refuses_muon_and_takes_the_direction():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False))
    with pytest.raises(TypeError, match="gtx.muon"):
        gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), gtx.muon(0.02))
    # The direction before an inner SGD(lr) equals gtx.muon on the matrices (SGD's L2 decay with no
    # momentum is the decoupled decay, scaled by lr).
    mats = [p for p in model.parameters() if p.ndim == 2]
    start = [p.detach().clone() for p in mats]
    tx = gtx.chain(gtx.scale_by_muon(), gtx.scale_by_shape())
    opt = gtx.TransformedOptimizer(torch.optim.SGD(mats, lr=0.02, weight_decay=0.1), tx)
    ref_tx = gtx.muon(0.02, weight_decay=0.1)
    ref, ref_state = start, ref_tx.init(start)
    for i in range(3):
        torch.manual_seed(i)
        model.zero_grad()
        model(torch.randn(5, 6)).square().mean().backward()
        grads = [p.grad.clone() for p in mats]
        opt.step()
        updates, ref_state = ref_tx.update(grads, ref_state, ref)
        ref = gtx.apply_updates(ref, updates)
        for p, r in zip(mats, ref):
            p.data.copy_(r)  # keep both on one trajectory: the comparison is per step
    for p, r in zip(mats, ref):
        torch.testing.assert_close(p.detach(), r)


def test_uneven_experts_sharded_on_both_mesh_dims_match_one_device():
    """6 stacked experts on a 2x2 mesh, (Shard(0), Shard(0)): 3 per EP rank, then 2 and 1 (simulated)."""
    g = torch.Generator().manual_seed(4)
    tree = lambda: {"experts": torch.randn(6, 5, 4, generator=g), "w": torch.randn(7, 5, generator=g)}
    params, grads = tree(), [tree() for _ in range(2)]
    tx = gtx.muon(0.1, weight_decay=0.1, muon_weight_dimension_numbers={"experts": DN(2, 1), "w": DN()})
    layout = {"experts": [Shard(0), Shard(0)], "w": [Shard(0), Shard(1)]}  # w: uneven, through the exchange
    gtx.testing.assert_matches_single_device(
        tx, grads, params, mesh_shape=(2, 2), names=("ep", "dp"), layout=layout, steps=2
    )


def test_bad_input_raises_and_names_it():
    with pytest.raises(ValueError, match="ns_coeffs"):
        gtx.scale_by_muon(ns_coeffs=(1.0, 2.0))
    with pytest.raises(ValueError, match="preconditioning"):
        gtx.orthogonalize(preconditioning="svd")
    with pytest.raises(ValueError, match="beta"):
        gtx.muon(0.02, beta=1.0)
    with pytest.raises(ValueError, match="ns_batch"):
        gtx.muon(0.02, ns_batch=0)
    with pytest.raises(TypeError, match="ExchangeComm"):
        gtx.orthogonalize(comm=object())
    tx = gtx.orthogonalize(weight_dimension_numbers=DN(2, 1))
    with pytest.raises(ValueError, match=r"\['w'\]"):
        tx.update({"w": torch.randn(3, 4)}, gtx.EmptyState())
    with pytest.raises(ValueError, match="output_split"):
        gtx.orthogonalize(weight_dimension_numbers=DN(output_split=3)).update(
            {"w": torch.randn(4, 4)}, gtx.EmptyState()
        )
    assert isinstance(LocalComm(), gtx.comm.ExchangeComm)
    with pytest.raises(TypeError, match=r"reduction_axis at \['w'\] must be an int or a sequence"):
        gtx.orthogonalize(weight_dimension_numbers=DN(1.0, 0)).update({"w": torch.randn(3, 4)}, gtx.EmptyState())
    with pytest.raises(TypeError, match="dimension_numbers must be a MuonDimensionNumbers"):
        gtx.newton_schulz(torch.randn(3, 4), dimension_numbers=(1, 0))
    with pytest.raises(ValueError, match="newton_schulz: eps must be >= 0"):  # as every transform checks it
        gtx.newton_schulz(torch.randn(3, 4), eps=-1.0)
    bad = {"v": torch.randn(3, 3), "w": torch.randn(4, 3, dtype=torch.complex64)}
    for tx in (gtx.muon(0.1), gtx.orthogonalize()):  # a complex leaf, named
        with pytest.raises(TypeError, match=r"update at \['w'\] is complex"):
            tx.update(bad, tx.init(bad), bad)


def test_axes_given_as_lists_are_the_same_as_tuples():
    """MuonDimensionNumbers takes one axis or a sequence of them: a list, as optax takes it."""
    g = {"w": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))}
    for make in (gtx.orthogonalize, gtx.scale_by_muon):
        by_list = make(weight_dimension_numbers={"w": DN([1, 2], 0)})
        by_tuple = make(weight_dimension_numbers={"w": DN((1, 2), 0)})
        want, _ = by_tuple.update(g, by_tuple.init(g))
        got, _ = by_list.update(g, by_list.init(g))
        torch.testing.assert_close(got["w"], want["w"], rtol=0, atol=0)


def test_a_matrix_with_an_empty_reduction_axis_gets_an_empty_update_as_in_optax():
    p = {"w": torch.zeros(8, 0), "v": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    g = {k: torch.ones_like(v) for k, v in p.items()}
    tx, ref = gtx.muon(0.1), optax_muon(0.1)
    got, _ = tx.update(g, tx.init(p), p)
    want, _ = ref.update(_jax(g), ref.init(_jax(p)), _jax(p))
    assert got["w"].shape == np.asarray(want["w"]).shape == (8, 0)
    alone, _ = tx.update({"v": g["v"]}, tx.init({"v": p["v"]}), {"v": p["v"]})  # the other leaf steps as without it
    torch.testing.assert_close(got["v"], alone["v"], rtol=0, atol=0)
    shaped, _ = gtx.scale_by_shape().update(g, gtx.EmptyState())
    assert shaped["w"].shape == (8, 0)


@pytest.mark.parametrize("preconditioning", ["frobenius", "spectral", "aol", "schatten"])
def test_fp64_muon_matches_optax_in_fp64(preconditioning):
    """fp64 params iterate in fp64 throughout: the spectral norm of the first step too (not in fp32)."""
    params = {k: v.double() for k, v in _tree().items()}
    grads = [{k: v.double() for k, v in g.items()} for g in _grads(3)]
    dims = {k: DN(*v) if v else None for k, v in OPTAX_LAYOUT.items()}
    odims = {k: OptaxDN(*v) if v else None for k, v in OPTAX_LAYOUT.items()}
    got, _ = _run_gtx(
        gtx.muon(0.02, preconditioning=preconditioning, muon_weight_dimension_numbers=dims), params, grads
    )
    with jax.enable_x64(True):
        want, _ = _run_optax(
            optax_muon(0.02, preconditioning=preconditioning, muon_weight_dimension_numbers=odims), params, grads
        )
    for k in got:
        assert want[k].dtype == torch.float64
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-13, msg=lambda m, k=k: f"{k}: {m}")
