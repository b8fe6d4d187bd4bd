"""Measuring what flows through a chain: ``snapshot``, ``monitor`` and ``measure_with_ema``.

Measurements live in the state, where optax users read them
(``state.measurement["name"]``, ``state.measurements["name"]``), and
:func:`gradtx.metrics` finds them by name anywhere in a chain's state. Nothing
is read to the host: a measurement is a tensor (or a tree of tensors) beside
the grads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    PyTree,
    export_metrics,
    factory,
    init_empty_state,
)
from gradtx.transforms.averaging import _decay, ema
from gradtx.transforms.combine import chain

__all__ = ["MonitorState", "SnapshotState", "measure_with_ema", "monitor", "snapshot"]

Measure = Callable[[PyTree], PyTree]


def _tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: PyTree) -> PyTree:
    # fn of each tensor leaf: zeros of a measurement, or a copy. A measure may return the updates themselves (or
    # params), and the state must not share their storage: the wrapper writes the chain's result into that .grad.
    return tu.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


@export_metrics(("measurement", "*"))
class SnapshotState(NamedTuple):
    """The last measurement, as ``{measure_name: value}``."""

    measurement: dict[str, Any]


@factory
def snapshot(measure_name: str, measure: Measure) -> GradientTransformation:
    """Record ``measure(updates)`` in the state under ``measure_name``; the updates pass through unchanged.

    Put it anywhere in a chain to see the updates at that point (the raw
    grads' norm before a clip, the final step's after the learning rate). Read
    it as ``state.measurement[measure_name]``, or ``gradtx.metrics(state)[measure_name]``
    from the whole chain's state. As optax's ``snapshot``; before the first
    update the state holds ``measure(params)``, as optax's does.

    Args:
      measure_name: the key of the measurement.
      measure: a function of the updates tree, returning a tensor (or a tree of tensors).

    Returns:
      A :class:`GradientTransformation` with state :class:`SnapshotState`.

    References:
      Optax's ``snapshot`` (DeepMind, 2025).

    Example:
      >>> tx = chain(snapshot("grad_norm", global_norm), clip_by_global_norm(1.0), adam(1e-3))
      >>> updates, state = tx.update(grads, tx.init(params))
      >>> metrics(state)["grad_norm"]
    """
    if not isinstance(measure_name, str):
        raise TypeError(f"snapshot: measure_name must be a str, got {type(measure_name).__name__}")
    check.function(measure, arg="measure", name="snapshot")

    def init_fn(params: Params) -> SnapshotState:
        with torch.no_grad():  # of params that require grad: a state holds no graph (and deep-copies)
            return SnapshotState({measure_name: _tensors(torch.clone, measure(params))})

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, SnapshotState, name="snapshot")
        return updates, SnapshotState({measure_name: _tensors(torch.clone, measure(updates))})

    return GradientTransformation(init_fn, update_fn)


@export_metrics(("measurements", "*"))
class MonitorState(NamedTuple):
    """The last measurements (``{name: value}``) and the measures' own states (a tuple, in the measures' order)."""

    measurements: dict[str, Any]
    measure_states: tuple[OptState, ...]


def _stateless_measure(fn: Measure) -> GradientTransformation:
    """A stateless transform whose updates are ``fn(updates)`` (as :func:`gradtx.identity` is built)."""
    return GradientTransformation(init_empty_state, lambda updates, state, params=None, **extra: (fn(updates), state))


@factory
def monitor(measures: Mapping[str, GradientTransformation | Measure]) -> GradientTransformation:
    """Record several measurements of the updates in the state; the updates pass through unchanged.

    Each measure is a function of the updates, or a transform whose output is
    the measurement and whose state it keeps (:func:`measure_with_ema`, an
    :func:`ema` of a function). Read them as ``state.measurements[name]``, or
    ``gradtx.metrics(state)[name]``. As optax's ``monitor``, with one
    difference: the state holds a zero of every measurement from ``init`` on
    (optax's starts as ``{}``), so its structure never changes and a state
    saved before the first step loads into a run that has stepped.

    Args:
      measures: ``{name: measure}``; a measure is a function of the updates or a
        :class:`GradientTransformation` (given the updates, the state it keeps,
        the params and the update's extra keywords).

    Returns:
      A :class:`GradientTransformation` with state :class:`MonitorState`.

    References:
      Optax's ``monitor`` (DeepMind, 2025).

    Example:
      >>> tx = chain(monitor({"grad_norm": global_norm, "smooth_norm": measure_with_ema(global_norm, 0.9)}), adam(1e-3))
    """
    if not isinstance(measures, Mapping):
        raise TypeError(f"monitor: measures must be a dict of name -> measure, got {type(measures).__name__}")
    txs: dict[str, GradientTransformation] = {}
    for key, measure in measures.items():
        if not isinstance(key, str):
            raise TypeError(f"monitor: measures' keys must be str, got {key!r}")
        if isinstance(measure, GradientTransformation):
            txs[key] = measure
        elif callable(measure):
            txs[key] = _stateless_measure(measure)
        else:
            raise TypeError(
                f"monitor: measures[{key!r}] must be a function or a transform, got {type(measure).__name__}"
            )
    names = tuple(txs)

    def init_fn(params: Params) -> MonitorState:
        states = tuple(txs[n].init(params) for n in names)
        # A zero of each measurement, shaped by measuring the params, so the state's structure is fixed from the start.
        measured = (txs[n].update(params, s, params)[0] for n, s in zip(names, states))
        return MonitorState({n: _tensors(torch.zeros_like, m) for n, m in zip(names, measured)}, states)

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, MonitorState, name="monitor")
        if len(state.measure_states) != len(names):
            raise ValueError(
                f"monitor: the state holds {len(state.measure_states)} measures, this monitor {len(names)}"
            )
        results = [txs[n].update(updates, s, params, **extra) for n, s in zip(names, state.measure_states)]
        measurements = {n: _tensors(torch.clone, m) for n, (m, _) in zip(names, results)}
        return updates, MonitorState(measurements, tuple(s for _, s in results))  # updates pass on

    return GradientTransformation(init_fn, update_fn)


@factory
def measure_with_ema(
    measure: Measure,
    decay: float | torch.Tensor,
    debias: bool = True,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """A measure for :func:`monitor`: the exponential moving average of ``measure(updates)``.

    A transform whose output is the (debiased) average, and whose state is
    ``(EmptyState(), EmaState)``, as optax's ``chain(stateless(measure), ema(...))``.

    Args:
      measure: a function of the updates, returning a float tensor (or a tree of them).
      decay: the EMA's decay; in ``[0, 1]`` (``< 1`` with ``debias``).
      debias: divide by ``1 - decay**t``.
      accumulator_dtype: the dtype the average is kept in; ``None``: the measurement's.

    Returns:
      A :class:`GradientTransformation` whose output is the measurement's average.

    References:
      Optax's ``measure_with_ema`` (DeepMind, 2025).

    Example:
      >>> tx = chain(monitor({"norm_ema": measure_with_ema(global_norm, 0.99)}), adam(1e-3))
    """
    check.function(measure, arg="measure", name="measure_with_ema")
    decay = _decay(decay, arg="decay", name="measure_with_ema")
    debias = check.flag(debias, arg="debias", name="measure_with_ema")
    average = ema(decay, debias, accumulator_dtype)

    def init_fn(params: Params) -> tuple[EmptyState, Any]:
        return (EmptyState(), average.init(measure(params)))  # the average mirrors the measurement, not the params

    return GradientTransformation(init_fn, chain(_stateless_measure(measure), average).update)
