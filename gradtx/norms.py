"""Norms of gradient trees, accumulated in fp32 with foreach kernels.

The local part is computed here, on each tensor's local shard. Turning local
parts into a global norm over a sharded model (summing p-th powers over the
mesh dims where a grad is sharded) is the job of a norm plan; see
:func:`gradtx.mesh_groups` and ``docs/distributed.md``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from gradtx import tree as tu
from gradtx.base import PyTree


def check_norm_type(norm_type: float, *, name: str) -> float:
    """Validate a norm order: a positive number or ``inf``."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"{name}: norm_type must be a number, got {type(norm_type).__name__}")
    norm_type = float(norm_type)
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"{name}: norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The fp32 ``norm_type``-norm of each tensor's local shard, one foreach kernel per (device, dtype)."""
    locals_ = [tu.local(t) for t in tensors]
    out: list[torch.Tensor] = [None] * len(locals_)  # type: ignore[list-item]
    for _, idx in tu.group_by_device_dtype(locals_).items():
        norms = torch._foreach_norm([locals_[i] for i in idx], norm_type, dtype=torch.float32)
        for i, n in zip(idx, norms):
            out[i] = n
    return out


def combine_norms(norms: Sequence[torch.Tensor], norm_type: float, device: torch.device | None = None) -> torch.Tensor:
    """The norm of a vector of norms, as ``torch.nn.utils.clip_grad_norm_`` combines them (fp32, 0-d)."""
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    device = device if device is not None else norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


def norm_to_power(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The additive form of a norm: ``norm**p``, or the norm itself for ``inf`` (combined with MAX)."""
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def power_to_norm(power: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Invert :func:`norm_to_power`."""
    return power if math.isinf(norm_type) else power.pow(1.0 / norm_type)


def global_norm(tree: PyTree, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all leaves of ``tree`` taken together, as a 0-d fp32 tensor.

    Matches ``torch.nn.utils.get_total_norm`` on fp32 tensors, and accumulates
    in fp32 for low-precision ones. DTensor leaves contribute their local
    shards only; for the norm of a sharded model use ``clip_by_global_norm``
    with ``mesh_groups``.

    Example:
      >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
      tensor(5.)
    """
    norm_type = check_norm_type(norm_type, name="global_norm")
    leaves, _ = tu.flatten(tree)
    tu.check_tensors(leaves, tu.paths(tree), what="global_norm: tree")
    return combine_norms(tensor_norms(leaves, norm_type), norm_type)
