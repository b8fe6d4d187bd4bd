"""Plain-tensor grads in a real 2-rank gloo run: torch's semantics, and the replica check you ask for.

One spawned program checks, on each rank:

* a 2-stage pipeline of plain tensors (each rank holds one Linear of a 2-layer model): the
  zero-config clip is each stage's own norm, as ``torch.nn.utils.clip_grad_norm_`` on that rank, with
  no collective; ``gtx.norm_audit(grads, check_replicas=True)`` says they differ and names ``pp_group=``;
* the same stages with ``pp_group`` declared: the clipped grads and the norm are the single-device ones;
* ``plain="local"``: each rank clips by its own norm (``torch.nn.utils.clip_grad_norm_`` on that rank);
* DDP grads taken under ``no_sync`` (each rank's own, unsynced): the audit's check finds them unequal;
* synced DDP grads with the zero-config clip match ``torch.nn.utils.clip_grad_norm_`` on the same grads,
  and the audit's check finds them replicas.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradtx as gtx
from tests.distributed.harness import part_results, share_spawn

MAX_NORM = 0.5


def _clip(grads: dict[str, torch.Tensor], **kw) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    tx = gtx.clip_by_global_norm(MAX_NORM, **kw)
    out, state = tx.update(grads, tx.init(grads))
    return out, state.grad_norm


def _body(rank: int) -> dict:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 3), nn.Linear(3, 2)]  # the same whole model on every rank
    x = torch.randn(5, 4)
    whole = nn.Sequential(*copy.deepcopy(layers))
    whole(x).square().sum().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM)  # one device: the reference
    expected = {f"{i}.{n}": p.grad for i, m in enumerate(whole) for n, p in m.named_parameters()}

    # The pipeline: rank r holds layer r; the activations travel by send/recv, the grads stay on their stage.
    stage = copy.deepcopy(layers[rank])
    if rank == 0:
        h = stage(x)
        dist.send(h.detach(), dst=1)
        dh = torch.empty_like(h)
        dist.recv(dh, src=1)
        h.backward(dh)
    else:
        h = torch.empty(5, 3)
        dist.recv(h, src=0)
        h.requires_grad_(True)
        stage(h).square().sum().backward()
        dist.send(h.grad, dst=0)
    grads = {f"{rank}.{n}": p.grad for n, p in stage.named_parameters()}
    out: dict = {"rank": rank}
    own = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(own, grads.values()):
        p.grad = g.clone()
    own_norm = torch.nn.utils.clip_grad_norm_(own, MAX_NORM)
    clipped, norm = _clip(grads)
    out["pipeline_zero_config"] = (clipped, norm, dict(zip(grads, (p.grad for p in own))), own_norm)
    audit = gtx.norm_audit(grads, check_replicas=True)
    out["pipeline_audit"] = (audit.replicas, " ".join(audit.notes))
    plan = gtx.mesh_groups(grads, pp_group="world")
    clipped, norm = _clip(grads, mesh_groups=plan)
    out["pipeline_declared"] = (clipped, norm, {k: expected[k] for k in grads}, expected_norm)

    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g.clone()
    local_norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    clipped, norm = _clip(grads, mesh_groups=gtx.mesh_groups(grads, plain="local"))
    out["local"] = (clipped, norm, dict(zip(grads, (p.grad for p in params))), local_norm)

    # DDP: each rank's own batch; under no_sync the grads are still each rank's own.
    torch.manual_seed(1)
    ddp = DDP(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    batch = torch.randn(6, 4) + rank
    with ddp.no_sync():
        ddp(batch).square().sum().backward()
    unsynced = {n: p.grad.clone() for n, p in ddp.named_parameters()}
    out["ddp_no_sync"] = gtx.norm_audit(unsynced, check_replicas=True).replicas
    ddp.zero_grad()
    ddp(batch).square().sum().backward()
    synced = {n: p.grad.clone() for n, p in ddp.named_parameters()}
    clipped, norm = _clip(synced)
    ref_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
    out["ddp"] = (clipped, norm, {n: p.grad for n, p in ddp.named_parameters()}, ref_norm)
    out["ddp_audit"] = gtx.norm_audit(synced, check_replicas=True).replicas
    return out


_SHARED = share_spawn({"body": _body}, 2, prefix="plain_ambiguity")


def test_plain_tensor_grads_get_torchs_semantics_and_the_audit_checks_replicas():
    results = part_results(_SHARED(), "body")
    for r in results:
        assert r["pipeline_audit"][0] is False and "pp_group=" in r["pipeline_audit"][1], r["pipeline_audit"]
        assert r["ddp_no_sync"] is False and r["ddp_audit"] is True
        for case in ("pipeline_zero_config", "pipeline_declared", "local", "ddp"):
            clipped, norm, expected, expected_norm = r[case]
            torch.testing.assert_close(norm, expected_norm.to(norm.dtype), rtol=1e-6, atol=0)
            torch.testing.assert_close(clipped, expected, rtol=1e-6, atol=1e-7)
    # each stage's own norm, with no plan or with plain="local": the two stages' differ.
    assert not torch.equal(results[0]["local"][1], results[1]["local"][1])
    assert not torch.equal(results[0]["pipeline_zero_config"][1], results[1]["pipeline_zero_config"][1])
