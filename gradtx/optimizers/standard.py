"""Optimizers' building blocks as transforms: scale, learning rates and schedules, Adam, weight decay, momentum.

They turn gradients into updates, and :mod:`gradtx.optimizers.aliases` chains
them into ``sgd``, ``adam`` and ``adamw`` the way optax does. An update is what
to *add* to the params (:func:`gradtx.apply_updates` computes ``p + u``), so
the learning-rate scaling is negative.

Moments (Adam's ``mu`` and ``nu``, the momentum trace) are kept in fp32 for
fp16 and bf16 params, and in the param's dtype otherwise; the updates come out
in the dtype the gradients came in. Step counts are 0-d int64 tensors on the
first param's device, so nothing is read back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Self

import torch

from gradtx.core import foreach as fe
from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import (
    EmptyState,
    GradientTransformation,
    Params,
    PyTree,
    ScalarTransformation,
    Schedule,
    _restore,
    factory,
    init_empty_state,
    scalar_transformation,
)
from gradtx.transforms.combine import masked

ScalarOrSchedule = float | torch.Tensor | Schedule
Scalar = float | torch.Tensor  # a 0-d tensor hyperparameter is what gradtx.inject_hyperparams passes

__all__ = [
    "OptimizerChain",
    "OptimizerSpec",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "add_decayed_weights",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "trace",
]


# --- validation and small helpers --------------------------------------------------------


def _on(value: Scalar, device: torch.device, dtype: torch.dtype) -> Scalar:
    """A tensor hyperparameter on ``device``, in ``dtype``, with no sync; a Python number stays one."""
    return value.to(device, dtype, non_blocking=True) if isinstance(value, torch.Tensor) else value


def _scalar(value: Scalar, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (a number, or a tensor already :func:`_on` the group) as a 0-d tensor: a foreach multiply by a
    Python number wraps it in a new tensor for every leaf."""
    return value if isinstance(value, torch.Tensor) else torch.full((), value, dtype=dtype, device=device)


def _is_zero(value: Scalar) -> bool:
    # A tensor hyperparameter may change between steps, so its member is always kept.
    return not isinstance(value, torch.Tensor) and value == 0.0


def _add_scaled(xs: list[torch.Tensor], ys: list[torch.Tensor], value: Scalar) -> list[torch.Tensor]:
    """``xs + value * ys`` by foreach ops, out of place; a tensor ``value`` (already :func:`_on` the group) stays on
    the device."""
    return fe.add(xs, fe.mul(ys, value)) if isinstance(value, torch.Tensor) else fe.add(xs, ys, alpha=value)


# --- scale ---------------------------------------------------------------------------------


@factory
def scale(step_size: Scalar) -> ScalarTransformation:
    """Multiply every update by the scalar ``step_size``.

    A :class:`gradtx.core.base.ScalarTransformation`: its factor is exposed, so a run
    of scalar transforms folds into one multiply (see :mod:`gradtx.wrapper.rules`).

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

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        tu.require_state(state, EmptyState, name=name)
        if isinstance(step_size, torch.Tensor):
            return step_size.to(torch.float64) * sign, state
        return torch.tensor(sign * step_size, dtype=torch.float64), state

    return scalar_transformation(init_empty_state, factor_fn)


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
    check.function(step_size_fn, arg="step_size_fn", name=name)

    def init_fn(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=lw.zero_count(params))

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        tu.require_state(state, ScaleByScheduleState, name=name)
        value = step_size_fn(state.count)
        value = check.number(value, arg="the schedule's value", name=name, finite=False, tensor=True)
        # A schedule should return a tensor computed from the count; a Python number is
        # accepted and becomes a CPU scalar, which scale_leaves moves without a sync.
        # Python numbers become fp64, so fp64 params step by exactly the learning rate given;
        # lower-precision grads take the factor in fp32 (see gradtx.core.tree.scale_leaves).
        if isinstance(value, torch.Tensor):
            factor = value if value.dtype in (torch.float32, torch.float64) else value.to(torch.float32)
        else:
            factor = torch.tensor(float(value), dtype=torch.float64)
        return (-factor if sign < 0 else factor), ScaleByScheduleState(count=state.count + 1)

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


def _debiased(m: list[torch.Tensor], g: list[torch.Tensor], beta: Scalar, t: torch.Tensor, nesterov: bool) -> Any:
    """optax's bias-corrected first moment at step ``t``: ``m / (1 - beta**t)``, or with ``nesterov``
    ``beta m / (1 - beta**(t+1)) + (1 - beta) g / (1 - beta**t)``; foreach ops on local tensors of one dtype."""
    dtype = m[0].dtype
    if not nesterov:
        return fe.div(m, _bias_correction(beta, t).to(dtype))
    b = lw.as_tensor(beta, m[0])
    c1 = (b / _bias_correction(beta, t + 1)).to(dtype)
    return fe.add(fe.mul(m, c1), fe.mul(g, ((1 - b) / _bias_correction(beta, t)).to(dtype)))


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
    return _scale_by_adam(b1, b2, eps)


def _scale_by_adam(
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    eps_root: Scalar = 0.0,
    *,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    name: str = "scale_by_adam",
) -> GradientTransformation:
    """:func:`scale_by_adam` with optax's ``eps_root``, ``nesterov`` and ``mu_dtype`` (Muon's fallback, lamb's).

    With ``eps_root`` or ``nesterov`` the arithmetic is optax's,
    ``m_hat / (sqrt(v_hat + eps_root) + eps)``, ``m_hat`` as :func:`_debiased`;
    otherwise ``torch.optim.Adam``'s.
    """
    optax_form = nesterov or not _is_zero(eps_root)

    def init_fn(params: Params) -> ScaleByAdamState:
        mu = lw.zeros_moments(params, mu_dtype, what=f"{name}: params")
        nu = lw.zeros_like_tree(mu) if mu_dtype is None else lw.zeros_moments(params, what=f"{name}: params")
        return ScaleByAdamState(count=lw.zero_count(params), mu=mu, nu=nu)  # mu_dtype is mu's alone, as optax

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, ScaleByAdamState, name=name)
        ms = lw.Moments(updates, (state.mu, state.nu), name=name, against="its moments")
        count = state.count + 1

        def step(key, idx, g, trees):
            (device, dtype), (mus, nus) = key, trees
            if mu_dtype is not None:  # as optax: mu_dtype only stores the first moment
                g, mus, nus = lw.promoted([tu.local(ms.leaves[j]) for j in idx], mus, nus)
                dtype = g[0].dtype
            if dtype.is_complex:  # pairs of reals, as torch.optim.Adam: the second moment is |re|^2 and |im|^2
                g, mus, nus = ([torch.view_as_real(x) for x in xs] for xs in (g, mus, nus))
            real = mus[0].dtype
            t = count.to(device, tu.acc_dtype(dtype))  # fp64 bias corrections for fp64 params
            m = fe.lerp(mus, g, _on(1 - b1, device, real))
            if isinstance(b2, torch.Tensor):
                v = fe.lerp(nus, fe.mul(g, g), (1 - b2).to(device, real))
            else:  # torch.optim.Adam's own arithmetic
                v = fe.addcmul_(fe.mul(nus, _scalar(b2, device, real)), g, g, value=1 - b2)
            if optax_form:
                bc2 = fe.computed_once(_bias_correction(b2, t).to(real))  # the per-tensor ops below skip fe
                root, outer = _on(eps_root, device, real), _on(eps, device, real)
                m_hat = _debiased(m, g, b1, t, nesterov)
                u = [mh / (torch.sqrt(vi / bc2 + root) + outer) for mh, vi in zip(m_hat, v)]
            else:
                # m / bc1 / (sqrt(v) / sqrt(bc2) + eps), computed as m / (sqrt(v) * (bc1 / sqrt(bc2)) + eps * bc1),
                # in the one new buffer sqrt made (autograd keeps none of what is written into).
                bc1 = _bias_correction(b1, t)
                denom = fe.mul_(fe.sqrt(v), bc1 / torch.sqrt(_bias_correction(b2, t)))
                u = fe.div(m, fe.add_(denom, [bc1 * _on(eps, device, bc1.dtype)] * len(denom)))
            if dtype.is_complex:
                m, v, u = ([torch.view_as_complex(x) for x in xs] for xs in (m, v, u))
            if mu_dtype is not None:
                m, v = [x.to(key[1]) for x in m], [x.to(y.dtype) for x, y in zip(v, trees[1])]
            ms.put(0, idx, m)
            ms.put(1, idx, v)
            ms.put_updates(idx, u)

        ms.each(step)
        return ms.updates(), ScaleByAdamState(count=count, mu=ms.tree(0), nu=ms.tree(1))

    return GradientTransformation(init_fn, update_fn)


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

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, EmptyState, name="add_decayed_weights")
        if params is None:
            hint = ""
            if isinstance(weight_decay, torch.Tensor):  # its value may change (injected): never read on the host
                hint = (
                    "; weight_decay is a tensor (inject_hyperparams injects gtx.adam's and gtx.sgd's default 0 too): "
                    "pass params, or name it in static_args to keep it a fixed number"
                )
            raise ValueError(
                f"add_decayed_weights: update() needs params (the weights to decay), got params=None{hint}"
            )
        ms = lw.Moments(updates, (params,), name="add_decayed_weights", against="the params")
        if _is_zero(weight_decay):
            return updates, state

        def step(key, idx, g, trees):
            ms.put_updates(idx, _add_scaled(g, trees[0], _on(weight_decay, *key)))

        ms.each(step)
        return ms.updates(), state

    return GradientTransformation(init_empty_state, update_fn)


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
        return TraceState(trace=lw.zeros_moments(params, what="trace: params"))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, TraceState, name="trace")
        ms = lw.Moments(updates, (state.trace,), name="trace", against="its momentum")

        def step(key, idx, g, trees):
            d = _on(decay, key[0], key[1])
            tr = fe.add(fe.mul(trees[0], _scalar(d, key[0], key[1])), g)  # torch.optim.SGD's buffer, out of place
            ms.put(0, idx, tr)
            if nesterov:
                ms.put_updates(idx, _add_scaled(g, tr, d))
            else:  # a copy: the updates never share storage with the state
                ms.put_updates(idx, [x.clone() for x in tr])

        ms.each(step)
        return ms.updates(), TraceState(trace=ms.tree(0))

    return GradientTransformation(init_fn, update_fn)


# --- the aliases' structure ----------------------------------------------------------------


class OptimizerSpec(NamedTuple):
    """An optimizer alias's hyperparameters, held once (the wrapper names the alias it refuses by ``kind``).

    Attributes:
      kind: ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"muon"``.
      learning_rate: a number or a schedule of the step count.
      weight_decay: L2 (sgd, adam) or decoupled (adamw, muon) decay.
      b1, b2, eps: Adam's.
      momentum, nesterov: SGD's.
    """

    kind: str
    learning_rate: float | torch.Tensor | Schedule
    weight_decay: float | torch.Tensor
    b1: float | torch.Tensor = 0.0
    b2: float | torch.Tensor = 0.0
    eps: float | torch.Tensor = 0.0
    momentum: float | torch.Tensor = 0.0
    nesterov: bool = False


class OptimizerChain(GradientTransformation):
    """What :func:`gradtx.sgd`, :func:`gradtx.adam` and :func:`gradtx.adamw` return: their chain, and its :class:`OptimizerSpec`.

    It runs as the plain :func:`gradtx.chain` of its ``members``, and its state
    is that chain's (a tuple of member states); :func:`gradtx.inject_hyperparams`
    of an alias returns one too, whose only member is the injected transform
    itself, with its own state. It is not a :class:`gradtx.Chain`
    itself, so code that walks nested chains keeps it whole: ``spec`` says
    which optimizer it is (the wrapper refuses one in its chain by name).
    """

    members: tuple[GradientTransformation, ...]
    spec: OptimizerSpec

    def __new__(cls, init: Any, update: Any, members: Sequence[GradientTransformation], spec: OptimizerSpec) -> Self:
        return _restore(cls, (init, update), {"members": tuple(members), "spec": spec})
