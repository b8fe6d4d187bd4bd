"""The norm plan: which process groups each grad's norm is reduced over (see ``docs/distributed.md``).

On DTensors the placements *are* the plan: a grad's p-th power is summed over each mesh dim where it
is ``Shard``/``_StridedShard``, never over a ``Replicate`` dim. What placements cannot say (plain
tensors sharded by hand, the pipeline group, tied weights) is declared with :func:`mesh_groups`, as
torchtitan's clip is passed ``pp_mesh``. An undeclared plain tensor is each rank's own (no collective).
A plan belongs to the user, or to a transform's :class:`~gradtx.distributed.global_norm.PlanSlot`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple, TypeGuard

import optree
import torch

from gradtx.comm.base import Comm, GroupKey, LocalComm, as_comm
from gradtx.core import tree as tu
from gradtx.core.base import PyTree

try:  # DTensor is optional: a CPU-only or old build may lack torch.distributed.
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    DTensor = Shard = None  # type: ignore[assignment,misc]
try:  # FSDP2 over TP shards dim 0 twice; the second split is a _StridedShard (private, so guarded).
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None  # type: ignore[assignment,misc]

# Mesh dim names read as a pipeline dim: stages hold different weights, which placements cannot say.
_PP_NAMES = ("pp", "pipeline", "pipe")


class Sharded(NamedTuple):
    """A manual shard declaration for :func:`mesh_groups`: a plain tensor split over ``group``.

    Attributes:
      group: the group key (a mesh dim name, a ``ProcessGroup``, ...) whose ranks each hold a piece.
      dim: the tensor dim that is split; :func:`gradtx.adaptive_clip` needs it, the global norm does not.
    """

    group: GroupKey
    dim: int | None = None


Matcher = str | Callable[[str, torch.Tensor], bool]
ShardDecl = GroupKey | Sharded | Sequence[GroupKey | Sharded]


class _Leaf(NamedTuple):
    path: str  # dotted, for matching and the audit: "layers.0.attn.wq.weight"
    shape: torch.Size  # global (logical) shape
    placements: tuple[Any, ...] | None  # None for a plain tensor
    shards: tuple[tuple[GroupKey, int | None], ...]  # (group, tensor dim split over it), no duplicates
    tie_group: GroupKey | None
    where: str  # the path as errors write it: "['layers'][0]['wq']"


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
        # "replicated" or "local" (declared), "local" (undeclared), or None when there are none.
        self.plain = plain
        # The one order every rank reduces in: first appearance in the params, the same on every member
        # of a group because its members hold the same part of the model.
        self.group_order: tuple[GroupKey, ...] = tuple(dict.fromkeys(g for leaf in leaves for g, _ in leaf.shards))
        sizes = {leaf.tie_group: comm.size(leaf.tie_group) for leaf in leaves if leaf.tie_group is not None}
        buckets: dict[tuple[tuple[GroupKey, ...], float], list[int]] = {}
        tied: dict[GroupKey, list[int]] = {}
        for i, leaf in enumerate(leaves):
            groups = tuple(g for g in self.group_order if any(g == s for s, _ in leaf.shards))
            weight = 1.0 / sizes[leaf.tie_group] if leaf.tie_group is not None else 1.0
            buckets.setdefault((groups, weight), []).append(i)
            if leaf.tie_group is not None:
                tied.setdefault(leaf.tie_group, []).append(i)
        self.tied: dict[GroupKey, tuple[int, ...]] = {g: tuple(idx) for g, idx in tied.items()}
        self._buckets = [_Bucket(groups, weight, tuple(idx)) for (groups, weight), idx in buckets.items()]
        # One reduction for the whole norm (one per mesh, not per mesh dim), when every sharded leaf lives on
        # one mesh over all the ranks of ``flat``: each bucket's part is divided by the number of ranks holding
        # the same shard (its replicas over the dims it is not sharded on), so one sum over ``flat`` counts it once.
        self.flat: tuple[GroupKey, tuple[int, ...]] | None = None
        self._columns: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        if flat is not None and len(self.group_order) > 1 and pp_group is None and not sizes:
            ranks = comm.size(flat)
            spans = [math.prod([comm.size(g) for g in b.groups]) for b in self._buckets]  # (a list: dynamo's prod)
            if all(ranks % span == 0 for span in spans):
                self.flat = (flat, tuple(ranks // span for span in spans))

    def columns(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each leaf's p-th power is summed, as ``(mask, weights)`` of shape ``(leaves, columns)``.

        A column per bucket, its leaves weighted as tied copies; under :attr:`flat`, one column for the
        sharded leaves (each divided by its replicas) and one for the plain ones. Made once per device.
        """
        key = (device, dtype)
        if key not in self._columns or torch.compiler.is_compiling():
            if self.flat is None:
                targets = [(j, b.weight) for j, b in enumerate(self._buckets)]
            else:
                targets = [
                    (0, b.weight / r) if b.groups else (1, b.weight) for b, r in zip(self._buckets, self.flat[1])
                ]
            shape = (len(self._leaves), len(self._buckets) if self.flat is None else 2)
            weights = torch.zeros(shape, dtype=dtype, device=device)
            for b, (j, w) in zip(self._buckets, targets):
                weights[list(b.leaves), j] = w
            self._columns[key] = (weights > 0, weights)  # every weight is positive: 1 / copies / replicas
        return self._columns[key]

    def __len__(self) -> int:
        return len(self._leaves)

    @property
    def paths(self) -> list[str]:
        """The dotted path of every leaf, in flatten order."""
        return [leaf.path for leaf in self._leaves]

    def leaf(self, index: int) -> _Leaf:
        """What the plan knows of leaf ``index``: path, global shape, placements, groups (and dims), tie group."""
        return self._leaves[index]

    def weight_of(self, index: int) -> float:
        """The factor leaf ``index``'s p-th power carries in the norm: ``1 / copies`` for a tied leaf, else 1."""
        return next(b.weight for b in self._buckets if index in b.leaves)

    def groups_of(self, index: int) -> tuple[GroupKey, ...]:
        """The groups leaf ``index``'s norm is summed over (its sharded mesh dims and declared groups)."""
        return tuple(g for g, _ in self._leaves[index].shards)

    def num_collectives(self) -> int:
        """The collectives a norm on this plan issues: one per group and one for ``pp_group``, or one under :attr:`flat`."""
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
                "build the plan from the same params tree the transform sees (a None leaf, a param without a "
                "grad, is not one: give zeros in its place, or the params to a transform's update)"
            )
        for leaf, info in zip(leaves, self._leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"{what}: leaf at {info.where} is a {type(leaf).__name__}, not a torch.Tensor")
            if leaf.shape != info.shape:
                raise ValueError(
                    f"{what}: leaf at {info.where} has shape {tuple(leaf.shape)}, the mesh_groups plan has "
                    f"{tuple(info.shape)}; build the plan from the same params tree the transform sees"
                )
            is_dtensor = DTensor is not None and isinstance(leaf, DTensor)
            if is_dtensor != (info.placements is not None):
                kind = "a DTensor" if is_dtensor else "a plain tensor"
                raise ValueError(f"{what}: leaf at {info.where} is {kind}, but the mesh_groups plan says otherwise")
            if is_dtensor and leaf.placements != info.placements:  # type: ignore[attr-defined]
                placements = leaf.placements  # type: ignore[attr-defined]
                if any(p.is_partial() for p in placements):
                    raise ValueError(
                        f"{what}: leaf at {info.where} has Partial placements {placements}; a norm of a pending "
                        "sum is not the sum of norms, so reduce it first (e.g. grad.redistribute(placements="
                        f"{info.placements})) or let the parallelism wrapper reduce it"
                    )
                raise ValueError(
                    f"{what}: leaf at {info.where} has placements {placements}, the mesh_groups plan was built "
                    f"for {info.placements}; rebuild the plan after re-sharding"
                )

    def unit_groups(self, index: int, *, unitwise: bool) -> tuple[GroupKey, ...]:
        """The groups a unit of leaf ``index`` spans: where a dim other than dim 0 (the output unit) is split.

        A 0-d or 1-d leaf, or any leaf when ``unitwise`` is False, is one
        unit, which spans every group the leaf is sharded over.
        """
        leaf = self._leaves[index]
        if len(leaf.shape) <= 1 or not unitwise:
            return tuple(g for g, _ in leaf.shards)
        out = []
        for group, dim in leaf.shards:
            if dim is None:
                raise ValueError(
                    f"adaptive_clip: leaf at {leaf.where} is declared sharded over {group!r} with no dim; "
                    "declare it as gradtx.Sharded(group, dim=...) so AGC knows whether its units are local"
                )
            if dim % len(leaf.shape) != 0:
                out.append(group)
        return tuple(out)


def _mesh_dim_key(mesh: Any, mesh_dim: int, comm: Comm) -> GroupKey:
    """The key of a mesh dim's group: its name when the comm names the same group so, else the group."""
    group = mesh.get_group(mesh_dim)
    names = mesh.mesh_dim_names
    if names is not None:
        with contextlib.suppress(ValueError, TypeError, KeyError):  # a name the comm does not know
            if comm.group_id(names[mesh_dim]) == comm.group_id(group):
                return names[mesh_dim]  # readable in logs and in RecordingComm's calls
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

    * A DTensor leaf is reduced over each mesh dim (of size > 1) where it is ``Shard``
      or ``_StridedShard``, never over a ``Replicate`` dim (copies would count once per
      replica); ``Partial`` is an error (the norm of a pending sum is no sum of norms).
    * DTensors on a mesh with a pipeline dim (``"pp"``, ``"pipeline"``, ``"pipe"``) need ``pp_group``.
    * A plain tensor is counted once on each rank, with no collective, unless
      ``sharded`` declares its groups: torch's semantics, right for DDP's
      replicas, wrong for a pipeline stage (declare ``pp_group``);
      ``gtx.norm_audit(grads, check_replicas=True)`` checks which.
    * ``pp_group`` adds the stages' contributions (MAX for ``inf``).
    * A leaf in ``tied`` is a copy of a weight held by every rank of its tie group
      (embedding and LM head); :func:`gradtx.pp_reduce` sums it, the norm counts it once.

    Args:
      params: the params tree the transforms will see (its leaf order and
        shapes are what the plan is bound to); DTensors and plain tensors.
      comm: the :class:`~gradtx.comm.Comm` that issues the reductions, e.g.
        ``TorchComm(mesh)``. Default: the process groups of the DTensors' own
        meshes (:func:`gradtx.comm.torch_dist.mesh_comm`), whose dim names
        are valid keys for ``sharded``, ``pp_group`` and ``tied``; without
        DTensors, the default group (``"world"``) when ``torch.distributed``
        is initialised, else a :class:`~gradtx.comm.LocalComm`.
      sharded: manual shards of plain tensors: ``{path_or_glob_or_predicate:
        group}``, where the value is a group key, a :class:`Sharded`, or a
        list of them. Paths are dotted (``"layers.0.wq"``; ``"0.3"`` in a list);
        a predicate gets ``(path, leaf)``.
      pp_group: the pipeline-parallel group, or ``None`` without pipelining.
      tied: ``{path_or_glob_or_predicate: tie_group}`` for leaves that are copies of
        one weight across stages.
      plain: a label for the plain-tensor leaves that ``sharded`` does not
        name, shown by :func:`gradtx.norm_audit`: ``"replicated"`` (copies you
        keep in sync) or ``"local"`` (each rank's own). Either way, as
        undeclared, each is counted once on each rank. A pipeline stage is
        ``pp_group``, not ``plain``.
      device: where the norm lives on a rank with no params (an empty stage);
        default: the params' device, else CPU.

    Returns:
      A :class:`MeshGroups` plan, for ``clip_by_global_norm(..., mesh_groups=plan)``,
      ``adaptive_clip(..., mesh_groups=plan)`` and ``pp_reduce(plan)``.

    References:
      d9d, "Gradient Norm & Clipping" (the no-double-counting argument), 2025.

    Example:
      >>> plan = gtx.mesh_groups(stage_params, pp_group="pp", tied={"emb.weight": "pp"})
    """
    flat_paths, flat_leaves, _ = optree.tree_flatten_with_path(params)
    tu.check_tensors(flat_leaves, flat_paths, what="mesh_groups: params")
    comm = default_comm(flat_leaves) if comm is None else as_comm(comm, name="mesh_groups")
    return _build(
        list(flat_paths), flat_leaves, comm, sharded=sharded, pp_group=pp_group, tied=tied, device=device, plain=plain
    )


def _build(
    paths: list[tuple[Any, ...]],
    flat_leaves: list[Any],
    comm: Comm,
    *,
    sharded: Mapping[Matcher, ShardDecl] | None = None,
    pp_group: GroupKey | None = None,
    tied: Mapping[Matcher, GroupKey] | None = None,
    device: torch.device | str | None = None,
    what: str = "mesh_groups",
    plain: str | None = None,
    flat: GroupKey | None = None,
) -> MeshGroups:
    # plain: a label for the undeclared plain leaves, shown by norm_audit; they are counted alike.
    if plain is not None and (not isinstance(plain, str) or plain not in ("replicated", "local")):
        raise ValueError(
            f"{what}: plain must be 'replicated' or 'local' (a pipeline stage is pp_group=...), got {plain!r}"
        )
    if plain == "local" and pp_group is not None:
        raise ValueError(
            f"{what}: plain='local' keeps each rank's norm its own, pp_group adds the stages' norms; pass one of them"
        )
    roots = tu.root_meshes(flat_leaves) if pp_group is None else []
    pipeline = [n for r in roots for d, n in enumerate(r.mesh_dim_names or ()) if n in _PP_NAMES and r.size(d) > 1]
    if pipeline:
        raise ValueError(
            f"{what}: these DTensors live on a mesh with a pipeline dim {pipeline[0]!r}; a stage's norm must add "
            "the other stages', which placements cannot say. Declare it once: plan = gtx.mesh_groups(params, "
            f"pp_group={pipeline[0]!r}, tied={{...}}), then pass mesh_groups=plan (and gtx.pp_reduce(plan) for "
            "tied weights)"
        )
    leaf_kind = "params" if what == "mesh_groups" else "updates"
    for arg, value in (("sharded", sharded), ("tied", tied)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(
                f"{what}: {arg} must be a dict {{path_or_glob_or_predicate: group}}, got {type(value).__name__}"
            )
        for key in value or {}:
            if not (isinstance(key, str) or callable(key)):
                raise TypeError(
                    f"mesh_groups: {arg} keys must be a dotted path, a glob, or a predicate (path, leaf) -> bool; "
                    f"got {type(key).__name__}"
                )
    sharded = dict(sharded or {})
    tied = dict(tied or {})

    dotted = [tu.dotted(p) for p in paths]
    seen: dict[Any, GroupKey] = {}

    def canonical(group: GroupKey, arg: str) -> GroupKey:
        # Two keys for one process group (the string "tp" and the mesh's ProcessGroup, or two meshes'
        # groups over the same ranks) must share one collective, so each group is named by the first
        # key seen for it.
        try:  # (a misspelt key, or one that is no key at all: say which argument gave it)
            return seen.setdefault(comm.group_id(group), group)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{what}: {arg} names group {group!r}, which the comm does not know: {e}") from None

    matched: set[Any] = set()  # the keys of sharded and tied that name a leaf
    infos: list[_Leaf] = []
    for path, where, leaf in zip(dotted, map(tu.path_str, paths), flat_leaves):
        shards: list[tuple[GroupKey, int | None]] = []
        placements = None
        if DTensor is not None and isinstance(leaf, DTensor):
            placements = tuple(leaf.placements)
            mesh = leaf.device_mesh
            for mesh_dim, placement in enumerate(placements):
                if placement.is_partial():
                    raise ValueError(
                        f"{what}: {leaf_kind} leaf at {where} is Partial on mesh dim {mesh_dim}; a norm of a "
                        "pending sum is not the sum of norms, so reduce it first (redistribute to Replicate or Shard)"
                    )
                if _is_shard(placement) and mesh.size(mesh_dim) > 1:
                    group_key = canonical(_mesh_dim_key(mesh, mesh_dim, comm), f"leaf at {where}")
                    if comm.size(group_key) != mesh.size(mesh_dim):  # a LocalComm would drop the other shards
                        raise ValueError(
                            f"{what}: leaf at {where} is sharded over a mesh dim of {mesh.size(mesh_dim)} "
                            f"ranks, but comm reports {comm.size(group_key)} for its group; pass a comm over the "
                            "same process groups, e.g. TorchComm(mesh)"
                        )
                    shards.append((group_key, placement.dim))
        for key, decl in sharded.items():
            if _match(key, path, leaf):
                matched.add(key)
                for group, dim in _shard_decls(decl, where=f"sharded[{key!r}] (leaf {where})"):
                    if dim is not None and not -max(leaf.ndim, 1) <= dim < max(leaf.ndim, 1):
                        raise ValueError(
                            f"{what}: sharded[{key!r}]: dim {dim} is out of range for leaf {where} of shape {tuple(leaf.shape)}"
                        )
                    group = canonical(group, f"sharded[{key!r}]")
                    if any(group == g for g, _ in shards):  # (a mesh dim, or a declaration before this one)
                        raise ValueError(f"{what}: leaf at {where} is sharded over group {group!r} twice")
                    shards.append((group, dim))
        tie_keys = [key for key in tied if _match(key, path, leaf)]
        matched.update(tie_keys)
        if len(tie_keys) > 1:
            raise ValueError(f"{what}: leaf at {where} matches several tied keys: {tie_keys}")
        tie_group = canonical(tied[tie_keys[0]], f"tied[{tie_keys[0]!r}]") if tie_keys else None
        infos.append(_Leaf(path, leaf.shape, placements, tuple(shards), tie_group, where))

    unused = [key for key in [*sharded, *tied] if isinstance(key, str) and key not in matched]
    if unused:
        example = ", ".join(repr(p) for p in dotted[:3])
        raise ValueError(f"{what}: keys {unused} match no leaf; paths look like {example or '(no leaves)'}")

    if device is None:
        device = tu.local(flat_leaves[0]).device if flat_leaves else torch.device("cpu")
    pp = canonical(pp_group, "pp_group") if pp_group is not None else None
    if pp is None and any(info.tie_group is not None for info in infos):
        raise ValueError(f"{what}: tied weights need pp_group, the group over which the stages' norms add up")
    undeclared = any(info.placements is None and not info.shards for info in infos)
    kind = ("pipeline" if pp is not None else plain or "local") if undeclared else None
    return MeshGroups(comm, infos, pp, torch.device(device), plain=kind, flat=flat)


def default_comm(leaves: Sequence[Any]) -> Comm:
    """The comm a plan with no ``comm=`` reduces with: the DTensors' own meshes, else the world, else one process."""
    meshes = [t.device_mesh for t in leaves if DTensor is not None and isinstance(t, DTensor)]
    if meshes:
        from gradtx.comm.torch_dist import mesh_comm

        return mesh_comm(meshes)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from gradtx.comm.torch_dist import TorchComm

        return TorchComm()
    return LocalComm()


NO_PLAN = object()  # what plan_read_by says of a transform that computes no norm


def reads_plan(tx: Any, mesh_groups: Any) -> Any:
    """``tx``, marked as computing a norm over ``mesh_groups`` (``None``: its grads' placements); returns ``tx``.

    What :func:`gradtx.distributed.pipeline.check_chain` reads when a chain is
    built; a wrapper transform passes on what its inner one reads with
    ``reads_plan(outer, plan_read_by(inner))``.
    """
    if mesh_groups is not NO_PLAN and hasattr(tx, "__dict__"):
        vars(tx)["norm_plan"] = mesh_groups
    return tx


def reads_tied(tx: Any, mesh_groups: MeshGroups | None) -> Any:
    """``tx``, marked as computing a norm over ``mesh_groups`` when it is a plan (what transforms called before)."""
    return reads_plan(tx, NO_PLAN if mesh_groups is None else mesh_groups)


def plan_read_by(tx: Any) -> Any:
    """The plan ``tx`` computes a norm over (see :func:`reads_plan`): a plan, ``None``, or :data:`NO_PLAN`."""
    return getattr(tx, "__dict__", {}).get("norm_plan", NO_PLAN)


def check_plan(mesh_groups: Any, *, name: str, required: bool = False) -> None:
    """Raise ``TypeError`` unless ``mesh_groups`` is a plan from :func:`gradtx.mesh_groups` (or ``None``, unless ``required``)."""
    if (mesh_groups is not None or required) and not isinstance(mesh_groups, MeshGroups):
        raise TypeError(
            f"{name}: mesh_groups must be a plan from gradtx.mesh_groups(...), got {type(mesh_groups).__name__}"
        )
