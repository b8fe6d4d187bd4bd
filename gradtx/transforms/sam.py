"""Sharpness-aware minimization (optax.contrib's ``sam``): step to the worst nearby point, take its grad, step back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, PyTree, factory

__all__ = ["SAMState", "sam"]


class SAMState(NamedTuple):
    """optax's fields: steps since the last outer step (0-d int64), both optimizers' states, and the outer params.

    ``cache`` holds the params of the last outer step (transparent mode), or
    ``None`` (opaque mode, which needs none).
    """

    steps_since_sync: torch.Tensor
    opt_state: OptState
    adv_state: OptState
    cache: PyTree | None


@factory
def sam(
    optimizer: GradientTransformation,
    adv_optimizer: GradientTransformation,
    sync_period: int = 2,
    reset_state: bool = True,
    opaque_mode: bool = False,
    batch_axis_name: str | None = None,
) -> GradientTransformation:
    """SAM: ``sync_period - 1`` adversarial ascent steps by ``adv_optimizer``, then one ``optimizer`` step from the start.

    Transparent mode (the default): each call is one step. On adversarial
    steps the updates climb (the negated ``adv_optimizer`` updates; use
    ``chain(normalize_by_update_norm(eps=0.0), scale(rho))`` for the paper's
    ``rho * g / ||g||``); on the last step of each period the updates take the
    params back to where the period began and apply ``optimizer``'s step from
    there, with the last grads. Evaluate the params after that step. The choice
    is a ``torch.where`` (no host sync). Opaque mode: each call is a whole
    period, and ``update`` needs ``grad_fn=`` (``grad_fn(params, i)`` returns
    the grads at the adversarial params). As ``optax.contrib.sam``.

    Args:
      optimizer: the outer optimizer.
      adv_optimizer: the adversarial step (its updates are negated: it ascends).
      sync_period: steps per period, adversarial steps plus one; ``>= 1``.
      reset_state: reinitialise ``adv_optimizer``'s state at the end of each period.
      opaque_mode: run the whole period in one call with ``grad_fn``.
      batch_axis_name: a JAX axis name in optax; torch has none, so it must be
        ``None`` (average the grads across ranks inside ``grad_fn``).

    Returns:
      A :class:`GradientTransformation` with state :class:`SAMState`; ``update`` needs ``params``.

    References:
      Foret, Kleiner, Mobahi & Neyshabur, "Sharpness-Aware Minimization for Efficiently Improving
      Generalization", 2021.

    Example:
      >>> tx = sam(sgd(0.1), chain(normalize_by_update_norm(eps=0.0), scale(0.05)))
      >>> updates, state = tx.update(grads, state, params)
    """
    check.transform(optimizer, arg="optimizer", name="sam")
    check.transform(adv_optimizer, arg="adv_optimizer", name="sam")
    sync_period = check.integer(sync_period, arg="sync_period", name="sam", minimum=1)
    reset_state = check.flag(reset_state, arg="reset_state", name="sam")
    opaque_mode = check.flag(opaque_mode, arg="opaque_mode", name="sam")
    if batch_axis_name is not None:
        raise ValueError(
            "sam: batch_axis_name must be None (torch has no named vmap axes); average the grads across ranks "
            "inside grad_fn instead"
        )

    def init_fn(params: Params) -> SAMState:
        tu.tensor_leaves(params, what="sam: params")
        return SAMState(
            steps_since_sync=lw.zero_count(params),
            opt_state=optimizer.init(params),
            adv_state=adv_optimizer.init(params),
            cache=None if opaque_mode else lw.clone_tree(params),
        )

    def held(updates: Any, who: str) -> None:
        if updates is None:
            raise ValueError(f"sam: {who} held (returned None); put accumulate() before sam")

    def check_args(state: Any, params: Any) -> None:
        tu.require_state(state, SAMState, name="sam")
        if params is None:
            raise ValueError("sam: update() needs params, got params=None")

    def transparent_update(updates, state, params=None, **extra):
        check_args(state, params)
        first = state.steps_since_sync == 0
        last = state.steps_since_sync == sync_period - 1
        adv_updates, adv_state = adv_optimizer.update(updates, state.adv_state, params, **extra)
        held(adv_updates, "adv_optimizer")
        adv_updates = lw.lmap(torch.neg, adv_updates)
        # The period's start: these params on its first step (with sync_period=1, also its last; optax reads the
        # previous period's start there, so its steps lag and the params never accumulate).
        tu.check_structure(state.cache, params, what="sam: params", against="the state's cache")
        try:
            cache = lw.where_tree(first, lw.clone_tree(params), state.cache)
        except RuntimeError:  # params on another device than the cache: a ValueError naming the leaf
            cached, given = tu.flatten(state.cache)[0], tu.flatten(params)[0]
            tu.check_devices(given, cached, state.cache, what="sam: the state's cache", against="sam: params")
            raise
        opt_updates, opt_state = optimizer.update(updates, state.opt_state, cache, **extra)
        held(opt_updates, "optimizer")
        opt_updates, _ = lw.lmap_updates(  # a None update (no grad) stays None
            lambda u, c, p: (c - p + u.to(c.dtype),),
            opt_updates,
            [cache, params],
            what="sam: updates",
            against="the state's cache",
            names=["sam: params"],
        )
        out = lw.where_tree(last, opt_updates, adv_updates)
        at_sync = adv_optimizer.init(params) if reset_state else state.adv_state  # the end of a period
        adv_state = lw.where_tree(last, at_sync, adv_state)
        opt_state = lw.where_tree(last, opt_state, state.opt_state)
        steps = torch.remainder(state.steps_since_sync + 1, sync_period)
        return out, SAMState(steps_since_sync=steps, opt_state=opt_state, adv_state=adv_state, cache=cache)

    def opaque_update(updates, state, params=None, *, grad_fn: Callable[[Params, int], PyTree] | None = None, **extra):
        if grad_fn is None:
            raise ValueError("sam: opaque_mode=True needs update(..., grad_fn=fn), fn(params, i) -> grads")
        check_args(state, params)
        adv_params, adv_updates, adv_state = params, updates, state.adv_state
        for i in range(sync_period - 1):
            adv_updates, adv_state = adv_optimizer.update(adv_updates, adv_state, adv_params, **extra)
            held(adv_updates, "adv_optimizer")
            adv_updates = lw.lmap(torch.neg, adv_updates)
            _, (adv_params,) = lw.lmap_updates(
                lambda u, p: (u, p + u.to(p.dtype)), adv_updates, [adv_params], what="sam: updates", against="params"
            )
            adv_updates = grad_fn(adv_params, i)
        if reset_state:
            adv_state = adv_optimizer.init(params)
        out, opt_state = optimizer.update(adv_updates, state.opt_state, params, **extra)
        held(out, "optimizer")
        steps = torch.zeros_like(state.steps_since_sync)
        return out, SAMState(steps_since_sync=steps, opt_state=opt_state, adv_state=adv_state, cache=None)

    return GradientTransformation(init_fn, opaque_update if opaque_mode else transparent_update)
