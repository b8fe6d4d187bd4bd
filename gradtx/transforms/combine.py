"""Combinators: chain, named_chain, masked, partition; and apply_updates."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple, Self, cast

import optree

from gradtx.core import foreach as fe
from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, PyTree, Updates, _restore, factory
from gradtx.distributed.pipeline import check_chain
from gradtx.distributed.plan import NO_PLAN, plan_read_by, reads_plan


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
        names = None if names is None else tuple(names)
        return _restore(cls, (init, update), {"members": tuple(members), "names": names})

    def member_states(self, state: OptState) -> list[OptState]:
        """The members' states, in member order, from this chain's state (checked like ``update`` checks it)."""
        if state is None:
            name = "named_chain" if self.names is not None else "chain"
            raise ValueError(f"{name}: state is None; call init(params) before update()")
        if self.names is not None:
            if not isinstance(state, dict) or list(state) != list(self.names):
                raise ValueError(f"named_chain: expected a state dict with keys {list(self.names)}, got {state!r:.200}")
            return [state[n] for n in self.names]
        if type(state) is not tuple or len(state) != len(self.members):  # not a member's NamedTuple of that length
            raise ValueError(
                f"chain: expected a state tuple of {len(self.members)} member states, got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        return list(state)

    def join_states(self, states: Sequence[OptState]) -> OptState:
        """This chain's state from its members' states (the inverse of :meth:`member_states`)."""
        return dict(zip(self.names, states)) if self.names is not None else tuple(states)


@factory
def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply transforms one after another; the state is a tuple of their states.

    Every extra keyword given to ``update`` reaches every member. When a member
    returns ``None`` (an accumulation window is still open), the chain stops
    there and returns ``None``: later members neither run nor change state.

    Args:
      *txs: the transforms, applied in order.

    Returns:
      A :class:`GradientTransformation` whose state is ``tuple(member states)``.

    Raises:
      ValueError: a member computes a norm over a pipeline plan's tied weights
        (``mesh_groups=plan`` with ``tied=``) and no :func:`gradtx.pp_reduce`
        of that plan comes before it in this chain.

    Example:
      >>> tx = chain(clip_by_global_norm(1.0), adamw(3e-4))
    """
    for i, tx in enumerate(txs):
        check.transform(tx, arg=f"argument {i}", name="chain")
    return _chain(txs)


def _chain(txs: Sequence[GradientTransformation], names: Sequence[str] | None = None) -> GradientTransformation:
    """A :class:`Chain` of ``txs`` (with ``names``, a :func:`named_chain`), its tied-weight order checked once."""
    check_chain(txs, name="chain" if names is None else "named_chain")
    # The one thing a member may change for those after it: accumulate hands on the window's loss, so a
    # loss guard after it judges the whole window (a method read once here, never declared).
    hands_on = [getattr(tx, "downstream_extra", None) for tx in txs]

    def init_fn(params: Params) -> OptState:
        return out.join_states([tx.init(params) for tx in txs])

    def update_fn(updates, state, params=None, **extra):
        new_states = out.member_states(state)
        for i, tx in enumerate(txs):
            updates, new_states[i] = tx.update(updates, new_states[i], params, **extra)
            if updates is None:  # a member (accumulate) is holding: nothing downstream runs or changes
                break
            if hands_on[i] is not None:
                extra = hands_on[i](new_states[i], extra)
        return updates, out.join_states(new_states)

    out = Chain(init_fn, update_fn, txs, names)
    if any(hands_on):  # nested in another chain, this one hands on what its members hand on

        def downstream_extra(state: OptState, extra: dict[str, Any]) -> dict[str, Any]:
            for hand_on, member_state in zip(hands_on, out.member_states(state)):
                extra = hand_on(member_state, extra) if hand_on is not None else extra
            return extra

        out.downstream_extra = downstream_extra  # type: ignore[attr-defined]
    return out


@factory
def named_chain(*named_txs: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict keyed by each member's name.

    Example:
      >>> tx = named_chain(("clip", clip_by_global_norm(1.0)), ("opt", adamw(3e-4)))
      >>> state = tx.init(params); state["clip"].grad_norm
    """
    for i, pair in enumerate(named_txs):
        is_pair = isinstance(pair, tuple) and len(pair) == 2
        if not (is_pair and isinstance(pair[0], str) and isinstance(pair[1], GradientTransformation)):
            raise TypeError(
                f"named_chain: argument {i} must be a (str, GradientTransformation) pair, got {pair!r:.80}; "
                "see docs/chaining.md"
            )
    names = [name for name, _ in named_txs]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    return _chain([tx for _, tx in named_txs], names)


# --- masked and partition -------------------------------------------------------------
#
# The inner transform sees the user's own tree, with ``None`` (an empty subtree) in place of
# every leaf it does not own, as optax's ``MaskedNode``: its state mirrors the params with
# ``None`` there, and its error messages name the user's paths.


def _is_tree_fn(labels: Any) -> bool:
    """Whether a mask/labels argument is a function of the params rather than a tree.

    optax's rule (its issue 913): a callable counts as a function only when
    every leaf of it is callable, so an equinox-style module that is both
    callable and a pytree (registered with optree) is a tree.
    """
    leaves = optree.tree_leaves(cast(Any, labels))
    return len(leaves) > 0 and all(callable(leaf) for leaf in leaves)


def check_mask(mask: Any, *, arg: str, name: str, wanted: str = "a tree of bools or a function of the params") -> None:
    """Raise ``TypeError`` naming ``name``'s ``arg`` when a mask tree (not a function) has a leaf that is not a bool."""
    if callable(mask) and _is_tree_fn(mask):  # a dict of functions is neither a function nor a tree of bools
        return
    for leaf in optree.tree_leaves(cast(Any, mask)):
        if not check._is_bool(leaf):
            raise TypeError(f"{name}: {arg} must be {wanted}, got a {type(leaf).__name__} leaf")


def _resolve(labels: Any, tree: PyTree, *, name: str, what: str) -> list[Any]:
    resolved = labels(tree) if _is_tree_fn(labels) else labels
    return tu.prefix_leaves(resolved, tree, what=f"{name}: {what}", against="the params/updates tree")


def _hide(leaves: list[Any], spec: Any, keep: Sequence[bool]) -> PyTree:
    """The tree of ``leaves`` (flattened with ``spec``) with ``None`` at every leaf not kept."""
    return tu.unflatten(spec, [x if k else None for x, k in zip(leaves, keep)])


def _routed_update(name: str, updates: Updates, params: Params | None, parts: Sequence[Any], extra: dict) -> Any:
    """Run each part ``(tx, state, keep)`` on its kept leaves; return the updates and the parts' new states.

    A part sees the reference tree (the params, else the updates) with ``None``
    at every leaf it does not keep; the leaves no part keeps pass through.
    """
    reference = params if params is not None else updates
    index, leaves, out_spec = tu.align(reference, updates, what=f"{name}: updates", against="params")
    ref_leaves, spec = tu.flatten(reference)
    full = tu.scatter(len(ref_leaves), index, leaves)
    out, states = list(leaves), []
    for tx, state, keep in parts:
        sub_params = None if params is None else _hide(ref_leaves, spec, keep)
        new, new_state = tx.update(_hide(full, spec, keep), state, sub_params, **extra)
        if new is None:
            raise ValueError(f"{name}: an inner transform held (returned None); put accumulate() in the outer chain")
        try:
            new_leaves = spec.flatten_up_to(new)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}: the inner transform returned updates of another structure: {e}") from None
        for j, i in enumerate(index):
            if keep[i]:
                out[j] = new_leaves[i]
        states.append(new_state)
    return tu.unflatten(out_spec, out), states


class MaskedState(NamedTuple):
    """The inner transform's state, built on the params with ``None`` at every masked-out leaf."""

    inner_state: OptState


class PartitionState(NamedTuple):
    """Each label's inner state, by label (each built like :class:`MaskedState`'s)."""

    inner_states: dict[Hashable, OptState]


@factory
def masked(inner: GradientTransformation, mask: PyTree | Callable[[Params], PyTree]) -> GradientTransformation:
    """Apply ``inner`` only to the leaves where ``mask`` is True; the others pass through unchanged.

    As optax's ``masked``. The inner transform sees the params and updates
    with ``None`` (an empty subtree) in place of each masked-out leaf, so its
    state holds nothing for them, and a param with no gradient (``None`` in
    the updates) is left alone.

    Args:
      inner: the transform to apply to the masked leaves.
      mask: bools in a tree with the structure of the params, or a prefix of
        it (``{"encoder": False, "head": True}``; a single ``True`` covers the
        whole tree); or a function ``params -> mask``, called with the params
        (the updates when ``update`` gets no params). A callable whose leaves
        are not all callable (an equinox-style module registered as a pytree)
        is a tree, not a function, as in optax.

    Returns:
      A :class:`GradientTransformation` with state :class:`MaskedState`.

    Raises:
      TypeError: at construction, when ``inner`` is not a transform or a mask
        tree has a leaf that is not a bool.

    References:
      Optax's ``masked`` (DeepMind, 2020).

    Example:
      >>> decay_matrices = lambda p: {k: v.ndim > 1 for k, v in p.items()}
      >>> tx = masked(add_decayed_weights(0.1), decay_matrices)
    """
    check.transform(inner, arg="inner", name="masked")
    check_mask(mask, arg="mask", name="masked")

    def keep_of(tree: PyTree) -> list[bool]:
        flags = _resolve(mask, tree, name="masked", what="mask")
        for i, f in enumerate(flags):
            if not check._is_bool(f):
                path = tu.path_str(tu.paths(tree)[i])  # (read only for the message)
                raise TypeError(f"masked: mask leaves must be bools, got {type(f).__name__} for {path}")
        return [bool(f) for f in flags]

    def init_fn(params: Params) -> MaskedState:
        return MaskedState(inner.init(_hide(*tu.flatten(params), keep_of(params))))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, MaskedState, name="masked")
        keep = keep_of(params if params is not None else updates)
        out, (inner_state,) = _routed_update("masked", updates, params, [(inner, state.inner_state, keep)], extra)
        return out, MaskedState(inner_state)

    return reads_plan(GradientTransformation(init_fn, update_fn), plan_read_by(inner))  # the chain holding it checks it


@factory
def partition(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: PyTree | Callable[[Params], PyTree],
) -> GradientTransformation:
    """Apply a different transform to each labelled part of the tree.

    As optax's ``partition``: every leaf goes to the transform of its label,
    which sees the params and updates with ``None`` at every leaf of another
    label (see :func:`masked`).

    Args:
      transforms: a transform for every label.
      param_labels: labels in a tree with the structure of the params, or a
        prefix of it (``("generator", "discriminator")`` over a pair of
        subtrees), or a function ``params -> labels`` (see :func:`masked` for
        which callables count as functions).

    Returns:
      A :class:`GradientTransformation` with state :class:`PartitionState`.

    Raises:
      TypeError: at construction, when a transform is not a
        :class:`GradientTransformation`. ValueError: when a label has no
        transform (at construction for a labels tree).

    References:
      Optax's ``partition`` (formerly ``multi_transform``; DeepMind, 2021).

    Example:
      >>> labels = lambda p: {k: "no_decay" if "norm" in k else "decay" for k in p}
      >>> tx = partition({"decay": adamw(1e-3), "no_decay": adam(1e-3)}, labels)
    """
    if not isinstance(transforms, Mapping):
        raise TypeError(
            f"partition: transforms must be a mapping from label to transform, got {type(transforms).__name__}"
        )
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"partition: transforms[{label!r}] is a {type(tx).__name__}, not a GradientTransformation")
    names = list(transforms)
    if not _is_tree_fn(param_labels):
        for lab in optree.tree_leaves(cast(Any, param_labels)):
            if not isinstance(lab, Hashable) or lab not in transforms:
                raise ValueError(f"partition: label {lab!r} has no transform; known labels: {names}")

    def label_of(tree: PyTree) -> list[Any]:
        leaf_labels = _resolve(param_labels, tree, name="partition", what="param_labels")
        for i, lab in enumerate(leaf_labels):
            if not isinstance(lab, Hashable) or lab not in transforms:
                path = tu.path_str(tu.paths(tree)[i])  # (read only for the message)
                raise ValueError(f"partition: label {lab!r} at {path} has no transform; known labels: {names}")
        return leaf_labels

    def init_fn(params: Params) -> PartitionState:
        leaf_labels, flat = label_of(params), tu.flatten(params)
        return PartitionState({n: transforms[n].init(_hide(*flat, [lab == n for lab in leaf_labels])) for n in names})

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, PartitionState, name="partition")
        if not isinstance(state.inner_states, dict) or list(state.inner_states) != names:
            raise ValueError(
                f"partition: expected inner states for the labels {names}, got {state.inner_states!r:.200}"
            )
        leaf_labels = label_of(params if params is not None else updates)
        parts = [(transforms[n], state.inner_states[n], [lab == n for lab in leaf_labels]) for n in names]
        out, new_states = _routed_update("partition", updates, params, parts, extra)
        return out, PartitionState(dict(zip(names, new_states)))

    read = next((p for p in map(plan_read_by, transforms.values()) if p is not NO_PLAN), NO_PLAN)
    return reads_plan(GradientTransformation(init_fn, update_fn), read)  # the chain holding it checks it


def apply_updates(params: Params, updates: Updates | None) -> Params:
    """Return ``params + updates`` as a new tree, in each param's dtype (a DTensor update placed as its param). Pure.

    ``updates`` of ``None`` (a held accumulation step) returns ``params`` itself.
    A ``None`` inside ``updates`` where ``params`` has a tensor (a param that got
    no gradient) leaves that param as it is: the same tensor object comes back.
    """
    if updates is None:
        return params
    p_leaves, spec = tu.flatten(params)
    key = lw.one_group(p_leaves)
    if key is not None and (key[1].is_floating_point or key[1].is_complex):
        # The common case, read with no loop per leaf and one launch. The updates are read through the params'
        # structure (several times faster than flattening them anew); a None or a subtree where the params have
        # a tensor comes out as a leaf that one_group refuses, and a structure that differs raises.
        try:
            u_leaves = spec.flatten_up_to(updates)
        except (ValueError, TypeError):
            u_leaves = None
        if u_leaves is not None and lw.one_group(u_leaves) == key and lw.same_shapes(u_leaves, p_leaves):
            return tu.unflatten(spec, fe.add(p_leaves, u_leaves))
    index, u_leaves, _ = tu.align(params, updates, what="updates", against="params")
    present = [p_leaves[i] for i in index]
    # One foreach call: torch groups by device and dtype itself (and refuses an empty list: every update None).
    if present and not (tu.has_dtensor(p_leaves) or tu.has_dtensor(u_leaves)):
        try:
            added = fe.add(present, u_leaves)
        except RuntimeError:  # an update on another device than its param: a ValueError naming it
            tu.check_devices(present, u_leaves, updates, what="updates", against="its param")
            raise
    else:  # DTensors, leaf by leaf, each update placed as its param: a Partial one would leave the param a pending sum
        tu.check_placed("apply_updates: updates", params, index, u_leaves, p_leaves)
        added = [p + u for p, u in zip(present, u_leaves)]
    out = list(p_leaves)
    for i, r in zip(index, added):
        out[i] = r if r.dtype == p_leaves[i].dtype else r.to(p_leaves[i].dtype)
    return tu.unflatten(spec, out)


def update_and_apply(
    tx: GradientTransformation, grads: Updates, state: OptState, params: Params, **extra: Any
) -> tuple[Params, OptState]:
    """One optimizer step: ``tx.update``, then :func:`apply_updates`. Pure.

    Exactly::

        updates, state = tx.update(grads, state, params, **extra)
        params = apply_updates(params, updates)

    When the chain holds (an open accumulation window) the params come back
    unchanged. For speed, compile the step (``torch.compile``); inductor then
    writes each result straight into its buffer.

    Example:
      >>> tx = chain(clip_by_global_norm(1.0), adamw(3e-4, weight_decay=0.1))
      >>> params, state = update_and_apply(tx, grads, state, params)
    """
    updates, state = tx.update(grads, state, params, **extra)
    return apply_updates(params, updates), state
