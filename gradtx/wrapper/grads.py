"""The wrapper's params and their ``.grad`` buffers: which params the transform sees, reading and writing grads.

The transform sees one list per param group of the params that take part:
those that required grad when the wrapper was built, and those unfrozen
later (they join at the next step, with a fresh transform state, as a
``torch.optim`` optimizer starts stepping a param once it has a grad). The
grads it reads are the params' own ``.grad`` (with :func:`gradtx.accumulate`
in the chain, autograd's summation into ``.grad`` is the accumulator), and
the result is written back into ``.grad`` for the inner optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from gradtx.checkpoint import functional as _ckpt
from gradtx.core import tree as tu
from gradtx.core.base import GradientTransformation, OptState

ParamTree = list[list[torch.Tensor]]


def trainable(groups: list[dict[str, Any]]) -> ParamTree:
    """One list per param group: the params that require grad."""
    return [[p for p in g["params"] if p.requires_grad] for g in groups]


def flat(tree: ParamTree) -> list[torch.Tensor]:
    return [p for group in tree for p in group]


def joined(tree: ParamTree, groups: list[dict[str, Any]]) -> ParamTree | None:
    """The tree grown by the params unfrozen since it was built (requires_grad and a grad), or None if none were."""
    seen = {id(p) for p in flat(tree)}
    if all(id(p) in seen or not (p.requires_grad and p.grad is not None) for g in groups for p in g["params"]):
        return None
    return [[p for p in g["params"] if id(p) in seen or (p.requires_grad and p.grad is not None)] for g in groups]


def regrow(tx: GradientTransformation, state: OptState, old: ParamTree, new: ParamTree) -> OptState:
    """The state for the tree ``new``: each param of ``old`` keeps its per-param state, new params start fresh.

    Params are matched by identity, not position, so a param joining in the
    middle of a group shifts nothing. Global state (counters, the window's
    bookkeeping) is kept as it is.
    """
    fresh = tx.init(new)
    old_layout = _ckpt._layout_of(state, old)
    index = {id(p): i for i, p in enumerate(flat(old))}
    new_flat = flat(new)
    p_leaves, p_spec = tu.flatten(new)

    def rebuild(kind: str, node: Any, key: str) -> Any:
        if kind == "global":
            prev = old_layout.globals_.get(key)
            same = isinstance(prev, torch.Tensor) and isinstance(node, torch.Tensor) and prev.shape == node.shape
            return prev if same else node
        if kind == "acc" or old_layout.per_param.get(key) is None:
            return node
        prev_leaves = tu.flatten(old_layout.per_param[key])[0]
        leaves, spec = tu.flatten(node)
        return tu.unflatten(
            spec, [prev_leaves[index[id(p)]] if id(p) in index else t for p, t in zip(new_flat, leaves)]
        )

    return _ckpt._walk(fresh, (), p_spec, p_leaves, _ckpt._Layout(), rebuild)


def read(params: ParamTree, *, emitting: bool) -> ParamTree:
    """Each param's ``.grad``; a param without one reads as zeros on an emitting step.

    Its ``.grad`` stays ``None``, so the inner optimizer skips it. A held step
    reads no grad values (accumulate comes first and only counts), so a
    missing grad there, as under FSDP2's no-sync, costs no allocation.
    """

    def missing(p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p) if emitting else torch.empty(0, dtype=p.dtype, device=tu.local(p).device)

    return [[p.grad if p.grad is not None else missing(p) for p in group] for group in params]


def write(params: ParamTree, updates: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Put ``updates`` into the params' ``.grad`` (only where a grad exists); returns (param, old grad) to undo it."""
    replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    compiling = torch.compiler.is_compiling()
    for group_params, group_updates in zip(params, updates):
        for p, u in zip(group_params, group_updates):
            if p.grad is not None and u is not p.grad:
                if compiling:
                    # Rebinding p.grad is a pending mutation of the param, which makes dynamo break the
                    # graph before the inner optimizer's _init_group; a copy into .grad is not.
                    copies.append((p.grad, u))
                else:
                    replaced.append((p, p.grad))
                    p.grad = u
    if copies:
        torch._foreach_copy_([g for g, _ in copies], [u for _, u in copies])
    return replaced


def scale(params: ParamTree, factor: torch.Tensor) -> None:
    """Multiply every existing ``.grad`` by ``factor`` (a 0-d tensor), in place."""
    tu.scale_leaves([p.grad for group in params for p in group if p.grad is not None], factor, inplace=True)


def undo(replaced: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for p, g in replaced:
        p.grad = g


def window_grads(params: ParamTree) -> list[torch.Tensor | None]:
    """An open window's partial sums, the params' ``.grad``, which pickle and deepcopy leave out of a Parameter."""
    return [None if p.grad is None else p.grad.detach() for p in flat(params)]


def put_window_grads(params: ParamTree, grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(flat(params), grads):
        if p.grad is None:
            p.grad = g


def drop(params: ParamTree) -> None:
    for p in flat(params):
        p.grad = None


def names(groups: list[dict[str, Any]], params: ParamTree) -> list[str]:
    """How messages name each param of ``params``: its place in the param groups and its shape."""
    where = {id(p): (i, j) for i, g in enumerate(groups) for j, p in enumerate(g["params"])}
    out = []
    for p in flat(params):
        i, j = where[id(p)]
        out.append(f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})")
    return out


def pids(groups: list[dict[str, Any]], params: ParamTree) -> list[int]:
    """torch.optim's state_dict index of each param of ``params``, in order."""
    index = {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
    return [index[id(p)] for p in flat(params)]
