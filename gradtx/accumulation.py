"""Exact gradient accumulation over micro-batches, plain or token-weighted."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from gradtx import tree as tu
from gradtx.base import GradientTransformation, Params, PyTree, export_metrics, gate, scale_aware
from gradtx.combine import apply_deferred
from gradtx.comm.base import Comm, GroupKey, ReduceOp, check_comm


@export_metrics(
    ("micro_step", "micro_step"),
    ("last_tokens", "tokens"),
    ("emitted", "emitted"),
    ("empty_windows", "empty_windows"),
)
class AccumulateState(NamedTuple):
    """The open accumulation window.

    Attributes:
      micro_step: micro-steps taken in the open window (CPU int64, 0-d).
      tokens: valid tokens seen in the open window on this rank (CPU int64, 0-d).
      emitted: whether the last update emitted (CPU bool, 0-d).
      last_tokens: the token total of the last emitted window, summed over the
        data-parallel ranks (CPU int64, 0-d; 0 when not token-weighted).
      acc: the fp32 running sum, a tree like the updates. While no window is
        open, and always when autograd is the accumulator (``running_sum=True``),
        its leaves are empty placeholders of shape ``(0, *leaf_shape)``: no
        second gradient-sized buffer is kept, yet every update's shape is checked.
      empty_windows: windows skipped because their valid tokens summed to 0
        over all ranks (CPU int64, 0-d).
      k: the window length (CPU int64, 0-d), a constant. It is kept in the
        state so that :meth:`gradtx.TransformedOptimizer.maybe_no_sync` can
        tell which micro-step will emit, and so which backward must sync.
    """

    micro_step: torch.Tensor
    tokens: torch.Tensor
    emitted: torch.Tensor
    last_tokens: torch.Tensor
    acc: PyTree
    empty_windows: torch.Tensor
    k: torch.Tensor


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    # No elements, but the leaf's (local) shape survives in dims 1.., so updates can be checked against it.
    t = tu.local(t)
    return torch.empty((0, *t.shape), dtype=torch.float32, device=t.device)


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


def accumulate(
    k: int,
    *,
    token_weighted: bool = False,
    comm: Comm | None = None,
    group: GroupKey = "dp",
    reduce_grads: bool = False,
) -> GradientTransformation:
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
    rank whose window has no valid tokens is fine. A window whose *global*
    total is 0 has no token mean: it is skipped on every rank (the update
    is ``None``, the window closes, nothing downstream moves) and counted in
    ``state.empty_windows`` (the ``empty_windows`` metric).

    Data-parallel ranks (``comm``): who sums the gradients across ranks?

    * A DDP or FSDP2 model already does, on its last micro-step's backward
      (see :meth:`gradtx.TransformedOptimizer.maybe_no_sync`). Give
      ``comm`` (for the token total) and leave ``reduce_grads=False``; make
      the wrapper *sum* rather than average with :func:`gradtx.sum_grad_reduction`
      when token-weighted.
    * A functional step (``torch.func.grad`` on each rank) does not: pass
      ``reduce_grads=True`` and gradtx sums the window's accumulated grads
      over ``group`` once, at emission, in one coalesced collective (in fp32
      unless autograd is the accumulator, then in the grads' dtype). The
      emitted update is then ``sum over ranks and micro-steps of grad /
      global token total`` (token-weighted) or ``... / (micro-steps * ranks)``
      (plain mean), identical on every rank.

    Per emitted update this issues at most two collectives over ``group``: one
    scalar SUM of the token total (token-weighted with a ``comm``), then one
    coalesced SUM of the grads (``reduce_grads``). Non-emitting micro-steps
    issue none. The token total is read on the host once per emitted update,
    to refuse a global zero.

    Args:
      k: micro-steps per emitted update; ``>= 1``.
      token_weighted: weight micro-batches by their valid-token counts.
      comm: a :class:`gradtx.comm.Comm` over the data-parallel ranks; ``None``
        for one process.
      group: the comm group of the data-parallel ranks.
      reduce_grads: sum the accumulated grads over ``group`` at emission (for
        functional steps with no DDP/FSDP2 wrapper); needs ``comm``.

    Returns:
      A :class:`GradientTransformation` with state :class:`AccumulateState`.

    References:
      Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017.

    Example:
      >>> tx = chain(accumulate(4), clip_by_global_norm(1.0), adamw(3e-4))
      >>> updates, state = tx.update(grads, state, params)
      >>> if updates is not None:  # the 4th micro-step
      ...     params = apply_updates(params, updates)
      >>> # functional data parallelism: token mean of the global batch
      >>> tx = chain(accumulate(4, token_weighted=True, comm=comm, reduce_grads=True), adamw(3e-4))
      >>> updates, state = tx.update(sum_loss_grads, state, params, tokens=n_valid)
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"accumulate: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"accumulate: k must be >= 1, got {k}")
    if not isinstance(token_weighted, bool):
        raise TypeError(f"accumulate: token_weighted must be a bool, got {type(token_weighted).__name__}")
    if not isinstance(reduce_grads, bool):
        raise TypeError(f"accumulate: reduce_grads must be a bool, got {type(reduce_grads).__name__}")
    if comm is not None:
        check_comm(comm, name="accumulate")
    if reduce_grads and comm is None:
        raise ValueError("accumulate: reduce_grads=True needs a comm over the data-parallel ranks (comm=...)")

    def init_fn(params: Params) -> AccumulateState:
        return AccumulateState(
            micro_step=torch.zeros((), dtype=torch.int64),
            tokens=torch.zeros((), dtype=torch.int64),
            emitted=torch.zeros((), dtype=torch.bool),
            last_tokens=torch.zeros((), dtype=torch.int64),
            acc=tu.tree_map(_empty_like, params),
            empty_windows=torch.zeros((), dtype=torch.int64),
            k=torch.tensor(k, dtype=torch.int64),
        )

    @gate
    @scale_aware
    def update_fn(updates, state, params=None, *, tokens=None, flush=False, running_sum=False, **extra):
        del params
        tu.require_state(state, AccumulateState, name="accumulate")
        if not running_sum:
            # A factor deferred by a transform ahead of us belongs to this micro-batch only.
            updates = apply_deferred(updates, extra)
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
        emitting = micro_step >= k or flush

        acc_leaves = spec.flatten_up_to(state.acc)
        if not running_sum or emitting:  # a held wrapper step reads no grads (they may be missing)
            placeholders = running_sum or micro_step == 1
            for path, a, g in zip(tu.paths(updates), acc_leaves, leaves):
                expected = a.shape[1:] if placeholders else a.shape
                if tu.local(g).shape != expected:
                    raise ValueError(
                        f"accumulate: updates at {tu.path_str(path)} have shape {tuple(tu.local(g).shape)}, "
                        f"expected {tuple(expected)}"
                    )
        if not running_sum:
            acc_leaves = [
                tu.like(g, tu.local(g).to(torch.float32, copy=True) if micro_step == 1 else tu.local(a) + tu.local(g))
                for a, g in zip(acc_leaves, leaves)
            ]

        if not emitting:
            return None, state._replace(
                micro_step=torch.tensor(micro_step),
                tokens=torch.tensor(window_tokens),
                emitted=torch.tensor(False),
                acc=state.acc if running_sum else tu.unflatten(spec, acc_leaves),
            )

        if token_weighted:
            total = window_tokens
            if comm is not None:
                # On the grads' device: a GPU process group (NCCL) reduces device tensors only.
                device = tu.local(leaves[0]).device if leaves else torch.device("cpu")
                (global_total,) = comm.all_reduce([torch.tensor(total, device=device)], ReduceOp.SUM, group)
                total = int(global_total.cpu())  # one scalar per optimizer step
            if total == 0:
                # No valid token anywhere: the token mean is undefined, so the window is skipped.
                # Every rank sees the same global total, so every rank skips, before the grad
                # reduction below: no rank is left waiting in it.
                return None, state._replace(
                    micro_step=torch.zeros((), dtype=torch.int64),
                    tokens=torch.zeros((), dtype=torch.int64),
                    emitted=torch.tensor(False),
                    acc=state.acc if running_sum else tu.tree_map(_empty_like, updates),
                    empty_windows=state.empty_windows + 1,
                )
            denom = total
        else:
            total = 0
            denom = micro_step * (comm.size(group) if reduce_grads else 1)
        factor = torch.tensor(1.0 / denom, dtype=torch.float32)
        inplace = bool(extra.get("inplace", False))

        deferred = extra.get("deferred")
        if running_sum:
            out = leaves
            if reduce_grads:
                out = _reduce(leaves, copy_into=leaves if inplace else None)
            if deferred is not None:
                deferred.fold(factor)
            else:
                # A comm may hand back its inputs (LocalComm does), so only donated buffers are scaled in place.
                out = tu.scale_leaves(out, factor, inplace=inplace)
        else:
            if reduce_grads:
                acc_leaves = _reduce(acc_leaves, copy_into=None)
            scaled = tu.scale_leaves(acc_leaves, factor, inplace=True)  # acc_leaves are ours
            out = [tu.like(g, tu.local(s).to(g.dtype)) for g, s in zip(leaves, scaled)]
        new_state = state._replace(
            micro_step=torch.zeros((), dtype=torch.int64),
            tokens=torch.zeros((), dtype=torch.int64),
            emitted=torch.tensor(True),
            last_tokens=torch.tensor(total, dtype=torch.int64),
            acc=tu.tree_map(_empty_like, updates),
        )
        return tu.unflatten(spec, out), new_state

    def _reduce(leaves: list[torch.Tensor], *, copy_into: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Sum ``leaves`` over ``group`` in one coalesced collective, through their local shards."""
        assert comm is not None
        reduced = comm.all_reduce([tu.local(t) for t in leaves], ReduceOp.SUM, group)
        if copy_into is None:
            return [tu.like(t, r) for t, r in zip(leaves, reduced)]
        for t, r in zip(copy_into, reduced):
            if r is not tu.local(t):
                tu.local(t).copy_(r)  # keep the donated .grad objects (and their DTensor metadata)
        return list(copy_into)

    return GradientTransformation(init_fn, update_fn)
