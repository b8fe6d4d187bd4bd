"""Muon's matrices: the dimension numbers, the layout of each leaf, and the Newton–Schulz iteration.

Everything here works on local (whole) tensors; the sharded exchange is in
``exchange`` and the transforms in
``transforms``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import optree
import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import PyTree

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


class _Layout(NamedTuple):
    split: tuple[int, ...]  # the shape with split axes cut
    perm: tuple[int, ...]  # batch + reduction + output axes
    inv: tuple[int, ...]
    flat: tuple[int, int, int]  # (batch, rows = reduction, cols = output)
    unflat: tuple[int, ...]
    batch_axes: frozenset[int]  # in the leaf's own axes (a split axis is not one)


def _layout(shape: Sequence[int], dn: MuonDimensionNumbers, *, where: str) -> _Layout:
    """How a leaf of ``shape`` is read as a ``(batch, rows, cols)`` stack of matrices; checks ``dn`` against it.

    A split axis is cut into ``(pieces, size / pieces)``, the pieces a batch
    axis just before the axis they cut.
    """
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"muon: the leaf at {where} has {ndim} dims; a Muon leaf needs at least 2 (give it None)")
    axes: list[tuple[int, ...]] = []
    for name in ("reduction_axis", "output_axis"):
        value = getattr(dn, name)
        if not isinstance(value, (int, tuple, list)):
            raise TypeError(f"muon: {name} at {where} must be an int or a sequence of ints, got {value!r}")
        items = (value,) if isinstance(value, int) else tuple(value)
        for ax in items:
            if isinstance(ax, bool) or not isinstance(ax, int) or not -ndim <= ax < ndim:
                raise ValueError(f"muon: {name}={value!r} at {where} is not an axis of a {ndim}-d leaf")
        axes.append(tuple(ax % ndim for ax in items))
    red, outp = axes
    if not red or not outp or set(red) & set(outp) or len(set(red)) < len(red) or len(set(outp)) < len(outp):
        raise ValueError(f"muon: the reduction and output axes at {where} must be non-empty and disjoint, got {dn}")
    cuts: dict[int, int] = {}
    for group, k, name in ((red, dn.reduction_split, "reduction"), (outp, dn.output_split, "output")):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"muon: {name}_split at {where} must be an int >= 1, got {k!r}")
        if k > 1:
            if len(group) != 1 or shape[group[0]] % k:
                raise ValueError(
                    f"muon: {name}_split={k} at {where} needs one {name} axis whose size it divides, "
                    f"got axes {group} of shape {tuple(shape)}"
                )
            cuts[group[0]] = k
    split: list[int] = []
    moved: dict[int, int] = {}  # each axis of the leaf -> its axis in the split shape
    for ax, n in enumerate(shape):
        if ax in cuts:
            split.append(cuts[ax])
            n //= cuts[ax]
        moved[ax] = len(split)
        split.append(n)
    own_batch = frozenset(ax for ax in range(ndim) if ax not in red and ax not in outp)
    red, outp = tuple(moved[ax] for ax in red), tuple(moved[ax] for ax in outp)
    batch = tuple(ax for ax in range(len(split)) if ax not in red and ax not in outp)
    perm = batch + red + outp
    inv = tuple(sorted(range(len(split)), key=lambda i: perm[i]))
    size = lambda group: math.prod([split[ax] for ax in group])
    flat = (size(batch), size(red), size(outp))
    return _Layout(tuple(split), perm, inv, flat, tuple(split[ax] for ax in perm), own_batch)


# --- the Newton–Schulz iteration on local tensors ------------------------------------------------


def _iteration_args(
    ns_coeffs: Any, ns_steps: Any, preconditioning: Any, eps: Any, ns_dtype: Any, *, name: str
) -> tuple[tuple[tuple[float, float, float], ...], Scalar]:
    """The iteration's arguments, checked: one ``(a, b, c)`` row per iteration (as optax reads ``ns_coeffs`` and
    ``ns_steps``), and ``eps``; checks ``preconditioning`` and ``ns_dtype`` too."""
    ns_steps = check.integer(ns_steps, arg="ns_steps", name=name, minimum=0)
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"{name}: preconditioning must be one of {_PRECONDITIONINGS}, got {preconditioning!r}")
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in _NS_COEFFS_PRESETS:
            raise ValueError(f"{name}: unknown ns_coeffs preset {ns_coeffs!r}; known: {sorted(_NS_COEFFS_PRESETS)}")
        ns_coeffs = _NS_COEFFS_PRESETS[ns_coeffs]
    # Plain Python, no tensor: under inject_hyperparams this runs again inside every (compiled) step.
    c = ns_coeffs.tolist() if hasattr(ns_coeffs, "tolist") else ns_coeffs
    num = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # (True, False, True) is not 1, 0, 1
    try:
        flat = all(map(num, c))
        rows = [tuple(c)] if flat else [tuple(r) for r in c]
    except TypeError:
        flat, rows = False, [(None,)]
    if not all(num(v) for r in rows for v in r):
        raise TypeError(f"{name}: ns_coeffs must be three numbers or a sequence of triples, got {ns_coeffs!r}")
    if not all(math.isfinite(v) for r in rows for v in r):
        raise ValueError(f"{name}: ns_coeffs must be finite, got {ns_coeffs!r}")
    if not rows or any(len(r) != 3 for r in rows):
        raise ValueError(f"{name}: ns_coeffs must have shape (3,) or (n, 3), got {ns_coeffs!r}")
    if not flat and len(rows) > ns_steps:
        raise ValueError(f"{name}: {len(rows)} rows of ns_coeffs need ns_steps >= {len(rows)}, got {ns_steps}")
    eps = check.non_negative(eps, arg="eps", name=name, tensor=True)
    check.dtype(ns_dtype, arg="ns_dtype", name=name, floating=True)
    return tuple(tuple(map(float, r)) for r in (rows * ns_steps if flat else rows)), eps  # type: ignore[misc]


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
      ns_steps: the number of iterations; a sequence of rows runs each row once and needs ``ns_steps`` at least
        its length (as optax's ``scale_by_muon``).
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
    rows, eps = _iteration_args(ns_coeffs, ns_steps, preconditioning, eps, ns_dtype, name="newton_schulz")
    tu.check_tensors([x], [()], what="newton_schulz: x")
    dn = dimension_numbers if dimension_numbers is not None else MuonDimensionNumbers()
    if not isinstance(dn, MuonDimensionNumbers):
        raise TypeError(f"newton_schulz: dimension_numbers must be a MuonDimensionNumbers, got {type(dn).__name__}")
    return _orthogonalize([x], rows, preconditioning, eps, [_layout(x.shape, dn, where="<x>")], ns_dtype)[0]


def _transposed(lay: _Layout, preconditioning: str) -> bool:
    """Whether the iteration runs on the transpose of the ``(reduction, output)`` matrix: on the wide side.

    A square matrix is transposed too (back to a torch ``(out, in)`` weight, where
    torch.optim.Muon iterates it, so bf16 agrees bit for bit), except under AOL,
    whose row scaling depends on the side: there optax's side, which iterates
    a 2-d leaf as stored whatever its dimension numbers, and any other leaf as
    ``(reduction, output)``.
    """
    rows, cols = lay.flat[1:]
    if rows != cols or preconditioning != "aol":
        return rows >= cols
    return lay.perm == (1, 0)


def _oriented(x: torch.Tensor, lay: _Layout, tr: bool) -> torch.Tensor:
    """``x`` as the ``(batch, rows, cols)`` view the iteration runs on (its wide side)."""
    m = x.reshape(lay.split).permute(lay.perm).reshape(lay.flat)
    return m.mT if tr else m


def _column_major(v: torch.Tensor) -> bool:
    return not v.is_contiguous() and v.mT.is_contiguous()


def _stack_key(x: torch.Tensor, lay: _Layout, preconditioning: str) -> tuple[Any, ...] | None:
    """What single-matrix leaves must share to be stacked into one batched iteration; ``None``: never stacked.

    Leaves stack with the memory layout of their wide view (a tall ``(out, in)``
    weight is a transposed view), so each matrix is multiplied in the layout
    ``torch.optim.Muon`` multiplies it in: CPU kernels differ in speed by layout.
    """
    if lay.flat[0] != 1 or x.is_complex():
        return None
    tr = _transposed(lay, preconditioning)
    v = _oriented(x, lay, tr)[0]
    return tuple(v.shape), _column_major(v), x.dtype, x.device


def _orthogonalize(
    xs: Sequence[torch.Tensor],
    rows: Sequence[tuple[float, float, float]],
    preconditioning: str,
    eps: Scalar,
    lays: Sequence[_Layout],
    ns_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    """The iteration on each (local, whole) tensor ``xs[i]``, read with ``lays[i]``; each result in its shape and dtype.

    Several tensors are single matrices of one :func:`_stack_key`, iterated as
    one stack: the same operations on every matrix, as ``bmm``, a few kernels
    for the group instead of a few per matrix. That costs a transient copy of
    the group in its own dtype (the stack, before the cast to ``ns_dtype``),
    and the iteration's working set for the whole group at once; the results
    are views of one buffer.
    """
    if any(x.is_complex() for x in xs):
        raise TypeError("muon: complex leaves are not supported (torch.optim.Muon refuses them too)")
    trs = [_transposed(lay, preconditioning) for lay in lays]
    views = [_oriented(x, lay, tr) for x, lay, tr in zip(xs, lays, trs)]  # (batch, rows, cols), on the wide side
    if len(views) == 1:
        stack = views[0]
    elif _column_major(views[0][0]):  # stack the transposes, so every matrix keeps its layout
        stack = torch.cat([v.mT for v in views]).mT
    else:
        stack = torch.cat(views)
    stack = stack.to(ns_dtype if ns_dtype is not None else xs[0].dtype)  # rebound: the stack's copy is freed
    if stack.shape[0] == 1:  # one matrix: the 2-d ops torch.optim.Muon uses, so bf16 results agree bit for bit
        y = _ns(stack[0], rows, preconditioning, eps).unsqueeze(0)
    else:
        y = _ns(stack, rows, preconditioning, eps)
    y = y.to(xs[0].dtype)
    out = []
    for yi, x, lay, tr in zip([y] if len(xs) == 1 else y.unbind(0), xs, lays, trs):  # a stack: one matrix each
        out.append((yi.mT if tr else yi).reshape(lay.unflat).permute(lay.inv).reshape(x.shape))
    return out


def _ns(x: torch.Tensor, rows: Sequence[tuple[float, float, float]], pre: str, eps: Scalar) -> torch.Tensor:
    """The iteration on one matrix ``(r, c)`` or a stack ``(b, r, c)``: ``addmm`` for one, as torch.optim.Muon, ``baddbmm`` for a stack."""
    e = lw.as_tensor(eps, x)
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm
    if pre == "frobenius":
        x = x / (torch.linalg.matrix_norm(x, keepdim=True) + e)
    elif pre == "spectral":
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # the SVD has no fp16/bf16; fp64 stays fp64
        x = x / (torch.linalg.matrix_norm(wide, ord=2, keepdim=True).to(x.dtype) + e)
    for i, (a, b, c) in enumerate(rows):
        gram = x @ x.mT
        if i == 0 and pre == "aol":
            s = torch.rsqrt(torch.clamp(gram.abs().sum(dim=-1), min=e)).unsqueeze(-1)
            x, gram = x * s, gram * s * s.mT
        elif i == 0 and pre == "schatten":
            s = torch.rsqrt(torch.clamp(torch.linalg.matrix_norm(gram, keepdim=True), min=e))
            x, gram = x * s, gram * s**2
        update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, update, x, beta=a)
    return x


def _ns_flops(lay: _Layout, steps: int) -> int:
    """Multiply-adds ×2 of the iteration on one leaf: per step ``X Xᵀ``, ``A A`` and ``B X`` on the wide side."""
    b, r, c = lay.flat
    m, n = min(r, c), max(r, c)
    return b * steps * (4 * m * m * n + 2 * m * m * m)


# --- which leaves are Muon's, and with which dimension numbers ------------------------------------


class _Matrices(NamedTuple):
    """An updates tree's Muon leaves: their positions among its leaves, dimension numbers, paths and layouts."""

    idx: list[int]
    dims: list[MuonDimensionNumbers]
    paths: list[str]
    layouts: list[_Layout]  # of the global (unsharded) shapes


def _matrices(dims_arg: Any, updates: PyTree, leaves: Sequence[Any], *, name: str) -> _Matrices:
    dims = _resolve_dims(dims_arg, updates, name=name)
    paths = [tu.path_str(p) for p in tu.paths(updates)]
    idx = [j for j, d in enumerate(dims) if d is not None]
    lays = [_layout(tuple(leaves[j].shape), dims[j], where=paths[j]) for j in idx]  # type: ignore[arg-type]
    return _Matrices(idx, [dims[j] for j in idx], [paths[j] for j in idx], lays)  # type: ignore[misc]


def _selector(dims_arg: Any, *, name: str) -> Callable[[PyTree, list[Any], Any], _Matrices]:
    """``select(updates, leaves, spec)``: :func:`_matrices`, computed once per tree structure and shapes.

    So a function given as the dimension numbers is called once per structure
    and shapes, as optax's is once per trace, and a step does not rebuild it.
    """
    cache: dict[Any, _Matrices] = {}

    def select(updates: PyTree, leaves: list[Any], spec: Any) -> _Matrices:
        key = (spec, tuple(x.shape for x in leaves))
        return cached(cache, key, lambda: _matrices(dims_arg, updates, leaves, name=name))

    return select


def cached(cache: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` when missing; the cache is emptied when it holds more than 8 entries."""
    if torch.compiler.is_compiling():  # dynamo's treespec in the key is unhashable; a trace runs make() once anyway
        return make()
    value = cache.get(key)
    if value is None:
        value = make()
        if len(cache) > 8:
            cache.clear()
        cache[key] = value
    return value


def _resolve_dims(dims: Any, updates: PyTree, *, name: str) -> list[MuonDimensionNumbers | None]:
    """One dimension-numbers entry per (non-None) leaf of ``updates``; ``None`` where a leaf is not Muon's."""
    if dims is None:  # the default 2-d rule: every matrix is an (out, in) weight, the rest pass through
        return [MuonDimensionNumbers() if x.ndim == 2 else None for x in tu.flatten(updates)[0]]
    if callable(dims):
        dims = dims(updates)
    if isinstance(dims, MuonDimensionNumbers):  # one for every leaf (no tree of constants for dynamo to build)
        return [dims] * len(tu.flatten(updates)[0])
    entry = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # one leaf, though a NamedTuple
    try:
        spread = optree.tree_broadcast_prefix(dims, updates, is_leaf=entry)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: the dimension numbers are not a prefix of the updates tree: {e!s:.300}") from None
    out = []
    for leaf, d in zip(optree.tree_leaves(updates, is_leaf=entry), optree.tree_leaves(spread, is_leaf=entry)):
        if leaf is None:
            continue
        if not entry(d):
            raise TypeError(f"{name}: dimension numbers must be MuonDimensionNumbers or None, got {d!r:.100}")
        out.append(d)
    return out
