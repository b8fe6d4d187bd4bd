"""torch.compile(step) as users write it first: no graph break, with and without fullgraph=True.

The step is the README's pure step (update, then apply_updates) over chains
with no data-dependent control flow, on dicts of plain tensors, on
nn.Parameters and on DTensors (a one-rank mesh). Breaks are counted by dynamo;
the compiled step must also give the eager numbers.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor
from torch._dynamo.utils import counters

import gradtx as gtx
from gradtx.testing import assert_trees_close

CHAINS = {
    "clip+adamw": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2)),
    "clip-value+sgd-nesterov": lambda: gtx.chain(gtx.clip(0.1), gtx.sgd(0.1, momentum=0.9, nesterov=True)),
    # lamb's Adam member takes optax's form (eps_root): bias corrections read by per-tensor ops
    "clip+lamb": lambda: gtx.chain(gtx.clip_by_global_norm(1.0), gtx.lamb(1e-2, eps_root=1e-8)),
    "injected-scheduled-adamw": lambda: gtx.inject_hyperparams(gtx.adamw)(
        learning_rate=gtx.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), b1=0.8, weight_decay=0.1
    ),
    # interpolated schedules: each segment's constants are computed when the schedule is built
    "onecycle-sgd": lambda: gtx.chain(
        gtx.sgd(gtx.cosine_onecycle_schedule(4, 0.1), momentum=0.9),
        gtx.scale_by_schedule(gtx.linear_onecycle_schedule(4, 1.0)),
    ),
    # Muon's transforms: which leaves are matrices is host work on shapes, done while tracing
    "muon-transforms": lambda: gtx.chain(gtx.scale_by_muon(), gtx.scale_by_shape(), gtx.scale_by_learning_rate(0.02)),
    "trace+orthogonalize": lambda: gtx.chain(gtx.trace(0.9), gtx.orthogonalize(), gtx.scale(-0.1)),
    # guards whose state starts as zeros: one tensor shared by two fields would be a guarded alias
    "zclip+sgd": lambda: gtx.chain(gtx.zclip(warmup_steps=2), gtx.sgd(0.1)),
    "skip_spikes-adamw": lambda: gtx.skip_spikes(gtx.adamw(1e-2), warmup_steps=2),
    # the alias: a partition of Muon and Adam by a labels function of the params
    "muon": lambda: gtx.muon(gtx.warmup_cosine_decay_schedule(0.0, 0.02, 2, 10), weight_decay=0.01),
    # injected: the factory (and its checks of ns_coeffs) runs again inside every traced step
    "injected-muon": lambda: gtx.inject_hyperparams(gtx.muon, static_args=("ns_steps",))(
        gtx.warmup_cosine_decay_schedule(0.0, 0.02, 2, 10), weight_decay=0.01
    ),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _params(kind):
    g = torch.Generator().manual_seed(0)
    raw = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(16, generator=g)}
    if kind == "param":
        return {k: torch.nn.Parameter(v) for k, v in raw.items()}
    return raw


def _run(tx, params, *, compiled, fullgraph=False, steps=2):
    state = tx.init(params)

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return gtx.apply_updates(params, updates), state

    fn = torch.compile(step, fullgraph=fullgraph) if compiled else step
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: _like(v, torch.randn(v.shape, generator=g)) for k, v in params.items()}
        params, state = fn(params, grads, state)
    return params


def _like(p, g):
    # A DTensor param's grad is a DTensor with its placements.
    if isinstance(p, torch.distributed.tensor.DTensor):
        return torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
    return g


def _breaks():
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("name", CHAINS)
def test_compiled_step_on_plain_tensors_has_no_graph_break(name, fullgraph):
    got = _run(CHAINS[name](), _params("plain"), compiled=True, fullgraph=fullgraph, steps=3)
    assert _breaks() == 0, dict(counters["graph_break"])
    # Each step feeds the last one's results back in: nothing in the graph may be keyed on the objects of
    # the first call (a guard on a tensor's identity recompiles on every step).
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert_trees_close(got, _run(CHAINS[name](), _params("plain"), compiled=False, steps=3), rtol=1e-5, atol=1e-6)


def test_a_compiled_noise_step_breaks_where_it_draws_and_gives_the_eager_noise():
    """add_noise draws from the CPU generator its state holds, which dynamo cannot create in a graph: the step
    breaks there (docs/functional.md says so) and must still give the eager numbers, step after step."""
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.add_noise(0.1, 0.55, seed=3), gtx.sgd(0.1))
    got = _run(tx, _params("plain"), compiled=True, steps=3)
    assert _breaks() > 0
    assert_trees_close(got, _run(tx, _params("plain"), compiled=False, steps=3), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_zero_nans_reports_the_nans_eager_reports(fullgraph):
    tx = gtx.chain(gtx.zero_nans(), gtx.clip_by_global_norm(1.0))
    params = _params("plain")
    grads = {"w": params["w"].clone(), "b": params["b"].clone()}
    grads["w"][0, 0] = float("nan")

    def step(grads, state):
        return tx.update(grads, state, params)

    want = step(grads, tx.init(params))
    got = torch.compile(step, fullgraph=fullgraph)(grads, tx.init(params))
    assert bool(want[1][0].found_nan["w"]) and not bool(want[1][0].found_nan["b"])
    assert_trees_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_step_on_parameters_has_no_graph_break(fullgraph):
    with torch.no_grad():
        got = _run(CHAINS["clip+adamw"](), _params("param"), compiled=True, fullgraph=fullgraph)
        want = _run(CHAINS["clip+adamw"](), _params("param"), compiled=False)
    assert _breaks() == 0, dict(counters["graph_break"])
    assert_trees_close(
        {k: v.detach() for k, v in got.items()}, {k: v.detach() for k, v in want.items()}, rtol=1e-5, atol=1e-6
    )


@pytest.fixture
def one_rank_mesh():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if owned:
            dist.destroy_process_group()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_step_on_dtensors_has_no_graph_break(one_rank_mesh, fullgraph):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def params():
        raw = _params("plain")
        return {"w": distribute_tensor(raw["w"], one_rank_mesh, [Shard(0)]),
                "b": distribute_tensor(raw["b"], one_rank_mesh, [Replicate()])}  # fmt: skip

    got = _run(CHAINS["clip+adamw"](), params(), compiled=True, fullgraph=fullgraph)
    assert _breaks() == 0, dict(counters["graph_break"])
    want = _run(CHAINS["clip+adamw"](), params(), compiled=False)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_adam_step_reads_nothing_to_the_host():
    # On meta tensors any read of a value raises: the eager step must run through.
    params = {"w": torch.zeros(300, 300, device="meta"), "b": torch.zeros(3, device="meta")}
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3))
    state = tx.init(params)
    updates, state = tx.update(gtx.tree.tree_map(torch.ones_like, params), state, params)
    assert updates["w"].device.type == "meta"


def test_donated_compiled_step_writes_the_eager_results_into_the_old_buffers():
    # docs/functional.md's donated step: the results copied into the caller's params and state inside the
    # compiled step. It must give the eager pure step's numbers, with no graph break and no new buffer.
    tx = CHAINS["clip+adamw"]()
    params = _params("plain")
    state = tx.init(params)
    ref_params, ref_state = {k: v.clone() for k, v in params.items()}, tx.init(params)
    storages = [t.untyped_storage().data_ptr() for t in optree.tree_leaves((params, state))]

    @torch.compile
    def donated_step(params, state, grads):
        new = gtx.update_and_apply(tx, grads, state, params)
        for old, result in zip(optree.tree_leaves((params, state)), optree.tree_leaves(new)):
            old.copy_(result)

    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        donated_step(params, state, grads)
        ref_params, ref_state = gtx.update_and_apply(tx, grads, ref_state, ref_params)
    assert _breaks() == 0, dict(counters["graph_break"])
    assert [t.untyped_storage().data_ptr() for t in optree.tree_leaves((params, state))] == storages
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6)
    assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_norm_inside_torch_func_grad_compiles_with_no_graph_break(fullgraph):
    """A hypergradient-style step: the clip's norm under torch.func.grad, compiled, against eager."""
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))

    def clipped_sum(w):
        tx = gtx.clip_by_global_norm(0.5)
        (u,), _ = tx.update([w * 2], tx.init([w]))
        return u.sum() + gtx.global_norm([w * 2, w.sum(0)])

    got = torch.compile(torch.func.grad(clipped_sum), fullgraph=fullgraph)(w)
    assert sum(counters["graph_break"].values()) == 0
    torch.testing.assert_close(got, torch.func.grad(clipped_sum)(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_compiled_vmap_of_a_step_has_no_graph_break_and_gives_the_loop_numbers(fullgraph):
    """jax.jit(jax.vmap(step)) in torch: independent runs batched by vmap, compiled, against a loop over the runs."""
    tx = CHAINS["clip+adamw"]()
    g = torch.Generator().manual_seed(2)
    params = {k: torch.randn(4, *v.shape, generator=g) for k, v in _params("plain").items()}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(2)]

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return gtx.apply_updates(params, updates), state

    got, state = params, torch.func.vmap(tx.init)(params)
    compiled = torch.compile(torch.func.vmap(step), fullgraph=fullgraph)
    for gr in grads:
        got, state = compiled(got, gr, state)
    assert _breaks() == 0, dict(counters["graph_break"])
    for i in range(4):
        want = {k: v[i] for k, v in params.items()}
        s = tx.init(want)
        for gr in grads:
            want, s = step(want, {k: v[i] for k, v in gr.items()}, s)
        assert_trees_close({k: v[i] for k, v in got.items()}, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_compiled_hypergradient_through_injected_adamw_has_no_graph_break(fullgraph):
    """d(loss after 2 steps)/d(learning rate), compiled, against a central finite difference (fp64)."""
    g = torch.Generator().manual_seed(3)
    p0 = {
        "w": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
    }
    x, y = torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64)
    tx = gtx.inject_hyperparams(gtx.adamw)(learning_rate=0.05, weight_decay=0.1)

    def loss(p):
        return ((x @ p["w"].T + p["b"] - y) ** 2).mean()

    def loss_after_steps(lr):
        p, state = p0, tx.init(p0)
        state = state._replace(hyperparams={**state.hyperparams, "learning_rate": lr})
        for _ in range(2):
            updates, state = tx.update(torch.func.grad(loss)(p), state, p)
            p = gtx.apply_updates(p, updates)
        return loss(p)

    lr, h = torch.tensor(0.05, dtype=torch.float64), 1e-6
    got = torch.compile(torch.func.grad(loss_after_steps), fullgraph=fullgraph)(lr)
    assert _breaks() == 0, dict(counters["graph_break"])
    want = (loss_after_steps(lr + h) - loss_after_steps(lr - h)) / (2 * h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
