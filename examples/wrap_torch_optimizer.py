"""Put a gradtx chain in front of a stock torch.optim optimizer, then save and resume mid-window.

    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True),
        gtx.chain(gtx.accumulate(K), gtx.clip_by_global_norm(1.0)),
    )

The loop is the ordinary ``loss.backward(); opt.step(); opt.zero_grad()``, once per
micro-batch, with no ``loss / K``: autograd sums the micro-batch grads into ``p.grad``
(``zero_grad`` is a no-op while a window is open), and the inner AdamW steps (``opt.emitted``)
only on the K-th micro-step, after dividing by K and clipping. With a fused AdamW, the ``1/K`` and
the clip coefficient ride in the kernel's ``grad_scale``: no extra pass over the grads.
A ``torch.optim.lr_scheduler`` drives the wrapper as it would the inner optimizer.

Then the run is checkpointed in the middle of an accumulation window, resumed into a
freshly built model, optimizer and scheduler, and compared with an uninterrupted run.

Run: ``python examples/wrap_torch_optimizer.py`` (a few seconds on CPU). The last line is
``initial_loss=... final_loss=...``, the held-out loss before and after training.
"""

from __future__ import annotations

import io
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from toy_task import CLASSES, DIM, HIDDEN, MICRO_BATCH, SEED, STEPS, K, make_data  # examples/toy_task.py

import gradtx as gtx


def build(seed: int):
    """A model, the wrapped fused AdamW, and a warm-up + cosine scheduler on the wrapper."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True),
        gtx.chain(gtx.accumulate(K), gtx.clip_by_global_norm(1.0)),
    )

    def warmup_cosine(step: int) -> float:  # counts optimizer steps: sched.step() runs only when opt stepped
        return min(1.0, (step + 1) / 5) * 0.5 * (1 + math.cos(math.pi * min(step / STEPS, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    return model, opt, sched


def train(model, opt, sched, micro_batches, *, log: bool = False) -> None:
    """The ordinary torch loop, once per micro-batch; gradtx decides when the inner optimizer steps."""
    window = []
    for x, y in micro_batches:
        loss = F.cross_entropy(model(x), y)  # a mean over the micro-batch; no division by K
        loss.backward()
        window.append(loss.detach())
        opt.step()
        if opt.emitted:  # True on the K-th micro-step: the inner AdamW stepped
            sched.step()
            if log and sched.last_epoch % 10 == 0:
                m = opt.metrics  # tensors; nothing was read to the host until here
                print(
                    f"step {sched.last_epoch:3d}  train loss {float(torch.stack(window).mean()):.4f}  "
                    f"grad_norm {float(m['grad_norm']):.3f}  clip_coef {float(m['clip_coef']):.3f}  "
                    f"lr {sched.get_last_lr()[0]:.5f}"
                )
            window.clear()
        opt.zero_grad()  # a no-op while the window is open: .grad is the accumulator


def main() -> None:
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and robust to a busy machine
    gen = torch.Generator().manual_seed(SEED)
    micro_batches = [make_data(MICRO_BATCH, gen) for _ in range(STEPS * K)]
    x_eval, y_eval = make_data(1024, torch.Generator().manual_seed(999))

    @torch.no_grad()
    def eval_loss(model: nn.Module) -> float:
        return float(F.cross_entropy(model(x_eval), y_eval))

    # 1. An uninterrupted run, with logging.
    uninterrupted, opt, sched = build(SEED)
    initial = eval_loss(uninterrupted)
    print(f"step   0  eval loss {initial:.4f}")
    train(uninterrupted, opt, sched, micro_batches, log=True)
    final = eval_loss(uninterrupted)
    print(f"step {STEPS:3d}  eval loss {final:.4f}")

    # 2. The same run, stopped in the middle of an accumulation window (2 of K micro-batches in),
    #    checkpointed, and resumed into a fresh model, optimizer and scheduler.
    stop = 25 * K + 2
    model, opt, sched = build(SEED)
    train(model, opt, sched, micro_batches[:stop])
    assert opt.window_open
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    print(f"checkpoint at micro-step {stop} (window open, {stop % K} of {K}): {buf.tell() / 1024:.0f} KiB")
    del model, opt, sched

    buf.seek(0)
    ckpt = torch.load(buf)  # weights_only: the wrapper's state dict is tensors, lists and dicts
    model, opt, sched = build(seed=123)  # a different init: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])  # inner AdamW state, gradtx state, and the window's partial grads
    sched.load_state_dict(ckpt["sched"])
    train(model, opt, sched, micro_batches[stop:])
    diff = max(
        float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), uninterrupted.state_dict().values())
    )
    print(f"resumed run vs uninterrupted run: max |param diff| = {diff:.1e}, eval loss {eval_loss(model):.4f}")
    if diff != 0.0:
        raise SystemExit("resuming mid-window changed the result")
    print(f"({time.perf_counter() - t0:.1f}s)")
    print(f"initial_loss={initial:.6f} final_loss={final:.6f}")


if __name__ == "__main__":
    main()
