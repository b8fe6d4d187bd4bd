"""Muon on sharded matrices: owners, the bucketed all-to-all exchange, and the per-step orthogonalizer.

A leaf sharded across its matrix axes is gathered to one owner rank, orthogonalized
there once and scattered back (see ``gradtx.optimizers.muon``); every collective
goes through the :class:`~gradtx.comm.ExchangeComm` it is given.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from gradtx.comm.base import ExchangeComm, check_exchange_comm
from gradtx.comm.local_ranks import per_rank
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import PyTree
from gradtx.distributed.plan import _is_shard  # Shard or _StridedShard (FSDP2 over TP): the placements with a dim
from gradtx.optimizers.muon.iteration import (
    _iteration_args,
    _Layout,
    _layout,
    _Matrices,
    _matrices,
    _ns_flops,
    _orthogonalize,
    _stack_key,
    cached,
)

try:  # DTensor is optional: a CPU-only or old build may lack torch.distributed.
    from torch.distributed.tensor import DTensor

    from gradtx.comm.torch_dist import mesh_comm, mesh_ranks
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


# --- sharded leaves: placements, owners and the exchange ---------------------------------------


def _check_shard_order(x: Any, *, where: str) -> None:
    spec = x._spec
    if getattr(spec, "use_strided_shard_as_shard_order", True) is False:
        default = type(spec).compute_default_shard_order(spec.placements)
        if spec.shard_order != default:
            raise ValueError(f"muon: the DTensor at {where} has a non-default shard_order; redistribute it first")


class _Piece(NamedTuple):
    """One rank's shard of a leaf: its contiguous blocks, where each sits in the full tensor and in the shard."""

    blocks: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]  # (in the full tensor, in the shard)
    shape: tuple[int, ...]
    sends: bool  # the first of the ranks holding this same shard (replicas send nothing)


def _chunks(pos: list[int], n: int) -> list[list[int]]:
    """``torch.chunk``'s split of ``pos`` into ``n`` parts (as ``Shard``), empty parts past the last."""
    c = -(-len(pos) // n)
    return [pos[i * c : (i + 1) * c] for i in range(n)]


def _split(pos: list[int], p: Any, n: int) -> list[list[int]]:
    """The positions each of ``n`` ranks holds of a dim ``p`` cuts (a ``Shard`` is a split factor of 1).

    A ``_StridedShard`` first cuts the dim in ``split_factor`` parts (the later
    mesh dims' split), and each rank holds its chunk of every part.
    """
    firsts = [_chunks(part, n) for part in _chunks(pos, getattr(p, "split_factor", 1))]
    return [[v for f in firsts for v in f[i]] for i in range(n)]


def _runs(pos: list[int]) -> list[tuple[slice, slice]]:
    """Each contiguous run of the positions a shard holds of a dim: where it sits in the full dim and in the shard."""
    runs: list[tuple[slice, slice]] = []
    for at, v in enumerate(pos):
        if runs and runs[-1][0].stop == v:
            runs[-1] = (slice(runs[-1][0].start, v + 1), slice(runs[-1][1].start, at + 1))
        else:
            runs.append((slice(v, v + 1), slice(at, at + 1)))
    return runs


def _pieces(x: Any) -> list[_Piece]:
    """Every mesh rank's shard of the DTensor ``x`` (by global rank), by replaying its placements on positions.

    DTensor splits in mesh-dim order, each ``Shard``/``_StridedShard`` cutting
    one tensor dim as ``torch.chunk`` does; replaying that on the positions of
    each tensor dim (plain Python: the same on every rank, simulated or not)
    gives the positions each rank holds, with no communication.
    """
    mesh, placements, shape = x.device_mesh, x.placements, tuple(x.shape)
    coords = itertools.product(*[range(s) for s in mesh.shape])
    out = []
    for _, coord in sorted(zip(mesh_ranks(mesh), coords)):  # by global rank, as the mesh's group ranks them
        pos = [list(range(n)) for n in shape]
        for mdim, p in enumerate(placements):
            if _is_shard(p):
                d = p.dim % len(shape)
                pos[d] = _split(pos[d], p, mesh.size(mdim))[coord[mdim]]
        per_dim = [_runs(q) for q in pos]
        blocks = tuple(tuple(zip(*combo)) for combo in itertools.product(*per_dim))
        sends = all(c == 0 for c, p in zip(coord, placements) if not _is_shard(p))
        out.append(_Piece(blocks, tuple(len(q) for q in pos), sends))  # type: ignore[arg-type]
    return out


class _Owned(NamedTuple):
    leaf: int  # position among the leaves the step orthogonalizes
    owner: int  # rank in the mesh's group (global-rank order)
    pieces: tuple[_Piece, ...]  # by group rank
    shape: tuple[int, ...]  # the whole leaf's


class _MeshPlan(NamedTuple):
    mesh: Any
    ranks: list[int]  # the global ranks, by group rank
    items: tuple[_Owned, ...]


class ExchangePlan(NamedTuple):
    """What one step of sharded orthogonalization costs on each rank (see :func:`exchange_plan`).

    Attributes:
      collectives: all-to-alls per step (two per mesh and dtype that holds a sharded matrix).
      sent_bytes: bytes this rank sends to other ranks per step, both exchanges together.
      received_bytes: bytes this rank receives from other ranks per step.
      all_gather_bytes: what this rank would receive if every sharded matrix were
        all-gathered to every rank (the naive scheme), for comparison.
      flops: the Newton–Schulz flops of the exchanged matrices each rank owns, by global rank, as this
        rank sees them: a leaf on a sub-mesh counts in this rank's group of it only.
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


def _greedy_owners(costs: Sequence[int], ranks: Sequence[int], start: Counter[int]) -> tuple[list[int], Counter[int]]:
    """Largest first, each to the least-loaded rank (lowest on ties): the same answer on every rank.

    ``ranks`` are the global ranks by group rank; ``start`` (by global rank) is the work already
    given out on other meshes. Returns each cost's owner (a group rank) and the work given out
    here, by global rank (every one of ``ranks``, 0 where none).
    """
    owners, given = [0] * len(costs), Counter(dict.fromkeys(ranks, 0))
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(len(ranks)), key=lambda r: (start[ranks[r]] + given[ranks[r]], ranks[r]))
        owners[i] = r
        given[ranks[r]] += costs[i]
    return owners, given


def _exchange(
    plan: _MeshPlan,
    comm: ExchangeComm,
    inputs: Sequence[torch.Tensor],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
) -> dict[int, torch.Tensor]:
    """Gather each leaf to its owner, run ``fn(leaf, full)`` there, and bring every rank its shard back.

    Two all-to-alls per dtype over the mesh's group; every rank of the mesh
    calls them in the same order, whatever it owns. What a rank sends and
    computes depends on its rank, so that local work runs through
    :func:`~gradtx.comm.local_ranks.per_rank`: once here, or once per rank of a simulated mesh.
    """
    group = plan.mesh
    n = comm.size(group)
    if n != len(plan.ranks):
        raise ValueError(f"muon: the comm's group for a mesh of {len(plan.ranks)} ranks has {n} ranks")
    me = comm.rank(group)
    out: dict[int, torch.Tensor] = {}
    dtypes: dict[torch.dtype, list[_Owned]] = {}
    for item in plan.items:
        dtypes.setdefault(inputs[item.leaf].dtype, []).append(item)
    for items in dtypes.values():
        sent = per_rank(functools.partial(_to_owners, items, n))(me, *[inputs[it.leaf] for it in items])
        got = comm.all_to_all(sent[:n], sent[n:], group)
        sent = per_rank(functools.partial(_at_owners, items, n, fn))(me, *got)
        got = comm.all_to_all(sent[:n], sent[n:], group)
        out.update(zip([it.leaf for it in items], per_rank(functools.partial(_from_owners, items, n))(me, *got)))
    return out


def _to_owners(items: list[_Owned], n: int, me: int, *shards: torch.Tensor) -> tuple[Any, ...]:
    """My shard of every leaf, to its owner, where I am the first holder of that shard; and what I receive."""
    send = [[x.reshape(-1) for it, x in zip(items, shards) if it.owner == r and it.pieces[me].sends] for r in range(n)]
    recv = [_size(it.pieces[r] for it in items if it.owner == me and it.pieces[r].sends) for r in range(n)]
    return (*[_cat(s, shards[0]) for s in send], *recv)


def _at_owners(
    items: list[_Owned], n: int, fn: Callable[[int, torch.Tensor], torch.Tensor], me: int, *got: torch.Tensor
) -> tuple[Any, ...]:
    """Each leaf I own, whole; ``fn`` of it; every rank's shard of the result; and what I receive back."""
    mine = [it for it in items if it.owner == me]
    parts = [_unpack(got[r], [it.pieces[r] for it in mine if it.pieces[r].sends]) for r in range(n)]
    back: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for it in mine:
        full = got[0].new_empty(it.shape)
        for r, p in enumerate(it.pieces):
            if p.sends:
                part = next(parts[r])
                for where, local in p.blocks:
                    full[where] = part[local]
        result = fn(it.leaf, full)
        for r, p in enumerate(it.pieces):
            back[r].append(_cut(result, p))
    recv = [_size(it.pieces[me] for it in items if it.owner == r) for r in range(n)]
    return (*[_cat(b, got[0]) for b in back], *recv)


def _from_owners(items: list[_Owned], n: int, me: int, *got: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """My shard of every leaf's result, from its owner."""
    parts = [_unpack(got[o], [it.pieces[me] for it in items if it.owner == o]) for o in range(n)]
    return tuple(next(parts[it.owner]) for it in items)


def _size(pieces: Iterable[_Piece]) -> int:
    return sum(math.prod(p.shape) for p in pieces)


def _unpack(flat: torch.Tensor, pieces: list[_Piece]) -> Iterator[torch.Tensor]:
    """The pieces ``flat`` holds one after another, each viewed in its shape."""
    sizes = [math.prod(p.shape) for p in pieces]
    return (x.view(p.shape) for x, p in zip(flat.split(sizes), pieces))


def _cut(full: torch.Tensor, p: _Piece) -> torch.Tensor:
    """Piece ``p`` of ``full``, flat."""
    if len(p.blocks) == 1:
        return full[p.blocks[0][0]].reshape(-1)
    shard = torch.empty(p.shape, dtype=full.dtype, device=full.device)
    for where, local in p.blocks:
        shard[local] = full[where]
    return shard.reshape(-1)


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not parts:
        return like.new_empty(0)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _routes(
    leaves: Sequence[Any], mats: _Matrices, *, whole_leaf: bool, steps: int
) -> tuple[list[int], list[_MeshPlan], Counter[int]]:
    """The leaves orthogonalized where they are, the plans of those exchanged through owners, by mesh,
    and the Newton–Schulz flops each mesh rank owns (by global rank).

    A leaf is exchanged when it is sharded across a matrix axis (any axis with ``whole_leaf``).
    """
    local: list[int] = []
    by_mesh: dict[int, tuple[Any, list[int]]] = {}
    for j, (x, lay, where) in enumerate(zip(leaves, mats.layouts, mats.paths)):
        sharded: set[int] = set()
        if x.is_complex():
            raise TypeError(f"muon: the update at {where} is complex; Muon takes real matrices, as torch.optim.Muon")
        if DTensor is not None and isinstance(x, DTensor):
            if any(p.is_partial() for p in x.placements):
                raise ValueError(
                    f"muon: the update at {where} is a Partial DTensor (a pending sum); reduce it before orthogonalizing"
                )
            sharded = {p.dim % x.ndim for p in x.placements if _is_shard(p)}
        if sharded and (whole_leaf or not sharded <= lay.batch_axes):
            _check_shard_order(x, where=where)
            by_mesh.setdefault(id(x.device_mesh), (x.device_mesh, []))[1].append(j)
        else:
            local.append(j)
    plans = []
    load: Counter[int] = Counter()  # by global rank, over every mesh
    done: list[tuple[frozenset[int], Counter[int]]] = []  # each earlier mesh's group here, and what it gave out
    for mesh, js in by_mesh.values():
        ranks = sorted(mesh_ranks(mesh))
        # An earlier mesh's load carries over only where its group here holds this whole group: then every
        # member of this group is in that same group and knows the same load. Another member of a sub-mesh
        # (dp beside the whole dp x tp mesh) is in another group of it, whose load this rank does not see.
        start = sum((given for group, given in done if group >= set(ranks)), Counter())
        owners, given = _greedy_owners([_ns_flops(mats.layouts[j], steps) for j in js], ranks, start)
        done.append((frozenset(ranks), given))
        load.update(given)
        items = [_Owned(j, o, tuple(_pieces(leaves[j])), tuple(leaves[j].shape)) for j, o in zip(js, owners)]
        plans.append(_MeshPlan(mesh, ranks, tuple(items)))
    return local, plans, load


def _dims_key(dn: Any) -> Any:
    """``dn`` as a hashable key: an axis may be given as a list."""
    return dn if dn is None else tuple(ax if isinstance(ax, int) else tuple(ax) for ax in dn)


def _signature(leaves: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(
        (tuple(x.shape), x.dtype, (id(x.device_mesh), x.placements) if isinstance(x, DTensor) else None) for x in leaves
    )


def _stacks(
    xs: Sequence[torch.Tensor], mats: _Matrices, local: list[int], preconditioning: str, ns_batch: int
) -> tuple[list[_Layout], list[list[int]]]:
    """The layouts of the local tensors ``xs`` of the leaves ``local``, and the groups (of at most ``ns_batch``)
    iterated as one; most hold one tensor."""
    lays = [_layout(tuple(x.shape), mats.dims[j], where=mats.paths[j]) for x, j in zip(xs, local)]
    groups: dict[Any, list[int]] = {}
    for k, (x, lay) in enumerate(zip(xs, lays)):
        key = None if ns_batch < 2 else _stack_key(x, lay, preconditioning)
        groups.setdefault(k if key is None else key, []).append(k)  # a leaf never stacked: a group of its own
    stacks: list[list[int]] = []
    for ks in groups.values():  # bounded stacks: ns_batch matrices at most, in near-equal parts
        n = -(-len(ks) // ns_batch)
        stacks += [ks[i::n] for i in range(n)]
    return lays, stacks


def _make_orthogonalizer(
    ns_coeffs: Any,
    ns_steps: Any,
    eps: Any,
    preconditioning: Any,
    ns_dtype: Any,
    comm: Any,
    ns_batch: Any,
    adaptive: bool,
    *,
    name: str,
) -> Callable[[Sequence[Any], Sequence[torch.Tensor], _Matrices], list[Any]]:
    """Check the arguments Muon's transforms share; return ``run(leaves, locs, mats)``.

    ``run`` gives the orthogonalized local value of each of ``locs``, the local
    values of ``leaves`` (the Muon leaves ``mats`` describes, whose placements
    route them); with ``adaptive``, each scaled by its dual norm. What depends
    on shapes and placements alone (routes, owners, stacks) is computed on the
    first step with those and cached.
    """
    if isinstance(ns_steps, torch.Tensor):
        raise TypeError(
            f"{name}: ns_steps must be an int, got a tensor (under inject_hyperparams pass static_args=('ns_steps',))"
        )
    rows, eps = _iteration_args(ns_coeffs, ns_steps, preconditioning, eps, ns_dtype, name=name)
    if comm is not None:
        check_exchange_comm(comm, name=name)
    ns_batch = check.integer(ns_batch, arg="ns_batch", name=name, minimum=1)
    batch = 1 if adaptive else ns_batch  # adaptive leaves are iterated one at a time
    cache: dict[tuple[Any, ...], tuple[list[int], list[_MeshPlan], Counter[int]]] = {}
    local_cache: dict[tuple[Any, ...], tuple[list[_Layout], list[list[int]]]] = {}

    def run(leaves: Sequence[Any], locs: Sequence[torch.Tensor], mats: _Matrices) -> list[Any]:
        key = (_signature(leaves), tuple(map(_dims_key, mats.dims)))
        local, plans, _ = cached(cache, key, lambda: _routes(leaves, mats, whole_leaf=adaptive, steps=len(rows)))

        def orthogonalized(xs: list[torch.Tensor], lays: list[_Layout]) -> list[torch.Tensor]:
            ys = _orthogonalize(xs, rows, preconditioning, eps, lays, ns_dtype)
            # adaptive: scale by the dual norm <G, O> of the whole leaf, as optax
            return [(x * y).sum() * y for x, y in zip(xs, ys)] if adaptive else ys

        def local_step(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # Per rank: a shard's shape is each rank's own (uneven experts), and so are its layout and stacks.
            lkey = (key, tuple((x.shape, x.stride(), x.dtype, x.device) for x in xs))
            lays, stacks = cached(local_cache, lkey, lambda: _stacks(xs, mats, local, preconditioning, batch))
            res: list[Any] = [None] * len(xs)
            for ks in stacks:
                for k, y in zip(ks, orthogonalized([xs[k] for k in ks], [lays[k] for k in ks])):
                    res[k] = y
            return tuple(res)

        out = tu.scatter(len(leaves), local, per_rank(local_step)(*[locs[j] for j in local]))
        if plans:
            c = comm if comm is not None else mesh_comm([x.device_mesh for x in leaves if isinstance(x, DTensor)])
            whole = lambda j, full: orthogonalized([full], [mats.layouts[j]])[0]
            for plan in plans:
                for j, shard in _exchange(plan, c, locs, whole).items():
                    out[j] = shard
        return out

    return run


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
      updates: the tree of (DTensor) updates, or params of the same layout. Bytes count in its dtypes:
        :func:`scale_by_muon` exchanges its direction (fp32 for bf16/fp16 params: see ``ns_dtype``), so pass
        the tree in that dtype (``x.float()``) to count Muon's.
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
    ns_steps = check.integer(ns_steps, arg="ns_steps", name="exchange_plan", minimum=0)
    rank = check.integer(rank, arg="rank", name="exchange_plan", minimum=0)
    adaptive = check.flag(adaptive, arg="adaptive", name="exchange_plan")
    all_leaves, _ = tu.flatten(updates)
    mats = _matrices(weight_dimension_numbers, updates, all_leaves, name="exchange_plan")
    leaves = [all_leaves[j] for j in mats.idx]
    _, plans, flops = _routes(leaves, mats, whole_leaf=adaptive, steps=ns_steps)
    sent = received = gather = collectives = 0
    owners: dict[int, int] = {}
    for plan in plans:
        owners.update({mats.idx[it.leaf]: plan.ranks[it.owner] for it in plan.items})
        if rank not in plan.ranks:
            continue
        me = plan.ranks.index(rank)
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
    by_rank = tuple(flops.get(r, 0) for r in range(max(flops, default=-1) + 1))
    total = sum(_ns_flops(lay, ns_steps) for lay in mats.layouts)
    return ExchangePlan(collectives, sent, received, gather, by_rank, total, owners)
