"""Schedules: functions from the step count to a hyperparameter value, with optax's names and numbers.

This module has the basic shapes (constant, polynomial, linear, piecewise
constant, exponential, cosine); :mod:`gradtx.schedules.combined` builds
warm-ups, one-cycles, joins and SGDR from them.

A schedule takes the step count, either the 0-d int64 tensor that
:func:`gradtx.scale_by_schedule` (and every ``learning_rate=`` argument) passes
it, or a Python int, and returns a 0-d fp32 tensor on the count's device. It
uses tensor ops only (``torch.where``, ``torch.clamp``), so it runs on the
device with no host sync and compiles under ``torch.compile(fullgraph=True)``
with no graph break.

The formulas, argument names, defaults and edge cases are optax's, and the
operations run in optax's order in fp32, so the values match optax's to fp32
rounding. A schedule is plain Python: any callable ``count -> value`` works
wherever a schedule does.

Example:
  >>> lr = warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=100, decay_steps=1000)
  >>> tx = gradtx.adamw(learning_rate=lr)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradtx.core import validate as check
from gradtx.core.base import factory

Schedule = Callable[[Any], torch.Tensor]

__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "linear_schedule",
    "piecewise_constant_schedule",
    "polynomial_schedule",
]


# --- helpers -----------------------------------------------------------------------------


def _count(count: Any) -> torch.Tensor:
    """The step count as a tensor (a Python or NumPy int becomes a 0-d int64 CPU tensor)."""
    if isinstance(count, torch.Tensor):
        return count
    if isinstance(count, bool) or not isinstance(count, numbers.Real):
        raise TypeError(f"schedule: the step count must be a number or a 0-d tensor, got {type(count).__name__}")
    return torch.tensor(count)


def _values(name: str, **values: Any) -> list[float]:
    """Each keyword argument checked as a number, named in the error."""
    return [check.number(v, arg=arg, name=name) for arg, v in values.items()]


def _scales(boundaries_and_scales: Mapping[int, float] | None, *, name: str) -> list[tuple[int, float]]:
    """``{step: scale}`` as sorted ``(step, scale)`` pairs, every scale ``>= 0``."""
    if boundaries_and_scales is not None and not isinstance(boundaries_and_scales, Mapping):
        raise TypeError(f"{name}: boundaries_and_scales must be a dict {{step: scale}}, got {boundaries_and_scales!r}")
    items = sorted(
        (check.integer(b, arg="boundaries_and_scales", name=name), check.number(s, arg="scale", name=name))
        for b, s in (boundaries_and_scales or {}).items()
    )
    if any(s < 0 for _, s in items):
        raise ValueError(f"{name}: boundaries_and_scales expects non-negative scale factors, got {dict(items)}")
    return items


def _full(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _as_value(value: Any, like: torch.Tensor) -> torch.Tensor:
    """A schedule's output as a 0-d fp32 tensor beside the count (a user schedule may return a number)."""
    value = check.number(value, arg="a schedule's value", name="join_schedules", finite=False, tensor=True)
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32)
    return _full(float(value), like)


# --- schedules ---------------------------------------------------------------------------


@factory
def constant_schedule(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Args:
      value: the value to hold.

    Returns:
      A schedule ``count -> value`` (a 0-d fp32 tensor).

    References:
      Optax's ``constant_schedule``.

    Example:
      >>> constant_schedule(5.0)(100)
      tensor(5.)
    """
    value = check.number(value, arg="value", name="constant_schedule")

    def schedule(count: Any) -> torch.Tensor:
        return _full(value, _count(count))

    return schedule


@factory
def polynomial_schedule(
    init_value: float, end_value: float, power: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    r"""A polynomial transition from ``init_value`` to ``end_value``.

    The value at step ``t`` is ``init_value`` before ``transition_begin`` (B),
    ``(init_value - end_value) * (1 - (t - B) / transition_steps) ** power + end_value``
    during the transition, and ``end_value`` after it.

    Args:
      init_value: the value before the transition.
      end_value: the value after it.
      power: the polynomial's power.
      transition_steps: the transition's length; ``<= 0`` gives a constant ``init_value`` (as in optax).
      transition_begin: the step at which the transition starts; a negative value means 0 (as in optax).

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``polynomial_schedule``.

    Example:
      >>> float(polynomial_schedule(1.0, 0.01, power=2, transition_steps=100)(100))
      0.01...
    """
    name = "polynomial_schedule"
    init_value, end_value = _values(name, init_value=init_value, end_value=end_value)
    power = check.non_negative(power, arg="power", name=name)  # a negative power climbs to inf at the end
    transition_steps = check.integer(transition_steps, arg="transition_steps", name=name)
    transition_begin = check.integer(transition_begin, arg="transition_begin", name=name)
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)
    delta = init_value - end_value  # a Python number, as optax's (init - end) is before it meets an array

    def schedule(count: Any) -> torch.Tensor:
        c = torch.clamp(_count(count) - transition_begin, 0, transition_steps)
        frac = 1 - c.float() / transition_steps
        return delta * frac**power + end_value

    return schedule


@factory
def linear_schedule(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """A linear transition from ``init_value`` to ``end_value``: :func:`polynomial_schedule` with ``power=1``.

    Args:
      init_value: the value before the transition.
      end_value: the value after it.
      transition_steps: the transition's length; ``<= 0`` gives a constant ``init_value``.
      transition_begin: the step at which the transition starts.

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``linear_schedule``.

    Example:
      >>> float(linear_schedule(0.0, 1.0, transition_steps=10)(5))
      0.5
    """
    name = "linear_schedule"  # checked here, so an error names this schedule and its own arguments
    _values(name, init_value=init_value, end_value=end_value)
    check.integer(transition_steps, arg="transition_steps", name=name)
    check.integer(transition_begin, arg="transition_begin", name=name)
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


@factory
def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """``init_value`` times the product of every scale whose boundary the step has reached.

    Args:
      init_value: the value before the first boundary.
      boundaries_and_scales: ``{step: scale}``; from ``step`` on, the value is multiplied by ``scale`` (``>= 0``).

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``piecewise_constant_schedule``.

    Example:
      >>> s = piecewise_constant_schedule(1.0, {100: 0.1, 200: 0.1})
      >>> float(s(50)), float(s(150)), round(float(s(250)), 6)
      (1.0, 0.10000000149011612, 0.01)
    """
    name = "piecewise_constant_schedule"
    init_value = check.number(init_value, arg="init_value", name=name)
    items = _scales(boundaries_and_scales, name=name)

    def schedule(count: Any) -> torch.Tensor:
        c = _count(count)
        v = _full(init_value, c)
        for threshold, scale in items:
            v = torch.where(c < threshold, v, scale * v)
        return v

    return schedule


@factory
def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """Exponential decay: ``init_value * decay_rate ** ((count - transition_begin) / transition_steps)``.

    Args:
      init_value: the value up to ``transition_begin``.
      transition_steps: the decay's time scale; ``<= 0`` gives a constant ``init_value`` (as in optax).
      decay_rate: the factor per ``transition_steps``; ``0`` gives a constant ``init_value`` (as in optax).
      transition_begin: the step at which decay starts; a negative value means 0.
      staircase: decay in discrete steps (integer division of the exponent).
      end_value: a floor when ``decay_rate < 1``, a ceiling when ``> 1``.

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``exponential_decay``.

    Example:
      >>> float(exponential_decay(1.0, transition_steps=10, decay_rate=0.5)(20))
      0.25
    """
    name = "exponential_decay"
    init_value = check.number(init_value, arg="init_value", name=name)
    decay_rate = check.non_negative(decay_rate, arg="decay_rate", name=name)  # a negative rate: NaN between steps
    transition_steps = check.integer(transition_steps, arg="transition_steps", name=name)
    transition_begin = check.integer(transition_begin, arg="transition_begin", name=name)
    staircase = check.flag(staircase, arg="staircase", name=name)
    if end_value is not None:
        end_value = check.number(end_value, arg="end_value", name=name)
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(count: Any) -> torch.Tensor:
        decreased = _count(count) - transition_begin
        p = decreased.float() / transition_steps
        if staircase:
            p = torch.floor(p)
        decayed = torch.where(decreased <= 0, init_value, init_value * torch.pow(decay_rate, p))
        if end_value is not None:
            decayed = torch.clamp(decayed, min=end_value) if decay_rate < 1.0 else torch.clamp(decayed, max=end_value)
        return decayed

    return schedule


@factory
def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    r"""Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    The value is ``init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * t / T))) ** exponent + alpha)``
    for ``t <= T = decay_steps`` and ``alpha * init_value`` after.

    Args:
      init_value: the starting value.
      decay_steps: the decay's length; ``> 0``.
      alpha: the final value as a fraction of ``init_value``.
      exponent: the power applied to the cosine factor.

    Returns:
      A schedule ``count -> value``.

    References:
      Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", 2017; optax's
      ``cosine_decay_schedule``.

    Example:
      >>> float(cosine_decay_schedule(1.0, decay_steps=100)(50))
      0.5
    """
    name = "cosine_decay_schedule"
    init_value, alpha = _values(name, init_value=init_value, alpha=alpha)
    exponent = check.non_negative(exponent, arg="exponent", name=name)
    decay_steps = check.integer(decay_steps, arg="decay_steps", name=name)
    if not decay_steps > 0:
        raise ValueError(f"{name}: decay_steps must be > 0, got {decay_steps}")

    def schedule(count: Any) -> torch.Tensor:
        c = torch.clamp(_count(count).float(), max=float(decay_steps))
        cosine = 0.5 * (1 + torch.cos(math.pi * c / decay_steps))
        decayed = (1 - alpha) * cosine**exponent + alpha
        return init_value * decayed

    return schedule
