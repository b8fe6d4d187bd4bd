"""Lookahead around AdamW, with an EMA copy of the params for evaluation, in a functional step.

The names and numbers are optax's: ``gtx.lookahead(gtx.adamw(...), sync_period, slow_step_size)``
trains a ``gtx.LookaheadParams(fast, slow)`` pair (the grads are the fast params'; the slow ones
are what to evaluate), and ``gtx.incremental_update`` keeps a Polyak average of the slow params.
A ``gtx.snapshot`` at the head of the chain records the raw gradient norm, read back with
``gtx.metrics(state)``.

Run: ``python examples/lookahead_and_ema.py`` (a second or two on CPU). The last line is
``initial_loss=... final_loss=...``, the held-out loss of the EMA params before and after training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

import gradtx as gtx

STEPS, BATCH, DIM = 150, 32, 8


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
    teacher = torch.randn(DIM, 1)
    x_test = torch.randn(256, DIM)
    y_test = torch.tanh(x_test @ teacher)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(functional_call(model, params, (x,)), y)

    tx = gtx.chain(
        gtx.snapshot("grad_norm", gtx.global_norm),
        gtx.lookahead(gtx.adamw(3e-2, weight_decay=1e-4), sync_period=5, slow_step_size=0.5),
    )
    pair = gtx.LookaheadParams.init_synced({n: p.detach() for n, p in model.named_parameters()})
    state = tx.init(pair)
    ema_params = {k: v.clone() for k, v in pair.slow.items()}
    initial = float(loss_fn(ema_params, x_test, y_test))

    for step in range(STEPS):
        x = torch.randn(BATCH, DIM)
        grads = grad(loss_fn)(pair.fast, x, torch.tanh(x @ teacher))
        updates, state = tx.update(grads, state, pair)
        pair = gtx.apply_updates(pair, updates)
        ema_params = gtx.incremental_update(pair.slow, ema_params, step_size=0.1)
        if step % 50 == 0:
            print(f"step {step:3d}  grad_norm {float(gtx.metrics(state)['grad_norm']):.4f}")

    final = float(loss_fn(ema_params, x_test, y_test))
    print(f"slow params' loss {float(loss_fn(pair.slow, x_test, y_test)):.6f}")
    print(f"initial_loss={initial:.6f} final_loss={final:.6f}")


if __name__ == "__main__":
    main()
