"""Clip by the global grad norm under TP x FSDP2 and under a pipeline with a tied embedding, checked against one device.

Run on CPU (gloo), four processes, with gradtx installed (``make install`` or ``pip install -e .``;
from a bare checkout, prefix ``PYTHONPATH=.``):

    torchrun --nproc-per-node 4 examples/train_nd_parallel.py              # both modes, one after the other
    torchrun --nproc-per-node 4 examples/train_nd_parallel.py --mode tp-fsdp
    torchrun --nproc-per-node 4 examples/train_nd_parallel.py --mode pp

``tp-fsdp``: a 2x2 ("dp", "tp") mesh. The MLP blocks are tensor parallel
(colwise then rowwise) and everything is FSDP2-sharded over "dp", so the grads
are DTensors on two different meshes with Shard, _StridedShard and Replicate
placements; ``torch.nn.utils.clip_grad_norm_`` fails on them. gradtx needs no
configuration here: ``clip_by_global_norm(max_norm)`` reads the plan from the
placements and reduces over each DTensor's own mesh.

``pp``: a 2x2 ("pp", "dp") mesh. A tiny LM is cut into two
``torch.distributed.pipelining`` stages (GPipe, two micro-batches), each
FSDP2-sharded over "dp". What placements cannot say is declared once: the
pipeline group, and that the LM head on stage 1 is tied to the embedding on
stage 0 (``gtx.mesh_groups(..., pp_group="pp", tied=...)``, no comm needed);
``gtx.pp_reduce`` sums the two copies' grads and the norm counts the weight once.

Each rank also trains the unsharded model on the whole batch in its own
process, and rank 0 prints the gradtx grad norm next to that single-device
reference for a few AdamW steps, then the largest difference between the
trained weights.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradtx as gtx

DIM, HIDDEN, VOCAB, SEQ = 16, 32, 24, 6
MAX_NORM, LR, STEPS = 0.5, 1e-2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.w2(F.gelu(self.w1(x))))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stage0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = Block()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids))


class Stage1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(h))


class TiedLM(nn.Module):
    """The single-device model: the head *is* the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.stage0, self.stage1 = Stage0(), Stage1()
        self.stage1.head.weight = self.stage0.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stage1(self.stage0(ids))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return norm


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def run_tp_fsdp(mesh: DeviceMesh) -> None:
    log("== TP x FSDP2 on a 2x2 ('dp', 'tp') mesh ==")
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    # Zero configuration: the clip reads the plan from the grads' placements (built once, cached), and
    # apply_if_finite agrees on a skip over the DTensors' mesh. Print the plan it infers, for the log.
    log(f"plan read from the placements: {gtx.mesh_groups([list(model.parameters())])}")
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR),
        gtx.apply_if_finite(gtx.clip_by_global_norm(MAX_NORM), max_consecutive_errors=3),
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)

    dp_rank, n = mesh.get_local_rank("dp"), 8
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(2 * n, DIM, generator=g), torch.randn(2 * n, 1, generator=g)
        loss = F.mse_loss(model(x[dp_rank * n : (dp_rank + 1) * n]), y[dp_rank * n : (dp_rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_norm = reference_step(ref, ref_opt, F.mse_loss(ref(x), y))
        log(
            f"step {step}: gradtx grad_norm {float(opt.metrics['grad_norm']):.6f}   single-device {float(ref_norm):.6f}"
        )

    try:
        model(x[:n]).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    except RuntimeError as err:
        log(f"torch.nn.utils.clip_grad_norm_ on this layout: {str(err).splitlines()[0][:100]}...")
    diff = max(float((full(p.detach()) - r.detach()).abs().max()) for p, r in zip(model.parameters(), ref.parameters()))
    log(f"max |param - single-device param| after {STEPS} steps: {diff:.2e}")


def run_pp(mesh: DeviceMesh) -> None:
    log("== 2-stage pipeline (GPipe) x FSDP2 on a 2x2 ('pp', 'dp') mesh, embedding tied to the LM head ==")
    torch.manual_seed(0)
    ref = TiedLM()
    stage_idx, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    if stage_idx == 0:
        module: nn.Module = copy.deepcopy(ref.stage0)
    else:
        module = Stage1()
        module.load_state_dict({k: v.detach().clone() for k, v in ref.stage1.state_dict().items()})
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, stage_idx, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lm_loss)

    # Each stage names its own copy of the tied weight; both copies are Shard(0) over "dp" alike.
    tie = module.emb.weight if stage_idx == 0 else module.head.weight
    # The pipeline group and the tied weight are what placements cannot say: declared once, no comm needed
    # ("pp" resolves through the stage's FSDP2 mesh). Without it, clip_by_global_norm(MAX_NORM) refuses.
    plan = gtx.mesh_groups([list(module.parameters())], pp_group="pp", tied={lambda path, p: p is tie: "pp"})
    log(f"plan (stage 0): {plan}")
    tx = gtx.chain(gtx.pp_reduce(plan), gtx.clip_by_global_norm(MAX_NORM, mesh_groups=plan))
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(module.parameters(), lr=LR), tx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)

    n = 4
    for step in range(STEPS):
        g = torch.Generator().manual_seed(200 + step)
        ids, targets = (
            torch.randint(0, VOCAB, (2 * n, SEQ), generator=g),
            torch.randint(0, VOCAB, (2 * n, SEQ), generator=g),
        )
        mine = slice(dp_rank * n, (dp_rank + 1) * n)
        if stage_idx == 0:
            schedule.step(ids[mine])
        else:
            schedule.step(target=targets[mine])
        opt.step()
        opt.zero_grad()
        ref_norm = reference_step(ref, ref_opt, lm_loss(ref(ids), targets))
        log(
            f"step {step}: gradtx grad_norm {float(opt.metrics['grad_norm']):.6f}   single-device {float(ref_norm):.6f}"
        )

    prefix = f"stage{stage_idx}."
    ref_params = dict(ref.named_parameters())
    diffs = []
    for name, p in module.named_parameters():
        ref_name = "stage0.emb.weight" if (stage_idx, name) == (1, "head.weight") else prefix + name
        diffs.append(float((full(p.detach()) - ref_params[ref_name].detach()).abs().max()))
    diff = torch.tensor(max(diffs))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    log(f"max |param - single-device param| after {STEPS} steps, both stages: {float(diff):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["tp-fsdp", "pp", "all"], default="all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit(f"run with torchrun --nproc-per-node 4 (got world size {dist.get_world_size()})")
    if args.mode in ("tp-fsdp", "all"):
        run_tp_fsdp(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    if args.mode in ("pp", "all"):
        run_pp(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    dist.barrier()  # every rank is done before the groups go away (gloo aborts a rank otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    main()
