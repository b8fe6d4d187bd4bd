"""Reduce the learning rate when a monitored value stops improving: ``reduce_on_plateau`` (optax.contrib's)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import Params, ScalarTransformation, export_metrics, factory, scalar_transformation

__all__ = ["ReduceLROnPlateauState", "reduce_on_plateau"]


@export_metrics(("scale", "plateau_scale"))
class ReduceLROnPlateauState(NamedTuple):
    """optax's fields: the current scale, the best (averaged) value, the counters, and the running average.

    Attributes:
      scale: the factor the updates are multiplied by (0-d, the params' lowest float dtype).
      best_value: the best averaged value seen (0-d, the params' highest float dtype).
      plateau_count: evaluations without improvement (0-d int64).
      cooldown_count: evaluations left before plateaus count again (0-d int64).
      count: values averaged so far in the current accumulation (0-d int64).
      avg_value: their running average.
    """

    scale: torch.Tensor
    best_value: torch.Tensor
    plateau_count: torch.Tensor
    cooldown_count: torch.Tensor
    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    avg_value: torch.Tensor


@factory
def reduce_on_plateau(
    factor: float = 0.1,
    patience: int = 10,
    rtol: float = 1e-4,
    atol: float = 0.0,
    cooldown: int = 0,
    accumulation_size: int = 1,
    min_scale: float = 0.0,
) -> ScalarTransformation:
    """Multiply the updates by a scale that shrinks by ``factor`` when the value fed in stops improving.

    Feed the monitored value (a loss) at every update: ``update(updates,
    state, params, value=loss)``, or ``opt.step(value=loss)`` in the wrapper.
    Every ``accumulation_size`` values are averaged; the average improves when
    it is below ``(1 - rtol) * best - atol``. After ``patience`` averages
    without improvement the scale is multiplied by ``factor`` (never below
    ``min_scale``), then ``cooldown`` averages pass before plateaus count
    again. The choice is made with ``torch.where``: no host sync. As
    ``optax.contrib.reduce_on_plateau``. A scalar transformation; put it after
    the optimizer (its scale multiplies the learning rate).

    Args:
      factor: the multiplier on a plateau; in ``(0, 1)``.
      patience: averages without improvement before the scale is reduced; ``>= 0``.
      rtol: the relative improvement needed; in ``[0, 1]``.
      atol: the absolute improvement needed; ``>= 0`` (one of ``rtol``, ``atol`` must be ``> 0``).
      cooldown: averages to wait after a reduction; ``>= 0``.
      accumulation_size: values averaged per evaluation; ``>= 1``.
      min_scale: the floor on the scale; ``>= 0``.

    Returns:
      A :class:`GradientTransformation` with state :class:`ReduceLROnPlateauState`;
      ``update`` needs ``value=``.

    References:
      Optax's ``contrib.reduce_on_plateau`` (DeepMind, 2024); PyTorch's ``ReduceLROnPlateau``.

    Example:
      >>> tx = chain(adam(1e-3), reduce_on_plateau(patience=5, cooldown=2))
      >>> updates, state = tx.update(grads, state, params, value=loss)
    """
    name = "reduce_on_plateau"
    factor = check.open_unit(factor, arg="factor", name=name)
    patience = check.integer(patience, arg="patience", name=name, minimum=0)
    rtol = check.within(rtol, lambda v: 0.0 <= v <= 1.0, "in [0, 1]", arg="rtol", name=name)
    atol = check.non_negative(atol, arg="atol", name=name)
    if rtol == 0.0 and atol == 0.0:
        raise ValueError(f"{name}: rtol and atol cannot both be 0 (one must be > 0)")
    cooldown = check.integer(cooldown, arg="cooldown", name=name, minimum=0)
    accumulation_size = check.integer(accumulation_size, arg="accumulation_size", name=name, minimum=1)
    min_scale = check.non_negative(min_scale, arg="min_scale", name=name)

    def init_fn(params: Params) -> ReduceLROnPlateauState:
        zero = lw.zero_count(params)  # on the params' device, as every value of the state
        low, high = lw.lowest_dtype(params), lw.highest_dtype(params)
        return ReduceLROnPlateauState(
            scale=zero.new_ones((), dtype=low),
            best_value=zero.new_full((), float("inf"), dtype=high),
            plateau_count=zero,
            cooldown_count=zero.clone(),
            count=zero.clone(),
            avg_value=zero.new_zeros((), dtype=high),
        )

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        tu.require_state(state, ReduceLROnPlateauState, name=name)
        if extra.get("value") is None:
            raise ValueError(f"{name}: update() needs value= (the monitored value, e.g. the loss), got none")
        avg_value = state.avg_value
        value = check.scalar(extra["value"], arg="value", name=name, dtype=avg_value.dtype, device=avg_value.device)
        count = state.count + 1
        avg = (state.count * state.avg_value + value) / count

        improved = avg < (1 - rtol) * state.best_value - atol
        best = torch.where(improved, avg.to(state.best_value.dtype), state.best_value)
        plateau = torch.where(improved, 0, state.plateau_count + 1)
        hit = plateau == patience
        cooling = state.cooldown_count > 0
        reduced = torch.clamp(torch.where(hit, state.scale * factor, state.scale), min=min_scale)
        new_plateau = torch.where(cooling | hit, 0, plateau)
        new_scale = torch.where(cooling, state.scale, reduced).to(state.scale.dtype)
        new_cooldown = torch.where(cooling, state.cooldown_count - 1, torch.where(hit, cooldown, 0))

        evaluate = count == accumulation_size
        zero_avg = torch.zeros_like(state.avg_value)
        evaluated = ReduceLROnPlateauState(new_scale, best, new_plateau, new_cooldown, count * 0, zero_avg)
        waiting = state._replace(count=count, avg_value=avg.to(zero_avg.dtype))
        new_state = lw.where_tree(evaluate, evaluated, waiting)
        return new_state.scale, new_state

    return scalar_transformation(init_fn, factor_fn)
