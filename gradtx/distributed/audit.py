"""The norm audit: for every leaf, which mesh dims its norm is summed over, which are skipped, and its share.

A distributed global norm is a sum of p-th powers over the right groups; a
replicated dim summed counts a grad once per replica, a group left out drops
other ranks' parts, and neither shows in the number. :func:`norm_audit` prints
the plan behind the number, leaf by leaf, with each leaf's share of the total,
so a double count or a missing group can be read off a table. See
``docs/distributed.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import optree
import torch

from gradtx.comm.base import Comm, GroupKey, LocalComm, ReduceOp, reduce_over_groups
from gradtx.comm.local_ranks import per_rank, rank_values
from gradtx.core import norms
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import PyTree
from gradtx.distributed import plan as plans
from gradtx.distributed.global_norm import all_max, plan_of
from gradtx.distributed.plan import DTensor

Number = float | tuple[float, ...]


class AuditRow(NamedTuple):
    """One leaf of a :class:`NormAudit`.

    Attributes:
      path: the dotted path of the leaf.
      placements: the DTensor's placements with their mesh dim names; for a plain tensor ``"plain"``, followed
        under a plan or with ``check_replicas`` by what it is taken for: ``"plain (pipeline stage)"``,
        ``"plain (replicated)"`` or ``"plain (local)"`` (declared, or undeclared: each rank's own),
        ``"plain (sharded)"`` (``sharded=``), and with ``check_replicas`` ``"plain (replicas)"`` (equal on every
        rank) or ``"plain (differs across ranks)"`` (a pipeline stage that needs ``pp_group=``, or unsynced grads).
      local_numel: the elements this rank holds (per simulated rank, as a tuple, where they differ).
      global_numel: the elements of the whole (unsharded) tensor.
      summed: the groups (mesh dim names, or declared group keys) its p-th power is summed over.
      skipped: the mesh dims it is not summed over, and why (``"tp: replicated"``, ``"dp: size 1"``).
      tied: the tie group and the weight of this copy (``"pp: 1/2"``), or ``None``.
      pipeline: the pipeline group its stage's total is added over, or ``None``.
      share: its share of the total ``norm**p`` (of the max for ``p = inf``), in ``[0, 1]``; per rank where ranks differ.
    """

    path: str
    placements: str
    local_numel: int | tuple[int, ...]
    global_numel: int
    summed: tuple[str, ...]
    skipped: tuple[str, ...]
    tied: str | None
    pipeline: str | None
    share: Number


class NormAudit(NamedTuple):
    """What :func:`norm_audit` returns: a row per leaf, the norm, and how the plan was found; ``str()`` is a table.

    Attributes:
      rows: one :class:`AuditRow` per leaf, in flatten order.
      norm: the global norm (what ``gtx.global_norm`` gives with the same plan).
      norm_type: the norm's order.
      plan: where the plan came from: ``"declared"``, ``"placements"``, or ``"none"`` (local norm).
      collectives: the all-reduces one norm of this plan issues.
      notes: what the plan cannot know and assumed, and what ``check_replicas`` found.
      replicas: with ``check_replicas``, whether the undeclared plain tensors are equal on every rank; else ``None``.
    """

    rows: tuple[AuditRow, ...]
    norm: Number
    norm_type: float
    plan: str
    collectives: int
    notes: tuple[str, ...]
    replicas: bool | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, path: str) -> AuditRow:
        """The row of the leaf at ``path``."""
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(f"norm_audit: no leaf at {path!r}; paths are {[r.path for r in self.rows]}")

    def __str__(self) -> str:
        head = ("path", "placements", "local", "global", "summed over", "skipped", "tied / pp", "share")
        body = [
            (
                r.path,
                r.placements,
                _fmt(r.local_numel, "{:d}"),
                str(r.global_numel),
                ", ".join(r.summed) or "-",
                ", ".join(r.skipped) or "-",
                " / ".join(x for x in (r.tied, r.pipeline) if x) or "-",
                _fmt(r.share, "{:.1%}"),
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body]]
        p = "inf" if math.isinf(self.norm_type) else f"{self.norm_type:g}"
        lines.append(
            f"norm (p={p}) = {_fmt(self.norm, '{:.6g}')}; plan: {self.plan}; "
            f"{self.collectives} all-reduce{'s' if self.collectives != 1 else ''} per norm"
        )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt(value: Number | int, spec: str) -> str:
    if isinstance(value, tuple):
        return "[" + " ".join(spec.format(v) for v in value) + "] by rank"
    return spec.format(value)


def _values(t: torch.Tensor) -> Number:
    """A 0-d tensor as a float, or one float per simulated rank where they differ (a diagnostic: reads to the host)."""
    vals = tuple(rank_values(t))
    return vals[0] if all(v == vals[0] or (math.isnan(v) and math.isnan(vals[0])) for v in vals) else vals


@per_rank  # simulated ranks hold shards of different sizes
def _local_numel(local: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(local.numel()))


def _numel(x: torch.Tensor) -> int | tuple[int, ...]:
    counts = _values(_local_numel(tu.local(x)))
    return tuple(int(c) for c in counts) if isinstance(counts, tuple) else int(counts)


def _replicas_agree(plain: list[torch.Tensor], leaves: list[Any], comm: Comm | None, group: GroupKey) -> bool:
    """Whether the plain tensors ``plain`` hold the same values on every rank: one MAX all-reduce of a fingerprint.

    The fingerprint is the leaf count, the element count and the sums of the
    leaves' L1 and L2 norms, with its negation (``max == -max(-x)`` means every
    rank holds the same). Over ``comm``'s ``group``, else the DTensors' root
    meshes, else the world; read to the host. Every rank must call it.
    """
    device = tu.local(plain[0]).device if plain else torch.device("cpu")
    stats = [
        torch.tensor([float(len(plain)), float(sum(t.numel() for t in plain))], dtype=torch.float64, device=device)
    ]
    for p in (1.0, 2.0):  # per-leaf fp32 norms (no copy of a grad): replicas compute them bitwise alike
        per_leaf = norms.tensor_norms([t.detach() for t in plain], p)
        stats.append(norms.total(per_leaf, 1.0, device).to(torch.float64).reshape(1))
    # NaN compares unequal to itself and infinities overflow the negation's meaning: map both to numbers.
    fingerprint = torch.nan_to_num(torch.cat(stats), nan=-1.0, posinf=1e300, neginf=-1e300)
    both = torch.cat([fingerprint, -fingerprint])  # one process, nothing to compare with: equal to itself
    both = all_max(both, leaves, comm=comm, group=group, name="norm_audit", world=True)
    n = fingerprint.numel()
    return all(v == 1.0 for v in rank_values((both[:n] == -both[n:]).all().to(torch.float32)))


def _group_name(group: GroupKey, leaf: Any, comm: Any) -> str:
    if isinstance(group, str):
        return group
    if DTensor is not None and isinstance(leaf, DTensor):
        mesh = leaf.device_mesh
        for d, name in enumerate(mesh.mesh_dim_names or ()):
            if mesh.get_group(d) is group:
                return name
    ident = comm.group_id(group)
    return f"group{ident[1]}" if isinstance(ident, tuple) and len(ident) == 2 else repr(group)


def _placements(leaf: Any) -> tuple[str, tuple[str, ...]]:
    """The leaf's placements, named by mesh dim, and the mesh dims its norm is not summed over, with why."""
    if DTensor is None or not isinstance(leaf, DTensor):
        return "plain", ()
    mesh = leaf.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    shown, skipped = [], []
    for d, p in enumerate(leaf.placements):
        shown.append(f"{names[d]}={p}")
        if mesh.size(d) == 1:
            skipped.append(f"{names[d]}: size 1")
        elif not plans._is_shard(p):
            skipped.append(f"{names[d]}: {'replicated' if p.is_replicate() else p}")
    return "(" + ", ".join(shown) + ")", tuple(skipped)


def norm_audit(
    grads: PyTree,
    plan: plans.MeshGroups | None = None,
    *,
    norm_type: float = 2.0,
    check_replicas: bool = False,
    comm: Comm | None = None,
    group: GroupKey = "world",
) -> NormAudit:
    """How the global norm of ``grads`` is put together: per leaf, the groups summed and skipped, and its share.

    The plan is ``plan`` (a :func:`gradtx.mesh_groups` plan), else the one the DTensor placements define (what
    ``clip_by_global_norm(max_norm)`` uses with no plan), else none: the local norm. Run it where the transform
    runs: on every rank of a real run (it issues one all-reduce per group of the plan, for the per-leaf shares,
    plus the pipeline group's when declared), or on a simulated mesh (:func:`gradtx.testing.simulated_mesh`),
    where a value the ranks disagree on shows one entry per rank.

    A plain tensor carries no placement: on each rank it may be a replica (DDP), a pipeline stage's own
    weight, or a grad nobody synced, and gradtx's norms take each rank's own, as torch does. The pipeline
    trap is the second: a stage's clip that ignores the other stages (declare ``pp_group``). With
    ``check_replicas=True`` the audit asks, with one collective you name here, whether the undeclared plain
    tensors are equal on every rank (DDP leaves its replicas bitwise equal), and says so in ``replicas``.

    Args:
      grads: the grads tree (DTensors and plain tensors).
      plan: a declared plan, or ``None`` to read the placements.
      norm_type: any ``p > 0`` or ``inf``.
      check_replicas: compare the undeclared plain tensors across ranks (one MAX all-reduce of a fingerprint,
        read to the host; every rank must call it).
      comm: the :class:`~gradtx.comm.Comm` that compares them, over ``group``; default the DTensors' root
        meshes, else the world.
      group: the group of ``comm`` to compare over.

    Returns:
      A :class:`NormAudit`; ``print(audit)`` shows the table.

    References:
      d9d, "Gradient Norm & Clipping" (the no-double-counting argument), 2025.

    Example:
      >>> audit = gtx.norm_audit(grads)            # on every rank (or on a simulated mesh)
      >>> print(audit)                             # path, placements, summed over, skipped, share
      >>> assert audit.row("tok_emb.weight").summed == ("dp",)
    """
    norm_type = check.norm_type(norm_type, name="norm_audit")
    paths, leaves, _ = optree.tree_flatten_with_path(grads)
    tu.check_tensors(leaves, paths, what="norm_audit: grads")
    dotted = [tu.dotted(p) for p in paths]
    source = "declared" if plan is not None else "placements"
    plan = plan_of(leaves, plan, None, "norm_audit", grads)  # a declared plan is checked against the grads
    plain_as = ""
    if plan is None:  # each rank's local norm: a plan with no groups, whose comm is never asked
        source, plain_as = "none (local norm)", "plain"
        plan = plans._build(list(paths), leaves, LocalComm(), what="norm_audit")
    notes: list[str] = []
    same: bool | None = None
    if check.flag(check_replicas, arg="check_replicas", name="norm_audit"):
        undeclared = [x for i, x in enumerate(leaves) if not isinstance(x, DTensor) and not plan.leaf(i).shards]
        same = _replicas_agree(undeclared, leaves, comm, group)  # issued on every rank alike, plain tensors or not
        if not undeclared:
            notes.append("check_replicas: no plain tensors here, so nothing to compare across ranks")
        elif same:
            plain_as = "plain (replicas)"
            notes.append("plain tensors equal on every rank: replicas (DDP's layout), each rank's norm is the model's")
        else:
            plain_as = "plain (differs across ranks)"
            notes.append(
                "plain tensors that differ across ranks: each rank's norm is its own. A pipeline stage needs "
                "mesh_groups(params, pp_group=...); unsynced data-parallel grads need their all-reduce first"
            )
    inf = math.isinf(norm_type)
    device = tu.local(leaves[0]).device if leaves else plan.device
    values = [v.to(device) for v in norms.tensor_powsums(leaves, norm_type)]  # as the plan's norm adds them
    groups = [plan.groups_of(i) for i in range(len(leaves))]
    op = ReduceOp.MAX if inf else ReduceOp.SUM
    reduced = reduce_over_groups(plan.comm, values, groups, plan.group_order, op)
    stage = [r if inf else r * plan.weight_of(i) for i, r in enumerate(reduced)]
    total = norms.total(stage, norm_type, device)
    if plan.pp_group is not None:
        (total,) = plan.comm.all_reduce([total], op, plan.pp_group)
    rows = []
    for i, leaf in enumerate(leaves):
        info = plan.leaf(i)
        tied = None
        if info.tie_group is not None:
            tied = f"{_group_name(info.tie_group, leaf, plan.comm)}: 1/{round(1 / plan.weight_of(i))}"
        pp = _group_name(plan.pp_group, leaf, plan.comm) if plan.pp_group is not None else None
        summed = tuple(_group_name(g, leaf, plan.comm) for g in groups[i])
        shown, skipped = _placements(leaf)
        if shown == "plain":
            shown = "plain (sharded)" if info.shards else plain_as or _PLAIN_AS.get(plan.plain or "", "plain")
        share = stage[i] / total.clamp_min(torch.finfo(total.dtype).tiny)
        rows.append(
            AuditRow(dotted[i], shown, _numel(leaf), int(leaf.numel()), summed, skipped, tied, pp, _values(share))
        )
    norm = norms.power_to_norm(total, norm_type)
    if isinstance(_values(norm), tuple):  # per-rank shares alone are a pipeline's stages, not a disagreement
        notes.append("the ranks disagree on some values (shown per rank): this norm is not the same on every rank")
    return NormAudit(tuple(rows), _values(norm), norm_type, source, plan.num_collectives(), tuple(notes), same)


_PLAIN_AS = {"pipeline": "plain (pipeline stage)", "replicated": "plain (replicated)", "local": "plain (local)"}
