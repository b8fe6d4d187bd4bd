"""DP-SGD with per-example gradients from ``torch.func.vmap(torch.func.grad(...))`` and ``gtx.dpsgd``.

Each example's gradient is clipped to norm ``C``, the clipped gradients are summed, Gaussian
noise of standard deviation ``C * sigma`` is added, and the sum is divided by the batch size
(Abadi et al., 2016), then SGD steps:

    per_example = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)   # every leaf (batch, ...)
    updates, state = tx.update(per_example, state, params)                  # tx = gtx.dpsgd(lr, C, sigma, seed)

The script checks both halves as it trains: the clipped sum equals a Python loop over examples
clipped one by one, and the noise of one step (the update minus its noiseless value) has the
standard deviation ``C * sigma / batch`` that DP-SGD prescribes. Privacy accounting (the epsilon
a run spends) is out of scope.

Run: ``python examples/dp_sgd.py`` (a few seconds on CPU). The last line is
``initial_loss=... final_loss=...``, the held-out loss before and after training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import gradtx as gtx

SEED, BATCH, STEPS, LR = 0, 64, 100, 0.5
CLIP, SIGMA = 1.0, 0.5


def main() -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    teacher = nn.Linear(8, 3)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 8)
        return x, teacher(x).argmax(-1).detach()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    def example_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(p, x[None], y[None])  # vmap hands one example, without its batch dim

    per_example_grads = vmap(grad(example_loss), in_dims=(None, 0, 0))
    x_test, y_test = batch(1024)
    initial = float(loss_fn(params, x_test, y_test))

    tx = gtx.dpsgd(LR, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=SEED, momentum=0.9)
    state = tx.init(params)
    for step in range(STEPS):
        x, y = batch(BATCH)
        per_example = per_example_grads(params, x, y)
        if step == 0:
            check_clipping_and_noise(params, per_example, x, y, example_loss)
        updates, state = tx.update(per_example, state, params)
        params = gtx.apply_updates(params, updates)
    final = float(loss_fn(params, x_test, y_test))
    print(f"initial_loss={initial:.6f} final_loss={final:.6f}")


def check_clipping_and_noise(params, per_example, x, y, example_loss) -> None:
    """The clipped sum against a loop over examples; the noise's spread against C * sigma / batch."""
    summed, clipped = gtx.per_example_global_norm_clip(per_example, CLIP)
    want = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(BATCH):
        g = grad(example_loss)(params, x[i], y[i])
        coef = min(1.0, CLIP / float(gtx.global_norm(g)))
        want = {k: want[k] + coef * g[k] for k in want}
    err = max(float((summed[k] - want[k]).abs().max()) for k in want)
    print(f"clipped {int(clipped)} of {BATCH} examples; clipped sum vs a loop over examples: max |diff| = {err:.1e}")
    assert err < 1e-5, err

    agg = gtx.differentially_private_aggregate(CLIP, SIGMA, seed=1)
    noisy, _ = agg.update(per_example, agg.init(params))
    noise = torch.cat([(noisy[k] - summed[k] / BATCH).flatten() for k in params])
    want_std = CLIP * SIGMA / BATCH
    print(f"noise std {float(noise.std()):.5f}, DP-SGD's C * sigma / batch = {want_std:.5f} ({noise.numel()} draws)")
    assert abs(float(noise.std()) / want_std - 1) < 0.1


if __name__ == "__main__":
    main()
