"""The sharding plan: which process groups each grad's norm is reduced over.

On DTensors the placements *are* the plan: a grad's local p-th power is
summed over each mesh dim where it is ``Shard``/``_StridedShard``, never over
a ``Replicate`` dim, with the process groups of the DTensor's own mesh.
:func:`gradtx.distributed.inferred.tree_norm` (what :func:`gradtx.clip_by_global_norm`,
:func:`gradtx.global_norm` and :func:`gradtx.adaptive_clip` call) infers that
plan from the leaves, builds it once and reuses it, keyed by the leaves'
placements, meshes and shapes (:mod:`gradtx.distributed.inferred`, whose names
this module still answers to). What placements cannot say (plain tensors
sharded by hand, the pipeline group, weights tied across stages) is declared
with :func:`mesh_groups`. The argument is in ``docs/distributed.md``.

Every collective goes through a :class:`~gradtx.comm.Comm`; the one for an
inferred plan comes from :func:`gradtx.comm.torch_dist.mesh_comm`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple, TypeGuard, TypeVar, cast

import optree
import torch

from gradtx.comm.base import Comm, GroupKey, ReduceOp, as_comm
from gradtx.comm.groups import reduce_over_groups
from gradtx.comm.local import LocalComm
from gradtx.core import kinds, norms
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import PyTree
from gradtx.distributed.replicas import check_plain_replicas, multi_process

try:  # DTensor is optional: a CPU-only or old build may lack torch.distributed.
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    DTensor = Shard = None  # type: ignore[assignment,misc]
try:  # FSDP2 over TP shards dim 0 twice; the second split is a _StridedShard (private, so guarded).
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None  # type: ignore[assignment,misc]

# Mesh dim names read as a pipeline dim: stages hold different weights, so a norm that ignores
# the other stages is wrong, and placements cannot say so. Such a mesh needs a declared plan.
PIPELINE_DIM_NAMES = ("pp", "pipeline", "pipe")

# What plain-tensor grads are, when a multi-process run says so (mesh_groups(..., plain=...)): "replicated"
# (copies, e.g. synced by hand: counted once) or "local" (each rank's norm is its own: no reduction).
# A pipeline stage is declared with pp_group; a hand-cut tensor with sharded.
PLAIN_KINDS = ("replicated", "local")


# --- the mesh_groups plan: which process groups each grad's norm is reduced over -------------
#
# Everything the plan decides is decided once, in mesh_groups(), from the params'
# placements and the user's declarations. A step only checks cheap metadata
# (count, shapes, placements), does local foreach math, and issues one
# all-reduce per process group that some bucket needs, always in the same order.


class Sharded(NamedTuple):
    """A manual shard declaration for :func:`mesh_groups`: a plain tensor split over ``group``.

    Attributes:
      group: the group key (a mesh dim name, a ``ProcessGroup``, ...) whose ranks
        each hold a disjoint piece of the tensor.
      dim: the tensor dim that is split. Only :func:`gradtx.adaptive_clip`
        needs it, to tell whether its units (dim 0) are local; ``None`` is
        fine for the global norm.
    """

    group: GroupKey
    dim: int | None = None


Matcher = str | Callable[[str, torch.Tensor], bool]
ShardDecl = GroupKey | Sharded | Sequence[GroupKey | Sharded]


class _Leaf(NamedTuple):
    path: str  # dotted, for error messages and matching: "layers.0.attn.wq.weight"
    shape: torch.Size  # global (logical) shape
    ndim: int
    placements: tuple[Any, ...] | None  # None for a plain tensor
    shards: tuple[tuple[GroupKey, int | None], ...]  # (group, tensor dim split over it), no duplicates
    tie_group: GroupKey | None


class _Bucket(NamedTuple):
    groups: tuple[GroupKey, ...]  # in plan order
    weight: float  # 1 / number of stages holding a tied copy; 1 otherwise
    leaves: tuple[int, ...]


def _is_shard(placement: Any) -> TypeGuard[Shard]:
    # Not placement.is_shard(): it is False for _StridedShard.
    return isinstance(placement, Shard) or (_StridedShard is not None and isinstance(placement, _StridedShard))


def _match(matcher: Matcher, path: str, leaf: torch.Tensor) -> bool:
    if callable(matcher):
        return bool(matcher(path, leaf))
    return path == matcher or fnmatch.fnmatchcase(path, matcher)


def _check_matcher(matcher: Any, *, arg: str) -> None:
    if not (isinstance(matcher, str) or callable(matcher)):
        raise TypeError(
            f"mesh_groups: {arg} keys must be a dotted path, a glob, or a predicate (path, leaf) -> bool; "
            f"got {type(matcher).__name__}"
        )


def _shard_decls(value: Any, *, where: str) -> list[tuple[GroupKey, int | None]]:
    items = list(value) if isinstance(value, (list, tuple)) and not isinstance(value, Sharded) else [value]
    if not items:
        raise ValueError(f"mesh_groups: {where} declares no group")
    out: list[tuple[GroupKey, int | None]] = []
    for item in items:
        if isinstance(item, Sharded):
            if item.dim is not None and (isinstance(item.dim, bool) or not isinstance(item.dim, int)):
                raise TypeError(f"mesh_groups: {where}: Sharded.dim must be an int or None, got {item.dim!r}")
            out.append((item.group, item.dim))
        elif item is None or isinstance(item, Hashable):
            out.append((item, None))
        else:
            raise TypeError(f"mesh_groups: {where}: a group key must be hashable, got {type(item).__name__}")
    return out


class MeshGroups:
    """A norm plan: for every leaf, the process groups its norm is reduced over. Build it with :func:`mesh_groups`.

    The plan is bound to the leaf order of the tree it was built from: pass the
    updates of that same tree (same structure, same shapes) to the transforms
    that use it. Each use checks this cheaply and names the first path that differs.
    """

    def __init__(
        self,
        comm: Comm,
        leaves: list[_Leaf],
        pp_group: GroupKey | None,
        device: torch.device,
        plain: str | None = None,
        flat: GroupKey | None = None,
    ) -> None:
        self.comm = comm
        self.pp_group = pp_group
        self.device = device
        self._leaves = leaves
        # What the plain leaves no `sharded` entry names are: "pipeline" (a stage, with pp_group),
        # "replicated" or "local" (declared), "replicas" (found equal on every rank when the plan was
        # built), "one process", or None when there are none.
        self.plain = plain

        order: list[GroupKey] = []
        for leaf in leaves:
            for group, _ in leaf.shards:
                if group not in order:
                    order.append(group)
        # The one order every rank reduces in: first appearance in the params, which is the
        # same on every member of a group because its members hold the same part of the model.
        self.group_order: tuple[GroupKey, ...] = tuple(order)

        sizes = {}
        for leaf in leaves:
            if leaf.tie_group is not None and leaf.tie_group not in sizes:
                sizes[leaf.tie_group] = comm.size(leaf.tie_group)
        buckets: dict[tuple[tuple[GroupKey, ...], float], list[int]] = {}
        for i, leaf in enumerate(leaves):
            groups = tuple(g for g in self.group_order if any(g == s for s, _ in leaf.shards))
            weight = 1.0 / sizes[leaf.tie_group] if leaf.tie_group is not None else 1.0
            buckets.setdefault((groups, weight), []).append(i)
        self._buckets = [_Bucket(groups, weight, tuple(idx)) for (groups, weight), idx in buckets.items()]
        # One reduction for the whole norm, when every sharded leaf lives on one mesh over all the ranks of
        # ``flat``: each bucket's part is divided by the number of ranks holding the same shard (its
        # replicas over the mesh dims it is not sharded on), so one sum over ``flat`` counts it once.
        self.flat: tuple[GroupKey, tuple[int, ...]] | None = None
        flat_ok = len(self.group_order) > 1 and pp_group is None  # one group is one collective either way
        if flat is not None and flat_ok and not any(leaf.tie_group is not None for leaf in leaves):
            ranks = comm.size(flat)
            replicas = []
            for b in self._buckets:
                shards = 1
                for g in b.groups:
                    shards *= comm.size(g)
                replicas.append(ranks // shards if ranks % shards == 0 else 0)
            if all(replicas):
                self.flat = (flat, tuple(replicas))

        tied: dict[GroupKey, list[int]] = {}
        for i, leaf in enumerate(leaves):
            if leaf.tie_group is not None:
                tied.setdefault(leaf.tie_group, []).append(i)
        self.tied: dict[GroupKey, tuple[int, ...]] = {g: tuple(idx) for g, idx in tied.items()}

    @property
    def tied_paths(self) -> list[str]:
        """The dotted paths of the tied leaves (``tied=``), in flatten order."""
        return [self._leaves[i].path for idx in self.tied.values() for i in idx]

    def __len__(self) -> int:
        return len(self._leaves)

    @property
    def paths(self) -> list[str]:
        """The dotted path of every leaf, in flatten order."""
        return [leaf.path for leaf in self._leaves]

    def leaf(self, index: int) -> _Leaf:
        """What the plan knows of leaf ``index``: path, global shape, placements, the groups it is summed over
        (with the tensor dim each splits), and its tie group."""
        return self._leaves[index]

    def weight_of(self, index: int) -> float:
        """The factor leaf ``index``'s p-th power carries in the norm: ``1 / copies`` for a tied leaf, else 1."""
        return next(b.weight for b in self._buckets if index in b.leaves)

    def groups_of(self, index: int) -> tuple[GroupKey, ...]:
        """The groups leaf ``index``'s norm is summed over (its sharded mesh dims and declared groups)."""
        return tuple(g for g, _ in self._leaves[index].shards)

    def num_collectives(self) -> int:
        """How many collectives :meth:`global_norm` issues per call: one per group, plus one for ``pp_group``.

        One in all for a plan inferred from DTensors on one mesh over the world (see :func:`gradtx.global_norm`).
        """
        return 1 if self.flat is not None else len(self.group_order) + (self.pp_group is not None)

    def __repr__(self) -> str:
        buckets = ", ".join(
            f"{list(b.groups)}x{len(b.leaves)}" + (f"/w={b.weight:g}" if b.weight != 1 else "") for b in self._buckets
        )
        plain = f", plain={self.plain!r}" if self.plain is not None else ""
        return f"MeshGroups({len(self)} leaves, buckets=[{buckets}], pp_group={self.pp_group!r}{plain})"

    # --- checks -------------------------------------------------------------------------

    def check(self, leaves: Sequence[Any], *, what: str) -> None:
        """Raise ``ValueError`` naming the first leaf that does not match the plan (count, shape, placements)."""
        if len(leaves) != len(self._leaves):
            raise ValueError(
                f"{what}: the mesh_groups plan was built for {len(self._leaves)} leaves, got {len(leaves)}; "
                "build the plan from the same params tree the transform sees"
            )
        for leaf, info in zip(leaves, self._leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"{what}: leaf at {info.path} is a {type(leaf).__name__}, not a torch.Tensor")
            if leaf.shape != info.shape:
                raise ValueError(
                    f"{what}: leaf at {info.path} has shape {tuple(leaf.shape)}, the mesh_groups plan has "
                    f"{tuple(info.shape)}; build the plan from the same params tree the transform sees"
                )
            is_dtensor = DTensor is not None and isinstance(leaf, DTensor)
            if is_dtensor != (info.placements is not None):
                kind = "a DTensor" if is_dtensor else "a plain tensor"
                raise ValueError(f"{what}: leaf at {info.path} is {kind}, but the mesh_groups plan says otherwise")
            if is_dtensor and cast(DTensor, leaf)._spec.placements != info.placements:
                placements = cast(DTensor, leaf)._spec.placements
                if any(p.is_partial() for p in placements):
                    raise ValueError(
                        f"{what}: leaf at {info.path} has Partial placements {placements}; a norm of a pending "
                        "sum is not the sum of norms, so reduce it first (e.g. grad.redistribute(placements="
                        f"{info.placements})) or let the parallelism wrapper reduce it"
                    )
                raise ValueError(
                    f"{what}: leaf at {info.path} has placements {placements}, the mesh_groups plan was built "
                    f"for {info.placements}; rebuild the plan after re-sharding"
                )

    # --- the global norm ----------------------------------------------------------------

    def global_norm(self, leaves: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm of the whole (unsharded, un-pipelined) model's grads, as every rank sees it.

        Local fp32 foreach norms of each leaf's local shard, combined into one
        p-th-power partial per bucket (leaves that share the same groups),
        then one all-reduce per group over the partials of every bucket that
        needs it (SUM, or MAX for ``inf``), then one over ``pp_group``; or,
        for a plan inferred on one mesh over the world (:attr:`flat`), one
        all-reduce in all (see :meth:`num_collectives`).

        Args:
          leaves: the grads, in the plan's leaf order (DTensors or plain tensors).
          norm_type: any ``p > 0`` or ``inf``.

        Returns:
          A 0-d fp32 tensor, equal on every rank; no host sync.
        """
        self.check(leaves, what="mesh_groups.global_norm")
        norm_type = check.norm_type(norm_type, name="mesh_groups.global_norm")
        from gradtx.distributed.global_norm import plan_norm  # the norm sits above the plan

        return plan_norm(self, leaves, norm_type)

    # --- unit-wise norms (AGC) ----------------------------------------------------------

    def unit_groups(self, index: int, *, unitwise: bool) -> tuple[GroupKey, ...]:
        """The groups a unit of leaf ``index`` spans: where a dim other than dim 0 (the output unit) is split.

        A 0-d or 1-d leaf, or any leaf when ``unitwise`` is False, is one
        unit, which spans every group the leaf is sharded over.
        """
        leaf = self._leaves[index]
        if leaf.ndim <= 1 or not unitwise:
            return tuple(g for g, _ in leaf.shards)
        out = []
        for group, dim in leaf.shards:
            if dim is None:
                raise ValueError(
                    f"adaptive_clip: leaf at {leaf.path} is declared sharded over {group!r} with no dim; "
                    "declare it as gradtx.Sharded(group, dim=...) so AGC knows whether its units are local"
                )
            if dim % leaf.ndim != 0:
                out.append(group)
        return tuple(out)

    def unitwise_norms(self, trees: Sequence[Sequence[torch.Tensor]], *, unitwise: bool) -> list[list[torch.Tensor]]:
        """The fp32 L2 norm of each output unit of every leaf, for several aligned leaf lists at once.

        Units follow PyTorch layouts (dim 0 is the output unit; see
        :func:`gradtx.unitwise_norm`). Where a unit spans ranks (a weight
        split along dim 1, or a 1-d leaf split at all), the partial sums of
        squares are summed over those groups: one all-reduce per group for
        every leaf of every list, e.g. the grads and the weights of AGC together.

        Args:
          trees: lists of leaves in the plan's leaf order (e.g. ``[grads, params]``).
          unitwise: per output unit (True) or per whole tensor (False).

        Returns:
          For each list, the per-leaf norms, broadcastable to the leaf's local shard.
        """
        items: list[torch.Tensor] = []
        groups: list[tuple[GroupKey, ...]] = []
        where: list[tuple[int, int]] = []
        out: list[list[torch.Tensor]] = []
        for t, leaves in enumerate(trees):
            self.check(leaves, what="adaptive_clip")
            row: list[torch.Tensor] = []
            for i, leaf in enumerate(leaves):
                spans = self.unit_groups(i, unitwise=unitwise)
                x = norms.magnitudes(tu.local(leaf))
                one_unit = x.ndim <= 1 or not unitwise
                if not spans:  # the units are all local: the plain single-device formula
                    dims = None if one_unit else tuple(range(1, x.ndim))
                    row.append(torch.linalg.vector_norm(x, dim=dims, keepdim=not one_unit))
                    continue
                sq = x.square().sum() if one_unit else x.square().sum(dim=tuple(range(1, x.ndim)), keepdim=True)
                row.append(sq)
                items.append(sq)
                groups.append(spans)
                where.append((t, i))
            out.append(row)
        if any(t.dtype == torch.float64 for t in items):  # one dtype: one collective per group
            items = [t.to(torch.float64) for t in items]
        reduced = reduce_over_groups(self.comm, items, groups, self.group_order, ReduceOp.SUM)
        for (t, i), sq in zip(where, reduced):
            out[t][i] = sq.sqrt()
        return out


def _mesh_dim_key(mesh: Any, mesh_dim: int, comm: Comm) -> GroupKey:
    """The key of a mesh dim's group: its name when the comm names the same group so, else the group."""
    group = mesh.get_group(mesh_dim)
    names = mesh.mesh_dim_names
    if names is not None:
        try:
            if comm.group_id(names[mesh_dim]) == comm.group_id(group):
                return names[mesh_dim]  # readable in logs and in RecordingComm's calls
        except (ValueError, TypeError, KeyError):
            pass
    return group


def mesh_groups(
    params: PyTree,
    *,
    comm: Comm | None = None,
    sharded: Mapping[Matcher, ShardDecl] | None = None,
    pp_group: GroupKey | None = None,
    tied: Mapping[Matcher, GroupKey] | None = None,
    plain: str | None = None,
    device: torch.device | str | None = None,
) -> MeshGroups:
    """Plan, once, which process groups each grad's norm is reduced over, so the global norm is the single-device one.

    The rules (the argument is in ``docs/distributed.md``):

    * A DTensor leaf is reduced over each mesh dim where its placement is
      ``Shard`` or ``_StridedShard``; never over a ``Replicate`` dim, which holds
      copies (summing them would count the grad once per replica). Size-1
      dims are skipped.
    * A ``Partial`` placement is an error: the norm of a pending sum is not
      the sum of the parts' norms, so reduce such a grad first.
    * A plain tensor is counted once, on each rank, unless ``sharded``
      declares the groups it is split over. In a run of several processes
      that is right for replicas (DDP's layout) and wrong for a pipeline
      stage, which a plain tensor cannot tell apart: declare ``pp_group``
      (a stage), ``plain="replicated"`` (copies you keep in sync) or
      ``plain="local"`` (each rank's norm is its own). Undeclared, the plan
      checks once, with one small all-reduce when it is built, that the
      plain leaves hold the same values on every rank (DDP leaves its
      replicas bitwise equal), and raises ``ValueError`` on every rank where
      they differ. That check is a collective: every rank builds the plan.
    * ``pp_group`` adds the stages' contributions (MAX for ``inf``).
    * A leaf in ``tied`` is a copy of a weight held by every rank of its tie
      group (e.g. the embedding on the first stage and the LM head on the
      last); :func:`gradtx.pp_reduce` sums its grads over that group, and the
      norm counts it once.

    Args:
      params: the params tree the transforms will see (its leaf order and
        shapes are what the plan is bound to); DTensors and plain tensors.
      comm: the :class:`~gradtx.comm.Comm` that issues the reductions, e.g.
        ``TorchComm(mesh)``. Default: the process groups of the DTensors' own
        meshes (:func:`gradtx.comm.torch_dist.mesh_comm`), whose dim names
        are valid keys for ``sharded``, ``pp_group`` and ``tied``; without
        DTensors, the default group (``"world"``) or, in one process, a
        :class:`~gradtx.comm.LocalComm`.
      sharded: manual shards of plain tensors: ``{path_or_glob_or_predicate:
        group}``, where the value is a group key, a :class:`Sharded`, or a
        list of them. Paths are dotted (``"layers.0.wq"``; ``"0.3"`` in a list);
        a predicate gets ``(path, leaf)``.
      pp_group: the pipeline-parallel group, or ``None`` without pipelining.
      tied: ``{path_or_glob_or_predicate: tie_group}`` for leaves that are copies of
        one weight across stages.
      plain: what the plain-tensor leaves that ``sharded`` does not name are:
        ``"replicated"`` (the same on every rank: counted once) or ``"local"``
        (a norm per rank: nothing is reduced for them); ``None`` (default)
        checks that they are replicas, in a run of several processes. A
        pipeline stage is ``pp_group``, not ``plain``.
      device: where the norm lives on a rank with no params (an empty stage);
        default: the params' device, else CPU.

    Returns:
      A :class:`MeshGroups` plan, for ``clip_by_global_norm(..., mesh_groups=plan)``,
      ``adaptive_clip(..., mesh_groups=plan)`` and ``pp_reduce(plan)``.

    References:
      d9d, "Gradient Norm & Clipping" (the no-double-counting argument), 2025.

    Example:
      >>> mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
      >>> params = dict(model.named_parameters())  # TP + FSDP2 DTensors
      >>> plan = gtx.mesh_groups(params)  # the same plan clip_by_global_norm(1.0) infers by itself
      >>> stage_plan = gtx.mesh_groups(stage_params, pp_group="pp", tied={"emb.weight": "pp"})
      >>> own_plan = gtx.mesh_groups(params, plain="local")  # each rank clips by its own norm, on purpose
    """
    flat_paths, flat_leaves, _ = optree.tree_flatten_with_path(params)
    tu.check_tensors(flat_leaves, flat_paths, what="mesh_groups: params")
    comm = default_comm(flat_leaves) if comm is None else as_comm(comm, name="mesh_groups")
    return _build(
        [tu.dotted(p) for p in flat_paths],
        flat_leaves,
        comm,
        sharded=sharded,
        pp_group=pp_group,
        tied=tied,
        device=device,
        what="mesh_groups",
        plain=plain,
    )


def default_comm(leaves: Sequence[Any]) -> Comm:
    """The comm of the zero-configuration path: the DTensors' own meshes, else the world, else one process."""
    meshes = [t.device_mesh for t in leaves if DTensor is not None and isinstance(t, DTensor)]
    if meshes:
        from gradtx.comm.torch_dist import mesh_comm

        return mesh_comm(meshes)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from gradtx.comm.torch_dist import TorchComm

        return TorchComm()
    return LocalComm()


def _pipeline_dims(leaves: Sequence[Any]) -> list[str]:
    """Pipeline-looking dims (size > 1) of the root meshes of ``leaves``' DTensors."""
    found: list[str] = []
    for t in leaves:
        if DTensor is None or not isinstance(t, DTensor):
            continue
        root = t.device_mesh._get_root_mesh()
        for dim, name in enumerate(root.mesh_dim_names or ()):
            if name in PIPELINE_DIM_NAMES and root.size(dim) > 1 and name not in found:
                found.append(name)
    return found


def _build(
    dotted: list[str],
    flat_leaves: list[Any],
    comm: Comm,
    *,
    sharded: Mapping[Matcher, ShardDecl] | None,
    pp_group: GroupKey | None,
    tied: Mapping[Matcher, GroupKey] | None,
    device: torch.device | str | None,
    what: str,
    plain: str | None = None,
    flat: bool = False,
) -> MeshGroups:
    if plain is not None and (not isinstance(plain, str) or plain not in PLAIN_KINDS):
        raise ValueError(
            f"{what}: plain must be 'replicated' or 'local' (a pipeline stage is pp_group=...), got {plain!r}"
        )
    if plain == "local" and pp_group is not None:
        raise ValueError(
            f"{what}: plain='local' keeps each rank's norm its own, pp_group adds the stages' norms; pass one of them"
        )
    if pp_group is None:
        pipeline = _pipeline_dims(flat_leaves)
        if pipeline:
            raise ValueError(
                f"{what}: these DTensors live on a mesh with a pipeline dim {pipeline[0]!r}; a stage's norm "
                "must add the other stages', which placements cannot say. Declare it once: "
                f"plan = gtx.mesh_groups(params, pp_group={pipeline[0]!r}, tied={{...}}), then pass "
                "mesh_groups=plan (and gtx.pp_reduce(plan) for tied weights)"
            )
    leaf_kind = "params" if what == "mesh_groups" else "updates"
    sharded = dict(sharded or {})
    tied = dict(tied or {})
    for key in sharded:
        _check_matcher(key, arg="sharded")
    for key in tied:
        _check_matcher(key, arg="tied")

    seen: dict[Any, GroupKey] = {}

    def canonical(group: GroupKey) -> GroupKey:
        # Two keys for one process group (the string "tp" and the mesh's ProcessGroup, or two meshes'
        # groups over the same ranks) must share one collective, so each group is named by the first
        # key seen for it.
        return seen.setdefault(comm.group_id(group), group)

    used: set[int] = set()
    checked: set[GroupKey] = set()
    infos: list[_Leaf] = []
    for path, leaf in zip(dotted, flat_leaves):
        shards: list[tuple[GroupKey, int | None]] = []
        placements = None
        if DTensor is not None and isinstance(leaf, DTensor):
            placements = tuple(leaf.placements)
            mesh = leaf.device_mesh
            for mesh_dim, placement in enumerate(placements):
                if placement.is_partial():
                    raise ValueError(
                        f"{what}: {leaf_kind} leaf at {path} is Partial on mesh dim {mesh_dim}; a norm of a "
                        "pending sum is not the sum of norms, so reduce it first (redistribute to Replicate or Shard)"
                    )
                if _is_shard(placement) and mesh.size(mesh_dim) > 1:
                    group_key = canonical(_mesh_dim_key(mesh, mesh_dim, comm))
                    if group_key not in checked:  # a LocalComm here would silently drop the other shards
                        if comm.size(group_key) != mesh.size(mesh_dim):
                            raise ValueError(
                                f"{what}: leaf at {path} is sharded over a mesh dim of {mesh.size(mesh_dim)} "
                                f"ranks, but comm reports {comm.size(group_key)} for its group; pass a comm over the "
                                "same process groups, e.g. TorchComm(mesh)"
                            )
                        checked.add(group_key)
                    shards.append((group_key, placement.dim))
        for n, (key, decl) in enumerate(sharded.items()):
            if _match(key, path, leaf):
                used.add(n)
                for group, dim in _shard_decls(decl, where=f"sharded[{key!r}] (leaf {path})"):
                    if dim is not None and not -max(leaf.ndim, 1) <= dim < max(leaf.ndim, 1):
                        raise ValueError(
                            f"{what}: sharded[{key!r}]: dim {dim} is out of range for leaf {path} of shape {tuple(leaf.shape)}"
                        )
                    shards.append((canonical(group), dim))
        deduped: list[tuple[GroupKey, int | None]] = []
        for group, dim in shards:
            if any(group == g for g, _ in deduped):
                raise ValueError(f"{what}: leaf at {path} is sharded over group {group!r} twice")
            deduped.append((group, dim))
        tie_keys = [key for key in tied if _match(key, path, leaf)]
        if len(tie_keys) > 1:
            raise ValueError(f"{what}: leaf at {path} matches several tied keys: {tie_keys}")
        tie_group = canonical(tied[tie_keys[0]]) if tie_keys else None
        infos.append(_Leaf(path, leaf.shape, leaf.ndim, placements, tuple(deduped), tie_group))

    unused = [key for n, key in enumerate(sharded) if n not in used and isinstance(key, str)]
    unused += [
        key for key in tied if isinstance(key, str) and not any(_match(key, p, x) for p, x in zip(dotted, flat_leaves))
    ]
    if unused:
        example = ", ".join(repr(p) for p in dotted[:3])
        raise ValueError(f"{what}: keys {unused} match no leaf; paths look like {example or '(no leaves)'}")

    if device is None:
        device = tu.local(flat_leaves[0]).device if flat_leaves else torch.device("cpu")
    pp = canonical(pp_group) if pp_group is not None else None
    if pp is None and any(info.tie_group is not None for info in infos):
        raise ValueError(f"{what}: tied weights need pp_group, the group over which the stages' norms add up")
    undeclared = [leaf for leaf, info in zip(flat_leaves, infos) if info.placements is None and not info.shards]
    kind: str | None = None
    if undeclared:
        kind = "pipeline" if pp is not None else plain
        if kind is None:
            kind = "one process"
            if not isinstance(comm, LocalComm) and multi_process():
                given = "params" if what == "mesh_groups" else "grads"
                check_plain_replicas(undeclared, flat_leaves, what=what, leaf_kind=given)
                kind = "replicas"
    flat_group = _one_mesh_group(flat_leaves, comm) if flat and not sharded and pp is None else None
    return MeshGroups(comm, infos, pp, torch.device(device), plain=kind, flat=flat_group)


def _one_mesh_group(leaves: Sequence[Any], comm: Comm) -> GroupKey | None:
    """``"world"`` when every DTensor of ``leaves`` lives on one root mesh (or its sub-meshes) over the whole world.

    Then a norm's parts can be reduced in one collective. A leaf is sharded
    over some dims of the root and held alike by the ranks that differ only in
    the others (a leaf on a sub-mesh, as FSDP2 puts a layer norm on the ``dp``
    dim of a TP x FSDP mesh, is replicated over the dims it does not name,
    which the per-dim reductions assume too), so its replica count is known.
    Two root meshes, or a root smaller than the world, keep the per-dim
    reductions.
    """
    root = None
    for t in leaves:
        if DTensor is None or not isinstance(t, DTensor):
            continue
        r = t.device_mesh._get_root_mesh()
        # Equal meshes, not the same object: DTensor's sharding-propagation cache hands out specs that hold
        # an earlier, equal mesh (one built again, or in an earlier part of the program), so one model's grads
        # may name two root objects for one grid. Equal roots are the same ranks, dims and names, and the plan
        # cache keys plans by mesh equality too, so the choice must not depend on which object a grad holds.
        if root is not None and r != root:
            return None
        root = r
    if root is None or not multi_process() or root.size() != comm.size("world"):
        return None
    return "world"


_T = TypeVar("_T")


def reads_tied(tx: _T, mesh_groups: MeshGroups | None) -> _T:
    """``tx``, declared as reading a norm over ``mesh_groups``' tied weights when the plan has some; returns ``tx``.

    What every transform that takes ``mesh_groups=`` and computes a norm
    returns: :func:`gradtx.chain` then refuses it, when built, unless a
    :func:`gradtx.pp_reduce` of the same plan comes before it
    (:func:`gradtx.core.kinds.declare_ties`).
    """
    if mesh_groups is not None and mesh_groups.tied:
        kinds.declare_ties(tx, reads=(mesh_groups,))
    return tx


def check_plan(mesh_groups: Any, *, name: str, required: bool = False) -> None:
    """Raise ``TypeError`` unless ``mesh_groups`` is a plan from :func:`gradtx.mesh_groups` (or ``None``, unless ``required``).

    The one check of a ``mesh_groups=`` argument, for every transform that takes one.
    """
    if (mesh_groups is not None or required) and not isinstance(mesh_groups, MeshGroups):
        raise TypeError(
            f"{name}: mesh_groups must be a plan from gradtx.mesh_groups(...), got {type(mesh_groups).__name__}"
        )


# The plan read from placements and the norms that run on a plan live in gradtx.distributed.inferred;
# their old names here still resolve (and gradtx.plan, the flat path of this module, with them).
_MOVED = ("DEFAULT_CACHE", "PlanCache", "agree_finite", "global_norm", "infer_plan", "tree_norm", "tree_unitwise_norms")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from gradtx.distributed import inferred

        return getattr(inferred, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MOVED])
