"""inject_hyperparams: hyperparameters kept in the state as 0-d tensors, read and changed by name.

``inject_hyperparams(adamw)(learning_rate=schedule, weight_decay=0.1)`` is
``adamw(...)``, except that its numeric hyperparameters live in the state
(``state.hyperparams["weight_decay"]``), where they can be logged
(:func:`gradtx.metrics` exports them by name) and changed between steps, and
any of them may be a schedule of the step count. The inner transform is built
anew on every ``update`` from the tensors in the state, so a changed value is
used on the next step, and under ``torch.compile`` it is a changed tensor input,
not a changed constant: nothing recompiles.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, PyTree, export_metrics, remember
from gradtx.optimizers.standard import OptimizerChain

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]


@export_metrics(("hyperparams", "*"))  # every hyperparameter by its own name: metrics(state)["learning_rate"]
class InjectHyperparamsState(NamedTuple):
    """The step count, the hyperparameters by name, and the inner transform's state.

    Attributes:
      count: the number of updates so far (0-d int64); schedules are called with it.
      hyperparams: ``{name: 0-d tensor}``, every numeric and scheduled
        hyperparameter. A scheduled one holds the value the last update used
        (before the first update, the value it will use). Assign a tensor to
        change a numeric one from the next update on (a scheduled one is
        recomputed and cannot be set).
      inner_state: the inner transform's state.
    """

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    hyperparams: dict[str, torch.Tensor]
    inner_state: OptState


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and value.dtype != torch.bool and not value.is_complex()
    return isinstance(value, numbers.Real) and not check._is_bool(value)


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: torch.dtype | None = None,
) -> Callable[..., GradientTransformation]:
    """Wrap a transform factory so its numeric hyperparameters live in the state, as 0-d tensors.

    The returned callable takes ``inner_factory``'s arguments. A numeric
    argument (a number or a 0-d tensor) becomes a tensor in
    ``state.hyperparams``; a callable becomes a schedule, called with the step
    count (a 0-d int64 tensor, 0 on the first update) before every update,
    whose value is stored there too. Bools, keyword-only arguments
    (``norm_type``, ``eps`` and ``mesh_groups`` of the clips), ``None`` and
    trees (a ``mask``) stay fixed, as do the names in ``static_args``.

    Every update builds ``inner_factory(**hyperparams)`` with the tensors, so
    the factory must accept 0-d tensors for the hyperparameters it is given:
    :func:`gradtx.sgd`, :func:`gradtx.adam`, :func:`gradtx.adamw`,
    :func:`gradtx.scale_by_learning_rate`, :func:`gradtx.scale_by_adam`,
    :func:`gradtx.trace`, :func:`gradtx.add_decayed_weights`,
    :func:`gradtx.clip_by_global_norm` (``max_norm``) and
    :func:`gradtx.adaptive_clip` (``clipping``) do. They read the tensors with
    no host sync, so a compiled step (``torch.compile``) takes a changed value
    as a new input, without recompiling. The values given as Python numbers
    are checked when the wrapper is called (``inject_hyperparams(adamw)(-1.0)``
    raises there); a tensor or a schedule's value is not read to be checked.

    Args:
      inner_factory: a function returning a :class:`GradientTransformation`.
      static_args: names of arguments to keep fixed, even when numeric or
        callable (a callable ``mask=`` must be named here, as in optax).
      hyperparam_dtype: the dtype of floating hyperparameters; fp32 by default
        (fp64 when a param is fp64). Integers are kept as int64.

    Returns:
      A callable with ``inner_factory``'s signature that returns a
      :class:`GradientTransformation` with state :class:`InjectHyperparamsState`.

    References:
      Optax's ``inject_hyperparams`` (DeepMind, 2021).

    Example:
      >>> tx = inject_hyperparams(adamw)(learning_rate=lambda count: 1e-3 * 0.99**count, weight_decay=0.1)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> state.hyperparams["weight_decay"] = torch.tensor(0.0)  # from the next update on
      >>> metrics(state)["learning_rate"]
    """
    check.function(inner_factory, arg="inner_factory", name="inject_hyperparams")
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    unknown = static - set(signature.parameters)
    if unknown:
        raise ValueError(
            f"inject_hyperparams: static_args {sorted(unknown)} are not parameters of "
            f"{getattr(inner_factory, '__name__', inner_factory)!r}: {list(signature.parameters)}"
        )
    check.dtype(hyperparam_dtype, arg="hyperparam_dtype", name="inject_hyperparams", floating=True)
    name = f"inject_hyperparams({getattr(inner_factory, '__name__', 'inner_factory')})"

    @functools.wraps(inner_factory)
    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        fixed: dict[str, Any] = {}
        numeric: dict[str, Any] = {}
        schedules: dict[str, Callable[[torch.Tensor], Any]] = {}
        for arg, value in bound.arguments.items():
            kind = signature.parameters[arg].kind
            if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise TypeError(f"{name}: *args/**kwargs factories are not supported (parameter {arg!r})")
            free = arg not in static and kind is not inspect.Parameter.KEYWORD_ONLY
            if free and callable(value) and not isinstance(value, torch.Tensor):
                schedules[arg] = value
            elif free and _is_number(value):  # not a bool
                numeric[arg] = value
            else:
                fixed[arg] = value
        # Build once with the values as given: bad numbers fail here, with the factory's own message.
        zero = torch.zeros((), dtype=torch.int64)
        probe = inner_factory(
            **fixed, **numeric, **{k: _as_tensor(f(zero), torch.float32, None) for k, f in schedules.items()}
        )

        def float_dtype(tree: PyTree) -> torch.dtype:
            """``hyperparam_dtype``, else fp64 when a leaf is fp64 (or complex128), else fp32."""
            if hyperparam_dtype is not None:
                return hyperparam_dtype
            dtypes = {getattr(t, "dtype", None) for t in tu.flatten(tree)[0]}  # (read on every update: one pass)
            return torch.float64 if dtypes & {torch.float64, torch.complex128} else torch.float32

        def init_fn(params: Params) -> InjectHyperparamsState:
            device = tu.device_of(params)
            dtype = float_dtype(params)
            count = torch.zeros((), dtype=torch.int64, device=device)
            hparams = {k: _as_tensor(v, dtype, device) for k, v in numeric.items()}
            hparams.update({k: _as_tensor(f(count), dtype, device) for k, f in schedules.items()})
            return InjectHyperparamsState(count, hparams, inner_factory(**fixed, **hparams).init(params))

        def update_fn(updates, state, params=None, **extra):
            tu.require_state(state, InjectHyperparamsState, name=name)
            if not isinstance(state.hyperparams, dict) or set(state.hyperparams) != set(numeric) | set(schedules):
                raise ValueError(
                    f"{name}: state.hyperparams must hold {sorted(set(numeric) | set(schedules))}, "
                    f"got {sorted(state.hyperparams) if isinstance(state.hyperparams, dict) else state.hyperparams!r}"
                )
            hparams: dict[str, torch.Tensor] = {}
            dtype = float_dtype(params if params is not None else (updates, state.hyperparams))  # no params: init's too
            for k, given in numeric.items():
                v = state.hyperparams[k]
                if isinstance(v, torch.Tensor):
                    check.scalar_tensor(v, arg=f"state.hyperparams[{k!r}]", name=name)
                elif not _is_number(v):
                    raise TypeError(f"{name}: state.hyperparams[{k!r}] must be a number or a 0-d tensor, got {v!r:.80}")
                # A number or tensor set by hand is welcome, in init's float dtype and device (0 for a float one is
                # 0.0; optax casts to hyperparam_dtype too), but a compiled step would specialise on a number.
                if not isinstance(v, torch.Tensor):
                    v = v if isinstance(given, numbers.Integral) else float(v)
                hparams[k] = _as_tensor(v, dtype, state.count.device)
            for k, f in schedules.items():  # as init stores them (whatever was written there is recomputed)
                hparams[k] = _as_tensor(f(state.count), dtype, state.count.device)
            for k, v in hparams.items() if not torch.is_grad_enabled() else ():  # autograd records no step
                if v.requires_grad:
                    raise ValueError(
                        f"{name}: state.hyperparams[{k!r}] requires grad, but this step runs under torch.no_grad (as "
                        "TransformedOptimizer.step does: it writes into its buffers, which autograd cannot "
                        "differentiate), so no gradient would reach it; take hypergradients through the pure step, "
                        "tx.update(...) then apply_updates(...), with grad enabled"
                    )
            new_updates, inner_state = inner_factory(**fixed, **hparams).update(
                updates, state.inner_state, params, **extra
            )
            if new_updates is None:  # the inner transform held (a window): no step taken, so no schedule advances
                return None, state._replace(inner_state=inner_state)
            return new_updates, InjectHyperparamsState(state.count + 1, hparams, inner_state)

        options = (inner_factory, tuple(sorted(static)), hyperparam_dtype)
        out = GradientTransformation(init_fn, update_fn)
        if isinstance(probe, OptimizerChain):  # an optimizer still: the wrapper refuses it by its spec's name
            out = OptimizerChain(init_fn, update_fn, (out,), probe.spec)
        return remember(out, _injected, (options, args, kwargs), {})

    return wrapped


def _injected(options: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> GradientTransformation:
    """``inject_hyperparams(*options)(*args, **kwargs)``: how an injected transform pickles."""
    return inject_hyperparams(*options)(*args, **kwargs)


def _as_tensor(value: Any, dtype: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
    """A 0-d tensor for a hyperparameter value: floats in ``dtype``, integers as int64; no host sync."""
    # A float never takes an int dtype (a schedule's 1 before, int64 in the state, then 0.5 would be 0).
    floating = dtype if dtype is not None and dtype.is_floating_point else None
    if isinstance(value, torch.Tensor):  # None (device or dtype) keeps the tensor's own
        return value.to(device=device, dtype=floating if value.dtype.is_floating_point else None)
    if isinstance(value, numbers.Integral):
        return torch.tensor(int(value), dtype=torch.int64, device=device)
    value = check.number(value, arg="a hyperparameter or its schedule's value", name="inject_hyperparams", finite=False)
    return torch.tensor(value, dtype=floating or torch.float32, device=device)
