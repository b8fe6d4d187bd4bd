"""Lookahead: a fast optimizer explores, and every ``sync_period`` steps the slow weights move towards it."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, factory

__all__ = ["LookaheadParams", "LookaheadState", "lookahead"]


class LookaheadState(NamedTuple):
    """The fast optimizer's state and the steps since the last synchronisation (0-d int64)."""

    fast_state: OptState
    steps_since_sync: torch.Tensor


class LookaheadParams(NamedTuple):
    """The pair of params lookahead trains: ``fast`` (the fast optimizer's) and ``slow`` (the ones to evaluate).

    A NamedTuple, so it is a pytree: :func:`gradtx.apply_updates` applies
    lookahead's ``LookaheadParams`` of updates to it leaf by leaf.
    """

    fast: Params
    slow: Params

    @classmethod
    def init_synced(cls, params: Params) -> LookaheadParams:
        """A pair whose fast and slow params both start at ``params`` (two copies, sharing no storage)."""
        tu.tensor_leaves(params, what="LookaheadParams.init_synced: params")
        return cls(fast=lw.clone_tree(params), slow=lw.clone_tree(params))


@factory
def lookahead(
    fast_optimizer: GradientTransformation,
    sync_period: int,
    slow_step_size: float | torch.Tensor,
    reset_state: bool = False,
) -> GradientTransformation:
    """Lookahead around ``fast_optimizer``: its params and updates are :class:`LookaheadParams` pairs.

    ``update(grads, state, params)`` takes the grads of the *fast* params and
    ``params = LookaheadParams(fast, slow)``, and returns a ``LookaheadParams``
    of updates for both. On the last step of every ``sync_period``, the slow
    params move ``slow_step_size`` of the way to the fast ones and the fast
    params are reset to them; between, only the fast params move. The choice
    is a ``torch.where`` (no host sync). Evaluate the slow params. As optax's
    ``lookahead``.

    It changes the params' structure, so it runs in a functional step, not in
    :class:`gradtx.TransformedOptimizer` (whose params are the model's own).

    Args:
      fast_optimizer: the inner optimizer, run on the fast params.
      sync_period: fast steps per slow step; ``>= 1``.
      slow_step_size: how far the slow params move towards the fast ones; a number or a 0-d tensor.
      reset_state: reinitialise the fast optimizer's state at every synchronisation.

    Returns:
      A :class:`GradientTransformation` with state :class:`LookaheadState`.

    References:
      Zhang, Lucas, Hinton & Ba, "Lookahead Optimizer: k steps forward, 1 step back", 2019.

    Example:
      >>> tx = lookahead(adam(1e-3), sync_period=5, slow_step_size=0.5)
      >>> params = LookaheadParams.init_synced(params)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads_of_fast, state, params)
      >>> params = apply_updates(params, updates)
    """
    check.transform(fast_optimizer, arg="fast_optimizer", name="lookahead")
    sync_period = check.integer(sync_period, arg="sync_period", name="lookahead", minimum=1)
    slow_step_size = check.number(slow_step_size, arg="slow_step_size", name="lookahead", tensor=True)
    reset_state = check.flag(reset_state, arg="reset_state", name="lookahead")

    def init_fn(params: Any) -> LookaheadState:
        # Fast params alone are accepted too, as optax accepts them (it only warns).
        fast = params.fast if isinstance(params, LookaheadParams) else params
        return LookaheadState(fast_state=fast_optimizer.init(fast), steps_since_sync=lw.zero_count(fast))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, LookaheadState, name="lookahead")
        if not isinstance(params, LookaheadParams):
            raise TypeError(
                "lookahead: update() needs params=LookaheadParams(fast, slow) (see LookaheadParams.init_synced), "
                f"got {type(params).__name__}"
            )
        fast_updates, fast_state = fast_optimizer.update(updates, state.fast_state, params.fast, **extra)
        if fast_updates is None:
            raise ValueError("lookahead: the fast optimizer held (returned None); put accumulate() before lookahead")
        sync_next = state.steps_since_sync == (sync_period - 1)
        # A param with no grad (a None update) is left alone, fast and slow: its difference stays None.
        last_difference, _ = lw.lmap_updates(
            lambda u, f, s: (f + u.to(f.dtype) - s,),
            fast_updates,
            [params.fast, params.slow],
            what="lookahead: updates",
            against="the fast params",
            names=["lookahead: params.slow"],
        )

        def slow_update(diff: torch.Tensor) -> torch.Tensor:
            alpha = lw.as_tensor(slow_step_size, diff)
            return torch.where(sync_next.to(diff.device), alpha * diff, torch.zeros_like(diff))

        def fast_update(u: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
            alpha = lw.as_tensor(slow_step_size, diff)
            return torch.where(sync_next.to(u.device), u - (1 - alpha) * diff, u)

        out = LookaheadParams(
            fast=lw.lmap(fast_update, fast_updates, last_difference), slow=lw.lmap(slow_update, last_difference)
        )
        if reset_state:
            fast_state = lw.where_tree(sync_next, fast_optimizer.init(params.fast), fast_state)
        steps = torch.remainder(state.steps_since_sync + 1, sync_period)
        return out, LookaheadState(fast_state=fast_state, steps_since_sync=steps)

    return GradientTransformation(init_fn, update_fn)
