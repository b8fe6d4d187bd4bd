"""The fast paths give the pure path's numbers: the wrapper's folded clip, compiled steps, many trees.

Timings live in ``benchmarks/``; these tests guard what the fast paths compute.
Every fast path is compared with an independent reference: the pure path,
``torch.nn.utils.clip_grad_norm_`` plus a ``torch.optim`` step, or the eager step.
"""

from __future__ import annotations

from pathlib import Path

import optree
import pytest
import torch

import gradtx as gtx
from gradtx.core import foreach as fe
from gradtx.testing import assert_trees_close
from tests.fork_server import run_script

REPO = Path(__file__).resolve().parent.parent


def _tree(seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(6, 5, generator=g) * scale).to(dtype),
        "b": (torch.randn(5, generator=g) * scale).to(dtype),
        "nested": {
            "s": (torch.randn((), generator=g) * scale).to(dtype),
            "v": (torch.randn(7, generator=g) * scale).to(dtype),
        },
    }


def _clone(tree):
    return optree.tree_map(torch.clone, tree)


CHAINS = {
    "clip+adamw": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2, weight_decay=0.1)),
    "clip+adamw_schedule": lambda: gtx.chain(
        gtx.clip_by_global_norm(0.5), gtx.adamw(lambda c: 1e-2 * 0.9 ** c.to(torch.float32), weight_decay=0.1)
    ),
    "clip+adam_l2": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adam(1e-2, weight_decay=0.1)),
    "clip+sgd_nesterov": lambda: gtx.chain(
        gtx.clip_by_global_norm(0.5), gtx.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)
    ),
    "sgd_plain": lambda: gtx.sgd(1e-1),
    "accumulate+clip+adamw": lambda: gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2)),
    "clip_value+scale+adamw": lambda: gtx.chain(gtx.clip(0.3), gtx.scale(0.5), gtx.adamw(1e-2)),
    "apply_if_finite(adamw)": lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.apply_if_finite(gtx.adamw(1e-2), 3)),
    "partition": lambda: gtx.partition(
        {"a": gtx.adamw(1e-2), "b": gtx.sgd(1e-2, momentum=0.5)},
        {"w": "a", "b": "b", "nested": {"s": "a", "v": "b"}},
    ),
}


def test_update_and_apply_is_pure():
    tx = CHAINS["clip+adamw"]()
    params, grads = _tree(0), _tree(1)
    state = tx.init(params)
    before = _clone((params, grads, state))
    new_params, _ = gtx.update_and_apply(tx, grads, state, params)
    assert_trees_close((params, grads, state), before, rtol=0, atol=0)
    assert not any(a is b for a, b in zip(optree.tree_leaves(new_params), optree.tree_leaves(params)))


def test_a_step_skips_non_finite_grads_inside_apply_if_finite():
    tx = CHAINS["apply_if_finite(adamw)"]()
    params = _tree(0)
    state = tx.init(params)
    grads = _tree(1)
    grads["w"][0, 0] = float("nan")
    before = _clone((params, state[1].inner_state))
    params, state = gtx.update_and_apply(tx, grads, state, params)
    assert bool(state[1].skipped)
    assert_trees_close((params, state[1].inner_state), before, rtol=0, atol=0)


# --- the clip folded into the fused kernel -----------------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(n: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("opt_name", ["AdamW", "Adam", "SGD"])
def test_folded_clip_equals_torch_clip_then_fused_step(opt_name):
    kwargs = {"lr": 0.05, "momentum": 0.9} if opt_name == "SGD" else {"lr": 1e-2}
    ref, ours = _mlp(), _mlp()
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), fused=True, **kwargs)
    our_opt = gtx.TransformedOptimizer(
        getattr(torch.optim, opt_name)(ours.parameters(), fused=True, **kwargs), gtx.chain(gtx.clip_by_global_norm(0.1))
    )
    for x, y in _batches(6):
        for model in (ref, ours):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        our_opt.step()
        assert our_opt.emitted
        ref_opt.zero_grad()
        our_opt.zero_grad()
    assert_trees_close(dict(ours.named_parameters()), dict(ref.named_parameters()), rtol=1e-5, atol=1e-7)


def test_functional_folded_clip_equals_clip_then_step():
    params = _tree(0)
    clipped_then_stepped = gtx.chain(gtx.clip_by_global_norm(0.2), gtx.adamw(1e-2, weight_decay=0.1))
    reference = gtx.adamw(1e-2, weight_decay=0.1)
    ours, ref = _clone(params), _clone(params)
    our_state, ref_state = clipped_then_stepped.init(ours), reference.init(ref)
    for step in range(4):
        grads = _tree(20 + step)
        coef = torch.clamp(
            0.2 / (torch.linalg.vector_norm(torch.stack([g.norm() for g in optree.tree_leaves(grads)])) + 1e-6), max=1.0
        )
        ref_updates, ref_state = reference.update(optree.tree_map(lambda g, c=coef: g * c, grads), ref_state, ref)
        ref = gtx.apply_updates(ref, ref_updates)
        ours, our_state = gtx.update_and_apply(clipped_then_stepped, _clone(grads), our_state, ours)
    assert_trees_close(ours, ref, rtol=1e-5, atol=1e-7)


# --- compiled == eager -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_tx, fullgraph",
    [
        (lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2, weight_decay=0.1)), True),
        # accumulate decides on the host whether to emit: compiled without fullgraph, it runs eagerly.
        (lambda: gtx.chain(gtx.accumulate(3), gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2)), False),
    ],
    ids=["adamw", "accumulate"],
)
def test_compiled_step_equals_eager_step(make_tx, fullgraph):
    from torch._dynamo.utils import counters

    tx = make_tx()

    def step(params, state, grads):
        return gtx.update_and_apply(tx, grads, state, params)

    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=fullgraph)
    eager_params = compiled_params = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    eager_state = compiled_state = tx.init(eager_params)
    for seed in range(7):
        g = torch.Generator().manual_seed(seed)
        grads = {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}
        eager_params, eager_state = step(eager_params, eager_state, grads)
        compiled_params, compiled_state = compiled(compiled_params, compiled_state, grads)
    assert sum(counters["graph_break"].values()) == 0 or not fullgraph
    assert_trees_close(compiled_params, eager_params, rtol=1e-5, atol=1e-6)
    assert_trees_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)


def test_compiled_pure_step_on_parameters_with_recording_grads_equals_eager():
    """params = dict(model.named_parameters()), grads from torch.func.grad: autograd records the step."""
    tx = gtx.chain(gtx.clip_by_global_norm(0.5), gtx.trace(0.9), gtx.adam(1e-2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 300), torch.nn.Tanh(), torch.nn.Linear(300, 1))
    x = torch.randn(8, 4)

    def loss(p):
        return torch.func.functional_call(model, p, (x,)).pow(2).mean()

    def step(params, state, grads):
        return gtx.update_and_apply(tx, grads, state, params)

    torch.compiler.reset()
    compiled = torch.compile(step, fullgraph=True)
    eager_params = compiled_params = dict(model.named_parameters())
    eager_state = compiled_state = tx.init(eager_params)
    for _ in range(3):
        grads = torch.func.grad(loss)(eager_params)
        assert any(g.requires_grad for g in grads.values())
        eager_params, eager_state = step(eager_params, eager_state, grads)
        compiled_params, compiled_state = compiled(
            compiled_params, compiled_state, torch.func.grad(loss)(compiled_params)
        )
    assert_trees_close(compiled_params, eager_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: gtx.chain(gtx.clip_by_global_norm(0.5), gtx.trace(0.9), gtx.scale(-0.1)),
        # Whether the window emits is data-dependent control flow: dynamo breaks the graph there.
        lambda: gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(0.5), gtx.sgd(0.1, momentum=0.9)),
        # States whose fields share one zero tensor at init: it must not be written once per field.
        lambda: gtx.skip_spikes(gtx.sgd(0.1), warmup_steps=2),
        lambda: gtx.chain(gtx.zclip(warmup_steps=2), gtx.sgd(0.1)),
    ],
    ids=["trace", "accumulate", "skip_spikes", "zclip"],
)
def test_compiled_step_of_more_transforms_equals_the_eager_step(make_tx, request):
    """A user compiling the step: the eager numbers, no graph break."""
    from torch._dynamo.utils import counters

    tx = make_tx()
    fullgraph = "accumulate" not in request.node.callspec.id

    def step(params, state, grads):
        return gtx.update_and_apply(tx, grads, state, params)

    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=fullgraph)
    pure_params = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    pure_state = tx.init(pure_params)
    compiled_params = _clone(pure_params)
    compiled_state = tx.init(compiled_params)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        spike = 100.0 if seed == 3 else 1.0  # after the warm-up: skip_spikes skips it, zclip clips it
        grads = {"w": torch.randn(8, 4, generator=g) * spike, "b": torch.randn(4, generator=g) * spike}
        pure_params, pure_state = gtx.update_and_apply(tx, grads, pure_state, pure_params)
        compiled_params, compiled_state = compiled(compiled_params, compiled_state, _clone(grads))
    assert sum(counters["graph_break"].values()) == 0 or not fullgraph
    assert_trees_close(compiled_params, pure_params, rtol=1e-5, atol=1e-6)
    assert_trees_close(compiled_state, pure_state, rtol=1e-5, atol=1e-6)


# --- no host syncs -----------------------------------------------------------------------------


@pytest.fixture
def no_host_reads(monkeypatch):
    """Make reading a tensor's value on the host (``.item()``, ``bool``, ``float``, ``int``) raise."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host in a hot path")

    for method in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, method, refuse)


def test_hot_paths_read_no_tensor_value_on_the_host(no_host_reads):
    tx = CHAINS["clip+adamw"]()
    params = _tree(0)
    state = tx.init(params)
    gtx.update_and_apply(tx, _tree(1), state, params)
    model = _mlp()
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), fused=True), gtx.chain(gtx.clip_by_global_norm(0.1))
    )
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


# --- plans follow the tree ---------------------------------------------------------------------


def test_grouping_follows_the_tree():
    a = [torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(4)]
    b = [torch.zeros(2, dtype=torch.float64), torch.zeros(3), torch.zeros(4, dtype=torch.float64)]
    first = dict(fe.group_by_device_dtype(a))
    assert dict(fe.group_by_device_dtype(b)) == {
        (torch.device("cpu"), torch.float64): [0, 2],
        (torch.device("cpu"), torch.float32): [1],
    }
    assert (
        dict(fe.group_by_device_dtype(a))
        == first
        == {
            (torch.device("cpu"), torch.float32): [0, 2],
            (torch.device("cpu"), torch.float64): [1],
        }
    )
    # What a caller was given is its own to edit.
    first[(torch.device("cpu"), torch.float32)].append(99)
    assert dict(fe.group_by_device_dtype(a))[(torch.device("cpu"), torch.float32)] == [0, 2]


def test_transforms_give_fresh_results_when_the_tree_changes():
    # The same transforms, stepped on trees that differ in dtype, structure and size, in turn:
    # every result must equal that of a transform that never saw the other trees.
    trees = {
        "fp32": lambda s: _tree(s),
        "fp64": lambda s: _tree(s, torch.float64),
        "mixed": lambda s: {**_tree(s), "extra": torch.randn(3, dtype=torch.float64)},
        "bf16": lambda s: _tree(s, torch.bfloat16),
    }

    def make():
        return gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2))

    shared = make()
    shared_states = {k: shared.init(f(0)) for k, f in trees.items()}
    fresh = {k: make() for k in trees}
    fresh_states = {k: fresh[k].init(f(0)) for k, f in trees.items()}
    for step in range(3):
        for key, f in trees.items():
            params, grads = f(0), f(10 + step)
            got, shared_states[key] = shared.update(_clone(grads), shared_states[key], params)
            want, fresh_states[key] = fresh[key].update(grads, fresh_states[key], params)
            assert_trees_close(got, want, rtol=0, atol=0)


# --- norms of big tensors ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_big_tensor_norms_are_fp32_accurate(dtype):
    # Big contiguous CPU tensors take BLAS dot (low precision through an fp32 scratch, chunk by
    # chunk, the last chunk partial); small and non-contiguous ones take _foreach_norm.
    g = torch.Generator().manual_seed(0)
    tree = {
        "big": torch.randn(600_001, generator=g).to(dtype),
        "edge": torch.randn(1 << 16, generator=g).to(dtype),
        "matrix_t": torch.randn(300, 400, generator=g).to(dtype).t(),
        "small": torch.randn(1000, generator=g).to(dtype),
    }
    exact = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tree.values()]))
    norm = gtx.global_norm(tree)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), exact, rtol=1e-5, atol=0)
    tx = gtx.clip_by_global_norm(1.0)
    out, state = tx.update(tree, tx.init(tree))
    torch.testing.assert_close(state.grad_norm.double(), exact, rtol=1e-5, atol=0)
    assert all(out[k].dtype == dtype for k in tree)


# --- the benchmark script ----------------------------------------------------------------------


def test_bench_quick_runs(tmp_path):
    # As `python benchmarks/run.py ...` from the repo root (forked from a process that imported torch once).
    # One thread: a smoke run checks the script, not timings, and one thread is steady on a busy machine.
    code, _, stderr = run_script(
        [str(REPO / "benchmarks" / "run.py"), "--quick", "--no-peers", "--cases", "abcd",
         "--threads", "1", "--out-dir", str(tmp_path)],
        timeout=120,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    md = (tmp_path / "benchmarks.md").read_text()
    assert "| target | goal | measured | verdict |" in md
    assert "torch clip + AdamW(fused)" in md and "gradtx TransformedOptimizer" in md
    assert "skipped: left out (--no-peers)" in md  # the peers were left out, and say so
    assert (tmp_path / "benchmarks.png").stat().st_size > 0


def test_norm_bench_quick_runs(tmp_path):
    out = tmp_path / "norm.md"
    code, _, stderr = run_script(
        [str(REPO / "benchmarks" / "norm.py"), "--quick", "--rounds", "1", "--out", str(out)], timeout=120
    )
    assert code == 0, stderr[-3000:]
    md = out.read_text()
    assert "float32: time, gtx / torch" in md and "rel. error on wte" in md
    if not torch.cuda.is_available():  # the GPU rows say they were not run
        assert "not run: no CUDA device" in md
