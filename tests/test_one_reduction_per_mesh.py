"""One reduction per mesh: the zero-config norm of DTensors on one root mesh over the world, in one collective.

Each bucket's local sum of p-th powers is divided by its replica count (the world size over the sizes of
the groups it is sharded over) and the parts are summed over the world once (a max for ``inf``). These
tests try to break that on simulated 3-D meshes (torch's ``LocalTensorMode``, every rank in this
process): ``_StridedShard``, uneven and empty shards, leaves on sub-meshes and on a flattened sub-mesh,
leaves replicated on every dim, plain replicas, fp64 and bf16, the precomputed-powsums path, the
wrapper. Every norm is checked against ``torch.linalg.vector_norm`` of the full tensors, bitwise equal on
every simulated rank, and against the per-dim rounds of the declared plan of the same placements.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
from collections.abc import Sequence

import optree
import pytest
import torch

import gradtx as gtx
from gradtx import testing

pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed._local_tensor import LocalTensor, local_tensor_mode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from gradtx.comm.torch_dist import TorchComm
from gradtx.distributed.global_norm import from_placements
from gradtx.distributed.plan import MeshGroups
from gradtx.testing.simulated import _coords, _local_shard

P = (1.0, 2.0, 3.0, math.inf)


@pytest.fixture
def calls(monkeypatch):
    """Every all-reduce a TorchComm issues: (group key, number of tensors)."""
    seen: list[tuple[object, int]] = []
    start = TorchComm.all_reduce

    def spy(self, tensors, op, group):
        seen.append((group, len(tensors)))
        return start(self, tensors, op, group)

    monkeypatch.setattr(TorchComm, "all_reduce", spy)
    return seen


def _randn(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # One full tensor: under a simulated mesh each rank would draw its own numbers from the generator in turn.
    g = torch.Generator().manual_seed(seed)
    mode = local_tensor_mode()
    with mode.disable() if mode is not None else contextlib.nullcontext():
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _on(full: torch.Tensor, root, dims: Sequence[str], placements: Sequence, *, flatten: str | None = None) -> DTensor:
    """``full`` as a DTensor on the sub-mesh ``root[dims]`` (flattened into one dim named ``flatten``), every
    simulated rank holding the shard its root coordinates give; the leaf is replicated over the other dims."""
    names = root.mesh_dim_names
    index = [names.index(d) for d in dims]
    sizes = [root.size(i) for i in index]
    sub = root[tuple(dims)] if len(dims) > 1 else root[dims[0]]
    if flatten is not None:
        sub = sub._flatten(flatten)
    coords = _coords(root)

    def coord(r: int) -> tuple[int, ...]:
        c = tuple(coords[r][i] for i in index)
        if flatten is None:
            return c
        flat = 0
        for x, n in zip(c, sizes):
            flat = flat * n + x
        return (flat,)

    shape = (math.prod(sizes),) if flatten is not None else tuple(sizes)
    local = local_tensor_mode().rank_map(lambda r: _local_shard(full, shape, placements, coord(r)))
    spec = DTensorSpec(sub, tuple(placements), TensorMeta(full.shape, full.stride(), full.dtype))
    return DTensor(local, spec, requires_grad=False)


def _values(norm: torch.Tensor) -> dict[int, torch.Tensor]:
    local = norm.to_local() if isinstance(norm, DTensor) else norm
    return dict(local._local_tensors) if isinstance(local, LocalTensor) else {0: local}


def _reference(full: dict[str, torch.Tensor], p: float) -> torch.Tensor:
    """The single-device norm, in fp64."""
    return torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in full.values()]), p)


def _check(norm: torch.Tensor, full: dict[str, torch.Tensor], p: float, *, rtol: float, what: str) -> torch.Tensor:
    """Every rank holds the same bits, and they are the single-device norm; returns the value."""
    values = _values(norm)
    first = next(iter(values.values()))
    for rank, v in values.items():
        assert v.dtype == first.dtype and torch.equal(v, first), f"{what}: rank {rank} holds {v}, rank 0 {first}"
    torch.testing.assert_close(first.double(), _reference(full, p), rtol=rtol, atol=0, msg=what)
    return first


def _dp_tp_ep(mesh):
    """FSDP2 over TP (a _StridedShard), row-wise TP, experts over ep and fsdp (uneven), norms on the dp sub-mesh,
    a bias on (dp, tp), a tiny leaf whose shards are mostly empty, replicated and plain leaves."""
    full = {
        "wq": _randn(1, (8, 6)),
        "wo": _randn(2, (6, 8)),
        "experts.w": _randn(3, (3, 5, 2)),
        "ln": _randn(4, (5,)),
        "bias": _randn(5, (6,)),
        "tiny": _randn(6, (1, 1)) * 4,
        "scale": _randn(7, ()),
        "gate": _randn(8, (3,)) * 3,
    }
    layout = {
        "wq": [_StridedShard(0, split_factor=1), Shard(0), Replicate()],
        "wo": [Shard(0), Shard(1), Replicate()],
        "experts.w": [Shard(1), Replicate(), Shard(0)],
        "tiny": [Shard(0), Shard(1), Replicate()],
    }
    d = testing.distribute({k: full[k] for k in layout}, mesh, layout)
    d["ln"] = _on(full["ln"], mesh, ["dp"], [Shard(0)])
    d["bias"] = _on(full["bias"], mesh, ["dp", "tp"], [Shard(0), Replicate()])
    d["scale"] = testing.distribute({"s": full["scale"]}, mesh, {"s": [Replicate()] * 3})["s"]
    d["gate"] = local_tensor_mode().rank_map(lambda r: full["gate"].clone())  # a plain replica (DDP's layout)
    return full, {k: d[k] for k in full}


def _dp_cp_tp(mesh):
    """TP x FSDP2 with CP (params replicated over cp), a leaf on the (cp, tp) sub-mesh, one on a flattened
    (dp, cp) sub-mesh, uneven rows, a leaf replicated on every dim that holds the largest magnitude."""
    full = {
        "w": _randn(11, (7, 6)),
        "v": _randn(12, (4, 5)),
        "ln": _randn(13, (3,)),
        "cp_tp": _randn(14, (5, 3)),
        "emb": _randn(15, (9, 2)),
        "rep": _randn(16, (4,)) * 10,
    }
    layout = {
        "w": [Shard(0), Replicate(), Shard(1)],
        "v": [Shard(1), Replicate(), Shard(0)],
        "rep": [Replicate(), Replicate(), Replicate()],
    }
    d = testing.distribute({k: full[k] for k in layout}, mesh, layout)
    d["ln"] = _on(full["ln"], mesh, ["dp"], [Shard(0)])
    d["cp_tp"] = _on(full["cp_tp"], mesh, ["cp", "tp"], [Shard(1), Shard(0)])
    d["emb"] = _on(full["emb"], mesh, ["dp", "cp"], [Shard(0)], flatten="dp_cp")
    return full, {k: d[k] for k in full}


CASES = [
    pytest.param(("dp", "tp", "ep"), _dp_tp_ep, id="dp_tp_ep"),
    pytest.param(("dp", "cp", "tp"), _dp_cp_tp, id="dp_cp_tp"),
]


@pytest.mark.parametrize("names, build", CASES)
def test_one_collective_on_a_3d_mesh_is_the_single_device_norm_on_every_rank(calls, names, build):
    with testing.simulated_mesh((2, 2, 2), names) as mesh:
        full, grads = build(mesh)
        leaves = optree.tree_leaves(grads)
        plan = from_placements(leaves, what="test")
        assert plan is not None and plan.flat is not None and plan.flat[0] == "world", plan
        assert plan.num_collectives() == 1
        declared = gtx.mesh_groups(grads)  # the same placements, reduced one mesh dim at a time
        assert declared.flat is None and declared.num_collectives() >= 2
        for p in P:
            calls.clear()
            flat = _check(gtx.global_norm(grads, p), full, p, rtol=1e-6, what=f"p={p}")
            assert calls == [("world", 1)], (p, calls)  # one collective of one value
            if p in (2.0, math.inf):  # (each simulated norm costs ~0.5 s: the other paths on two orders)
                calls.clear()
                per_dim = _check(
                    gtx.global_norm(leaves, p, mesh_groups=declared), full, p, rtol=1e-6, what=f"declared p={p}"
                )
                assert len(calls) == declared.num_collectives(), (p, calls)
                torch.testing.assert_close(flat, per_dim, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fp64_and_bf16_leaves(calls, dtype):
    full = {"w": _randn(21, (6, 5), dtype), "ln": _randn(22, (5,), dtype), "r": _randn(23, (3,), dtype)}
    with testing.simulated_mesh((2, 2, 2), ("dp", "tp", "ep")) as mesh:
        grads = testing.distribute({"w": full["w"], "r": full["r"]}, mesh, {"w": [Shard(0), Shard(1), Replicate()]})
        grads["ln"] = _on(full["ln"], mesh, ["dp"], [Shard(0)])
        for p in P:
            calls.clear()
            norm = gtx.global_norm(grads, p)
            assert calls == [("world", 1)], calls
            expected = torch.float64 if dtype == torch.float64 else torch.float32
            assert _values(norm)[0].dtype == expected
            _check(norm, full, p, rtol=1e-13 if dtype == torch.float64 else 1e-6, what=f"{dtype} p={p}")


@pytest.mark.parametrize("p", P)
def test_leaves_in_several_dtypes_and_a_long_one_count_each_in_its_own_bucket(calls, p):
    """The local pass groups leaves by dtype and reads a long CPU tensor by rows, out of the leaves' order: each
    leaf's part must still land in its own bucket (a plain leaf after the reduction, a tied one weighted)."""
    full = {
        "w16": _randn(91, (4, 6), torch.bfloat16),
        "long": _randn(92, (2, 1 << 17)),  # 128K elements a rank: read by rows
        "ln": _randn(93, (5,), torch.bfloat16),
        "w": _randn(94, (6, 4)) * 7,
    }
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        layout = {"w16": [Shard(0), Shard(1)], "long": [Replicate(), Shard(0)], "w": [Shard(1), Shard(0)]}
        grads = testing.distribute({k: full[k] for k in layout}, mesh, layout)
        grads["ln"] = _on(full["ln"], mesh, ["dp"], [Shard(0)])
        grads = {k: grads[k] for k in full}
        plan = gtx.mesh_groups(grads)
        for norm in (gtx.global_norm(grads, p), gtx.global_norm(grads, p, mesh_groups=plan)):
            _check(norm, full, p, rtol=1e-6, what=f"p={p}")
        grads["x"] = local_tensor_mode().rank_map(lambda r: torch.full((3,), 100.0 * (r + 1)))
        for r, value in _values(gtx.global_norm(grads, p)).items():  # a plain leaf stays each rank's own
            torch.testing.assert_close(
                value.double(), _reference({**full, "x": torch.full((3,), 100.0 * (r + 1))}, p), rtol=1e-6, atol=0
            )


def test_transforms_that_read_the_norm_match_one_device_through_the_one_reduction(calls):
    # The clip, a spike guard and the finite guard read the flat norm (tests/test_simulated_matrix.py runs
    # every transform on 3-D and 4-D meshes; here the 3-D mesh holds a _StridedShard and p = 3).
    def layout(path, leaf):
        if leaf.ndim >= 2:
            return (
                [_StridedShard(0, split_factor=1), Shard(0), Replicate()]
                if path == "w"
                else [Shard(1), Shard(0), Replicate()]
            )
        return [Shard(0), Replicate(), Replicate()] if leaf.ndim else [Replicate()] * 3

    params = {"w": _randn(31, (6, 4)), "v": _randn(32, (3, 5)), "b": _randn(33, (3,)), "s": _randn(34, ())}
    grads_seq = [
        {k: _randn(40 + i * 10 + j, t.shape) * (1 + 3 * i) for j, (k, t) in enumerate(params.items())} for i in range(2)
    ]
    txs = [
        gtx.clip_by_global_norm(0.7, norm_type=3.0),
        gtx.skip_spikes(gtx.sgd(0.1), warmup_steps=1, z_thresh=0.5),
        gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(1.0, norm_type=math.inf), gtx.sgd(0.1)), 2),
    ]
    with testing.simulated_mesh((2, 2, 2), ("dp", "tp", "ep")) as mesh:
        for tx in txs:
            testing.assert_matches_single_device(tx, grads_seq, params, mesh=mesh, layout=layout)
        # a clip step issues the one norm reduction and nothing else
        grads = testing.distribute(grads_seq[0], mesh, layout)
        tx = gtx.clip_by_global_norm(1.0)
        calls.clear()
        tx.update(grads, tx.init(grads))
        assert calls == [("world", 1)], calls


def test_the_wrapper_clips_by_the_one_reduction(calls):
    full = {"w": _randn(51, (8, 6)), "b": _randn(52, (5,))}
    layout = {"w": [_StridedShard(0, split_factor=1), Shard(0), Replicate()], "b": [Shard(0), Replicate(), Replicate()]}
    with testing.simulated_mesh((2, 2, 2), ("dp", "tp", "ep")) as mesh:
        params = {k: torch.nn.Parameter(v) for k, v in testing.distribute(full, mesh, layout).items()}
        opt = gtx.TransformedOptimizer(torch.optim.SGD(list(params.values()), lr=0.1), gtx.clip_by_global_norm(1.0))
        grads = testing.distribute(full, mesh, layout)  # the grads equal the params: easy to check
        for k, p in params.items():
            p.grad = grads[k]
        calls.clear()
        opt.step()
        assert calls == [("world", 1)], calls
        coef = min(1.0, 1.0 / (float(_reference(full, 2.0)) + 1e-6))
        for k, p in params.items():
            for rank, t in p.full_tensor()._local_tensors.items():
                torch.testing.assert_close(t, full[k] * (1 - 0.1 * coef), msg=f"{k} on rank {rank}")


def test_what_keeps_one_collective_per_dim(calls):
    full = {"w": _randn(61, (4, 6)), "x": _randn(62, (6, 4))}
    # one sharded group: one collective either way, over that group
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        grads = testing.distribute(full, mesh, {"w": [Shard(0), Replicate()], "x": [Shard(1), Replicate()]})
        plan = from_placements(optree.tree_leaves(grads), what="test")
        assert plan.flat is None and plan.num_collectives() == 1
        calls.clear()
        _check(gtx.global_norm(grads, 2.0), full, 2.0, rtol=1e-6, what="one group")
        assert calls == [("dp", 1)], calls
    # two root meshes over the same ranks: their dims are not known to be one mesh's, so one per group
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        grads = {
            "w": testing.distribute({"w": full["w"]}, mesh, {"w": [Shard(0), Shard(1)]})["w"],
            "x": testing.distribute({"x": full["x"]}, other, {"x": [Replicate(), Shard(0)]})["x"],
        }
        plan = from_placements(optree.tree_leaves(grads), what="test")
        assert plan.flat is None
        for p in P:
            calls.clear()
            _check(gtx.global_norm(grads, p), full, p, rtol=1e-6, what=f"two roots p={p}")
            assert len(calls) == plan.num_collectives() == 2, calls


@pytest.mark.parametrize("p", [2.0, float("inf")])
def test_plain_leaves_beside_two_sharded_dims_stay_each_ranks_own(calls, p):
    """An undeclared plain grad is each rank's own (no collective): one sum over the mesh would average it."""
    full = {"w": _randn(71, (4, 2)), "v": _randn(72, (2, 4))}
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        grads = testing.distribute(full, mesh, {"w": [Shard(0), Replicate()], "v": [Replicate(), Shard(1)]})
        grads["x"] = local_tensor_mode().rank_map(lambda r: torch.full((2,), 3.0 * (r + 1)))
        norm = _values(gtx.global_norm(grads, p))
        for r, value in norm.items():  # each rank: the sharded leaves' global norm with its own plain leaf
            torch.testing.assert_close(value.double(), _reference({**full, "x": torch.full((2,), 3.0 * (r + 1))}, p))
        assert calls == [("world", 1)], calls  # still one reduction over the mesh, x added after it


@pytest.mark.parametrize("p", [2.0, float("inf")])
def test_a_mesh_dim_no_leaf_has_is_not_summed_over(calls, p):
    """A pipeline over one world mesh: each stage holds its own layer on the (dp, tp) sub-mesh, so the ranks that
    differ in the stage dim hold different values. Each stage's norm is its own layer's, as the declared plan
    gives; one sum over the world would mix the stages'."""
    layers = [_randn(81, (4, 6)), _randn(82, (4, 6)) * 3]
    with testing.simulated_mesh((2, 2, 2), ("stage", "dp", "tp")) as mesh:
        sub, coords, placements = mesh["dp", "tp"], _coords(mesh), (Shard(0), Shard(1))
        local = local_tensor_mode().rank_map(
            lambda r: _local_shard(layers[coords[r][0]], (2, 2), placements, coords[r][1:])
        )
        meta = TensorMeta(layers[0].shape, layers[0].stride(), layers[0].dtype)
        grads = {"w": DTensor(local, DTensorSpec(sub, placements, meta), requires_grad=False)}
        plan = from_placements(optree.tree_leaves(grads), what="test")
        assert plan is not None and plan.flat is None
        for norm in (gtx.global_norm(grads, p), gtx.global_norm(grads, p, mesh_groups=gtx.mesh_groups(grads))):
            for r, value in _values(norm).items():
                torch.testing.assert_close(
                    value.double(), _reference({"w": layers[coords[r][0]]}, p), rtol=1e-6, atol=0
                )
        assert {group for group, _ in calls} == {"dp", "tp"}, calls  # never over the stage dim


class _SizedComm:
    """A picklable comm that only knows group sizes (no reduction is run here)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes

    def all_reduce(self, tensors, op, group):  # pragma: no cover - not called
        raise AssertionError("no collective expected")

    def size(self, group):
        return self.sizes[group]

    def rank(self, group):  # pragma: no cover - not called
        return 0

    def group_id(self, group):
        return ("name", group)


def test_a_plan_with_one_reduction_pickles_copies_and_reprs():
    leaves = {"w": torch.zeros(4, 6), "b": torch.zeros(4), "s": torch.zeros(())}
    comm = _SizedComm({"world": 8, "dp": 2, "tp": 2})
    plan = gtx.mesh_groups(leaves, comm=comm, sharded={"w": ["dp", "tp"], "b": "dp"}, plain="replicated")
    assert plan.flat is None  # a declared plan keeps the per-dim rounds
    flat = MeshGroups(plan.comm, [plan.leaf(i) for i in range(len(plan))], None, plan.device, plan.plain, flat="world")
    assert flat.flat == ("world", (4, 8, 2)) and flat.num_collectives() == 1  # b: 8 / 2, s: whole, w: 8 / (2 * 2)
    for other in (pickle.loads(pickle.dumps(flat)), copy.deepcopy(flat)):
        assert other.flat == flat.flat and other.num_collectives() == 1 and repr(other) == repr(flat)
        assert other.group_order == flat.group_order and other.paths == flat.paths
    # a world whose size the shards do not divide cannot count replicas: the per-dim rounds stay
    odd = MeshGroups(_SizedComm({"world": 6, "dp": 2, "tp": 2}), flat._leaves, None, plan.device, flat="world")
    assert odd.flat is None and odd.num_collectives() == 2


def test_grads_on_two_equal_root_meshes_are_one_mesh(calls):
    # An op's output DTensor takes its spec from torch's sharding-propagation cache, which may hold an
    # earlier mesh equal to the one the input lives on (the same grid built twice): the grads of one
    # model then name two root objects for one grid. Equal roots are one mesh: still one reduction.
    full = {"w": _randn(71, (4, 6)), "ln": _randn(72, (6,))}
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        earlier = testing.distribute({"w": full["w"]}, mesh, {"w": [Shard(0), Shard(1)]})["w"] * 1.0
        again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert again == mesh and again is not mesh
        w = testing.distribute({"w": full["w"] / 2}, again, {"w": [Shard(0), Shard(1)]})["w"] * 2.0
        grads = {"w": w, "ln": _on(full["ln"], again, ["dp"], [Shard(0)])}
        roots = {id(t.device_mesh._get_root_mesh()) for t in grads.values()}
        assert len(roots) == 2  # w's spec came from the cache entry of `earlier`, on `mesh`
        del earlier
        plan = from_placements(optree.tree_leaves(grads), what="test")
        assert plan.flat is not None and plan.num_collectives() == 1, plan
        for p in P:
            calls.clear()
            _check(gtx.global_norm(grads, p), full, p, rtol=1e-6, what=f"p={p}")
            assert calls == [("world", 1)], (p, calls)


@pytest.mark.parametrize("layout", ["tp_fsdp", "hsdp", "ep_fsdp", "fsdp"])
def test_a_zero_config_norm_on_one_mesh_is_one_collective(calls, layout):
    # Every leaf on the one mesh that spans the world: each bucket's part over its replica count, one
    # sum (or max) over the world (or over the one sharded dim), equal to the single-device norm.
    full = {
        k: _randn(3 + i, s)
        for i, (k, s) in enumerate({"w": (8, 6), "expert_w": (4, 6, 2), "norm": (6,), "b": (3,)}.items())
    }
    shape, names = ((4,), ("dp",)) if layout == "fsdp" else ((2, 2), ("dp", "tp"))
    with testing.simulated_mesh(shape, names) as mesh:
        grads = testing.distribute(full, mesh, layout)
        for p in (1.0, 2.0, math.inf):
            calls.clear()
            norm = gtx.global_norm(grads, p)
            assert len(calls) == 1 and calls[0][1] == 1, (p, calls)  # one collective of one value
            if layout in ("tp_fsdp", "ep_fsdp"):  # sharded over two dims: over the world, not one per dim
                assert calls[0][0] == "world", calls
            expected = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in full.values()]), p)
            for rank, value in _values(norm).items():
                torch.testing.assert_close(value, expected, rtol=1e-6, atol=0, msg=f"rank {rank}, p={p}")
