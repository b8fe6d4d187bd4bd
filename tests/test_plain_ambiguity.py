"""Plain-tensor grads on several ranks: torch's semantics (each rank's local norm, no collective), and the replica check you ask for.

On simulated meshes (every rank in this process); ``tests/distributed/test_plain_ambiguity.py`` runs
the same rule on real gloo ranks. Also here: ``TorchComm.rank`` per simulated rank, and the code
that depends on it (Muon's sharded exchange, a checkpoint of an open token-weighted window).
"""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from gradtx import testing
from gradtx.checkpoint import functional as ckpt

pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed._local_tensor import LocalTensor, rank_map


def _tree(seed: int = 0, **shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _per_rank(x: torch.Tensor) -> dict[int, torch.Tensor]:
    assert isinstance(x, LocalTensor)
    return dict(sorted(x._local_tensors.items()))


def _own(trees: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Plain tensors whose value on simulated rank r is ``trees[r]``."""
    return {k: rank_map(lambda r, k=k: trees[r][k].clone()) for k in trees[0]}


def test_plain_grads_that_differ_across_ranks_get_each_ranks_local_norm_with_no_collective():
    stages = [_tree(r, w=(3, 4), b=(3,)) for r in range(2)]
    own = [torch.nn.utils.get_total_norm(list(s.values())) for s in stages]  # torch's clip, on each rank
    clip, agc = gtx.clip_by_global_norm(1.0), gtx.adaptive_clip(0.1)
    with testing.simulated_mesh(2, ("pp",)):
        grads = _own(stages)
        comm = testing.RecordingComm()
        _, state = clip.update(grads, clip.init(grads))
        norm = gtx.global_norm(grads)
        agc.update(grads, agc.init(grads), params=grads)
        plan = gtx.mesh_groups(grads, comm=comm)
        gtx.global_norm(grads, mesh_groups=plan)
        audit = gtx.norm_audit(grads, check_replicas=True)
    for got in (state.grad_norm, norm):
        assert [float(v) for v in _per_rank(got).values()] == pytest.approx([float(n) for n in own], rel=1e-6)
    assert comm.calls == [] and plan.plain == "local"
    # The replica check, asked for: these are not replicas (a pipeline stage, or unsynced grads).
    assert audit.replicas is False and audit.row("w").placements == "plain (differs across ranks)"
    assert any("pp_group=" in n for n in audit.notes)


def test_declared_plain_grads_give_each_declaration_its_norm():
    stages = [_tree(r, w=(3, 4), b=(3,)) for r in range(2)]
    own = [math.sqrt(sum(float(t.double().square().sum()) for t in s.values())) for s in stages]
    with testing.simulated_mesh(2, ("pp",)) as mesh:
        grads = _own(stages)
        norms = {
            decl: gtx.global_norm(grads, mesh_groups=gtx.mesh_groups(grads, plain=decl))
            for decl in ("local", "replicated")
        }
        stage_plan = gtx.mesh_groups(grads, comm=gtx.comm.TorchComm(mesh), pp_group="pp")
        summed = gtx.global_norm(grads, mesh_groups=stage_plan)
        audits = {
            "local": gtx.norm_audit(grads, gtx.mesh_groups(grads, plain="local")),
            "replicated": gtx.norm_audit(grads, gtx.mesh_groups(grads, plain="replicated")),
            "pipeline": gtx.norm_audit(grads, stage_plan),
            "undeclared": gtx.norm_audit(grads),
            "checked": gtx.norm_audit(grads, check_replicas=True),
        }
    for decl in ("local", "replicated"):  # counted once on each rank, nothing reduced: each rank's own norm
        assert [float(v) for v in _per_rank(norms[decl]).values()] == pytest.approx(own, rel=1e-6)
    assert [float(v) for v in _per_rank(summed).values()] == pytest.approx([math.hypot(*own)] * 2, rel=1e-6)
    assert audits["local"].row("w").placements == "plain (local)"
    assert audits["replicated"].row("b").placements == "plain (replicated)"
    assert audits["pipeline"].row("w").placements == "plain (pipeline stage)"
    assert audits["undeclared"].row("w").placements == "plain" and audits["undeclared"].replicas is None
    assert audits["checked"].row("w").placements == "plain (differs across ranks)"


def test_replicas_pass_once_and_match_one_device():
    g = _tree(3, w=(5, 2), b=(5,))
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in g.values()]
    for p, t in zip(params, g.values()):
        p.grad = t.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    tx = gtx.clip_by_global_norm(1.0)
    with testing.simulated_mesh(4, ("dp",)) as mesh:
        replicas = testing.distribute(g, mesh, "ddp")  # DDP's layout: every rank its own equal copy
        out, state = tx.update(replicas, tx.init(replicas))
        audit = gtx.norm_audit(replicas, check_replicas=True, comm=gtx.comm.TorchComm(mesh), group="dp")
    for (k, t), p in zip(out.items(), params):
        for v in _per_rank(t).values():
            torch.testing.assert_close(v, p.grad)
    for v in _per_rank(state.grad_norm).values():
        torch.testing.assert_close(v, ref_norm)
    assert audit.row("w").placements == "plain (replicas)" and audit.replicas is True


def test_plain_declaration_is_checked():
    g = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="mesh_groups: plain must be 'replicated' or 'local'"):
        gtx.mesh_groups(g, plain="pipeline")
    with pytest.raises(ValueError, match="plain='local' keeps each rank's norm its own"):
        gtx.mesh_groups(g, plain="local", pp_group="world")
    # Undeclared plain tensors are each rank's own: torch's semantics.
    assert gtx.mesh_groups(g).plain == "local"
    assert gtx.mesh_groups(g, pp_group="world").plain == "pipeline"


# --- rank() on a simulated mesh --------------------------------------------------------------------


def test_torch_comm_rank_is_each_simulated_ranks_own():
    with testing.simulated_mesh((2, 3), ("dp", "tp")) as mesh:
        comm = gtx.comm.TorchComm(mesh)
        ranks = {g: comm.rank(g).node._local_ints for g in ("dp", "tp", "world")}
        zero_config = gtx.comm.torch_dist.mesh_comm([mesh]).rank("tp").node._local_ints
    # Row-major (2, 3) mesh: global rank r sits at (r // 3, r % 3).
    assert ranks["dp"] == {r: r // 3 for r in range(6)}
    assert ranks["tp"] == {r: r % 3 for r in range(6)} == zero_config
    assert ranks["world"] == {r: r for r in range(6)}


@pytest.mark.parametrize(("layout", "shape", "names"), [("fsdp", (2,), ("dp",)), ("tp_fsdp", (2, 2), ("dp", "tp"))])
def test_muon_on_a_simulated_mesh_matches_one_device(layout, shape, names):
    g = _tree(4, w=(8, 6), v=(5, 7))
    params = _tree(5, w=(8, 6), v=(5, 7))
    testing.assert_matches_single_device(
        gtx.muon(0.1), [g, g], params, mesh_shape=shape, names=names, layout=layout, steps=2
    )


def test_a_checkpointed_open_token_window_goes_to_each_groups_first_simulated_rank():
    # Each of 2 dp ranks feeds its own grads; the window is saved after the first of two micro-steps as
    # group totals, and restored with the totals on the group's rank 0 and zeros on the others, so the
    # next sum over dp counts them once. (Resuming it cannot run simulated: accumulate keeps the window's
    # token count on the host, one int for all simulated ranks.)
    micro = [_tree(10 + r, w=(3, 2)) for r in range(2)]
    with testing.simulated_mesh(2, ("dp",)) as mesh:
        tx = gtx.accumulate(2, token_weighted=True, reduce_grads=True, comm=gtx.comm.TorchComm(mesh), group="dp")
        params = testing.distribute({"w": torch.zeros(3, 2)}, mesh, "ddp")
        _, state = tx.update(_own(micro), tx.init(params), tokens=3)
        saved = ckpt.state_dict(state, params, tx=tx)
        resumed = ckpt.load_state_dict(saved, tx.init(params), params, tx=tx)
    assert {r: int(v) for r, v in _per_rank(resumed.tokens).items()} == {0: 6, 1: 0}
    restored = _per_rank(resumed.acc["w"])
    torch.testing.assert_close(restored[0], micro[0]["w"] + micro[1]["w"])
    torch.testing.assert_close(restored[1], torch.zeros(3, 2))


def test_a_replica_check_with_no_plain_tensor_says_there_was_nothing_to_compare():
    from torch.distributed.tensor import Shard

    full = _tree(5, w=(4, 2))
    with testing.simulated_mesh(2, ("dp",)) as mesh:
        grads = testing.distribute(full, mesh, {"w": [Shard(0)]})
        audit = gtx.norm_audit(grads, check_replicas=True)
    assert any("no plain tensors" in n for n in audit.notes)
    assert not any("replicas (DDP" in n for n in audit.notes)
