"""Leaf-by-leaf helpers shared by the optimizers and the optax-parity transforms (adam, trace, ema, lion, ...).

Every helper works on the local shard of a DTensor and wraps the result the way
its template is wrapped, so elementwise math never communicates. Nothing here
reads a tensor value back to the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradtx.core import foreach as fe
from gradtx.core import tree as tu

PyTree = Any


def zero_count(tree: PyTree) -> torch.Tensor:
    """A 0-d int64 zero beside the params (the first leaf's device), so counters never cross to the host."""
    return torch.zeros((), dtype=torch.int64, device=tu.device_of(tree))


def lmap(fn: Callable[..., torch.Tensor], tree: PyTree, *rest: PyTree) -> PyTree:
    """``fn`` over the local shards of aligned leaves; each result is wrapped like the leaf of ``tree``."""
    return tu.tree_map(lambda x, *ys: tu.like(x, fn(tu.local(x), *(tu.local(y) for y in ys))), tree, *rest)


def lmap_updates(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    updates: PyTree,
    trees: Sequence[PyTree],
    *,
    what: str,
    against: str,
    names: Sequence[str] = (),
) -> tuple[PyTree, list[PyTree]]:
    """``fn(g, *leaves) -> (update, *new_leaves)`` over each update leaf and its leaves in ``trees`` (which
    mirror the params), on local shards, each result wrapped like its template; the first ``len(new_leaves)``
    trees get the new leaves. A ``None`` update (a param with no gradient) stays ``None`` and leaves its
    leaves as they were. Returns the updates and those trees.

    ``updates`` must match ``trees[0]`` (``what`` and ``against`` name them in the error), and each later
    tree must match it leaf for leaf (``names`` names them: ``"sam: params"``)."""
    index, leaves, spec = tu.align(trees[0], updates, what=what, against=against)
    flat = [tu.flatten(tree) for tree in trees]
    tu.check_placed(what, trees[0], index, leaves, flat[0][0])
    for tree, (xs, other), name in zip(trees[1:], flat[1:], names, strict=True):
        if other != flat[0][1] or not same_shapes(xs, flat[0][0]):
            tu.check_structure(trees[0], tree, what=name, against=against)
    new = [list(xs) for xs, _ in flat]
    out = []
    try:
        for j, g in zip(index, leaves):
            olds = [xs[j] for xs, _ in flat]
            u, *results = fn(tu.local(g), *map(tu.local, olds))
            out.append(tu.like(g, u))
            for k, r in enumerate(results):
                new[k][j] = tu.like(olds[k], r)
    except RuntimeError:  # a leaf on another device than its state or params: a ValueError naming it, as Moments.each
        for (xs, _), name in zip(flat, [against, *names]):
            tu.check_devices([xs[j] for j in index], leaves, updates, what=what, against=name)
        raise
    return tu.unflatten(spec, out), [tu.unflatten(s, xs) for xs, (_, s) in zip(new, flat)]


def zeros_like_tree(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """Zeros mirroring ``tree`` (a DTensor stays one, with its placements), in ``dtype`` or each leaf's own."""
    return tu.tree_map(lambda x: torch.zeros_like(x, dtype=dtype or x.dtype, requires_grad=False), tree)


def moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for low-precision floating params, the param's own dtype otherwise."""
    if dtype.is_floating_point and dtype.itemsize < 4:
        return torch.float32
    return dtype


def zeros_moments(params: PyTree, dtype: torch.dtype | None = None, *, what: str) -> PyTree:
    """Zeros mirroring ``params`` (checked to be tensors; ``what`` names them), in ``dtype`` or :func:`moment_dtype`."""
    leaves, spec = tu.tensor_leaves(params, what=what)
    # zeros_like keeps a DTensor a DTensor (same mesh and placements) and keeps strides.
    zeros = [torch.zeros_like(p, dtype=dtype or moment_dtype(p.dtype), requires_grad=False) for p in leaves]
    return tu.unflatten(spec, zeros)


def promoted(*lists: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A group's grads and moments, all in the dtype they promote to: optax computes a moment in the grads'
    precision and only stores it in ``mu_dtype``."""
    work = functools.reduce(torch.promote_types, {x.dtype for xs in lists for x in xs})
    return [[x.to(work) for x in xs] for xs in lists]


def clone_tree(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A copy of ``tree`` that shares no storage with it (and never requires grad), optionally cast."""
    return tu.tree_map(lambda x: x.detach().to(dtype or x.dtype, copy=True), tree)


def where_tree(cond: torch.Tensor, if_true: PyTree, if_false: PyTree) -> PyTree:
    """``torch.where(cond, a, b)`` leaf by leaf over two trees of one structure; non-tensor leaves come from ``if_true``."""

    def pick(a: Any, b: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        a_local = tu.local(a)
        return tu.like(a, torch.where(cond.to(a_local.device), a_local, tu.local(b).to(a_local.dtype)))

    return tu.tree_map(pick, if_true, if_false)


def as_tensor(value: Any, like: torch.Tensor) -> Any:
    """A tensor hyperparameter on ``like``'s device, in its dtype; a Python number stays one."""
    return value.to(like.device, like.dtype) if isinstance(value, torch.Tensor) else value


def lowest_dtype(tree: PyTree) -> torch.dtype:
    """The lowest-precision float dtype among the leaves (optax's ``tree.dtype(params, 'lowest')``); fp32 if none."""
    return min(_float_dtypes(tree), key=lambda d: d.itemsize, default=torch.float32)


def highest_dtype(tree: PyTree) -> torch.dtype:
    """The highest-precision float dtype among the leaves; fp32 if none."""
    return max(_float_dtypes(tree), key=lambda d: d.itemsize, default=torch.float32)


def _float_dtypes(tree: PyTree) -> list[torch.dtype]:
    return [t.dtype for t in tu.flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def one_group(leaves: Sequence[Any]) -> tuple[torch.device, torch.dtype] | None:
    """``(device, dtype)`` when every leaf is a plain dense tensor, all on one device in one dtype, else ``None``.

    Read without a Python loop per leaf: the check a fast path makes before one foreach launch over all leaves.
    """
    types = set(map(type, leaves))  # (no leaves: no dtype, so None below)
    if not all(
        issubclass(t, torch.Tensor) and not (tu.DTensor is not None and issubclass(t, tu.DTensor)) for t in types
    ):
        return None
    dtypes, devices = set(tu.attrs(leaves, "dtype")), set(tu.attrs(leaves, "device"))
    if len(dtypes) == 1 and len(devices) == 1 and set(tu.attrs(leaves, "layout")) == {torch.strided}:
        return devices.pop(), dtypes.pop()
    return None


def same_shapes(leaves: Sequence[Any], reference: Sequence[Any]) -> bool:
    """Whether each of ``leaves`` has its ``reference``'s shape.

    Eagerly ``is_same_size`` answers with a bool (a DTensor's compares global shapes),
    where reading ``.shape`` makes a ``torch.Size`` per leaf: one allocation the
    garbage collector counts, which on a model of many small tensors sets off
    collections every step.
    """
    if torch.compiler.is_compiling():
        return [x.shape for x in leaves] == [x.shape for x in reference]
    return len(leaves) == len(reference) and all(map(torch.Tensor.is_same_size, leaves, reference))


def _flatten_alike(trees: Sequence[PyTree]) -> list[tuple[list[Any], Any]]:
    """Each tree's leaves and structure. The updates and a transform's state trees mirror one another (its
    ``init`` made them together), so the later ones are read through the first's structure, several times faster
    than a flatten (which sorts every dict's keys). A later tree with ``None`` or a subtree where the first has a
    leaf gets that as its leaf, which the callers' type checks refuse; one whose structure differs otherwise is
    flattened on its own."""
    first = tu.flatten(trees[0])
    out = [first]
    for tree in trees[1:]:
        try:
            out.append((first[1].flatten_up_to(tree), first[1]))
        except (ValueError, TypeError):
            out.append(tu.flatten(tree))
    return out


class Moments:
    """The updates aligned with a transform's per-param trees (moments, params), grouped for foreach kernels.

    ``groups`` holds, for each (device, dtype) of the first tree's leaves,
    ``(key, idx, g, trees)``: ``idx`` indexes the present update leaves, ``g``
    are their local shards cast to that dtype, and ``trees`` the local shards
    of each tree's leaf for them. A ``None`` update (a param with no gradient)
    leaves its moments as they are. :meth:`put` and :meth:`put_updates` store
    each group's results, and :meth:`tree` and :meth:`updates` rebuild the trees.
    The common case, every leaf a plain tensor with an update, in one (device,
    dtype), costs no Python loop over the leaves.

    Example:
      >>> ms = Moments(updates, (state.mu,), name="trace", against="its trace")
      >>> def step(key, idx, g, trees):
      ...     ms.put(0, idx, new_mu); ms.put_updates(idx, new_updates)
      >>> ms.each(step)
    """

    def __init__(self, updates: PyTree, trees: Sequence[PyTree], *, name: str, against: str):
        *self.flat, (leaves, spec) = _flatten_alike([*trees, updates])
        ref, ref_spec = self.flat[0]
        held = [xs for xs, _ in self.flat]
        # Read without a Python loop per leaf (``map`` with C getters): every step sets up the common case, every
        # leaf a plain dense tensor with an update shaped as its moments', in one (device, dtype), this way.
        types = set(map(type, leaves)).union(*(map(type, xs) for xs in held))
        tensors = all(issubclass(t, torch.Tensor) for t in types)
        dtypes = set(tu.attrs(leaves, "dtype")) if tensors else set()
        self.plain = tu.DTensor is None or not any(issubclass(t, tu.DTensor) for t in types)
        self.full = (  # every leaf has an update, checked; else tu.align matches them and names a bad one
            tensors
            and spec == ref_spec
            and (not leaves or set(tu.attrs(leaves, "layout")) == {torch.strided})
            and all(d.is_floating_point or d.is_complex for d in dtypes)
            and same_shapes(leaves, ref)
        )
        if self.full:
            self.index, self.leaves, self.spec = list(range(len(leaves))), leaves, spec
        else:  # (the present leaves of the updates, as flattened above)
            self.index, self.leaves, self.spec = tu.align(trees[0], updates, what=f"{name}: updates", against=against)
        if not self.plain:
            tu.check_placed(f"{name}: updates", trees[0], self.index, self.leaves, ref)
        self.new = [list(xs) for xs in held]
        self.out = list(self.leaves)
        kept = held if self.full else [[xs[i] for i in self.index] for xs in held]  # those with an update
        local = (lambda xs: xs) if self.plain else tu.local_shards
        g_all, trees_local = local(self.leaves), [local(xs) for xs in kept]
        self._check = lambda: tu.check_devices(kept[0], self.leaves, updates, what=f"{name}: updates", against=against)
        key = one_group(trees_local[0])
        if key is not None:
            self.cast = dtypes != {key[1]}
            g = [x if x.dtype == key[1] else x.to(key[1]) for x in g_all] if self.cast else g_all
            self.groups = [(key, list(range(len(g_all))), g, trees_local)]
            return
        self.cast, self.groups = True, []
        for key, idx in fe.group_by_device_dtype(trees_local[0]):
            g = [g_all[j] if g_all[j].dtype == key[1] else g_all[j].to(key[1]) for j in idx]
            self.groups.append((key, idx, g, [[xs[j] for j in idx] for xs in trees_local]))

    def each(self, step: Callable[..., None]) -> None:
        """``step(key, idx, g, trees)`` for every group; a leaf on another device is reported by its path."""
        try:
            for group in self.groups:
                step(*group)
        except RuntimeError:
            self._check()  # raises a ValueError naming the leaf when a device mismatch was the cause
            raise

    def put(self, k: int, idx: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Store a group's new local leaves of tree ``k`` (in that tree's dtypes, as the group's are)."""
        new, templates = self.new[k], self.flat[k][0]
        if self.plain and self.full and len(idx) == len(new):
            new[:] = results
            return
        for j, r in zip(idx, results):
            i = self.index[j]
            new[i] = r if self.plain else tu.like(templates[i], r)

    def put_updates(self, idx: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Store a group's new local updates, each in the dtype its update came in."""
        if self.plain and not self.cast and len(idx) == len(self.out):
            self.out[:] = results
            return
        for j, r in zip(idx, results):
            u = self.leaves[j]
            r = r if r.dtype == u.dtype else r.to(u.dtype)
            self.out[j] = r if self.plain else tu.like(u, r)

    def tree(self, k: int) -> PyTree:
        """Tree ``k`` with the stored leaves (the old ones where no update came)."""
        return tu.unflatten(self.flat[k][1], self.new[k])

    def updates(self) -> PyTree:
        return tu.unflatten(self.spec, self.out)
