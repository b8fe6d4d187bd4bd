"""gtx.norm_audit: per leaf, the groups summed and skipped and the share of the norm; and a simulated pipeline."""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from gradtx import testing

pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed._local_tensor import rank_map


def _tree(seed: int = 0, **shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _sq(t: torch.Tensor) -> float:
    return float(t.double().square().sum())


def test_one_device_shares_are_each_leafs_part_of_the_squared_norm():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}
    audit = gtx.norm_audit(grads)
    assert audit.plan.startswith("none") and audit.collectives == 0 and audit.notes == ()
    assert audit.norm == pytest.approx(5.0)
    assert [r.share for r in audit] == pytest.approx([9 / 25, 16 / 25])
    assert audit.row("b").placements == "plain" and audit.row("b").global_numel == 1
    assert "norm (p=2) = 5" in str(audit)
    inf = gtx.norm_audit(grads, norm_type=math.inf)
    assert inf.norm == pytest.approx(4.0) and inf.row("b").share == pytest.approx(1.0)


def test_tp_fsdp_rows_name_the_dims_summed_and_skipped_and_match_one_device():
    full = _tree(w=(5, 3), v=(3, 4), b=(3,), s=())
    total = sum(_sq(t) for t in full.values())
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        grads = testing.distribute(full, mesh, "tp_fsdp")
        audit = gtx.norm_audit(grads)
        declared = gtx.norm_audit(grads, gtx.mesh_groups(grads))
    # the zero-config norm on one mesh over the world: one all-reduce; the declared plan: one per sharded dim
    assert audit.plan == "placements" and audit.collectives == 1 and audit.notes == ()
    assert declared.collectives == 2 and declared.norm == pytest.approx(audit.norm, rel=1e-12)
    assert audit.norm == pytest.approx(math.sqrt(total), rel=1e-6)
    w, v, b, s = (audit.row(k) for k in ("w", "v", "b", "s"))
    assert w.summed == ("dp", "tp") and w.skipped == () and w.local_numel == (6, 3, 4, 2)  # uneven, per rank
    assert w.placements == "(dp=S(0), tp=S(1))"  # FSDP2 over a row-wise TP weight
    assert v.summed == ("dp", "tp") and v.placements == "(dp=_S(0, 2), tp=S(0))"  # over a column-wise one
    assert b.summed == ("dp",) and b.skipped == ("tp: replicated",)
    assert s.summed == () and s.skipped == ("dp: replicated", "tp: replicated")
    for k in full:
        assert audit.row(k).share == pytest.approx(_sq(full[k]) / total, rel=1e-5)


def test_a_double_count_shows_in_the_shares():
    # A plain bias declared sharded over 4 ranks that actually hold copies of it: counted 4 times.
    grads = {"w": torch.tensor([[1.0, 2.0]]), "b": torch.tensor([2.0])}
    with testing.simulated_mesh(4, ("tp",)) as mesh:
        g = testing.distribute(grads, mesh, "ddp")
        wrong = gtx.mesh_groups(g, comm=gtx.comm.TorchComm(mesh), sharded={"b": "tp"})
        audit = gtx.norm_audit(g, wrong)
    assert audit.plan == "declared" and audit.row("b").summed == ("tp",)
    assert audit.norm == pytest.approx(math.sqrt(5 + 4 * 4))  # one device: sqrt(5 + 4)
    assert audit.row("b").share == pytest.approx(16 / 21)


def _stages():
    """A two-stage model: stage r holds emb (tied: stage 0's embedding, stage 1's head) and its own block."""
    stages = [_tree(10 + r, emb=(3, 2), block=(2, 2)) for r in range(2)]
    whole = {"emb": stages[0]["emb"] + stages[1]["emb"], "block0": stages[0]["block"], "block1": stages[1]["block"]}
    return stages, whole


def _on_stages(stages):
    return {k: rank_map(lambda r, k=k: stages[r][k].clone()) for k in stages[0]}


def test_a_plain_tensor_pipeline_without_a_plan_is_a_per_stage_norm_the_audit_shows():
    stages, _ = _stages()
    with testing.simulated_mesh(2, ("pp",)):
        g = _on_stages(stages)
        audit = gtx.norm_audit(g, check_replicas=True)  # the one collective the check needs, asked for
    assert audit.plan.startswith("none") and audit.replicas is False
    assert any("pp_group" in n for n in audit.notes)
    assert isinstance(audit.norm, tuple) and audit.norm[0] != audit.norm[1]  # each stage: its own norm
    assert any("ranks disagree" in n for n in audit.notes)


def test_a_declared_plain_tensor_pipeline_matches_one_device():
    stages, whole = _stages()
    expected, _ = gtx.clip_by_global_norm(1.0).update(whole, gtx.clip_by_global_norm(1.0).init(whole))
    with testing.simulated_mesh(2, ("pp",)) as mesh:
        g = _on_stages(stages)
        plan = gtx.mesh_groups(g, comm=gtx.comm.TorchComm(mesh), pp_group="pp", tied={"emb": "pp"})
        tx = gtx.chain(gtx.pp_reduce(plan), gtx.clip_by_global_norm(1.0, mesh_groups=plan))
        out, state = tx.update(g, tx.init(g))
        audit = gtx.norm_audit(g, plan)
        after_tie = gtx.norm_audit(gtx.pp_reduce(plan).update(g, ())[0], plan)
        norm_after_tie = after_tie.norm
        emb, block = out["emb"]._local_tensors, out["block"]._local_tensors
        norms = state[1].grad_norm._local_tensors
    for r in range(2):
        torch.testing.assert_close(emb[r], expected["emb"])
        torch.testing.assert_close(block[r], expected[f"block{r}"])
        torch.testing.assert_close(
            norms[r], torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in whole.values()]))
        )
    assert audit.row("emb").tied == "pp: 1/2" and audit.row("block").pipeline == "pp"
    assert norm_after_tie == pytest.approx(math.sqrt(sum(_sq(t) for t in whole.values())), rel=1e-6)
    assert after_tie.notes == ()  # each stage's share differs by rank, but the norm is one: no "disagree" note


def test_the_audit_refuses_what_is_not_a_plan_or_a_tensor():
    with pytest.raises(TypeError, match="norm_audit: mesh_groups must be a plan"):
        gtx.norm_audit({"a": torch.ones(2)}, {"a": "tp"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"norm_audit: grads leaf at .*a.* is a float"):
        gtx.norm_audit({"a": 1.0})
    with pytest.raises(KeyError, match="no leaf at 'c'"):
        gtx.norm_audit({"a": torch.ones(2)}).row("c")
