"""What other layers may still read about a transform, until the streams that own those readers drop them.

* **Tied weights** (:func:`declare_ties`): the transform reads a norm over a
  pipeline plan's tied weights, which an earlier member must have summed, or it
  is that member (:func:`gradtx.pp_reduce`). A chain checks the order when it
  is built.
* **A window** (:class:`Windowed`, :func:`window_state`, :func:`empty_sum`):
  what the wrapper and the checkpoint read of :func:`gradtx.accumulate`.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from gradtx.core import tree as tu
from gradtx.core._transitional import *

_T = TypeVar("_T")

_TIES_READ = "tied_plans_read"
_TIES_REDUCED = "tied_plans_reduced"


def declare_ties(tx: _T, *, reads: tuple[Any, ...] = (), reduces: tuple[Any, ...] = ()) -> _T:
    """Declare the pipeline plans whose tied weights ``tx`` reads a norm over, or sums the grads of; returns ``tx``.

    ``reads``: plans (:func:`gradtx.mesh_groups` with ``tied=``) whose tied
    copies' grads must be summed before ``tx`` runs, as a norm over unsummed
    copies is wrong. ``reduces``: plans whose tied grads ``tx`` sums
    (:func:`gradtx.pp_reduce`). :func:`gradtx.chain` checks, when it is built,
    that every plan a member reads is reduced by an earlier member, and raises
    a ``ValueError`` otherwise; a chain declares what its members reduce, and
    what they read that none of them reduced.

    Example:
      >>> tx = declare_ties(GradientTransformation(init_fn, update_fn), reads=(plan,))
    """
    vars(tx)[_TIES_READ] = tuple(reads)
    vars(tx)[_TIES_REDUCED] = tuple(reduces)
    return tx


def ties_read(tx: Any) -> tuple[Any, ...]:
    """The plans whose tied weights ``tx`` reads a norm over, unsummed by ``tx`` itself (see :func:`declare_ties`)."""
    return tuple(getattr(tx, "__dict__", {}).get(_TIES_READ, ()))


def ties_reduced(tx: Any) -> tuple[Any, ...]:
    """The plans whose tied weights' grads ``tx`` sums (see :func:`declare_ties`)."""
    return tuple(getattr(tx, "__dict__", {}).get(_TIES_REDUCED, ()))


@runtime_checkable
class Windowed(Protocol):
    """A transform that holds its updates over a window of micro-steps, then emits their normalised sum.

    Every method takes the transform's own state and reads only the host:

    * ``emits_next(state, *, flush=False)``: whether the next micro-step closes the window;
    * ``is_open(state)``: whether micro-steps have been counted and not emitted;
    * ``count_step(state, *, tokens=None, flush=False, device=None) -> (factor | None, new_state)``:
      count one micro-step whose gradient the caller sums itself (autograd's ``.grad``);
      on the closing one, ``factor`` is ``1 / denominator``, else ``None`` (hold);
    * ``reduce(leaves)``: the caller's summed leaves, summed over the data-parallel
      ranks in place where the window says so (else returned as they are);
    * ``sum_window(updates, state, params=None, *, tokens=None, flush=False) ->
      (sum | None, factor | None, new_state)``: the pure function ``update`` is
      built on: the window's running sum in a new tree and its normaliser, or
      ``None`` while the window holds;
    * ``rank_local()``: what of the state differs between data-parallel ranks
      (a :class:`gradtx.transforms.accumulation.RankLocal`), for a checkpoint to sum on save;
    * ``k``: the window length (for messages).

    Its state is a NamedTuple declared with :func:`window_state` (as
    :class:`gradtx.AccumulateState`, which :class:`gradtx.Window` makes, is).

    :func:`gradtx.accumulate` is one; :class:`gradtx.Window` does the counting
    for a windowed transform of yours.
    """

    k: int

    def emits_next(self, state: Any, *, flush: bool = False) -> bool: ...

    def is_open(self, state: Any) -> bool: ...

    def count_step(
        self, state: Any, *, tokens: Any = None, flush: bool = False, device: torch.device | None = None
    ) -> tuple[torch.Tensor | None, Any]: ...

    def reduce(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def sum_window(
        self, updates: Any, state: Any, params: Any = None, *, tokens: Any = None, flush: bool = False
    ) -> tuple[Any, torch.Tensor | None, Any]: ...

    def rank_local(self) -> Any: ...


_WINDOW_FIELDS = "_gradtx_window_fields"
_S = TypeVar("_S", bound=type)


def empty_sum(params: Any) -> Any:
    """The running sum of a window that holds nothing: a tree like ``params``, every leaf a 0-element tensor.

    A window's state keeps its running sum from ``init`` on, so the state's
    structure never changes between steps; outside a window (and where a
    param got no gradient in the open one) a leaf is this 0-element
    placeholder, in the sum's dtype (``torch.promote_types(param.dtype, torch.float32)``)
    on the param's (local) device, and costs no memory. ``None`` gives ``None``.

    Example:
      >>> empty_sum({"w": torch.zeros(3)})["w"].shape
      torch.Size([0])
    """
    if params is None:
        return None
    return tu.tree_map(
        lambda p: (
            torch.empty(0, dtype=torch.promote_types(p.dtype, torch.float32), device=tu.local(p).device)
            if isinstance(p, torch.Tensor)
            else p
        ),
        params,
    )


def is_empty_sum(tree: Any) -> bool:
    """Whether a window's running sum holds nothing (``None``, or every tensor leaf a 0-element placeholder)."""
    return all(not isinstance(t, torch.Tensor) or t.numel() == 0 for t in tu.flatten(tree)[0])


def emptied(tree: Any) -> Any:
    """``tree`` with every tensor leaf replaced by the placeholder of :func:`empty_sum` (kept where it is one)."""
    return tu.tree_map(
        lambda t: (
            t
            if not isinstance(t, torch.Tensor) or t.numel() == 0 and t.dim() == 1 and not _is_dtensor(t)
            else torch.empty(0, dtype=t.dtype, device=tu.local(t).device)
        ),
        tree,
    )


def _is_dtensor(t: torch.Tensor) -> bool:
    return tu.DTensor is not None and isinstance(t, tu.DTensor)


def window_state(*, running_sum: str, micro_step: str, tokens: str, k: str) -> Any:
    """Class decorator: declare which fields of a window's state NamedTuple hold what, for the checkpoint.

    The checkpoint keeps ``running_sum`` (a tree like the params, each leaf in
    ``torch.promote_types(param.dtype, torch.float32)``: the sum while the
    window is open, the 0-element placeholder of :func:`empty_sum` where it
    holds nothing, which is saved as zeros) by parameter, refuses a load under another
    ``k``, and sums ``tokens`` and ``running_sum`` over the data-parallel ranks
    where the window's ``rank_local()`` says they are per rank.
    :class:`gradtx.AccumulateState` is declared with it.

    Example:
      >>> @window_state(running_sum="acc", micro_step="micro_step", tokens="tokens", k="k")
      ... class MyWindowState(NamedTuple): ...
    """
    fields = {"running_sum": running_sum, "micro_step": micro_step, "tokens": tokens, "k": k}

    def decorate(cls: _S) -> _S:
        names = getattr(cls, "_fields", None)
        if names is None:
            raise TypeError(f"window_state: decorates a NamedTuple class, got {cls!r}")
        missing = [f for f in fields.values() if f not in names]
        if missing:
            raise ValueError(f"window_state: {cls.__name__} has no field(s) {missing}; its fields are {names}")
        setattr(cls, _WINDOW_FIELDS, dict(fields))
        return cls

    return decorate


def window_fields(state: Any) -> dict[str, str] | None:
    """The fields a window's state declared with :func:`window_state` (``running_sum``, ...), or ``None``."""
    fields = getattr(type(state), _WINDOW_FIELDS, None)
    return dict(fields) if isinstance(state, tuple) and fields is not None else None
