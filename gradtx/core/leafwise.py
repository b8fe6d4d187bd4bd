"""Small leaf-by-leaf helpers shared by the optax-parity transforms (ema, lion, lookahead, schedule-free, sam, ...).

Every helper works on the local shard of a DTensor and wraps the result the way
its template is wrapped, so elementwise math never communicates. Nothing here
reads a tensor value back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradtx.core import tree as tu
from gradtx.core.base import PyTree


def tensor_leaves(tree: PyTree, *, name: str, what: str) -> tuple[list[torch.Tensor], Any]:
    """The leaves of ``tree`` and its spec, after checking that every leaf is a float or complex tensor."""
    leaves, spec = tu.flatten(tree)
    tu.check_tensors(leaves, tree=tree, what=f"{name}: {what}")
    return leaves, spec


def device_of(tree: PyTree) -> torch.device:
    """The device of the first tensor leaf (the local shard's), where counters live; CPU for an empty tree."""
    for leaf in tu.flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            return tu.local(leaf).device
    return torch.device("cpu")


def zero_count(tree: PyTree) -> torch.Tensor:
    """A 0-d int64 zero beside the params, so counters never cross to the host."""
    return torch.zeros((), dtype=torch.int64, device=device_of(tree))


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


def without_inplace(extra: dict[str, Any]) -> dict[str, Any]:
    """The extra keywords minus ``inplace``: for an inner transform whose input the caller reads again afterwards."""
    return {k: v for k, v in extra.items() if k != "inplace"}


def as_tensor(value: Any, like: torch.Tensor) -> Any:
    """A tensor hyperparameter on ``like``'s device, in its dtype; a Python number stays one."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device, like.dtype)
    return value


def float_dtypes(tree: PyTree) -> Sequence[torch.dtype]:
    return [t.dtype for t in tu.flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def lowest_dtype(tree: PyTree) -> torch.dtype:
    """The lowest-precision float dtype among the leaves (optax's ``tree.dtype(params, 'lowest')``); fp32 if none."""
    dtypes = float_dtypes(tree)
    return min(dtypes, key=lambda d: d.itemsize) if dtypes else torch.float32


def highest_dtype(tree: PyTree) -> torch.dtype:
    """The highest-precision float dtype among the leaves; fp32 if none."""
    dtypes = float_dtypes(tree)
    return max(dtypes, key=lambda d: d.itemsize) if dtypes else torch.float32
