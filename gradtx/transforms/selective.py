"""Freezing params and transforming only on some steps: ``freeze``, ``selective_transform``, ``conditionally_*``.

optax's names and conventions. ``freeze`` zeros the updates of frozen leaves;
``selective_transform`` gives them no optimizer state at all. The conditional
wrappers run their inner transform only on steps a predicate of the step count
selects; the choice is a ``torch.where`` on a tensor, never a Python branch on
a tensor value, so a step compiles to one graph and nothing is read back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import optree
import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, PyTree, factory, init_empty_state
from gradtx.transforms.combine import check_mask, masked, partition
from gradtx.transforms.conditionals import select_step

__all__ = [
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "conditionally_mask",
    "conditionally_transform",
    "freeze",
    "selective_transform",
    "set_to_zero",
]


@factory
def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros of its shape and dtype.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Optax's ``set_to_zero`` (DeepMind, 2021).

    Example:
      >>> tx = set_to_zero()
      >>> tx.update({"w": torch.ones(2)}, tx.init(None))[0]
      {'w': tensor([0., 0.])}
    """

    def update_fn(updates, state, params=None, **extra):
        tu.tensor_leaves(updates, what="set_to_zero: updates")
        return tu.tree_map(torch.zeros_like, updates), state

    return GradientTransformation(init_empty_state, update_fn)


@factory
def freeze(mask: bool | PyTree) -> GradientTransformation:
    """Zero the updates of the leaves where ``mask`` is True (freeze them); pass the others through.

    ``masked(set_to_zero(), mask)``, as optax's ``freeze``. Put it after the
    optimizer to freeze its output; the optimizer still keeps state for the
    frozen leaves (use :func:`selective_transform` to give them none).

    Args:
      mask: True freezes everything, False nothing; or a tree of bools with the
        structure of the params (or a prefix of it), True where a leaf is frozen.

    Returns:
      A :class:`GradientTransformation` with state :class:`gradtx.MaskedState`.

    References:
      Optax's ``freeze`` (DeepMind, 2025).

    Example:
      >>> tx = chain(adam(1e-3), freeze({"encoder": True, "head": False}))
    """
    check_mask(mask, arg="mask", name="freeze", wanted="a bool or a tree of bools")
    return masked(set_to_zero(), mask)


@factory
def selective_transform(optimizer: GradientTransformation, *, freeze_mask: bool | PyTree) -> GradientTransformation:
    """Run ``optimizer`` on the leaves where ``freeze_mask`` is False; zero the updates of the others.

    ``partition({"train": optimizer, "freeze": set_to_zero()}, labels)``, as
    optax's ``selective_transform``: the frozen leaves get zero updates and no
    optimizer state (no moments are allocated for them).

    Args:
      optimizer: the transform for the trained leaves.
      freeze_mask: True freezes everything, False nothing; or a tree of bools
        with the structure of the params (or a prefix of it), True where a leaf
        is frozen. Keyword-only, as in optax.

    Returns:
      A :class:`GradientTransformation` with state :class:`gradtx.PartitionState`.

    References:
      Optax's ``selective_transform`` (DeepMind, 2025).

    Example:
      >>> tx = selective_transform(adam(1e-3), freeze_mask={"encoder": True, "head": False})
    """
    check.transform(optimizer, arg="optimizer", name="selective_transform")
    check_mask(freeze_mask, arg="freeze_mask", name="selective_transform", wanted="a bool or a tree of bools")
    if callable(freeze_mask):
        raise TypeError("selective_transform: freeze_mask must be a bool or a tree of bools, got a function")
    labels = optree.tree_map(lambda m: "freeze" if m else "train", cast(Any, freeze_mask))
    return partition({"train": optimizer, "freeze": set_to_zero()}, labels)


class ConditionallyTransformState(NamedTuple):
    """The inner transform's state and the number of updates seen (0-d int64), as optax's."""

    inner_state: OptState
    step: torch.Tensor


class ConditionallyMaskState(NamedTuple):
    """The number of updates seen (0-d int64) and the inner transform's state, as optax's (in its field order)."""

    step: torch.Tensor
    inner_state: OptState


ConditionFn = Callable[..., Any]


def _conditional(
    inner: GradientTransformation,
    should_transform_fn: ConditionFn,
    forward_extra_args: bool,
    *,
    name: str,
    zero_rejected: bool,
) -> GradientTransformation:
    check.transform(inner, arg="inner", name=name)
    check.function(should_transform_fn, arg="should_transform_fn", name=name)
    forward_extra_args = check.flag(forward_extra_args, arg="forward_extra_args", name=name)
    state_type = ConditionallyMaskState if zero_rejected else ConditionallyTransformState

    def init_fn(params: Params) -> Any:
        return state_type(step=lw.zero_count(params), inner_state=inner.init(params))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, state_type, name=name)
        cond = should_transform_fn(state.step, **(extra if forward_extra_args else {}))
        ok = isinstance(cond, torch.Tensor) and cond.shape == () and cond.dtype == torch.bool
        if not (ok or check._is_bool(cond)):
            got = (
                f"{cond.dtype} of shape {tuple(cond.shape)}" if isinstance(cond, torch.Tensor) else type(cond).__name__
            )
            raise TypeError(f"{name}: should_transform_fn must return a bool or a 0-d bool tensor, got {got}")
        # The updates are read again when the step is rejected: the inner transform may not write into them.
        # A predicate that answers in Python gets a Python choice, as lax.cond would make.
        if zero_rejected:  # (zeros_like of a leaf that is no tensor would fail inside torch, naming no path)
            tu.tensor_leaves(updates, what=f"{name}: updates")
        rejected = tu.tree_map(torch.zeros_like, updates) if zero_rejected else updates
        out, inner_state = select_step(
            inner, cond, updates, state.inner_state, params, extra, name=name, rejected=rejected
        )
        return out, state_type(step=state.step + 1, inner_state=inner_state)

    return GradientTransformation(init_fn, update_fn)


@factory
def conditionally_transform(
    inner: GradientTransformation, should_transform_fn: ConditionFn, forward_extra_args: bool = False
) -> GradientTransformation:
    """Apply ``inner`` on the steps where ``should_transform_fn(step)`` is True; pass the updates through on the others.

    On a step it skips, ``inner``'s state does not change. ``inner`` runs on
    every step and its result is kept or dropped with ``torch.where`` (no host
    sync); a predicate returning a Python bool is obeyed in Python. As
    optax's ``conditionally_transform``.

    Args:
      inner: the transform to apply on selected steps.
      should_transform_fn: ``step -> bool`` (``step``: a 0-d int64 tensor counting
        updates from 0); returns a 0-d bool tensor (or a Python bool).
      forward_extra_args: also pass the update's extra keywords (``loss=...``) to
        ``should_transform_fn``.

    Returns:
      A :class:`GradientTransformation` with state :class:`ConditionallyTransformState`.

    References:
      Optax's ``conditionally_transform`` (DeepMind, 2024).

    Example:
      >>> tx = conditionally_transform(clip_by_global_norm(1.0), lambda step: step >= 100)
    """
    return _conditional(
        inner, should_transform_fn, forward_extra_args, name="conditionally_transform", zero_rejected=False
    )


@factory
def conditionally_mask(
    inner: GradientTransformation, should_transform_fn: ConditionFn, forward_extra_args: bool = False
) -> GradientTransformation:
    """Apply ``inner`` on the steps where ``should_transform_fn(step)`` is True; return zero updates on the others.

    As :func:`conditionally_transform`, except that a skipped step's updates
    are zeros (the params do not move). As optax's ``conditionally_mask``.

    Args:
      inner: the transform to apply on selected steps.
      should_transform_fn: ``step -> bool`` (``step``: a 0-d int64 tensor counting
        updates from 0); returns a 0-d bool tensor (or a Python bool).
      forward_extra_args: also pass the update's extra keywords to ``should_transform_fn``.

    Returns:
      A :class:`GradientTransformation` with state :class:`ConditionallyMaskState`.

    References:
      Optax's ``conditionally_mask`` (DeepMind, 2024).

    Example:
      >>> tx = conditionally_mask(adam(1e-3), lambda step: step % 2 == 0)  # update every other step
    """
    return _conditional(inner, should_transform_fn, forward_extra_args, name="conditionally_mask", zero_rejected=True)
