"""Case f: one ``gtx.testing.assert_matches_single_device`` on a simulated 2x2 TP x FSDP2 mesh against the same
check under 4 gloo processes (what a ``torchrun`` test costs: start the ranks, init the group, check, tear down).

Both contenders run the same check on the same grads: a small transformer's params and two steps of its
grads, laid out ``"tp_fsdp"`` over ``(dp, tp) = (2, 2)``, through ``chain(clip_by_global_norm, adamw)``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import CaseResult, Contender, measure

F_SIM = "simulated 2x2 mesh in one process (LocalTensorMode)"
F_GLOO = "4 gloo processes (spawn, init_process_group, check, destroy)"
SHAPE = (2, 2)
NAMES = ("dp", "tp")


def transformer_grads(quick: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A small transformer's params and two steps of grads (a real backward on random tokens)."""
    torch.manual_seed(0)
    d, layers, vocab = (32, 1, 64) if quick else (64, 2, 128)
    layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(vocab, d),
            "blocks": torch.nn.TransformerEncoder(layer, layers),
            "head": torch.nn.Linear(d, vocab),
        }
    )
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads_seq = []
    for _ in range(2):
        tokens = torch.randint(0, vocab, (4, 16))
        logits = model["head"](model["blocks"](model["emb"](tokens)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
        model.zero_grad()
        loss.backward()
        grads_seq.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return params, grads_seq


def _tx() -> Any:
    import gradtx as gtx

    return gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3, weight_decay=0.1))


def _check(params: Any, grads_seq: Any) -> None:
    from gradtx import testing

    testing.assert_matches_single_device(_tx(), grads_seq, params, mesh_shape=SHAPE, names=NAMES, layout="tp_fsdp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, params: Any, grads_seq: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _check(params, grads_seq)
    finally:
        dist.destroy_process_group()


def _gloo(params: Any, grads_seq: Any) -> None:
    mp.start_processes(_rank, args=(4, _free_port(), params, grads_seq), nprocs=4, start_method="spawn")


def case_f(ctx: Any) -> CaseResult:
    """assert_matches_single_device: simulated mesh vs 4 gloo processes."""
    params, grads_seq = transformer_grads(ctx.quick)
    n = sum(t.numel() for t in params.values())
    desc = f"{len(params)} tensors, {n:,} params, 2 steps of chain(clip_by_global_norm, adamw)"
    ctx.log(f"  case f: {desc}")
    contenders = [
        Contender(F_GLOO, lambda: _gloo(params, grads_seq), "the baseline: a torchrun-style test, start to end"),
        Contender(F_SIM, lambda: _check(params, grads_seq), "gtx.testing.assert_matches_single_device, start to end"),
    ]
    result = CaseResult("f", f"f. assert_matches_single_device on 2x2 TP x FSDP2, small transformer ({desc})")
    result.timings, result.contention = measure(
        contenders, reps=max(3, ctx.reps // 3), warmup=1, device=ctx.device, log=ctx.log, wait_quiet=ctx.wait_quiet
    )
    result.ratios = [(f"{F_SIM} / {F_GLOO}", F_SIM, F_GLOO)]
    return result
