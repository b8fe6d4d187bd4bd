"""Combinators: chain, named_chain, masked, partition; and apply_updates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Self, cast

import torch

from gradtx import tree as tu
from gradtx.base import GradientTransformation, OptState, Params, PyTree, ScalarTransformation, Updates


class Chain(GradientTransformation):
    """What :func:`chain` and :func:`named_chain` return: a transform that keeps its members.

    Attributes:
      members: the member transforms, in order.
      names: the members' names (:func:`named_chain`, state a dict), or ``None``
        (:func:`chain`, state a tuple).
    """

    members: tuple[GradientTransformation, ...]
    names: tuple[str, ...] | None

    def __new__(
        cls,
        init: Any,
        update: Any,
        members: Sequence[GradientTransformation],
        names: Sequence[str] | None = None,
    ) -> Self:
        self = super().__new__(cls, init, update)
        self.members = tuple(members)
        self.names = None if names is None else tuple(names)
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle rebuild it with every field
        return (self.init, self.update, self.members, self.names)

    def member_states(self, state: OptState) -> list[OptState]:
        """The members' states, in member order, from this chain's state (checked like ``update`` checks it)."""
        if state is None:
            name = "named_chain" if self.names is not None else "chain"
            raise ValueError(f"{name}: state is None; call init(params) before update()")
        if self.names is not None:
            if not isinstance(state, dict) or list(state) != list(self.names):
                raise ValueError(f"named_chain: expected a state dict with keys {list(self.names)}, got {state!r:.200}")
            return [state[n] for n in self.names]
        if not isinstance(state, tuple) or len(state) != len(self.members):
            raise ValueError(
                f"chain: expected a state tuple of {len(self.members)} member states, got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        return list(state)

    def join_states(self, states: Sequence[OptState]) -> OptState:
        """This chain's state from its members' states (the inverse of :meth:`member_states`)."""
        return dict(zip(self.names, states)) if self.names is not None else tuple(states)


def _run(
    txs: Sequence[GradientTransformation],
    updates: Updates,
    states: Sequence[OptState],
    params: Params | None,
    extra: dict[str, Any],
) -> tuple[Updates | None, list[OptState]]:
    # A scalar member's product is computed here, into new buffers (or the donated ones): from then
    # on the chain owns its updates, so later members may write into them (``inplace=True``), with
    # the pure path's numbers and one gradient-sized allocation fewer per member.
    owned = bool(extra.get("inplace", False))
    new_states = list(states)
    for i, tx in enumerate(txs):
        if isinstance(tx, ScalarTransformation):
            factor, new_states[i] = tx.factor(updates, states[i], params, **extra)
            leaves, spec = tu.flatten(updates)
            tu.check_tensors(leaves, tu.paths(updates), what="updates")
            updates = tu.unflatten(spec, tu.scale_leaves(leaves, factor, inplace=owned))
            owned = True
            continue
        updates, new_states[i] = tx.update(
            updates, states[i], params, **({**extra, "inplace": True} if owned else extra)
        )
        if updates is None:  # a member (accumulate) is holding: nothing downstream runs or changes
            break
    return updates, new_states


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply transforms one after another; the state is a tuple of their states.

    Every extra keyword given to ``update`` reaches every member. When a member
    returns ``None`` (an accumulation window is still open), the chain stops
    there and returns ``None``: later members neither run nor change state.

    Args:
      *txs: the transforms, applied in order.

    Returns:
      A :class:`GradientTransformation` whose state is ``tuple(member states)``.

    Example:
      >>> tx = chain(clip_by_global_norm(1.0), adamw(3e-4))
    """
    for i, tx in enumerate(txs):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain: argument {i} is a {type(tx).__name__}, not a GradientTransformation")

    def init_fn(params: Params) -> tuple[OptState, ...]:
        return tuple(tx.init(params) for tx in txs)

    def update_fn(updates, state, params=None, **extra):
        updates, new_states = _run(txs, updates, out.member_states(state), params, extra)
        return updates, out.join_states(new_states)

    out = Chain(init_fn, update_fn, txs)
    return out


def named_chain(*named_txs: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict keyed by each member's name.

    Example:
      >>> tx = named_chain(("clip", clip_by_global_norm(1.0)), ("opt", adamw(3e-4)))
      >>> state = tx.init(params); state["clip"].grad_norm
    """
    names = [name for name, _ in named_txs]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    for name, tx in named_txs:
        if not isinstance(name, str) or not isinstance(tx, GradientTransformation):
            raise TypeError(f"named_chain: expected (str, GradientTransformation) pairs, got ({name!r}, {tx!r})")
    txs = [tx for _, tx in named_txs]

    def init_fn(params: Params) -> dict[str, OptState]:
        return {name: tx.init(params) for name, tx in named_txs}

    def update_fn(updates, state, params=None, **extra):
        updates, new_states = _run(txs, updates, out.member_states(state), params, extra)
        return updates, out.join_states(new_states)

    out = Chain(init_fn, update_fn, txs, names)
    return out


# --- masked and partition -------------------------------------------------------------
#
# The inner transform sees a dict {path string: leaf} of just its leaves, so error
# messages from inside it still name the user's pytree paths.


def _labels_for(labels: PyTree | Callable[[Params], PyTree], tree: PyTree, *, name: str) -> list[Any]:
    resolved = labels(tree) if callable(labels) else labels
    _, spec = tu.flatten(tree)
    try:
        label_leaves = spec.flatten_up_to(resolved)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: labels do not match the params/updates tree: {e}") from None
    return label_leaves


def _select(tree: PyTree, keep: Sequence[bool]) -> dict[str, Any]:
    paths = tu.paths(tree)
    leaves, _ = tu.flatten(tree)
    return {tu.path_str(p): leaf for p, leaf, k in zip(paths, leaves, keep) if k}


def _merge(tree: PyTree, parts: Sequence[dict[str, Any]]) -> PyTree:
    leaves, spec = tu.flatten(tree)
    by_path = {}
    for part in parts:
        by_path.update(part)
    out = [by_path.get(tu.path_str(p), leaf) for p, leaf in zip(tu.paths(tree), leaves)]
    return tu.unflatten(spec, out)


class MaskedState(NamedTuple):
    inner_state: OptState


class PartitionState(NamedTuple):
    inner_states: dict[str, OptState]


def _check_hold(updates: Any, name: str) -> None:
    if updates is None:
        raise ValueError(f"{name}: an inner transform held (returned None); put accumulate() in the outer chain")


def masked(inner: GradientTransformation, mask: PyTree | Callable[[Params], PyTree]) -> GradientTransformation:
    """Apply ``inner`` only to the leaves where ``mask`` is True; others pass through unchanged.

    Args:
      inner: the transform to apply to the masked leaves.
      mask: a pytree of bools with the structure of the params, or a callable
        ``params -> mask``, evaluated on every call.

    Returns:
      A :class:`GradientTransformation` with state ``MaskedState(inner_state)``.

    Example:
      >>> no_bias = lambda p: {k: not k.endswith("bias") for k in p}
      >>> tx = masked(add_decayed_weights(0.1), no_bias)
    """

    def keep_of(tree: PyTree) -> list[bool]:
        flags = _labels_for(mask, tree, name="masked")
        for f in flags:
            if not isinstance(f, bool):
                raise TypeError(f"masked: mask leaves must be bool, got {type(f).__name__}")
        return flags

    def init_fn(params: Params) -> MaskedState:
        return MaskedState(inner.init(_select(params, keep_of(params))))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, MaskedState, name="masked")
        keep = keep_of(params if params is not None else updates)
        sub_params = None if params is None else _select(params, keep)
        sub, inner_state = inner.update(_select(updates, keep), state.inner_state, sub_params, **extra)
        _check_hold(sub, "masked")
        return _merge(updates, [sub]), MaskedState(inner_state)

    return GradientTransformation(init_fn, update_fn)


def partition(
    txs_by_label: Mapping[str, GradientTransformation], labels: PyTree | Callable[[Params], PyTree]
) -> GradientTransformation:
    """Apply a different transform to each labelled part of the tree.

    Args:
      txs_by_label: a transform for every label.
      labels: a pytree of labels with the structure of the params, or a
        callable ``params -> labels``.

    Returns:
      A :class:`GradientTransformation` with state ``PartitionState({label: state})``.

    Example:
      >>> labels = lambda p: {k: "no_decay" if "norm" in k else "decay" for k in p}
      >>> tx = partition({"decay": adamw(1e-3), "no_decay": adam(1e-3)}, labels)
    """
    names = list(txs_by_label)

    def label_of(tree: PyTree) -> list[str]:
        leaf_labels = _labels_for(labels, tree, name="partition")
        for path, lab in zip(tu.paths(tree), leaf_labels):
            if lab not in txs_by_label:
                raise ValueError(
                    f"partition: label {lab!r} at {tu.path_str(path)} has no transform; known labels: {names}"
                )
        return leaf_labels

    def init_fn(params: Params) -> PartitionState:
        leaf_labels = label_of(params)
        return PartitionState(
            {n: txs_by_label[n].init(_select(params, [lab == n for lab in leaf_labels])) for n in names}
        )

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, PartitionState, name="partition")
        leaf_labels = label_of(params if params is not None else updates)
        parts, new_states = [], {}
        for n in names:
            keep = [lab == n for lab in leaf_labels]
            sub_params = None if params is None else _select(params, keep)
            sub, new_states[n] = txs_by_label[n].update(
                _select(updates, keep), state.inner_states[n], sub_params, **extra
            )
            _check_hold(sub, "partition")
            parts.append(sub)
        return _merge(updates, parts), PartitionState(new_states)

    return GradientTransformation(init_fn, update_fn)


def apply_updates(params: Params, updates: Updates | None) -> Params:
    """Return ``params + updates`` as a new tree, in each param's dtype. Pure.

    ``updates`` of ``None`` (a held accumulation step) returns ``params`` itself.
    """
    if updates is None:
        return params
    tu.check_structure(params, updates, what="updates", against="params")

    p_leaves, spec = tu.flatten(params)
    u_leaves = cast(list[torch.Tensor], spec.flatten_up_to(updates))  # optree types the leaves as PyTree
    out: list[Any] = [None] * len(p_leaves)
    plain: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (p, u) in enumerate(zip(p_leaves, u_leaves)):
        if type(p) is torch.Tensor and type(u) is torch.Tensor and p.dtype == u.dtype and p.device == u.device:
            plain.setdefault((p.device, p.dtype), []).append(i)
        else:  # DTensors (placements may differ) and mixed dtypes take the ordinary op
            out[i] = (p + u).to(p.dtype) if u.dtype != p.dtype else p + u
    for idx in plain.values():  # one foreach launch per (device, dtype): the many-small-tensors case
        for i, r in zip(idx, torch._foreach_add([p_leaves[i] for i in idx], [u_leaves[i] for i in idx])):
            out[i] = r
    return tu.unflatten(spec, out)
