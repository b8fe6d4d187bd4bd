"""What the wrapper reads about its chain's members, in one place.

The wrapper needs to know whether the chain holds an accumulation window,
where that window stands, and which part of the state survives a skipped
step. It learns this from the step plan and from what the members and their
states declare through :mod:`gradtx.core.kinds`; these few functions are the only
places it does.
"""

from __future__ import annotations

from typing import Any

import torch

from gradtx.core import kinds
from gradtx.core import tree as tu
from gradtx.core.base import OptState
from gradtx.runtime.executor import StepPlan


def accumulates(plan: StepPlan) -> bool:
    """Whether the chain holds an accumulation window (it leads the chain)."""
    return plan.window is not None


def window_open(plan: StepPlan, state: OptState) -> bool:
    """Whether the window has counted micro-steps it has not emitted yet."""
    return plan.window is not None and plan.window_open(state)


def window_position(plan: StepPlan, state: OptState) -> tuple[int, int]:
    """(micro-steps counted, k) of the open window, for messages."""
    ws, window = plan.window_state(state), plan.window
    fields = kinds.window_fields(ws)
    assert fields is not None and window is not None
    return int(getattr(ws, fields["micro_step"])), int(window.k)


def acc_key(plan: StepPlan, layout: Any) -> str | None:
    """The checkpoint key of the leading window's partial sums (autograd's ``.grad``), or ``None``.

    ``layout`` is :func:`gradtx.checkpoint.functional`'s walk of the state; the window's
    running sum is the field its state declares (:func:`gradtx.core.kinds.window_state`).
    """
    if plan.window is None or not layout.windows:
        return None
    return layout.windows[0].key("running_sum")  # the leading window's, the first in the walk


def keep_on_skip(skip: torch.Tensor, old: Any, new: Any) -> Any:
    """``new``, except where ``skip``: then ``old``; the accumulation window closes either way (no host sync)."""
    if kinds.window_fields(new) is not None:  # a declared window state
        return new
    if isinstance(new, torch.Tensor):
        local_new = tu.local(new)
        return tu.like(new, torch.where(skip.to(local_new.device), tu.local(old), local_new))
    if isinstance(new, tuple) and hasattr(type(new), "_fields"):
        return type(new)(*(keep_on_skip(skip, o, n) for o, n in zip(old, new)))
    if isinstance(new, (tuple, list)):
        return type(new)(keep_on_skip(skip, o, n) for o, n in zip(old, new))
    if isinstance(new, dict):
        return {k: keep_on_skip(skip, old[k], v) for k, v in new.items()}
    return new
