"""The gradient-transformation protocol, the empty state, and the identity transform.

A :class:`GradientTransformation` is a pair of pure functions:

* ``init(params) -> state`` builds the transform's state, a pytree of tensors;
* ``update(updates, state, params=None, **extra) -> (updates, state)`` turns
  gradients (or updates from an earlier transform) into new updates.

``update`` never mutates ``updates``, ``state`` or ``params``; it returns new
trees. The updates it returns never share storage with the state it returns,
so a later transform that writes into its updates (``inplace=True``) cannot
corrupt an earlier transform's state. Extra keyword arguments (``tokens=...``, ``flush=...``) flow to every
member of a chain, and a transform ignores the ones it does not use.

A transform may also return ``None`` as its updates: that means "hold", the
step produced no update (an open accumulation window). A chain stops at a hold,
so nothing after it runs and nothing after it changes its state.

Reserved extras, passed by :class:`gradtx.TransformedOptimizer` (and by users
who own their buffers, as in a donated functional step):

* ``inplace=True``: the caller donates the ``updates`` buffers, so a transform
  may write its result into them. The numbers are the pure path's (bitwise for
  one scalar factor; within rounding when several factors fold into one).
* ``running_sum=True``: ``updates`` already hold the sum of the window's
  micro-batch gradients (autograd summed them into ``.grad``), so
  :func:`gradtx.accumulate` keeps no buffer of its own.
* ``deferred``: a :class:`DeferredScale` into which scalar transforms
  (clipping, accumulation's normalisation, :func:`gradtx.scale`) may put
  their factor instead of applying it, so the caller can fold it into a fused
  optimizer kernel. See :class:`DeferredScale`.
* ``fused_apply``: a :class:`gradtx.optimizers.FusedApply`, passed by
  :func:`gradtx.update_and_apply` with ``donate=True``. The aliases
  :func:`gradtx.sgd`, :func:`gradtx.adam` and :func:`gradtx.adamw` may claim
  it and apply the whole step to the donated params in one fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = PyTree
Schedule = Callable[[torch.Tensor], Any]


class InitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates | None, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure gradient transformation: ``init(params)`` and ``update(updates, state, params, **extra)``."""

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def identity() -> GradientTransformation:
    """Return the updates unchanged.

    Returns:
      A stateless :class:`GradientTransformation`.

    Example:
      >>> tx = identity()
      >>> updates, _ = tx.update({"w": torch.ones(2)}, tx.init(None))
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        return updates, state

    return GradientTransformation(init_fn, update_fn)


class DeferredScale:
    """A scalar factor that scalar transforms fold in instead of applying.

    Clipping by global norm, accumulation's normalisation and :func:`scale`
    all multiply every update by one scalar. When the caller passes
    ``deferred=DeferredScale()``, such a transform multiplies its factor into
    :attr:`factor` and returns the updates untouched, so the factor can ride
    inside a fused optimizer kernel (``grad_scale``) instead of costing a pass
    over memory. The true updates are always ``updates * factor``.

    A transform that is not scalar (AGC, Adam, clipping by value, anything a
    user writes) must see the true updates, so :func:`gradtx.chain` applies
    the pending factor before calling any member that has not declared itself
    scale-aware with :func:`scale_aware`.
    """

    def __init__(self) -> None:
        self.factor: torch.Tensor | None = None

    def fold(self, factor: torch.Tensor) -> None:
        """Multiply ``factor`` (a 0-d tensor) into the pending factor."""
        self.factor = factor if self.factor is None else self.factor * factor

    def take(self) -> torch.Tensor | None:
        """Return the pending factor and clear it."""
        factor, self.factor = self.factor, None
        return factor


_SCALE_AWARE = "_gradtx_scale_aware"


def scale_aware(update_fn: UpdateFn) -> UpdateFn:
    """Mark ``update_fn`` as able to take updates with a pending :class:`DeferredScale`."""
    setattr(update_fn, _SCALE_AWARE, True)
    return update_fn


def is_scale_aware(tx: GradientTransformation) -> bool:
    """Whether ``tx.update`` accepts updates that still carry a pending deferred factor."""
    return bool(getattr(tx.update, _SCALE_AWARE, False))


_GATE = "_gradtx_gate"


def gate(update_fn: UpdateFn) -> UpdateFn:
    """Mark ``update_fn`` as a gate: it may hold (return ``None``), like :func:`gradtx.accumulate`."""
    setattr(update_fn, _GATE, True)
    return update_fn


def is_gate(tx: GradientTransformation) -> bool:
    """Whether ``tx`` is, or contains, a gate that may hold."""
    return bool(getattr(tx.update, _GATE, False))


_StateType = TypeVar("_StateType", bound=type)


def export_metrics(*pairs: tuple[str, str]) -> Callable[[_StateType], _StateType]:
    """Class decorator: declare which fields of a state NamedTuple :func:`metrics` reports.

    It sets the ``_metrics`` class attribute that :func:`metrics` reads. Written
    as ``_metrics = ...`` in the class body, the same attribute works at run time,
    but type checkers refuse it: a name in a NamedTuple body is a field, and a
    field may not start with an underscore.

    Args:
      *pairs: ``(field name, metric name)`` pairs; each field must be one of the
        NamedTuple's fields.

    Returns:
      A decorator that returns the class itself, with ``_metrics`` set.

    Example:
      >>> @export_metrics(("count", "updates_seen"))
      ... class CountState(NamedTuple):
      ...     count: torch.Tensor
    """
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise TypeError(f"export_metrics: each pair must be a (field name, metric name) tuple of str, got {pair!r}")

    def decorate(cls: _StateType) -> _StateType:
        fields = getattr(cls, "_fields", None)
        if not (isinstance(cls, type) and issubclass(cls, tuple) and fields is not None):
            raise TypeError(f"export_metrics: decorates a NamedTuple class, got {cls!r}")
        missing = [field for field, _ in pairs if field not in fields]
        if missing:
            raise ValueError(f"export_metrics: {cls.__name__} has no field(s) {missing}; its fields are {fields}")
        setattr(cls, "_metrics", tuple(pairs))  # noqa: B010 (an attribute the NamedTuple does not declare)
        return cls

    return decorate


def metrics(state: OptState) -> dict[str, torch.Tensor]:
    """Named scalars found anywhere in a (chain) state: ``{"grad_norm": ..., "clip_coef": ...}``.

    A state NamedTuple declares what it exports with :func:`export_metrics`
    (which sets a ``_metrics`` class attribute: a tuple of ``(field name, metric
    name)`` pairs). When two members export the same name, the first one in chain
    order wins. Values are tensors; nothing is read to the host.

    Example:
      >>> updates, state = tx.update(grads, state, params)
      >>> float(metrics(state)["grad_norm"])
    """
    found: dict[str, torch.Tensor] = {}

    def walk(node: Any) -> None:
        exported = getattr(type(node), "_metrics", None)
        if isinstance(node, tuple) and exported:
            for field, name in exported:
                found.setdefault(name, getattr(node, field))
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (tuple, list)):
            for v in node:
                walk(v)

    walk(state)
    return found
