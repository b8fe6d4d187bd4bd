"""The global norm: local sums of p-th powers, reduced over a plan's groups with the reductions overlapped.

Every transform that reads a norm (the clip, AGC, the spike guards) comes
here, through :func:`gradtx.plan.tree_norm`: a declared ``mesh_groups`` plan,
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

from gradtx import norms
from gradtx import plan as plans
from gradtx import tree as tu
from gradtx.comm.base import ReduceOp
from gradtx.comm.groups import start_reduce_over_groups


def check_plan(mesh_groups: Any, *, name: str) -> None:
    """Raise ``TypeError`` unless ``mesh_groups`` is ``None`` or a plan from :func:`gradtx.mesh_groups`."""
    if mesh_groups is not None:
        plans._check_plan_arg(mesh_groups, what=name)


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
    norm = plans.tree_norm(leaves, norm_type, mesh_groups, what=what, tree=tree)
    if device is not None:
        norm = norm.to(device=device, dtype=torch.float32)
    if scale is not None:
        norm = norm * scale.abs().to(device=norm.device, dtype=norm.dtype)
    return norm


def leaf_norms_of(
    leaves: Sequence[torch.Tensor], *, mesh_groups: Any = None, what: str, tree: Any = None
) -> list[torch.Tensor]:
    """The fp32 L2 norm of each whole leaf (0-d each), of the unsharded tensor, the same on every rank."""
    plan = mesh_groups if mesh_groups is not None else plans.infer_plan(leaves, what=what, tree=tree)
    if plan is None:
        return norms.tensor_norms(leaves, 2.0)
    (out,) = plan.unitwise_norms([list(leaves)], unitwise=False)
    return [n.reshape(()) for n in out]


def plan_norm(plan: Any, leaves: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model under ``plan`` (a :class:`gradtx.MeshGroups`), checks done.

    One contribution (a sum of p-th powers, or a max for ``inf``) per bucket
    of leaves that share the same groups; the sharded buckets' reductions are
    started before the replicated buckets' local pass runs, then one wait,
    then the reduction over ``pp_group``, which needs the stage's total.
    """
    inf = math.isinf(norm_type)
    op = ReduceOp.MAX if inf else ReduceOp.SUM
    device = tu.local(leaves[0]).device if leaves else plan.device
    buckets = plan._buckets
    sharded = [b for b in buckets if b.groups]
    replicated = [b for b in buckets if not b.groups]
    pending = start_reduce_over_groups(
        plan.comm, _bucket_sums(sharded, leaves, norm_type, device), [b.groups for b in sharded], plan.group_order, op
    )
    sums = _bucket_sums(replicated, leaves, norm_type, device)  # runs while the reductions are in flight
    sums += pending.wait()
    total = norms.total(sums, norm_type, device).to(norms.partial_dtype(device))
    if plan.pp_group is not None:  # a rank with no grads (an empty stage) still joins it, with 0
        (total,) = plan.comm.all_reduce([total], op, plan.pp_group)
    return norms.power_to_norm(total, norm_type).to(norms.norm_dtype(leaves))


def _bucket_sums(
    buckets: Sequence[Any], leaves: Sequence[torch.Tensor], norm_type: float, device: torch.device
) -> list[torch.Tensor]:
    """One contribution per bucket, its leaves' local powsums added (weighted for tied copies), all in one dtype."""
    index = [i for b in buckets for i in b.leaves]
    per_leaf = dict(zip(index, norms.tensor_powsums([leaves[i] for i in index], norm_type)))
    out = []
    for b in buckets:
        s = norms.total([per_leaf[i] for i in b.leaves], norm_type, device)
        out.append(s if b.weight == 1.0 or math.isinf(norm_type) else s * b.weight)
    return out
