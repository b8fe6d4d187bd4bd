"""Exact gradient accumulation over micro-batches, plain or token-weighted."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from gradtx import tree as tu
from gradtx.base import GradientTransformation, Params, PyTree, scale_aware
from gradtx.comm.base import ReduceOp


class AccumulateState(NamedTuple):
    """The open accumulation window.

    Attributes:
      micro_step: micro-steps taken in the open window (CPU int64, 0-d).
      tokens: valid tokens seen in the open window on this rank (CPU int64, 0-d).
      emitted: whether the last update emitted (CPU bool, 0-d).
      last_tokens: the token total of the last emitted window, summed over the
        data-parallel ranks (CPU int64, 0-d; 0 when not token-weighted).
      acc: the fp32 running sum, a tree like the updates. Its leaves are empty
        while no window is open, and always when autograd is the accumulator
        (``running_sum=True``), so no second gradient-sized buffer is kept.
    """

    micro_step: torch.Tensor
    tokens: torch.Tensor
    emitted: torch.Tensor
    last_tokens: torch.Tensor
    acc: PyTree

    _metrics = {"micro_step": "micro_step", "last_tokens": "tokens", "emitted": "emitted"}


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=tu.local(t).device)


def _token_count(tokens: Any) -> int:
    """Validate a micro-batch's token count and return it as an int (reads only host memory)."""
    if tokens is None:
        raise ValueError("accumulate: token_weighted=True needs update(..., tokens=n), the micro-batch's valid tokens")
    if isinstance(tokens, torch.Tensor):
        if tokens.numel() != 1:
            raise ValueError(f"accumulate: tokens must be a scalar, got a tensor of shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"accumulate: tokens must be an integer count, got a {tokens.dtype} tensor")
        tokens = int(tokens.cpu())  # a count, normally already on the host; never a hot-path device sync
    elif isinstance(tokens, bool) or not isinstance(tokens, numbers.Real):
        raise TypeError(f"accumulate: tokens must be an integer count, got {type(tokens).__name__}")
    elif not float(tokens).is_integer():
        raise ValueError(f"accumulate: tokens must be a whole number, got {tokens}")
    tokens = int(tokens)
    if tokens < 0:
        raise ValueError(f"accumulate: tokens must be >= 0, got {tokens}")
    return tokens


def accumulate(k: int, *, token_weighted: bool = False, comm: Any | None = None, group: Any = "dp") -> GradientTransformation:
    """Accumulate ``k`` micro-batches and emit their mean; a chain member that gates what follows it.

    Each ``update`` adds the micro-batch's gradient to an fp32 running sum. On
    the ``k``-th micro-step (or one passed ``flush=True``, which closes a short
    final window) it emits the sum divided by the count, in the grads' dtype.
    On the other micro-steps it returns ``None``: a :func:`gradtx.chain` stops
    there, so no later transform runs or changes its state (no Adam moment,
    no step count, no schedule moves), and ``apply_updates(params, None)``
    leaves the params as they are. ``updates is None`` is how a caller asks
    whether the step emitted; ``state.emitted`` records it too.

    Plain mean (``token_weighted=False``): feed each micro-batch's mean-loss
    gradient; the emitted update is their plain mean over the real count.

    Token-weighted (``token_weighted=True``): feed each micro-batch's *summed*
    loss gradient (``reduction="sum"`` over its valid tokens, i.e. ``n_i``
    times its mean-loss gradient) with ``update(..., tokens=n_i)``. The
    emitted update is ``sum_i grad_i / sum_i n_i``: micro-batch ``i`` carries
    weight ``n_i / sum(n)``, and a micro-batch with no valid tokens
    contributes zero rather than NaN. With a ``comm``, the token total is summed
    over ``group`` (the data-parallel ranks) with one scalar collective per
    optimizer step, so the result is the token mean of the global batch. A
    window whose total is 0 raises ``ValueError`` before any state changes.

    Args:
      k: micro-steps per emitted update; ``>= 1``.
      token_weighted: weight micro-batches by their valid-token counts.
      comm: a :class:`gradtx.comm.Comm` to sum token totals across data-parallel
        ranks; ``None`` for one process.
      group: the comm group of the data-parallel ranks.

    Returns:
      A :class:`GradientTransformation` with state :class:`AccumulateState`.

    Example:
      >>> tx = chain(accumulate(4), clip_by_global_norm(1.0), adamw(3e-4))
      >>> updates, state = tx.update(grads, state, params)
      >>> if updates is not None:  # the 4th micro-step
      ...     params = apply_updates(params, updates)
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"accumulate: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"accumulate: k must be >= 1, got {k}")

    def init_fn(params: Params) -> AccumulateState:
        return AccumulateState(
            micro_step=torch.zeros((), dtype=torch.int64),
            tokens=torch.zeros((), dtype=torch.int64),
            emitted=torch.zeros((), dtype=torch.bool),
            last_tokens=torch.zeros((), dtype=torch.int64),
            acc=tu.tree_map(_empty_like, params),
        )

    @scale_aware
    def update_fn(updates, state, params=None, *, tokens=None, flush=False, running_sum=False, **extra):
        del params
        tu.require_state(state, AccumulateState, name="accumulate")
        leaves, spec = tu.flatten(updates)
        tu.check_tensors(leaves, tu.paths(updates), what="accumulate: updates")
        tu.check_structure(
            tu.tree_map(lambda _: 0, state.acc), tu.tree_map(lambda _: 0, updates),
            what="accumulate: updates", against="the tree accumulate was initialised with",
        )  # fmt: skip
        n = _token_count(tokens) if token_weighted else 0
        # The counters live on the host, so this branch never waits on a device.
        micro_step = int(state.micro_step) + 1
        window_tokens = int(state.tokens) + n

        acc_leaves = spec.flatten_up_to(state.acc)
        if not running_sum:
            acc_leaves = [
                tu.like(g, tu.local(g).to(torch.float32, copy=True) if micro_step == 1 else tu.local(a) + tu.local(g))
                for a, g in zip(acc_leaves, leaves)
            ]

        if micro_step < k and not flush:
            return None, AccumulateState(
                micro_step=torch.tensor(micro_step),
                tokens=torch.tensor(window_tokens),
                emitted=torch.tensor(False),
                last_tokens=state.last_tokens,
                acc=state.acc if running_sum else tu.unflatten(spec, acc_leaves),
            )

        if token_weighted:
            total = torch.tensor(window_tokens, dtype=torch.int64)
            if comm is not None:
                (total,) = comm.all_reduce([total], ReduceOp.SUM, group)
            total = int(total.cpu())  # one scalar per optimizer step
            if total == 0:
                raise ValueError(
                    "accumulate: the window's valid tokens sum to 0, so the token mean is undefined; "
                    "nothing was changed (skip such windows, or count tokens before backward)"
                )
            denom = total
        else:
            total, denom = 0, micro_step
        factor = torch.tensor(1.0 / denom, dtype=torch.float32)

        deferred = extra.get("deferred")
        if running_sum:
            if deferred is not None:
                deferred.fold(factor)
                out = leaves
            else:
                out = tu.scale_leaves(leaves, factor, inplace=bool(extra.get("inplace", False)))
        else:
            scaled = tu.scale_leaves(acc_leaves, factor, inplace=True)  # acc_leaves are ours
            out = [tu.like(g, tu.local(s).to(g.dtype)) for g, s in zip(leaves, scaled)]
        new_state = AccumulateState(
            micro_step=torch.zeros((), dtype=torch.int64),
            tokens=torch.zeros((), dtype=torch.int64),
            emitted=torch.tensor(True),
            last_tokens=torch.tensor(total, dtype=torch.int64),
            acc=tu.tree_map(_empty_like, updates),
        )
        return tu.unflatten(spec, out), new_state

    return GradientTransformation(init_fn, update_fn)
