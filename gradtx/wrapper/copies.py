"""Copies of a :class:`gradtx.TransformedOptimizer`: pickle and deepcopy, as for any ``torch.optim`` optimizer.

A copy carries everything but what is rebuilt from the user's transform (the
chain around it, its plan, the fused rule's cache) and what belongs to the
moment (GradScaler's flags, an lr scheduler's patched ``step``). An open
accumulation window's partial sums are the params' ``.grad``, which pickle
leaves out of a Parameter, so they travel beside it.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import torch

from gradtx.wrapper import state_dict as _sd

_PICKLED_GRADS = "_pickled_window_grads"
# Rebuilt rather than copied; an lr scheduler patches `step` on the instance with a wrapper bound to the original.
_REBUILT = ("grad_scale", "found_inf", "step", "tx", "_plan", "_fused", "_state_view")


def _window_grads(opt: Any, what: str) -> list[torch.Tensor | None] | None:
    if not opt._live.window_open:
        return None
    _sd.check_sums_visible(opt, what)
    return [None if p.grad is None else p.grad.detach() for p in opt._flat]


def _put_grads(params: list[torch.Tensor], window: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, window):
        if p.grad is None:
            p.grad = g


def getstate(opt: Any) -> dict[str, Any]:
    try:
        pickle.dumps(opt._user_tx)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"TransformedOptimizer cannot be pickled: its transform cannot be ({e}). Save opt.state_dict() "
            "with torch.save and rebuild the wrapper with the same chain, or copy.deepcopy(opt) in-process"
        ) from None
    state = {k: v for k, v in opt.__dict__.items() if k not in _REBUILT}
    window = _window_grads(opt, "pickle")
    if window is not None:
        state[_PICKLED_GRADS] = window
    return state


def setstate(opt: Any, state: dict[str, Any]) -> None:
    window = state.pop(_PICKLED_GRADS, None)
    opt.__dict__.update(state)
    opt._setup_tx()
    if window is not None:
        _put_grads(opt._flat, window)


def deepcopy(opt: Any, memo: dict[int, Any]) -> Any:
    """An in-process copy: shares the transform and its plan (pure functions), copies everything else."""
    new = type(opt).__new__(type(opt))
    memo[id(opt)] = new
    memo[id(opt._user_tx)] = opt._user_tx
    new.__dict__.update(copy.deepcopy({k: v for k, v in opt.__dict__.items() if k not in _REBUILT}, memo))
    new.tx, new._plan = opt.tx, opt._plan
    new._attach()
    window = _window_grads(opt, "deepcopy")
    if window is not None:
        _put_grads(new._flat, copy.deepcopy(window, memo))
    return new
