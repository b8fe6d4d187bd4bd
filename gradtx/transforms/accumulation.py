"""Exact gradient accumulation over micro-batches, plain or token-weighted.

Two pieces: :class:`Window`, the pure bookkeeping of an accumulation window
(count micro-steps and tokens, decide when it closes, and the normaliser
``1 / denominator``), and :func:`accumulate`, a transform that keeps the
window's running sum in an fp32 buffer of its own. :class:`gradtx.TransformedOptimizer`
drives the same :class:`Window` (:mod:`gradtx.wrapper.rules`), with autograd's
``.grad`` as the buffer.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Self

import torch

from gradtx.comm.base import Comm, GroupKey, ReduceOp, check_comm
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Params, PyTree, export_metrics, factory


@export_metrics(
    ("micro_step", "micro_step"),
    ("last_tokens", "tokens"),
    ("emitted", "emitted"),
    ("empty_windows", "empty_windows"),
)
class AccumulateState(NamedTuple):
    """The accumulation window.

    The counters live on the host (CPU, 0-d), so deciding whether a step
    emits never waits on a device.

    Attributes:
      micro_step: micro-steps taken in the open window (int64).
      tokens: valid tokens seen in the open window on this rank (int64).
      emitted: whether the last update emitted (bool).
      last_tokens: the token total of the last emitted window, summed over the
        data-parallel ranks (int64; 0 when not token-weighted).
      empty_windows: windows skipped because their valid tokens summed to 0
        over all ranks (int64).
      k: the window length this state was made for (int64), checked on every
        update so a state cannot be resumed under another ``k`` by mistake.
      acc: the fp32 running sum, a tree like the params, from ``init`` on (so the
        state's structure never changes): a leaf is the sum of its grads while a
        window is open in :func:`accumulate`, else a 0-element placeholder
        (:func:`empty_sums`; no memory), and always the placeholder when
        autograd is the buffer.
      loss_sum: the sum of the losses given (``update(..., loss=...)``) in the
        open window (fp32, 0-d, on the loss's device).
      loss_weight: what ``loss_sum`` is divided by when the window closes: the
        number of micro-steps that gave a loss, or their tokens when
        token-weighted (int64, on the host).
      last_loss: the last emitted window's loss, reduced as its grads were
        (fp32, 0-d); what the members after the window see as ``loss``.
      windows: the number of windows emitted so far (int64, on the host): what
        ``every_k_schedule`` is called with.
    """

    micro_step: torch.Tensor
    tokens: torch.Tensor
    emitted: torch.Tensor
    last_tokens: torch.Tensor
    empty_windows: torch.Tensor
    k: torch.Tensor
    acc: PyTree
    loss_sum: torch.Tensor
    loss_weight: torch.Tensor
    last_loss: torch.Tensor
    windows: torch.Tensor


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
    if tokens >= 2**62:
        raise ValueError(f"accumulate: tokens must be < 2**62 (an int64 running total), got {tokens}")
    return tokens


def _loss_value(loss: Any) -> torch.Tensor | None:
    """A micro-batch's loss as a detached fp32 0-d tensor (no host read), or ``None`` when none was given."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"accumulate: loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
        if not loss.dtype.is_floating_point:
            raise TypeError(f"accumulate: loss must be a real floating-point number, got a {loss.dtype} tensor")
        return loss.detach().reshape(()).to(torch.float32)
    return torch.tensor(check.number(loss, arg="loss", name="accumulate", finite=False), dtype=torch.float32)


def _multi_process() -> int:
    """The world size when torch.distributed runs several processes, else 0 (a query, no collective)."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    world = dist.get_world_size()
    return world if world > 1 else 0


def _placeholder(leaf: Any) -> bool:
    """Whether a leaf of a window's running sum holds nothing (an :func:`empty_sums` placeholder)."""
    return not isinstance(leaf, torch.Tensor) or leaf.numel() == 0


def empty_sums(tree: Any) -> Any:
    """The running sum of a window that holds nothing: ``tree``'s structure, every tensor leaf a 0-element tensor.

    A window's state keeps its running sum from ``init`` on, so the state's
    structure never changes between steps; outside a window a leaf is this
    placeholder, in the sum's dtype (at least fp32) on the leaf's (local)
    device, and costs no memory. ``None`` gives ``None``.
    """
    if tree is None:
        return None
    return tu.tree_map(
        lambda p: (
            torch.empty(0, dtype=torch.promote_types(p.dtype, torch.float32), device=tu.local(p).device)
            if isinstance(p, torch.Tensor)
            else p
        ),
        tree,
    )


class WindowStep(NamedTuple):
    """What one micro-step did to the window.

    Attributes:
      emit: the window closed with an update.
      factor: ``1 / denominator`` (0-d fp64 on the host; each use narrows it to the grads' precision) when
        ``emit``; else ``None``.
      state: the new :class:`AccumulateState` (``acc`` untouched while the window holds: the buffer is the
        caller's business; emptied when it closes).
    """

    emit: bool
    factor: torch.Tensor | None
    state: AccumulateState


@dataclass(frozen=True)
class Window:
    """The pure bookkeeping of an accumulation window: counting, closing, normalising.

    It keeps no buffer: :func:`accumulate` sums into an fp32 tree of its own,
    and :class:`gradtx.TransformedOptimizer` lets autograd sum into ``.grad``.
    Both call :meth:`step` once per micro-step.
    """

    k: int
    token_weighted: bool = False
    comm: Comm | None = None
    group: GroupKey = "dp"
    reduce_grads: bool = False
    every_k_schedule: Any = None  # ``windows -> k``; then ``k`` is 0 (recorded in the state as such)

    def window_k(self, state: AccumulateState) -> int:
        """The length of the window ``state`` is in: ``k``, or ``every_k_schedule(windows emitted so far)``."""
        if self.every_k_schedule is None:
            return self.k
        value = self.every_k_schedule(state.windows)
        k = int(value) if isinstance(value, torch.Tensor) else value  # host counters in, a host count out
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) and not float(k).is_integer() or k < 1:
            raise ValueError(f"accumulate: every_k_schedule({int(state.windows)}) must be an integer >= 1, got {value!r}")
        return int(k)

    def init(self, params: Params | None = None) -> AccumulateState:
        """A fresh window; its running sum is :func:`empty_sums` of ``params`` (``None`` without)."""
        zero = torch.zeros((), dtype=torch.int64)
        return AccumulateState(
            micro_step=zero,
            tokens=zero.clone(),
            emitted=torch.zeros((), dtype=torch.bool),
            last_tokens=zero.clone(),
            empty_windows=zero.clone(),
            k=torch.tensor(self.k, dtype=torch.int64),
            acc=empty_sums(params),
            loss_sum=torch.zeros((), dtype=torch.float32),
            loss_weight=zero.clone(),
            last_loss=torch.zeros((), dtype=torch.float32),
            windows=zero.clone(),
        )

    def check(self, state: Any) -> None:
        """Raise unless ``state`` is an :class:`AccumulateState` made for this window's ``k``."""
        tu.require_state(state, AccumulateState, name="accumulate")
        if int(state.k) != self.k:
            raise ValueError(
                f"accumulate: the state was made for k={int(state.k)}, this transform has k={self.k}; "
                "resume with the same k, or start from init()"
            )

    def is_open(self, state: AccumulateState) -> bool:
        """Whether a window is open (some micro-steps counted, none emitted yet)."""
        return int(state.micro_step) > 0

    def emits_next(self, state: AccumulateState, *, flush: bool = False) -> bool:
        """Whether the next micro-step closes the window (the ``k``-th, or one passed ``flush=True``)."""
        return flush or int(state.micro_step) + 1 >= self.window_k(state)

    def check_tokens(self, tokens: Any) -> int:
        """Validate ``tokens`` for this window (the count, or 0 when not token-weighted); changes nothing."""
        if not self.token_weighted:
            return 0
        world = _multi_process() if self.comm is None else 0
        if world:
            raise ValueError(
                f"accumulate: token_weighted=True in a run of {world} processes needs comm= over the data-parallel "
                "ranks (e.g. accumulate(k, token_weighted=True, comm=gtx.comm.TorchComm(mesh), group='dp')), so the "
                "token total is the global batch's; pass comm=gtx.comm.LocalComm() if each rank's tokens are "
                "already the global count"
            )
        return _token_count(tokens)

    def step(
        self,
        state: AccumulateState,
        *,
        tokens: Any = None,
        flush: bool = False,
        device: torch.device | None = None,
        loss: Any = None,
    ) -> WindowStep:
        """Count one micro-step; on the closing one, compute the normaliser.

        On the closing micro-step of a token-weighted window with a ``comm``,
        this issues the one scalar collective of the window (the token total
        over ``group``) and reads the total on the host, to refuse a global
        zero. A window with no valid token anywhere closes without emitting
        (``emit`` False, counted in ``empty_windows``) on every rank alike.

        Args:
          state: the window's state.
          tokens: this micro-batch's valid tokens (token-weighted windows).
          flush: close the window now, over its real size.
          device: where the factor (and the token collective) lives: the grads' device.
          loss: this micro-batch's loss (its mean loss, or its summed loss when
            token-weighted, as its grads are), added to the window's loss; the
            closing step's :attr:`AccumulateState.last_loss` is their mean (or
            token mean), what the members after the window see as ``loss``.
        """
        self.check(state)
        n = self.check_tokens(tokens)
        loss_value = _loss_value(loss)
        loss_sum, loss_weight = state.loss_sum, int(state.loss_weight)
        if loss_value is not None:
            loss_sum = loss_sum.to(loss_value.device) + loss_value
            loss_weight += n if self.token_weighted else 1
        micro_step = int(state.micro_step) + 1
        window_tokens = int(state.tokens) + n
        if micro_step < self.window_k(state) and not flush:
            return WindowStep(
                False,
                None,
                state._replace(
                    micro_step=torch.tensor(micro_step),
                    tokens=torch.tensor(window_tokens),
                    emitted=torch.tensor(False),
                    loss_sum=loss_sum,
                    loss_weight=torch.tensor(loss_weight),
                ),
            )
        device = device if device is not None else torch.device("cpu")
        closed = state._replace(
            micro_step=torch.zeros((), dtype=torch.int64),
            tokens=torch.zeros((), dtype=torch.int64),
            acc=empty_sums(state.acc),
            loss_sum=torch.zeros((), dtype=torch.float32),
            loss_weight=torch.zeros((), dtype=torch.int64),
            last_loss=loss_sum / loss_weight if loss_weight > 0 else state.last_loss,
        )
        if self.token_weighted:
            total = window_tokens
            if self.comm is not None:
                # On the grads' device: a GPU process group (NCCL) reduces device tensors only.
                (global_total,) = self.comm.all_reduce([torch.tensor(total, device=device)], ReduceOp.SUM, self.group)
                total = int(global_total.cpu())  # one scalar per optimizer step
            if total == 0:
                # No valid token anywhere: the token mean is undefined, so every rank skips the window
                # alike (the total is global), before any grad collective: no rank is left waiting.
                return WindowStep(
                    False, None, closed._replace(emitted=torch.tensor(False), empty_windows=state.empty_windows + 1)
                )
            denom = total
        else:
            total = 0
            denom = micro_step * (self.comm.size(self.group) if self.reduce_grads and self.comm is not None else 1)
        factor = torch.tensor(1.0 / denom, dtype=torch.float64)  # exact for fp64 sums; scale_leaves narrows it
        return WindowStep(
            True,
            factor,
            closed._replace(
                emitted=torch.tensor(True),
                last_tokens=torch.tensor(total, dtype=torch.int64),
                windows=state.windows + 1,
            ),
        )

    def reduce(self, leaves: list[torch.Tensor], *, inplace: bool) -> list[torch.Tensor]:
        """Sum ``leaves`` over ``group`` in one coalesced collective, through their local shards (``reduce_grads``).

        With ``inplace`` the sums are written back into the leaves (keeping the
        ``.grad`` objects and their DTensor metadata); otherwise new leaves are returned.
        """
        if not self.reduce_grads or self.comm is None:
            return leaves
        return tu.all_reduce_leaves(self.comm, leaves, ReduceOp.SUM, self.group, inplace=inplace)


class Accumulation(GradientTransformation):
    """What :func:`accumulate` returns: the transform, with its pieces exposed.

    Attributes:
      window: the :class:`Window` (counting and normalising, no buffer).
      sum_window: ``(updates, state, params=None, *, tokens=None, flush=False)
        -> (sum | None, factor | None, new_state)``, the pure function ``update``
        is built on: the window's fp32 running sum (a new tree) and its
        normaliser, or ``None`` while the window holds. ``update`` returns
        ``sum * factor`` in the grads' dtype.
    """

    window: Window
    sum_window: Any

    def __new__(cls, init: Any, update: Any, window: Window, sum_window: Any) -> Self:
        self = super().__new__(cls, init, update)
        self.window = window
        self.sum_window = sum_window
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle rebuild it with every field
        return (self.init, self.update, self.window, self.sum_window)

    @property
    def k(self) -> int:
        """The window length."""
        return self.window.k

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
      when token-weighted. In a run of several processes, token weighting
      without a ``comm`` raises: each rank would divide by its own tokens.
    * A functional step (``torch.func.grad`` on each rank) does not: pass
      ``reduce_grads=True`` and gradtx sums the window's accumulated grads
      over ``group`` once, at emission, in one coalesced collective (in fp32
      unless autograd is the accumulator, then in the grads' dtype). The
      emitted update is then ``sum over ranks and micro-steps of grad /
      global token total`` (token-weighted) or ``... / (micro-steps * ranks)``
      (plain mean), identical on every rank.

    The window itself (counting micro-steps and tokens, and the normaliser
    ``1 / denominator``) is :attr:`Accumulation.window`, a pure object that
    :class:`gradtx.TransformedOptimizer` drives with autograd's ``.grad`` as the
    buffer, so no second buffer exists there.

    Per emitted update this issues at most two collectives over ``group``: one
    scalar SUM of the token total (token-weighted with a ``comm``), then one
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
        if not callable(every_k_schedule):
            raise TypeError(
                f"accumulate: every_k_schedule must be a callable windows -> k, got {type(every_k_schedule).__name__}"
            )
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

    def init_fn(params: Params) -> AccumulateState:
        return window.init(params)

    def update_fn(updates, state, params=None, *, tokens=None, flush=False, **extra):
        total, factor, new_state = sum_window(
            updates, state, params, tokens=tokens, flush=flush, loss=extra.get("loss")
        )
        if total is None:
            return None, new_state
        leaves, spec = tu.flatten(updates)
        scaled = tu.scale_leaves(tu.flatten(total)[0], factor, inplace=True)  # the sums are ours
        return tu.unflatten(spec, [tu.like(g, tu.local(s).to(g.dtype)) for g, s in zip(leaves, scaled)]), new_state

    def sum_window(updates, state, params=None, *, tokens=None, flush=False, loss=None):
        """The window's fp32 sum (``None`` while it holds) and its normaliser: ``update`` is their product."""
        window.check(state)
        leaves, spec = tu.flatten(updates)
        tu.check_tensors(leaves, tree=updates, what="accumulate: updates")
        window.check_tokens(tokens)  # before anything is summed: a bad count leaves nothing half done
        _loss_value(loss)
        held = state.acc
        if held is None:  # a Window made without params: nothing summed yet
            held = empty_sums(params if params is not None else updates)
        sums, sum_spec = tu.flatten(held)
        opened = window.is_open(state)
        against = "the open window's running sum" if opened else "params"
        # A None grad (a param with no gradient) is allowed; the window keeps that pattern to its end.
        index, _, _ = tu.align(  # structure only: shapes are compared on local shards below
            tu.tree_map(lambda _: 0, held), tu.tree_map(lambda _: 0, updates),
            what="accumulate: updates", against=against, tensors=False,
        )  # fmt: skip
        p_leaves = tu.flatten(params)[0] if params is not None else []
        summed = [not _placeholder(a) for a in sums]
        sum_paths = tu.paths(held)
        for j, i in enumerate(index):
            e = sums[i] if summed[i] else p_leaves[i] if len(p_leaves) == len(sums) else None
            g = leaves[j]
            if isinstance(e, torch.Tensor) and tu.local(g).shape != tu.local(e).shape:
                raise ValueError(
                    f"accumulate: updates at {tu.path_str(sum_paths[i])} have shape {tuple(tu.local(g).shape)}, "
                    f"expected {tuple(tu.local(e).shape)} ({against})"
                )
        if opened:
            given = {i: j for j, i in enumerate(index)}
            for i, path in enumerate(sum_paths):
                if summed[i] != (i in given) and (summed[i] or tu.local(leaves[given[i]]).numel() > 0):
                    where = "missing" if summed[i] else "unexpected"
                    raise ValueError(f"accumulate: updates does not match {against} at {tu.path_str(path)}: {where}")
            tu.check_devices(
                [sums[i] for i in index], leaves, updates, what="accumulate: updates", against="the open window's sum"
            )
        new = list(sums)
        for j, i in enumerate(index):
            g = leaves[j]
            if summed[i]:
                new[i] = tu.like(g, tu.local(sums[i]) + tu.local(g))
            else:  # fp32 at least: bf16/fp16 sum in fp32, fp64 in fp64, complex keeps its imaginary part
                new[i] = tu.like(g, tu.local(g).to(torch.promote_types(g.dtype, torch.float32), copy=True))
        device = tu.local(leaves[0]).device if leaves else None
        stepped = window.step(state._replace(acc=held), tokens=tokens, flush=flush, device=device, loss=loss)
        if stepped.factor is None:
            if int(stepped.state.micro_step) == 0:  # an empty window: dropped, nothing emitted
                return None, None, stepped.state
            return None, None, stepped.state._replace(acc=tu.unflatten(sum_spec, new))
        total = window.reduce([new[i] for i in index], inplace=True)  # the sums are ours
        return tu.unflatten(spec, total), stepped.factor, stepped.state

    # Whether the window emits is decided on the host: traced, that is a graph break inside the window's
    # bookkeeping, and dynamo (torch 2.13) then hands optree specs built by its polyfill to eager code,
    # which fails. The window runs eagerly instead, as one break; the rest of a compiled step is traced.
    reason = (
        "gradtx.accumulate decides on the host whether its window emits (data-dependent control flow): "
        "compile the step without fullgraph=True, or leave the accumulation to TransformedOptimizer"
    )
    update_fn = torch.compiler.disable(update_fn, reason=reason)
    sum_window = torch.compiler.disable(sum_window, reason=reason)
    return Accumulation(init_fn, update_fn, window, sum_window)
