"""Plain tensors in a run of several processes: replicas, or something the caller must declare.

A plain tensor carries no placement, so :func:`gradtx.mesh_groups` and the
zero-configuration norm check once, when a plan is built, that undeclared plain
tensors hold the same values on every rank (see :func:`plain_replicas_agree`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradtx.comm.base import Comm, GroupKey, ReduceOp
from gradtx.core import norms
from gradtx.core import tree as tu

try:  # DTensor is optional: a CPU-only or old build may lack torch.distributed.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["agreement_groups", "check_plain_replicas", "multi_process", "plain_replicas_agree"]


# --- plain tensors in a run of several processes --------------------------------------------------
#
# A plain tensor carries no placement: on each rank it may be a replica (DDP, or synced by hand), a
# pipeline stage's own weight, or an unsynced partial grad, and nothing in the tensor tells them apart.
# What DDP makes observable is that its replicas are bitwise equal on every rank, so an undeclared plan
# checks that, once, when it is built: one MAX all-reduce of a fingerprint and its negation (max == -max(-x)
# means every rank holds the same), read to the host once. Equal: replicas, counted once. Different: the
# caller must say what they are, so every rank raises (the reduced fingerprint is the same everywhere).


def multi_process() -> bool:
    """Whether ``torch.distributed`` is initialised with more than one rank (simulated ranks included)."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def plain_replicas_agree(plain: Sequence[torch.Tensor], leaves: Sequence[Any]) -> tuple[bool, int]:
    """Whether the plain tensors ``plain`` hold the same values on every rank of the run, and over how many ranks.

    One all-reduce (MAX, one per mesh dim when the DTensors' root mesh does not span the world) of a
    fingerprint: the leaf count, the element count, and the sums of the leaves' L1 and L2 norms. Every rank must call it
    at the same point (it is a collective), whatever it holds; the answer is the same on every rank. Not for a
    hot path: it reads the result to the host.

    Args:
      plain: this rank's plain tensors (possibly none).
      leaves: the whole tree's leaves: its DTensors' root meshes are the ranks checked; without any, the world.

    Returns:
      ``(agree, ranks)``.
    """
    from gradtx.comm.torch_dist import TorchComm, fingerprint_device, world_size

    roots = {id(m): m for m in (t.device_mesh._get_root_mesh() for t in leaves if isinstance(t, DTensor))}
    if roots:  # the ranks that hold this model: its DTensors' root meshes
        comm, groups = agreement_groups(leaves)
        ranks = max(root.size() for root in roots.values())
    else:
        comm, groups, ranks = TorchComm(), ("world",), world_size()
    device = tu.local(plain[0]).device if plain else fingerprint_device()
    count = torch.tensor([float(len(plain)), float(sum(t.numel() for t in plain))], dtype=torch.float64, device=device)
    stats = [count]
    for p in (1.0, 2.0):  # per-leaf fp32 norms (no copy of a grad): replicas compute them bitwise alike
        per_leaf = norms.tensor_norms([tu.local(t).detach() for t in plain], p) if plain else []
        zero = torch.zeros(1, dtype=torch.float64, device=device)
        stats.append(sum((n.to(device, torch.float64).reshape(1) for n in per_leaf), zero))
    # NaN compares unequal to itself and infinities overflow the negation's meaning: map both to numbers.
    fingerprint = torch.nan_to_num(torch.cat(stats), nan=-1.0, posinf=1e300, neginf=-1e300)
    both = torch.cat([fingerprint, -fingerprint])
    for group in groups:
        (both,) = comm.all_reduce([both], ReduceOp.MAX, group)
    n = fingerprint.numel()
    return _all_true(both[:n] == -both[n:]), ranks


def agreement_groups(leaves: Sequence[Any]) -> tuple[Comm, tuple[GroupKey, ...]]:
    """The comm and groups that span every rank holding ``leaves``: the world, or each dim of their DTensors' root meshes."""
    from gradtx.comm.torch_dist import mesh_comm, world_size

    roots: list[Any] = []
    for t in leaves:
        if isinstance(t, DTensor):
            root = t.device_mesh._get_root_mesh()
            if all(root is not r for r in roots):
                roots.append(root)
    comm = mesh_comm(roots)
    if all(root.size() == world_size() for root in roots):
        return comm, ("world",)
    groups: list[Any] = []
    for root in roots:
        for dim in range(root.ndim):
            pg = root.get_group(dim)
            if root.size(dim) > 1 and all(pg is not g for g in groups):
                groups.append(pg)
    return comm, tuple(groups)


def _all_true(flags: torch.Tensor) -> bool:
    # On a simulated mesh the flags are a LocalTensor; after the all-reduce every rank holds the same ones.
    try:
        from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
    except ImportError:  # pragma: no cover
        return bool(flags.all())
    with maybe_disable_local_tensor_mode():
        if isinstance(flags, LocalTensor):
            return all(bool(t.all()) for t in flags._local_tensors.values())
        return bool(flags.all())


def check_plain_replicas(plain: Sequence[torch.Tensor], leaves: Sequence[Any], *, what: str, leaf_kind: str) -> None:
    """Raise ``ValueError`` on every rank unless the plain tensors ``plain`` are replicas (see :func:`plain_replicas_agree`)."""
    agree, ranks = plain_replicas_agree(plain, leaves)
    if not agree:
        raise ValueError(
            f"{what}: the {leaf_kind} are plain tensors that differ across the {ranks} ranks, and no plan says what "
            "they are (a pipeline stage, replicas, or each rank's own); declare it with "
            "mesh_groups=gtx.mesh_groups(params, pp_group=...) for a pipeline stage, plain='replicated' for "
            "replicas you sync yourself, or plain='local' for a norm per rank (see docs/distributed.md)"
        )
