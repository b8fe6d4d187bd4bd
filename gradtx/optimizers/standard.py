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

The aliases are :class:`OptimizerChain` s: chains that also hold their
hyperparameters once (:class:`OptimizerSpec`), so :mod:`gradtx.runtime.executor` can
run a donated step (:func:`gradtx.update_and_apply` with ``donate=True``) as
one fused torch kernel. Nothing in this module knows about that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Self

import torch

from gradtx.core import foreach as fe
from gradtx.core import kinds
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    PyTree,
    ScalarTransformation,
    Schedule,
    Updates,
    factory,
    scalar_transformation,
)
from gradtx.transforms.combine import Chain, chain, masked

ScalarOrSchedule = float | torch.Tensor | Schedule
Scalar = float | torch.Tensor  # a 0-d tensor hyperparameter is what gradtx.inject_hyperparams passes

__all__ = [
    "OptimizerChain",
    "OptimizerSpec",
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
]


# --- validation and small helpers --------------------------------------------------------


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
    return tu.device_of(list(leaves))


def _zero_count(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=_count_device(leaves))


def _tensor_arg(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _as(value: Scalar, like: torch.Tensor) -> Scalar:
    """A tensor hyperparameter on ``like``'s device and in its dtype (a Python number stays one)."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device, like.dtype, non_blocking=True)
    return value


def _real_view(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _to_factor(value: Any, sign: float) -> torch.Tensor:
    # A schedule should return a tensor computed from the count; a Python number is
    # accepted and becomes a CPU scalar, which scale_leaves moves without a sync.
    # Python numbers become fp64, so fp64 params step by exactly the learning rate given;
    # lower-precision grads take the factor in fp32 (see gradtx.core.tree.scale_leaves).
    if isinstance(value, torch.Tensor):
        factor = value if value.dtype in (torch.float32, torch.float64) else value.to(torch.float32)
    else:
        factor = torch.tensor(float(value), dtype=torch.float64)
    return -factor if sign < 0 else factor


# --- scale ---------------------------------------------------------------------------------


@factory
def scale(step_size: Scalar) -> ScalarTransformation:
    """Multiply every update by the scalar ``step_size``.

    A :class:`gradtx.core.base.ScalarTransformation`: its factor is exposed, so a run
    of scalar transforms folds into one multiply (see :mod:`gradtx.runtime.executor`).

    Args:
      step_size: the factor; any finite number (negative to descend), or a 0-d tensor.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Optax's ``scale`` (DeepMind, 2020).

    Example:
      >>> tx = scale(0.5)
      >>> tx.update({"w": torch.tensor([2.0, -4.0])}, tx.init(None))[0]
      {'w': tensor([ 1., -2.])}
    """
    step_size = check.number(step_size, arg="step_size", name="scale", tensor=True)
    return _scale(step_size, 1.0, name="scale")


def _scale(step_size: Scalar, sign: float, *, name: str) -> ScalarTransformation:
    """Multiply by ``sign * step_size``; a tensor ``step_size`` is read at every update, never copied."""

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        del updates, params, scale, extra
        tu.require_state(state, EmptyState, name=name)
        if isinstance(step_size, torch.Tensor):
            return step_size.to(torch.float64) * sign, state
        return torch.tensor(sign * step_size, dtype=torch.float64), state

    return scalar_transformation(init_fn, factor_fn)


class ScaleByScheduleState(NamedTuple):
    """The number of updates made so far: a 0-d int64 tensor."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax


@factory
def scale_by_schedule(step_size_fn: Schedule) -> ScalarTransformation:
    """Multiply every update by ``step_size_fn(count)``, where ``count`` is the number of earlier updates.

    ``count`` is a 0-d int64 tensor (0 on the first update), so a schedule
    written with tensor ops (``0.1 * 0.99 ** count``, ``torch.clamp(...)``)
    runs with no host sync. A schedule may also return a Python number.
    A scalar transformation, like :func:`scale`.

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


def _scale_by_schedule(step_size_fn: Schedule, *, sign: float, name: str) -> ScalarTransformation:
    if not callable(step_size_fn):
        raise TypeError(f"{name}: the schedule must be callable, got {type(step_size_fn).__name__}")

    def init_fn(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_zero_count(tu.flatten(params)[0]))

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        del updates, params, scale, extra
        tu.require_state(state, ScaleByScheduleState, name=name)
        return _to_factor(step_size_fn(state.count), sign), ScaleByScheduleState(count=state.count + 1)

    return scalar_transformation(init_fn, factor_fn)


@factory
def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> ScalarTransformation:
    """Multiply every update by ``-learning_rate`` (a constant or a schedule of the step count).

    Updates are added to the params, so the sign is flipped by default to
    descend. A constant is :func:`scale`; a callable is
    :func:`scale_by_schedule` (called with the 0-d int64 count, 0 on the first
    update, as ``torch.optim.lr_scheduler.LambdaLR`` calls its lambda with the
    epoch). Either way it is a scalar transformation.

    Args:
      learning_rate: a number ``>= 0``, a 0-d tensor, or a callable ``count -> learning rate``.
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
    learning_rate = check.learning_rate(learning_rate, name="scale_by_learning_rate")
    flip_sign = check.flag(flip_sign, arg="flip_sign", name="scale_by_learning_rate")
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return _scale_by_schedule(learning_rate, sign=sign, name="scale_by_learning_rate")
    return _scale(learning_rate, sign, name="scale_by_learning_rate")


# --- Adam ----------------------------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """Adam's step count (0-d int64) and first and second moments (trees mirroring the params)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    mu: PyTree
    nu: PyTree


def _bias_correction(beta: Scalar, t: torch.Tensor) -> torch.Tensor:
    """``1 - beta**t`` as ``-expm1(t * log(beta))``: accurate in fp32 even when ``beta**t`` is close to 1."""
    if isinstance(beta, torch.Tensor):
        return -torch.expm1(t * torch.log(beta.to(t.device, t.dtype)))  # log(0) = -inf gives 1, as below
    log_beta = math.log(beta) if beta > 0 else -math.inf
    return -torch.expm1(t * log_beta)


# Below this many elements one foreach launch over the group beats a Python loop of ``out=`` calls.
_LOOP_MIN_NUMEL = 1 << 16


def _adam_direction_into(
    u: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], scale: torch.Tensor, shift: torch.Tensor
) -> None:
    """Write ``m / (sqrt(v) * scale + shift)`` into ``u``, which aliases neither ``m`` nor ``v``.

    Large tensors take three passes (``sqrt`` and ``div`` with ``out=``, and one
    affine pass); small ones go through foreach ops, one launch per op for all
    of them.
    """
    large = [k for k, x in enumerate(u) if x.numel() >= _LOOP_MIN_NUMEL]
    small = [k for k, x in enumerate(u) if x.numel() < _LOOP_MIN_NUMEL]
    for k in large:
        torch.sqrt(v[k], out=u[k])
    if small:
        torch._foreach_copy_([u[k] for k in small], [v[k] for k in small])
        torch._foreach_sqrt_([u[k] for k in small])
    torch._foreach_mul_(u, scale)
    # The list overload: with one 0-d tensor, _foreach_add_ reads it to the host (.item()) on every
    # call, which breaks a compiled graph, fails on meta tensors, and is 3x slower on CPU.
    torch._foreach_add_(u, [shift] * len(u))
    for k in large:
        torch.div(m[k], u[k], out=u[k])
    if small:
        torch._foreach_reciprocal_([u[k] for k in small])
        torch._foreach_mul_([u[k] for k in small], [m[k] for k in small])


@factory
def scale_by_adam(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8) -> GradientTransformation:
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
    b1 = check.beta(b1, arg="b1", name="scale_by_adam", tensor=True)
    b2 = check.beta(b2, arg="b2", name="scale_by_adam", tensor=True)
    eps = check.non_negative(eps, arg="eps", name="scale_by_adam", tensor=True)

    def init_fn(params: Params) -> ScaleByAdamState:
        leaves, spec = tu.tensor_leaves(params, what="scale_by_adam: params")
        return ScaleByAdamState(
            count=_zero_count(leaves),
            mu=tu.unflatten(spec, _zeros_moments(leaves)),
            nu=tu.unflatten(spec, _zeros_moments(leaves)),
        )

    def update_fn(updates, state, params=None, **extra):
        del params
        tu.require_state(state, ScaleByAdamState, name="scale_by_adam")
        # A None update (a param with no gradient) leaves its moments as they are.
        index, leaves, spec = tu.align(state.mu, updates, what="scale_by_adam: updates", against="the state's moments")
        mu_leaves, mu_spec = tu.flatten(state.mu)
        nu_leaves, nu_spec = tu.flatten(state.nu)
        tu.check_devices(
            [mu_leaves[i] for i in index], leaves, updates, what="scale_by_adam: updates", against="its moments"
        )

        count = state.count + 1
        mu_locals = [tu.local(mu_leaves[i]) for i in index]
        out: list[torch.Tensor] = list(leaves)
        new_mu: list[torch.Tensor] = list(mu_leaves)
        new_nu: list[torch.Tensor] = list(nu_leaves)
        for (device, dtype), idx in tu.group_by_device_dtype(mu_locals).items():
            # Complex params are pairs of reals, as torch.optim.Adam treats them (view_as_real):
            # the second moment is per component, |re|^2 and |im|^2, never g*g.
            real = _real_view if dtype.is_complex else _same
            g = [real(tu.local(leaves[j]).to(dtype)) for j in idx]
            mus = [real(mu_locals[j]) for j in idx]
            nus = [real(tu.local(nu_leaves[index[j]])) for j in idx]
            m_dtype = mus[0].dtype  # the real dtype of the moments
            t = count.to(device, tu.acc_dtype(dtype))  # fp64 bias corrections for fp64 params
            bc1 = _bias_correction(b1, t)
            bc2_sqrt = torch.sqrt(_bias_correction(b2, t))
            if isinstance(b1, torch.Tensor) or isinstance(b2, torch.Tensor):
                w1 = (1 - b1).to(device, m_dtype) if isinstance(b1, torch.Tensor) else 1 - b1
                m = fe.lerp(mus, g, w1)
                # addcmul's value must be a Python number: v = lerp(v, g*g, 1 - b2) is the same update.
                w2 = (1 - b2).to(device, m_dtype) if isinstance(b2, torch.Tensor) else torch.tensor(1 - b2)
                v = fe.lerp(nus, fe.mul(g, g), w2.to(device, m_dtype))
            else:
                m = fe.lerp(mus, g, 1 - b1)
                v = fe.mul(nus, b2)
                fe.addcmul_(v, g, g, value=1 - b2)  # v is ours: a fresh tensor
            # u = m / bc1 / (sqrt(v) / sqrt(bc2) + eps), computed in the one temporary the step needs:
            # u = m / (sqrt(v) * (bc1 / sqrt(bc2)) + eps * bc1).
            scale_, shift = bc1 / bc2_sqrt, bc1 * _as(eps, bc1)
            recording = torch.is_grad_enabled() and any(t.requires_grad for t in (*g, *mus, *nus, scale_, shift))
            if recording or fe.under_vmap():
                # Autograd is recording (torch.func.grad through the step, a hyperparameter that requires
                # grad), or vmap is batching: no out= ops, no writes into the moments.
                denom = fe.add(fe.mul(fe.sqrt(v), scale_), [shift] * len(v))
                u = fe.div(m, denom)
            else:
                if extra.get("inplace", False) and all(tu.local(leaves[i]).dtype == dtype for i in idx):
                    u = g  # the donated update buffers, read for the last time above: the result goes there
                else:
                    u = [torch.empty_like(x) for x in v]
                _adam_direction_into(u, m, v, scale_, shift)
            back = torch.view_as_complex if dtype.is_complex else _same
            for k, j in enumerate(idx):
                i = index[j]
                new_mu[i] = tu.like(mu_leaves[i], back(m[k]))
                new_nu[i] = tu.like(nu_leaves[i], back(v[k]))
                out[j] = tu.like(leaves[j], back(u[k]).to(leaves[j].dtype))
        new_state = ScaleByAdamState(count=count, mu=tu.unflatten(mu_spec, new_mu), nu=tu.unflatten(nu_spec, new_nu))
        return tu.unflatten(spec, out), new_state

    return kinds.declare_fresh(GradientTransformation(init_fn, update_fn))


# --- weight decay --------------------------------------------------------------------------


@factory
def add_decayed_weights(
    weight_decay: Scalar = 0.0, mask: PyTree | Callable[[Params], PyTree] | None = None
) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates.

    Before :func:`scale_by_adam` this is L2 regularisation (``torch.optim.Adam``'s
    ``weight_decay``); after it, decoupled weight decay (``AdamW``). ``update``
    needs ``params``, even when ``weight_decay`` is 0.

    Args:
      weight_decay: the decay coefficient; ``>= 0``, or a 0-d tensor.
      mask: decay only the leaves where this is True: a tree of bools (or a
        prefix of the params tree) or a function ``params -> mask``, as for
        :func:`gradtx.masked` (optax's ``mask``). ``None`` decays every leaf.

    Returns:
      A stateless :class:`GradientTransformation`; ``update`` needs ``params``.

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019.

    Example:
      >>> tx = add_decayed_weights(0.1)
      >>> updates, _ = tx.update(grads, tx.init(params), params)
    """
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name="add_decayed_weights", tensor=True)
    if mask is not None:
        return masked(add_decayed_weights(weight_decay), mask)

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, EmptyState, name="add_decayed_weights")
        if params is None:
            raise ValueError("add_decayed_weights: update() needs params (the weights to decay), got params=None")
        index, leaves, spec = tu.align(params, updates, what="add_decayed_weights: updates", against="params")
        if not isinstance(weight_decay, torch.Tensor) and weight_decay == 0.0:
            return updates, state
        param_leaves, _ = tu.flatten(params)
        tu.check_devices(
            [param_leaves[i] for i in index], leaves, updates, what="add_decayed_weights: updates", against="the params"
        )
        locals_ = [tu.local(u) for u in leaves]
        out: list[torch.Tensor] = list(leaves)
        inplace = bool(extra.get("inplace", False))
        for (device, dtype), idx in tu.group_by_device_dtype(locals_).items():
            group = [locals_[j] for j in idx]
            p = [tu.local(param_leaves[index[j]]).to(dtype) for j in idx]
            if isinstance(weight_decay, torch.Tensor):
                decay = fe.mul(p, weight_decay.to(device, dtype, non_blocking=True))
                result = fe.add_(group, decay) if inplace else fe.add(group, decay)
            elif inplace:
                fe.add_(group, p, alpha=weight_decay)
            else:
                result = fe.add(group, p, alpha=weight_decay)
            if not inplace:
                for j, r in zip(idx, result):
                    out[j] = tu.like(leaves[j], r)
        return tu.unflatten(spec, out), state

    return kinds.declare_fresh(GradientTransformation(init_fn, update_fn))


# --- momentum ------------------------------------------------------------------------------


class TraceState(NamedTuple):
    """The momentum buffer: a tree mirroring the params (fp32 for fp16/bf16 params)."""

    trace: PyTree


@factory
def trace(decay: Scalar, nesterov: bool = False) -> GradientTransformation:
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
    decay = check.non_negative(decay, arg="decay", name="trace", tensor=True)
    nesterov = check.flag(nesterov, arg="nesterov", name="trace")

    def init_fn(params: Params) -> TraceState:
        leaves, spec = tu.tensor_leaves(params, what="trace: params")
        return TraceState(trace=tu.unflatten(spec, _zeros_moments(leaves)))

    def update_fn(updates, state, params=None, **extra):
        del params
        tu.require_state(state, TraceState, name="trace")
        # A None update (a param with no gradient) leaves its trace as it is.
        index, leaves, spec = tu.align(state.trace, updates, what="trace: updates", against="the state's trace")
        tr_leaves, tr_spec = tu.flatten(state.trace)
        tu.check_devices([tr_leaves[i] for i in index], leaves, updates, what="trace: updates", against="its momentum")
        tr_locals = [tu.local(tr_leaves[i]) for i in index]
        inplace = bool(extra.get("inplace", False))

        out: list[torch.Tensor] = list(leaves)
        new_tr: list[torch.Tensor] = list(tr_leaves)
        for (device, dtype), idx in tu.group_by_device_dtype(tr_locals).items():
            g = [tu.local(leaves[j]).to(dtype) for j in idx]
            d = decay.to(device, dtype, non_blocking=True) if isinstance(decay, torch.Tensor) else decay
            tr = fe.mul([tr_locals[j] for j in idx], d)
            fe.add_(tr, g)  # tr is ours: a fresh tensor
            if not nesterov:
                u = tr
            elif isinstance(d, torch.Tensor):
                u = fe.add(g, fe.mul(tr, d))
            else:
                u = fe.add(g, tr, alpha=d)
            for k, j in enumerate(idx):
                new_tr[index[j]] = tu.like(tr_leaves[index[j]], tr[k])
                if inplace:  # write into the donated buffer, never hand out the state itself
                    tu.local(leaves[j]).copy_(u[k])
                else:
                    out[j] = tu.like(leaves[j], u[k].to(leaves[j].dtype, copy=not nesterov))
        return tu.unflatten(spec, out), TraceState(trace=tu.unflatten(tr_spec, new_tr))

    return kinds.declare_fresh(GradientTransformation(init_fn, update_fn))


# --- aliases -------------------------------------------------------------------------------


def _is_zero(value: Scalar) -> bool:
    # A tensor hyperparameter may change between steps, so its member is always kept.
    return not isinstance(value, torch.Tensor) and value == 0.0


@factory
def sgd(
    learning_rate: ScalarOrSchedule, momentum: Scalar = 0.0, nesterov: bool = False, weight_decay: Scalar = 0.0
) -> OptimizerChain:
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
    learning_rate = check.learning_rate(learning_rate, name="sgd")
    momentum = check.non_negative(momentum, arg="momentum", name="sgd", tensor=True)
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name="sgd", tensor=True)
    nesterov = check.flag(nesterov, arg="nesterov", name="sgd")
    if nesterov and _is_zero(momentum):
        raise ValueError("sgd: nesterov=True needs momentum > 0, got momentum=0.0")
    txs = []
    if not _is_zero(weight_decay):
        txs.append(add_decayed_weights(weight_decay))
    if not _is_zero(momentum):
        txs.append(trace(momentum, nesterov))
    txs.append(scale_by_learning_rate(learning_rate))
    core = len(txs) - 2 if not _is_zero(momentum) else None
    return _alias(
        txs, OptimizerSpec("sgd", learning_rate, weight_decay, momentum=momentum, nesterov=nesterov, core=core)
    )


@factory
def adam(
    learning_rate: ScalarOrSchedule,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
) -> OptimizerChain:
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
    learning_rate = check.learning_rate(learning_rate, name="adam")
    b1 = check.beta(b1, arg="b1", name="adam", tensor=True)
    b2 = check.beta(b2, arg="b2", name="adam", tensor=True)
    eps = check.non_negative(eps, arg="eps", name="adam", tensor=True)
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name="adam", tensor=True)
    txs = [add_decayed_weights(weight_decay)] if not _is_zero(weight_decay) else []
    txs += [scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate)]
    return _alias(txs, OptimizerSpec("adam", learning_rate, weight_decay, b1=b1, b2=b2, eps=eps, core=len(txs) - 2))


@factory
def adamw(
    learning_rate: ScalarOrSchedule,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.01,
    mask: PyTree | Callable[[Params], PyTree] | None = None,
) -> OptimizerChain:
    """AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay.

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay),
    scale_by_learning_rate(learning_rate))``, so the decay is scaled by the
    (scheduled) learning rate but not by Adam's denominator; the decay member
    is left out when ``weight_decay == 0``. With weight decay, ``update`` needs
    ``params``. ``mask`` exempts biases and norms, as optax's ``mask``.

    The default ``weight_decay`` is torch's (0.01); optax's ``adamw`` defaults to 1e-4.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      b1: decay of the first moment; in ``[0, 1)``.
      b2: decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator for stability; ``>= 0``.
      weight_decay: the decoupled decay coefficient; ``>= 0``.
      mask: decay only the leaves where this is True: a tree of bools (or a
        prefix of the params tree) or a function ``params -> mask``, as for
        :func:`gradtx.masked`. ``None`` decays every leaf.

    Every numeric hyperparameter may also be a 0-d tensor (what
    :func:`gradtx.inject_hyperparams` passes), read with no host sync; an alias
    built with tensor hyperparameters, or with a ``mask``, is never fused.

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
    learning_rate = check.learning_rate(learning_rate, name="adamw")
    b1 = check.beta(b1, arg="b1", name="adamw", tensor=True)
    b2 = check.beta(b2, arg="b2", name="adamw", tensor=True)
    eps = check.non_negative(eps, arg="eps", name="adamw", tensor=True)
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name="adamw", tensor=True)
    txs = [scale_by_adam(b1, b2, eps)]
    if not _is_zero(weight_decay):
        txs.append(add_decayed_weights(weight_decay, mask))
    txs.append(scale_by_learning_rate(learning_rate))
    spec = OptimizerSpec("adamw", learning_rate, weight_decay, b1=b1, b2=b2, eps=eps, core=0)
    return _alias(txs, spec if mask is None or _is_zero(weight_decay) else spec._replace(fusable=False))


# --- the aliases' structure ----------------------------------------------------------------


class OptimizerSpec(NamedTuple):
    """An alias's hyperparameters, held once: what a fused kernel needs to apply the whole step.

    Attributes:
      kind: ``"sgd"``, ``"adam"`` or ``"adamw"``.
      learning_rate: a number or a schedule of the step count.
      weight_decay: L2 (sgd, adam) or decoupled (adamw) decay.
      b1, b2, eps: Adam's.
      momentum, nesterov: SGD's.
      core: the member holding the moments (:class:`ScaleByAdamState` or
        :class:`TraceState`) in the alias's state tuple, or ``None`` (plain SGD).
        The last member is always the learning-rate scale.
      fusable: False when the chain does something a fused kernel cannot (a
        weight-decay ``mask``).
    """

    kind: str
    learning_rate: float | torch.Tensor | Schedule
    weight_decay: float | torch.Tensor
    b1: float | torch.Tensor = 0.0
    b2: float | torch.Tensor = 0.0
    eps: float | torch.Tensor = 0.0
    momentum: float | torch.Tensor = 0.0
    nesterov: bool = False
    core: int | None = None
    fusable: bool = True

    def fused_ok(self) -> bool:
        """Whether a fused torch kernel can apply this alias: plain-number hyperparameters, no weight-decay mask."""
        values = (self.learning_rate, self.weight_decay, self.b1, self.b2, self.eps, self.momentum)
        return self.fusable and not any(isinstance(v, torch.Tensor) for v in values)


class OptimizerChain(Chain):
    """What :func:`sgd`, :func:`adam` and :func:`adamw` return: their chain, with its :class:`OptimizerSpec`.

    Its state is the chain's (a tuple of member states). :mod:`gradtx.runtime.executor`
    reads ``spec`` to run a donated step as one fused torch kernel.
    """

    spec: OptimizerSpec

    def __new__(cls, init: Any, update: Any, members: Sequence[GradientTransformation], spec: OptimizerSpec) -> Self:
        self = super().__new__(cls, init, update, members)
        self.spec = spec
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle rebuild it with every field
        return (self.init, self.update, self.members, self.spec)

    def fused_step(
        self, state: OptState, updates: Updates, params: Params, factor: torch.Tensor | None
    ) -> tuple[Callable[[], None], OptState] | None:
        """The :class:`gradtx.core.kinds.FusableOptimizer` kind: ``(launch, new_state)`` for one fused torch kernel, or ``None``.

        ``launch()`` writes the step into ``params`` and the state's moments in
        place, with ``factor`` (or ``None``) applied to ``updates``; ``None``
        comes back when a leaf or the state does not suit the kernel.
        """
        from gradtx.optimizers.fused import launch_for  # the kernels sit beside the optimizers that own their state

        return launch_for(self.spec, state, updates, params, factor)


def _alias(txs: list[GradientTransformation], spec: OptimizerSpec) -> OptimizerChain:
    """``chain(*txs)``, whose pure path lets every member after the first write into the first one's output.

    Every member's output buffers are new and shared with nothing (the first
    member of an alias always computes: members that would be no-ops are left
    out), so after it they belong to this call and later members may take them
    as donated (``inplace=True``): the same numbers with fewer gradient-sized
    buffers per step. The caller's updates, state and params are never written.
    """
    inner = chain(*txs)

    def update_fn(updates, state, params=None, **extra):
        if extra.get("inplace", False) or not isinstance(state, tuple) or len(state) != len(txs) or fe.under_vmap():
            # donated already, or a bad state to report, or vmap (whose batched values are written out of place)
            return inner.update(updates, state, params, **extra)
        new_states = list(state)
        for i, tx in enumerate(txs):
            owned = {**extra, "inplace": True} if i > 0 else extra
            updates, new_states[i] = tx.update(updates, state[i], params, **owned)
            if updates is None:
                break
        return updates, tuple(new_states)

    return kinds.declare_fresh(OptimizerChain(inner.init, update_fn, txs, spec), all(map(kinds.returns_fresh, txs)))
