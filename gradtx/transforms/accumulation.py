"""Exact gradient accumulation over micro-batches, plain or token-weighted.

:func:`accumulate` keeps the window's running sum in an fp32 buffer of its
own; the window's bookkeeping (counting micro-steps and tokens, deciding when
it closes, the normaliser ``1 / denominator``) is :class:`gradtx.transforms.window.Window`,
which :class:`gradtx.TransformedOptimizer` drives with autograd's ``.grad``
as the buffer (:mod:`gradtx.wrapper.rules`).
"""

from __future__ import annotations

from typing import Any, Self

import torch

from gradtx.comm.base import Comm, GroupKey, check_comm
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, _restore, factory
from gradtx.transforms.window import AccumulateState, Window, WindowStep, empty_sums

__all__ = ["AccumulateState", "Accumulation", "Window", "WindowStep", "accumulate", "empty_sums"]


class Accumulation(GradientTransformation):
    """What :func:`accumulate` returns: the transform, with its pieces exposed.

    Attributes:
      window: the :class:`Window` (counting and normalising, no buffer).
    """

    window: Window

    def __new__(cls, init: Any, update: Any, window: Window) -> Self:
        return _restore(cls, (init, update), {"window": window})

    def downstream_extra(self, state: AccumulateState, extra: dict[str, Any]) -> dict[str, Any]:
        """The extras the members after the window see, once it has emitted with ``state``.

        A ``loss`` given on the micro-steps is replaced by the window's loss,
        reduced as the grads were (:attr:`AccumulateState.last_loss`), so a
        loss-based guard after the window judges the whole window, not its
        last micro-batch. Everything else passes as given.
        """
        if extra.get("loss") is None:
            return extra
        return {**extra, "loss": state.last_loss}


@factory
def accumulate(
    k: int | None = None,
    *,
    every_k_schedule: Any = None,
    token_weighted: bool = False,
    comm: Comm | None = None,
    group: GroupKey = "dp",
    reduce_grads: bool = False,
) -> Accumulation:
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
    contributes zero rather than NaN. With a ``comm``, the token total is
    summed over ``group`` (the data-parallel ranks) with one small collective
    per optimizer step (the window's loss rides in it too), so the result is
    the token mean of the global batch. A rank whose window has no valid
    tokens is fine. A window whose *global* total is 0 has no token mean: it
    is skipped on every rank (the update is ``None``, the window closes,
    nothing downstream moves) and counted in ``state.empty_windows`` (the
    ``empty_windows`` metric).

    Data-parallel ranks (``comm``): who sums the gradients across ranks?

    * A DDP or FSDP2 model already does, on its last micro-step's backward
      (see :meth:`gradtx.TransformedOptimizer.maybe_no_sync`). Give
      ``comm`` (for the token total) and leave ``reduce_grads=False``; make
      the wrapper *sum* rather than average with :func:`gradtx.sum_grad_reduction`
      when token-weighted. In a run of several processes, token weighting
      without a ``comm`` raises: each rank would divide by its own tokens.
    * A functional step (``torch.func.grad`` on each rank) does not: pass
      ``reduce_grads=True`` and gradtx sums the window's accumulated grads
      over ``group`` once, at emission, in one coalesced collective (in fp32
      unless autograd is the accumulator, then in the grads' dtype); a DTensor
      grad sharded over those ranks (FSDP2's, summed already) is refused. The
      emitted update is then ``sum over ranks and micro-steps of grad /
      global token total`` (token-weighted) or ``... / (micro-steps * ranks)``
      (plain mean), identical on every rank. A param whose grad is ``None`` on
      this rank joins the sum as zeros (``update`` needs ``params`` then) and
      emits the sum, as on the ranks that have its grad.

    The window itself (counting micro-steps and tokens, and the normaliser
    ``1 / denominator``) is :attr:`Accumulation.window`, a pure object that
    :class:`gradtx.TransformedOptimizer` drives with autograd's ``.grad`` as the
    buffer, so no second buffer exists there.

    Per emitted update this issues at most two collectives over ``group``: one
    SUM of the token total, with the window's loss and its weight (three fp64
    numbers; token-weighted with a ``comm``), then one
    coalesced SUM of the grads (``reduce_grads``). Non-emitting micro-steps
    issue none. The token total is read on the host once per emitted update,
    to refuse a global zero.

    A window's length may follow a schedule, as optax's ``MultiSteps(every_k_schedule=...)``
    does (batch-size warm-up): ``every_k_schedule(n)`` is the length of the
    window after ``n`` emitted ones (``n`` a 0-d int64 tensor on the host; the
    schedule returns an int or a 0-d tensor, read on the host, where the
    window's counters live).

    Args:
      k: micro-steps per emitted update; ``>= 1``. Give ``k`` or ``every_k_schedule``.
      every_k_schedule: ``windows_emitted -> k``, the length of each window.
      token_weighted: weight micro-batches by their valid-token counts.
      comm: a :class:`gradtx.comm.Comm` over the data-parallel ranks; ``None``
        for one process.
      group: the comm group of the data-parallel ranks.
      reduce_grads: sum the accumulated grads over ``group`` at emission (for
        functional steps with no DDP/FSDP2 wrapper); needs ``comm``.

    Returns:
      An :class:`Accumulation` (a :class:`GradientTransformation`) with state :class:`AccumulateState`.

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
    if (k is None) == (every_k_schedule is None):
        raise ValueError("accumulate: give k (micro-steps per update) or every_k_schedule, exactly one of them")
    if every_k_schedule is not None:
        check.function(every_k_schedule, arg="every_k_schedule", name="accumulate")  # windows -> k
        k = 0  # recorded in the state: a scheduled window resumes only under a schedule
    else:
        k = check.integer(k, arg="k", name="accumulate", minimum=1)
    token_weighted = check.flag(token_weighted, arg="token_weighted", name="accumulate")
    reduce_grads = check.flag(reduce_grads, arg="reduce_grads", name="accumulate")
    if comm is not None:
        check_comm(comm, name="accumulate")
    if reduce_grads and comm is None:
        raise ValueError("accumulate: reduce_grads=True needs a comm over the data-parallel ranks (comm=...)")
    window = Window(k, token_weighted, comm, group, reduce_grads, every_k_schedule)
    if every_k_schedule is not None:
        window.window_k(window.init())  # a bad schedule fails here, not on the first micro-step

    def update_fn(updates, state, params=None, *, tokens=None, flush=False, **extra):
        window.check(state)
        leaves, spec = tu.tensor_leaves(updates, what="accumulate: updates")
        held = state.acc
        if held is None:  # a Window made without params: nothing summed yet
            held = empty_sums(params if params is not None else updates)
        sums, sum_spec = tu.flatten(held)
        opened = window.is_open(state)
        against = "the open window's running sum" if opened else "params"
        # A None grad (a param with no gradient) is allowed; a param the open window holds no sum of gets none
        # until it closes, and a None adds zeros to a sum it holds (as autograd's .grad keeps its sum; with
        # reduce_grads, a None is zeros: the ranks' sums are summed, a rank's None pattern may change).
        index, _, _ = tu.align(  # structure only: shapes are compared on local shards below
            tu.tree_map(lambda _: 0, held),
            tu.tree_map(lambda _: 0, updates),
            what="accumulate: updates",
            against=against,
            tensors=False,
        )
        p_leaves = tu.flatten(params)[0] if params is not None else []
        if window.reduce_grads and len(index) < len(sums) and len(p_leaves) != len(sums):
            raise ValueError(
                "accumulate: reduce_grads=True and an update of None (a param with no grad) need "
                "update(..., params): another rank may hold its grad, so this rank sums zeros of its shape"
            )
        summed = [isinstance(a, torch.Tensor) and a.numel() > 0 for a in sums]  # else an empty_sums placeholder
        sum_paths = tu.paths(held)
        if opened:
            given = {i: j for j, i in enumerate(index)}
            for i, path in enumerate(sum_paths):
                missing = summed[i] and i not in given and len(p_leaves) != len(sums)  # no param: no dtype to emit in
                unexpected = not summed[i] and i in given and not window.reduce_grads
                if missing or (unexpected and tu.local(leaves[given[i]]).numel() > 0):
                    where = "missing (pass update(..., params) to add zeros)" if missing else "unexpected"
                    raise ValueError(f"accumulate: updates does not match {against} at {tu.path_str(path)}: {where}")
            tu.check_devices(
                [sums[i] for i in index], leaves, updates, what="accumulate: updates", against="the open window's sum"
            )
        new = list(sums)
        for j, i in enumerate(index):
            g = tu.local(leaves[j])
            e = sums[i] if summed[i] else p_leaves[i] if len(p_leaves) == len(sums) else None
            if isinstance(e, torch.Tensor) and g.shape != tu.local(e).shape:
                raise ValueError(
                    f"accumulate: updates at {tu.path_str(sum_paths[i])} have shape {tuple(g.shape)}, "
                    f"expected {tuple(tu.local(e).shape)} ({against})"
                )
            if summed[i]:
                new[i] = tu.like(leaves[j], tu.local(sums[i]) + g)
            else:  # fp32 at least: bf16/fp16 sum in fp32, fp64 in fp64, complex keeps its imaginary part
                new[i] = tu.like(leaves[j], g.to(torch.promote_types(g.dtype, torch.float32), copy=True))
        device = tu.device_of(leaves or p_leaves) if leaves or p_leaves else None  # a rank with no grad: the params'
        loss = extra.get("loss")
        stepped = window.step(state._replace(acc=held), tokens=tokens, flush=flush, device=device, loss=loss)
        if stepped.factor is None:
            if int(stepped.state.micro_step) == 0:  # an empty window: dropped, nothing emitted
                return None, stepped.state
            return None, stepped.state._replace(acc=tu.unflatten(sum_spec, new))
        given = dict(zip(index, leaves))
        kept = [i for i, held_sum in enumerate(summed) if held_sum or i in given or window.reduce_grads]
        filled = len(kept) > len(index)
        if filled:
            # A param with no grad here emits the sum the window holds (a copy: the input state's own tensor, which
            # the sums below overwrite); with reduce_grads another rank may hold its grad: it joins the sum as zeros
            # and emits it, so every rank sums the same buffer and the replicas stay equal (as the wrapper fills .grad).
            for i in set(kept) - given.keys():
                p = p_leaves[i]
                new[i] = new[i].clone() if summed[i] else tu.like(p, empty_sums(p).new_zeros(tu.local(p).shape))
            leaves, index, spec = [given.get(i, p_leaves[i]) for i in kept], kept, sum_spec
        total = window.reduce([new[i] for i in index], write_back=True)  # the sums are ours
        scaled = tu.scale_leaves(total, stepped.factor, write_back=True)  # the sums are ours: fp32 sum times 1/n
        out = [tu.like(g, tu.local(s).to(g.dtype)) for g, s in zip(leaves, scaled)]
        return tu.unflatten(spec, tu.scatter(len(new), index, out) if filled else out), stepped.state

    # Whether the window emits is decided on the host: traced, that is a graph break inside the window's
    # bookkeeping, and dynamo (torch 2.13) then hands optree specs built by its polyfill to eager code,
    # which fails. The window runs eagerly instead, as one break; the rest of a compiled step is traced.
    reason = (
        "gradtx.accumulate decides on the host whether its window emits (data-dependent control flow): "
        "compile the step without fullgraph=True, or leave the accumulation to TransformedOptimizer"
    )
    return Accumulation(window.init, torch.compiler.disable(update_fn, reason=reason), window)
