"""Norms in one process: global_norm against torch, and the mesh_groups plan's bookkeeping.

The plan's arithmetic across ranks is checked here with ``MirrorComm``, which
stands for N ranks that all hold the same shard: a SUM multiplies by N and a
MAX is the identity. The same plan on real layouts is tested in
``tests/distributed/test_norms.py`` and ``test_pipeline.py``.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch

import gradtx as gtx
from gradtx.comm import LocalComm, ReduceOp
from gradtx.distributed.global_norm import unitwise_norms
from gradtx.distributed.pipeline import pp_reduce
from gradtx.distributed.plan import MeshGroups, Sharded, mesh_groups
from gradtx.testing import RecordingComm, assert_pure, assert_trees_close

NORM_TYPES = [1.0, 2.0, 3.0, math.inf]


class MirrorComm:
    """N ranks holding identical data: SUM is ``x * n``, MAX is ``x``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def all_reduce(self, tensors, op, group):
        del group
        return [t * self.n if ReduceOp(op) is ReduceOp.SUM else t.clone() for t in tensors]

    def size(self, group) -> int:
        del group
        return self.n


def leaves(t) -> list[torch.Tensor]:
    """Leaves in flatten order (optree sorts dict keys), the order a plan is bound to."""
    return optree.tree_leaves(t)


def tree(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (6, 4), "l0.w": (5, 4), "l0.b": (5,), "l1.w": (3, 5), "norm": (3,), "s": ()}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


# --- global_norm ------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_global_norm_matches_torch(norm_type):
    grads = tree()
    expected = torch.nn.utils.get_total_norm(leaves(grads), norm_type)
    torch.testing.assert_close(gtx.global_norm(grads, norm_type), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("shape", [(256,), (16, 30), (3,)])
def test_global_norm_of_many_small_fp32_tensors_is_as_close_to_fp64_as_torchs(norm_type, shape):
    # Many small fp32 tensors are reduced from one flat copy: its sums must stay as short as per-tensor
    # norms keep them, so the norm is no further from the fp64 one than torch's get_total_norm.
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g) * (1 + i % 7) for i in range(600)]
    exact = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in grads]), norm_type)
    ours = gtx.global_norm(grads, norm_type=norm_type)
    theirs = torch.nn.utils.get_total_norm(grads, norm_type, foreach=True)
    assert ours.dtype == torch.float32
    # (up to one fp32 ulp of its own: the 0-d result is rounded to fp32 once more)
    assert abs(ours.double() / exact - 1) <= max(abs(theirs.double() / exact - 1), torch.finfo(torch.float32).eps)


def test_global_norm_bad_input():
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        gtx.global_norm(tree(), 0.0)
    with pytest.raises(TypeError, match=r"leaf at \['b'\] is a str"):
        gtx.global_norm({"a": torch.ones(1), "b": "x"})


# --- the plan on unsharded tensors: same numbers, no collective ------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_plan_on_plain_tensors_is_the_single_process_norm_with_no_collective(norm_type):
    grads = tree()
    comm = RecordingComm()
    plan = mesh_groups(grads, comm=comm)
    got = gtx.global_norm(leaves(grads), norm_type, mesh_groups=plan)
    torch.testing.assert_close(got, gtx.global_norm(grads, norm_type), rtol=1e-6, atol=0)
    assert got.dtype == torch.float32 and got.ndim == 0
    assert comm.calls == []


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_by_global_norm_with_a_local_plan_equals_without(norm_type):
    grads = tree(1)
    plain = gtx.clip_by_global_norm(0.3, norm_type=norm_type)
    planned = gtx.clip_by_global_norm(0.3, norm_type=norm_type, mesh_groups=mesh_groups(grads, comm=LocalComm()))
    out_a, st_a = plain.update(grads, plain.init(grads))
    out_b, st_b = planned.update(grads, planned.init(grads))
    assert_trees_close(out_b, out_a, rtol=1e-6)
    torch.testing.assert_close(st_b.grad_norm, st_a.grad_norm, rtol=1e-6, atol=0)
    assert_pure(planned, grads, grads)


# --- collectives: one per group, in first-appearance order, pp last ---------------------------


@pytest.mark.parametrize("n_layers", [1, 7])
def test_one_collective_per_group_however_many_tensors(n_layers):
    grads = {}
    for i in range(n_layers):
        grads |= {f"l{i}.colwise": torch.ones(4, 2), f"l{i}.rowwise": torch.ones(2, 4), f"l{i}.norm": torch.ones(2)}
    comm = RecordingComm()
    plan = mesh_groups(
        grads,
        comm=comm,
        sharded={"*.colwise": ["dp", Sharded("tp", dim=0)], "*.rowwise": ["dp", Sharded("tp", dim=1)], "*.norm": "dp"},
        pp_group="pp",
    )
    gtx.global_norm(leaves(grads), 2.0, mesh_groups=plan)
    # One collective per group, in the plan's order (dp, then tp for the bucket that needs both); pp is
    # always last, over the stage's total. Never one collective per tensor: one value per bucket.
    assert [c.group for c in comm.calls] == ["dp", "tp", "pp"]
    assert [c.num_tensors for c in comm.calls] == [2, 1, 1]
    assert plan.num_collectives() == 3 and plan.group_order == ("dp", "tp")


def test_reduction_over_a_group_sums_shards_and_max_for_inf():
    x = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    r = torch.tensor([1.0, 2.0])
    plan = mesh_groups({"x": x, "r": r}, comm=MirrorComm(4), sharded={"x": "tp"})
    # Four ranks with identical shards of x: |x|^2 counted four times; r replicated: once.
    torch.testing.assert_close(gtx.global_norm([r, x], 2.0, mesh_groups=plan), torch.tensor(math.sqrt(4 * 25 + 5)))
    torch.testing.assert_close(gtx.global_norm([r, x], math.inf, mesh_groups=plan), torch.tensor(4.0))
    torch.testing.assert_close(gtx.global_norm([r, x], 1.0, mesh_groups=plan), torch.tensor(4 * 7 + 3.0))


def test_pp_stages_add_and_tied_weight_counts_once():
    emb = torch.tensor([3.0, 4.0])
    block = torch.tensor([1.0])
    plan = mesh_groups({"emb": emb, "block": block}, comm=MirrorComm(2), pp_group="pp", tied={"emb": "pp"})
    # The grads given are the tied copies' sum already (what pp_reduce leaves), so the plan's norm is the model's.
    # Two stages: each holds a copy of emb (counted once overall) and its own block (counted per stage).
    torch.testing.assert_close(
        gtx.global_norm([block, emb], 2.0, mesh_groups=plan), torch.tensor(math.sqrt(25 + 2 * 1))
    )
    torch.testing.assert_close(gtx.global_norm([block, emb], math.inf, mesh_groups=plan), torch.tensor(4.0))


def test_empty_rank_still_joins_the_pp_reduction():
    comm = RecordingComm()
    plan = mesh_groups({}, comm=comm, pp_group="pp")
    norm = gtx.global_norm([], 2.0, mesh_groups=plan)
    assert float(norm) == 0.0 and [c.group for c in comm.calls] == ["pp"]


def test_mesh_dim_keys_dedupe_through_the_comm_group_id():
    class Resolving(RecordingComm):
        def group_id(self, group):
            return {"tp": "TP", "tensor": "TP"}.get(group, group)

    comm = Resolving()
    t = {"a": torch.ones(2), "b": torch.ones(2)}
    plan = mesh_groups(t, comm=comm, sharded={"a": "tp", "b": "tensor"})  # two names, one process group
    gtx.global_norm(leaves(t), 2.0, mesh_groups=plan)
    assert [c.group for c in comm.calls] == ["tp"]


# --- matching and errors ----------------------------------------------------------------------


def test_paths_are_dotted_and_keys_match_by_path_glob_or_predicate():
    params = {"layers": [{"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2)}], "head": torch.ones(3)}
    comm = RecordingComm()
    plan = mesh_groups(params, comm=comm, sharded={"layers.0.w": "a", "layers.*.w": "b", lambda p, x: x.ndim == 1: "c"})
    assert plan.paths == ["head", "layers.0.w", "layers.1.w"]
    assert plan.groups_of(0) == ("c",) and plan.groups_of(1) == ("a", "b") and plan.groups_of(2) == ("b",)


def test_plan_errors_name_the_argument_or_path():
    t = tree()
    with pytest.raises(TypeError, match="comm must implement"):
        mesh_groups(t, comm=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys \['l9.w'\] match no leaf; paths look like 'emb', 'l0.b'"):
        mesh_groups(t, comm=LocalComm(), sharded={"l9.w": "tp"})
    with pytest.raises(TypeError, match="sharded keys must be a dotted path"):
        mesh_groups(t, comm=LocalComm(), sharded={3: "tp"})
    with pytest.raises(ValueError, match=r"dim 2 is out of range for leaf \['l0.w'\]"):
        mesh_groups(t, comm=LocalComm(), sharded={"l0.w": Sharded("tp", dim=2)})
    with pytest.raises(ValueError, match=r"leaf at \['emb'\] is sharded over group 'tp' twice"):
        mesh_groups(t, comm=LocalComm(), sharded={"emb": "tp", "e*": "tp"})
    with pytest.raises(ValueError, match="tied weights need pp_group"):
        mesh_groups(t, comm=LocalComm(), tied={"emb": "pp"})
    with pytest.raises(ValueError, match="matches several tied keys"):
        mesh_groups(t, comm=LocalComm(), pp_group="pp", tied={"emb": "pp", "e*": "pp"})
    with pytest.raises(TypeError, match=r"leaf at \['x'\] is a int"):
        mesh_groups({"x": 3}, comm=LocalComm())


def test_step_checks_name_the_path_that_differs():
    t = tree()
    plan = mesh_groups(t, comm=LocalComm())
    flat = leaves(t)
    with pytest.raises(ValueError, match="built for 6 leaves, got 5"):
        gtx.global_norm(flat[:5], 2.0, mesh_groups=plan)
    bad = list(flat)
    bad[1] = torch.ones(7)  # flatten order: emb, l0.b, l0.w, ...
    with pytest.raises(ValueError, match=r"leaf at \['l0.b'\] has shape \(7,\), the mesh_groups plan has \(5,\)"):
        gtx.global_norm(bad, 2.0, mesh_groups=plan)
    tx = gtx.clip_by_global_norm(1.0, mesh_groups=plan)
    with pytest.raises(ValueError, match="clip_by_global_norm|global_norm"):
        tx.update({"only": torch.ones(1)}, tx.init(None))


def test_transforms_reject_a_plan_that_is_not_one():
    with pytest.raises(TypeError, match="clip_by_global_norm: mesh_groups must be a plan"):
        gtx.clip_by_global_norm(1.0, mesh_groups=object())
    with pytest.raises(TypeError, match="adaptive_clip: mesh_groups must be a plan"):
        gtx.adaptive_clip(0.1, mesh_groups="tp")
    with pytest.raises(TypeError, match="pp_reduce: mesh_groups must be a plan"):
        pp_reduce({"emb": "pp"})  # type: ignore[arg-type]


# --- adaptive_clip with a plan ------------------------------------------------------------------


def test_adaptive_clip_with_a_local_plan_equals_without():
    grads, params = tree(2), tree(3)
    plan = mesh_groups(params, comm=LocalComm(), sharded={"l1.w": Sharded("tp", dim=1)})
    a, _ = gtx.adaptive_clip(0.05).update(grads, gtx.EmptyState(), params)
    b, _ = gtx.adaptive_clip(0.05, mesh_groups=plan).update(grads, gtx.EmptyState(), params)
    assert_trees_close(b, a, rtol=1e-6)


@pytest.mark.parametrize("dim", [0, 1])
def test_adaptive_clip_units_span_ranks_only_when_split_along_dim_1(dim):
    g = torch.Generator().manual_seed(4)
    grad, weight = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g) * 0.5
    comm = RecordingComm(MirrorComm(2))
    plan = mesh_groups({"w": weight}, comm=comm, sharded={"w": Sharded("tp", dim=dim)})
    out, _ = gtx.adaptive_clip(0.5, mesh_groups=plan).update({"w": grad}, gtx.EmptyState(), {"w": weight})
    # The reference: the full tensor two identical shards make, clipped on one device.
    full_g, full_w = torch.cat([grad, grad], dim=dim), torch.cat([weight, weight], dim=dim)
    ref, _ = gtx.adaptive_clip(0.5).update({"w": full_g}, gtx.EmptyState(), {"w": full_w})
    expected = ref["w"].chunk(2, dim=dim)[0]
    torch.testing.assert_close(out["w"], expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(out["w"], grad)  # some unit really was clipped
    # Units split along dim 1 need one reduction (grads and weights together); along dim 0, none.
    assert [(c.group, c.num_tensors) for c in comm.calls] == ([("tp", 2)] if dim == 1 else [])


def test_adaptive_clip_one_unit_tensors_span_every_group():
    b = torch.tensor([3.0, 4.0])
    plan = mesh_groups({"b": b}, comm=MirrorComm(2), sharded={"b": Sharded("tp", dim=0)})
    (g_norm,), (w_norm,) = unitwise_norms(plan, [[b], [b * 2]], unitwise=True)
    torch.testing.assert_close(g_norm, torch.tensor(5.0 * math.sqrt(2)))
    torch.testing.assert_close(w_norm, torch.tensor(10.0 * math.sqrt(2)))


def test_adaptive_clip_needs_the_dim_of_a_manual_shard():
    plan = mesh_groups({"w": torch.ones(2, 2)}, comm=LocalComm(), sharded={"w": "tp"})
    with pytest.raises(
        ValueError, match=r"leaf at \['w'\] is declared sharded over 'tp' with no dim.*Sharded\(group, dim"
    ):
        gtx.adaptive_clip(0.1, mesh_groups=plan)
    gtx.adaptive_clip(0.1, unitwise=False, mesh_groups=plan)  # one unit per tensor: the dim does not matter


# --- pp_reduce --------------------------------------------------------------------------------


def test_pp_reduce_sums_tied_grads_only_and_is_pure():
    grads = {"emb": torch.tensor([1.0, 2.0]), "block": torch.tensor([5.0])}
    comm = RecordingComm(MirrorComm(2))
    plan = mesh_groups(grads, comm=comm, pp_group="pp", tied={"emb": "pp"})
    tx = pp_reduce(plan)
    out, _ = assert_pure(tx, grads, grads)
    assert torch.equal(out["emb"], torch.tensor([2.0, 4.0])) and torch.equal(out["block"], grads["block"])
    assert {(c.group, c.num_tensors) for c in comm.calls} == {("pp", 1)}


def _tied_plan():
    grads = {"emb": torch.tensor([3.0, 4.0]), "block": torch.tensor([1.0])}
    return grads, mesh_groups(grads, comm=MirrorComm(2), pp_group="pp", tied={"emb": "pp"})


def test_a_chain_with_pp_reduce_before_the_clip_is_planned_and_matches_the_hand_computed_norm():
    grads, plan = _tied_plan()
    tx = gtx.chain(pp_reduce(plan), gtx.clip_by_global_norm(1.0, mesh_groups=plan))
    out, state = tx.update(grads, tx.init(grads))
    # Two stages: the summed emb copy (6, 8) counted once, each stage's block once: sqrt(100 + 2).
    norm = math.sqrt(100.0 + 2.0)
    torch.testing.assert_close(state[1].grad_norm, torch.tensor(norm))
    torch.testing.assert_close(out["emb"], torch.tensor([6.0, 8.0]) / (norm + 1e-6))


@pytest.mark.parametrize(
    "reader",
    [
        lambda plan: gtx.clip_by_global_norm(1.0, mesh_groups=plan),
        lambda plan: gtx.adaptive_clip(0.1, mesh_groups=plan),
        lambda plan: gtx.masked(gtx.clip_by_global_norm(1.0, mesh_groups=plan), {"emb": True, "block": False}),
    ],
)
def test_a_chain_reading_tied_weights_without_pp_reduce_before_it_is_refused_when_built(reader):
    grads, plan = _tied_plan()
    unused = pp_reduce(plan)  # built, and left out of the chain: it silences nothing
    with pytest.raises(ValueError, match=r"chain: member 0 .*tied weights \(emb\).*no gradtx.pp_reduce\(plan\) comes"):
        gtx.chain(reader(plan), gtx.sgd(0.1))
    with pytest.raises(ValueError, match=r"member 1 .*comes only after it"):
        gtx.chain(gtx.scale(1.0), reader(plan), pp_reduce(plan))
    other = mesh_groups(grads, comm=MirrorComm(2), pp_group="pp", tied={"emb": "pp"})
    with pytest.raises(ValueError, match="member 1"):  # a pp_reduce of another plan does not count
        gtx.chain(pp_reduce(other), reader(plan))
    with pytest.raises(ValueError, match="member 0"):  # the wrapper plans its chain when built
        gtx.TransformedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), reader(plan))
    gtx.chain(unused, reader(plan))  # the same pp_reduce, in the chain before it: planned


def test_pp_reduce_without_tied_weights_issues_nothing():
    comm = RecordingComm()
    grads = {"block": torch.ones(2)}
    out, _ = pp_reduce(mesh_groups(grads, comm=comm, pp_group="pp")).update(grads, None)
    assert out["block"] is grads["block"] and comm.calls == []


def test_plan_repr_and_type():
    plan = mesh_groups(tree(), comm=LocalComm(), sharded={"l0.*": "tp"}, pp_group="pp")
    assert isinstance(plan, MeshGroups) and len(plan) == 6
    assert "['tp']x2" in repr(plan) and "pp_group='pp'" in repr(plan)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_global_norm_of_fp64_tensors_stays_fp64_and_exact(norm_type):
    grads = {k: v.double() for k, v in tree(5).items()}
    got = gtx.global_norm(grads, norm_type)
    expected = torch.nn.utils.get_total_norm(list(grads.values()), norm_type)
    assert got.dtype == torch.float64  # nothing is rounded to fp32
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


# --- the local pass: one pass over sums of p-th powers, accurate on long tensors --------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return abs(float(a.double()) / float(b) - 1.0)


@pytest.fixture
def two_threads():
    """torch's thread count 2 (the suite pins 1), so that helper threads share the rows where they can."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_long_tensor_norm_is_within_1e6_of_fp64(two_threads, norm_type):
    # All-positive values make one long fp32 running sum drift (torch's CPU norm is ~1e-4 off here).
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1 << 22, generator=gen) + 1.0
    few_rows = torch.rand(150_000, generator=gen) + 1.0  # just past the split: rows and a tail, summed with the rows
    small = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    leaves = {"x": x, "few_rows": few_rows, "small": small}
    expected = torch.linalg.vector_norm(torch.cat([v.double().reshape(-1) for v in leaves.values()]), norm_type)
    got = gtx.global_norm(leaves, norm_type)
    assert got.dtype == torch.float32
    assert _rel(got, expected) <= (1e-6 if norm_type != 3.0 else 2e-5)  # a cube rounds in fp32 per element


def test_grads_with_few_mantissa_bits_are_within_1e7_of_fp64(two_threads):
    # The fp32 grads of a bf16 autocast hold bf16 values: their squares tie when rounded, so one long fp32
    # sum drifts one way (rows of 64K elements were 3e-6 off here, torch's norm 3e-5).
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn((1 << 20) + 5, generator=gen).bfloat16().float(), torch.randn(300, generator=gen)]
    expected = torch.linalg.vector_norm(torch.cat([t.double() for t in leaves]))
    got = gtx.global_norm(leaves)
    assert got.dtype == torch.float32 and _rel(got, expected) <= 2e-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_long_tensor_accumulates_in_fp32(two_threads, dtype):
    # 80 rows of 32K elements and a tail shorter than a row, copied to fp32 in 512K-element pieces.
    x = (torch.rand((5 << 19) + 3, generator=torch.Generator().manual_seed(2)) + 1.0).to(dtype)
    expected = torch.linalg.vector_norm(x.double())
    got = gtx.global_norm([x])
    # Quantized all-positive squares make fp32 row sums drift a little (1.2e-5 here for bf16's 8-bit
    # mantissa); the low-precision running sum of torch's own norm is 100x further off.
    assert got.dtype == torch.float32 and _rel(got, expected) <= 2e-5
    assert _rel(got, expected) * 20 < _rel(torch.linalg.vector_norm(x).float(), expected)


def test_rows_of_every_dtype_are_summed_in_one_pass(two_threads):
    gen = torch.Generator().manual_seed(6)
    leaves = [
        torch.randn(1 << 21, generator=gen),
        torch.randn((1 << 21) + 9, generator=gen).bfloat16(),
        torch.randn(1 << 20, generator=gen).half(),
        torch.randn(5, 3, generator=gen).bfloat16(),
        torch.randn(11, generator=gen),
    ]
    expected = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in leaves]))
    assert _rel(gtx.global_norm(leaves), expected) <= 2e-5  # low-precision squares drift a little (see above)
    from gradtx.core import norms

    sums = norms.tensor_powsums(leaves, 2.0)
    for t, s in zip(leaves, sums):
        bound = 1e-6 if t.dtype == torch.float32 else 2e-5
        assert s.dtype == torch.float64 and _rel(s, t.double().square().sum()) <= bound


def _big_grads(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(n, generator=gen) * 1e-3).to(dtype) for n in (3 << 20, (1 << 20) + 5, 1 << 18, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_row_and_tail_is_counted_once(two_threads, dtype):
    # Tensors of 2.0 have exact row sums (n * 2**p) in every dtype used here, so a row or tail dropped
    # or counted twice is off by at least 1 element of a tensor (1.5e-6 for the largest, 655K elements of
    # bf16), past the 1e-6 allowed for the small low-precision tensors' norms raised to the p.
    from gradtx.core import norms

    row = norms._ROW if dtype == torch.float32 else norms._LOW_ROW  # (fp64 is never split)
    offsets = [-1, 0, 1, row - 1, row, row + 1, 4 * row + 1, 7 * row + 3, 16 * row + 5]
    sizes = [norms._MIN_ROWS + n for n in offsets]  # at and past the size from which a CPU tensor is split
    leaves = [torch.full((n,), 2.0, dtype=dtype) for n in sizes]
    for p in (1.0, 2.0, 3.0):
        sums = norms.tensor_powsums(leaves, p)
        for n, got in zip(sizes, sums):
            assert _rel(got, torch.tensor(n * 2.0**p)) <= 1e-6, (n, p)
        expected = (sum(sizes) * 2.0**p) ** (1 / p)
        # (each tensor's fp32 norm is rounded once before the p-th powers are added: 3 x 6e-8 for a cube)
        bound = 1e-7 if p != 3.0 else 2e-7
        assert _rel(gtx.global_norm(leaves, p), torch.tensor(expected, dtype=torch.float64)) <= bound


def test_the_pass_ignores_the_default_device(two_threads):
    # Buffers and results of the CPU pass are made on the tensors' device, not torch's default one.
    x = torch.randn((1 << 21) + 3, generator=torch.Generator().manual_seed(7))
    leaves = [x, x.bfloat16(), torch.randn(1 << 18)]
    expected = gtx.global_norm(leaves)
    with torch.device("meta"):
        got = gtx.global_norm(leaves)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_compiled_norm_of_big_tensors_traces_in_one_graph():
    # Big tensors are summed by rows under dynamo too (by the norm kernel: it cannot trace powsum).
    grads = _big_grads()
    compiled = torch.compile(gtx.global_norm, fullgraph=True)
    torch.testing.assert_close(compiled(grads), gtx.global_norm(grads), rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0])
def test_a_gradient_flows_through_the_clip(norm_type):
    # Meta-learning through the clip: torch.func.grad and plain autograd, on a big leaf (the rows
    # path) and a small one, against the clip written with torch's own norm.
    gen = torch.Generator().manual_seed(5)
    grads = {"w": torch.randn(1 << 18, generator=gen), "b": torch.randn(7, generator=gen)}
    probe = {k: torch.randn(v.shape, generator=gen) for k, v in grads.items()}
    clip = gtx.clip_by_global_norm(1.0, norm_type=norm_type)

    def loss(g):
        updates, _ = clip.update(g, clip.init(g))
        return sum((updates[k] * probe[k]).sum() for k in g)

    def reference(g):
        norm = torch.linalg.vector_norm(torch.cat([g["w"], g["b"]]), norm_type)
        coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        return sum((g[k] * coef * probe[k]).sum() for k in g)

    expected = torch.func.grad(reference)(grads)
    assert_trees_close(torch.func.grad(loss)(grads), expected, rtol=1e-5, atol=1e-7)
    leaves_ = {k: v.clone().requires_grad_() for k, v in grads.items()}
    loss(leaves_).backward()
    assert_trees_close({k: v.grad for k, v in leaves_.items()}, expected, rtol=1e-5, atol=1e-7)


def test_tensor_powsums_are_the_additive_form():
    from gradtx.core import norms

    x, y = torch.tensor([3.0, -4.0]), torch.empty(0)
    sq, empty = norms.tensor_powsums([x, y], 2.0)
    assert float(sq) == 25.0 and float(empty) == 0.0 and sq.dtype == torch.float64
    assert [float(s) for s in norms.tensor_powsums([x, y], math.inf)] == [4.0, 0.0]


def test_global_norm_under_vmap_uses_plain_ops():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    for p in (1.0, 2.0, math.inf):
        got = torch.func.vmap(lambda row, p=p: gtx.global_norm({"a": row[:2], "b": row[2:]}, p))(x)
        torch.testing.assert_close(got, torch.linalg.vector_norm(x, p, dim=1), rtol=1e-6, atol=0)


def test_per_example_grads_of_the_norm_under_vmap_of_grad():
    # Under vmap(grad(f)) a shard is a grad-tracking tensor with the batched one inside: the foreach norm (no
    # batching rule) raised here. Reference: autograd of torch's norm in fp64, example by example.
    x = torch.randn(3, 1 << 16, generator=torch.Generator().manual_seed(5))
    for p in (1.0, 2.0):
        got = torch.func.vmap(torch.func.grad(lambda row, p=p: gtx.global_norm({"a": row[:100], "b": row[100:]}, p)))(x)
        want = torch.stack([torch.func.grad(lambda r, p=p: torch.linalg.vector_norm(r, p))(row.double()) for row in x])
        torch.testing.assert_close(got, want.float(), rtol=2e-6, atol=1e-12)


# --- the reductions: one per group ---------------------------------------------------------------


def test_one_reduction_per_group_in_the_plans_order():
    grads = {"colwise": torch.ones(4, 2), "experts": torch.ones(3), "norm": torch.ones(2), "rowwise": torch.ones(2, 4)}
    comm = RecordingComm()
    plan = mesh_groups(grads, comm=comm, sharded={"colwise": "tp", "rowwise": "tp", "experts": "ep"})
    norm = gtx.global_norm(leaves(grads), 2.0, mesh_groups=plan)
    torch.testing.assert_close(norm, gtx.global_norm(grads))
    assert [c.group for c in comm.calls] == ["tp", "ep"]  # the plan's order: first appearance


def test_a_grad_sharded_over_two_groups_is_reduced_over_each_once():
    grads = {"w": torch.ones(4, 2), "b": torch.ones(2)}
    comm = RecordingComm()
    plan = mesh_groups(grads, comm=comm, sharded={"w": ["dp", "tp"], "b": "dp"})
    gtx.global_norm(leaves(grads), 2.0, mesh_groups=plan)
    # w and b over dp first, then w over tp: one collective per group, in levels (w needs both).
    assert [(c.group, c.num_tensors) for c in comm.calls] == [("dp", 2), ("tp", 1)]
    mirrored = mesh_groups(grads, comm=MirrorComm(2), sharded={"w": ["dp", "tp"], "b": "dp"})
    torch.testing.assert_close(
        gtx.global_norm(leaves(grads), 2.0, mesh_groups=mirrored), torch.tensor(math.sqrt(4 * 8 + 2 * 2.0))
    )


def test_a_pipeline_chain_whose_clip_has_no_plan_is_refused_when_built():
    _, plan = _tied_plan()
    with pytest.raises(
        ValueError, match=r"chain: member 1 computes a norm with no plan.*member 0 is a gradtx.pp_reduce"
    ):
        gtx.chain(pp_reduce(plan), gtx.clip_by_global_norm(1.0))
    gtx.chain(pp_reduce(plan), gtx.clip_by_global_norm(1.0, mesh_groups=plan))  # the same plan: built


def test_import_gradtx_leaves_the_test_harness_out():
    import subprocess
    import sys

    code = "import sys, gradtx; assert 'gradtx.testing' not in sys.modules; gradtx.testing.RecordingComm"
    subprocess.run([sys.executable, "-c", code], check=True)
    from pathlib import Path

    root = Path(gtx.__file__).parent
    named = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.parts[len(root.parts)] != "testing"
        and p.name != "local_ranks.py"
        and any(w in p.read_text() for w in ("LocalTensor", "_local_tensor"))
    ]
    # only gradtx/testing/ and the one adapter, gradtx/comm/local_ranks.py. The two left are the Muon exchange's
    # and the checkpoint's simulated branches, which their own streams take out: empty this set when they land.
    assert set(named) <= {"optimizers/muon/exchange.py", "checkpoint/functional.py"}, named
