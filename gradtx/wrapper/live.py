"""The wrapper's mutable record: what a step writes (the transform's state, the window's flags, GradScaler's record)."""

from __future__ import annotations

from typing import Any

import torch

from gradtx.core.base import OptState


class Live:
    """What a step writes, held apart from the optimizer object.

    torch.compile drops attribute writes to a ``torch.optim.Optimizer``
    instance inside a graph (dynamo treats optimizers specially), but tracks
    writes to a plain object (tests/test_wrapper_compile.py).
    """

    def __init__(self, tx_state: OptState, device: torch.device) -> None:
        self.tx_state = tx_state
        self.device = device  # the params' when the state was made: a load makes it again where they moved
        self.window_open = False
        self.emitted = False
        # GradScaler's scale inside a window, and whether it saw an inf.
        self.amp_scale: torch.Tensor | None = None
        self.amp_inf: torch.Tensor | None = None
        self.synced = True  # False after a backward that skipped the data-parallel sync
        self.stand_ins: dict[torch.Tensor, dict[str, Any]] = {}  # inner states shown before the inner's first step
        self.lrs: list[Any] | None = None  # the lrs at the last step, while a window is open
        self.lr_prev = (False, False)  # whether the lr changed at the last step, and inside a window
