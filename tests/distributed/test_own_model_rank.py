"""A rank that trains a model of its own beside DDP on a subgroup: the zero-config clip issues no collective.

Three gloo processes: ranks 0 and 1 train one model under DDP on ``dist.new_group([0, 1])``; rank 2
trains a small model of its own. ``TransformedOptimizer(AdamW, clip_by_global_norm(0.5))`` must not
wait for a collective the other ranks never join (a world all-reduce hung here, 30 minutes under gloo),
and must clip each rank by its local norm, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import gradtx as gtx
from tests.distributed.harness import run_distributed


def _body(rank: int, world_size: int) -> dict[str, object]:
    del world_size
    pair = dist.new_group([0, 1])  # every rank creates the group, as torch requires
    torch.manual_seed(0 if rank < 2 else 7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    if rank == 2:
        model = torch.nn.Linear(4, 2)  # a model of its own
    ref = copy.deepcopy(model)
    trained = torch.nn.parallel.DistributedDataParallel(model, process_group=pair) if rank < 2 else model
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), gtx.clip_by_global_norm(0.5))
    norms, torch_norms = [], []
    for step in range(3):
        x = torch.randn(8, 6 if rank < 2 else 4, generator=torch.Generator().manual_seed(10 * rank + step))
        opt.zero_grad()
        trained(x).square().mean().backward()
        opt.step()
        norms.append(float(opt.metrics["grad_norm"]))
        # torch's recipe on the same grads: DDP's synced mean on ranks 0 and 1, the own grads on rank 2
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        if rank < 2:
            for p in ref.parameters():
                dist.all_reduce(p.grad, group=pair)
                p.grad /= 2
        torch_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        ref_opt.step()
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    return {"norms": norms, "torch_norms": torch_norms, "params_match": same}


def test_a_rank_with_its_own_model_clips_by_its_local_norm_and_does_not_hang():
    results = run_distributed(_body, world_size=3, timeout=180.0)  # a hang fails here, not after 30 minutes
    for rank, r in enumerate(results):
        assert r["norms"] == pytest.approx(r["torch_norms"], rel=1e-5), (rank, r)
        assert r["params_match"], rank
    assert results[0]["norms"] == results[1]["norms"]  # DDP's replicas: one norm
    assert results[2]["norms"] != results[0]["norms"]  # rank 2's own
