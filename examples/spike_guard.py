"""A bad batch in the middle of training, with and without a spike guard.

Trains the tiny character LM of ``train_tiny_lm.py`` (same data, model and
functional step) three times on the same batches. At one step the gradient is
multiplied by ``--spike`` (default 1000), as a corrupted batch or a broken
loss scale would do. The three runs differ only in the chain:

* ``adamw`` alone: the spike lands in Adam's second moment, whose slow decay
  (``b2=0.999``) then shrinks every step for hundreds of steps: the loss stalls;
* ``zclip`` before ``adamw``: the spike is clipped to near the running mean norm;
* ``skip_spikes(adamw)``: the step is skipped, and nothing (moments, counts,
  schedule) moves.

Writes a plot of the loss and the pre-guard global grad norm of each run to
``out/spike_guard.png`` (the figure in ``docs/spikes.md``). Runs in well under a
minute on two CPU cores; ``--quick`` in a few seconds (used by the tests).

Usage::

    python examples/spike_guard.py
    python examples/spike_guard.py --quick --out /tmp/spike.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_tiny_lm.py

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_lm import CharVocab, TinyLM, get_batch, load_stdlib_text

import gradtx as gtx

REPO_ROOT = Path(__file__).resolve().parent.parent


def guards(lr: float, warmup: int) -> dict[str, gtx.GradientTransformation]:
    """The three chains compared; each also measures the grad norm it receives (track_norms' total)."""
    return {
        "adamw (no guard)": gtx.adamw(lr),
        "zclip + adamw": gtx.chain(gtx.zclip(warmup_steps=warmup, max_grad_norm=None), gtx.adamw(lr)),
        "skip_spikes(adamw)": gtx.skip_spikes(gtx.adamw(lr), z_thresh=6.0, warmup_steps=warmup),
    }


def train(tx, *, model, params, batches, spike_at: int, spike: float) -> tuple[list[float], list[float]]:
    def loss_fn(p, x, y):
        logits = functional_call(model, p, (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    grad_fn = grad_and_value(loss_fn)
    state = tx.init(params)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches):
        grads, loss = grad_fn(params, x, y)
        if step == spike_at:
            grads = {k: g * spike for k, g in grads.items()}
        norms.append(float(gtx.global_norm(grads)))
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, norms


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 240; 40 with --quick)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--spike", type=float, default=1000.0, help="factor applied to the bad step's gradient")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "spike_guard.png")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    steps = args.steps or (40 if args.quick else 240)
    cfg = {"context": 32, "d_model": 64, "n_layer": 1, "n_head": 4}
    spike_at = steps // 2
    warmup = max(5, steps // 10)
    vocab = CharVocab()
    data = vocab.encode(load_stdlib_text(400_000))
    gen = torch.Generator().manual_seed(0)
    batches = [get_batch(data, 8, cfg["context"], gen) for _ in range(steps)]  # the same batches for every run
    model = TinyLM(len(vocab), **cfg)
    init_params = {n: t.detach().clone() for n, t in model.named_parameters()}

    results = {}
    for name, tx in guards(args.lr, warmup).items():
        results[name] = train(
            tx, model=model, params=dict(init_params), batches=batches, spike_at=spike_at, spike=args.spike
        )
    tail = max(1, steps // 8)
    summary = {}
    for name, (losses, _) in results.items():
        summary[name] = sum(losses[-tail:]) / tail
        print(f"{name:20s} mean loss over the last {tail} steps: {summary[name]:.3f}")
    if not args.no_plot:
        write_plot(args.out, results, spike_at, args.spike)
        print(f"plot: {args.out}")
    print(f"wall time {time.perf_counter() - t0:.1f}s")
    return summary


def write_plot(path: Path, results: dict[str, tuple[list[float], list[float]]], spike_at: int, spike: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, (losses, norms) in results.items():
        ax_loss.plot(losses, label=name, linewidth=1.2)
        ax_norm.plot(norms, label=name, linewidth=1.0)
    for ax in (ax_loss, ax_norm):
        ax.axvline(spike_at, color="gray", linestyle=":", linewidth=1)
    ax_loss.set_ylabel("train loss (nats/char)")
    ax_loss.set_title(f"tiny char LM, one bad step (grad x{spike:g}) at step {spike_at}")
    ax_loss.legend()
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("global grad norm (before the guard)")
    ax_norm.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
