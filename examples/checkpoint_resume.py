"""Save a sharded run on 4 ranks with torch.distributed.checkpoint, resume it on 2, get the same params.

An FSDP2 model, a ``torch.optim.AdamW`` behind ``gtx.TransformedOptimizer`` with
``accumulate(4)`` and ``clip_by_global_norm(1.0)``. The run takes 16 micro-steps
of a fixed global batch schedule; the 4-rank run checkpoints after micro-step 8,
at the boundary of its second accumulation window (a DCP checkpoint is made at a
boundary: its template holds no partial sums), with torch's own
``get_state_dict`` and ``dcp.save``, as torchtitan does (flattened optimizer
dicts). A 2-rank run loads that checkpoint with ``dcp.load`` and
``set_state_dict`` and takes micro-steps 8..15. Its final params must match
the 4-rank run's, and a single-device run in plain torch (mean of each window's
grads, ``clip_grad_norm_``, ``AdamW``).

Run it (CPU, gloo)::

    torchrun --standalone --nproc-per-node 4 examples/checkpoint_resume.py --phase save --dir /tmp/ckpt
    torchrun --standalone --nproc-per-node 2 examples/checkpoint_resume.py --phase resume --dir /tmp/ckpt

or ``python examples/checkpoint_resume.py`` to run both through torchrun in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

K, TOTAL, SAVE_AT, ROWS = 4, 16, 8, 16
LR, MAX_NORM = 1e-2, 1.0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def micro_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def reference() -> dict[str, torch.Tensor]:
    """One process, no gradtx: the mean of each window's grads, clipped, then AdamW."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for w in range(TOTAL // K):
        sum(F.mse_loss(model(x), y) for x, y in map(micro_batch, range(w * K, (w + 1) * K))).div(K).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def build():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradtx as gtx

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("dp",))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    plan = gtx.mesh_groups([list(model.parameters())], comm=gtx.comm.TorchComm(mesh))
    tx = gtx.chain(gtx.accumulate(K), gtx.clip_by_global_norm(MAX_NORM, mesh_groups=plan))
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), tx)
    return model, opt


def train(model: nn.Module, opt, steps: range) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    for i in steps:
        x, y = micro_batch(i)
        F.mse_loss(model(x[rows]), y[rows]).backward()  # FSDP2 averages the ranks' grads: the global mean
        opt.step()
        opt.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def main() -> int:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    options = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's setting
    model, opt = build()
    status = 0
    if args.phase == "save":
        train(model, opt, range(SAVE_AT))
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(args.dir, "step"))
        if rank == 0:
            print(f"saved on {world} ranks after micro-step {SAVE_AT}, window open: {opt.window_open}")
        train(model, opt, range(SAVE_AT, TOTAL))
        params = full_params(model)
        if rank == 0:
            torch.save(params, os.path.join(args.dir, "uninterrupted.pt"))
    else:
        model_sd, optim_sd = get_state_dict(model, opt, options=options)  # what to load into
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(args.dir, "step"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        if rank == 0:
            print(f"resumed on {world} ranks at micro-step {SAVE_AT}, window open: {opt.window_open}")
        train(model, opt, range(SAVE_AT, TOTAL))
        params = full_params(model)
        if rank == 0:
            uninterrupted = torch.load(os.path.join(args.dir, "uninterrupted.pt"))
            ref = reference()
            vs_run = max(float((params[n] - uninterrupted[n]).abs().max()) for n in params)
            vs_ref = max(float((params[n] - ref[n]).abs().max()) for n in params)
            match = vs_run <= 1e-5 and vs_ref <= 1e-5
            print(f"max |param diff| vs the uninterrupted 4-rank run = {vs_run:.1e}")
            print(f"max |param diff| vs a single-device torch run   = {vs_ref:.1e}")
            print(f"match: {match}")
            status = 0 if match else 1
    # Every rank is done before the groups go away: a rank that tears gloo down (or exits) while a
    # peer is still in a collective aborts ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return status


def launch_both() -> int:
    """Without torchrun: run the save phase on 4 processes, then the resume phase on 2."""
    with tempfile.TemporaryDirectory() as tmp:
        for phase, n in (("save", 4), ("resume", 2)):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   os.path.abspath(__file__), "--phase", phase, "--dir", tmp]  # fmt: skip
            done = subprocess.run(cmd, check=False)
            if done.returncode != 0:
                return done.returncode
    return 0


if __name__ == "__main__":
    if "RANK" not in os.environ:  # not under torchrun: both phases, in a temporary directory (--help says so)
        argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
        sys.exit(launch_both())
    code = main()
    # Leave without the interpreter's teardown: on a busy 2-core CPU box, gloo's background threads
    # have aborted it now and then ("terminate called without an active exception") after the work
    # was done and the process groups were destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
