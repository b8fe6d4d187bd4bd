"""Muon: gradtx against torch.optim.Muon on one device, and the sharded exchange on 4 gloo ranks.

Writes ``docs/benchmarks_muon.md`` (``--out``), a page of its own because
``benchmarks/run.py`` regenerates ``docs/benchmarks.md`` whole::

    .venv/bin/python benchmarks/muon.py                 # GPU when there is one
    .venv/bin/python benchmarks/muon.py --quick         # tiny shapes: a smoke run

* **Step time**, one device: the block matrices of GPT-2 small (48 tensors,
  84,934,656 params; embeddings and vectors go to AdamW in both, so they are
  left out of both) with the same momentum, Newton–Schulz in bf16, weight
  decay and learning rate. ``torch.optim.Muon.step()`` against
  ``gtx.muon(..., bias_correction=False, ns_dtype=torch.bfloat16)`` through
  ``update_and_apply``; round-robin rounds in one process, medians, the ratio
  per round. Target: gradtx / torch <= 1.1. Also the torch ops each step
  dispatches, views left out (what launches kernels on a GPU: a step there is
  bound by launches at these sizes), counted with ``torch.profiler``.
* **Exchange**, 4 gloo ranks, FSDP2 ``Shard(0)`` DTensor grads: the bytes
  each rank sends and receives per step (measured by ``RecordingComm`` on the
  real all-to-alls, and from :func:`gradtx.exchange_plan` for the full model)
  against an all-gather of every matrix to every rank (target <= 0.5), and the
  Newton–Schulz flops each rank does against the total (target about 1/4).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradtx as gtx
from benchmarks.cases import gpt2_shapes
from benchmarks.harness import Contender, measure

LR, WD, MOMENTUM = 0.02, 0.1, 0.95


def matrix_shapes(quick: bool, n_layer: int = 12, n_embd: int = 768) -> dict[str, tuple[int, ...]]:
    cfg = {"n_layer": 2, "n_embd": 64, "vocab_size": 1000, "n_positions": 64} if quick else {"n_layer": n_layer}
    if not quick and n_embd != 768:
        cfg["n_embd"] = n_embd
    # HF's Conv1D weights are (in, out); torch.optim.Muon and gtx read (out, in): transpose them.
    return {k: tuple(reversed(s)) for k, s in gpt2_shapes(**cfg).items() if len(s) == 2 and k.startswith("h.")}


# Ops that make no kernel: views, and dtype casts to the same dtype (counted only when they copy).
_VIEWS = {
    "aten::reshape", "aten::view", "aten::permute", "aten::mT", "aten::t", "aten::numpy_T", "aten::transpose",
    "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::unbind", "aten::as_strided", "aten::expand",
    "aten::detach", "aten::alias", "aten::slice", "aten::split", "aten::chunk", "aten::lift_fresh",
}  # fmt: skip


def ops_per_step(step: Any) -> int:
    """The torch ops one call of ``step`` dispatches at its top level (inside ``Optimizer.step``), views left out."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    n = 0
    for e in prof.events():
        parent = e.cpu_parent
        top = parent is None or parent.name.startswith("Optimizer.step#")
        if not top or not e.name.startswith("aten::") or e.name in _VIEWS:
            continue
        if e.name == "aten::to" and not e.cpu_children:  # the same dtype: returns the tensor itself
            continue
        n += 1
    return n


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def step_time(device: torch.device, quick: bool, reps: int, n_layer: int, n_embd: int) -> dict[str, Any]:
    shapes = matrix_shapes(quick, n_layer, n_embd)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen).to(device) for s in shapes.values()]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(device) for s in shapes.values()]
    ref = [p.clone().requires_grad_() for p in full]
    for p, g in zip(ref, grads):
        p.grad = g
    opt = torch.optim.Muon(ref, lr=LR, weight_decay=WD, momentum=MOMENTUM)
    tx = gtx.muon(LR, beta=MOMENTUM, eps=1e-7, weight_decay=WD, bias_correction=False, ns_dtype=torch.bfloat16)
    box = {"params": [p.clone() for p in full]}
    box["state"] = tx.init(box["params"])

    def gtx_step() -> None:
        box["params"], box["state"] = gtx.update_and_apply(tx, grads, box["state"], box["params"])

    def torch_step() -> None:
        opt.step()

    torch_name, gtx_name = "torch.optim.Muon.step()", "gtx.muon: update_and_apply (pure)"
    load_before = _load()
    timings, contention = measure(
        [Contender(torch_name, torch_step), Contender(gtx_name, gtx_step)],
        reps=reps, warmup=2, device=device, log=lambda s: None,
    )  # fmt: skip
    load_after = _load()
    t = {x.name: x for x in timings}
    ops = {"torch": ops_per_step(torch_step), "gtx": ops_per_step(gtx_step)}  # one more step each: still in step
    # Same numbers: after the same steps both hold the same params (the runs above took the same count).
    err = max(float((a - b.detach()).abs().max()) for a, b in zip(box["params"], ref))
    per_round = [a / b for a, b in zip(t[gtx_name].seconds, t[torch_name].seconds)]
    return {
        "shapes": f"{len(shapes)} matrices, {sum(math.prod(s) for s in shapes.values()):,} params",
        "torch_ms": 1e3 * t[torch_name].median,
        "gtx_ms": 1e3 * t[gtx_name].median,
        "ratio": statistics.median(per_round),
        "max_abs_diff": err,
        "contention": contention,
        "load": (load_before, load_after),
        "ops": ops,
        "threads": torch.get_num_threads(),
        "reps": reps,
        "layers": n_layer if not quick else 2,
        "width": n_embd if not quick else 64,
    }


def _exchange_body(rank: int, world: int, quick: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gradtx.comm.torch_dist import mesh_comm
    from gradtx.testing import RecordingComm

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out: dict[str, Any] = {}
    for label, shapes in (("measured", matrix_shapes(True)), ("full", matrix_shapes(quick))):
        gen = torch.Generator().manual_seed(0)
        grads = {
            # The plan reads shapes only: the full model's values are left empty.
            k: distribute_tensor(
                torch.randn(s, generator=gen) if label == "measured" else torch.empty(s),
                mesh,
                [Shard(0)],
                src_data_rank=None,
            )
            for k, s in shapes.items()
        }
        plan = gtx.exchange_plan(grads, rank=rank)
        out[label] = {"plan": plan._asdict(), "numel": sum(math.prod(s) for s in shapes.values())}
        if label == "measured":
            comm = RecordingComm(mesh_comm([mesh]))
            tx = gtx.orthogonalize(comm=comm)
            t0 = time.perf_counter()
            tx.update(grads, tx.init(grads))
            out[label]["seconds"] = time.perf_counter() - t0
            calls = [c for c in comm.calls if c.op == "all_to_all"]
            me = comm.rank(mesh)
            out[label]["collectives"] = len(calls)
            out[label]["sent_bytes"] = 4 * sum(math.prod(s) for c in calls for r, s in enumerate(c.shapes) if r != me)
    return out


def exchange(quick: bool) -> list[dict[str, Any]]:
    from tests.distributed.harness import run_distributed

    return run_distributed(_exchange_body, 4, args=(quick,), timeout=600)


def report(single: dict[str, Any] | None, ranks: list[dict[str, Any]] | None, device: str, cmd: str) -> str:
    lines = ["# Benchmarks: Muon", "", f"Generated by `{cmd}` on {device}.", ""]
    if single is not None:
        ok = "met" if single["ratio"] <= 1.1 else "NOT met"
        lines += [
            "## Step time on one device", "",
            (f"GPT-2's block matrices, {single['layers']} blocks of width {single['width']} ({single['shapes']}; "
             "GPT-2 small has 12 of width 768), fp32 params, Newton–Schulz in bf16, "
            f"{single['reps']} rounds; the same hyperparameters in both."), "",
            "| contender | median ms |", "|---|---|",
            f"| `torch.optim.Muon.step()` | {single['torch_ms']:.2f} |",
            (f"| `gtx.muon(..., bias_correction=False, ns_dtype=torch.bfloat16)` via `update_and_apply` | "
            f"{single['gtx_ms']:.2f} |"), "",
            (f"**gradtx / torch = {single['ratio']:.3f}** (median of per-round ratios; target <= 1.1: {ok}). "
            f"Largest difference between the two runs' params after all rounds: {single['max_abs_diff']:.2e}."), "",
            (f"Ops dispatched per step, views left out (a GPU launches a kernel for each): torch "
            f"{single['ops']['torch']}, gradtx {single['ops']['gtx']}."), "",
        ]  # fmt: skip
        lb, la = single["load"]
        if lb is not None:
            share = single["contention"]
            lines += [
                (f"{single['threads']} torch thread(s); 1-min load average {lb:.2f} before and {la:.2f} after, "
                f"on {os.cpu_count()} cores" + (f"; other processes used {share:.0%} of the CPUs while it ran"
                if share is not None else "") + "."), "",
            ]  # fmt: skip
    if ranks is not None:
        m = ranks[0]["measured"]
        lines += [
            "## Exchange on 4 gloo ranks (FSDP2 `Shard(0)`)", "",
            ("Per step every rank sends its shard of each matrix to the matrix's owner and gets its shard of the "
            "result back: 2 all-to-alls per mesh and dtype. With `N` bytes of sharded matrices and `W` ranks, a "
            "rank sends and receives about `2 N (W-1) / W²`; an all-gather of every matrix to every rank receives "
            "`N (W-1) / W` per rank, so the ratio is `2 / W` (0.5 on 4 ranks)."), "",
            ("| model | rank | all-to-alls | sent (B) | received (B) | all-gather (B) | received / all-gather "
            "| NS flops on this rank / total |"),
            "|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for label in ("measured", "full"):
            for r, res in enumerate(ranks):
                p = res[label]["plan"]
                colls = res[label].get("collectives", p["collectives"])
                sent = res[label].get("sent_bytes", p["sent_bytes"])
                share = p["flops"][r] / p["total_flops"]
                lines.append(
                    f"| {label} ({res[label]['numel']:,} params) | {r} | {colls} | {sent:,} | "
                    f"{p['received_bytes']:,} | {p['all_gather_bytes']:,} | "
                    f"{p['received_bytes'] / p['all_gather_bytes']:.3f} | {share:.3f} |"
                )
        lines += [
            "",
            (
                "The `measured` rows count the bytes of the all-to-alls a real step issued (`RecordingComm`, "
                f"one step took {m['seconds']:.2f} s on rank 0); the `full` rows are `gtx.exchange_plan` on "
                "GPT-2 small's block matrices (the same owner assignment a step uses, computed from shapes)."
            ),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 blocks in the step-time case (12: GPT-2 small)")
    ap.add_argument("--width", type=int, default=768, help="n_embd in the step-time case (768: GPT-2 small)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--skip-exchange", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks_muon.md"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 15)
    single = None if args.skip_single else step_time(device, args.quick, reps, args.layers, args.width)
    ranks = None if args.skip_exchange else exchange(args.quick)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    text = report(single, ranks, name, "python benchmarks/muon.py " + " ".join(argv or sys.argv[1:]))
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
