"""A param with no grad (``None``) on one rank, on two gloo ranks: the collectives still match, the result is right.

* ``accumulate(..., reduce_grads=True)``: rank 0's micro-batches never reach ``"c"``, rank 1's never
  reach ``"b"`` (an unused expert, a branch): each rank used to sum only its own grads, so the ranks'
  buffers held different params (here of one size, so they were silently added to each other).
* ``pp_reduce(plan)`` first in a pipeline chain, where the clip on the same plan already allowed a
  ``None`` grad: it refused the update on that stage, and the other stage's collective failed.
* ``clip_by_global_norm`` and ``adaptive_clip`` with no plan on DTensor grads, an expert without a grad on
  one rank: that rank's plan (read from the grads it has) left the expert's group out, so the other rank
  waited in its all-reduce for ever.
* The same with the expert's rank holding only plain grads (a plain dense layer beside a DTensor expert): that
  rank took the local norm, with no collective. Under the wrapper, the expert frozen at the build and unfrozen
  later joined the transform only on the rank where it had a grad, with the same result.
* ``apply_if_finite``, ``skip_if`` and ``skip_spikes(metric="loss")`` there: rank 0 took its local verdict while
  rank 1, whose expert shard (or loss) is NaN, waited in the MAX. ``centralize`` on rowwise (``Shard(1)``) weights, one without a grad on rank 0 (set to ``None`` by
  the user's code): the ranks' all-reduces of the row sums held different leaves.
* ``orthogonalize`` and ``scale_by_muon`` on ``Shard(0)`` (FSDP-style) matrices, one without a grad on rank 0 for
  a step: the ranks' all-to-alls held different matrices (gloo aborted).
* ``TransformedOptimizer`` with ``cp_reduce``, an expert frozen at the build and unfrozen later, reached by
  one CP rank's chunk only at that step: it joined the transform on that rank alone, so the ranks' all-reduces
  held different buffers (gloo aborted).
* ``cp_reduce`` in a functional step, an expert reached by one CP rank's chunk only: the ranks' coalesced
  all-reduces held different buffers (gloo aborted on the sizes, or, on equal sizes, summed other params).
* ``accumulate`` before that ``cp_reduce``, saved with DCP mid-window and resumed: the checkpoint kept one rank's
  flags (whether the window held a sum of the expert), so the other rank refused its next micro-step and the first
  died in the all-reduce.

The references are worked on one device from the same grads, a missing one read as zeros.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import gradtx as gtx
from gradtx.comm import TorchComm
from tests.distributed.harness import run_distributed

TOKENS = ((3, 5), (0, 4))  # rank -> tokens of its two micro-batches
SHAPES = {"a": (3,), "b": (5,), "c": (5,)}


def _grad(rank: int, micro: int, name: str) -> torch.Tensor | None:
    if (rank, name) in ((0, "c"), (1, "b")):
        return None
    gen = torch.Generator().manual_seed(100 * rank + 10 * micro + len(name))
    return torch.randn(SHAPES[name], generator=gen)


def _accumulate(rank: int) -> dict:
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    tx = gtx.accumulate(2, token_weighted=True, comm=TorchComm(), group="world", reduce_grads=True)
    state = tx.init(params)
    for micro in range(2):
        grads = {n: _grad(rank, micro, n) for n in SHAPES}
        out, state = tx.update(grads, state, params, tokens=TOKENS[rank][micro])
    try:
        tx.update({"a": torch.ones(3), "b": None, "c": None}, state, tokens=1)  # no params to shape the zeros
        error = None
    except ValueError as err:
        error = str(err)
    return {"out": out, "refused": error}


def _stage(rank: int, tied_none: bool) -> dict:
    comm = TorchComm(groups={"pp": dist.group.WORLD})
    params, grads = _stage_data(rank, tied_none)
    tied = {"emb": "pp"} if rank == 0 else {"head": "pp"}
    plan = gtx.mesh_groups(params, comm=comm, pp_group="pp", tied=tied)
    tx = gtx.chain(gtx.pp_reduce(plan), gtx.clip_by_global_norm(1.0, mesh_groups=plan))
    out, state = tx.update(grads, tx.init(params), params)
    return {"grads": grads, "out": out, "norm": gtx.metrics(state)["grad_norm"]}


def _wrapped_stage(rank: int) -> dict:
    """The same two stages through ``TransformedOptimizer``, stage 0's tied copy without a grad."""
    comm = TorchComm(groups={"pp": dist.group.WORLD})
    params, grads = _stage_data(rank, tied_none=True)
    live = {n: torch.nn.Parameter(torch.full_like(p, 0.5)) for n, p in params.items()}
    tie = live["emb" if rank == 0 else "head"]
    plan = gtx.mesh_groups([list(live.values())], comm=comm, pp_group="pp", tied={lambda path, p: p is tie: "pp"})
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(live.values(), lr=0.1, weight_decay=0.1),
        gtx.chain(gtx.pp_reduce(plan), gtx.clip_by_global_norm(1.0, mesh_groups=plan)),
    )
    for n, p in live.items():
        p.grad = None if grads[n] is None else grads[n].clone()  # the wrapper writes the clipped grads there
    opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in live.items()}}


def _stage_data(rank: int, tied_none: bool) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(rank)
    if rank == 0:
        params = {"emb": torch.zeros(4, 3), "unused": torch.zeros(2)}
        grads = {"emb": None if tied_none else torch.randn(4, 3, generator=gen), "unused": None}
    else:
        params = {"head": torch.zeros(4, 3), "w": torch.zeros(5)}
        grads = {"head": torch.randn(4, 3, generator=gen), "w": torch.randn(5, generator=gen)}
    return params, grads


def _expert_data() -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(7)
    return ({n: torch.randn(4, 6, generator=gen) for n in ("dense", "expert")},
            {n: torch.randn(4, 6, generator=gen) for n in ("dense", "expert")})  # fmt: skip


def _zero_config(rank: int) -> dict:
    """DTensor grads and no plan, functional: a rowwise expert (``Shard(1)`` over both ranks, so its units and its
    norm span them) that no token reached on rank 0."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    weights, grads = _expert_data()
    placements = {"dense": [Replicate()], "expert": [Shard(1)]}
    params = {n: distribute_tensor(w, mesh, placements[n]) for n, w in weights.items()}
    grads = {n: distribute_tensor(g, mesh, placements[n]) for n, g in grads.items()}  # (a scatter: on every rank)
    if rank == 0:
        grads["expert"] = None
    out = {}
    for name, tx in (("clip", gtx.clip_by_global_norm(0.1)), ("agc", gtx.adaptive_clip(0.01))):
        new, state = tx.update(grads, tx.init(params), params)
        out[name] = {n: None if u is None else u.to_local() for n, u in new.items()}
        out.setdefault("norm", gtx.metrics(state).get("grad_norm"))
    return out


def _functional_cp(rank: int) -> dict:
    params = {"shared": torch.zeros(4, 3), "expert": torch.zeros(5)}
    tx = gtx.chain(gtx.cp_reduce(dist.group.WORLD), gtx.clip_by_global_norm(1.0))
    out, state = tx.update(_cp_grads(rank), tx.init(params), params)
    error = None
    if rank == 0:  # no params: no shape for the zeros; refused before any collective
        with pytest.raises(ValueError, match=r"update\(\.\.\., params\)") as err:
            tx.update(_cp_grads(rank), state)
        error = str(err.value)
    return {"out": out, "refused": error}


def _functional_cp_resumed(rank: int) -> dict:
    """chain(accumulate(2), cp_reduce) saved with DCP after micro-step 1 and resumed from a fresh state; rank 0's
    chunk never reaches the expert. DCP kept one rank's 'held' flags, so the other refused its next micro-step
    (rank 0 its None: 'missing', or rank 1 its grad: 'unexpected') and the first died in cp_reduce's all-reduce."""
    params = {"shared": torch.zeros(4, 3), "expert": torch.zeros(5)}
    tx = gtx.chain(gtx.accumulate(2), gtx.cp_reduce(dist.group.WORLD))
    micro = [_cp_grads(rank), {n: None if g is None else 2 * g for n, g in _cp_grads(rank).items()}]
    _, state = tx.update(micro[0], tx.init(params), params)
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save({"tx": gtx.checkpoint.state_dict(state, params, tx=tx)}, checkpoint_id=path[0])
    saved = {"tx": gtx.checkpoint.state_dict(tx.init(params), params, tx=tx)}
    dcp.load(saved, checkpoint_id=path[0])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0])
    out, _ = tx.update(micro[1], gtx.checkpoint.load_state_dict(saved["tx"], tx.init(params), params, tx=tx), params)
    return out


def _wrapped_cp_unfrozen(rank: int) -> dict:
    live = {"shared": torch.nn.Parameter(torch.full((4, 3), 0.5)), "expert": torch.nn.Parameter(torch.full((5,), 0.5))}
    live["expert"].requires_grad_(False)  # frozen when the wrapper is built
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(live.values(), lr=0.1, momentum=0.9),
        gtx.chain(gtx.cp_reduce(dist.group.WORLD), gtx.clip_by_global_norm(1.0)),
    )
    for step in range(3):
        live["expert"].requires_grad_(step > 0)  # unfrozen at step 1, on every rank
        for n, g in _cp_grads(rank).items():
            live[n].grad = None if g is None or not live[n].requires_grad else g.clone()
        opt.step()
    return {n: p.detach().clone() for n, p in live.items()}


def _body(rank: int, world_size: int) -> dict:
    del world_size
    # One spawn of its own, so that a rank that raises ends its process and the other rank's collective fails
    # at once, instead of waiting for the shared spawn's barrier.
    return {
        "accumulate": _accumulate(rank),
        "pp_reduce": _stage(rank, tied_none=False),
        "pp_reduce_tied_none": _stage(rank, tied_none=True),
        "wrapper_tied_none": _wrapped_stage(rank),
        "zero_config": _zero_config(rank),
        "functional_cp": _functional_cp(rank),
        "functional_cp_resumed": _functional_cp_resumed(rank),
        "wrapper_cp_unfrozen": _wrapped_cp_unfrozen(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_body, world_size=2, timeout=120.0)


def test_reduce_grads_sums_a_param_that_has_no_grad_on_some_ranks(ranks):
    results = [r["accumulate"] for r in ranks]
    total = sum(map(sum, TOKENS))
    zero = {n: torch.zeros(s) for n, s in SHAPES.items()}
    expected = {
        n: sum((g if (g := _grad(r, m, n)) is not None else zero[n] for r in range(2) for m in range(2)), zero[n])
        / total
        for n in SHAPES
    }
    for r in results:
        assert set(r["out"]) == set(SHAPES)  # every param gets the sum, the same on both ranks
        for n in SHAPES:
            torch.testing.assert_close(r["out"][n], expected[n], rtol=1e-6, atol=1e-7)
    assert results[0]["refused"] is not None and "update(..., params)" in results[0]["refused"]


@pytest.mark.parametrize("part", ["pp_reduce", "pp_reduce_tied_none"])
def test_pp_reduce_takes_a_missing_grad_as_the_clip_does(ranks, part):
    stage0, stage1 = (r[part] for r in ranks)
    emb0 = stage0["grads"]["emb"]
    tied = stage1["grads"]["head"] + (emb0 if emb0 is not None else 0)  # one weight on one device: the sum
    ref = [tied, stage1["grads"]["w"]]
    ref_norm = torch.nn.utils.get_total_norm(ref)
    coef = min(1.0, 1.0 / (float(ref_norm) + 1e-6))
    for r in (stage0, stage1):
        torch.testing.assert_close(r["norm"], ref_norm, rtol=1e-6, atol=0)
    assert stage0["out"]["unused"] is None  # an untied param with no grad stays without one
    for out in (stage0["out"]["emb"], stage1["out"]["head"]):  # both copies take the same update
        torch.testing.assert_close(out, tied * coef, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stage1["out"]["w"], ref[1] * coef, rtol=1e-6, atol=1e-7)


def test_wrapper_steps_a_tied_copy_without_a_grad_on_the_holders_sum(ranks):
    """Under the wrapper, stage 0's tied copy has no ``.grad``: ``pp_reduce`` summed it as zeros, but the
    summed grad was written only where a ``.grad`` existed, so stage 1 stepped its copy and stage 0 did not,
    and the tied copies drifted apart. The reference is one device, where the tied weight is one tensor."""
    stage0, stage1 = (r["wrapper_tied_none"] for r in ranks)
    tied = torch.nn.Parameter(torch.full((4, 3), 0.5))
    w, unused = torch.nn.Parameter(torch.full((5,), 0.5)), torch.nn.Parameter(torch.full((2,), 0.5))
    tied.grad, w.grad = stage1["grads"]["head"].clone(), stage1["grads"]["w"].clone()
    torch.nn.utils.clip_grad_norm_([tied, w, unused], 1.0)
    torch.optim.SGD([tied, w, unused], lr=0.1, weight_decay=0.1).step()
    for name, got in (("emb", stage0["params"]["emb"]), ("head", stage1["params"]["head"])):
        torch.testing.assert_close(got, tied.detach(), rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(stage1["params"]["w"], w.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stage0["params"]["unused"], unused.detach(), rtol=0, atol=0)  # no grad: not stepped


def test_zero_config_norms_take_a_missing_dtensor_grad_as_zeros(ranks):
    """The reference is one device holding the whole expert, whose grad has zeros in rank 0's columns."""
    weights, grads = _expert_data()
    grads["expert"][:, :3] = 0
    ref = [torch.nn.Parameter(w) for w in weights.values()]
    for p, g in zip(ref, grads.values()):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.1)
    ref = [p.grad for p in ref]

    def agc(g, w):  # by hand: rows are the units
        limit = 0.01 * w.norm(dim=1, keepdim=True).clamp(min=1e-3)
        norm = g.norm(dim=1, keepdim=True)
        return torch.where(norm > limit, g * limit / norm.clamp(min=1e-6), g)

    for rank, r in enumerate(ranks):
        got = r["zero_config"]
        torch.testing.assert_close(got["norm"], ref_norm, rtol=1e-6, atol=0)
        torch.testing.assert_close(got["clip"]["dense"], ref[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["agc"]["dense"], agc(grads["dense"], weights["dense"]), rtol=1e-6, atol=1e-7)
    assert ranks[0]["zero_config"]["clip"]["expert"] is None and ranks[0]["zero_config"]["agc"]["expert"] is None
    torch.testing.assert_close(ranks[1]["zero_config"]["clip"]["expert"], ref[1][:, 3:], rtol=1e-6, atol=1e-7)
    expert = agc(grads["expert"], weights["expert"])[:, 3:]
    torch.testing.assert_close(ranks[1]["zero_config"]["agc"]["expert"], expert, rtol=1e-6, atol=1e-7)


def _mixed(rank: int, world_size: int) -> dict:
    """A plain dense layer and a ``Shard(0)`` expert that no token reached on rank 0, whose present grads are then all
    plain: functional (clip and per-leaf norms), and wrapped with the expert frozen at step 0, unfrozen at step 1."""
    del world_size
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    weights, grads = _expert_data()
    expert = DTensor.from_local(grads["expert"].chunk(2)[rank], mesh, [Shard(0)])
    params = {"dense": weights["dense"], "expert": distribute_tensor(weights["expert"], mesh, [Shard(0)])}
    tx = gtx.chain(gtx.track_norms(), gtx.clip_by_global_norm(0.1))
    new, state = tx.update({"dense": grads["dense"], "expert": expert if rank else None}, tx.init(params), params)
    out = {"clip": {n: None if u is None else _local(u) for n, u in new.items()}, "metrics": gtx.metrics(state)}
    live = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    live["expert"].requires_grad_(False)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(live.values(), lr=0.1), gtx.clip_by_global_norm(0.1))
    for step in range(2):
        live["expert"].requires_grad_(step > 0)
        live["dense"].grad = grads["dense"].clone()
        live["expert"].grad = expert.clone() if step and rank else None
        opt.step()
    out["wrapped"] = {n: _local(p.detach()).clone() for n, p in live.items()}
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def test_a_rank_with_only_plain_grads_joins_a_missing_dtensor_grads_norm():
    """One device holds the whole expert, its grad zero in rank 0's rows; on 3fc4e57 rank 0 took its local norm and
    left rank 1 in the all-reduce (the spawn failed)."""
    ranks = run_distributed(_mixed, world_size=2, timeout=60.0)
    weights, grads = _expert_data()
    grads["expert"][:2] = 0
    ref = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    for n, p in ref.items():
        p.grad = grads[n].clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.values(), 0.1)
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["metrics"]["grad_norm"], ref_norm, rtol=1e-6, atol=0)
        torch.testing.assert_close(
            r["metrics"]["grad_norm_by_layer"]["dense"], grads["dense"].norm(), rtol=1e-6, atol=0
        )
        torch.testing.assert_close(r["clip"]["dense"], ref["dense"].grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ranks[1]["clip"]["expert"], ref["expert"].grad[2:], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        ranks[1]["metrics"]["grad_norm_by_layer"]["expert"], grads["expert"].norm(), rtol=1e-6, atol=0
    )
    wrapped = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    sgd = torch.optim.SGD(wrapped.values(), lr=0.1)
    for step in range(2):
        wrapped["dense"].grad = grads["dense"].clone()
        wrapped["expert"].grad = grads["expert"].clone() if step else None
        torch.nn.utils.clip_grad_norm_([p for p in wrapped.values() if p.grad is not None], 0.1)
        sgd.step()
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["wrapped"]["dense"], wrapped["dense"].detach(), rtol=1e-6, atol=1e-7)
        rows = wrapped["expert"].detach()[2 * rank : 2 * rank + 2]
        torch.testing.assert_close(r["wrapped"]["expert"], rows, rtol=1e-6, atol=1e-7)


def _guards(rank: int, world_size: int) -> dict:
    """The guards on the plain dense layer and ``Shard(0)`` expert above, rank 1's expert shard (and loss) NaN;
    centralize on two rowwise weights, ``"b"``'s grad ``None`` on rank 0."""
    del world_size
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    weights, grads = _expert_data()
    params = {"dense": weights["dense"], "expert": distribute_tensor(weights["expert"], mesh, [Shard(0)])}
    nan = DTensor.from_local(torch.full((2, 6), float("nan")), mesh, [Shard(0)])
    skipped = {}
    for name, tx in (
        ("apply_if_finite", gtx.apply_if_finite(gtx.sgd(0.1), 3)),
        ("skip_if", gtx.skip_if(gtx.sgd(0.1), gtx.skip_not_finite)),
        ("skip_spikes", gtx.skip_spikes(gtx.sgd(0.1), metric="loss")),  # rank 1's loss NaN
    ):
        loss = torch.tensor(float("nan") if rank else 1.0)
        grads_r = {"dense": grads["dense"], "expert": nan if rank else None}
        _, state = tx.update(grads_r, tx.init(params), params, loss=loss)
        skipped[name] = gtx.metrics(state)["skipped"]
    rows = {n: distribute_tensor(w, mesh, [Shard(1)]) for n, w in (("a", weights["dense"]), ("b", weights["expert"]))}
    cols = {n: distribute_tensor(g, mesh, [Shard(1)]) for n, g in (("a", grads["dense"]), ("b", grads["expert"]))}
    if rank == 0:
        cols["b"] = None
    out, _ = gtx.centralize().update(cols, gtx.EmptyState(), rows)
    return {"skipped": skipped, "centralized": {n: _local(u) for n, u in out.items() if u is not None}}


def test_guard_and_centralize_join_a_missing_dtensor_grad_as_zeros():
    """Every rank skips the step whose only NaN is in the shard rank 0 has no grad for; centralize's reference is
    one device, ``"b"``'s grad zero in rank 0's columns. On 3fc4e57 rank 1 fails in the all-reduce (the spawn fails)."""
    ranks = run_distributed(_guards, world_size=2, timeout=60.0)
    _, grads = _expert_data()
    grads["expert"][:, :3] = 0
    ref = {n: g - g.mean(dim=1, keepdim=True) for n, g in (("a", grads["dense"]), ("b", grads["expert"]))}
    for rank, r in enumerate(ranks):
        assert all(map(bool, r["skipped"].values())), r["skipped"]
        torch.testing.assert_close(r["centralized"]["a"], ref["a"][:, 3 * rank : 3 * rank + 3], rtol=1e-6, atol=1e-7)
    assert "b" not in ranks[0]["centralized"]
    torch.testing.assert_close(ranks[1]["centralized"]["b"], ref["b"][:, 3:], rtol=1e-6, atol=1e-7)


def _muon_grads(step: int) -> dict:
    gen = torch.Generator().manual_seed(20 + step)
    return {n: torch.randn(4, 6, generator=gen) for n in "ab"}


def _muon(rank: int, world_size: int) -> dict:
    """Two steps on two ``Shard(0)`` matrices; at step 1 rank 0 has no grad for ``"b"``."""
    del world_size
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    weights = _expert_data()[0]
    params = {n: distribute_tensor(weights[m], mesh, [Shard(0)]) for n, m in (("a", "dense"), ("b", "expert"))}
    out: dict = {}
    for name, tx in (("orthogonalize", gtx.orthogonalize()), ("scale_by_muon", gtx.scale_by_muon())):
        state = tx.init(params)
        for step in range(2):
            grads = {n: distribute_tensor(g, mesh, [Shard(0)]) for n, g in _muon_grads(step).items()}
            if step == 1 and rank == 0:
                grads["b"] = None
            new, state = tx.update(grads, state, params)
        out[name] = {n: None if u is None else _local(u) for n, u in new.items()}
        out[name + "_mu"] = {n: _local(m) for n, m in getattr(state, "mu", {}).items()}
    return out


def test_muon_exchanges_a_missing_matrix_as_zeros():
    """One device holds both matrices, ``"b"``'s grad zero in rank 0's rows at step 1. Rank 0's update for it stays
    None and its momentum is kept (as for any None update). On 3fc4e57 gloo aborts."""
    ranks = run_distributed(_muon, world_size=2, timeout=60.0)
    weights = _expert_data()[0]
    params = {"a": weights["dense"], "b": weights["expert"]}
    for name, tx in (("orthogonalize", gtx.orthogonalize()), ("scale_by_muon", gtx.scale_by_muon())):
        state = tx.init(params)
        _, state = tx.update(_muon_grads(0), state, params)
        before = state
        grads = _muon_grads(1)
        grads["b"][:2] = 0
        ref, state = tx.update(grads, state, params)
        assert ranks[0][name]["b"] is None
        for rank, r in enumerate(ranks):
            rows = slice(2 * rank, 2 * rank + 2)
            for n, u in r[name].items():
                if u is not None:
                    torch.testing.assert_close(
                        u, ref[n][rows], rtol=1e-5, atol=1e-6, msg=lambda m, w=(name, n): f"{w} {m}"
                    )
            for n, mu in r[name + "_mu"].items():
                want = (before if rank == 0 and n == "b" else state).mu[n][rows]
                torch.testing.assert_close(mu, want, rtol=1e-6, atol=1e-7, msg=lambda m, w=(rank, n): f"mu {w} {m}")


def _cp_grads(rank: int) -> dict:
    """A context-parallel rank's grads: its token chunk reaches the expert only on rank 1 (an MoE route)."""
    gen = torch.Generator().manual_seed(10 + rank)
    return {"shared": torch.randn(4, 3, generator=gen), "expert": torch.randn(5, generator=gen) if rank else None}


def _wrapped_cp(rank: int, world_size: int) -> dict:
    del world_size
    live = {"shared": torch.nn.Parameter(torch.full((4, 3), 0.5)), "expert": torch.nn.Parameter(torch.full((5,), 0.5))}
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(live.values(), lr=0.1, momentum=0.9),
        gtx.chain(gtx.cp_reduce(dist.group.WORLD), gtx.clip_by_global_norm(1.0)),
    )
    for _ in range(2):
        for n, g in _cp_grads(rank).items():
            live[n].grad = None if g is None else g.clone()
        opt.step()
    return {n: p.detach().clone() for n, p in live.items()}


def test_wrapper_cp_reduce_sums_a_grad_that_one_rank_lacks():
    """An expert reached by rank 1's chunk only: rank 0 has no ``.grad`` for it. The wrapper gave ``cp_reduce`` a
    ``None`` there and the ranks' all-reduces differed (gloo failed); before, the sum was written only where a
    ``.grad`` existed, so rank 0 did not step the expert and the replicas drifted apart. The reference is one
    device holding the whole sequence: each grad is the chunks' sum."""
    ranks = run_distributed(_wrapped_cp, world_size=2, timeout=60.0)
    ref = {n: torch.nn.Parameter(torch.full(s, 0.5)) for n, s in (("shared", (4, 3)), ("expert", (5,)))}
    sgd = torch.optim.SGD(ref.values(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for n, p in ref.items():
            p.grad = sum(g for r in range(2) if (g := _cp_grads(r)[n]) is not None)
        torch.nn.utils.clip_grad_norm_(list(ref.values()), 1.0)
        sgd.step()
    for rank in ranks:
        for n, p in ref.items():
            torch.testing.assert_close(rank[n], p.detach(), rtol=1e-6, atol=1e-7)


def test_functional_cp_reduce_sums_a_grad_that_one_rank_lacks(ranks):
    """As the wrapper above, in a functional step: the reference is one device, each grad the chunks' sum."""
    ref = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))]
    for p, n in zip(ref, ("shared", "expert")):
        p.grad = sum(g for r in range(2) if (g := _cp_grads(r)[n]) is not None)
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    for r in ranks:
        for p, n in zip(ref, ("shared", "expert")):
            torch.testing.assert_close(r["functional_cp"]["out"][n], p.grad, rtol=1e-6, atol=1e-7)
    assert "cp_reduce: a None update" in ranks[0]["functional_cp"]["refused"]


def test_functional_cp_window_resumed_mid_window_from_dcp_where_one_rank_lacks_a_grad(ranks):
    """The reference is one device holding the whole sequence: each micro-step's grad is the chunks' sum (the
    second twice the first), and the window emits their mean."""
    for r in ranks:
        for n in ("shared", "expert"):
            want = 1.5 * sum(g for k in range(2) if (g := _cp_grads(k)[n]) is not None)
            torch.testing.assert_close(r["functional_cp_resumed"][n], want, rtol=1e-6, atol=1e-7)


def test_wrapper_cp_reduce_joins_an_unfrozen_expert_on_every_rank(ranks):
    """One device holds the whole sequence: the expert, unfrozen at step 1, steps from then on by the chunks' sum."""
    ref = {n: torch.nn.Parameter(torch.full(s, 0.5)) for n, s in (("shared", (4, 3)), ("expert", (5,)))}
    sgd = torch.optim.SGD(ref.values(), lr=0.1, momentum=0.9)
    for step in range(3):
        for n, p in ref.items():
            p.grad = (
                None if n == "expert" and step == 0 else sum(g for r in range(2) if (g := _cp_grads(r)[n]) is not None)
            )
        torch.nn.utils.clip_grad_norm_(list(ref.values()), 1.0)
        sgd.step()
    for rank in ranks:
        for n, p in ref.items():
            torch.testing.assert_close(rank["wrapper_cp_unfrozen"][n], p.detach(), rtol=1e-6, atol=1e-7)
