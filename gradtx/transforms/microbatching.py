"""Microbatching a function: evaluate it on slices of a batch in turn and combine the results (optax's ``microbatch``).

The usual use is gradient accumulation inside one functional step:
``microbatch(torch.func.grad(loss_fn), argnums=1, microbatch_size=8, accumulator=AccumulationType.MEAN)``
computes the mean gradient of a batch of 64 with the memory of a batch of 8.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, cast

import optree
import torch

from gradtx.core import tree as tu
from gradtx.core import validate as check

__all__ = ["AccumulationType", "microbatch"]


class AccumulationType(enum.Enum):
    """How :func:`microbatch` combines the results of the micro-batches (optax's ``microbatching.AccumulationType``)."""

    MEAN = enum.auto()
    """The mean over the micro-batches (the full batch's mean, for a mean loss and equal micro-batches)."""
    SUM = enum.auto()
    """The sum over the micro-batches."""
    RUNNING_MEAN = enum.auto()
    """The mean over the micro-batches actually run (``num_real_microbatches``)."""
    CONCAT = enum.auto()
    """The results concatenated along dim 0, in the batch's order."""


def _slice(x: torch.Tensor, axis: int, index: int, num: int) -> torch.Tensor:
    # optax splits the batch axis column-major: micro-batch i holds rows i, i + num, i + 2 * num, ...
    ax = axis % x.ndim
    return x.unflatten(ax, (x.shape[ax] // num, num)).select(ax + 1, index)


def microbatch(
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    microbatch_size: int | None,
    accumulator: AccumulationType | Any = AccumulationType.SUM,
    *,
    argnames: str | Sequence[str] = (),
    in_axes: int | Sequence[int] = 0,
    num_real_microbatches: int | None = None,
) -> Callable[..., Any]:
    """``fun``, evaluated on ``microbatch_size`` rows of its batch arguments at a time, results combined.

    The batch arguments (``argnums`` and ``argnames``) are split along their
    batch axis (``in_axes``) the way optax splits them (micro-batch ``i`` holds
    rows ``i, i + n, i + 2n, ...`` for ``n`` micro-batches), ``fun`` runs on
    each in a Python loop, and each output leaf is combined as its
    :class:`AccumulationType` says. The same results as optax's ``microbatch``;
    peak memory is one micro-batch's. Any torch function works, ``torch.func.grad``
    and ``vmap`` ones included.

    Args:
      fun: the function to microbatch.
      argnums: the positions of the arguments that have a batch axis.
      microbatch_size: rows per micro-batch; must divide the batch size.
        ``None`` returns ``fun`` itself.
      accumulator: an :class:`AccumulationType`, or a tree of them that is a
        prefix of ``fun``'s output (one per output leaf or subtree).
      argnames: the names of keyword arguments that have a batch axis.
      in_axes: the batch axis of each batch argument (``argnums`` then
        ``argnames``), or one int for all.
      num_real_microbatches: run only the first this many micro-batches
        (``MEAN`` still divides by the total; ``RUNNING_MEAN`` by this); ``0``
        raises a ``ValueError`` (optax returns zeros).

    Returns:
      A function with ``fun``'s signature.

    References:
      Optax's ``microbatch`` (DeepMind, 2025).

    Example:
      >>> grad_fn = torch.func.grad(loss_fn)
      >>> mean_grad = microbatch(grad_fn, argnums=1, microbatch_size=8, accumulator=AccumulationType.MEAN)
      >>> grads = mean_grad(params, batch)
    """
    check.function(fun, arg="fun", name="microbatch")
    if microbatch_size is None:
        return fun
    microbatch_size = check.integer(microbatch_size, arg="microbatch_size", name="microbatch", minimum=1)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for n in nums:
        check.integer(n, arg="argnums", name="microbatch", minimum=0)
    # The batch arguments: positions, then keyword names.
    keys: list[Any] = [*nums, *((argnames,) if isinstance(argnames, str) else argnames)]
    if not all(isinstance(k, str) for k in keys[len(nums) :]):  # an int here would batch a positional argument
        raise TypeError(f"microbatch: argnames must be str keyword names, got {argnames!r}")
    given = in_axes if isinstance(in_axes, (list, tuple)) else (in_axes,) * len(keys)
    axes = tuple(check.integer(ax, arg="in_axes", name="microbatch") for ax in given)
    if len(axes) != len(keys):
        raise ValueError(f"microbatch: in_axes needs one axis per batch argument ({len(keys)}), got {len(axes)}")
    if num_real_microbatches is not None:
        num_real_microbatches = check.integer(
            num_real_microbatches, arg="num_real_microbatches", name="microbatch", minimum=0
        )
    for acc in optree.tree_leaves(cast(Any, accumulator)):
        if not isinstance(acc, AccumulationType):
            raise TypeError(f"microbatch: accumulator must be an AccumulationType or a tree of them, got {acc!r}")

    def microbatched(*args: Any, **kwargs: Any) -> Any:
        for k in keys:
            passed = k in kwargs if isinstance(k, str) else k < len(args)
            if not passed:
                raise ValueError(
                    f"microbatch: batch argument {k!r} (argnums/argnames) was not passed: got {len(args)} "
                    f"positional arguments and keywords {sorted(kwargs)}"
                )
        batch = [(args[k] if isinstance(k, int) else kwargs[k], ax) for k, ax in zip(keys, axes)]
        sizes = set()
        for k, (tree, ax) in zip(keys, batch):
            for leaf in optree.tree_leaves(tree):
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(f"microbatch: a batch argument's leaves must be tensors, got {type(leaf).__name__}")
                if not -leaf.ndim <= ax < leaf.ndim:
                    raise ValueError(
                        f"microbatch: in_axes {ax} is out of range for a {leaf.ndim}-d leaf of batch argument {k!r}"
                    )
                sizes.add(leaf.shape[ax])
        if len(sizes) != 1:
            raise ValueError(f"microbatch: the batch arguments must have equal batch axes, got sizes {sorted(sizes)}")
        (batch_size,) = sizes
        if batch_size % microbatch_size != 0:
            raise ValueError(
                f"microbatch: the batch size {batch_size} is not divisible by microbatch_size={microbatch_size}"
            )
        num = batch_size // microbatch_size
        steps = num if num_real_microbatches is None else num_real_microbatches
        if steps > num:
            raise ValueError(f"microbatch: num_real_microbatches={steps} is more than the {num} micro-batches")

        def call(index: int) -> Any:
            new_args, new_kwargs = list(args), dict(kwargs)
            for k, (tree, ax) in zip(keys, batch):
                sliced = optree.tree_map(lambda x, ax=ax: _slice(x, ax, index, num), tree)
                (new_args if isinstance(k, int) else new_kwargs)[k] = sliced
            return fun(*new_args, **new_kwargs)

        if steps == 0:
            why = "num_real_microbatches=0" if num else f"an empty batch (batch size {batch_size})"
            raise ValueError(f"microbatch: {why} runs nothing, so there is no output to return")
        first = call(0)
        leaves, spec = optree.tree_flatten(first)
        kinds = tu.prefix_leaves(accumulator, first, what="microbatch: accumulator", against="fun's output")
        for kind, leaf in zip(kinds, leaves):
            if kind in (AccumulationType.MEAN, AccumulationType.RUNNING_MEAN) and not leaf.is_floating_point():
                raise ValueError("microbatch: MEAN and RUNNING_MEAN accumulators need floating-point outputs")
        carry = [
            leaf.new_zeros((num, *leaf.shape)) if kind is AccumulationType.CONCAT else torch.zeros_like(leaf)
            for kind, leaf in zip(kinds, leaves)
        ]
        for index in range(steps):
            if index > 0:
                leaves = optree.tree_leaves(call(index))
            for k, (kind, leaf) in enumerate(zip(kinds, leaves)):
                if kind is AccumulationType.CONCAT:
                    carry[k] = carry[k].index_copy(0, torch.tensor([index], device=leaf.device), leaf.unsqueeze(0))
                elif kind is AccumulationType.RUNNING_MEAN:
                    p = index / (index + 1)
                    carry[k] = carry[k] * p + leaf * (1 - p)
                else:
                    carry[k] = carry[k] + leaf
        finish = {
            AccumulationType.MEAN: lambda c: c / num,
            # the batch's row order; one value per micro-batch (a 0-d output, e.g. a loss) stays in micro-batch order
            AccumulationType.CONCAT: lambda c: c.transpose(0, 1).reshape(-1, *c.shape[2:]) if c.ndim > 1 else c,
        }
        return optree.tree_unflatten(spec, [finish.get(k, lambda c: c)(c) for k, c in zip(kinds, carry)])

    return microbatched
