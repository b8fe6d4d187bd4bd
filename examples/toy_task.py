"""The toy task the small examples train on: labels from a fixed random 'teacher' network.

Shared by ``functional_step.py`` and ``wrap_torch_optimizer.py``; generated, so nothing is downloaded.
"""

from __future__ import annotations

import torch

SEED = 0
K = 4  # micro-batches per optimizer step
MICRO_BATCH = 64
STEPS = 60  # optimizer steps
DIM, HIDDEN, CLASSES = 16, 64, 4

_TEACHER = torch.Generator().manual_seed(1234)
W1 = torch.randn(DIM, HIDDEN, generator=_TEACHER) / DIM**0.5
W2 = torch.randn(HIDDEN, CLASSES, generator=_TEACHER)


def make_data(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels from a fixed random 'teacher' network: a learnable, non-linear task."""
    x = torch.randn(n, DIM, generator=gen)
    return x, (torch.tanh(x @ W1) @ W2).argmax(dim=1)
