"""A functional training step: torch.func computes the gradients, a gradtx chain turns them into updates.

The params are a plain dict of tensors. ``torch.func.functional_call`` runs the module with
them, ``torch.func.grad_and_value`` differentiates the loss with respect to them, and

    tx = gtx.chain(
        gtx.accumulate(K),                  # mean of K micro-batch grads; None until the K-th
        gtx.clip_by_global_norm(0.5),       # sees the full averaged gradient (reduce, then clip)
        gtx.partition(                      # AdamW, with no weight decay on biases and norms
            {"decay": gtx.adamw(lr, weight_decay=0.1), "no_decay": gtx.adamw(lr, weight_decay=0.0)},
            labels,
        ),
    )

turns the gradients into updates that ``gtx.apply_updates`` adds to the params. Nothing is
mutated: every step returns new params and a new state.

Run: ``python examples/functional_step.py`` (a few seconds on CPU). The last line is
``initial_loss=... final_loss=...``, the held-out loss before and after training.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value
from toy_task import CLASSES, DIM, HIDDEN, MICRO_BATCH, SEED, STEPS, K, make_data  # examples/toy_task.py

import gradtx as gtx


def main() -> None:
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and robust to a busy machine
    gen = torch.Generator().manual_seed(SEED)

    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))
    # The module only supplies the forward pass; the training state is this dict.
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    grad_fn = grad_and_value(loss_fn)  # (grads, loss); grads is a dict like params

    # Weight decay only on matrices: biases and the LayerNorm's weight and bias are 1-d.
    def labels(tree: dict[str, torch.Tensor]) -> dict[str, str]:
        return {name: "decay" if t.ndim >= 2 else "no_decay" for name, t in tree.items()}

    # A schedule is called with the count of *optimizer* steps (0 first): held micro-steps
    # do not advance it. Warm-up, then cosine decay; tensor ops only, so no host sync.
    def lr(count: torch.Tensor) -> torch.Tensor:
        count = count.to(torch.float32)
        warmup = torch.clamp((count + 1) / 5, max=1.0)
        return 1e-2 * warmup * 0.5 * (1 + torch.cos(math.pi * torch.clamp(count / STEPS, max=1.0)))

    tx = gtx.chain(
        gtx.accumulate(K),
        gtx.clip_by_global_norm(0.5),
        gtx.partition({"decay": gtx.adamw(lr, weight_decay=0.1), "no_decay": gtx.adamw(lr, weight_decay=0.0)}, labels),
    )
    state = tx.init(params)

    def train_step(params, state, x, y):
        """One micro-step. Pure: returns new params and state, the loss, and whether the optimizer stepped."""
        grads, loss = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params)
        # updates is None while accumulate holds: apply_updates then returns params unchanged.
        return gtx.apply_updates(params, updates), state, loss, updates is not None

    x_eval, y_eval = make_data(1024, torch.Generator().manual_seed(999))

    @torch.no_grad()
    def eval_loss(params: dict[str, torch.Tensor]) -> float:
        return float(loss_fn(params, x_eval, y_eval))

    # Accumulation is exact: K micro-batch mean-loss grads, accumulated, equal the full-batch grad.
    x, y = make_data(K * MICRO_BATCH, gen)
    full, _ = grad_fn(params, x, y)
    acc = gtx.accumulate(K)
    acc_state = acc.init(params)
    for xi, yi in zip(x.chunk(K), y.chunk(K)):
        mean, acc_state = acc.update(grad_fn(params, xi, yi)[0], acc_state)
    diff = max(float((mean[n] - full[n]).abs().max()) for n in params)
    print(f"accumulate({K}) vs full-batch gradient: max |diff| = {diff:.1e}")

    initial = eval_loss(params)
    print(f"step   0  eval loss {initial:.4f}")
    window: list[torch.Tensor] = []
    for micro_step in range(STEPS * K):
        params, state, loss, stepped = train_step(params, state, *make_data(MICRO_BATCH, gen))
        window.append(loss)
        if not stepped:
            continue
        step = (micro_step + 1) // K
        if step % 10 == 0:
            m = gtx.metrics(state)  # the pre-clip norm and the coefficient of this step's clip
            print(
                f"step {step:3d}  train loss {float(torch.stack(window).mean()):.4f}  "
                f"grad_norm {float(m['grad_norm']):.3f}  clip_coef {float(m['clip_coef']):.3f}  "
                f"lr {float(lr(torch.tensor(step - 1))):.4f}"
            )
        window.clear()

    final = eval_loss(params)
    print(f"step {STEPS:3d}  eval loss {final:.4f}   ({time.perf_counter() - t0:.1f}s)")
    print(f"initial_loss={initial:.6f} final_loss={final:.6f}")


if __name__ == "__main__":
    main()
