"""Robustness: skip a step whose gradients are not finite."""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch

from gradtx.comm.base import Comm, GroupKey, check_comm
from gradtx.core import leafwise as lw
from gradtx.core import norms
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Guard, OptState, Params, Updates, export_metrics, factory
from gradtx.distributed import global_norm as inferred

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]


@export_metrics(("total_skipped", "skipped"), ("notfinite_count", "notfinite_count"))
class ApplyIfFiniteState(NamedTuple):
    """Skip counters and the inner state.

    Attributes:
      notfinite_count: consecutive non-finite steps so far (int64, 0-d).
      last_finite: whether the last step's updates were finite (bool, 0-d).
      skipped: whether the last step was skipped (bool, 0-d).
      total_skipped: skipped steps over the whole run (int64, 0-d).
      inner_state: the wrapped transform's state.
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    skipped: torch.Tensor
    total_skipped: torch.Tensor
    inner_state: OptState


def select_step(
    inner: GradientTransformation,
    accept: torch.Tensor | bool,
    updates: Updates,
    inner_state: OptState,
    params: Params | None,
    extra: dict[str, Any],
    *,
    name: str,
    rejected: Updates = None,
) -> tuple[Updates, OptState]:
    """Run ``inner``; its result where ``accept``, else ``rejected`` (zeros by default) and the old inner state.

    A 0-d bool tensor ``accept`` is a ``torch.where`` (no host read); a Python bool (with ``rejected``
    given), a Python choice.
    """
    new_updates, new_inner = inner.update(updates, inner_state, params, **extra)
    if new_updates is None:
        raise ValueError(f"{name}: the inner transform held (returned None); put accumulate() before it")
    if not isinstance(accept, torch.Tensor):
        return (new_updates, new_inner) if accept else (rejected, inner_state)
    if rejected is None:  # zeros: a Python 0 keeps each leaf's dtype and allocates nothing
        out = lw.lmap(lambda u: torch.where(accept.to(u.device), u, 0), new_updates)
    else:
        out = lw.where_tree(accept, new_updates, rejected)
    return out, lw.where_tree(accept, new_inner, inner_state)


@factory
def apply_if_finite(
    inner: GradientTransformation,
    max_consecutive_errors: int,
    *,
    comm: Comm | None = None,
    group: GroupKey = "world",
) -> Guard:
    """Run ``inner`` only on finite updates; skip, and count, a step with any NaN or inf.

    A skipped step returns zero updates and leaves the inner state exactly as
    it was (no moment, count or schedule moves). The decision is a tensor
    ``torch.where``, with no host sync. After ``max_consecutive_errors``
    skips in a row, the next non-finite update is applied anyway, as in
    optax, so a run that keeps producing NaNs fails loudly instead of stalling.

    On DTensor grads (FSDP2, TP, HSDP, EP, and mixes) the verdict is agreed,
    with no argument, over every rank of the DTensors' root mesh: one scalar
    MAX reduction per step, so if any rank sees a non-finite value in its
    shard, every rank skips and the shards stay consistent. Given the params,
    a DTensor param whose grad this rank lacks (``None``) counts among them. With a ``comm``,
    the verdict is agreed over ``group`` instead (e.g. rank-local plain
    grads in a functional step; ``group`` must span every rank that holds a
    piece of the model, usually ``"world"``). Plain tensors with no ``comm``
    get the local verdict, which is the global one when they are replicated
    (DDP syncs a NaN to every rank).

    Put :func:`gradtx.accumulate` before this transform, not inside it.

    Args:
      inner: the transform to protect.
      max_consecutive_errors: skips in a row allowed before updates pass through; ``>= 0``.
      comm: a :class:`gradtx.comm.Comm` for global agreement; ``None``: the DTensors' root mesh, else local.
      group: the comm group over which ranks must agree.

    Returns:
      A :class:`GradientTransformation` with state :class:`ApplyIfFiniteState`.

    References:
      Micikevicius et al., "Mixed Precision Training", 2018 (skipping non-finite steps).

    Example:
      >>> tx = chain(accumulate(4), apply_if_finite(chain(clip_by_global_norm(1.0), adamw(3e-4)), 5))
    """
    name = "apply_if_finite"
    max_consecutive_errors = check.integer(max_consecutive_errors, arg="max_consecutive_errors", name=name, minimum=0)
    check.transform(inner, arg="inner", name=name)
    if comm is not None:
        check_comm(comm, name=name)
    slot = inferred.PlanSlot()  # whether the updates cover the params (see planned)

    def init_fn(params: Params) -> ApplyIfFiniteState:
        count = lw.zero_count(params)  # beside the grads, so the per-step verdict never crosses to the host
        # notfinite_count, last_finite, skipped, total_skipped, inner_state
        return ApplyIfFiniteState(count, ~count.bool(), count.bool(), count.clone(), inner.init(params))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, ApplyIfFiniteState, name=name)
        leaves, spec = tu.tensor_leaves(updates, what=f"{name}: updates")
        # The inf-norm is finite exactly when every element is (NaN propagates through max); no host sync.
        local = torch.isfinite(norms.local_norm(leaves, float("inf")))  # no leaves: a norm of 0
        # Agreed over the meshes of the DTensor params too: a rank may lack a grad another holds (zeros: finite).
        full = leaves if comm is not None else inferred.planned(leaves, updates, params, None, name, slot, spec)[0]
        finite = inferred.agree_finite(local, full, comm=comm, group=group).to(state.notfinite_count.device)
        notfinite_count = torch.where(finite, 0, state.notfinite_count + 1)
        accept = finite | (notfinite_count > max_consecutive_errors)

        out, inner_state = select_step(inner, accept, updates, state.inner_state, params, extra, name=name)
        return out, ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=finite,
            skipped=~accept,
            total_skipped=state.total_skipped + (~accept).to(torch.int64),
            inner_state=inner_state,
        )

    return Guard(init_fn, update_fn, operator.attrgetter("skipped"))
