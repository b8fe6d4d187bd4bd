"""Leaf-by-leaf helpers shared by the optimizers and the optax-parity transforms (adam, trace, ema, lion, ...).

Every helper works on the local shard of a DTensor and wraps the result the way
its template is wrapped, so elementwise math never communicates. Nothing here
reads a tensor value back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradtx.core import foreach as fe
from gradtx.core import tree as tu
from gradtx.core.base import PyTree


def tensor_leaves(tree: PyTree, *, name: str, what: str) -> tuple[list[torch.Tensor], Any]:
    """The leaves of ``tree`` and its spec, after checking that every leaf is a float or complex tensor."""
    return tu.tensor_leaves(tree, what=f"{name}: {what}")


def device_of(tree: PyTree) -> torch.device:
    """The device of the first tensor leaf (the local shard's), where counters live; CPU for an empty tree."""
    return tu.device_of(tree)


def zero_count(tree: PyTree) -> torch.Tensor:
    """A 0-d int64 zero beside the params, so counters never cross to the host."""
    return torch.zeros((), dtype=torch.int64, device=tu.device_of(tree))


def lmap(fn: Callable[..., torch.Tensor], tree: PyTree, *rest: PyTree) -> PyTree:
    """``fn`` over the local shards of aligned leaves; each result is wrapped like the leaf of ``tree``."""
    return tu.tree_map(lambda x, *ys: tu.like(x, fn(tu.local(x), *(tu.local(y) for y in ys))), tree, *rest)


def zeros_like_tree(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """Zeros mirroring ``tree`` (a DTensor stays one, with its placements), in ``dtype`` or each leaf's own."""
    return tu.tree_map(lambda x: torch.zeros_like(x, dtype=dtype or x.dtype, requires_grad=False), tree)


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
    if isinstance(value, torch.Tensor):
        return value.to(like.device, like.dtype)
    return value


def lowest_dtype(tree: PyTree) -> torch.dtype:
    """The lowest-precision float dtype among the leaves (optax's ``tree.dtype(params, 'lowest')``); fp32 if none."""
    dtypes = _float_dtypes(tree)
    return min(dtypes, key=lambda d: d.itemsize) if dtypes else torch.float32


def highest_dtype(tree: PyTree) -> torch.dtype:
    """The highest-precision float dtype among the leaves; fp32 if none."""
    dtypes = _float_dtypes(tree)
    return max(dtypes, key=lambda d: d.itemsize) if dtypes else torch.float32


def _float_dtypes(tree: PyTree) -> list[torch.dtype]:
    return [t.dtype for t in tu.flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def plain(leaves: Sequence[Any]) -> bool:
    """Whether no leaf is a DTensor, so local shards and results need no wrapping."""
    return tu.DTensor is None or not any(issubclass(t, tu.DTensor) for t in set(map(type, leaves)))  # no loop per leaf


class Moments:
    """The updates aligned with a transform's per-param trees (moments, params), grouped for foreach kernels.

    ``groups`` holds, for each (device, dtype) of the first tree's leaves,
    ``(key, idx, g, trees)``: ``idx`` indexes the present update leaves, ``g``
    are their local shards cast to that dtype, and ``trees`` the local shards
    of each tree's leaf for them. A ``None`` update (a param with no gradient)
    leaves its moments as they are. :meth:`put` and :meth:`put_updates` store
    each group's results, and :meth:`tree` and :meth:`updates` rebuild the trees.

    Example:
      >>> ms = Moments(updates, (state.mu,), name="trace", against="its trace")
      >>> def step(key, idx, g, trees):
      ...     ms.put(0, idx, new_mu); ms.put_updates(idx, new_updates)
      >>> ms.each(step)
    """

    def __init__(self, updates: PyTree, trees: Sequence[PyTree], *, name: str, against: str, cast: bool = True):
        self.index, self.leaves, self.spec = tu.align(trees[0], updates, what=f"{name}: updates", against=against)
        self.flat = [tu.flatten(t) for t in trees]
        self.new = [list(leaves) for leaves, _ in self.flat]
        self.out = list(self.leaves)
        n = len(self.flat[0][0])
        full = self.index == list(range(n))  # every leaf has an update: the common case, no gathering
        firsts = self.flat[0][0] if full else [self.flat[0][0][i] for i in self.index]
        self.plain = plain(self.leaves) and all(plain(leaves) for leaves, _ in self.flat)
        local = (lambda xs: list(xs)) if self.plain else (lambda xs: [tu.local(x) for x in xs])
        g_all = local(self.leaves)
        firsts_local = local(firsts)
        others = [local(leaves if full else [leaves[i] for i in self.index]) for leaves, _ in self.flat[1:]]
        self._check = lambda: tu.check_devices(firsts, self.leaves, updates, what=f"{name}: updates", against=against)
        grouped = fe.group_by_device_dtype(firsts_local)
        self.groups = []
        for key, idx in grouped:
            one = len(grouped) == 1
            g = g_all if one else [g_all[j] for j in idx]
            g = [x if x.dtype == key[1] else x.to(key[1]) for x in g] if cast else g
            trees_ = [xs if one else [xs[j] for j in idx] for xs in (firsts_local, *others)]
            self.groups.append((key, idx, g, trees_))

    def each(self, step: Callable[..., None]) -> None:
        """``step(key, idx, g, trees)`` for every group; a leaf on another device is reported by its path."""
        try:
            for group in self.groups:
                step(*group)
        except RuntimeError:
            self._check()  # raises a ValueError naming the leaf when a device mismatch was the cause
            raise

    def put(self, k: int, idx: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Store a group's new local leaves of tree ``k``, each in its old leaf's dtype."""
        new, templates = self.new[k], self.flat[k][0]
        for j, r in zip(idx, results):
            i = self.index[j]
            r = r if r.dtype == templates[i].dtype else r.to(templates[i].dtype)
            new[i] = r if self.plain else tu.like(templates[i], r)

    def put_updates(self, idx: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Store a group's new local updates, each in the dtype its update came in."""
        for j, r in zip(idx, results):
            u = self.leaves[j]
            r = r if r.dtype == u.dtype else r.to(u.dtype)
            self.out[j] = r if self.plain else tu.like(u, r)

    def tree(self, k: int) -> PyTree:
        """Tree ``k`` with the stored leaves (the old ones where no update came)."""
        return tu.unflatten(self.flat[k][1], self.new[k])

    def updates(self) -> PyTree:
        return tu.unflatten(self.spec, self.out)
