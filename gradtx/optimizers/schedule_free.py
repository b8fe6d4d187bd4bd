"""Schedule-free optimization (optax.contrib's ``schedule_free`` family), and how to get its evaluation params.

Schedule-free training keeps two sequences: ``z``, moved by the base
optimizer, and ``x``, a running average of ``z`` weighted by the learning rate
seen so far. The params it trains are ``y = b1 * x + (1 - b1) * z``, where
grads are taken. Evaluate ``x`` instead: :func:`schedule_free_eval_params`
computes it from the state and ``y``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, PyTree, export_metrics, factory
from gradtx.optimizers.aliases import sgd
from gradtx.optimizers.standard import ScalarOrSchedule, add_decayed_weights, scale_by_learning_rate
from gradtx.schedules.combined import warmup_constant_schedule
from gradtx.transforms.combine import chain

__all__ = [
    "ScaleByRmsWithCountState",
    "ScheduleFreeState",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
]


@export_metrics(("max_lr", "max_lr"))
class ScheduleFreeState(NamedTuple):
    """optax's fields: ``b1``, the weight sum, the step count (from 1), the largest learning rate, the base state, ``z``.

    The scalars are in the params' lowest dtype, fp32 for bf16/fp16 params (optax keeps them in bf16).
    """

    b1: torch.Tensor
    weight_sum: torch.Tensor
    step_count: torch.Tensor
    max_lr: torch.Tensor
    base_optimizer_state: OptState
    z: PyTree


@factory
def schedule_free(
    base_optimizer: GradientTransformation,
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    weight_lr_power: float = 2.0,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Turn ``base_optimizer`` into its schedule-free version: no learning-rate decay needed.

    ``update`` needs ``params`` (``y``, the params grads are taken at) and
    returns the updates that move them to the next ``y``. ``learning_rate``
    must be the one ``base_optimizer`` uses: it weights the average (a
    schedule is called with the step count from 1, as optax calls it). As
    ``optax.contrib.schedule_free``.

    To evaluate, use :func:`schedule_free_eval_params` (``x``). In
    :class:`gradtx.TransformedOptimizer` (with a plain ``torch.optim.SGD(lr=1)``
    inner optimizer, which applies the updates as they are), the state is
    ``opt.tx_state`` and the params ``opt.param_tree()``.

    Args:
      base_optimizer: the optimizer that moves ``z`` (``sgd(lr)``, or Adam without momentum).
      learning_rate: the base optimizer's learning rate: a number or a schedule.
      b1: the interpolation between ``x`` and ``z``; in ``(0, 1)``.
      weight_lr_power: the average weights step ``t`` by ``max_lr_t ** weight_lr_power``.
      state_dtype: the dtype ``z`` is kept in; ``None``: the params'.

    Returns:
      A :class:`GradientTransformation` with state :class:`ScheduleFreeState`.

    References:
      Defazio et al., "The Road Less Scheduled", 2024.

    Example:
      >>> tx = schedule_free(sgd(1.0), learning_rate=1.0)
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> eval_params = schedule_free_eval_params(state, apply_updates(params, updates))
    """
    check.transform(base_optimizer, arg="base_optimizer", name="schedule_free")
    learning_rate = check.learning_rate(learning_rate, name="schedule_free")
    b1 = check.open_unit(b1, arg="b1", name="schedule_free")
    weight_lr_power = check.number(weight_lr_power, arg="weight_lr_power", name="schedule_free")
    state_dtype = check.dtype(state_dtype, arg="state_dtype", name="schedule_free", floating=True)

    def init_fn(params: Params) -> ScheduleFreeState:
        tu.tensor_leaves(params, what="schedule_free: params")
        # fp32 for bf16/fp16 params (optax: the params' lowest dtype, where a bf16 weight sum stops growing at ~400 steps)
        device, dtype = tu.device_of(params), lw.moment_dtype(lw.lowest_dtype(params))
        return ScheduleFreeState(
            b1=torch.tensor(b1, dtype=dtype, device=device),
            weight_sum=torch.zeros((), dtype=dtype, device=device),
            step_count=torch.ones((), dtype=torch.int64, device=device),
            max_lr=torch.zeros((), dtype=dtype, device=device),
            base_optimizer_state=base_optimizer.init(params),
            z=lw.clone_tree(params, state_dtype),  # its own storage: z never aliases the params
        )

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, ScheduleFreeState, name="schedule_free")
        if params is None:
            raise ValueError("schedule_free: update() needs params (y, where the grads were taken), got params=None")
        lr = learning_rate(state.step_count) if callable(learning_rate) else learning_rate
        lr = check.number(lr, arg="the learning rate schedule's value", name="schedule_free", finite=False, tensor=True)
        lr = torch.as_tensor(lr).to(state.max_lr.device, state.max_lr.dtype)
        max_lr = torch.maximum(state.max_lr, lr)
        weight = max_lr**weight_lr_power
        total = state.weight_sum + weight
        # A tiny learning rate gives 0/0: count it as no weight, as optax does.
        ck = torch.where(
            torch.isnan(weight) | torch.isnan(total),
            torch.full_like(weight, float("nan")),
            torch.nan_to_num(weight / total, nan=0.0, posinf=float("inf")),
        )
        base_updates, base_state = base_optimizer.update(updates, state.base_optimizer_state, params, **extra)
        if base_updates is None:
            raise ValueError("schedule_free: the base optimizer held (returned None); put accumulate() before it")

        def step(u: torch.Tensor, z_old: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c = ck.to(y.device)
            z_new = (z_old + u).to(z_old.dtype)
            prev_x = (y - (1.0 - b1) * z_old) / b1
            x = (1.0 - c) * prev_x + c * z_new
            return (b1 * x + (1.0 - b1) * z_new - y).to(y.dtype), z_new

        out, (z, _) = lw.lmap_updates(
            step,
            base_updates,
            [state.z, params],
            what="schedule_free: updates",
            against="the state's z",
            names=["schedule_free: params"],
        )
        return out, state._replace(
            weight_sum=total, step_count=state.step_count + 1, max_lr=max_lr, base_optimizer_state=base_state, z=z
        )

    return GradientTransformation(init_fn, update_fn)


def schedule_free_eval_params(state: OptState, params: Params) -> Params:
    """The params to evaluate a schedule-free run at: ``x = (y - (1 - b1) * z) / b1``; pure.

    Args:
      state: the :class:`ScheduleFreeState`, or any state holding one (a chain's,
        the wrapper's ``opt.tx_state``).
      params: ``y``, the params being trained (the wrapper's ``opt.param_tree()``).

    Returns:
      A new tree of the params' structure; nothing is changed.

    Raises:
      ValueError: when ``state`` holds no :class:`ScheduleFreeState`.

    Example:
      >>> eval_params = schedule_free_eval_params(state, params)
    """
    is_sf = lambda x: isinstance(x, ScheduleFreeState)
    found = next(filter(is_sf, optree.tree_leaves(state, is_leaf=is_sf)), None)
    if found is None:
        raise ValueError(
            f"schedule_free_eval_params: state must be (or hold) a ScheduleFreeState, got {type(state).__name__}"
        )
    tu.check_structure(found.z, params, what="schedule_free_eval_params: params", against="the state's z")

    def evaluate(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        b1 = found.b1.to(y.device)
        return ((y - (1.0 - b1) * z.to(y.dtype)) / b1).to(y.dtype)

    return lw.lmap(evaluate, params, found.z)


class ScaleByRmsWithCountState(NamedTuple):
    """The step count (0-d int64) and the second moment (a tree mirroring the params), as optax's."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    nu: PyTree


def _scale_by_rms_debiased(decay: float, eps: float) -> GradientTransformation:
    """optax's ``scale_by_rms(decay, eps, eps_in_sqrt=False, bias_correction=True)``: Adam without momentum."""

    def init_fn(params: Params) -> ScaleByRmsWithCountState:
        nu = lw.zeros_moments(params, what="schedule_free_adamw: params")  # fp32 for bf16/fp16, as Adam's moments
        return ScaleByRmsWithCountState(count=lw.zero_count(params), nu=nu)

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, ScaleByRmsWithCountState, name="schedule_free_adamw")
        count = state.count + 1

        def step(g: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if g.is_complex():  # pairs of reals, as scale_by_adam takes them (docs/optax.md)
                u, nu = step(torch.view_as_real(g), torch.view_as_real(v))
                return torch.view_as_complex(u), torch.view_as_complex(nu)
            w = g.to(v.dtype)
            nu = (1 - decay) * w * w + decay * v
            t = count.to(nu.device, tu.acc_dtype(nu.dtype))
            v_hat = nu / (1 - decay**t).to(nu.dtype)
            return (w * (1 / (torch.sqrt(v_hat) + eps))).to(g.dtype), nu

        out, (nu,) = lw.lmap_updates(
            step, updates, [state.nu], what="schedule_free_adamw: updates", against="its second moment"
        )
        return out, ScaleByRmsWithCountState(count=count, nu=nu)

    return GradientTransformation(init_fn, update_fn)


def _warmed_up(learning_rate: Any, warmup_steps: Any, *, name: str) -> Any:
    if warmup_steps is None:
        return learning_rate
    warmup_steps = check.integer(warmup_steps, arg="warmup_steps", name=name, minimum=0)
    return warmup_constant_schedule(init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps)


@factory
def schedule_free_adamw(
    learning_rate: float = 0.0025,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_lr_power: float = 2.0,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Schedule-free AdamW: :func:`schedule_free` around Adam's second-moment scaling (no momentum), decay and lr.

    ``schedule_free(chain(scale_by_rms(b2, eps, bias corrected), add_decayed_weights(weight_decay),
    scale_by_learning_rate(lr)), lr, b1)``, with a constant warm-up over
    ``warmup_steps`` when given, as ``optax.contrib.schedule_free_adamw`` (whose
    defaults these are). ``b1`` is the schedule-free interpolation, which
    takes the place of Adam's momentum. ``update`` needs ``params``.

    Args:
      learning_rate: the peak learning rate; ``>= 0``.
      warmup_steps: linear warm-up from 0 over this many steps; ``None``: none.
      b1: the schedule-free interpolation; in ``(0, 1)``.
      b2: the decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator; ``>= 0``.
      weight_decay: decoupled weight decay (scaled by the learning rate); ``>= 0``.
      weight_lr_power: the power of the learning rate in the average's weights.
      state_dtype: the dtype ``z`` is kept in; ``None``: the params'.

    Returns:
      A :class:`GradientTransformation` with state :class:`ScheduleFreeState`.

    References:
      Defazio et al., "The Road Less Scheduled", 2024.

    Example:
      >>> tx = schedule_free_adamw(1e-3, warmup_steps=100, weight_decay=1e-4)
    """
    name = "schedule_free_adamw"
    learning_rate = check.non_negative(learning_rate, arg="learning_rate", name=name)
    b1 = check.open_unit(b1, arg="b1", name=name)
    b2 = check.beta(b2, arg="b2", name=name)
    eps = check.non_negative(eps, arg="eps", name=name)
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name=name)
    lr = _warmed_up(learning_rate, warmup_steps, name=name)
    optimizer = chain(_scale_by_rms_debiased(b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))
    return schedule_free(optimizer, learning_rate=lr, b1=b1, weight_lr_power=weight_lr_power, state_dtype=state_dtype)


@factory
def schedule_free_sgd(
    learning_rate: float = 1.0,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    weight_decay: float | None = None,
    weight_lr_power: float = 2.0,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Schedule-free SGD: :func:`schedule_free` around ``sgd(learning_rate)``, with L2 decay when given.

    As ``optax.contrib.schedule_free_sgd`` (whose defaults these are). With
    ``weight_decay``, ``update`` needs ``params`` (it always does: ``y``).

    Args:
      learning_rate: the peak learning rate; ``>= 0``.
      warmup_steps: linear warm-up from 0 over this many steps; ``None``: none.
      b1: the schedule-free interpolation; in ``(0, 1)``.
      weight_decay: L2 decay added to the gradient; ``None``: none.
      weight_lr_power: the power of the learning rate in the average's weights.
      state_dtype: the dtype ``z`` is kept in; ``None``: the params'.

    Returns:
      A :class:`GradientTransformation` with state :class:`ScheduleFreeState`.

    References:
      Defazio et al., "The Road Less Scheduled", 2024.

    Example:
      >>> tx = schedule_free_sgd(1.0, warmup_steps=10)
    """
    name = "schedule_free_sgd"
    learning_rate = check.non_negative(learning_rate, arg="learning_rate", name=name)
    b1 = check.open_unit(b1, arg="b1", name=name)
    lr = _warmed_up(learning_rate, warmup_steps, name=name)
    optimizer: GradientTransformation = sgd(lr)
    if weight_decay is not None:
        weight_decay = check.non_negative(weight_decay, arg="weight_decay", name=name)
        optimizer = chain(add_decayed_weights(weight_decay), optimizer)
    return schedule_free(optimizer, learning_rate=lr, b1=b1, weight_lr_power=weight_lr_power, state_dtype=state_dtype)
