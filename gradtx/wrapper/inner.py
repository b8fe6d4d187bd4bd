"""The inner ``torch.optim`` optimizer: stand-ins for its state before its first step, and how it steps.

A ``torch.optim`` optimizer creates its state lazily, at its first step, and
engines that load a checkpoint rebuild it from the keys they find in
``optimizer.state[p]`` (torch's and torchtitan's flattened loads), or skip
their warm-up when that state exists. So the wrapper shows a state for every
param from the start: :func:`materialize` makes it as torch's checkpoint
warm-up does (one step on zero grads with ``lr = 0``) and takes it straight
back out of the inner optimizer, which stays untouched and initialises its
own state at its first real step, exactly as without the wrapper. The
wrapper's ``state`` shows these *stand-ins* until then; a checkpoint saved
before that step marks them, and loading one replaces them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

GTX = "gradtx"  # the transform's entry in each param's state


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's ``step`` requires a closure (LBFGS: it reevaluates the model itself)."""
    try:
        param = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # pragma: no cover - a builtin step
        return False
    return param is not None and param.default is inspect.Parameter.empty


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


def raw_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """The optimizer class's own step, without torch's hook and profiling wrappers."""
    raw: Any = type(optimizer).step
    while hasattr(raw, "__wrapped__"):
        raw = raw.__wrapped__
    return raw(optimizer) if closure is None else raw(optimizer, closure)


def started(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Whether the inner optimizer holds a state of its own for ``p``."""
    return bool(optimizer.state.get(p))


def materialize(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[torch.Tensor, dict[str, Any]]:
    """Stand-ins for the inner state of every param of ``params`` the optimizer has no state for.

    One step of the optimizer's own ``step`` (no hooks) on zero grads, with
    ``lr = 0`` in every group and every other param's grad hidden, so no
    param moves and no existing state changes; the state it makes is then
    taken back out, so the optimizer is as it was. Returns ``{param: state}``.
    """
    missing = [p for p in params if not started(optimizer, p)]
    if not missing:
        return {}
    wanted = {id(p) for p in missing}
    every = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in every]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    made: dict[torch.Tensor, dict[str, Any]] = {}
    try:
        for p in every:
            p.grad = torch.zeros_like(p) if id(p) in wanted else None
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            raw_step(optimizer, (lambda: torch.zeros(())) if needs_closure(optimizer) else None)
    finally:
        for p, grad in zip(every, grads):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p in missing:
            made[p] = optimizer.state.pop(p, None) or {}
    return made
