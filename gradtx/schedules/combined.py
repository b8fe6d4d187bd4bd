"""Schedules built from the basic shapes: piecewise interpolation, one-cycles, joins, warm-ups and SGDR.

Like :mod:`gradtx.schedules.builtin`'s, each takes the step count (a 0-d int64
tensor or a Python int) and returns a 0-d fp32 tensor on its device, with
optax's names, formulas and numbers, and no host sync.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from gradtx.core import validate as check
from gradtx.core.base import factory
from gradtx.schedules.builtin import (
    Schedule,
    _as_value,
    _count,
    _scales,
    _values,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
)

__all__ = [
    "cosine_onecycle_schedule",
    "join_schedules",
    "linear_onecycle_schedule",
    "piecewise_interpolate_schedule",
    "sgdr_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]


@factory
def piecewise_interpolate_schedule(
    interpolate_type: str, init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """Interpolate (linearly or by cosine) between values scaled at each boundary.

    The value at boundary ``b_i`` is ``init_value`` times the product of the
    scales up to ``b_i``; between boundaries the value moves from one to the
    next; after the last it is held.

    Args:
      interpolate_type: ``"linear"`` or ``"cosine"``.
      init_value: the value at step 0.
      boundaries_and_scales: ``{step: scale}``, scales ``>= 0``.

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``piecewise_interpolate_schedule``.

    Example:
      >>> s = piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
      >>> round(float(s(2)), 6)
      0.55
    """
    name = "piecewise_interpolate_schedule"
    if interpolate_type not in ("linear", "cosine"):
        raise ValueError(f"{name}: interpolate_type must be 'linear' or 'cosine', got {interpolate_type!r}")
    init_value = check.number(init_value, arg="init_value", name=name)
    items = _scales(boundaries_and_scales, name=name)
    bounds = [0] + [b for b, _ in items]
    # The values at the boundaries: a cumulative product in fp32, as optax's jnp.cumprod does.
    values = torch.tensor([init_value] + [s for _, s in items], dtype=torch.float32).cumprod(0).tolist()
    # Each segment moves from ``base`` (its start for linear, its end for cosine) by ``delta``, its fp32 difference
    # as optax holds it (``end - start`` for linear, ``start - end`` for cosine), computed when the schedule is
    # built: read back at each call, it would be a graph break under compile.
    linear = interpolate_type == "linear"
    sign = 1.0 if linear else -1.0
    segments = [
        (lo, hi, max(hi - lo, 1), v0 if linear else v1, float(torch.tensor(sign * (v1 - v0), dtype=torch.float32)))
        for lo, hi, v0, v1 in zip(bounds, bounds[1:], values, values[1:])
    ]

    def schedule(count: Any) -> torch.Tensor:
        c = _count(count)
        # The selected segment contributes its value, the others exactly 0 (optax's indicator.dot).
        out = torch.where(bounds[-1] <= c, values[-1], 0.0).to(torch.float32)
        for lo, hi, size, base, delta in segments:
            pct = (c - lo).float() / size
            moved = delta * pct if linear else delta / 2.0 * (torch.cos(math.pi * pct) + 1)
            inside = (lo <= c) & (c < hi)
            out = out + torch.where(inside, base + moved, 0.0)
        return out

    return schedule


def _onecycle(
    name: str,
    interpolate_type: str,
    transition_steps: Any,
    peak_value: Any,
    pct_start: Any,
    pct_final: Any,
    div_factor: Any,
    final_div_factor: Any,
) -> Schedule:
    """The one-cycle ``name`` builds, its arguments checked first (the cosine one has no ``pct_final``).

    From ``peak_value / div_factor`` up to ``peak_value`` at ``pct_start`` of the cycle; then linear goes back to
    the start value at ``pct_final`` and on to it ``/ final_div_factor`` at the end, and cosine goes straight to
    that final value.
    """
    transition_steps = check.integer(transition_steps, arg="transition_steps", name=name)
    if transition_steps <= 0:
        raise ValueError(f"{name}: transition_steps must be > 0, got {transition_steps}")
    linear = interpolate_type == "linear"
    pcts = {"pct_start": pct_start, "pct_final": pct_final} if linear else {"pct_start": pct_start}
    for arg, value in pcts.items():
        check.within(value, lambda v: 0.0 <= v <= 1.0, "in [0, 1]", arg=arg, name=name)
    for arg, value in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
        check.positive(value, arg=arg, name=name)
    peak_value = check.number(peak_value, arg="peak_value", name=name)
    scales = {int(pct_start * transition_steps): div_factor}
    if linear:
        scales[int(pct_final * transition_steps)] = 1.0 / div_factor
        scales[transition_steps] = 1.0 / final_div_factor
    else:
        scales[transition_steps] = 1.0 / (div_factor * final_div_factor)
    return piecewise_interpolate_schedule(interpolate_type, peak_value / div_factor, scales)


@factory
def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """One cycle with three linear phases: up to ``peak_value``, back down, then to ``init / final_div_factor``.

    Args:
      transition_steps: the cycle's length; ``> 0``.
      peak_value: the largest value, reached at ``pct_start * transition_steps``.
      pct_start: the fraction of the cycle spent increasing.
      pct_final: the fraction at which the value is back at ``peak_value / div_factor``.
      div_factor: the initial value is ``peak_value / div_factor``.
      final_div_factor: the final value is the initial value ``/ final_div_factor``.

    Returns:
      A schedule ``count -> value``.

    References:
      Smith & Topin, "Super-Convergence", 2017; optax's ``linear_onecycle_schedule``.

    Example:
      >>> round(float(linear_onecycle_schedule(100, 1.0)(30)), 6)
      1.0
    """
    name = "linear_onecycle_schedule"
    return _onecycle(name, "linear", transition_steps, peak_value, pct_start, pct_final, div_factor, final_div_factor)


@factory
def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle schedule: cosine up from ``peak_value / div_factor`` to ``peak_value``, then cosine down.

    The value rises for ``pct_start * transition_steps`` steps, then falls to
    ``peak_value / (div_factor * final_div_factor)`` at ``transition_steps``.

    Args:
      transition_steps: the cycle's length; ``> 0``.
      peak_value: the largest value.
      pct_start: the fraction of the cycle spent increasing.
      div_factor: the initial value is ``peak_value / div_factor``.
      final_div_factor: the final value is the initial value ``/ final_div_factor``.

    Returns:
      A schedule ``count -> value``.

    References:
      Smith & Topin, "Super-Convergence", 2017; optax's ``cosine_onecycle_schedule``.

    Example:
      >>> lr = cosine_onecycle_schedule(1000, peak_value=1e-3)
    """
    name = "cosine_onecycle_schedule"
    return _onecycle(name, "cosine", transition_steps, peak_value, pct_start, None, div_factor, final_div_factor)


@factory
def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules`` one after another, switching at each boundary.

    Each schedule after the first gets the steps since its boundary.

    Args:
      schedules: the schedules, in order.
      boundaries: the steps at which to switch; one fewer than ``schedules``.

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``join_schedules``.

    Example:
      >>> s = join_schedules([constant_schedule(1.0), linear_schedule(1.0, 0.0, 10)], [5])
      >>> float(s(10))
      0.5
    """
    for arg, value in (("schedules", schedules), ("boundaries", boundaries)):
        if not isinstance(value, Iterable) or isinstance(value, str):
            raise TypeError(f"join_schedules: {arg} must be a list, got {type(value).__name__}")
    schedules = list(schedules)
    boundaries = [check.integer(b, arg="boundaries", name="join_schedules") for b in boundaries]
    for i, s in enumerate(schedules):
        check.function(s, arg=f"schedules[{i}]", name="join_schedules")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules: boundaries must have one fewer entry than schedules, got {len(boundaries)} "
            f"boundaries for {len(schedules)} schedules"
        )

    def schedule(count: Any) -> torch.Tensor:
        c = _count(count)
        out = _as_value(schedules[0](c), c)
        for boundary, s in zip(boundaries, schedules[1:]):
            out = torch.where(c < boundary, out, _as_value(s(c - boundary), c))
        return out

    return schedule


@factory
def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """A linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then constant.

    Args:
      init_value: the value at step 0.
      peak_value: the value from ``warmup_steps`` on.
      warmup_steps: the warm-up's length.

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``warmup_constant_schedule``.

    Example:
      >>> float(warmup_constant_schedule(0.0, 1.0, warmup_steps=10)(20))
      1.0
    """
    name = "warmup_constant_schedule"  # checked here, so an error names this schedule and its own arguments
    _values(name, init_value=init_value, peak_value=peak_value)
    check.integer(warmup_steps, arg="warmup_steps", name=name)
    return linear_schedule(init_value, peak_value, warmup_steps)


def _after_warmup(init_value: float, peak_value: float, warmup_steps: int, schedule: Schedule) -> Schedule:
    """A linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then ``schedule`` from its step 0."""
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps), schedule], [warmup_steps])


@factory
def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """A linear warm-up to ``peak_value``, then cosine decay to ``end_value``.

    Args:
      init_value: the value at step 0.
      peak_value: the value at ``warmup_steps``.
      warmup_steps: the warm-up's length.
      decay_steps: the whole schedule's length, warm-up included; ``> warmup_steps``.
      end_value: the value from ``decay_steps`` on.
      exponent: the power applied to the cosine factor.

    Returns:
      A schedule ``count -> value``.

    References:
      Loshchilov & Hutter, "SGDR", 2017; optax's ``warmup_cosine_decay_schedule``.

    Example:
      >>> lr = warmup_cosine_decay_schedule(0.0, 3e-4, warmup_steps=100, decay_steps=10_000, end_value=3e-5)
    """
    name = "warmup_cosine_decay_schedule"
    init_value, peak_value, end_value = _values(name, init_value=init_value, peak_value=peak_value, end_value=end_value)
    warmup_steps = check.integer(warmup_steps, arg="warmup_steps", name=name)
    decay_steps = check.integer(decay_steps, arg="decay_steps", name=name)
    if decay_steps - warmup_steps <= 0:
        raise ValueError(
            f"{name}: decay_steps (the whole schedule, warm-up included) must be > warmup_steps, "
            f"got decay_steps={decay_steps}, warmup_steps={warmup_steps}"
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha=alpha, exponent=exponent)
    return _after_warmup(init_value, peak_value, warmup_steps, decay)


@factory
def warmup_exponential_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """A linear warm-up to ``peak_value``, then :func:`exponential_decay` from it.

    Args:
      init_value: the value at step 0.
      peak_value: the value at ``warmup_steps``.
      warmup_steps: the warm-up's length.
      transition_steps: see :func:`exponential_decay`.
      decay_rate: see :func:`exponential_decay`.
      transition_begin: steps after the warm-up before decay starts.
      staircase: see :func:`exponential_decay`.
      end_value: see :func:`exponential_decay`.

    Returns:
      A schedule ``count -> value``.

    References:
      Optax's ``warmup_exponential_decay_schedule``.

    Example:
      >>> lr = warmup_exponential_decay_schedule(0.0, 1e-3, 100, transition_steps=1000, decay_rate=0.5)
    """
    name = "warmup_exponential_decay_schedule"  # checked here, so an error names this schedule and its own arguments
    _values(name, init_value=init_value, peak_value=peak_value)
    warmup_steps = check.integer(warmup_steps, arg="warmup_steps", name=name)
    decay = exponential_decay(peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value)
    return _after_warmup(init_value, peak_value, warmup_steps, decay)


@factory
def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    """SGD with warm restarts: :func:`warmup_cosine_decay_schedule` cycles joined end to end.

    Args:
      cosine_kwargs: one dict of :func:`warmup_cosine_decay_schedule` arguments per cycle;
        each cycle lasts its ``decay_steps``.

    Returns:
      A schedule ``count -> value``.

    References:
      Loshchilov & Hutter, "SGDR", 2017; optax's ``sgdr_schedule``.

    Example:
      >>> cycle = dict(init_value=0.0, peak_value=1e-3, warmup_steps=10, decay_steps=100)
      >>> lr = sgdr_schedule([cycle, cycle])
    """
    cycles = list(cosine_kwargs)
    schedules = [warmup_cosine_decay_schedule(**kwargs) for kwargs in cycles]
    # Where each cycle ends and the next begins.
    ends = list(itertools.accumulate(kwargs["decay_steps"] for kwargs in cycles))
    return join_schedules(schedules, ends[:-1])
