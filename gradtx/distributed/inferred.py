"""The plan read from placements, and what runs on a plan: the global norm, unit-wise norms, finite agreement.

On DTensors the placements *are* the plan (see :mod:`gradtx.distributed.plan`):
:func:`infer_plan` reads it from the leaves once and keeps it in a
:class:`PlanCache`, keyed by the leaves' placements, meshes and shapes.
:func:`tree_norm` is the one norm every transform uses (a declared plan,
else the inferred one, else the local norm); :func:`agree_finite` makes every
rank skip a step when any rank sees a non-finite value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from gradtx.comm.backward_norm import BackwardNorm
from gradtx.comm.base import Comm, GroupKey, ReduceOp, check_comm
from gradtx.core import norms
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import PyTree
from gradtx.distributed.plan import (
    DTensor,
    MeshGroups,
    _build,
    check_plan,
    default_comm,
)
from gradtx.distributed.replicas import agreement_groups, check_plain_replicas, multi_process

__all__ = [
    "DEFAULT_CACHE",
    "PlanCache",
    "agree_finite",
    "global_norm",
    "infer_plan",
    "tree_norm",
    "tree_unitwise_norms",
]

# --- the zero-configuration path: the plan read from the placements ----------------------------
#
# A step's cost on a cache hit is one read of each leaf's DTensor spec (shape, placements, mesh)
# and a tuple compare: no collective and no host sync beyond what the plan itself issues.


class PlanCache:
    """The plans inferred from placements, and the groups a finite check agrees over, built once and reused.

    Keyed by each leaf's DTensor spec (mesh, placements, shape, stride, dtype) and bounded (a model re-sharded,
    or a second model, gets a new entry; the oldest goes). Its entries belong to the process-group world they
    were built in: once the default process group is destroyed and another one started (a test's simulated
    mesh ending, an in-process restart), the first lookup drops them all, so no plan reduces over a dead group
    and no dead group is kept alive by a plan. gradtx's norms use :data:`DEFAULT_CACHE`; code that wants
    a shorter lifetime builds its own and passes ``cache=`` to :func:`infer_plan` and :func:`agree_finite`.

    Args:
      size: how many plans (and as many agreements) to keep.
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._world: Any = None
        self.plans: dict[tuple[Any, ...], MeshGroups] = {}
        self.agreements: dict[tuple[Any, ...], tuple[Comm, tuple[GroupKey, ...]]] = {}
        # Trees of plain tensors found to be replicas on every rank (keyed by shapes and dtypes): checked once.
        self.replicas: dict[tuple[Any, ...], bool] = {}

    def current(self) -> PlanCache:
        """This cache, emptied first if the process-group world changed since its entries were built."""
        dist = torch.distributed
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if world is not self._world:
            self.clear()
            self._world = world
        return self

    def clear(self) -> None:
        """Drop every entry."""
        self.plans.clear()
        self.agreements.clear()
        self.replicas.clear()
        self._world = None

    def remember(self, table: dict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any) -> Any:
        """Store ``value`` under ``key`` in ``table`` (one of this cache's), evicting the oldest entry when full."""
        if len(table) >= self.size:
            table.pop(next(iter(table)))
        table[key] = value
        return value

    def __len__(self) -> int:
        return len(self.plans) + len(self.agreements) + len(self.replicas)


DEFAULT_CACHE = PlanCache()


def _signature(leaves: Sequence[Any]) -> tuple[Any, ...] | None:
    """What an inferred plan depends on: each DTensor's spec (mesh, placements, shape, stride, dtype); None without DTensors."""
    if DTensor is None:
        return None
    key = tuple(t._spec if isinstance(t, DTensor) else None for t in leaves)
    return key if any(k is not None for k in key) else None


def _leaf_paths(n: int, tree: PyTree | None) -> list[str]:
    if tree is not None:
        paths = [tu.dotted(p) for p in optree.tree_paths(tree)]
        if len(paths) == n:
            return paths
    return [f"<leaf {i}>" for i in range(n)]


def infer_plan(
    leaves: Sequence[Any], *, what: str, tree: PyTree | None = None, cache: PlanCache | None = None
) -> MeshGroups | None:
    """The plan the placements of ``leaves`` define, built once per placements and meshes; ``None`` without DTensors.

    Plain tensors in the tree are counted once, as replicas (DDP's layout).
    In a run of several processes that is checked once per tree layout, with
    one small all-reduce when the plan is first needed: plain tensors that
    differ across the ranks (a pipeline stage, unsynced grads) raise
    ``ValueError`` on every rank, naming what to declare. A tree on a mesh with a pipeline dim (``"pp"``) is refused: the other
    stages' norms cannot be read from placements, so that plan is declared
    with :func:`mesh_groups`.

    Args:
      leaves: the grads (DTensors and plain tensors), in flatten order.
      what: the caller's name, for error messages.
      tree: the tree ``leaves`` came from, only to name paths in errors.
      cache: where the plan is kept; default :data:`DEFAULT_CACHE`.

    Returns:
      A cached :class:`MeshGroups` over the DTensors' own process groups, or ``None``.
    """
    key = _signature(leaves)
    if key is None:
        if multi_process():
            _check_plain_tree(leaves, what=what, cache=cache)
        return None
    cache = (cache if cache is not None else DEFAULT_CACHE).current()
    plan = cache.plans.get(key)
    if plan is None:
        plan = cache.remember(
            cache.plans,
            key,
            _build(
                _leaf_paths(len(leaves), tree),
                list(leaves),
                default_comm(leaves),
                sharded=None,
                pp_group=None,
                tied=None,
                device=None,
                what=what,
                flat=True,
            ),
        )
    return plan


def _check_plain_tree(leaves: Sequence[Any], *, what: str, cache: PlanCache | None) -> None:
    """A tree of plain tensors only, in a multi-process run: raise unless they are replicas (checked once per layout)."""
    table = (cache if cache is not None else DEFAULT_CACHE).current()
    key = tuple((t.shape, t.dtype) for t in leaves)
    if key in table.replicas:
        return
    check_plain_replicas(list(leaves), leaves, what=what, leaf_kind="grads")
    table.remember(table.replicas, key, True)


def tree_norm(
    leaves: Sequence[torch.Tensor],
    norm_type: float,
    mesh_groups: MeshGroups | None = None,
    *,
    what: str = "global_norm",
    tree: PyTree | None = None,
    powsums: Sequence[torch.Tensor] | None = None,
    backward: BackwardNorm | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's grads, as one device would compute it; the one norm every transform uses.

    * With ``mesh_groups``: that declared plan (pipeline stages, tied weights,
      hand-sharded plain tensors).
    * Else, with DTensor leaves: the plan their placements define (see
      :func:`infer_plan`), built once and cached by placements and meshes:
      one collective per sharded mesh dim, as the explicit plan issues, or one in all when every
      DTensor lives on one root mesh over the world (see ``MeshGroups.num_collectives``).
    * Else: the local norm (unsharded, or replicated as under DDP): no collective.

    Every rank holding part of the model must call it (it may communicate).

    Args:
      leaves: the grads, in flatten order.
      norm_type: any ``p > 0`` or ``inf``.
      mesh_groups: a plan from :func:`mesh_groups`, or ``None`` to read the placements.
      what: the caller's name, for error messages.
      tree: the tree the leaves came from, only to name paths in errors.
      powsums: each leaf's local contribution (:func:`gradtx.core.norms.tensor_powsums`), already
        measured (by the hooks of a :class:`gradtx.BackwardNorm`): only the reductions remain.
      backward: that :class:`gradtx.BackwardNorm`, which under a plan of one reduction over the
        mesh starts that reduction in the backward from the next step on.

    Returns:
      A 0-d fp32 tensor, equal on every rank; no host sync.
    """
    if mesh_groups is not None:
        check_plan(mesh_groups, name=what)
        return mesh_groups.global_norm(leaves, norm_type)
    plan = infer_plan(leaves, what=what, tree=tree)
    if plan is None:
        if powsums is not None:
            total = norms.total(list(powsums), norm_type)
            return norms.power_to_norm(total, norm_type).to(norms.norm_dtype(leaves))
        return norms.local_norm(leaves, norm_type)
    from gradtx.distributed.global_norm import plan_norm

    return plan_norm(plan, leaves, norm_type, powsums=powsums, backward=backward)


def tree_unitwise_norms(
    grads: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    *,
    unitwise: bool,
    mesh_groups: MeshGroups | None = None,
    tree: PyTree | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-unit fp32 L2 norms of grads and weights (AGC), reduced where a unit spans ranks.

    The plan is ``mesh_groups``, else the one the grads' placements define, else none
    (every unit is local). Units follow PyTorch layouts: see :func:`gradtx.unitwise_norm`.

    Returns:
      ``(grad_norms, weight_norms)``, each broadcastable to its leaf's local shard.
    """
    plan = mesh_groups
    if plan is not None:
        check_plan(plan, name="adaptive_clip")
    else:
        plan = infer_plan(grads, what="adaptive_clip", tree=tree)
    if plan is None:
        return (
            [norms.unitwise_norm(g, unitwise=unitwise) for g in grads],
            [norms.unitwise_norm(w, unitwise=unitwise) for w in weights],
        )
    g_norms, w_norms = plan.unitwise_norms([grads, weights], unitwise=unitwise)
    return g_norms, w_norms


def agree_finite(
    finite: torch.Tensor,
    leaves: Sequence[Any],
    *,
    comm: Comm | None = None,
    group: GroupKey = "world",
    cache: PlanCache | None = None,
) -> torch.Tensor:
    """Agree on a finite-check verdict over every rank that holds part of the model (MAX of the not-finite flag).

    With ``comm``: over ``group``. Else, with DTensor leaves: over the whole
    root mesh of their meshes (one scalar collective over the default group
    when the mesh spans it, else one per mesh dim), because a NaN that lands
    in one rank's shard must stop every rank. Else (plain tensors, replicated
    as under DDP, or one process): the local verdict.

    Returns:
      A 0-d bool tensor, equal on every rank that agreed; no host sync.
    """
    if comm is not None:
        check_comm(comm, name="apply_if_finite")
        plan: tuple[Comm, tuple[GroupKey, ...]] | None = (comm, (group,))
    else:
        key = _signature(leaves)
        table = (cache if cache is not None else DEFAULT_CACHE).current()
        plan = None if key is None else table.agreements.get(key)
        if key is not None and plan is None:
            plan = table.remember(table.agreements, key, agreement_groups(leaves))
    if plan is None:
        return finite
    agree_comm, groups = plan
    notfinite = (~finite).to(torch.float32)
    for g in groups:
        (notfinite,) = agree_comm.all_reduce([notfinite], ReduceOp.MAX, g)
    return notfinite == 0


def global_norm(tree: PyTree, norm_type: float = 2.0, *, mesh_groups: MeshGroups | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of all leaves of ``tree`` taken together, as a 0-d fp32 tensor (fp64 if a leaf is fp64).

    Matches ``torch.nn.utils.get_total_norm`` on fp32 tensors, and accumulates
    in fp32 for low-precision ones. On DTensor leaves it is the norm of the
    whole sharded model, as one device would compute it, read from the
    placements (see :func:`tree_norm`); every rank must call it. Pipeline
    stages and hand-sharded plain tensors need ``mesh_groups``.

    Args:
      tree: a pytree of tensors (DTensors included).
      norm_type: any ``p > 0`` or ``inf``.
      mesh_groups: a declared plan from :func:`mesh_groups`, or ``None``.

    Returns:
      A 0-d fp32 tensor.

    Example:
      >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
      tensor(5.)
    """
    norm_type = check.norm_type(norm_type, name="global_norm")
    leaves, _ = tu.flatten(tree)
    tu.check_tensors(leaves, tree=tree, what="global_norm: tree")
    return tree_norm(leaves, norm_type, mesh_groups, what="global_norm", tree=tree)
