"""Muon on sharded matrices: owners, the bucketed all-to-all exchange, and the per-step orthogonalizer.

A leaf sharded across its matrix axes is gathered to one owner rank, orthogonalized
there once and scattered back (see ``gradtx.optimizers.muon``); every collective
goes through the :class:`~gradtx.comm.ExchangeComm` it is given.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch

from gradtx.comm.base import ExchangeComm, check_exchange_comm
from gradtx.comm.local import LocalComm
from gradtx.core import tree as tu
from gradtx.core.base import PyTree
from gradtx.optimizers.muon.iteration import (
    MuonDimensionNumbers,
    Scalar,
    _Layout,
    _layout,
    _ns_flops,
    _orthogonalize_full,
    _orthogonalize_stacked,
    _resolve_dims,
    _stack_key,
)

try:  # DTensor is optional: a CPU-only or old build may lack torch.distributed.
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = Partial = Replicate = Shard = None  # type: ignore[assignment,misc]
try:  # FSDP2 over TP shards dim 0 twice; the second split is a _StridedShard (private, so guarded).
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None  # type: ignore[assignment,misc]


# --- sharded leaves: placements, owners and the exchange ---------------------------------------


def _is_shard(p: Any) -> bool:
    return (Shard is not None and isinstance(p, Shard)) or (_StridedShard is not None and isinstance(p, _StridedShard))


def _check_shard_order(x: Any, *, where: str) -> None:
    spec = x._spec
    if getattr(spec, "use_strided_shard_as_shard_order", True) is False:
        default = type(spec).compute_default_shard_order(spec.placements)
        if spec.shard_order != default:
            raise ValueError(f"muon: the DTensor at {where} has a non-default shard_order; redistribute it first")


class _Piece(NamedTuple):
    """One rank's shard of a leaf: where it sits in the full tensor."""

    where: tuple[Any, ...]  # per tensor dim: a slice or a 1-d int64 tensor of positions
    shape: tuple[int, ...]
    sends: bool  # the first of the ranks holding this same shard (replicas send nothing)


def _pieces(x: Any) -> list[_Piece]:
    """Every mesh rank's shard of the DTensor ``x`` (in mesh order), by replaying its placements on positions.

    DTensor splits in mesh-dim order, each ``Shard``/``_StridedShard`` cutting
    one tensor dim with its own ``_split_tensor``; replaying that on a 1-d
    range per tensor dim gives the positions each rank holds, with no
    communication and no full-size index.
    """
    mesh, placements, shape = x.device_mesh, x.placements, tuple(x.shape)
    out = []
    for coord in torch.cartesian_prod(*[torch.arange(s) for s in mesh.shape]).reshape(-1, mesh.ndim).tolist():
        pos: list[torch.Tensor] = [torch.arange(n) for n in shape]
        for mdim, p in enumerate(placements):
            if _is_shard(p):
                d = p.dim % len(shape)
                view = [1] * len(shape)
                view[d] = pos[d].numel()
                chunks, _ = p._split_tensor(pos[d].reshape(view), mesh.size(mdim), with_padding=False)
                pos[d] = chunks[coord[mdim]].reshape(-1) if coord[mdim] < len(chunks) else pos[d][:0]
        index: list[Any] = []
        for d, q in enumerate(pos):
            lo = int(q[0]) if q.numel() else 0
            contiguous = q.numel() == 0 or bool(torch.equal(q, torch.arange(lo, lo + q.numel())))
            index.append(slice(lo, lo + q.numel()) if contiguous else q)
        sends = all(c == 0 for c, p in zip(coord, placements) if not _is_shard(p))
        out.append(_Piece(tuple(index), tuple(q.numel() for q in pos), sends))
    return out


def _advanced(index: tuple[Any, ...]) -> tuple[Any, ...]:
    """``index`` as broadcasting index tensors, when any dim is not a plain slice."""
    if all(isinstance(i, slice) for i in index):
        return index
    n = len(index)
    out = []
    for d, i in enumerate(index):
        t = torch.arange(i.start, i.stop) if isinstance(i, slice) else i
        view = [1] * n
        view[d] = -1
        out.append(t.reshape(view))
    return tuple(out)


class _Owned(NamedTuple):
    leaf: int  # position among the leaves the step orthogonalizes
    owner: int  # rank in the mesh's group (global-rank order)
    pieces: tuple[_Piece, ...]  # by group rank


class _MeshPlan(NamedTuple):
    mesh: Any
    group_of_mesh: tuple[int, ...]  # mesh-order position -> group rank
    items: tuple[_Owned, ...]
    flops: tuple[int, ...]  # Newton–Schulz work per group rank


class ExchangePlan(NamedTuple):
    """What one step of sharded orthogonalization costs on each rank (see :func:`exchange_plan`).

    Attributes:
      collectives: all-to-alls per step (two per mesh and dtype that holds a sharded matrix).
      sent_bytes: bytes this rank sends to other ranks per step, both exchanges together.
      received_bytes: bytes this rank receives from other ranks per step.
      all_gather_bytes: what this rank would receive if every sharded matrix were
        all-gathered to every rank (the naive scheme), for comparison.
      flops: the Newton–Schulz flops of the exchanged matrices each rank owns, by global rank.
      total_flops: the Newton–Schulz flops of the whole step, every matrix once.
      owners: the owner (global rank) of every exchanged leaf, by leaf position.
    """

    collectives: int
    sent_bytes: int
    received_bytes: int
    all_gather_bytes: int
    flops: tuple[int, ...]
    total_flops: int
    owners: dict[int, int]


def _greedy_owners(costs: Sequence[int], ranks: Sequence[int], load: dict[int, int]) -> list[int]:
    """Largest first, each to the least-loaded rank (lowest on ties): the same answer on every rank.

    ``ranks`` are the global ranks by group rank; ``load`` (by global rank) carries
    the work already given out on other meshes, so several meshes share it too.
    """
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(len(ranks)), key=lambda r: (load.get(ranks[r], 0), ranks[r]))
        owners[i] = r
        load[ranks[r]] = load.get(ranks[r], 0) + costs[i]
    return owners


def _global_ranks(mesh: Any) -> tuple[int, ...]:
    from gradtx.comm.torch_dist import mesh_ranks

    return mesh_ranks(mesh)


def _mesh_order_to_group(mesh: Any) -> tuple[int, ...]:
    ranks = _global_ranks(mesh)
    order = sorted(ranks)
    return tuple(order.index(r) for r in ranks)


def _plan_sharded(
    leaves: Sequence[Any], dims: Sequence[_Layout], exchanged: Sequence[int], steps: int
) -> tuple[_MeshPlan, ...]:
    by_mesh: dict[int, list[int]] = {}
    meshes: dict[int, Any] = {}
    for j in exchanged:
        mesh = leaves[j].device_mesh
        by_mesh.setdefault(id(mesh), []).append(j)
        meshes[id(mesh)] = mesh
    plans = []
    load: dict[int, int] = {}
    for key, js in by_mesh.items():
        mesh = meshes[key]
        to_group = _mesh_order_to_group(mesh)
        n = len(to_group)
        costs = [_ns_flops(dims[j], steps) for j in js]
        owners = _greedy_owners(costs, sorted(_global_ranks(mesh)), load)
        items = []
        flops = [0] * n
        for j, owner, cost in zip(js, owners, costs):
            by_mesh_order = _pieces(leaves[j])
            pieces: list[_Piece] = [None] * n  # type: ignore[list-item]
            for pos, piece in enumerate(by_mesh_order):
                pieces[to_group[pos]] = piece
            items.append(_Owned(j, owner, tuple(pieces)))
            flops[owner] += cost
        plans.append(_MeshPlan(mesh, to_group, tuple(items), tuple(flops)))
    return tuple(plans)


def _exchange(
    plan: _MeshPlan,
    comm: ExchangeComm,
    inputs: Sequence[torch.Tensor],
    templates: Sequence[Any],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
) -> dict[int, torch.Tensor]:
    """Gather each leaf to its owner, run ``fn(leaf, full)`` there, and bring every rank its shard back.

    Two all-to-alls per dtype over the mesh's group; every rank of the mesh
    calls them in the same order, whatever it owns.
    """
    group = plan.mesh
    n = comm.size(group)
    me = comm.rank(group)
    if n != len(plan.group_of_mesh):
        raise ValueError(f"muon: the comm's group for a mesh of {len(plan.group_of_mesh)} ranks has {n} ranks")
    out: dict[int, torch.Tensor] = {}
    dtypes: dict[torch.dtype, list[_Owned]] = {}
    for item in plan.items:
        dtypes.setdefault(inputs[item.leaf].dtype, []).append(item)
    for dtype, items in dtypes.items():
        device = inputs[items[0].leaf].device
        # To the owners: my shard of every leaf, where I am the first holder of that shard.
        send = [[] for _ in range(n)]  # type: list[list[torch.Tensor]]
        for it in items:
            if it.pieces[me].sends:
                send[it.owner].append(inputs[it.leaf].reshape(-1))
        recv_numels = [
            sum(math.prod(it.pieces[r].shape) for it in items if it.owner == me and it.pieces[r].sends)
            for r in range(n)
        ]
        got = comm.all_to_all([_cat(s, dtype, device) for s in send], recv_numels, group)
        offsets = [0] * n
        back = [[] for _ in range(n)]  # type: list[list[torch.Tensor]]
        for it in items:
            if it.owner != me:
                continue
            shape = templates[it.leaf].shape
            full = torch.empty(shape, dtype=dtype, device=device)
            for r in range(n):
                p = it.pieces[r]
                if not p.sends:
                    continue
                k = math.prod(p.shape)
                full[_advanced(p.where)] = got[r][offsets[r] : offsets[r] + k].view(p.shape)
                offsets[r] += k
            result = fn(it.leaf, full)
            for r in range(n):
                back[r].append(result[_advanced(it.pieces[r].where)].reshape(-1))
        recv_numels = [sum(math.prod(it.pieces[me].shape) for it in items if it.owner == r) for r in range(n)]
        got = comm.all_to_all([_cat(b, dtype, device) for b in back], recv_numels, group)
        offsets = [0] * n
        for it in items:
            p = it.pieces[me]
            k = math.prod(p.shape)
            out[it.leaf] = got[it.owner][offsets[it.owner] : offsets[it.owner] + k].view(p.shape)
            offsets[it.owner] += k
    return out


def _cat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


class _Route(NamedTuple):
    kind: str  # "local": orthogonalize the local tensor; "exchange": via owners
    layout: _Layout


def _routes(
    leaves: Sequence[Any], dims: Sequence[MuonDimensionNumbers], leaf_paths: Sequence[str], *, whole_leaf: bool
) -> list[_Route]:
    routes = []
    for x, dn, where in zip(leaves, dims, leaf_paths):
        lay = _layout(tuple(x.shape), dn, where=where)
        kind = "local"
        if DTensor is not None and isinstance(x, DTensor):
            if any(isinstance(p, Partial) for p in x.placements):
                raise ValueError(
                    f"muon: the update at {where} is a Partial DTensor (a pending sum); reduce it before orthogonalizing"
                )
            sharded = {cast(Any, p).dim % x.ndim for p in x.placements if _is_shard(p)}
            if sharded and (whole_leaf or not sharded <= lay.batch_axes):
                _check_shard_order(x, where=where)
                kind = "exchange"
        routes.append(_Route(kind, lay))
    return routes


def _default_comm(leaves: Sequence[Any]) -> ExchangeComm:
    meshes = [x.device_mesh for x in leaves if DTensor is not None and isinstance(x, DTensor)]
    if not meshes:
        return LocalComm()
    from gradtx.comm.torch_dist import mesh_comm

    return mesh_comm(meshes)


def _signature(leaves: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(
        (tuple(x.shape), x.dtype, (id(x.device_mesh), x.placements) if isinstance(x, DTensor) else None) for x in leaves
    )


class _Prepared(NamedTuple):
    """What a step needs that depends only on the leaves' shapes, dtypes and placements (cached)."""

    routes: list[_Route]
    local_layouts: list[_Layout | None]  # the local tensor's layout, for a "local" route
    stacks: list[list[int]]  # groups of "local" leaves iterated as one stack (at most ``ns_batch`` each)
    singles: list[int]  # the other "local" leaves, one at a time
    mesh_plans: tuple[_MeshPlan, ...]


def _prepare(
    leaves: Sequence[Any],
    dims: Sequence[MuonDimensionNumbers],
    leaf_paths: Sequence[str],
    *,
    adaptive: bool,
    preconditioning: str,
    steps: int,
    ns_batch: int,
) -> _Prepared:
    routes = _routes(leaves, dims, leaf_paths, whole_leaf=adaptive)
    local_layouts: list[_Layout | None] = [None] * len(leaves)
    groups: dict[tuple[Any, ...], list[int]] = {}
    singles: list[int] = []
    for j, (x, r) in enumerate(zip(leaves, routes)):
        if r.kind != "local":
            continue
        loc = tu.local(x)
        lay = _layout(tuple(loc.shape), dims[j], where=leaf_paths[j]) if loc.shape != x.shape else r.layout
        local_layouts[j] = lay
        key = None if adaptive or ns_batch < 2 else _stack_key(loc, lay, preconditioning)
        if key is None:
            singles.append(j)
        else:
            groups.setdefault(key, []).append(j)
    stacks: list[list[int]] = []
    for js in groups.values():
        if len(js) == 1:
            singles += js
            continue
        # Bounded stacks: ns_batch matrices at most, in near-equal parts.
        n = -(-len(js) // ns_batch)
        stacks += [js[k::n] for k in range(n)]
    exchanged = [j for j, r in enumerate(routes) if r.kind == "exchange"]
    mesh_plans = _plan_sharded(leaves, [r.layout for r in routes], exchanged, steps)
    return _Prepared(routes, local_layouts, stacks, sorted(singles), mesh_plans)


def _make_orthogonalizer(
    rows: Sequence[tuple[float, float, float]],
    preconditioning: str,
    eps: Scalar,
    ns_dtype: torch.dtype | None,
    comm: ExchangeComm | None,
    *,
    name: str,
    ns_batch: int = 1,
) -> Callable[..., list[torch.Tensor]]:
    """``run(leaves, dims, paths, adaptive)``: each leaf's orthogonalized value, wrapped like the leaf.

    ``paths`` is a function returning the leaves' path strings (for messages),
    called only when the leaves' layout is new; everything that depends on
    shapes and placements alone is computed then and cached.
    """
    cache: dict[tuple[Any, ...], _Prepared] = {}

    def run(
        leaves: Sequence[Any],
        dims: Sequence[MuonDimensionNumbers],
        leaf_paths: Callable[[], Sequence[str]],
        adaptive: bool,
    ) -> list[torch.Tensor]:
        key = (_signature(leaves), tuple(dims), adaptive)
        prep = cache.get(key)
        if prep is None:
            prep = _prepare(
                leaves, dims, leaf_paths(), adaptive=adaptive, preconditioning=preconditioning, steps=len(rows),
                ns_batch=ns_batch,
            )  # fmt: skip
            if len(cache) > 8:
                cache.clear()
            cache[key] = prep
        routes = prep.routes

        def whole(j: int, full: torch.Tensor) -> torch.Tensor:
            o = _orthogonalize_full(full, rows, preconditioning, eps, routes[j].layout, ns_dtype)
            if adaptive:  # scale by the dual norm <G, O> of the whole leaf, as optax
                o = (full * o).sum() * o
            return o

        out: list[Any] = [None] * len(leaves)
        for js in prep.stacks:
            locs = [tu.local(leaves[j]) for j in js]
            lays = [cast(_Layout, prep.local_layouts[j]) for j in js]
            for j, o in zip(js, _orthogonalize_stacked(locs, rows, preconditioning, eps, lays, ns_dtype)):
                out[j] = tu.like(leaves[j], o)
        for j in prep.singles:
            x = leaves[j]
            loc = tu.local(x)
            o = _orthogonalize_full(loc, rows, preconditioning, eps, cast(_Layout, prep.local_layouts[j]), ns_dtype)
            if adaptive:
                o = (loc * o).sum() * o
            out[j] = tu.like(x, o)
        if prep.mesh_plans and _simulated():
            # A simulated mesh runs every rank at once, so the owner exchange (whose sends depend on the rank)
            # cannot run there; every rank gathers the whole leaf instead and keeps its shard of the same result.
            from gradtx.comm.torch_dist import on_whole

            for plan in prep.mesh_plans:
                for it in plan.items:
                    out[it.leaf] = on_whole(leaves[it.leaf], functools.partial(whole, it.leaf))
        elif prep.mesh_plans:
            c = comm if comm is not None else _default_comm(leaves)
            check_exchange_comm(c, name=name)
            locals_ = [tu.local(x) for x in leaves]
            for plan in prep.mesh_plans:
                for j, shard in _exchange(plan, c, locals_, leaves, whole).items():
                    out[j] = tu.like(leaves[j], shard)
        return out

    return run


def _simulated() -> bool:
    """Whether torch's ``LocalTensorMode`` (a simulated mesh: every rank in this process) is on."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:  # pragma: no cover
        return False
    return enabled_local_tensor_mode() is not None


def exchange_plan(
    updates: PyTree,
    weight_dimension_numbers: Any = None,
    *,
    ns_steps: int = 5,
    rank: int = 0,
    adaptive: bool = False,
) -> ExchangePlan:
    """The communication and Newton–Schulz work of one sharded orthogonalization step, for rank ``rank``.

    Computed from shapes and placements alone (no communication), with the
    same owner assignment the step uses.

    Args:
      updates: the tree of (DTensor) updates, or params of the same layout.
      weight_dimension_numbers: as for :func:`scale_by_muon`.
      ns_steps: the number of Newton–Schulz iterations.
      rank: the global rank to report bytes for.
      adaptive: as for :func:`scale_by_muon` (it gathers leaves sharded along batch axes too).

    Returns:
      An :class:`ExchangePlan`.

    Example:
      >>> plan = exchange_plan(grads)
      >>> plan.received_bytes / plan.all_gather_bytes  # 2 / world size for evenly sharded matrices
    """
    leaves, _ = tu.flatten(updates)
    dims = _resolve_dims(weight_dimension_numbers, updates, name="exchange_plan")
    all_paths = [tu.path_str(p) for p in tu.paths(updates)]
    keep = [j for j, d in enumerate(dims) if d is not None]
    leaves = [leaves[j] for j in keep]
    routes = _routes(leaves, [dims[j] for j in keep], [all_paths[j] for j in keep], whole_leaf=adaptive)  # type: ignore[misc]
    exchanged = [j for j, r in enumerate(routes) if r.kind == "exchange"]
    plans = _plan_sharded(leaves, [r.layout for r in routes], exchanged, ns_steps)
    sent = received = gather = 0
    collectives = 0
    flops: dict[int, int] = {}
    owners: dict[int, int] = {}
    for plan in plans:
        ranks = sorted(_global_ranks(plan.mesh))
        for g, f in zip(ranks, plan.flops):
            flops[g] = flops.get(g, 0) + f
        for it in plan.items:
            owners[keep[it.leaf]] = ranks[it.owner]
        if rank not in ranks:
            continue
        me = ranks.index(rank)
        collectives += 2 * len({leaves[it.leaf].dtype for it in plan.items})
        for it in plan.items:
            size = leaves[it.leaf].element_size()
            mine = math.prod(it.pieces[me].shape) * size
            if it.owner != me:
                sent += mine if it.pieces[me].sends else 0  # to the owner
                received += mine  # my shard of the result
            else:
                received += sum(math.prod(p.shape) * size for r, p in enumerate(it.pieces) if r != me and p.sends)
                sent += sum(math.prod(p.shape) * size for r, p in enumerate(it.pieces) if r != me)
            gather += (leaves[it.leaf].numel() - math.prod(it.pieces[me].shape)) * size
    total = sum(_ns_flops(r.layout, ns_steps) for r in routes)
    return ExchangePlan(
        collectives,
        sent,
        received,
        gather,
        tuple(flops.get(r, 0) for r in range(max(flops, default=-1) + 1)),
        total,
        owners,
    )
