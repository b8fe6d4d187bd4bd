"""pp_reduce with several tie groups on three gloo ranks: the stages share weights in a cycle, and nothing waits.

Stage 0 holds the embedding (tied to stage 2's head) and a block ``W`` shared with stage 1; stage 1 holds
``W`` and a block ``V`` shared with stage 2; stage 2 holds ``V`` and the head. In each stage's forward
(flatten) order the tie groups form a cycle: stage 0 reduces over (0, 2) first, stage 1 over (0, 1), stage
2 over (1, 2), so each waited on the next and the three hung. The reference is one device, where each
shared weight is one tensor whose grad is the sum of its uses. Every rank builds one ``TorchComm`` of the
three tie groups, as the docs do, though each rank is outside one of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import gradtx as gtx
from gradtx.comm import TorchComm
from tests.distributed.harness import run_distributed

# stage -> (leaf name, tie group, grad value); names sort in forward order
LAYOUT = {
    0: [("0_emb", "A", 1.0), ("1_W", "B", 2.0)],
    1: [("1_W", "B", 3.0), ("2_V", "C", -4.0)],
    2: [("2_V", "C", 5.0), ("3_head", "A", 6.0)],
}
SHARED = {"A": ("0_emb", "3_head"), "B": ("1_W",), "C": ("2_V",)}


def _body(rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    del world_size
    groups = {"A": dist.new_group([0, 2]), "B": dist.new_group([0, 1]), "C": dist.new_group([1, 2])}
    # Every rank builds one comm of all three; new_group gives a rank outside a group NON_GROUP_MEMBER (an int),
    # which TorchComm refused ("groups['A'] must be a ProcessGroup, got int"), so no rank could build this one.
    comm = TorchComm(groups=groups)
    outside = next(k for k, g in groups.items() if not isinstance(g, dist.ProcessGroup))
    try:
        comm.resolve(outside)
    except ValueError as err:
        assert f"this rank is not in group {outside!r}" in str(err), err
    else:
        raise AssertionError(f"resolved {outside!r}, a group this rank is not in")
    params = {n: torch.zeros(2) for n, _, _ in LAYOUT[rank]}
    grads = {n: torch.tensor([v, -v]) for n, _, v in LAYOUT[rank]}
    plan = gtx.mesh_groups(params, comm=comm, pp_group="world", tied={n: g for n, g, _ in LAYOUT[rank]})
    tx = gtx.chain(gtx.pp_reduce(plan), gtx.clip_by_global_norm(1.0, mesh_groups=plan))
    out, state = tx.update(grads, tx.init(params), params)
    return out, gtx.metrics(state)["grad_norm"]


def test_stages_sharing_weights_in_a_cycle_sum_them_and_count_each_once():
    results = run_distributed(_body, world_size=3, timeout=90.0)  # a cycle of waits fails here
    # One device: a shared weight's grad is the sum of its uses.
    total = {g: sum(v for stage in LAYOUT.values() for _, gg, v in stage if gg == g) for g in SHARED}
    ref_grads = [torch.tensor([total[g], -total[g]]) for g in SHARED]
    ref_norm = torch.nn.utils.get_total_norm(ref_grads)
    coef = 1.0 / (float(ref_norm) + 1e-6)
    for rank, (out, norm) in enumerate(results):
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        for name, group, _ in LAYOUT[rank]:
            expected = torch.tensor([total[group], -total[group]]) * coef
            torch.testing.assert_close(out[name], expected, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {name}")
