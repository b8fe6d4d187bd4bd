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

import inspect
import operator
from typing import Any

import torch

from gradtx.checkpoint import layout as lo
from gradtx.core import tree as tu
from gradtx.core.base import GradientTransformation, OptState
from gradtx.wrapper.rules import has_none

ParamTree = list[list[torch.Tensor]]


def trainable(groups: list[dict[str, Any]]) -> ParamTree:
    """One list per param group: the params that require grad."""
    return [[p for p in g["params"] if p.requires_grad] for g in groups]


def joined(
    tree: ParamTree, groups: list[dict[str, Any]], frozen: list[torch.Tensor], summed: bool = False
) -> ParamTree | None:
    """The tree grown by the params frozen at its build (``frozen``) that have a grad since (unfrozen, or holding
    one from before: torch.optim steps every param with a grad, whatever its ``requires_grad``), or None if none has.
    Where every rank must grow alike, with ``summed`` (grads summed over ranks) or DTensor params (whose norms
    all-reduce), it grows by those that require a grad, at the same step on every rank whichever ranks hold one."""
    summed = summed or tu.has_dtensor(frozen)
    if not any(p.grad is not None or (summed and p.requires_grad) for p in frozen):
        return None
    seen = {id(p) for p in tu.flatten(tree)[0]}
    return [
        [p for p in g["params"] if id(p) in seen or p.grad is not None or (summed and p.requires_grad)] for g in groups
    ]


def regrow(tx: GradientTransformation, state: OptState, old: ParamTree, new: ParamTree) -> OptState:
    """The state for the tree ``new``: each param of ``old`` keeps its per-param state, new params start fresh.

    Params are matched by identity, not position, so a param joining in the
    middle of a group shifts nothing; a global leaf in a tree like the params
    (a masked member's state, None where masked) follows its param too. Other
    global state (counters, the window's bookkeeping) is kept as it is.
    """
    fresh = tx.init(new)
    old_layout = lo.layout_of(state, old)
    old_flat, new_flat = tu.flatten(old)[0], tu.flatten(new)[0]
    old_ids = [id(p) for p in old_flat]
    old_key = {(id(old_flat[i]), head, tail): key for key, (i, head, tail) in old_layout.places.items()}
    places = lo.layout_of(fresh, new).places

    def rebuild(kind: str, node: Any, key: str) -> Any:
        if kind == "global":
            if key in places:  # its param's piece where the param was, none for a param new here
                i, head, tail = places[key]
                key = old_key.get((id(new_flat[i]), head, tail), "")
            prev = old_layout.globals_.get(key)
            same = isinstance(prev, torch.Tensor) and isinstance(node, torch.Tensor) and prev.shape == node.shape
            return prev if same else node
        if kind == "acc" or old_layout.per_param.get(key) is None:
            return node
        old_leaf = dict(zip(old_ids, tu.flatten(old_layout.per_param[key])[0]))  # by param identity
        leaves, spec = tu.flatten(node)
        return tu.unflatten(spec, [old_leaf.get(id(p), t) for p, t in zip(new_flat, leaves)])

    return lo.walk(fresh, new, rebuild)[1]


def in_groups(opt: Any, places: dict[str, tuple[int, str, str]], globals_: Any, *, out: bool = True) -> Any:
    """``globals_`` with each key at a param's place in the transform's tree (``places``, from the state's
    :class:`~gradtx.checkpoint.layout.Layout`) keyed by the param's place in the param groups instead (``out``), or back.

    Places in the tree move when a frozen param joins it; in the groups they do not, so a checkpoint keyed by them
    loads into a template made before the param joined (``dcp.load``).
    """
    if not isinstance(globals_, dict):
        return globals_
    index = [{id(q): j for j, q in enumerate(g["params"])} for g in opt.optimizer.param_groups]
    grouped = [f"{n}/{index[n].get(id(p))}" for n, ps in enumerate(opt._tree) for p in ps]
    name = {key: f"{head}/{grouped[i]}{tail}".lstrip("/") for key, (i, head, tail) in places.items()}
    name = name if out else {v: k for k, v in name.items()}
    return {name.get(key, key): value for key, value in globals_.items()}


def check_groups(groups: list[dict[str, Any]], tree: ParamTree) -> None:
    """Refuse param groups added behind the wrapper's back (the transform state has none for them)."""
    if len(groups) != len(tree):
        raise ValueError(
            f"TransformedOptimizer: the inner optimizer has {len(groups)} param groups, the transform state was "
            f"built for {len(tree)}; add groups with opt.add_param_group (the wrapper's), "
            "not opt.optimizer.add_param_group"
        )


def same_lists(lists: ParamTree, groups: list[dict[str, Any]]) -> bool:
    """Whether each group lists the params of ``lists``, by identity (a hand edit appends, removes or replaces one)."""
    return all(len(a) == len(g["params"]) and all(map(operator.is_, a, g["params"])) for a, g in zip(lists, groups))


def check_unique(groups: list[dict[str, Any]]) -> None:
    """Refuse a param listed twice: the transform would count it twice (its square twice in a norm)."""
    seen: dict[int, tuple[int, int]] = {}
    for i, g in enumerate(groups):
        for j, p in enumerate(g["params"]):
            if id(p) in seen:
                a, b = seen[id(p)]
                raise ValueError(
                    f"TransformedOptimizer: param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)}) is the same "
                    f"tensor as param_groups[{a}]['params'][{b}]; list each parameter once (a norm would count it "
                    "twice, and the inner optimizer would step it twice)"
                )
            seen[id(p)] = (i, j)


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's ``step`` requires a closure (LBFGS: it reevaluates the model itself)."""
    param = inspect.signature(type(optimizer).step).parameters.get("closure")
    return param is not None and param.default is inspect.Parameter.empty


def read(params: ParamTree, emitting: bool, *, summed: bool, tied: frozenset[int] = frozenset()) -> Any:
    """The params' grads as the transform's tree.

    A param without a grad reads zeros on an emitting step (so a member's
    per-param state moves for it as for a zero grad: a user's transform
    written as optax writes them takes no ``None``), and an empty tensor on
    a held one (the window only counts: a missing grad there, as under
    FSDP2's no-sync, costs no allocation). Its ``.grad`` stays ``None``, so
    the inner optimizer skips it, unless the grads are summed over the ranks
    (``summed``: a window's, or ``cp_reduce``), or it is a copy of a weight tied across stages (its
    flat index in ``tied``, summed by ``pp_reduce``): the param may have a grad
    on another rank, so on an emitting step it takes zeros into ``.grad`` and
    steps on the sum as it does there.
    """
    tree = [[p.grad for p in group] for group in params]
    if not any(map(has_none, tree)):
        return tree
    if emitting and (summed or tied):
        for i, p in enumerate(tu.flatten(params)[0]):
            if p.grad is None and (summed or i in tied):
                p.grad = torch.zeros_like(p)
    return [[p.grad if p.grad is not None else missing(p, emitting) for p in group] for group in params]


def missing(p: torch.Tensor, emitting: bool) -> torch.Tensor:
    """What :func:`read` gives a param without a grad: zeros on an emitting step, an empty tensor on a held one."""
    return torch.zeros_like(p) if emitting else torch.empty(0, dtype=p.dtype, device=tu.local(p).device)


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


def not_holding(updates: ParamTree, held: Any) -> ParamTree:
    """``updates``, with every leaf that shares storage with a tensor of ``held`` (a state, the params) copied.

    Traced, :func:`write` copies into ``.grad`` anyway, so nothing is checked.
    """
    if torch.compiler.is_compiling():
        return updates
    storages = {_storage(t) for t in tu.flatten(held)[0] if isinstance(t, torch.Tensor)} - {None}
    return [[u.clone() if _storage(u) in storages else u for u in group] for group in updates]


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s (local) data lives; ``None`` for a sparse tensor (SparseAdam's grads), which has no storage."""
    t = tu.local(t)
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else None


def names(groups: list[dict[str, Any]], params: ParamTree) -> list[str]:
    """How messages name each param of ``params``: its place in the param groups and its shape."""
    where = {
        id(p): f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
        for i, g in enumerate(groups)
        for j, p in enumerate(g["params"])
    }
    return [where[id(p)] for p in tu.flatten(params)[0]]
