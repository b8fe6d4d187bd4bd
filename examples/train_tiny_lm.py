"""Train a tiny character-level transformer on the Python standard library's own source.

The README's demo. The training step is functional: ``torch.func.functional_call`` and
``torch.func.grad_and_value`` compute the loss and gradients of a params dict, a gradtx
chain turns the gradients into updates, and ``gtx.apply_updates`` returns new params::

    tx = gtx.chain(
        gtx.accumulate(k),             # mean of k micro-batch grads; holds (None) until the k-th
        gtx.clip_by_global_norm(1.0),  # sees the full, averaged gradient
        gtx.adamw(lr, weight_decay=0.1),
    )

On the k-1 non-emitting micro-steps the chain returns ``None`` as updates: nothing after
``accumulate`` runs, Adam's moments do not move, and ``apply_updates(params, None)``
returns the params unchanged. After an emitting step, ``gtx.metrics(state)`` holds the
pre-clip global grad norm.

The text is every top-level ``*.py`` file of the running interpreter's standard library,
read at run time (about 5 MB); nothing is downloaded. Runs in about two minutes on two CPU
cores; ``--quick`` runs a few seconds (used by the tests). Writes a plot of loss and grad
norm to ``out/train_tiny_lm.png``.

Usage::

    python examples/train_tiny_lm.py               # ~2 minutes
    python examples/train_tiny_lm.py --steps 50    # fewer optimizer steps
    python examples/train_tiny_lm.py --quick       # a few seconds
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import random
import sys
import time
from pathlib import Path

# Set before torch loads OpenMP. With the default busy-wait, torch's two intra-op threads spin
# against any other busy process on a 2-core machine and a step gets 10x+ slower; waiting
# passively costs little on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value
from tqdm import tqdm

import gradtx as gtx

REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- data


def load_stdlib_text(max_bytes: int) -> str:
    """Concatenate the standard library's top-level ``*.py`` files, in sorted order."""
    lib_dir = os.path.dirname(os.__file__)
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(lib_dir, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            src = f.read()
        parts.append(src)
        total += len(src)
        if total >= max_bytes:
            break
    if not parts:
        raise RuntimeError(f"no *.py files found under {lib_dir}")
    return "\n".join(parts)[:max_bytes]


class CharVocab:
    """Printable ASCII plus newline; any other character maps to ``?``."""

    def __init__(self) -> None:
        self.chars = ["\n"] + [chr(c) for c in range(32, 127)]
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.unknown = self.index["?"]

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        text = text.replace("\t", "    ")
        return torch.tensor([self.index.get(c, self.unknown) for c in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def get_batch(data: torch.Tensor, batch_size: int, context: int, gen: torch.Generator):
    starts = torch.randint(len(data) - context - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + context] for s in starts.tolist()])
    return x, y


# -------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, context: int, d_model: int, n_layer: int, n_head: int) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------- training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 400; 4 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny run that finishes in a few seconds")
    p.add_argument("--accum", type=int, default=4, help="micro-batches accumulated per optimizer step")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "train_tiny_lm.png", help="where to write the plot")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    if args.quick:
        steps = args.steps or 4
        cfg = {"context": 32, "d_model": 64, "n_layer": 1, "n_head": 4}
        batch_size, max_bytes, eval_batches = 4, 200_000, 2
    else:
        steps = args.steps or 400
        cfg = {"context": 96, "d_model": 128, "n_layer": 3, "n_head": 4}
        batch_size, max_bytes, eval_batches = args.batch_size, 5_000_000, 20
    k = args.accum
    if steps < 1 or k < 1:
        raise SystemExit("--steps and --accum must be >= 1")

    vocab = CharVocab()
    data = vocab.encode(load_stdlib_text(max_bytes))
    n_train = int(0.9 * len(data))
    train_data, val_data = data[:n_train], data[n_train:]

    model = TinyLM(len(vocab), **cfg)
    # The functional step owns the params as a plain dict of tensors; the module only
    # supplies the forward pass through functional_call.
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    n_params = sum(p.numel() for p in params.values())
    print(
        f"text: {len(data) / 1e6:.2f}M chars of stdlib source ({len(train_data) / 1e6:.2f}M train)  "
        f"model: {n_params / 1e3:.0f}k params {cfg}  "
        f"steps: {steps} x {k} micro-batches of {batch_size}x{cfg['context']}"
    )

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    grad_fn = grad_and_value(loss_fn)

    warmup = max(1, steps // 10, min(20, steps // 2))  # short runs get a longer share of warm-up

    def lr_schedule(count: torch.Tensor) -> torch.Tensor:
        """Linear warm-up, then cosine decay to 10%; tensor ops only, so no host sync."""
        count = torch.as_tensor(count, dtype=torch.float32)
        warm = torch.clamp((count + 1) / warmup, max=1.0)
        progress = torch.clamp((count - warmup) / max(1, steps - warmup), 0.0, 1.0)
        return args.lr * warm * (0.1 + 0.45 * (1 + torch.cos(math.pi * progress)))

    tx = gtx.chain(
        gtx.accumulate(k),  # holds (returns None) until the k-th micro-batch
        gtx.clip_by_global_norm(1.0),
        gtx.adamw(lr_schedule, weight_decay=0.1),  # the schedule counts optimizer steps, not micro-steps
    )
    state = tx.init(params)

    @torch.no_grad()
    def eval_loss(split: torch.Tensor) -> float:
        gen = torch.Generator().manual_seed(1234)  # same eval batches every call
        losses = [loss_fn(params, *get_batch(split, batch_size, cfg["context"], gen)) for _ in range(eval_batches)]
        return torch.stack(losses).mean().item()

    gen = torch.Generator().manual_seed(args.seed)
    hist_loss, hist_gnorm = [], []
    window = []
    t_train = time.perf_counter()
    with tqdm(total=steps, desc="train", unit="step", mininterval=0.5, file=sys.stderr) as bar:
        for _micro in range(steps * k):
            x, y = get_batch(train_data, batch_size, cfg["context"], gen)
            grads, loss = grad_fn(params, x, y)
            updates, state = tx.update(grads, state, params)
            params = gtx.apply_updates(params, updates)  # unchanged while accumulate holds (None)
            window.append(loss)
            if updates is None:
                continue
            # An emitting step: the window's mean loss and the pre-clip global grad norm.
            hist_loss.append(torch.stack(window).mean().item())
            hist_gnorm.append(float(gtx.metrics(state)["grad_norm"]))
            window.clear()
            bar.set_postfix(loss=f"{hist_loss[-1]:.3f}", grad_norm=f"{hist_gnorm[-1]:.3f}", refresh=False)
            bar.update(1)
    train_time = time.perf_counter() - t_train
    if len(hist_loss) != steps:
        raise RuntimeError(f"expected {steps} optimizer steps from {steps * k} micro-steps, got {len(hist_loss)}")

    train_loss, val_loss = eval_loss(train_data), eval_loss(val_data)
    print(f"initial train loss {hist_loss[0]:.3f} (uniform guess: {math.log(len(vocab)):.3f})")
    print(f"final   train loss {train_loss:.3f}   val loss {val_loss:.3f}")
    clipped = sum(g > 1.0 for g in hist_gnorm)
    print(f"grad norm clipped to 1.0 on {clipped}/{steps} optimizer steps")

    # A flourish: sample some "Python" from the trained params.
    gen_sample = torch.Generator().manual_seed(args.seed)
    prompt = "def "
    ids = vocab.encode(prompt).tolist()
    with torch.no_grad():
        for _ in range(40 if args.quick else 240):
            ctx = torch.tensor([ids[-cfg["context"] :]])
            logits = functional_call(model, params, (ctx,))[0, -1] / 0.8
            ids.append(int(torch.multinomial(F.softmax(logits, -1), 1, generator=gen_sample)))
    print("sample:\n" + "-" * 40 + "\n" + vocab.decode(ids) + "\n" + "-" * 40)

    if not args.no_plot:
        write_plot(args.out, hist_loss, hist_gnorm, val_loss, k)
        print(f"plot: {args.out}")

    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.1f}s (training {train_time:.1f}s)")
    return {"train_loss": train_loss, "val_loss": val_loss, "initial_loss": hist_loss[0], "wall_time": wall}


def write_plot(path: Path, losses: list[float], gnorms: list[float], val_loss: float, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    path.parent.mkdir(parents=True, exist_ok=True)
    steps = range(1, len(losses) + 1)
    fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, losses, label=f"train (mean of {k} micro-batches)")
    ax_loss.axhline(val_loss, color="tab:orange", linestyle="--", label=f"final val {val_loss:.3f}")
    ax_loss.set_ylabel("cross-entropy (nats/char)")
    ax_loss.legend()
    ax_loss.set_title("tiny char LM on stdlib source\nchain(accumulate, clip_by_global_norm, adamw)")
    ax_norm.plot(steps, gnorms, color="tab:green", label="pre-clip global grad norm")
    ax_norm.axhline(1.0, color="gray", linestyle=":", label="max_norm = 1.0")
    ax_norm.set_yscale("log", base=2)
    ax_norm.yaxis.set_major_locator(LogLocator(base=2))
    ax_norm.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_norm.yaxis.set_minor_formatter(NullFormatter())
    ax_norm.set_xlabel("optimizer step")
    ax_norm.set_ylabel("grad norm")
    ax_norm.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
