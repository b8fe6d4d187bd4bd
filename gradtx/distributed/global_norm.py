"""The global norm every transform reads: a declared plan, else the placements' plan, else the local norm.

:func:`global_norm_of` is the one entry point (what :func:`gradtx.clip_by_global_norm`,
:func:`gradtx.global_norm`, the spike guards and AGC call):

* with ``mesh_groups`` (a plan the user holds): that plan's reductions;
* else with DTensor leaves: the plan their placements define, held by the
  caller's :class:`~gradtx.distributed.global_norm.PlanSlot` (or built for the call);
* else: the local norm, torch's semantics, with no collective.

Every collective it issues is named by its arguments: the DTensors' own
meshes, or the declared plan's comm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from gradtx.comm.base import Comm, GroupKey, ReduceOp, check_comm, reduce_over_groups
from gradtx.core import norms, validate
from gradtx.core import tree as tu
from gradtx.core.base import PyTree
from gradtx.distributed.plan import DTensor, MeshGroups, _build, check_plan, default_comm


def from_placements(leaves: Sequence[Any], *, what: str, tree: PyTree | None = None) -> MeshGroups | None:
    """The plan the placements of ``leaves`` define, over the DTensors' own process groups; ``None`` without DTensors.

    Plain tensors among them are each rank's own (counted once, no collective).
    Every DTensor on one root mesh (or its sub-meshes) over the whole world,
    each of whose dims some leaf's mesh has: one reduction in all (see
    :attr:`MeshGroups.flat`); else one per sharded mesh dim. A leaf is then
    sharded over some dims of the root and held alike by the ranks that differ
    only in the others (a leaf on a sub-mesh, as FSDP2 puts a layer norm on the
    ``dp`` dim of a TP x FSDP mesh, is replicated over the ``tp`` dim that other
    leaves name), so its replica count is known. A dim no leaf's mesh has may
    hold other values on its ranks (the stages of a pipeline over one world
    mesh), which the per-dim reductions never mix; they also serve two root
    meshes, or a root smaller than the world. ``tree``, the tree ``leaves``
    were flattened from (every caller's), names their paths in errors.
    """
    if not tu.has_dtensor(leaves):
        return None
    paths = tu.paths(tree) if tree is not None else [(i,) for i in range(len(leaves))]
    comm = default_comm(leaves)
    roots = tu.root_meshes(leaves)
    one_mesh = len(roots) == 1 and 1 < roots[0].size() == comm.size("world")
    flat = "world" if one_mesh and _names_every_dim(leaves, roots[0]) else None
    return _build(paths, list(leaves), comm, what=what, flat=flat)


def _names_every_dim(leaves: Sequence[Any], root: Any) -> bool:
    """Whether every dim of the root mesh (of more than one rank) is a dim of some leaf's mesh.

    A sub-mesh dim, flattened or not, spans some dims of its root: its group
    holds the ranks that differ from this one in those dims only, so it meets
    a root dim's group in more than this rank exactly when it spans that dim.
    Read from the groups' ranks, no collective.
    """
    meshes = {id(t.device_mesh): t.device_mesh for t in leaves if isinstance(t, DTensor)}.values()
    named = {
        frozenset(dist.get_process_group_ranks(mesh.get_group(d)))
        for mesh in meshes
        for d in range(mesh.ndim)
        if mesh.size(d) > 1
    }
    dims = [set(dist.get_process_group_ranks(root.get_group(i))) for i in range(root.ndim) if root.size(i) > 1]
    return all(any(len(dim & group) > 1 for group in named) for dim in dims)


class PlanSlot:
    """The plan a transform reads from its grads' placements, rebuilt only when their meshes, placements or shapes change.

    Each transform that takes ``mesh_groups=None`` holds one (nothing is
    shared between transforms or kept process-wide). Its key is public
    DTensor metadata, read each step: a tuple compare, no collective.
    """

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.plan: MeshGroups | None = None
        self.full: Any = None  # the last updates treespec seen to cover every param (see planned)

    def get(self, leaves: Sequence[Any], *, what: str, tree: PyTree | None = None) -> MeshGroups | None:
        """The plan for ``leaves`` (``None`` without DTensors)."""
        if not tu.has_dtensor(leaves):
            return None
        # The world too: a mesh of a later process group (a re-init, a new simulated mesh) equals the old one.
        key = (
            dist.group.WORLD,
            *((t.device_mesh, t.placements, t.shape) if isinstance(t, DTensor) else None for t in leaves),
        )
        if key != self.key:
            self.plan = from_placements(leaves, what=what, tree=tree)
            self.key = key
        return self.plan

    def __getstate__(self) -> dict[str, Any]:  # a plan holds process groups: rebuilt after a copy or a load
        return {"key": None, "plan": None, "full": None}


def plan_of(leaves: Sequence[Any], mesh_groups: Any, slot: PlanSlot | None, what: str, tree: PyTree) -> Any:
    """The plan for ``leaves``: ``mesh_groups``, checked against them, else their placements' (``None``: no DTensor)."""
    if mesh_groups is not None:
        check_plan(mesh_groups, name=what)
        mesh_groups.check(leaves, what=what)
        return mesh_groups
    return (slot if slot is not None else PlanSlot()).get(leaves, what=what, tree=tree)


def global_norm(tree: PyTree, norm_type: float = 2.0, *, mesh_groups: MeshGroups | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of all leaves of ``tree`` taken together, as a 0-d fp32 tensor (fp64 if a leaf is fp64).

    Matches ``torch.nn.utils.get_total_norm`` on plain fp32 tensors (each
    rank's local norm, with no collective), and accumulates in fp32 for
    low-precision ones. On DTensor leaves it is the norm of the whole sharded
    model, as one device would compute it, read from the placements; every
    rank of their meshes must call it. Pipeline stages and hand-sharded plain
    tensors need ``mesh_groups``.

    Args:
      tree: a pytree of tensors (DTensors included).
      norm_type: any ``p > 0`` or ``inf``.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups`, or ``None``.

    Returns:
      A 0-d fp32 tensor.

    Example:
      >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
      tensor(5.)
    """
    norm_type = validate.norm_type(norm_type, name="global_norm")
    # A list of plain tensors is its own leaves: optree's registry lookup per leaf costs a tenth of the norm.
    plain = type(tree) is list and set(map(type, tree)) <= _PLAIN
    leaves = tree if plain else optree.tree_leaves(tree)
    if mesh_groups is None and (plain or set(map(type, leaves)) <= _PLAIN):
        # torch's semantics, no collective: the norm is computed first and a failure explained after, as
        # the checks' passes over the leaves cost as much as all the rest of the call's Python.
        try:
            return norms.local_norm(leaves, norm_type)
        except (RuntimeError, NotImplementedError):
            tu.check_tensors(leaves, tree=tree, what="global_norm: tree")  # names the leaf that failed
            raise
    tu.check_tensors(leaves, tree=tree, what="global_norm: tree")
    return global_norm_of(leaves, norm_type, mesh_groups=mesh_groups, tree=tree)


_PLAIN = frozenset({torch.Tensor})


def global_norm_of(
    leaves: Sequence[torch.Tensor],
    norm_type: float = 2.0,
    *,
    mesh_groups: Any = None,
    what: str = "global_norm",
    tree: PyTree | None = None,
    scale: torch.Tensor | None = None,
    device: torch.device | None = None,
    slot: PlanSlot | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's grads, as one device would compute it.

    Args:
      leaves: the grads, in flatten order.
      norm_type: any ``p > 0`` or ``inf`` (checked by the caller).
      mesh_groups: a plan from :func:`gradtx.mesh_groups`, or ``None`` to read the placements.
      what: the caller's name, for error messages.
      tree: the tree the leaves came from, only to name paths in errors.
      scale: a pending multiplier: the norm is that of the true updates ``leaves * scale``.
      device: where to return the norm, as fp32; default: where it was computed.
      slot: where the caller keeps the plan read from placements, from one call to the next.

    Returns:
      A 0-d fp32 tensor (fp64 if a leaf is fp64, unless ``device`` is given), equal on every
      rank that holds part of the model; no host sync. Every such rank must call it when it
      communicates.
    """
    plan = plan_of(leaves, mesh_groups, slot, what, tree)
    norm = norms.local_norm(leaves, norm_type) if plan is None else plan_norm(plan, leaves, norm_type)
    if device is not None:
        norm = norm.to(device=device, dtype=torch.float32)
    if scale is not None:
        norm = norm * scale.abs().to(device=norm.device, dtype=norm.dtype)
    return norm


def leaf_norms_of(
    leaves: Sequence[torch.Tensor],
    spec: Any,
    *,
    mesh_groups: Any = None,
    what: str,
    tree: Any = None,
    slot: PlanSlot,
    params: Any = None,
) -> list[torch.Tensor]:
    """The fp32 L2 norm of each whole leaf (0-d each), of the unsharded tensor, the same on every rank.

    With ``params``, a declared plan reads a ``None`` leaf of ``tree`` (treespec ``spec``) as zeros (see
    :func:`planned`)."""
    full, tree, index = planned(list(leaves), tree, params, mesh_groups, what, slot, spec)
    plan = plan_of(full, mesh_groups, slot, what, tree)
    if plan is None:
        return norms.tensor_norms(full, 2.0)
    out = unitwise_norms(plan, [full], unitwise=False, what=what)[0]  # one unit per leaf: 0-d each
    return out if index is None else [out[i] for i in index]


def unitwise_norms(
    plan: MeshGroups, trees: Sequence[Sequence[torch.Tensor]], *, unitwise: bool, what: str = "adaptive_clip"
) -> list[list[torch.Tensor]]:
    """The fp32 L2 norm of each output unit of every leaf under ``plan``, for several aligned leaf lists at once.

    Units follow PyTorch layouts (dim 0 is the output unit; see
    :func:`gradtx.unitwise_norm`). Where a unit spans ranks (a weight split
    along dim 1, or a 1-d leaf split at all), its partial sums of squares are
    summed over those groups: one all-reduce per group for every leaf of
    every list, e.g. the grads and the weights of AGC together.

    Returns:
      For each list, the per-leaf norms, broadcastable to the leaf's local shard.
    """
    spanning: list[tuple[int, int, tuple[GroupKey, ...]]] = []  # (list, leaf, the groups its units span)
    out: list[list[torch.Tensor]] = []
    for t, leaves in enumerate(trees):
        plan.check(leaves, what=f"{what}: {('updates', 'params')[t]}" if len(trees) > 1 else what)
        row: list[torch.Tensor] = []
        for i, leaf in enumerate(leaves):
            spans = plan.unit_groups(i, unitwise=unitwise)
            if not spans:  # the units are all local: the plain single-device formula
                row.append(norms.unitwise_norm(leaf, unitwise=unitwise))
                continue
            x = norms.magnitudes(tu.local(leaf))
            one_unit = x.ndim <= 1 or not unitwise
            row.append(x.square().sum() if one_unit else x.square().sum(dim=tuple(range(1, x.ndim)), keepdim=True))
            spanning.append((t, i, spans))
        out.append(row)
    items = [out[t][i] for t, i, _ in spanning]
    if any(sq.dtype == torch.float64 for sq in items):  # one dtype: one collective per group
        items = [sq.to(torch.float64) for sq in items]
    groups = [spans for _, _, spans in spanning]
    for (t, i, _), sq in zip(spanning, reduce_over_groups(plan.comm, items, groups, plan.group_order, ReduceOp.SUM)):
        out[t][i] = sq.sqrt()
    return out


def zero_filled(index: list[int], leaves: list[Any], all_params: list[Any]) -> list[Any]:
    """An update for every param: the ``leaves`` at ``index``, zeros for the params that got none."""
    full = tu.scatter(len(all_params), index, leaves)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(full, all_params)]


def planned(
    leaves: list[Any], updates: Any, params: Any, mesh_groups: Any, what: str, slot: PlanSlot, spec: Any
) -> tuple[list[Any], Any, Any]:
    """``(leaves, tree, index)`` as a declared plan, or DTensor params' placements, read ``updates``' leaves: they
    cover every param, so one with no gradient (``None``, an expert no token reached on this rank, even where its
    other grads are plain) joins the collectives as zeros and every rank issues the same ones; ``leaves[index[j]]``
    is the ``j``-th given leaf (``index`` is ``None`` when nothing was filled). ``spec``, the updates' treespec, is
    kept in ``slot`` once it covers every param, so a step with the same one does not read the params again."""
    if params is None or (not torch.compiler.is_compiling() and spec == slot.full):  # (dynamo compares no specs)
        return leaves, updates, None
    all_params = tu.flatten(params)[0]
    if len(leaves) == len(all_params) or not (mesh_groups is not None or tu.has_dtensor(all_params)):
        slot.full = spec if len(leaves) == len(all_params) else None
        return leaves, updates, None  # (plain params and no plan: each rank's local norm, no collective to join)
    index, leaves, _ = tu.align(params, updates, what=f"{what}: updates", against="params")
    return zero_filled(index, leaves, all_params), params, index


def paired_norms(
    updates: PyTree, params: PyTree, *, unitwise: bool, mesh_groups: MeshGroups | None, slot: PlanSlot, what: str
) -> tuple[list[torch.Tensor], Any, list[torch.Tensor], list[torch.Tensor]]:
    """Per-unit fp32 L2 norms of each update and of its param (AGC, lamb, lars), the updates aligned to the params.

    The plan is ``mesh_groups``, else the one the updates' placements define, else none (every unit is
    local); where a unit spans ranks, its norm is reduced over them. Units follow PyTorch layouts: see
    :func:`gradtx.unitwise_norm`. A ``None`` update (a param with no gradient) is left out, and its param
    is not read. A declared plan, or DTensor params, cover every param: one with no update joins the
    collectives as zeros, so every rank issues the same ones.

    Returns:
      The updates' leaves and treespec (as :func:`gradtx.core.tree.align` gives them), their norms and
      their params' norms, each broadcastable to its leaf's local shard.
    """
    index, leaves, spec = tu.align(params, updates, what=f"{what}: updates", against="params")
    all_params = tu.flatten(params)[0]
    filled = mesh_groups is not None or tu.has_dtensor(all_params)  # every rank joins the same collectives
    if filled:
        grads, weights = zero_filled(index, leaves, all_params), all_params
    else:
        grads, weights = leaves, [all_params[i] for i in index]
    plan = plan_of(grads, mesh_groups, slot, what, params if filled else updates)
    if plan is None:  # every unit is local: the plain single-device formula
        u_norms = [norms.unitwise_norm(x, unitwise=unitwise) for x in grads]
        p_norms = [norms.unitwise_norm(x, unitwise=unitwise) for x in weights]
        return leaves, spec, u_norms, p_norms
    u_norms, p_norms = unitwise_norms(plan, [grads, weights], unitwise=unitwise, what=what)
    if filled:
        u_norms, p_norms = [u_norms[i] for i in index], [p_norms[i] for i in index]
    return leaves, spec, u_norms, p_norms


def agree_finite(
    finite: torch.Tensor, leaves: Sequence[Any], *, comm: Comm | None = None, group: GroupKey = "world"
) -> torch.Tensor:
    """Agree on a finite-check verdict over every rank that holds part of the model (MAX of the not-finite flag).

    With ``comm``: over ``group``. Else, with DTensor leaves: over the root
    meshes of their meshes (one scalar collective over the default group when
    a root spans it, else one per mesh dim), because a NaN that lands in one
    rank's shard must stop every rank. Else (plain tensors, as under DDP, or
    one process): the local verdict, with no collective.

    Returns:
      A 0-d bool tensor, equal on every rank that agreed; no host sync.
    """
    notfinite = (~finite).to(torch.float32)
    return all_max(notfinite, leaves, comm=comm, group=group, name="apply_if_finite") == 0


def all_max(
    x: torch.Tensor, leaves: Sequence[Any], *, comm: Comm | None, group: GroupKey, name: str, world: bool = False
) -> torch.Tensor:
    """``x``'s elementwise MAX over every rank that holds part of the model, or ``x`` with no one to agree with.

    Over ``comm``'s ``group`` when ``comm`` is given; else over the root meshes
    of ``leaves``' DTensors (the default group when every root spans it, else
    each of their dims); else, with ``world``, over the default group when
    ``torch.distributed`` is initialised.
    """
    if comm is not None:
        check_comm(comm, name=name)
        groups: list[GroupKey] = [group]
    else:
        roots = tu.root_meshes(leaves)
        if not (roots or world):
            return x
        comm = default_comm(leaves)  # the DTensors' own meshes, else the world, else one process (no collective)
        groups = ["world"]
        if any(root.size() != comm.size("world") for root in roots):  # each dim of the root meshes
            groups = []
            for root in roots:
                for dim in range(root.ndim):
                    pg = root.get_group(dim)
                    if root.size(dim) > 1 and all(pg is not g for g in groups):
                        groups.append(pg)
    for g in groups:
        (x,) = comm.all_reduce([x], ReduceOp.MAX, g)
    return x


# --- the norm on a plan -------------------------------------------------------------------------
#
# Local fp32 foreach norms of each leaf's shard, one p-th-power partial per bucket (leaves that share
# the same groups), all taken in one masked, weighted sum over the plan's columns with no Python per leaf
# or bucket, then the reductions: one all-reduce over the whole mesh for a flat plan, else one per group,
# then one over pp_group.


def plan_norm(plan: MeshGroups, leaves: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model under ``plan``, checks done: 0-d, the same on every rank, no host sync."""
    inf = math.isinf(norm_type)
    op = ReduceOp.MAX if inf else ReduceOp.SUM
    device = tu.local(leaves[0]).device if leaves else plan.device
    part = norms.partial_dtype(device)
    mask, weights = plan.columns(device, part)
    if leaves:  # one pass over every leaf's contribution: each column's part, its tied copies weighted
        cols = torch.where(mask, norms.tensor_powsums(leaves, norm_type)[:, None], 0)
        parts = cols.amax(0) if inf else (cols * weights).sum(0)
    else:  # a rank with no grads (an empty stage) still joins every collective, with 0
        parts = torch.zeros(mask.shape[1], dtype=part, device=device)
    if plan.flat is not None:  # one sum over the whole mesh, each part divided by its replica count
        sharded, plain = parts.unbind()
        (stage,) = plan.comm.all_reduce([sharded], op, plan.flat[0])
        # Plain leaves are each rank's own: added after, never averaged over the ranks.
        stage = torch.maximum(stage, plain) if inf else stage + plain
    else:
        reduced = reduce_over_groups(plan.comm, parts.unbind(), [b.groups for b in plan._buckets], plan.group_order, op)
        stage = norms.total(reduced, norm_type, device).to(part)
    if plan.pp_group is not None:
        (stage,) = plan.comm.all_reduce([stage], op, plan.pp_group)
    return norms.power_to_norm(stage, norm_type).to(norms.norm_dtype(leaves))
