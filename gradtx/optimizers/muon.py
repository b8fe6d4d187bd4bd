"""Muon: momentum orthogonalized by Newton–Schulz, exact on sharded matrices.

:func:`scale_by_muon` keeps a momentum of the gradients and replaces each
weight matrix's momentum by an approximately orthogonal matrix (a few
Newton–Schulz iterations); :func:`muon` chains it with the shape scaling,
weight decay and the learning rate, and sends the other leaves to AdamW, as
``optax.contrib.muon`` does. :func:`orthogonalize` is the Newton–Schulz step
alone, to chain with a momentum of one's own.

**Layout.** A leaf's :class:`MuonDimensionNumbers` say which axes form the
matrix (``reduction_axis``, ``output_axis``); every other axis is a batch
axis (heads, stacked experts), each slice orthogonalized on its own. The
default reads PyTorch's ``(out, in)`` weights: reduction axis 1, output axis 0,
as ``torch.optim.Muon`` and :func:`gradtx.adaptive_clip` do. Optax's default
(reduction 0, output 1) assumes JAX's ``(in, out)``; pass
``MuonDimensionNumbers(0, 1)`` to get it.

**Sharded matrices.** The momentum is elementwise, so it runs on each
DTensor's local shard. The Newton–Schulz iteration needs whole matrices, so a
leaf sharded across the matrix axes is *owned* by one rank of its mesh: every
rank sends its shard to the owner in one bucketed all-to-all, each owner
orthogonalizes the matrices it owns, and a second all-to-all brings every
rank its shard of the result. Owners are assigned greedily by Newton–Schulz
cost, largest first, to the least-loaded rank, so each matrix is
orthogonalized once and the work is spread. A leaf sharded only along batch
axes (experts over an EP dim) holds whole matrices and needs no
communication; a replicated or plain leaf is orthogonalized where it is.
The cost is stated in ``docs/muon.md``; :func:`exchange_plan` computes it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, cast

import optree
import torch

from gradtx.comm.base import ExchangeComm, check_exchange_comm
from gradtx.comm.local import LocalComm
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import EmptyState, GradientTransformation, Params, PyTree, factory
from gradtx.optimizers.standard import (
    OptimizerChain,
    OptimizerSpec,
    ScaleByAdamState,
    _bias_correction,
    _moment_dtype,
    add_decayed_weights,
    scale_by_learning_rate,
)
from gradtx.transforms.combine import chain, partition

try:  # DTensor is optional: a CPU-only or old build may lack torch.distributed.
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = Partial = Replicate = Shard = None  # type: ignore[assignment,misc]
try:  # FSDP2 over TP shards dim 0 twice; the second split is a _StridedShard (private, so guarded).
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None  # type: ignore[assignment,misc]

__all__ = [
    "ExchangePlan",
    "MuonDimensionNumbers",
    "MuonState",
    "exchange_plan",
    "muon",
    "newton_schulz",
    "orthogonalize",
    "scale_by_muon",
    "scale_by_shape",
]

Scalar = float | torch.Tensor
Preconditioning = Literal["frobenius", "spectral", "aol", "schatten"]
_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
_DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
_NS_COEFFS_PRESETS: dict[str, Any] = {
    "standard": _DEFAULT_NS_COEFFS,
    "dion": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
}


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a leaf form the matrix Muon orthogonalizes; every other axis is a batch axis.

    The defaults read a PyTorch ``(out, in)`` weight: the matrix multiplies
    along axis 1 (``reduction_axis``) and produces axis 0 (``output_axis``).
    Optax's defaults are the transpose, for JAX's ``(in, out)`` weights. Each
    may be one axis or a sequence of axes (flattened together, in order);
    negative axes count from the end.

    Two fields optax does not have cut a fused axis into equal pieces, each
    orthogonalized on its own: ``output_split=3`` treats a fused QKV weight
    ``(3 d, d)`` as three ``(d, d)`` matrices, ``output_split=n_heads`` a
    projection ``(n_heads d_head, d)`` as one matrix per head, and
    ``reduction_split=n_heads`` the attention output ``(d, n_heads d_head)``.
    A split axis must be a single axis whose size the split divides.

    Example:
      >>> MuonDimensionNumbers()                                   # a Linear weight (out, in)
      >>> MuonDimensionNumbers(reduction_axis=2, output_axis=1)    # stacked experts (E, out, in)
      >>> MuonDimensionNumbers(output_split=3)                     # fused QKV (3 d, d): Q, K, V apart
    """

    reduction_axis: Sequence[int] | int = 1
    output_axis: Sequence[int] | int = 0
    reduction_split: int = 1
    output_split: int = 1


def _is_dn(x: Any) -> bool:
    return isinstance(x, MuonDimensionNumbers)


def _axes(ndim: int, dn: MuonDimensionNumbers, *, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The reduction and output axes of an ``ndim``-d leaf, as non-negative ints; checks they are valid."""
    if ndim < 2:
        raise ValueError(f"muon: the leaf at {where} has {ndim} dims; a Muon leaf needs at least 2 (give it None)")
    out: list[tuple[int, ...]] = []
    for name in ("reduction_axis", "output_axis"):
        value = getattr(dn, name)
        items = (value,) if isinstance(value, int) else tuple(value)
        for ax in items:
            if isinstance(ax, bool) or not isinstance(ax, int) or not -ndim <= ax < ndim:
                raise ValueError(f"muon: {name}={value!r} at {where} is not an axis of a {ndim}-d leaf")
        out.append(tuple(ax % ndim for ax in items))
    red, outp = out
    if not red or not outp or set(red) & set(outp) or len(set(red)) < len(red) or len(set(outp)) < len(outp):
        raise ValueError(f"muon: the reduction and output axes at {where} must be non-empty and disjoint, got {dn}")
    return red, outp


class _Layout(NamedTuple):
    split: tuple[int, ...]  # the shape with split axes cut
    perm: tuple[int, ...]  # batch + reduction + output axes
    inv: tuple[int, ...]
    flat: tuple[int, int, int]  # (batch, rows = reduction, cols = output)
    unflat: tuple[int, ...]
    batch_axes: frozenset[int]  # in the leaf's own axes (a split axis is not one)
    fan_in: int
    fan_out: int


def _split(
    shape: Sequence[int], dn: MuonDimensionNumbers, *, where: str
) -> tuple[tuple[int, ...], MuonDimensionNumbers]:
    """``shape`` with each split axis cut into ``(pieces, size / pieces)``, and the dimension numbers on that shape.

    The pieces become a batch axis just before the axis they cut.
    """
    red, outp = _axes(len(shape), dn, where=where)
    cuts: dict[int, int] = {}
    for axes, k, name in ((red, dn.reduction_split, "reduction"), (outp, dn.output_split, "output")):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"muon: {name}_split at {where} must be an int >= 1, got {k!r}")
        if k > 1:
            if len(axes) != 1 or shape[axes[0]] % k:
                raise ValueError(
                    f"muon: {name}_split={k} at {where} needs one {name} axis whose size it divides, "
                    f"got axes {axes} of shape {tuple(shape)}"
                )
            cuts[axes[0]] = k
    if not cuts:
        return tuple(shape), dn
    new_shape: list[int] = []
    where_is: dict[int, int] = {}
    for ax, n in enumerate(shape):
        if ax in cuts:
            new_shape.append(cuts[ax])
            n //= cuts[ax]
        where_is[ax] = len(new_shape)
        new_shape.append(n)
    return tuple(new_shape), MuonDimensionNumbers(tuple(where_is[a] for a in red), tuple(where_is[a] for a in outp))


def _layout(shape: Sequence[int], dn: MuonDimensionNumbers, *, where: str) -> _Layout:
    red0, out0 = _axes(len(shape), dn, where=where)
    own_batch = frozenset(ax for ax in range(len(shape)) if ax not in red0 and ax not in out0)
    shape, dn = _split(shape, dn, where=where)
    red, outp = _axes(len(shape), dn, where=where)
    batch = tuple(ax for ax in range(len(shape)) if ax not in red and ax not in outp)
    perm = batch + red + outp
    inv = tuple(sorted(range(len(shape)), key=lambda i: perm[i]))
    size = lambda axes: math.prod(shape[ax] for ax in axes)
    return _Layout(
        shape, perm, inv, (size(batch), size(red), size(outp)), tuple(shape[ax] for ax in perm), own_batch,
        size(red), size(outp),
    )  # fmt: skip


# --- the Newton–Schulz iteration on local tensors ------------------------------------------------


def _coeff_rows(ns_coeffs: Any, ns_steps: int, *, name: str) -> tuple[tuple[float, float, float], ...]:
    """One ``(a, b, c)`` row per iteration, as optax reads ``ns_coeffs`` and ``ns_steps``."""
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in _NS_COEFFS_PRESETS:
            raise ValueError(f"{name}: unknown ns_coeffs preset {ns_coeffs!r}; known: {sorted(_NS_COEFFS_PRESETS)}")
        ns_coeffs = _NS_COEFFS_PRESETS[ns_coeffs]
    try:
        rows = torch.as_tensor(ns_coeffs, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{name}: ns_coeffs must be three numbers or a sequence of triples, got {ns_coeffs!r}"
        ) from None
    if rows.ndim not in (1, 2) or rows.shape[-1] != 3:
        raise ValueError(f"{name}: ns_coeffs must have shape (3,) or (n, 3), got {tuple(rows.shape)}")
    if rows.ndim == 1:
        return (tuple(float(v) for v in rows),) * ns_steps  # type: ignore[return-value]
    if rows.shape[0] > ns_steps:
        raise ValueError(f"{name}: {rows.shape[0]} rows of ns_coeffs need ns_steps >= {rows.shape[0]}, got {ns_steps}")
    return tuple(tuple(float(v) for v in row) for row in rows)  # type: ignore[misc]


def newton_schulz(
    x: torch.Tensor,
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    *,
    preconditioning: Preconditioning = "frobenius",
    eps: Scalar = 1e-8,
    dimension_numbers: MuonDimensionNumbers | None = None,
    ns_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonalize the matrices of a (local, whole) tensor with the quintic Newton–Schulz iteration.

    Each matrix ``X`` (rows: the reduction axes, columns: the output axes) is
    normalised, then iterated ``X <- a X + (b A + c A A) X`` with ``A = X Xᵀ``,
    on its wide orientation (transposed when it has at least as many rows as
    columns, which is where ``torch.optim.Muon`` iterates a square matrix).
    The result is close to ``U Vᵀ`` for ``X = U S Vᵀ``.

    Args:
      x: a dense tensor holding whole matrices (a DTensor's full value, not a shard).
      ns_coeffs: ``(a, b, c)``, a sequence of such rows (one per iteration), or
        a preset name (``"standard"``, ``"dion"``).
      ns_steps: the number of iterations (ignored for a sequence of rows).
      preconditioning: ``"frobenius"`` (divide by the Frobenius norm plus
        ``eps``), ``"spectral"``, ``"aol"`` or ``"schatten"``, as optax.
      eps: added to the normalising norm.
      dimension_numbers: the matrix axes; ``None`` means the default
        :class:`MuonDimensionNumbers` (a 2-d ``(out, in)`` weight).
      ns_dtype: the dtype to iterate in (``torch.bfloat16`` as
        ``torch.optim.Muon``); ``None`` iterates in ``x``'s dtype.

    Returns:
      A tensor of ``x``'s shape and dtype.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024;
      Bernstein & Newhouse, "Old Optimizer, New Norm: An Anthology", 2024.

    Example:
      >>> o = newton_schulz(torch.randn(64, 32))
      >>> torch.linalg.svdvals(o)  # all close to 1 (within the iteration's 0.7..1.2 band)
    """
    rows = _coeff_rows(ns_coeffs, check.integer(ns_steps, arg="ns_steps", name="newton_schulz", minimum=0),
                       name="newton_schulz")  # fmt: skip
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"newton_schulz: preconditioning must be one of {_PRECONDITIONINGS}, got {preconditioning!r}")
    dn = dimension_numbers if dimension_numbers is not None else MuonDimensionNumbers()
    return _orthogonalize_full(x, rows, preconditioning, eps, _layout(x.shape, dn, where="<x>"), ns_dtype)


def _orthogonalize_full(
    x: torch.Tensor,
    rows: Sequence[tuple[float, float, float]],
    preconditioning: str,
    eps: Scalar,
    lay: _Layout,
    ns_dtype: torch.dtype | None,
) -> torch.Tensor:
    if x.is_complex():
        raise TypeError("muon: complex leaves are not supported (torch.optim.Muon refuses them too)")
    dtype = ns_dtype if ns_dtype is not None else x.dtype
    m = x.reshape(lay.split).permute(lay.perm).reshape(lay.flat).to(dtype)
    # Iterate on the wide side. A square matrix is transposed too (where torch.optim.Muon iterates it, so bf16
    # agrees bit for bit), except under AOL, whose row scaling depends on the side: there optax's side.
    transposed = lay.flat[1] > lay.flat[2] or (lay.flat[1] == lay.flat[2] and preconditioning != "aol")
    if transposed:
        m = m.mT
    if lay.flat[0] == 1:  # one matrix: the 2-d ops torch.optim.Muon uses, so bf16 results agree bit for bit
        y = _ns_2d(m[0], rows, preconditioning, eps).unsqueeze(0)
    else:
        y = _ns_batched(m, rows, preconditioning, eps)
    if transposed:
        y = y.mT
    return y.reshape(lay.unflat).permute(lay.inv).reshape(x.shape).to(x.dtype)


def _eps_like(eps: Scalar, like: torch.Tensor) -> Scalar:
    return eps.to(like.device, like.dtype) if isinstance(eps, torch.Tensor) else eps


def _ns_2d(x: torch.Tensor, rows: Sequence[tuple[float, float, float]], pre: str, eps: Scalar) -> torch.Tensor:
    e = _eps_like(eps, x)
    if pre == "frobenius":
        x = x / (x.norm() + e)
    elif pre == "spectral":
        x = x / (torch.linalg.matrix_norm(x.float(), ord=2).to(x.dtype) + e)
    for i, (a, b, c) in enumerate(rows):
        gram = x @ x.T
        if i == 0 and pre in ("aol", "schatten"):
            if pre == "aol":
                s = torch.rsqrt(torch.clamp(gram.abs().sum(dim=-1), min=e)).unsqueeze(-1)
                x, gram = x * s, gram * s * s.T
            else:
                s = torch.rsqrt(torch.clamp(torch.linalg.matrix_norm(gram), min=e))
                x, gram = x * s, gram * s**2
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x


def _ns_batched(x: torch.Tensor, rows: Sequence[tuple[float, float, float]], pre: str, eps: Scalar) -> torch.Tensor:
    e = _eps_like(eps, x)
    if pre == "frobenius":
        x = x / (torch.linalg.matrix_norm(x, keepdim=True) + e)
    elif pre == "spectral":
        x = x / (torch.linalg.matrix_norm(x.float(), ord=2, keepdim=True).to(x.dtype) + e)
    for i, (a, b, c) in enumerate(rows):
        gram = x @ x.mT
        if i == 0 and pre in ("aol", "schatten"):
            if pre == "aol":
                s = torch.rsqrt(torch.clamp(gram.abs().sum(dim=-1), min=e)).unsqueeze(-1)
                x, gram = x * s, gram * s * s.mT
            else:
                s = torch.rsqrt(torch.clamp(torch.linalg.matrix_norm(gram, keepdim=True), min=e))
                x, gram = x * s, gram * s**2
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x


def _ns_flops(lay: _Layout, steps: int) -> int:
    """Multiply-adds ×2 of the iteration on one leaf: per step ``X Xᵀ``, ``A A`` and ``B X`` on the wide side."""
    b, r, c = lay.flat
    m, n = min(r, c), max(r, c)
    return b * steps * (4 * m * m * n + 2 * m * m * m)


# --- which leaves are Muon's, and with which dimension numbers ------------------------------------


class _Dn:
    """A leaf wrapper, so optree treats a MuonDimensionNumbers (a NamedTuple) or None as one leaf."""

    __slots__ = ("dn",)

    def __init__(self, dn: MuonDimensionNumbers | None) -> None:
        self.dn = dn


def _resolve_dims(dims: Any, updates: PyTree, *, name: str) -> list[MuonDimensionNumbers | None]:
    """One dimension-numbers entry per (non-None) leaf of ``updates``; ``None`` where a leaf is not Muon's."""
    if dims is None:  # the default 2-d rule: every matrix is an (out, in) weight, the rest pass through
        return [MuonDimensionNumbers() if x.ndim == 2 else None for x in tu.flatten(updates)[0]]
    if callable(dims) and not _is_dn(dims):
        dims = dims(updates)
    wrapped = optree.tree_map(_Dn, dims, is_leaf=lambda x: x is None or _is_dn(x), none_is_leaf=True)
    full = optree.tree_map(lambda x: x, updates, none_is_leaf=True)
    try:
        spread = optree.tree_broadcast_prefix(wrapped, full, none_is_leaf=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: the dimension numbers are not a prefix of the updates tree: {e!s:.300}") from None
    leaves = optree.tree_leaves(full, none_is_leaf=True)
    per_leaf = optree.tree_leaves(spread, none_is_leaf=True, is_leaf=lambda x: isinstance(x, _Dn))
    out = []
    for leaf, d in zip(leaves, per_leaf):
        if leaf is None:
            continue
        if not isinstance(d, _Dn) or not (d.dn is None or _is_dn(d.dn)):
            raise TypeError(f"{name}: dimension numbers must be MuonDimensionNumbers or None, got {d!r:.100}")
        out.append(d.dn)
    return out


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


class _Sharded(NamedTuple):
    comm: ExchangeComm
    mesh_plans: tuple[_MeshPlan, ...]


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


def _simulated() -> bool:
    """Whether torch's ``LocalTensorMode`` (a simulated mesh: every rank in this process) is on."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:  # pragma: no cover
        return False
    return enabled_local_tensor_mode() is not None


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


def _make_orthogonalizer(
    rows: Sequence[tuple[float, float, float]],
    preconditioning: str,
    eps: Scalar,
    ns_dtype: torch.dtype | None,
    comm: ExchangeComm | None,
    *,
    name: str,
) -> Callable[..., list[torch.Tensor]]:
    """``run(leaves, dims, paths, adaptive)``: each leaf's orthogonalized value, wrapped like the leaf."""
    cache: dict[tuple[Any, ...], tuple[list[_Route], tuple[_MeshPlan, ...]]] = {}

    def run(
        leaves: Sequence[Any], dims: Sequence[MuonDimensionNumbers], leaf_paths: Sequence[str], adaptive: bool
    ) -> list[torch.Tensor]:
        key = (_signature(leaves), tuple(dims), adaptive)
        if key not in cache:
            routes = _routes(leaves, dims, leaf_paths, whole_leaf=adaptive)
            exchanged = [j for j, r in enumerate(routes) if r.kind == "exchange"]
            mesh_plans = _plan_sharded(leaves, [r.layout for r in routes], exchanged, len(rows))
            if len(cache) > 8:
                cache.clear()
            cache[key] = (routes, mesh_plans)
        routes, mesh_plans = cache[key]

        def whole(j: int, full: torch.Tensor) -> torch.Tensor:
            o = _orthogonalize_full(full, rows, preconditioning, eps, routes[j].layout, ns_dtype)
            if adaptive:  # scale by the dual norm <G, O> of the whole leaf, as optax
                o = (full * o).sum() * o
            return o

        out: list[Any] = [None] * len(leaves)
        for j, (x, r) in enumerate(zip(leaves, routes)):
            if r.kind == "local":
                loc = tu.local(x)
                lay = _layout(tuple(loc.shape), dims[j], where=leaf_paths[j]) if loc.shape != x.shape else r.layout
                o = _orthogonalize_full(loc, rows, preconditioning, eps, lay, ns_dtype)
                if adaptive:
                    o = (loc * o).sum() * o
                out[j] = tu.like(x, o)
        if mesh_plans and _simulated():
            from gradtx.comm.torch_dist import on_whole

            # A simulated mesh runs every rank at once, so the owner exchange (whose sends depend on the rank)
            # cannot run there; every rank gathers the whole leaf instead and keeps its shard of the same result.
            for plan in mesh_plans:
                for it in plan.items:
                    out[it.leaf] = on_whole(leaves[it.leaf], functools.partial(whole, it.leaf))
        elif mesh_plans:
            c = comm if comm is not None else _default_comm(leaves)
            check_exchange_comm(c, name=name)
            locals_ = [tu.local(x) for x in leaves]
            for plan in mesh_plans:
                for j, shard in _exchange(plan, c, locals_, leaves, whole).items():
                    out[j] = tu.like(leaves[j], shard)
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


# --- the transforms ------------------------------------------------------------------------------


def _check_common(
    ns_coeffs: Any, ns_steps: Any, eps: Any, preconditioning: Any, ns_dtype: Any, comm: Any, *, name: str
):
    if isinstance(ns_steps, torch.Tensor):
        raise TypeError(
            f"{name}: ns_steps must be an int, got a tensor (under inject_hyperparams pass static_args=('ns_steps',))"
        )
    ns_steps = check.integer(ns_steps, arg="ns_steps", name=name, minimum=0)
    rows = _coeff_rows(ns_coeffs, ns_steps, name=name)
    eps = check.non_negative(eps, arg="eps", name=name, tensor=True)
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"{name}: preconditioning must be one of {_PRECONDITIONINGS}, got {preconditioning!r}")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
        raise TypeError(f"{name}: ns_dtype must be a floating torch.dtype or None, got {ns_dtype!r}")
    if comm is not None:
        check_exchange_comm(comm, name=name)
    return rows, eps


def _muon_leaves(updates: PyTree, dims_arg: Any, *, name: str):
    """The updates' leaves with their dimension numbers; a leaf whose entry is None passes through."""
    leaves, spec = tu.flatten(updates)
    tu.check_tensors(leaves, tu.paths(updates), what=f"{name}: updates")
    dims = _resolve_dims(dims_arg, updates, name=name)
    leaf_paths = [tu.path_str(p) for p in tu.paths(updates)]
    return leaves, spec, dims, leaf_paths


@factory
def orthogonalize(
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    eps: Scalar = 1e-8,
    *,
    preconditioning: Preconditioning = "frobenius",
    weight_dimension_numbers: Any = None,
    ns_dtype: torch.dtype | None = None,
    comm: ExchangeComm | None = None,
) -> GradientTransformation:
    """Replace each matrix update by its Newton–Schulz orthogonalization (Muon's step without the momentum).

    Chain it after a momentum of your own (``chain(trace(0.9), orthogonalize(), ...)``).
    Sharded DTensor updates are orthogonalized whole, each on one owner rank
    (see the module docstring), so the result equals the single-device one.

    Args:
      ns_coeffs: ``(a, b, c)``, one triple per iteration, or a preset (``"standard"``, ``"dion"``).
      ns_steps: Newton–Schulz iterations.
      eps: added to the normalising norm; ``>= 0``, or a 0-d tensor.
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or ``"schatten"``.
      weight_dimension_numbers: a :class:`MuonDimensionNumbers` for every
        leaf, a tree of them (``None`` leaves pass through unchanged), or a
        function of the updates returning such a tree. ``None``: every 2-d leaf is an
        ``(out, in)`` matrix, and the other leaves pass through.
      ns_dtype: iterate in this dtype (``torch.bfloat16`` as ``torch.optim.Muon``); ``None``: the update's.
      comm: the :class:`~gradtx.comm.ExchangeComm` for sharded leaves; ``None``
        derives one from the DTensors' meshes.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024.

    Example:
      >>> tx = chain(trace(0.95), orthogonalize(), scale_by_learning_rate(0.02))
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    rows, eps = _check_common(ns_coeffs, ns_steps, eps, preconditioning, ns_dtype, comm, name="orthogonalize")
    run = _make_orthogonalizer(rows, preconditioning, eps, ns_dtype, comm, name="orthogonalize")

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, EmptyState, name="orthogonalize")
        leaves, spec, dims, leaf_paths = _muon_leaves(updates, weight_dimension_numbers, name="orthogonalize")
        idx = [j for j, d in enumerate(dims) if d is not None]
        out = list(leaves)
        for j, o in zip(
            idx, run([leaves[j] for j in idx], [dims[j] for j in idx], [leaf_paths[j] for j in idx], False)
        ):
            out[j] = o
        return tu.unflatten(spec, out), state

    return GradientTransformation(init_fn, update_fn)


class MuonState(NamedTuple):
    """Muon's step count (0-d int64) and momentum (a tree mirroring the params)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    mu: PyTree


@factory
def scale_by_muon(
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Scalar = 0.95,
    eps: Scalar = 1e-8,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    weight_dimension_numbers: Any = None,
    bias_correction: bool = True,
    ns_dtype: torch.dtype | None = None,
    comm: ExchangeComm | None = None,
) -> GradientTransformation:
    """Orthogonalize the momentum of each matrix: optax's ``scale_by_muon`` on PyTorch layouts and DTensors.

    With ``t`` the step, ``mu = beta * mu + (1 - beta) * g``; the direction is
    ``mu / (1 - beta**t)`` or, with ``nesterov``,
    ``beta * mu / (1 - beta**(t+1)) + (1 - beta) * g / (1 - beta**t)``
    (``bias_correction=False`` drops the denominators, as ``torch.optim.Muon``);
    the update is its Newton–Schulz orthogonalization (see :func:`newton_schulz`),
    times ``<direction, update>`` with ``adaptive``.

    Args:
      ns_coeffs: ``(a, b, c)``, one triple per iteration, or a preset (``"standard"``, ``"dion"``).
      ns_steps: Newton–Schulz iterations.
      beta: the momentum decay; in ``[0, 1)``, or a 0-d tensor.
      eps: added to the normalising norm; ``>= 0``, or a 0-d tensor.
      mu_dtype: the momentum's dtype; ``None``: fp32 for fp16/bf16 params, the param's otherwise.
      nesterov: use Nesterov momentum.
      adaptive: scale each leaf's update by the dual norm of its direction (Bernstein & Newhouse).
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or ``"schatten"``.
      weight_dimension_numbers: a :class:`MuonDimensionNumbers` for every
        leaf, a tree of them (a ``None`` leaf passes through untouched, and its
        momentum is not kept), or a function of the updates returning one.
        ``None``: every 2-d leaf is an ``(out, in)`` matrix, and the other leaves pass through.
      bias_correction: divide the momentum by ``1 - beta**t`` (optax); False as ``torch.optim.Muon``.
      ns_dtype: iterate in this dtype (``torch.bfloat16`` as ``torch.optim.Muon``); ``None``: the update's.
      comm: the :class:`~gradtx.comm.ExchangeComm` for sharded leaves; ``None``
        derives one from the DTensors' meshes.

    Returns:
      A :class:`GradientTransformation` with state :class:`MuonState`.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024;
      Bernstein & Newhouse, "Old Optimizer, New Norm: An Anthology", 2024;
      Liu et al., "Muon is Scalable for LLM Training", 2025.

    Example:
      >>> tx = chain(scale_by_muon(), scale_by_learning_rate(0.02))
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    name = "scale_by_muon"
    rows, eps = _check_common(ns_coeffs, ns_steps, eps, preconditioning, ns_dtype, comm, name=name)
    beta = check.beta(beta, arg="beta", name=name, tensor=True)
    nesterov = check.flag(nesterov, arg="nesterov", name=name)
    adaptive = check.flag(adaptive, arg="adaptive", name=name)
    bias_correction = check.flag(bias_correction, arg="bias_correction", name=name)
    if mu_dtype is not None and not (isinstance(mu_dtype, torch.dtype) and mu_dtype.is_floating_point):
        raise TypeError(f"{name}: mu_dtype must be a floating torch.dtype or None, got {mu_dtype!r}")
    run = _make_orthogonalizer(rows, preconditioning, eps, ns_dtype, comm, name=name)

    def init_fn(params: Params) -> MuonState:
        leaves, spec = tu.flatten(params)
        tu.check_tensors(leaves, tu.paths(params), what=f"{name}: params")
        mu = [torch.zeros_like(p, dtype=mu_dtype or _moment_dtype(p.dtype), requires_grad=False) for p in leaves]
        device = tu.local(leaves[0]).device if leaves else torch.device("cpu")
        return MuonState(count=torch.zeros((), dtype=torch.int64, device=device), mu=tu.unflatten(spec, mu))

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, MuonState, name=name)
        index, leaves, spec = tu.align(state.mu, updates, what=f"{name}: updates", against="the state's momentum")
        mu_leaves, mu_spec = tu.flatten(state.mu)
        tu.check_devices(
            [mu_leaves[i] for i in index], leaves, updates, what=f"{name}: updates", against="its momentum"
        )
        dims = _resolve_dims(weight_dimension_numbers, updates, name=name)
        leaf_paths = [tu.path_str(p) for p in tu.paths(updates)]
        count = state.count + 1
        new_mu = list(mu_leaves)
        directions: list[torch.Tensor] = []
        for j, (g, i) in enumerate(zip(leaves, index)):
            if dims[j] is None:
                directions.append(g)
                continue
            m0 = tu.local(mu_leaves[i])
            gl = tu.local(g).to(m0.dtype)
            b = beta.to(m0.device, m0.dtype) if isinstance(beta, torch.Tensor) else beta
            m = m0.lerp(gl, 1 - b)  # (1 - beta) g + beta mu, as torch.optim.Muon's buffer
            if not bias_correction:
                d = gl.lerp(m, b) if nesterov else m
            else:
                t = count.to(m0.device, tu.acc_dtype(m0.dtype))
                if nesterov:
                    d = m * (b / _bias_correction(beta, t + 1)).to(m.dtype) + gl * (
                        (1 - b) / _bias_correction(beta, t)
                    ).to(m.dtype)
                else:
                    d = m / _bias_correction(beta, t).to(m.dtype)
            new_mu[i] = tu.like(mu_leaves[i], m)
            directions.append(tu.like(g, d))
        idx = [j for j, d in enumerate(dims) if d is not None]
        out: list[torch.Tensor] = list(leaves)
        results = run([directions[j] for j in idx], [dims[j] for j in idx], [leaf_paths[j] for j in idx], adaptive)
        for j, o in zip(idx, results):
            out[j] = tu.like(leaves[j], tu.local(o).to(leaves[j].dtype))
        return tu.unflatten(spec, out), MuonState(count=count, mu=tu.unflatten(mu_spec, new_mu))

    return GradientTransformation(init_fn, update_fn)


@factory
def scale_by_shape(
    weight_dimension_numbers: Any = None, consistent_rms: Scalar | None = None
) -> GradientTransformation:
    """Scale each matrix update by a factor of its shape: Muon's width scaling, or consistent RMS.

    ``sqrt(max(1, fan_out / fan_in))`` (Keller Jordan's, ``torch.optim.Muon``'s
    ``adjust_lr_fn="original"``), or ``consistent_rms * sqrt(max(fan_in, fan_out))``
    (Moonshot's; ``0.2`` is ``adjust_lr_fn="match_rms_adamw"``). ``fan_in`` is
    the size of the reduction axes and ``fan_out`` of the output axes, from
    the global (unsharded) shape. Elementwise, so DTensors scale through their shards.

    Args:
      weight_dimension_numbers: as for :func:`scale_by_muon`.
      consistent_rms: ``None`` for width scaling, else the target RMS (a number or a 0-d tensor).

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Liu et al., "Muon is Scalable for LLM Training", 2025.

    Example:
      >>> tx = scale_by_shape(consistent_rms=0.2)
    """
    if consistent_rms is not None:
        consistent_rms = check.non_negative(consistent_rms, arg="consistent_rms", name="scale_by_shape", tensor=True)

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, EmptyState, name="scale_by_shape")
        leaves, spec, dims, leaf_paths = _muon_leaves(updates, weight_dimension_numbers, name="scale_by_shape")
        out = list(leaves)
        for j, (x, dn) in enumerate(zip(leaves, dims)):
            if dn is None:
                continue
            lay = _layout(tuple(x.shape), dn, where=leaf_paths[j])
            loc = tu.local(x)
            if consistent_rms is None:
                factor: Any = math.sqrt(max(1.0, lay.fan_out / lay.fan_in))
            elif isinstance(consistent_rms, torch.Tensor):
                factor = consistent_rms.to(loc.device, loc.dtype) * math.sqrt(max(lay.fan_in, lay.fan_out))
            else:
                factor = math.sqrt(max(lay.fan_in, lay.fan_out)) * consistent_rms
            out[j] = tu.like(x, loc * factor)
        return tu.unflatten(spec, out), state

    return GradientTransformation(init_fn, update_fn)


def _scale_by_adam_nesterov(
    b1: Scalar, b2: Scalar, eps: Scalar, eps_root: Scalar, mu_dtype: torch.dtype | None, nesterov: bool
) -> GradientTransformation:
    """optax's ``scale_by_adam`` with ``eps_root`` and ``nesterov``: Muon's fallback for the other leaves."""

    def init_fn(params: Params) -> ScaleByAdamState:
        leaves, spec = tu.flatten(params)
        zeros = lambda: [
            torch.zeros_like(p, dtype=mu_dtype or _moment_dtype(p.dtype), requires_grad=False) for p in leaves
        ]
        device = tu.local(leaves[0]).device if leaves else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int64, device=device)
        return ScaleByAdamState(count=count, mu=tu.unflatten(spec, zeros()), nu=tu.unflatten(spec, zeros()))

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, ScaleByAdamState, name="muon (adam)")
        index, leaves, spec = tu.align(state.mu, updates, what="muon (adam): updates", against="the state's moments")
        mu_leaves, mu_spec = tu.flatten(state.mu)
        nu_leaves, nu_spec = tu.flatten(state.nu)
        count = state.count + 1
        new_mu, new_nu, out = list(mu_leaves), list(nu_leaves), list(leaves)
        for j, (g, i) in enumerate(zip(leaves, index)):
            m0, v0 = tu.local(mu_leaves[i]), tu.local(nu_leaves[i])
            gl = tu.local(g).to(m0.dtype)
            dev, dt = m0.device, m0.dtype

            def c(v: Scalar, dev: torch.device = dev, dt: torch.dtype = dt) -> Scalar:
                return v.to(dev, dt) if isinstance(v, torch.Tensor) else v

            m = m0.lerp(gl, 1 - c(b1))
            v = v0 * c(b2) + (1 - c(b2)) * gl * gl
            t = count.to(dev, tu.acc_dtype(dt))
            if nesterov:
                m_hat = m * (c(b1) / _bias_correction(b1, t + 1)).to(dt) + gl * (
                    (1 - c(b1)) / _bias_correction(b1, t)
                ).to(dt)
            else:
                m_hat = m / _bias_correction(b1, t).to(dt)
            v_hat = v / _bias_correction(b2, t).to(dt)
            u = m_hat / (torch.sqrt(v_hat + c(eps_root)) + c(eps))
            new_mu[i], new_nu[i] = tu.like(mu_leaves[i], m), tu.like(nu_leaves[i], v)
            out[j] = tu.like(g, u.to(g.dtype))
        return tu.unflatten(spec, out), ScaleByAdamState(
            count, tu.unflatten(mu_spec, new_mu), tu.unflatten(nu_spec, new_nu)
        )

    return GradientTransformation(init_fn, update_fn)


@factory
def muon(
    learning_rate: Any,
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Scalar = 0.95,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
    weight_decay_mask: PyTree | Callable[[Params], PyTree] | None = None,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    adam_b1: Scalar = 0.9,
    adam_b2: Scalar = 0.999,
    adam_eps_root: Scalar = 0.0,
    adam_weight_decay: Scalar = 0.0,
    adam_learning_rate: Any = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: Scalar | None = None,
    bias_correction: bool = True,
    ns_dtype: torch.dtype | None = None,
    comm: ExchangeComm | None = None,
) -> GradientTransformation:
    """Muon for the matrices, AdamW for the rest: optax's ``contrib.muon``, on PyTorch layouts and DTensors.

    The Muon leaves run ``chain(scale_by_muon(...), scale_by_shape(...),
    add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_learning_rate(learning_rate))``; the others run AdamW (Nesterov
    when ``nesterov``, as optax) with ``adam_*`` and ``eps``. Which leaves are
    Muon's: ``muon_weight_dimension_numbers`` (``None`` entries go to Adam),
    or, when it is ``None``, every 2-d leaf, read as an ``(out, in)`` weight.

    With ``beta=momentum, eps=1e-7, weight_decay=wd, bias_correction=False,
    ns_dtype=torch.bfloat16`` (and ``consistent_rms=0.2`` for
    ``adjust_lr_fn="match_rms_adamw"``) it is ``torch.optim.Muon(lr=lr,
    momentum=momentum, weight_decay=wd)`` on 2-d params.

    Args:
      learning_rate: a number ``>= 0``, a 0-d tensor or a schedule.
      ns_coeffs: as for :func:`scale_by_muon`, or a preset (``"standard"``, ``"dion"``).
      ns_steps: Newton–Schulz iterations.
      beta: the momentum decay.
      eps: added to the normalising norm, and Adam's denominator.
      mu_dtype: the moments' dtype (both members).
      nesterov: Nesterov momentum (both members, as optax).
      adaptive: as for :func:`scale_by_muon`.
      preconditioning: as for :func:`scale_by_muon`.
      bias_correction: as for :func:`scale_by_muon` (the Muon leaves only).
      ns_dtype: as for :func:`scale_by_muon`.
      comm: as for :func:`scale_by_muon`.
      weight_decay: decoupled decay of the Muon leaves, scaled by the learning rate.
      weight_decay_mask: which Muon leaves decay (a tree of bools, a prefix, or a function).
      adam_b1: the fallback AdamW's first-moment decay.
      adam_b2: its second-moment decay.
      adam_eps_root: added inside its square root.
      adam_weight_decay: its decoupled decay.
      adam_learning_rate: the fallback's learning rate; ``None``: ``learning_rate``.
      muon_weight_dimension_numbers: a tree of :class:`MuonDimensionNumbers`
        (``None`` for Adam leaves), a prefix of the params, or a function of
        the params returning one.
      consistent_rms: ``None`` for width scaling, else the target RMS (see :func:`scale_by_shape`).

    Returns:
      An :class:`~gradtx.OptimizerChain` of one :func:`gradtx.partition` (labels ``"muon"`` and ``"adam"``);
      its state is ``(PartitionState,)``. Its output is an update, so
      :class:`gradtx.TransformedOptimizer` refuses it; in front of a torch
      optimizer chain :func:`scale_by_muon` and :func:`scale_by_shape` instead
      (``docs/muon.md``).

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024;
      Liu et al., "Muon is Scalable for LLM Training", 2025.

    Example:
      >>> tx = muon(0.02, weight_decay=0.01, adam_learning_rate=3e-4)
      >>> updates, state = tx.update(grads, tx.init(params), params)
    """
    learning_rate = check.learning_rate(learning_rate, name="muon")
    adam_lr = learning_rate if adam_learning_rate is None else check.learning_rate(adam_learning_rate, name="muon")
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name="muon", tensor=True)
    adam_b1 = check.beta(adam_b1, arg="adam_b1", name="muon", tensor=True)
    adam_b2 = check.beta(adam_b2, arg="adam_b2", name="muon", tensor=True)
    adam_eps_root = check.non_negative(adam_eps_root, arg="adam_eps_root", name="muon", tensor=True)
    adam_weight_decay = check.non_negative(adam_weight_decay, arg="adam_weight_decay", name="muon", tensor=True)
    dims_arg = muon_weight_dimension_numbers
    if isinstance(ns_coeffs, str):
        _coeff_rows(ns_coeffs, ns_steps if isinstance(ns_steps, int) else 5, name="muon")
        ns_coeffs = _NS_COEFFS_PRESETS[ns_coeffs]

    def per_leaf(tree: PyTree) -> list[MuonDimensionNumbers | None]:
        if dims_arg is None:
            return [MuonDimensionNumbers() if x.ndim == 2 else None for x in tu.flatten(tree)[0]]
        return _resolve_dims(dims_arg, tree, name="muon")

    def labels(params: PyTree) -> PyTree:
        _, spec = tu.flatten(params)
        return tu.unflatten(spec, ["muon" if d is not None else "adam" for d in per_leaf(params)])

    def inner_dims(updates: PyTree) -> PyTree:
        # The Muon member sees None at the Adam leaves; what remains are Muon leaves.
        if dims_arg is None:
            return MuonDimensionNumbers()
        return dims_arg(updates) if callable(dims_arg) and not _is_dn(dims_arg) else dims_arg

    muon_tx = scale_by_muon(
        ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
        preconditioning=preconditioning, weight_dimension_numbers=inner_dims, bias_correction=bias_correction,
        ns_dtype=ns_dtype, comm=comm,
    )  # fmt: skip
    members = [muon_tx, scale_by_shape(inner_dims, consistent_rms)]
    if isinstance(weight_decay, torch.Tensor) or weight_decay != 0.0:
        members.append(add_decayed_weights(weight_decay, weight_decay_mask))
    members.append(scale_by_learning_rate(learning_rate))
    adam_members = [_scale_by_adam_nesterov(adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, nesterov)]
    if isinstance(adam_weight_decay, torch.Tensor) or adam_weight_decay != 0.0:
        adam_members.append(add_decayed_weights(adam_weight_decay))
    adam_members.append(scale_by_learning_rate(adam_lr))
    inner = partition({"muon": chain(*members), "adam": chain(*adam_members)}, labels)
    # An OptimizerChain: its output is an update (-learning_rate times a direction), so the wrapper refuses
    # it in front of a torch optimizer, and no fused kernel claims it.
    spec = OptimizerSpec("muon", learning_rate, weight_decay, b1=adam_b1, b2=adam_b2, eps=eps, fusable=False)
    return OptimizerChain(*_as_chain(inner), [inner], spec)


def _as_chain(inner: GradientTransformation) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``init`` and ``update`` of ``chain(inner)``: the state is a 1-tuple, as every chain's."""

    def init_fn(params: Params) -> tuple[Any]:
        return (inner.init(params),)

    def update_fn(updates, state, params=None, **extra):
        if not isinstance(state, tuple) or len(state) != 1:
            raise TypeError(f"muon: expected the state that init() returned (a 1-tuple), got {type(state).__name__}")
        updates, inner_state = inner.update(updates, state[0], params, **extra)
        return updates, (inner_state,)

    return init_fn, update_fn
