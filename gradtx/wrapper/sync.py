"""Data-parallel gradient sync around an accumulation window: skip it, or make it a sum.

:func:`no_sync` finds every DDP and FSDP2 module in a model and skips the
gradient sync of one backward; :func:`sum_grad_reduction` makes those modules
sum their grads across ranks instead of averaging them (token-weighted
accumulation divides by the global token total itself).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

from gradtx.core import validate as check

try:  # a CPU-only or old build may lack torch.distributed
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
except ImportError:  # pragma: no cover
    FSDPModule = DistributedDataParallel = None  # type: ignore[assignment,misc]

__all__ = ["data_parallel_modules", "no_sync", "sum_grad_reduction"]

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def data_parallel_modules(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """Every FSDP2-like module and every DDP-like module anywhere in ``model``, itself included.

    FSDP2's ``FSDPModule`` and DDP, and any module with their sync switch
    (``set_requires_gradient_sync``, or ``no_sync()``), e.g. a wrapper's own data-parallel module.
    """
    fsdp: list[Any] = []
    ddp: list[Any] = []
    for m in model.modules():  # FSDPModule and DDP have these methods too
        if callable(getattr(m, "set_requires_gradient_sync", None)):
            fsdp.append(m)
        elif callable(getattr(m, "no_sync", None)):
            ddp.append(m)
    return fsdp, ddp


def _set_sync(module: Any, sync: bool) -> None:  # FSDP2's and DDP's methods are not on nn.Module's type
    if FSDPModule is not None and isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync, recurse=False)  # each module's own flag: all are visited
    else:
        module.set_requires_gradient_sync(sync)


@contextlib.contextmanager
def no_sync(model: torch.nn.Module, *, sync: bool) -> Iterator[None]:
    """Skip the data-parallel gradient sync of one backward unless ``sync`` is True.

    Finds every FSDP2 module (``set_requires_gradient_sync``) and every DDP
    module (``no_sync``) wherever it sits in ``model``: the model itself, or
    FSDP2 blocks inside a plain root module, or a DDP inside a wrapper. A
    model with neither runs unchanged. Use ``sync=True`` on the last
    micro-step of an accumulation window, so the sync happens once per
    optimizer step. Wrap the forward too: DDP reads the flag in its forward.
    With a :class:`TransformedOptimizer`, :meth:`TransformedOptimizer.maybe_no_sync`
    works out ``sync`` for you.

    Args:
      model: the model, holding DDP or FSDP2 modules anywhere.
      sync: whether this backward syncs the grads across ranks.

    Example:
      >>> with no_sync(model, sync=(micro_step == k - 1)):
      ...     loss.backward()
    """
    if check.flag(sync, arg="sync", name="no_sync"):  # None or "no" would silently skip the sync
        yield
        return
    fsdp, ddp = data_parallel_modules(model)
    with contextlib.ExitStack() as stack:
        for module in fsdp:
            _set_sync(module, False)
            stack.callback(_set_sync, module, True)
        for module in ddp:
            stack.enter_context(module.no_sync())
        yield


def sum_grad_reduction(model: ModuleT) -> ModuleT:
    """Make the DDP and FSDP2 modules in a model *sum* their grads across data-parallel ranks instead of averaging them.

    Token-weighted accumulation needs the raw sum ``sum over ranks of grad``:
    gradtx divides it by the global token total (see :func:`gradtx.accumulate`).
    The wrappers average by default, which would divide a second time, by the
    world size, and weight every rank equally however many tokens it saw.

    * FSDP2: every ``fully_shard``-ed module, wherever it sits in ``model``,
      gets ``set_gradient_divide_factor(1.0)`` and
      ``set_force_sum_reduction_for_comms(True)``, so the reduce-scatter (and
      HSDP's all-reduce) is a plain SUM with no pre- or post-scaling (gloo has
      no ``PREMUL_SUM``, and NCCL's zero-copy paths need plain SUM). FSDP2
      adds each sync's reduce-scattered grad to the sharded one, so any sync
      pattern is counted once.
    * DDP (``model`` itself or any DDP module inside it): a summing comm hook,
      :func:`gradtx.comm.torch_dist.ddp_sum_hook`, made correct whatever the
      sync pattern. DDP all-reduces the whole accumulated ``.grad``, so a
      plain sum hook would count every earlier synced micro-step once per rank
      (``sum_r(S + g_r) = W·S + sum_r g_r``), where DDP's mean is harmless
      (``mean_r(S + g_r) = S + mean_r g_r``). The hook therefore remembers which
      grads hold a synced (replicated) sum, and a grad hook on each param
      divides such a ``.grad`` by ``W`` before the next backward adds to it, so
      the next sum restores it: syncing on every micro-step, on the last one
      only (:meth:`TransformedOptimizer.maybe_no_sync`), or any mix, gives
      ``sum over ranks and micro-steps``, also after resuming a window saved
      mid-way (its restored ``.grad`` is a synced sum). DDP takes one comm
      hook; call this once, before the first backward, on a DDP without one.
    * Pipelining (``torch.distributed.pipelining``) is configured elsewhere:
      build the schedule with ``scale_grads=False``.

    Args:
      model: a module holding DDP or FSDP2 (``fully_shard``) modules anywhere, itself included.

    Returns:
      ``model``, configured in place.

    Raises:
      TypeError: ``model`` holds neither (a one-process model sums nothing).

    References:
      xorl, "Gradient Accumulation & Token Normalization" (FSDP2 ``set_gradient_divide_factor(1.0)``).

    Example:
      >>> model = gtx.sum_grad_reduction(fully_shard(model))
      >>> opt = gtx.TransformedOptimizer(
      ...     torch.optim.AdamW(model.parameters(), lr=3e-4), gtx.accumulate(4, token_weighted=True, comm=comm)
      ... )
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sum_grad_reduction: model must be a torch.nn.Module, got {type(model).__name__}")
    fsdp: list[Any] = [m for m in model.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]
    ddp: list[Any] = [
        m for m in model.modules() if DistributedDataParallel is not None and isinstance(m, DistributedDataParallel)
    ]
    if not fsdp and not ddp:
        raise TypeError(
            f"sum_grad_reduction: model must be DistributedDataParallel or contain fully_shard (FSDP2) or DDP modules, "
            f"got {type(model).__name__} with neither; a one-process model needs no call"
        )
    from gradtx.comm.torch_dist import DDPSumState, ddp_sum_hook  # the comm layer communicates

    # Both setters act on one module's own state, not recursively, so each is visited.
    for module in fsdp:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    for module in ddp:
        state = DDPSumState(module.process_group)
        module.register_comm_hook(state, ddp_sum_hook)
        for param in module.module.parameters():
            if param.requires_grad:
                # A leaf's tensor hook runs before autograd adds the new grad into .grad: the moment to
                # turn a synced sum back into its 1/W share.
                param.register_hook(functools.partial(_rescale, state, param))
    return model


def _rescale(state: Any, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A param's grad hook: the DDP sum state turns a synced ``.grad`` back into this rank's share."""
    state.rescale(param)
    return grad
