"""The wrapper's copies: pickle and deepcopy, as for any ``torch.optim`` optimizer.

A copy carries everything but what is rebuilt from the user's transform (the chain around it, its plan,
the fused rule's cache) and what belongs to the moment (GradScaler's flags, an lr scheduler's patched
``step``). An open accumulation window's partial sums are the params' ``.grad``, which pickle leaves out
of a Parameter, so they travel beside it.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import torch

from gradtx.wrapper.state_dict import check_sums_visible

_PICKLED_GRADS = "_pickled_window_grads"
# Rebuilt rather than copied; an lr scheduler patches `step` on the instance with a wrapper bound to the original.
_REBUILT = ("grad_scale", "found_inf", "step", "tx", "_plan", "_fused", "_state_view")


def _copied(opt: Any, what: str) -> dict[str, Any]:
    """What a copy carries: the instance's attributes but the rebuilt ones and the hooks (torch.optim's copies
    leave them out too), and an open window's partial sums."""
    state = {k: v for k, v in opt.__dict__.items() if k not in _REBUILT and not _is_hooks(k)}
    if opt._live.window_open:
        check_sums_visible(opt, what)
        state[_PICKLED_GRADS] = [None if p.grad is None else p.grad.detach() for p in opt._flat]
    return state


def _is_hooks(name: str) -> bool:
    return name.startswith("_optimizer_") and name.endswith("_hooks")


def getstate(opt: Any) -> dict[str, Any]:
    try:
        pickle.dumps(opt._user_tx)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"TransformedOptimizer cannot be pickled: its transform cannot be ({e}). Save opt.state_dict() "
            "with torch.save and rebuild the wrapper with the same chain, or copy.deepcopy(opt) in-process"
        ) from None
    return _copied(opt, "pickle")


def setstate(opt: Any, state: dict[str, Any]) -> None:
    window = state.pop(_PICKLED_GRADS, [])
    torch.optim.Optimizer.__setstate__(opt, state)  # the attributes, and empty hook dicts
    opt._setup_tx()
    for p, g in zip(opt._flat, window):
        if p.grad is None:
            p.grad = g


def deepcopy(opt: Any, memo: dict[int, Any]) -> Any:
    """An in-process copy: shares the user's transform (pure functions), copies everything else."""
    cls: Any = type(opt)
    new = cls.__new__(cls)
    memo[id(opt)] = new
    memo[id(opt._user_tx)] = opt._user_tx
    setstate(new, copy.deepcopy(_copied(opt, "deepcopy"), memo))
    new.tx, new._plan = opt.tx, opt._plan
    return new
