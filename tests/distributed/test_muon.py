"""Muon on sharded matrices, 4 gloo ranks: every layout gives the single-device params and momentum.

For each layout (FSDP2 ``Shard(0)`` with uneven shards, TP colwise and rowwise,
TP x FSDP2 with ``_StridedShard``, EP x FSDP2 with stacked experts, HSDP) the
params and grads are DTensors made with ``distribute_tensor``; several
``gtx.muon`` steps run through ``tx.update`` + ``apply_updates`` and the full
params, the full momentum and the step count are compared with the same steps
on one device, and with the same steps on a simulated mesh (one process playing the 4 ranks: the same
exchange, rank by rank). The all-to-alls the step issues are counted (``RecordingComm``)
and their bytes compared with :func:`gradtx.exchange_plan`. Also: the
wrapper with an inner SGD, ``inject_hyperparams``, and a DCP checkpoint saved
under FSDP2 and loaded under TP x FSDP2.
"""

from __future__ import annotations

import functools
import math
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import gradtx as gtx
from gradtx.comm.torch_dist import mesh_comm
from gradtx.optimizers.muon import exchange_plan
from gradtx.testing import RecordingComm
from tests.distributed.harness import part_results, share_spawn

WORLD = 4
STEPS = 3
DN = gtx.MuonDimensionNumbers
# Heads (H, out, in) with the head as a batch axis, and stacked experts (E, out, in).
DIMS = {"w1": DN(), "w2": DN(), "w3": DN(), "heads": DN(2, 1), "experts": DN(2, 1), "experts_ep": DN(2, 1), "b": None}


DIMS_AT = {k: i for i, k in enumerate(sorted(DIMS))}  # a leaf's position in optree's order: exchange_plan's owners


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (16, 8), "w2": (8, 12), "w3": (7, 5), "heads": (3, 6, 4), "experts": (4, 6, 8),
              "experts_ep": (6, 5, 3), "b": (8,)}  # fmt: skip
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _grads() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{k: torch.randn(v.shape, generator=g) for k, v in _params().items()} for _ in range(STEPS)]


# Mesh -> (shape, dim names); each layout: leaf -> (mesh, placements). Built the same way under torchrun and on
# a simulated mesh, so the two runs can be compared rank by rank.
MESHES = {
    "dp": ((4,), ("dp",)),
    "tp": ((4,), ("tp",)),
    "dp_tp": ((2, 2), ("dp", "tp")),
    "ep_dp": ((2, 2), ("ep", "dp")),
}
LAYOUTS: dict[str, dict[str, tuple[str, list[Any]]]] = {
    "fsdp": {k: ("dp", [Shard(0)]) for k in DIMS},  # w3 (7 rows) and heads (3) are uneven; one rank has no head
    "tp": {
        "w1": ("tp", [Shard(0)]),
        "w2": ("tp", [Shard(1)]),
        "w3": ("tp", [Shard(1)]),
        "heads": ("tp", [Shard(1)]),
        "experts": ("tp", [Shard(2)]),
        "experts_ep": ("tp", [Shard(0)]),
        "b": ("tp", [Replicate()]),
    },
    "tp_fsdp": {
        "w1": ("dp_tp", [_StridedShard(0, split_factor=2), Shard(0)]),  # colwise TP, then FSDP2 on dim 0
        "w2": ("dp_tp", [Shard(0), Shard(1)]),  # rowwise TP, FSDP2 on dim 0
        "w3": ("dp_tp", [Shard(0), Shard(1)]),
        "heads": ("dp_tp", [Shard(0), Shard(1)]),
        "experts": ("dp_tp", [Shard(0), Shard(2)]),
        "experts_ep": ("dp_tp", [Replicate(), Shard(1)]),  # HSDP-like: a replicated dim
        "b": ("dp_tp", [Shard(0), Replicate()]),
    },
    "ep_fsdp": {
        "w1": ("dp_tp", [Shard(1), Shard(0)]),
        **{k: ("dp_tp", [Replicate(), Replicate()]) for k in ("w2", "w3", "b")},
        "heads": ("ep_dp", [Shard(0), Replicate()]),
        "experts": ("ep_dp", [Shard(0), Shard(1)]),  # experts over EP, FSDP2 on out
        # 6 experts over EP and DP: 3 per EP rank, then 2 and 1: whole matrices, uneven, no exchange.
        "experts_ep": ("ep_dp", [Shard(0), Shard(0)]),
    },
    # Leaves on sub-meshes of one 2x2 mesh beside leaves on the whole of it (FSDP2-only modules in a TP x FSDP2
    # model): a dp group's other member sits in the other tp group, whose owners this rank's dp group does not see.
    "sub_meshes": {
        "w1": ("dp_tp/dp", [Shard(0)]),
        "w2": ("dp_tp", [Shard(0), Shard(1)]),
        "w3": ("dp_tp/tp", [Shard(1)]),
        "heads": ("dp_tp/tp", [Shard(1)]),
        "experts": ("dp_tp/dp", [Shard(2)]),
        "experts_ep": ("dp_tp", [Shard(1), Replicate()]),
        "b": ("dp_tp/dp", [Replicate()]),
    },
}


def _mesh(meshes: dict[str, Any], name: str) -> Any:
    """``meshes[name]``, or a sub-mesh of one: ``"dp_tp/dp"``."""
    root, _, dim = name.partition("/")
    return meshes[root][dim] if dim else meshes[root]


@functools.cache  # a mesh's process groups cost a rendezvous each: make them once per process
def _layouts() -> dict[str, Any]:
    meshes = {k: init_device_mesh("cpu", shape, mesh_dim_names=names) for k, (shape, names) in MESHES.items()}
    return {name: {k: (_mesh(meshes, m), p) for k, (m, p) in layout.items()} for name, layout in LAYOUTS.items()}


def _distribute(tree: dict[str, torch.Tensor], layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: distribute_tensor(v, *layout[k], src_data_rank=None) for k, v in tree.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _tx(**kw: Any) -> gtx.GradientTransformation:
    return gtx.muon(0.05, weight_decay=0.1, muon_weight_dimension_numbers=DIMS, **kw)


def _run(tx: gtx.GradientTransformation, params: Any, grads: list[Any]) -> tuple[Any, Any]:
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = gtx.apply_updates(params, updates)
    return params, state


def _muon_state(state: Any) -> Any:
    return state[0].inner_states["muon"][0]


@functools.cache
def _reference() -> tuple[Any, Any]:
    return _run(_tx(), _params(), _grads())


def _pairs(got: dict[str, Any], want: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """Each leaf's local shard beside the reference's same shard (cut locally, with no collective)."""
    return {
        k: (v.to_local().clone(), distribute_tensor(want[k], *layout[k], src_data_rank=None).to_local())
        for k, v in got.items()
        if v is not None
    }


def part_layouts(rank: int) -> dict[str, Any]:
    ref_params, ref_state = _reference()
    out: dict[str, Any] = {}
    for name, layout in _layouts().items():
        params = _distribute(_params(), layout)
        grads = [_distribute(g, layout) for g in _grads()]
        meshes = [p.device_mesh for p in params.values()]
        comm = RecordingComm(mesh_comm(meshes))
        p, s = _run(_tx(comm=comm), params, grads)
        plan = exchange_plan(grads[0], DIMS, rank=dist.get_rank())
        alltoall = [c for c in comm.calls if c.op == "all_to_all"]
        mu = _muon_state(s)
        out[name] = {
            "params": _pairs(p, ref_params, layout),
            "mu": _pairs(mu.mu, _muon_state(ref_state).mu, layout),
            "count": mu.count.clone(),
            "collectives": len(alltoall) // STEPS,
            "plan_collectives": plan.collectives,
            "sent": sum(  # elements sent to other ranks
                math.prod(shape) for c in alltoall for r, shape in enumerate(c.shapes) if r != comm.rank(c.group)
            )
            // STEPS,
            "plan_sent": plan.sent_bytes // 4,
            "owners": plan.owners,
            "flops": plan.flops,
            "total_flops": plan.total_flops,
        }
    return out


def part_wrapper(rank: int) -> dict[str, Any]:
    """TransformedOptimizer (Muon's direction before an inner SGD) and inject_hyperparams, under TP x FSDP2."""
    layout = _layouts()["tp_fsdp"]
    mats = [k for k, v in DIMS.items() if v is not None]
    params = {k: torch.nn.Parameter(v) for k, v in _distribute(_params(), layout).items() if k in mats}
    # The wrapper's tree is the inner optimizer's param groups: a list of lists, in order. SGD's L2 decay
    # without momentum is muon's decoupled decay: p - lr (d + wd p).
    dims = [[DIMS[k] for k in params]]
    tx = gtx.chain(gtx.scale_by_muon(weight_dimension_numbers=dims), gtx.scale_by_shape(dims))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(params.values(), lr=0.05, weight_decay=0.1), tx)
    for g in _grads():
        for k, v in params.items():
            v.grad = _distribute({k: g[k]}, layout)[k]
        opt.step()
    injected = gtx.inject_hyperparams(gtx.muon, static_args=("ns_steps",))(
        0.05, weight_decay=0.1, muon_weight_dimension_numbers=DIMS
    )
    p2, _ = _run(injected, _distribute(_params(), layout), [_distribute(g, layout) for g in _grads()])
    ref_params, _ = _reference()
    return {"wrapper": _pairs(params, ref_params, layout), "injected": _pairs(p2, ref_params, layout)}


def part_checkpoint(rank: int) -> dict[str, Any]:
    """Two steps under FSDP2, saved with DCP; loaded under TP x FSDP2 for the last step."""
    layouts = _layouts()
    grads = _grads()
    tx = _tx()
    params, state = _run(
        tx, _distribute(_params(), layouts["fsdp"]), [_distribute(g, layouts["fsdp"]) for g in grads[:2]]
    )
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save({"params": params, "tx": gtx.checkpoint.state_dict(state, params, tx=tx)}, checkpoint_id=path[0])
    new_params = _distribute(_params(), layouts["tp_fsdp"])
    new_state = tx.init(new_params)
    sd = {"params": new_params, "tx": gtx.checkpoint.state_dict(new_state, new_params, tx=tx)}
    dcp.load(sd, checkpoint_id=path[0])
    new_params = sd["params"]
    new_state = gtx.checkpoint.load_state_dict(sd["tx"], new_state, new_params, tx=tx)
    updates, new_state = tx.update(_distribute(grads[2], layouts["tp_fsdp"]), new_state, new_params)
    new_params = gtx.apply_updates(new_params, updates)
    return _pairs(new_params, _reference()[0], layouts["tp_fsdp"])


def _simulated(name: str) -> dict[str, Any]:
    """The same steps as ``part_layouts`` on a simulated mesh of 4 ranks (one process): each rank's shards."""
    full_params, full_grads = _params(), _grads()  # made outside the simulation: plain tensors
    with gtx.testing.simulated_mesh(WORLD, ("world",)):
        meshes = {k: init_device_mesh("cpu", shape, mesh_dim_names=names) for k, (shape, names) in MESHES.items()}
        layout = {k: (_mesh(meshes, m), p) for k, (m, p) in LAYOUTS[name].items()}

        def place(tree: dict[str, torch.Tensor]) -> dict[str, Any]:
            return {k: gtx.testing.distribute({k: v}, layout[k][0], {k: layout[k][1]})[k] for k, v in tree.items()}

        grads = [place(g) for g in full_grads]
        comm = RecordingComm(mesh_comm(meshes.values()))
        p, s = _run(_tx(comm=comm), place(full_params), grads)
        locals_ = {
            "params": {k: v.to_local() for k, v in p.items()},
            "mu": {k: v.to_local() for k, v in _muon_state(s).mu.items() if v is not None},
        }
        calls = sum(c.op == "all_to_all" for c in comm.calls) // STEPS
        owners = exchange_plan(grads[0], DIMS).owners

    def on(local: torch.Tensor, rank: int) -> torch.Tensor:  # with the simulation over: plain tensors
        return local._local_tensors[rank] if isinstance(local, LocalTensor) else local

    ranks = [{w: {k: on(v, r) for k, v in t.items()} for w, t in locals_.items()} for r in range(WORLD)]
    return {"ranks": ranks, "collectives": calls, "owners": owners}


_SHARED = share_spawn(
    {"layouts": part_layouts, "wrapper": part_wrapper, "checkpoint": part_checkpoint}, WORLD, prefix="muon"
)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return _SHARED()


def _close(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=msg)


@pytest.mark.parametrize("layout", ["fsdp", "tp", "tp_fsdp", "ep_fsdp", "sub_meshes"])
def test_muon_matches_one_device(ranks, layout):
    for rank, res in enumerate(part_results(ranks, "layouts")):
        got = res[layout]
        assert set(got["params"]) == set(DIMS) and set(got["mu"]) == {k for k, v in DIMS.items() if v is not None}
        for what in ("params", "mu"):
            for k, (mine, want) in got[what].items():
                _close(mine, want, f"rank {rank} {layout} {what}[{k}]")
        assert int(got["count"]) == STEPS


@pytest.mark.parametrize("layout", ["fsdp", "tp", "tp_fsdp", "ep_fsdp", "sub_meshes"])
def test_muon_exchange_cost(ranks, layout):
    results = [r[layout] for r in part_results(ranks, "layouts")]
    for rank, res in enumerate(results):
        # The plan's count and bytes are what the step really issued.
        assert res["collectives"] == res["plan_collectives"], f"rank {rank}"
        assert res["sent"] == res["plan_sent"], f"rank {rank}"
    if layout == "sub_meshes":  # a rank sees the work of its own sub-mesh groups only; the owners still agree
        for leaf in ("w2", "experts_ep"):  # on the whole mesh: one owner, the same on every rank
            assert len({r["owners"][DIMS_AT[leaf]] for r in results}) == 1, [r["owners"] for r in results]
        return
    # Every exchanged matrix is orthogonalized once: the per-rank work adds up to the exchanged total.
    flops = results[0]["flops"]
    assert len(set(map(tuple, (r["flops"] for r in results)))) == 1
    assert results[0]["owners"] and len(set(results[0]["owners"].values())) > 1, "the work is spread"
    assert sum(flops) <= results[0]["total_flops"]


@pytest.mark.parametrize("layout", ["fsdp", "tp", "tp_fsdp", "ep_fsdp", "sub_meshes"])
def test_muon_exchange_on_a_simulated_mesh_is_the_torchrun_one(ranks, layout):
    """One process playing 4 ranks runs the owner exchange torchrun runs: same owners, all-to-alls and shards."""
    sim = _simulated(layout)
    for rank, res in enumerate(part_results(ranks, "layouts")):
        got = res[layout]
        assert sim["collectives"] == got["collectives"] == got["plan_collectives"]
        if layout != "sub_meshes" or rank == 0:  # a sub-mesh leaf's owner is in each rank's own group of it
            assert sim["owners"] == got["owners"]
        for what in ("params", "mu"):
            assert set(sim["ranks"][rank][what]) == set(got[what])
            for k, (mine, _) in got[what].items():
                torch.testing.assert_close(
                    sim["ranks"][rank][what][k], mine, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {layout} {what}[{k}]"
                )


def test_muon_wrapper_and_inject_hyperparams(ranks):
    for rank, res in enumerate(part_results(ranks, "wrapper")):
        for what in ("wrapper", "injected"):
            for k, (mine, want) in res[what].items():
                _close(mine, want, f"rank {rank} {what} params[{k}]")


def test_muon_checkpoint_resharded(ranks):
    for rank, res in enumerate(part_results(ranks, "checkpoint")):
        assert set(res) == set(DIMS)
        for k, (mine, want) in res.items():
            _close(mine, want, f"rank {rank} params[{k}]")
