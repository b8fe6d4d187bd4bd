"""mesh_groups, clip_by_global_norm and adaptive_clip on real multi-process layouts, against one device.

One 4-process gloo run (spawning costs seconds, so every layout shares it):
TP (colwise + rowwise) x FSDP2 on a 2x2 ("dp", "tp") mesh, FSDP2 alone, HSDP,
DDP alone, plain replicated tensors and manually sharded plain tensors. Each
rank also runs the same model on one device, on the whole global batch, and
the assertions compare the two here in the parent.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

import gradtx as gtx
from gradtx.comm import TorchComm
from gradtx.distributed.plan import Sharded, mesh_groups
from gradtx.testing import RecordingComm
from tests.distributed import models
from tests.distributed.harness import part_results, share_spawn

NORM_TYPES = (2.0, math.inf)
MAX_NORM = 0.05  # well below the grads' norm, so clipping really scales


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _dp_slice(x: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    n = x.shape[0] // dp_size
    return x[dp_rank * n : (dp_rank + 1) * n]


def _clip_checks(grads, params, comm, ref_grads, *, plan_kwargs=None, local_piece=None):
    """Norms, clipped grads and collective counts for each norm type, on one layout.

    ``local_piece(name, full)`` cuts a reference tensor down to this rank's part
    for manually sharded plain tensors (DTensors are gathered instead).
    """
    rec = RecordingComm(comm)
    plan = mesh_groups(params, comm=rec, **(plan_kwargs or {}))
    out = {"plan": repr(plan), "groups": len(plan.group_order)}
    for norm_type in NORM_TYPES:
        ref_norm, ref_clipped = models.reference_clip(ref_grads, MAX_NORM, norm_type)
        tx = gtx.clip_by_global_norm(MAX_NORM, norm_type=norm_type, mesh_groups=plan)
        rec.reset()
        clipped, state = tx.update(grads, tx.init(params))
        out[norm_type] = {
            "norm": state.grad_norm.clone(),
            "ref_norm": ref_norm,
            "clipped": {n: _full(g) for n, g in clipped.items()},
            "ref_clipped": {n: local_piece(n, t) if local_piece else t for n, t in ref_clipped.items()},
            "calls": [(c.op, c.num_tensors) for c in rec.calls],
            "call_groups": [c.group if isinstance(c.group, str) else "<pg>" for c in rec.calls],
            "distinct_groups": len({id(c.group) for c in rec.calls}),
        }
    return out


def _tp_fsdp(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = models.toy_net(seed=0)
    ref = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], models.tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    x, y = models.batch(seed=1)
    dp_rank = mesh.get_local_rank("dp")
    models.mse(model, _dp_slice(x, dp_rank, 2), _dp_slice(y, dp_rank, 2)).backward()
    ref_grads = models.reference_grads(ref, models.mse(ref, x, y))
    grads = {n: p.grad for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    comm = TorchComm(mesh)
    out = _clip_checks(grads, params, comm, ref_grads)
    out["placements"] = {n: str(p.placements) for n, p in params.items()}

    # AGC: blocks.*.w2.weight is Shard(1) on tp, so its units span the tp ranks.
    rec = RecordingComm(comm)
    plan = mesh_groups(params, comm=rec)
    clipping = 0.05
    agc, _ = gtx.adaptive_clip(clipping, mesh_groups=plan).update(grads, gtx.EmptyState(), params)
    out["agc"] = {n: _full(g) for n, g in agc.items()}
    out["agc_ref"] = models.reference_agc(ref_grads, dict(ref.named_parameters()), clipping)
    out["agc_calls"] = [(c.op, c.num_tensors) for c in rec.calls]
    out["full_grads"] = {n: _full(g) for n, g in grads.items()}

    # The documented gap: torch's own clip cannot stack norms living on different meshes.
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["torch_clip_error"] = None
    except RuntimeError as err:
        out["torch_clip_error"] = str(err)

    # Partial is an error, at plan time for a param and at step time for a grad.
    t = DTensor.from_local(torch.ones(3), mesh["tp"], [Partial()], run_check=False)
    r = DTensor.from_local(torch.ones(3), mesh["tp"], [Replicate()], run_check=False)
    errors = []
    try:
        mesh_groups({"p": t}, comm=comm)
    except ValueError as err:
        errors.append(str(err))
    try:
        tx = gtx.clip_by_global_norm(1.0, mesh_groups=mesh_groups({"p": r}, comm=comm))
        tx.update({"p": t}, tx.init({"p": r}))
    except (ValueError, TypeError) as err:
        errors.append(str(err))
    out["partial_errors"] = errors
    try:
        mesh_groups(params, comm=gtx.comm.LocalComm())
        out["local_comm_error"] = None
    except ValueError as err:
        out["local_comm_error"] = str(err)
    return out


def _fsdp_alone(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = models.toy_net(seed=2)
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = models.batch(seed=3)
    models.mse(model, _dp_slice(x, rank, world), _dp_slice(y, rank, world)).backward()
    ref_grads = models.reference_grads(ref, models.mse(ref, x, y))
    grads = {n: p.grad for n, p in model.named_parameters()}
    return _clip_checks(grads, dict(model.named_parameters()), TorchComm(mesh), ref_grads)


def _hsdp(rank: int) -> dict:
    # FSDP2 with a (Replicate, Shard) mesh: the norm must reduce over "shard" only.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    model = models.toy_net(seed=4)
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    x, y = models.batch(seed=5)
    models.mse(model, _dp_slice(x, rank, 4), _dp_slice(y, rank, 4)).backward()
    ref_grads = models.reference_grads(ref, models.mse(ref, x, y))
    grads = {n: p.grad for n, p in model.named_parameters()}
    out = _clip_checks(grads, dict(model.named_parameters()), TorchComm(mesh), ref_grads)
    out["placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
    return out


def _ddp_alone(rank: int, world: int) -> dict:
    model = models.toy_net(seed=6)
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    x, y = models.batch(seed=7)
    models.mse(ddp, _dp_slice(x, rank, world), _dp_slice(y, rank, world)).backward()
    ref_grads = models.reference_grads(ref, models.mse(ref, x, y))
    grads = {n: p.grad for n, p in model.named_parameters()}
    return _clip_checks(grads, dict(model.named_parameters()), TorchComm(), ref_grads)


def _plain_and_manual(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(8)
    full = {"a": torch.randn(6, 8, generator=g), "b": torch.randn(8, generator=g), "c": torch.randn(5, generator=g)}
    # "a" is split along dim 1 and "b" along dim 0 over the world; "c" is replicated on every rank.
    grads = {
        "a": full["a"].chunk(world, dim=1)[rank].clone(),
        "b": full["b"].chunk(world)[rank].clone(),
        "c": full["c"],
    }
    replicated = _clip_checks(
        {"c": full["c"].clone()}, {"c": full["c"]}, TorchComm(), {"c": full["c"]}
    )  # no declaration: replicated, counted once, no collective
    pieces = {"a": lambda t: t.chunk(world, dim=1)[rank], "b": lambda t: t.chunk(world)[rank], "c": lambda t: t}
    manual = _clip_checks(
        grads,
        grads,
        TorchComm(),
        full,
        plan_kwargs={"sharded": {"a": Sharded("world", dim=1), "b": "world"}},
        local_piece=lambda name, t: pieces[name](t),
    )
    # AGC on a manual Shard(1) weight: units span the ranks.
    params = {"a": full["a"].chunk(world, dim=1)[rank] * 3.0, "b": full["b"].chunk(world)[rank] * 3.0, "c": full["c"]}
    full_params = {"a": full["a"] * 3.0, "b": full["b"] * 3.0, "c": full["c"]}
    plan = mesh_groups(params, comm=TorchComm(), sharded={"a": Sharded("world", dim=1), "b": "world"})
    agc, _ = gtx.adaptive_clip(0.2, mesh_groups=plan).update(grads, gtx.EmptyState(), params)
    return {
        "replicated": replicated,
        "manual": manual,
        "agc": agc,
        "agc_ref": models.reference_agc(full, full_params, 0.2),
    }


def _body(rank: int, world: int) -> bytes:
    torch.manual_seed(0)
    return models.pack(
        {
            "tp_fsdp": _tp_fsdp(rank),
            "fsdp": _fsdp_alone(rank, world),
            "hsdp": _hsdp(rank),
            "ddp": _ddp_alone(rank, world),
            "plain": _plain_and_manual(rank, world),
            "world": dist.get_world_size(),
        }
    )


def _body_part(rank: int) -> bytes:
    return _body(rank, 4)


_SHARED = share_spawn({"body": _body_part}, 4, prefix="norms")


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return [models.unpack(r) for r in part_results(_SHARED(), "body")]


def _assert_matches_single_device(per_rank: list[dict], *, expected_calls: int) -> None:
    for norm_type in NORM_TYPES:
        norms = [r[norm_type]["norm"] for r in per_rank]
        for n in norms[1:]:  # replicated: bitwise equal on every rank
            assert torch.equal(n, norms[0])
        for r in per_rank:
            got = r[norm_type]
            assert got["norm"].dtype == torch.float32 and got["norm"].ndim == 0
            torch.testing.assert_close(got["norm"], got["ref_norm"], rtol=1e-5, atol=0)
            for name, ref in got["ref_clipped"].items():
                torch.testing.assert_close(got["clipped"][name], ref, rtol=1e-5, atol=1e-7, msg=f"{name} ({norm_type})")
            assert len(got["calls"]) == expected_calls, got["calls"]
            assert got["distinct_groups"] == expected_calls  # at most one collective per group
            assert {op for op, _ in got["calls"]} <= {"max" if math.isinf(norm_type) else "sum"}


def test_tp_x_fsdp2_norm_and_clipped_grads_match_single_device(results):
    per_rank = [r["tp_fsdp"] for r in results]
    # The layout really mixes the three kinds of placement.
    placements = per_rank[0]["placements"]
    assert "_StridedShard" in placements["blocks.0.w1.weight"] and "Shard(dim=1)" in placements["blocks.0.w2.weight"]
    assert "Replicate" in placements["blocks.0.w2.bias"]
    # dp and tp: two collectives per step, however many tensors.
    _assert_matches_single_device(per_rank, expected_calls=2)
    # One collective per mesh dim, in the plan's order: dp carries both buckets' parts, then tp the
    # dp+tp bucket's.
    for norm_type in NORM_TYPES:
        assert per_rank[0][norm_type]["call_groups"] == ["dp", "tp"]
        assert [n for _, n in per_rank[0][norm_type]["calls"]] == [2, 1]


def test_tp_x_fsdp2_torch_clip_grad_norm_fails_on_this_layout(results):
    for r in results:
        err = r["tp_fsdp"]["torch_clip_error"]
        assert err is not None and "same mesh" in err


def test_partial_placements_raise_clear_errors(results):
    errors = results[0]["tp_fsdp"]["partial_errors"]
    assert len(errors) == 2
    assert "Partial" in errors[0] and "params leaf at ['p']" in errors[0]
    assert "Partial" in errors[1] and "leaf at ['p']" in errors[1] and "reduce it first" in errors[1]


def test_a_comm_that_cannot_reach_the_shards_is_refused(results):
    err = results[0]["tp_fsdp"]["local_comm_error"]
    assert err is not None and "comm reports 1" in err and "TorchComm(mesh)" in err


def test_adaptive_clip_rowwise_sharded_weight_matches_single_device(results):
    for r in results:
        got = r["tp_fsdp"]
        for name, ref in got["agc_ref"].items():
            torch.testing.assert_close(got["agc"][name], ref, rtol=1e-5, atol=1e-7, msg=name)
        # Clipping really happened on a Shard(1) weight, and not on everything.
        w2 = "blocks.0.w2.weight"
        assert not torch.allclose(got["agc"][w2], got["full_grads"][w2])
        assert len(got["agc_calls"]) == 2 and {op for op, _ in got["agc_calls"]} == {"sum"}


def test_fsdp2_alone_no_double_counting(results):
    _assert_matches_single_device([r["fsdp"] for r in results], expected_calls=1)


def test_hsdp_replicate_dim_is_not_summed(results):
    per_rank = [r["hsdp"] for r in results]
    assert "Replicate" in per_rank[0]["placements"]["head.weight"]
    _assert_matches_single_device(per_rank, expected_calls=1)


def test_ddp_alone_no_double_counting_and_no_collective(results):
    _assert_matches_single_device([r["ddp"] for r in results], expected_calls=0)


def test_plain_replicated_tensors_are_counted_once(results):
    _assert_matches_single_device([r["plain"]["replicated"] for r in results], expected_calls=0)


def test_manually_sharded_plain_tensors(results):
    _assert_matches_single_device([r["plain"]["manual"] for r in results], expected_calls=1)
    world = results[0]["world"]
    for rank, r in enumerate(results):
        ref = r["plain"]["agc_ref"]
        got = r["plain"]["agc"]
        torch.testing.assert_close(got["a"], ref["a"].chunk(world, dim=1)[rank], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got["b"], ref["b"].chunk(world)[rank], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got["c"], ref["c"], rtol=1e-5, atol=1e-7)
