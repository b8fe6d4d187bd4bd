"""The norm calls of the spike guards and adaptive clippers (:mod:`gradtx.spikes`, :mod:`gradtx.adaptive`).

Every statistic those transforms keep, and every skip or clip decision they
make, derives from the norms returned here, so they must be the single-device
norms of the whole model on every rank. Both go through :mod:`gradtx.plan`, as
``clip_by_global_norm`` does: a declared ``mesh_groups`` plan, else the plan the
DTensor placements define, else the local norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradtx import norms
from gradtx import plan as plans
from gradtx.plan import check_plan

__all__ = ["check_plan", "global_norm_of", "leaf_norms_of"]


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
