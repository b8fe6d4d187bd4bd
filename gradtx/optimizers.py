"""Optimizers as transforms: scale, learning rates and schedules, Adam, weight decay, momentum; sgd, adam, adamw.

The building blocks turn gradients into updates, and the aliases chain them the
way optax does. An update is what to *add* to the params
(:func:`gradtx.apply_updates` computes ``p + u``), so the learning-rate scaling
is negative.

The aliases match ``torch.optim.SGD``, ``Adam`` and ``AdamW`` numerically (same
hyperparameters, same bias correction), to fp32 rounding.

Moments (Adam's ``mu`` and ``nu``, the momentum trace) are kept in fp32 for
fp16 and bf16 params, and in the param's dtype otherwise; the updates come out
in the dtype the gradients came in. Step counts are 0-d int64 tensors on the
first param's device, so nothing is read back to the host.

:func:`update_and_apply` takes a whole step (``update`` then ``apply_updates``);
with ``donate=True`` the aliases apply it in place with one fused torch kernel
(see the section "fused, donated steps" below and ``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from gradtx import tree as tu
from gradtx.base import (
    DeferredScale,
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    PyTree,
    Schedule,
    Updates,
    scale_aware,
)
from gradtx.combine import apply_updates, chain

ScalarOrSchedule = float | Schedule

__all__ = [
    "FUSED_APPLY",
    "FusedApply",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "trace",
    "update_and_apply",
]


# --- validation and small helpers --------------------------------------------------------


def _number(value: Any, *, arg: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: {arg} must be a number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name}: {arg} must not be NaN")
    if math.isinf(value):
        raise ValueError(f"{name}: {arg} must be finite, got {value}")
    return value


def _non_negative(value: Any, *, arg: str, name: str) -> float:
    value = _number(value, arg=arg, name=name)
    if value < 0:
        raise ValueError(f"{name}: {arg} must be >= 0, got {value}")
    return value


def _beta(value: Any, *, arg: str, name: str) -> float:
    value = _number(value, arg=arg, name=name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: {arg} must be in [0, 1), got {value}")
    return value


def _learning_rate(learning_rate: Any, *, name: str) -> float | Schedule:
    if callable(learning_rate):
        return learning_rate
    return _non_negative(learning_rate, arg="learning_rate", name=name)


def _leaves(tree: PyTree, *, name: str, what: str = "updates") -> tuple[list[torch.Tensor], Any]:
    leaves, spec = tu.flatten(tree)
    tu.check_tensors(leaves, tu.paths(tree), what=f"{name}: {what}")
    return leaves, spec


def _moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for low-precision floating params, the param's own dtype otherwise."""
    if dtype.is_floating_point and dtype.itemsize < 4:
        return torch.float32
    return dtype


def _zeros_moments(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # zeros_like keeps a DTensor a DTensor (same mesh and placements) and keeps strides.
    return [torch.zeros_like(p, dtype=_moment_dtype(p.dtype), requires_grad=False) for p in leaves]


def _count_device(leaves: Sequence[torch.Tensor]) -> torch.device:
    # The count lives beside the params, so bias corrections and schedules need no host sync.
    return tu.local(leaves[0]).device if leaves else torch.device("cpu")


def _zero_count(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=_count_device(leaves))


def _scalar_update(updates: Updates, factor: torch.Tensor, extra: dict[str, Any], *, name: str) -> Updates:
    """Multiply every update by the 0-d ``factor``: fold it into ``deferred``, or scale in place or purely."""
    deferred = extra.get("deferred")
    if deferred is not None:
        deferred.fold(factor)
        return updates
    leaves, spec = _leaves(updates, name=name)
    out = tu.scale_leaves(leaves, factor, inplace=bool(extra.get("inplace", False)))
    # A 0-d bf16 leaf times the 0-d fp32 factor promotes to fp32 (both are 0-d); keep each leaf's dtype.
    out = [o if o.dtype == g.dtype else o.to(g.dtype) for o, g in zip(out, leaves)]
    return tu.unflatten(spec, out)


def _to_factor(value: Any, sign: float) -> torch.Tensor:
    # A schedule should return a tensor computed from the count; a Python number is
    # accepted and becomes a CPU scalar, which scale_leaves moves without a sync.
    if isinstance(value, torch.Tensor):
        factor = value.to(torch.float32)
    else:
        factor = torch.tensor(float(value), dtype=torch.float32)
    return -factor if sign < 0 else factor


# --- scale ---------------------------------------------------------------------------------


def scale(step_size: float) -> GradientTransformation:
    """Multiply every update by the scalar ``step_size``.

    A pure scalar multiplication, so it is scale-aware: given
    ``deferred=DeferredScale()`` it folds its factor in and returns the updates
    untouched; given ``inplace=True`` it scales the donated buffers in place.

    Args:
      step_size: the factor; any finite number (negative to descend).

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Optax's ``scale`` (DeepMind, 2020).

    Example:
      >>> tx = scale(0.5)
      >>> tx.update({"w": torch.tensor([2.0, -4.0])}, tx.init(None))[0]
      {'w': tensor([ 1., -2.])}
    """
    step_size = _number(step_size, arg="step_size", name="scale")

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    @scale_aware
    def update_fn(updates, state, params=None, **extra):
        del params
        tu.require_state(state, EmptyState, name="scale")
        factor = torch.tensor(step_size, dtype=torch.float32)
        return _scalar_update(updates, factor, extra, name="scale"), state

    return GradientTransformation(init_fn, update_fn)


class ScaleByScheduleState(NamedTuple):
    """The number of updates made so far: a 0-d int64 tensor."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply every update by ``step_size_fn(count)``, where ``count`` is the number of earlier updates.

    ``count`` is a 0-d int64 tensor (0 on the first update), so a schedule
    written with tensor ops (``0.1 * 0.99 ** count``, ``torch.clamp(...)``)
    runs with no host sync. A schedule may also return a Python number.
    Scale-aware, like :func:`scale`.

    Args:
      step_size_fn: a callable from the step count to the factor.

    Returns:
      A :class:`GradientTransformation` with state :class:`ScaleByScheduleState`.

    References:
      Optax's ``scale_by_schedule`` (DeepMind, 2020).

    Example:
      >>> tx = scale_by_schedule(lambda count: 0.5**count)
      >>> updates, state = tx.update(grads, tx.init(params))  # grads * 1, then * 0.5, ...
    """
    return _scale_by_schedule(step_size_fn, sign=1.0, name="scale_by_schedule")


def _scale_by_schedule(step_size_fn: Schedule, *, sign: float, name: str) -> GradientTransformation:
    if not callable(step_size_fn):
        raise TypeError(f"{name}: the schedule must be callable, got {type(step_size_fn).__name__}")

    def init_fn(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_zero_count(tu.flatten(params)[0]))

    @scale_aware
    def update_fn(updates, state, params=None, **extra):
        del params
        tu.require_state(state, ScaleByScheduleState, name=name)
        factor = _to_factor(step_size_fn(state.count), sign)
        return _scalar_update(updates, factor, extra, name=name), ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init_fn, update_fn)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply every update by ``-learning_rate`` (a constant or a schedule of the step count).

    Updates are added to the params, so the sign is flipped by default to
    descend. A constant is :func:`scale`; a callable is
    :func:`scale_by_schedule` (called with the 0-d int64 count, 0 on the first
    update, as ``torch.optim.lr_scheduler.LambdaLR`` calls its lambda with the
    epoch). Either way the transform is scale-aware.

    Args:
      learning_rate: a number ``>= 0``, or a callable ``count -> learning rate``.
      flip_sign: multiply by ``-learning_rate`` (True) or ``learning_rate``.

    Returns:
      A :class:`GradientTransformation`: stateless for a constant, with
      :class:`ScaleByScheduleState` for a schedule.

    References:
      Optax's ``scale_by_learning_rate`` (DeepMind, 2020).

    Example:
      >>> tx = scale_by_learning_rate(lambda count: 1e-3 * torch.clamp((count + 1) / 100, max=1.0))
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    learning_rate = _learning_rate(learning_rate, name="scale_by_learning_rate")
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return _scale_by_schedule(learning_rate, sign=sign, name="scale_by_learning_rate")
    return scale(sign * learning_rate)


# --- Adam ----------------------------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """Adam's step count (0-d int64) and first and second moments (trees mirroring the params)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    mu: PyTree
    nu: PyTree


def _bias_correction(beta: float, t: torch.Tensor) -> torch.Tensor:
    """``1 - beta**t`` as ``-expm1(t * log(beta))``: accurate in fp32 even when ``beta**t`` is close to 1."""
    log_beta = math.log(beta) if beta > 0 else -math.inf
    return -torch.expm1(t * log_beta)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moment estimates.

    With ``t`` the step (1 on the first update), ``m = b1*m + (1-b1)*g`` and
    ``v = b2*v + (1-b2)*g**2``, the update is
    ``m / (1 - b1**t) / (sqrt(v) / sqrt(1 - b2**t) + eps)``, which is what
    ``torch.optim.Adam`` computes before multiplying by ``-lr``. Chain it with
    :func:`scale_by_learning_rate` (or use :func:`adam`).

    Args:
      b1: decay of the first moment; in ``[0, 1)``.
      b2: decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator for stability; ``>= 0``.

    Returns:
      A :class:`GradientTransformation` with state :class:`ScaleByAdamState`;
      moments are fp32 for fp16/bf16 params.

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.

    Example:
      >>> tx = chain(scale_by_adam(), scale_by_learning_rate(1e-3))
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    b1 = _beta(b1, arg="b1", name="scale_by_adam")
    b2 = _beta(b2, arg="b2", name="scale_by_adam")
    eps = _non_negative(eps, arg="eps", name="scale_by_adam")

    def init_fn(params: Params) -> ScaleByAdamState:
        leaves, spec = _leaves(params, name="scale_by_adam", what="params")
        return ScaleByAdamState(
            count=_zero_count(leaves),
            mu=tu.unflatten(spec, _zeros_moments(leaves)),
            nu=tu.unflatten(spec, _zeros_moments(leaves)),
        )

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, ScaleByAdamState, name="scale_by_adam")
        leaves, spec = _leaves(updates, name="scale_by_adam")
        tu.check_structure(state.mu, updates, what="scale_by_adam: updates", against="the state's moments")
        mu_leaves, mu_spec = tu.flatten(state.mu)
        nu_leaves, nu_spec = tu.flatten(state.nu)

        count = state.count + 1
        t = count.to(torch.float32)
        bc1 = _bias_correction(b1, t)
        bc2_sqrt = torch.sqrt(_bias_correction(b2, t))

        mu_locals = [tu.local(m) for m in mu_leaves]
        out: list[torch.Tensor] = list(leaves)
        new_mu: list[torch.Tensor] = list(mu_leaves)
        new_nu: list[torch.Tensor] = list(nu_leaves)
        for (device, dtype), idx in tu.group_by_device_dtype(mu_locals).items():
            g = [tu.local(leaves[i]).to(dtype) for i in idx]
            m = torch._foreach_lerp([mu_locals[i] for i in idx], g, 1 - b1)
            v = torch._foreach_mul([tu.local(nu_leaves[i]) for i in idx], b2)
            torch._foreach_addcmul_(v, g, g, value=1 - b2)  # v is ours: a fresh tensor
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bc2_sqrt.to(device, non_blocking=True))
            torch._foreach_add_(denom, eps)
            u = torch._foreach_div(m, denom)
            torch._foreach_div_(u, bc1.to(device, non_blocking=True))
            for j, i in enumerate(idx):
                new_mu[i] = tu.like(mu_leaves[i], m[j])
                new_nu[i] = tu.like(nu_leaves[i], v[j])
                out[i] = tu.like(leaves[i], u[j].to(leaves[i].dtype))
        new_state = ScaleByAdamState(count=count, mu=tu.unflatten(mu_spec, new_mu), nu=tu.unflatten(nu_spec, new_nu))
        return tu.unflatten(spec, out), new_state

    return GradientTransformation(init_fn, update_fn)


# --- weight decay --------------------------------------------------------------------------


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates.

    Before :func:`scale_by_adam` this is L2 regularisation (``torch.optim.Adam``'s
    ``weight_decay``); after it, decoupled weight decay (``AdamW``). ``update``
    needs ``params``, even when ``weight_decay`` is 0.

    Args:
      weight_decay: the decay coefficient; ``>= 0``.

    Returns:
      A stateless :class:`GradientTransformation`; ``update`` needs ``params``.

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019.

    Example:
      >>> tx = add_decayed_weights(0.1)
      >>> updates, _ = tx.update(grads, tx.init(params), params)
    """
    weight_decay = _non_negative(weight_decay, arg="weight_decay", name="add_decayed_weights")

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, EmptyState, name="add_decayed_weights")
        if params is None:
            raise ValueError("add_decayed_weights: update() needs params (the weights to decay), got params=None")
        leaves, spec = _leaves(updates, name="add_decayed_weights")
        tu.check_structure(params, updates, what="add_decayed_weights: updates", against="params")
        if weight_decay == 0.0:
            return updates, state
        param_leaves, _ = tu.flatten(params)
        locals_ = [tu.local(u) for u in leaves]
        out: list[torch.Tensor] = list(leaves)
        inplace = bool(extra.get("inplace", False))
        for (_, dtype), idx in tu.group_by_device_dtype(locals_).items():
            group = [locals_[i] for i in idx]
            p = [tu.local(param_leaves[i]).to(dtype) for i in idx]
            if inplace:
                torch._foreach_add_(group, p, alpha=weight_decay)
            else:
                for i, r in zip(idx, torch._foreach_add(group, p, alpha=weight_decay)):
                    out[i] = tu.like(leaves[i], r)
        return tu.unflatten(spec, out), state

    return GradientTransformation(init_fn, update_fn)


# --- momentum ------------------------------------------------------------------------------


class TraceState(NamedTuple):
    """The momentum buffer: a tree mirroring the params (fp32 for fp16/bf16 params)."""

    trace: PyTree


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Heavy-ball momentum: ``trace = decay * trace + g``; the update is ``trace`` (or ``g + decay * trace``).

    This is ``torch.optim.SGD``'s momentum buffer with zero dampening, and its
    Nesterov variant. The returned updates never share storage with the state.

    Args:
      decay: the momentum coefficient; ``>= 0``.
      nesterov: use Nesterov momentum, ``g + decay * trace``.

    Returns:
      A :class:`GradientTransformation` with state :class:`TraceState`.

    References:
      Polyak, "Some methods of speeding up the convergence of iteration methods", 1964;
      Sutskever, Martens, Dahl & Hinton, "On the importance of initialization and momentum in deep learning", 2013.

    Example:
      >>> tx = trace(0.9)
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    decay = _non_negative(decay, arg="decay", name="trace")
    if not isinstance(nesterov, bool):
        raise TypeError(f"trace: nesterov must be a bool, got {type(nesterov).__name__}")

    def init_fn(params: Params) -> TraceState:
        leaves, spec = _leaves(params, name="trace", what="params")
        return TraceState(trace=tu.unflatten(spec, _zeros_moments(leaves)))

    def update_fn(updates, state, params=None, **extra):
        del params
        tu.require_state(state, TraceState, name="trace")
        leaves, spec = _leaves(updates, name="trace")
        tu.check_structure(state.trace, updates, what="trace: updates", against="the state's trace")
        tr_leaves, tr_spec = tu.flatten(state.trace)
        tr_locals = [tu.local(t) for t in tr_leaves]
        inplace = bool(extra.get("inplace", False))

        out: list[torch.Tensor] = list(leaves)
        new_tr: list[torch.Tensor] = list(tr_leaves)
        for (_, dtype), idx in tu.group_by_device_dtype(tr_locals).items():
            g = [tu.local(leaves[i]).to(dtype) for i in idx]
            tr = torch._foreach_mul([tr_locals[i] for i in idx], decay)
            torch._foreach_add_(tr, g)  # tr is ours: a fresh tensor
            u = torch._foreach_add(g, tr, alpha=decay) if nesterov else tr
            for j, i in enumerate(idx):
                new_tr[i] = tu.like(tr_leaves[i], tr[j])
                if inplace:  # write into the donated buffer, never hand out the state itself
                    tu.local(leaves[i]).copy_(u[j])
                else:
                    out[i] = tu.like(leaves[i], u[j].to(leaves[i].dtype, copy=not nesterov))
        return tu.unflatten(spec, out), TraceState(trace=tu.unflatten(tr_spec, new_tr))

    return GradientTransformation(init_fn, update_fn)


# --- aliases -------------------------------------------------------------------------------


def sgd(
    learning_rate: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent, optionally with (Nesterov) momentum and L2 weight decay, as ``torch.optim.SGD``.

    ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov),
    scale_by_learning_rate(learning_rate))``, leaving out the members that are
    no-ops (``weight_decay == 0``, ``momentum == 0``). With weight decay,
    ``update`` needs ``params``.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      momentum: the momentum coefficient; ``>= 0``.
      nesterov: use Nesterov momentum (needs ``momentum > 0``).
      weight_decay: L2 penalty added to the gradient; ``>= 0``.

    Returns:
      A :class:`GradientTransformation` that runs that :func:`gradtx.chain` and has its state.
      In a donated :func:`update_and_apply` step it applies the whole step with
      torch's fused kernel instead, when the leaves allow.

    References:
      Robbins & Monro, "A Stochastic Approximation Method", 1951;
      Sutskever, Martens, Dahl & Hinton, "On the importance of initialization and momentum in deep learning", 2013.

    Example:
      >>> tx = sgd(0.1, momentum=0.9)
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> params = apply_updates(params, updates)
    """
    learning_rate = _learning_rate(learning_rate, name="sgd")
    momentum = _non_negative(momentum, arg="momentum", name="sgd")
    weight_decay = _non_negative(weight_decay, arg="weight_decay", name="sgd")
    if not isinstance(nesterov, bool):
        raise TypeError(f"sgd: nesterov must be a bool, got {type(nesterov).__name__}")
    if nesterov and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0, got momentum=0.0")
    txs = []
    if weight_decay != 0.0:
        txs.append(add_decayed_weights(weight_decay))
    if momentum != 0.0:
        txs.append(trace(momentum, nesterov))
    txs.append(scale_by_learning_rate(learning_rate))
    spec = _FusedSpec("sgd", learning_rate, weight_decay, momentum=momentum, nesterov=nesterov)
    return _fusable("sgd", txs, spec, core=len(txs) - 2 if momentum != 0.0 else None)


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam``: ``weight_decay`` is an L2 penalty added to the gradient.

    ``chain(add_decayed_weights(weight_decay), scale_by_adam(b1, b2, eps),
    scale_by_learning_rate(learning_rate))``, without the first member when
    ``weight_decay == 0``. With weight decay, ``update`` needs ``params``.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      b1: decay of the first moment; in ``[0, 1)``.
      b2: decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator for stability; ``>= 0``.
      weight_decay: L2 penalty added to the gradient; ``>= 0``.

    Returns:
      A :class:`GradientTransformation` that runs that :func:`gradtx.chain` and has its state.
      In a donated :func:`update_and_apply` step it applies the whole step with
      torch's fused kernel instead, when the leaves allow.

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.

    Example:
      >>> tx = adam(1e-3)
      >>> updates, state = tx.update(grads, tx.init(params))
      >>> params = apply_updates(params, updates)
    """
    learning_rate = _learning_rate(learning_rate, name="adam")
    b1 = _beta(b1, arg="b1", name="adam")
    b2 = _beta(b2, arg="b2", name="adam")
    eps = _non_negative(eps, arg="eps", name="adam")
    weight_decay = _non_negative(weight_decay, arg="weight_decay", name="adam")
    txs = [add_decayed_weights(weight_decay)] if weight_decay != 0.0 else []
    txs += [scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate)]
    spec = _FusedSpec("adam", learning_rate, weight_decay, b1=b1, b2=b2, eps=eps)
    return _fusable("adam", txs, spec, core=len(txs) - 2)


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay.

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay),
    scale_by_learning_rate(learning_rate))``, so the decay is scaled by the
    (scheduled) learning rate but not by Adam's denominator; the decay member
    is left out when ``weight_decay == 0``. With weight decay, ``update`` needs
    ``params``. Use :func:`gradtx.masked` to exempt biases and norms.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      b1: decay of the first moment; in ``[0, 1)``.
      b2: decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator for stability; ``>= 0``.
      weight_decay: the decoupled decay coefficient; ``>= 0``.

    Returns:
      A :class:`GradientTransformation` that runs that :func:`gradtx.chain` and has its state.
      In a donated :func:`update_and_apply` step it applies the whole step with
      torch's fused kernel instead, when the leaves allow.

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019;
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.

    Example:
      >>> tx = adamw(3e-4, weight_decay=0.1)
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> params = apply_updates(params, updates)
    """
    learning_rate = _learning_rate(learning_rate, name="adamw")
    b1 = _beta(b1, arg="b1", name="adamw")
    b2 = _beta(b2, arg="b2", name="adamw")
    eps = _non_negative(eps, arg="eps", name="adamw")
    weight_decay = _non_negative(weight_decay, arg="weight_decay", name="adamw")
    txs = [scale_by_adam(b1, b2, eps)]
    if weight_decay != 0.0:
        txs.append(add_decayed_weights(weight_decay))
    txs.append(scale_by_learning_rate(learning_rate))
    spec = _FusedSpec("adamw", learning_rate, weight_decay, b1=b1, b2=b2, eps=eps)
    return _fusable("adamw", txs, spec, core=0)


# --- fused, donated steps --------------------------------------------------------------------
#
# A pure step must write new moments, new updates and new params: on a big model those
# are fresh gradient-sized buffers every step, several passes over memory more than
# torch.optim's fused kernels make. A *donated* step gives its grads, state and params
# to the step (as jax.jit's donate_argnums does), so the last optimizer of a chain may
# update them in place with one fused torch kernel (torch._fused_adamw_, _fused_adam_,
# _fused_sgd_): it reads p, g and the moments once and writes p and the moments once,
# and a clip or accumulation factor rides in its ``grad_scale``.

FUSED_APPLY = "fused_apply"
"""The reserved extra through which :func:`update_and_apply` offers a :class:`FusedApply`."""

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# torch.optim's own list of device types with fused optimizer kernels; a guess if it moves.
try:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    _FUSED_DEVICE_TYPES = frozenset(_get_fused_kernels_supported_devices())
except ImportError:  # pragma: no cover
    _FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})


class FusedApply:
    """The handshake of a donated step: the one fused kernel that will apply it.

    :func:`update_and_apply` passes one as the reserved extra ``fused_apply``,
    together with ``inplace=True`` and ``deferred``. The aliases :func:`sgd`,
    :func:`adam` and :func:`adamw`, when they run at the top level of the
    chain (``deferred`` reached them) and every leaf suits the fused kernel,
    *claim* it: they record the kernel launch that will update the params and
    their moments in place, advance their step counts, and hand back their
    input updates untouched as a token. Nothing is launched until the whole
    chain has returned, so a chain that cannot be fused that way fails before
    anything changes. Anything else ignores the extra.

    Attributes:
      launch: the recorded kernel launch, or ``None`` while unclaimed.
      token: the updates tree the claiming alias returned.
      name: which alias claimed it.
    """

    def __init__(self) -> None:
        self.launch: Callable[[], None] | None = None
        self.token: Any = None
        self.name = ""

    def claim(self, launch: Callable[[], None], token: Any, *, name: str) -> None:
        """Record ``launch`` as the step's kernel; ``token`` is the updates tree the claimer returns."""
        if self.launch is not None:
            raise ValueError(
                f"update_and_apply: {name} and {self.name} both apply the step; a donated step fuses one optimizer"
            )
        self.launch, self.token, self.name = launch, token, name


class _FusedSpec(NamedTuple):
    kind: str  # "sgd", "adam" or "adamw"
    learning_rate: float | Schedule
    weight_decay: float
    b1: float = 0.0
    b2: float = 0.0
    eps: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False


def _fused_groups(
    lists: Sequence[Sequence[torch.Tensor]],
) -> dict[tuple[torch.device, torch.dtype], list[list[Any]]] | None:
    """Group parallel lists of local tensors by (device, dtype) for a fused kernel, or ``None`` if one does not suit it.

    The kernels walk each tensor's memory flat and check neither shapes nor
    layouts, so every tensor of a leaf must have the same dtype, device and
    shape, and be contiguous.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[list[Any]]] = {}
    for ts in zip(*lists):
        p = ts[0]
        if not isinstance(p, torch.Tensor) or p.dtype not in _FUSED_DTYPES or p.device.type not in _FUSED_DEVICE_TYPES:
            return None
        for t in ts:
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != p.dtype
                or t.device != p.device
                or t.shape != p.shape
                or not t.is_contiguous()
            ):
                return None
        group = groups.get((p.device, p.dtype))
        if group is None:
            group = groups[(p.device, p.dtype)] = [[] for _ in ts]
        for column, t in zip(group, ts):
            column.append(t)
    return groups


def _fused_step(
    spec: _FusedSpec,
    members: int,
    core: int | None,
    updates: Updates,
    state: Any,
    params: Params,
    deferred: DeferredScale,
) -> tuple[Callable[[], None], tuple[OptState, ...]] | None:
    """The fused kernel launch and new chain state for a donated step, or ``None`` to take the ordinary path.

    ``None`` whenever anything is unusual (a wrong state, another structure,
    a leaf the kernel does not take): the ordinary chain then runs, and
    reports a real error in its own words.
    """
    if not isinstance(state, tuple) or len(state) != members:
        return None
    core_state = state[core] if core is not None else None
    core_type = TraceState if spec.kind == "sgd" else ScaleByAdamState
    if core is not None and not isinstance(core_state, core_type):
        return None
    lr_state = state[-1]
    scheduled = callable(spec.learning_rate)
    if scheduled != isinstance(lr_state, ScaleByScheduleState):
        return None

    g_leaves, g_spec = tu.flatten(updates)
    p_leaves, p_spec = tu.flatten(params)
    lists = [[tu.local(t) for t in p_leaves], [tu.local(t) for t in g_leaves]]
    if g_spec != p_spec:
        return None
    if core_state is not None:
        moments = (core_state.mu, core_state.nu) if isinstance(core_state, ScaleByAdamState) else (core_state.trace,)
        for buffers in moments:
            b_leaves, b_spec = tu.flatten(buffers)
            if b_spec != p_spec:
                return None
            lists.append([tu.local(t) for t in b_leaves])
    groups = _fused_groups(lists)
    if groups is None:
        return None

    lr: float | torch.Tensor = spec.learning_rate  # type: ignore[assignment]
    if scheduled:
        lr = _to_factor(spec.learning_rate(lr_state.count), 1.0)  # type: ignore[operator]
    factor = deferred.take()
    count = core_state.count + 1 if isinstance(core_state, ScaleByAdamState) else None

    def launch() -> None:
        for (device, _), columns in groups.items():
            kw: dict[str, Any] = {"weight_decay": spec.weight_decay, "maximize": False}
            # The kernel divides the grads by grad_scale (it unscales AMP grads), so the factor goes in inverted.
            kw["grad_scale"] = None if factor is None else torch.reciprocal(factor.to(device, torch.float32))
            kw["lr"] = lr.to(device, non_blocking=True) if isinstance(lr, torch.Tensor) else lr
            if spec.kind == "sgd":
                ps, gs, *bufs = columns
                kw.update(momentum=spec.momentum, dampening=0.0, nesterov=spec.nesterov, is_first_step=False)
                packet = torch.ops.aten._fused_sgd_
                op = packet.tensor_lr if isinstance(lr, torch.Tensor) else packet.default
                op(ps, gs, bufs[0] if bufs else [], **kw)
            else:
                ps, gs, ms, vs = columns
                assert count is not None
                step = count.to(device, torch.float32, non_blocking=True)
                kw.update(beta1=spec.b1, beta2=spec.b2, eps=spec.eps, amsgrad=False)
                packet = torch.ops.aten._fused_adamw_ if spec.kind == "adamw" else torch.ops.aten._fused_adam_
                op = packet.tensor_lr if isinstance(lr, torch.Tensor) else packet.default
                op(ps, gs, ms, vs, [], [step] * len(ps), **kw)

    new_state = list(state)
    if isinstance(core_state, ScaleByAdamState):
        # The moments are the donated buffers: the launch advances them in place.
        assert core is not None and count is not None  # both set together with core_state
        new_state[core] = ScaleByAdamState(count=count, mu=core_state.mu, nu=core_state.nu)
    if scheduled:
        new_state[-1] = ScaleByScheduleState(count=lr_state.count + 1)
    return launch, tuple(new_state)


def _fusable(
    name: str, txs: list[GradientTransformation], spec: _FusedSpec, *, core: int | None
) -> GradientTransformation:
    """``chain(*txs)``, which also claims a donated step's :class:`FusedApply` when it can.

    The state is the chain's (a tuple of member states), on every path.
    """
    inner = chain(*txs)

    @scale_aware  # the inner chain applies a pending factor itself before its first non-scalar member
    def update_fn(updates, state, params=None, **extra):
        fused = extra.get(FUSED_APPLY)
        deferred = extra.get("deferred")
        # deferred reaches only the top level of a chain (masked, partition and apply_if_finite
        # drop it), which is where applying the whole step in place is sound.
        if fused is not None and deferred is not None and params is not None and extra.get("inplace", False):
            planned = _fused_step(spec, len(txs), core, updates, state, params, deferred)
            if planned is not None:
                launch, new_state = planned
                fused.claim(launch, updates, name=name)
                return updates, new_state
        if deferred is None and not extra.get("inplace", False) and isinstance(state, tuple) and len(state) == len(txs):
            return _run_owning(txs, updates, state, params, extra)
        return inner.update(updates, state, params, **extra)

    return GradientTransformation(inner.init, update_fn)


def _run_owning(
    txs: Sequence[GradientTransformation], updates: Updates, state: tuple[OptState, ...], params: Params, extra: Any
) -> tuple[Updates | None, tuple[OptState, ...]]:
    """The pure path of an alias: the first member makes fresh updates, the rest write into them.

    Every member's output buffers are new and shared with nothing (the
    protocol), so after the first one they belong to this call and later
    members may take them as donated (``inplace=True``): the same numbers,
    with fewer gradient-sized buffers allocated per step. The caller's
    updates, state and params are never written.
    """
    new_states = list(state)
    for i, tx in enumerate(txs):
        owned = {**extra, "inplace": True} if i > 0 else extra
        updates, new_states[i] = tx.update(updates, state[i], params, **owned)
        if updates is None:  # an alias has no gate, but a member may still hold
            break
    return updates, tuple(new_states)


def _add_in_place(params: Params, updates: Updates, factor: torch.Tensor | None) -> None:
    """``params += factor * updates``, in place, through local shards; ``updates`` are owned and may be scaled."""
    tu.check_structure(params, updates, what="updates", against="params")
    p_leaves = [tu.local(p) for p in tu.flatten(params)[0]]
    u_leaves = [tu.local(u) for u in tu.flatten(updates)[0]]
    for (device, _), idx in tu.group_by_device_dtype(p_leaves).items():
        ps = [p_leaves[i] for i in idx]
        us = [u_leaves[i] for i in idx]
        if factor is not None:
            torch._foreach_mul_(us, factor.to(device, non_blocking=True))
        torch._foreach_add_(ps, us)


def update_and_apply(
    tx: GradientTransformation,
    grads: Updates,
    state: OptState,
    params: Params,
    *,
    donate: bool = False,
    **extra: Any,
) -> tuple[Params, OptState]:
    """One optimizer step: ``tx.update`` then :func:`gradtx.apply_updates`, optionally on donated buffers.

    With ``donate=False`` this is exactly::

        updates, state = tx.update(grads, state, params, **extra)
        params = apply_updates(params, updates)

    and it is pure. With ``donate=True`` the caller hands ``grads``, ``state``
    and ``params`` over to the step, as with ``jax.jit(..., donate_argnums=...)``:
    the step may overwrite them, and the returned params and state share
    their storage. Do not use the inputs afterwards (keep the returned ones).
    The step then runs the chain with ``inplace=True`` and a
    :class:`gradtx.DeferredScale`, and:

    * when the chain ends in :func:`adamw`, :func:`adam` or :func:`sgd` with
      every leaf fit for torch's fused kernel (params, grads and moments of one
      dtype, contiguous, on a CPU/CUDA/... device: fp32 or fp64 params, since
      gradtx keeps fp32 moments for low-precision ones), that alias applies
      the whole step in one ``torch._fused_adamw_`` / ``_fused_adam_`` /
      ``_fused_sgd_`` launch, with the pending clip or accumulation factor in
      its ``grad_scale``: one pass over p, g and the moments, like
      ``torch.optim.AdamW(fused=True)`` after an in-place clip, minus the clip's
      own pass;
    * otherwise the updates are computed in the donated grads buffers and
      added to the params in place, with no new gradient-sized buffers.

    The numbers equal the pure path's to fp32 rounding. The grads' values
    after a donated step are unspecified. Only an alias at the top level of
    the chain fuses (inside :func:`gradtx.masked`, :func:`gradtx.partition` or
    :func:`gradtx.apply_if_finite` it runs its ordinary way); the fused alias
    must be the last member that changes the updates.

    Args:
      tx: the gradient transformation.
      grads: the gradients, a pytree matching ``params``.
      state: ``tx``'s state.
      params: the parameters, a pytree of tensors.
      donate: hand ``grads``, ``state`` and ``params`` to the step to update in place.
      **extra: forwarded to ``tx.update`` (``tokens=...``, ``flush=...``);
        ``inplace``, ``deferred`` and ``fused_apply`` are set by this function.

    Returns:
      ``(new_params, new_state)``. With ``donate=True`` they are (or share
      storage with) the donated inputs. When the chain holds (an open
      accumulation window) the params come back unchanged.

    Raises:
      ValueError: with ``donate=True``, when a fused alias is not the chain's
        last member that changes the updates, or two aliases would fuse.

    Example:
      >>> tx = chain(clip_by_global_norm(1.0), adamw(3e-4, weight_decay=0.1))
      >>> state = tx.init(params)
      >>> for batch in loader:
      ...     grads = torch.func.grad(loss_fn)(params, batch)
      ...     params, state = update_and_apply(tx, grads, state, params, donate=True)
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"update_and_apply: tx must be a GradientTransformation, got {type(tx).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"update_and_apply: donate must be a bool, got {type(donate).__name__}")
    if not donate:
        updates, new_state = tx.update(grads, state, params, **extra)
        return apply_updates(params, updates), new_state

    reserved = sorted(k for k in ("inplace", "deferred", FUSED_APPLY) if k in extra)
    if reserved:
        raise TypeError(f"update_and_apply: {reserved} are set by donate=True; do not pass them")
    deferred = DeferredScale()
    fused = FusedApply()
    # A donated step writes its inputs, so it is not differentiable; no_grad also lets it write
    # params that are leaves requiring grad (nn.Parameters), as an optimizer step does.
    with torch.no_grad():
        updates, new_state = tx.update(
            grads, state, params, inplace=True, deferred=deferred, **{FUSED_APPLY: fused}, **extra
        )
        if fused.launch is not None:
            if updates is not fused.token or deferred.factor is not None:
                raise ValueError(
                    f"update_and_apply: a member after {fused.name} changed the updates (or held); with donate=True "
                    f"{fused.name} applies the step itself, so it must be the chain's last member"
                )
            fused.launch()
        elif updates is not None:  # None: an open accumulation window
            _add_in_place(params, updates, deferred.take())
    return params, new_state
