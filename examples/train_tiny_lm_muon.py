"""Train the tiny character LM with Muon for its matrices and AdamW for the rest, beside AdamW alone.

The model, data and batches are those of ``examples/train_tiny_lm.py``. Two runs see the same
batches in the same order, each a functional step (``grad_and_value``, ``tx.update``,
``gtx.apply_updates``)::

    adamw = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(lr, weight_decay=0.1))
    muon = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.muon(
        0.02, weight_decay=0.1, adam_learning_rate=lr, adam_weight_decay=0.1,
        muon_weight_dimension_numbers=dims))   # blocks' matrices; QKV as three matrices

The dimension numbers give Muon the transformer blocks' weight matrices (the fused QKV weight
split into Q, K and V with ``output_split=3``) and send the embeddings, the LM head, biases and
norms to AdamW. Writes the two loss curves to ``out/train_tiny_lm_muon.png``.

Usage::

    python examples/train_tiny_lm_muon.py              # ~2 minutes on two CPU cores
    python examples/train_tiny_lm_muon.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

import gradtx as gtx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_lm import CharVocab, TinyLM, get_batch, load_stdlib_text

REPO_ROOT = Path(__file__).resolve().parent.parent


def muon_dims(params: dict[str, torch.Tensor]) -> dict[str, gtx.MuonDimensionNumbers | None]:
    """Muon for the blocks' weight matrices, Q, K and V apart; None (AdamW) for everything else."""
    dims: dict[str, gtx.MuonDimensionNumbers | None] = {}
    for name, p in params.items():
        if not (name.startswith("blocks.") and p.ndim == 2):
            dims[name] = None
        elif name.endswith("qkv.weight"):
            dims[name] = gtx.MuonDimensionNumbers(output_split=3)
        else:
            dims[name] = gtx.MuonDimensionNumbers()
    return dims


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; 4 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny run that finishes in a few seconds")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (both runs)")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "train_tiny_lm_muon.png")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.quick:
        steps = args.steps or 4
        cfg = {"context": 32, "d_model": 64, "n_layer": 1, "n_head": 4}
        batch_size, max_bytes = 4, 200_000
    else:
        steps = args.steps or 300
        cfg = {"context": 96, "d_model": 128, "n_layer": 3, "n_head": 4}
        batch_size, max_bytes = 32, 5_000_000
    vocab = CharVocab()
    data = vocab.encode(load_stdlib_text(max_bytes))
    model = TinyLM(len(vocab), **cfg)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (x,)).flatten(0, 1), y.flatten())

    grad_fn = grad_and_value(loss_fn)
    runs = {
        "adamw": gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(args.lr, weight_decay=0.1)),
        "muon + adamw": gtx.chain(
            gtx.clip_by_global_norm(1.0),
            gtx.muon(
                args.muon_lr, weight_decay=0.1, adam_learning_rate=args.lr, adam_weight_decay=0.1,
                muon_weight_dimension_numbers=muon_dims(start),
            ),
        ),
    }  # fmt: skip
    curves: dict[str, list[float]] = {}
    for label, tx in runs.items():
        params, state = dict(start), tx.init(start)
        gen = torch.Generator().manual_seed(args.seed)  # the same batches for both runs
        losses = []
        for _ in range(steps):
            x, y = get_batch(data, batch_size, cfg["context"], gen)
            grads, loss = grad_fn(params, x, y)
            updates, state = tx.update(grads, state, params)
            params = gtx.apply_updates(params, updates)
            losses.append(float(loss))
        curves[label] = losses
        tail = losses[-max(1, steps // 10) :]
        print(f"{label:14s} first loss {losses[0]:.3f}  mean of the last {len(tail)} steps {sum(tail) / len(tail):.3f}")
    if not args.no_plot:
        write_plot(args.out, curves)
        print(f"plot: {args.out}")
    print(f"wall time {time.perf_counter() - t0:.1f}s")
    muon_curve = curves["muon + adamw"]
    print(f"initial_loss={muon_curve[0]:.6f} final_loss={muon_curve[-1]:.6f}")
    return curves


def write_plot(path: Path, curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (batch)")
    ax.set_title("tiny char LM: Muon for the matrices vs AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
