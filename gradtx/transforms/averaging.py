"""Averages of params and updates: an exponential moving average (``ema``), and optax's target-network updates.

``ema`` is a transform (it averages whatever flows through it: updates, or
params when you feed it params). ``incremental_update`` and
``periodic_update`` are plain tree functions, as in optax, for keeping an
averaged copy of the params beside the trained ones (a target network, an EMA
model for evaluation).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Params, PyTree, factory

__all__ = ["EmaState", "ema", "incremental_update", "periodic_update"]


def _decay(value: Any, *, arg: str, name: str) -> Any:
    """A decay in ``[0, 1]``, or a 0-d tensor (not read)."""
    return check.within(value, lambda v: 0.0 <= v <= 1.0, "in [0, 1]", arg=arg, name=name, tensor=True)


class EmaState(NamedTuple):
    """The number of updates averaged (0-d int64) and the running average (a tree mirroring the params)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    ema: PyTree


@factory
def ema(
    decay: float | torch.Tensor, debias: bool = True, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Replace the updates by their exponential moving average: ``ema = decay * ema + (1 - decay) * g``.

    With ``debias`` the output is ``ema / (1 - decay**t)`` (``t`` counts updates
    from 1), which removes the pull towards the zero the average starts at, as
    Adam's bias correction does. The state keeps the raw average. As optax's
    ``ema``.

    Args:
      decay: the weight of the past; in ``[0, 1]`` (``< 1`` with ``debias``), or a 0-d tensor.
      debias: divide by ``1 - decay**t``.
      accumulator_dtype: the dtype the average is kept in; ``None``: each leaf's own.

    Returns:
      A :class:`GradientTransformation` with state :class:`EmaState`.

    References:
      Optax's ``ema`` (DeepMind, 2020); Polyak & Juditsky, "Acceleration of
      Stochastic Approximation by Averaging", 1992.

    Example:
      >>> tx = ema(0.9)
      >>> smoothed, state = tx.update(grads, tx.init(params))
    """
    decay = _decay(decay, arg="decay", name="ema")
    debias = check.flag(debias, arg="debias", name="ema")
    if debias and not isinstance(decay, torch.Tensor) and decay == 1.0:
        raise ValueError("ema: decay must be < 1 with debias=True (the correction divides by 1 - decay**t = 0)")
    accumulator_dtype = check.dtype(accumulator_dtype, arg="accumulator_dtype", name="ema", floating=True)

    def init_fn(params: Params) -> EmaState:
        tu.tensor_leaves(params, what="ema: params")
        return EmaState(count=lw.zero_count(params), ema=lw.zeros_like_tree(params, accumulator_dtype))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, EmaState, name="ema")
        count = state.count + 1

        def step(g: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            d = lw.as_tensor(decay, old)
            dtype = torch.promote_types(g.dtype, old.dtype)
            m = (1 - d) * g.to(dtype) + d * old.to(dtype)
            out = m
            if debias:
                t = count.to(m.device, tu.acc_dtype(m.dtype))
                out = m / (1 - lw.as_tensor(decay, t) ** t).to(m.dtype)
            out, m = out.to(g.dtype), m.to(old.dtype)
            return (out.clone() if out is m else out), m  # the updates never share storage with the state

        out, (stored,) = lw.lmap_updates(step, updates, [state.ema], what="ema: updates", against="the state's average")
        return out, EmaState(count=count, ema=stored)

    return GradientTransformation(init_fn, update_fn)


def incremental_update(new_tensors: Params, old_tensors: Params, step_size: float | torch.Tensor) -> Params:
    """Polyak averaging: ``step_size * new + (1 - step_size) * old``, leaf by leaf; pure.

    The way to keep an EMA copy of the params for evaluation (``step_size`` is
    ``1 - decay``) or a slowly moving target network. A ``None`` leaf in
    ``new_tensors`` stays ``None``. As optax's ``incremental_update``.

    Args:
      new_tensors: the latest params.
      old_tensors: the averaged params so far.
      step_size: the weight of the new params; a number or a 0-d tensor.

    Returns:
      A new tree; neither input is changed.

    References:
      Polyak & Juditsky, "Acceleration of Stochastic Approximation by Averaging", 1992.

    Example:
      >>> ema_params = incremental_update(params, ema_params, step_size=0.001)
    """
    step_size = check.number(step_size, arg="step_size", name="incremental_update", tensor=True)
    tu.align(old_tensors, new_tensors, what="incremental_update: new_tensors", against="old_tensors", tensors=False)

    def blend(new: Any, old: Any) -> Any:
        if new is None:
            return None
        n, o = tu.local(new), tu.local(old)
        s = lw.as_tensor(step_size, n)
        return tu.like(new, s * n + (1.0 - s) * o.to(n.dtype))

    return optree.tree_map(blend, new_tensors, old_tensors, none_is_leaf=True)


def periodic_update(
    new_tensors: Params, old_tensors: Params, steps: int | torch.Tensor, update_period: int | torch.Tensor
) -> Params:
    """``new_tensors`` when ``steps`` is a multiple of ``update_period``, else ``old_tensors``; pure.

    The hard target-network update of DQN. With a tensor ``steps`` the choice
    is a ``torch.where`` (no host sync, so it compiles); with Python ints it is
    made in Python. As optax's ``periodic_update``.

    Args:
      new_tensors: the latest params.
      old_tensors: the copy kept between updates.
      steps: the current step; an int or a 0-d integer tensor.
      update_period: copy every this many steps; ``>= 1``.

    Returns:
      A copy of ``new_tensors`` on an update step, else ``old_tensors`` (with a
      tensor ``steps``, a copy of either).

    References:
      Mnih et al., "Human-level control through deep reinforcement learning", 2015.

    Example:
      >>> target = periodic_update(params, target, step, update_period=100)
    """
    if not isinstance(update_period, torch.Tensor):
        update_period = check.integer(update_period, arg="update_period", name="periodic_update", minimum=1)
    if not isinstance(steps, torch.Tensor):
        steps = check.integer(steps, arg="steps", name="periodic_update")
    tu.check_structure(new_tensors, old_tensors, what="periodic_update: old_tensors", against="new_tensors")
    if not isinstance(steps, torch.Tensor) and not isinstance(update_period, torch.Tensor):
        # A copy: params trained in place (torch.optim) would otherwise carry the target along on every step.
        return lw.lmap(torch.clone, new_tensors) if steps % update_period == 0 else old_tensors
    now = torch.remainder(torch.as_tensor(steps), torch.as_tensor(update_period)) == 0
    return lw.where_tree(now, new_tensors, old_tensors)
