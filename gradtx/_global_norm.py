"""The one global-norm call of the spike guards and adaptive clippers (:mod:`gradtx.spikes`, :mod:`gradtx.adaptive`).

Every statistic those transforms keep, and every skip or clip decision they
make, derives from the norm returned here, so it must be the single-device
norm of the whole model on every rank. Routing it through one function lets
the plan be inferred from DTensor placements later without touching them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradtx import norms


def check_plan(mesh_groups: Any, method: str, *, name: str) -> None:
    """Raise ``TypeError`` unless ``mesh_groups`` is ``None`` or a plan with ``.method``."""
    if mesh_groups is not None and not callable(getattr(mesh_groups, method, None)):
        raise TypeError(
            f"{name}: mesh_groups must be a plan from gradtx.mesh_groups(...) (with .{method}), "
            f"got {type(mesh_groups).__name__}"
        )


def global_norm_of(leaves: Sequence[torch.Tensor], norm_type: float = 2.0, *, mesh_groups: Any = None) -> torch.Tensor:
    """The global ``norm_type``-norm of ``leaves`` (0-d fp32, no host sync), as ``clip_by_global_norm`` takes it.

    With a ``mesh_groups`` plan the norm is reduced over the groups each leaf
    is sharded over, so every rank gets the unsharded model's norm.
    """
    if mesh_groups is None:
        return norms.combine_norms(norms.tensor_norms(leaves, norm_type), norm_type)
    return mesh_groups.global_norm(leaves, norm_type)


def leaf_norms_of(leaves: Sequence[torch.Tensor], *, mesh_groups: Any = None) -> list[torch.Tensor]:
    """The fp32 L2 norm of each whole leaf (0-d each); with a plan, of the unsharded leaf on every rank."""
    if mesh_groups is None:
        return norms.tensor_norms(leaves, 2.0)
    (out,) = mesh_groups.unitwise_norms([list(leaves)], unitwise=False)
    return [n.reshape(()) for n in out]
