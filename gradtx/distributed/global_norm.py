"""The global norm: local sums of p-th powers, reduced over a plan's groups with the reductions overlapped.

Every transform that reads a norm (the clip, AGC, the spike guards) comes
here, through :func:`gradtx.distributed.inferred.tree_norm`: a declared ``mesh_groups`` plan,
else the plan the DTensor placements define, else the local norm. Every
statistic those transforms keep, and every skip or clip decision they make,
derives from it, so it is the single-device norm of the whole model on every rank.

The order of a step (:func:`plan_norm`): the local contributions of the
buckets that some group must reduce are computed first and their
reductions started, all of them, group by group in the plan's order; the
local work of the replicated buckets runs while they are in flight; the step
waits once, at the end (once per level where a grad is sharded over several
mesh dims, see :mod:`gradtx.comm.groups`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradtx.comm.backward_norm import BackwardNorm
from gradtx.comm.base import ReduceOp, start_all_reduce
from gradtx.comm.groups import levels
from gradtx.core import norms
from gradtx.core import tree as tu
from gradtx.distributed import inferred
from gradtx.distributed.plan import check_plan

__all__ = ["check_plan", "global_norm_of", "leaf_norms_of", "plan_norm", "rounds"]


def global_norm_of(
    leaves: Sequence[torch.Tensor],
    norm_type: float = 2.0,
    *,
    mesh_groups: Any = None,
    what: str,
    tree: Any = None,
    scale: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The global ``norm_type``-norm of ``leaves`` (0-d, no host sync), the same on every rank.

    With ``scale`` (a factor the leaves still carry, see :class:`gradtx.ScalarTransformation`),
    the norm of the true updates ``leaves * scale``; with ``device``, as fp32 there.
    """
    norm = inferred.tree_norm(leaves, norm_type, mesh_groups, what=what, tree=tree)
    if device is not None:
        norm = norm.to(device=device, dtype=torch.float32)
    if scale is not None:
        norm = norm * scale.abs().to(device=norm.device, dtype=norm.dtype)
    return norm


def leaf_norms_of(
    leaves: Sequence[torch.Tensor], *, mesh_groups: Any = None, what: str, tree: Any = None
) -> list[torch.Tensor]:
    """The fp32 L2 norm of each whole leaf (0-d each), of the unsharded tensor, the same on every rank."""
    plan = mesh_groups if mesh_groups is not None else inferred.infer_plan(leaves, what=what, tree=tree)
    if plan is None:
        return norms.tensor_norms(leaves, 2.0)
    (out,) = plan.unitwise_norms([list(leaves)], unitwise=False)
    return [n.reshape(()) for n in out]


def plan_norm(
    plan: Any,
    leaves: Sequence[torch.Tensor],
    norm_type: float,
    *,
    powsums: Sequence[torch.Tensor] | None = None,
    backward: BackwardNorm | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model under ``plan`` (a :class:`gradtx.MeshGroups`), checks done.

    One contribution (a sum of p-th powers, or a max for ``inf``) per bucket
    of leaves that share the same groups. The groups are reduced in rounds
    (:func:`rounds`), innermost first: a round's collectives are all started,
    then the local pass of the buckets that round does not need runs while
    they are in flight, then one wait. Buckets left with the same groups are
    added before the next round, so every group still costs one collective of
    one value per bucket set. The reduction over ``pp_group`` comes last: it
    needs the stage's total. With ``powsums`` (each leaf's local contribution, measured in the
    backward) the local pass is skipped and only the reductions run; under a flat plan, ``backward``
    (the :class:`gradtx.BackwardNorm` that measured them) may have started the one reduction too.
    """
    inf = math.isinf(norm_type)
    op = ReduceOp.MAX if inf else ReduceOp.SUM
    device = tu.local(leaves[0]).device if leaves else plan.device
    buckets = plan._buckets
    if plan.flat is not None:
        return _flat_norm(plan, leaves, norm_type, device, powsums, backward)
    schedule = rounds([b.groups for b in buckets], plan.group_order)
    # (value, groups still to reduce over); a bucket's local pass runs just before its first round.
    values: list[tuple[torch.Tensor, frozenset]] = []
    todo = list(buckets)
    for r, groups in enumerate(schedule):
        now = [b for b in todo if any(g in b.groups for g in groups)]
        todo = [b for b in todo if b not in now]
        values += [(s, frozenset(b.groups)) for b, s in zip(now, _bucket_sums(now, leaves, norm_type, device, powsums))]
        values = _merge(values, norm_type, device)
        started = []
        for g in groups:
            idx = [i for i, (_, gs) in enumerate(values) if g in gs]
            started.append((g, idx, start_all_reduce(plan.comm, [values[i][0] for i in idx], op, g)))
        if r + 1 < len(schedule):  # overlap: the next round's buckets, else the replicated ones
            nxt = [b for b in todo if any(g in b.groups for g in schedule[r + 1])]
        else:
            nxt = [b for b in todo if not b.groups]
        todo = [b for b in todo if b not in nxt]
        ahead = list(zip(nxt, _bucket_sums(nxt, leaves, norm_type, device, powsums)))
        for g, idx, pending in started:
            for i, reduced in zip(idx, pending.wait()):
                values[i] = (reduced, values[i][1] - {g})
        values += [(s, frozenset(b.groups)) for b, s in ahead]
    values += [(s, frozenset()) for s in _bucket_sums(todo, leaves, norm_type, device, powsums)]
    total = norms.total([v for v, _ in values], norm_type, device).to(norms.partial_dtype(device))
    if plan.pp_group is not None:  # a rank with no grads (an empty stage) still joins it, with 0
        (total,) = plan.comm.all_reduce([total], op, plan.pp_group)
    return norms.power_to_norm(total, norm_type).to(norms.norm_dtype(leaves))


def _flat_norm(
    plan: Any,
    leaves: Sequence[torch.Tensor],
    norm_type: float,
    device: torch.device,
    powsums: Sequence[torch.Tensor] | None,
    backward: BackwardNorm | None = None,
) -> torch.Tensor:
    """:func:`plan_norm` in one collective: every sharded bucket's part over its replica count, summed over the mesh.

    A bucket sharded over some of the mesh's dims is held alike by the ranks
    that differ only in the other dims; divided by their number, its part
    counts once in a sum over the whole mesh (a max needs no division). The
    one reduction is started first, and the local pass of the leaves that
    every rank holds whole runs while it is in flight.

    With ``backward``, whose hooks measured ``powsums``, the sum is what its
    last hook reduced, started in the backward (see
    :meth:`gradtx.BackwardNorm.take_flat`, which also arms the next backward): only the wait is left here.
    """
    inf = math.isinf(norm_type)
    group, replicas = plan.flat
    sharded = [(b, r) for b, r in zip(plan._buckets, replicas) if b.groups]
    whole = [b for b in plan._buckets if not b.groups]
    weights: list[float | None] = [None] * len(leaves)  # each leaf's weight in the sum over the mesh
    for b, r in sharded:
        for i in b.leaves:
            weights[i] = 1.0 if inf else b.weight / r
    pending = backward.take_flat(plan.comm, group, weights) if backward is not None else None
    if pending is None:
        parts = _bucket_sums([b for b, _ in sharded], leaves, norm_type, device, powsums)
        if not inf:
            parts = [p if r == 1 else p / r for p, (_, r) in zip(parts, sharded)]
        mine = norms.total(parts, norm_type, device).to(norms.partial_dtype(device))
        pending = start_all_reduce(plan.comm, [mine], ReduceOp.MAX if inf else ReduceOp.SUM, group)
    rest = _bucket_sums(whole, leaves, norm_type, device, powsums)
    (reduced,) = pending.wait()
    total = norms.total([reduced, *rest], norm_type, device)
    return norms.power_to_norm(total, norm_type).to(norms.norm_dtype(leaves))


def rounds(groups: Sequence[tuple[Any, ...]], order: Sequence[Any]) -> list[list[Any]]:
    """The rounds a plan's groups are reduced in: innermost first (the groups fewest buckets need).

    Groups that as many buckets need share a round unless one bucket needs
    both (see :func:`gradtx.comm.groups.levels`); a bucket sharded over
    ``(dp, tp)`` beside one sharded over ``dp`` gives ``[[tp], [dp]]``: the
    first bucket's part is summed over ``tp``, added to the second's, and the
    sum reduced over ``dp`` once. The order depends only on the plan, so every
    rank starts the same collectives in the same order.
    """
    need = {g: sum(g in gs for gs in groups) for g in order}
    out: list[list[Any]] = []
    for count in sorted({n for n in need.values() if n}):
        same = [g for g in order if need[g] == count]
        out += levels([gs for gs in groups if any(g in gs for g in same)], same)
    return out


def _merge(values: list[tuple[torch.Tensor, frozenset]], norm_type: float, device: torch.device) -> list:
    """Add up the values left with the same groups (max for ``inf``): one tensor per group set in a collective."""
    by_groups: dict[frozenset, list[torch.Tensor]] = {}
    for v, gs in values:
        by_groups.setdefault(gs, []).append(v)
    return [(vs[0] if len(vs) == 1 else norms.total(vs, norm_type, device), gs) for gs, vs in by_groups.items()]


def _bucket_sums(
    buckets: Sequence[Any],
    leaves: Sequence[torch.Tensor],
    norm_type: float,
    device: torch.device,
    powsums: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One contribution per bucket, its leaves' local powsums added (weighted for tied copies), all in one dtype."""
    if not buckets:
        return []
    index = [i for b in buckets for i in b.leaves]
    if powsums is not None:  # measured in the backward
        per_leaf = {i: powsums[i] for i in index}
    else:
        per_leaf = dict(zip(index, norms.tensor_powsums([leaves[i] for i in index], norm_type)))
    out = []
    for b in buckets:
        s = norms.total([per_leaf[i] for i in b.leaves], norm_type, device).to(norms.partial_dtype(device))
        out.append(s if b.weight == 1.0 or math.isinf(norm_type) else s * b.weight)
    return out
