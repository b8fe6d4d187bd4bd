"""The bookkeeping of an accumulation window: counting micro-steps and tokens, closing, normalising.

:class:`Window` is pure and keeps no buffer: :func:`gradtx.accumulate` sums
into an fp32 tree of its own, and :class:`gradtx.TransformedOptimizer` lets
autograd sum into ``.grad`` (:mod:`gradtx.wrapper.rules`). Both call
:meth:`Window.step` once per micro-step.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from gradtx.comm.base import Comm, GroupKey, ReduceOp
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import Params, PyTree, export_metrics
from gradtx.distributed.context_parallel import sharded_over


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
      token_weighted: whether this state was made for a token-weighted window
        (bool), checked as ``k`` is: the two sum different grads (summed or mean losses).
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
    token_weighted: torch.Tensor
    acc: PyTree
    loss_sum: torch.Tensor
    loss_weight: torch.Tensor
    last_loss: torch.Tensor
    windows: torch.Tensor


def multi_process() -> int:
    """The world size when torch.distributed runs several processes, else 0 (a query, no collective)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    world = torch.distributed.get_world_size()
    return world if world > 1 else 0


def _flush(flush: Any) -> bool:
    if not isinstance(flush, bool):  # bool("no") is True: a string would close the window
        raise TypeError(f"accumulate: flush must be True or False, got {flush!r}")
    return flush


def _token_count(tokens: Any, comm: Comm | None) -> int:
    """Validate a micro-batch's token count and return it as an int (reads only host memory); changes nothing."""
    world = multi_process() if comm is None else 0
    if world:
        raise ValueError(
            f"accumulate: token_weighted=True in a run of {world} processes needs comm= over the data-parallel "
            "ranks (e.g. accumulate(k, token_weighted=True, comm=gtx.comm.TorchComm(mesh), group='dp')), so the "
            "token total is the global batch's; pass comm=gtx.comm.LocalComm() if each rank's tokens are "
            "already the global count"
        )
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
    if isinstance(loss, torch.Tensor) and not loss.dtype.is_floating_point:
        raise TypeError(f"accumulate: loss must be a real floating-point number, got a {loss.dtype} tensor")
    device = loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")  # a number: a NaN one is data too
    return check.scalar(loss, arg="loss", name="accumulate", dtype=torch.float32, device=device)


def empty_sums(tree: Any) -> Any:
    """The running sum of a window that holds nothing: ``tree``'s structure, every tensor leaf a 0-element tensor.

    A window's state keeps its running sum from ``init`` on, so the state's
    structure never changes between steps; outside a window a leaf is this
    placeholder, in the sum's dtype (at least fp32) on the leaf's (local)
    device, and costs no memory. ``None`` gives ``None``.
    """

    def placeholder(p: Any) -> Any:
        if not isinstance(p, torch.Tensor):
            return p
        return torch.empty(0, dtype=torch.promote_types(p.dtype, torch.float32), device=tu.local(p).device)

    return tu.tree_map(placeholder, tree)


class WindowStep(NamedTuple):
    """What one micro-step did to the window.

    Attributes:
      factor: ``1 / denominator`` (0-d fp64 on the host; each use narrows it to the grads' precision) when
        the window closed with an update; else ``None``.
      state: the new :class:`AccumulateState` (``acc`` untouched while the window holds: the buffer is the
        caller's business; emptied when it closes).
    """

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
        # Host counters in, a host count out; tolist keeps a float or bool tensor's value for the check (int() truncates).
        k: Any = value.tolist() if isinstance(value, torch.Tensor) else value
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) and not float(k).is_integer() or k < 1:
            raise ValueError(
                f"accumulate: every_k_schedule({int(state.windows)}) must be an integer >= 1, got {value!r}"
            )
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
            token_weighted=torch.tensor(self.token_weighted),
            acc=empty_sums(params),
            loss_sum=torch.zeros((), dtype=torch.float32),
            loss_weight=zero.clone(),
            last_loss=torch.zeros((), dtype=torch.float32),
            windows=zero.clone(),
        )

    def check(self, state: Any) -> None:
        """Raise unless ``state`` is an :class:`AccumulateState` made for this window's ``k`` and weighting."""
        tu.require_state(state, AccumulateState, name="accumulate")
        made, this = (int(state.k), bool(state.token_weighted)), (self.k, self.token_weighted)
        if made != this:
            raise ValueError(
                f"accumulate: the state was made for (k, token_weighted)={made}, this transform has {this}; "
                "resume with the same k and token_weighted, or start from init()"
            )

    def is_open(self, state: AccumulateState) -> bool:
        """Whether a window is open (some micro-steps counted, none emitted yet)."""
        return int(state.micro_step) > 0

    def emits_next(self, state: AccumulateState, *, flush: bool = False) -> bool:
        """Whether the next micro-step closes the window (the ``k``-th, or one passed ``flush=True``)."""
        return _flush(flush) or int(state.micro_step) + 1 >= self.window_k(state)

    def check_tokens(self, tokens: Any) -> int:
        """Validate ``tokens`` for this window (the count, or 0 when not token-weighted); changes nothing."""
        return _token_count(tokens, self.comm) if self.token_weighted else 0

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
        this issues the one collective of the window (the token total over
        ``group``, with the loss and its weight) and reads the total on the
        host, to refuse a global zero. A window with no valid token anywhere
        closes without emitting (no factor, counted in ``empty_windows``) on
        every rank alike.

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
        _flush(flush)
        n = self.check_tokens(tokens)
        loss_value = _loss_value(loss)
        loss_sum, loss_weight = state.loss_sum, int(state.loss_weight)
        if loss_value is not None:
            loss_sum = loss_sum.to(loss_value.device) + loss_value
            loss_weight += n if self.token_weighted else 1
        micro_step = int(state.micro_step) + 1
        total = int(state.tokens) + n  # the open window's tokens on this rank (over every rank once reduced)
        if micro_step < self.window_k(state) and not flush:
            return WindowStep(
                None,
                state._replace(
                    micro_step=torch.tensor(micro_step),
                    tokens=torch.tensor(total),
                    emitted=torch.tensor(False),
                    loss_sum=loss_sum,
                    loss_weight=torch.tensor(loss_weight),
                ),
            )
        if self.token_weighted and self.comm is not None:
            # One collective, on the grads' device (a GPU process group, NCCL, reduces device tensors only), in
            # fp64 (exact for counts below 2**53): the tokens, and the window's loss with its weight, so the loss
            # is the global token mean, as the grads are.
            counts = torch.tensor([total, loss_weight], dtype=torch.float64, device=device)
            (reduced,) = self.comm.all_reduce(
                [torch.cat([counts, loss_sum.to(device, torch.float64).reshape(1)])], ReduceOp.SUM, self.group
            )
            total, loss_weight = (int(v) for v in reduced[:2].tolist())  # one read per optimizer step
            loss_sum = reduced[2].float()
        closed = state._replace(
            micro_step=torch.zeros((), dtype=torch.int64),
            tokens=torch.zeros((), dtype=torch.int64),
            acc=empty_sums(state.acc),
            loss_sum=torch.zeros((), dtype=torch.float32),
            loss_weight=torch.zeros((), dtype=torch.int64),
            last_loss=loss_sum / loss_weight if loss_weight > 0 else state.last_loss,
        )
        if self.token_weighted:
            if total == 0:
                # No valid token anywhere: the token mean is undefined, so every rank skips the window
                # alike (the total is global), before any grad collective: no rank is left waiting.
                return WindowStep(
                    None, closed._replace(emitted=torch.tensor(False), empty_windows=state.empty_windows + 1)
                )
            denom = total
        else:
            total = 0
            denom = micro_step * (self.comm.size(self.group) if self.reduce_grads and self.comm is not None else 1)
        factor = torch.tensor(1.0 / denom, dtype=torch.float64)  # exact for fp64 sums; scale_leaves narrows it
        return WindowStep(
            factor,
            closed._replace(
                emitted=torch.tensor(True),
                last_tokens=torch.tensor(total, dtype=torch.int64),
                windows=state.windows + 1,
            ),
        )

    def reduce(self, leaves: list[torch.Tensor], *, write_back: bool) -> list[torch.Tensor]:
        """Sum ``leaves`` over ``group`` in one coalesced collective, through their local shards (``reduce_grads``).

        With ``write_back`` the sums are written back into the leaves (keeping the
        ``.grad`` objects and their DTensor metadata); otherwise new leaves are returned.
        """
        if not self.reduce_grads or self.comm is None:
            return leaves
        sharded = sharded_over(self.comm, self.group)  # a DTensor's sharding over these ranks summed them already
        for i, g in enumerate(leaves if tu.has_dtensor(leaves) else ()):
            if (where := sharded(g)) is not None:
                raise ValueError(
                    f"accumulate: reduce_grads=True sums the grads over {self.group!r}, but grad {i} is sharded "
                    f"{where}, which holds several of its ranks: its sharding (FSDP2) summed it over them already, "
                    "and a sum of different shards is no grad; drop reduce_grads (see docs/distributed.md)"
                )
        return tu.all_reduce_leaves(self.comm, leaves, ReduceOp.SUM, self.group, write_back=write_back)
