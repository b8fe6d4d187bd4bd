"""Argument validation for every factory: one place, one wording, numpy scalars welcome.

Each checker takes the value, the argument's name (``arg``) and the factory's
name (``name``), and returns the value as a plain Python ``float``, ``int`` or
``bool``, or raises ``TypeError`` (wrong kind) / ``ValueError`` (out of range)
naming both. numpy scalars (``np.float32(0.1)``, ``np.int64(4)``,
``np.bool_(True)``) are accepted like the Python numbers they stand for.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from gradtx.core.base import GradientTransformation, Schedule


def _is_bool(value: Any) -> bool:
    # numpy.bool_ (named "bool" in numpy 2), recognised without importing numpy
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def scalar_tensor(value: torch.Tensor, *, arg: str, name: str) -> torch.Tensor:
    """A 0-d real (floating or integer, not bool) tensor standing for a hyperparameter, returned as is.

    Its value is not read: reading it would be a host sync on an accelerator and
    a graph break under ``torch.compile``. :func:`gradtx.inject_hyperparams`
    checks the values it is first given as Python numbers. It may require grad:
    the pure ``update`` is differentiable in it (hypergradients); the paths that
    write into donated buffers refuse it.
    """
    if value.ndim != 0:
        raise ValueError(f"{name}: {arg} must be a number or a 0-d tensor, got a tensor of shape {tuple(value.shape)}")
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name}: {arg} must be a real number, got a {value.dtype} tensor")
    return value


def number(value: Any, *, arg: str, name: str, finite: bool = True, tensor: bool = False) -> Any:
    """A real number (not a bool), never NaN; finite unless ``finite=False``.

    With ``tensor=True`` a 0-d tensor is accepted too (see :func:`scalar_tensor`).
    """
    if isinstance(value, torch.Tensor):
        if tensor:
            return scalar_tensor(value, arg=arg, name=name)
        raise TypeError(
            f"{name}: {arg} must be a number, got a tensor (only hyperparameters documented as such take one; "
            f"with inject_hyperparams, give it as a number and name it in static_args=({arg!r},))"
        )
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        value = value[()]  # a 0-d array (np.where's, a schedule's value) is its scalar, as float() takes it
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: {arg} must be a number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name}: {arg} must not be NaN")
    if finite and math.isinf(value):
        raise ValueError(f"{name}: {arg} must be finite, got {value}")
    return value


def within(value: Any, ok: Callable[[float], bool], wanted: str, *, arg: str, name: str, **kw: Any) -> Any:
    """:func:`number`, then ``ok(value)`` or a ValueError saying it must be ``wanted``; a tensor is not read."""
    value = number(value, arg=arg, name=name, **kw)
    if not isinstance(value, torch.Tensor) and not ok(value):
        raise ValueError(f"{name}: {arg} must be {wanted}, got {value}")
    return value


def non_negative(value: Any, *, arg: str, name: str, finite: bool = True, tensor: bool = False) -> Any:
    """A number ``>= 0``."""
    return within(value, lambda v: v >= 0, ">= 0", arg=arg, name=name, finite=finite, tensor=tensor)


def positive(value: Any, *, arg: str, name: str, finite: bool = True, tensor: bool = False) -> Any:
    """A number ``> 0``."""
    return within(value, lambda v: v > 0, "> 0", arg=arg, name=name, finite=finite, tensor=tensor)


def beta(value: Any, *, arg: str, name: str, tensor: bool = False) -> Any:
    """A decay rate in ``[0, 1)``."""
    return within(value, lambda v: 0.0 <= v < 1.0, "in [0, 1)", arg=arg, name=name, tensor=tensor)


def integer(value: Any, *, arg: str, name: str, minimum: int | None = None) -> int:
    """An integer (not a bool), ``>= minimum`` when given."""
    if isinstance(value, torch.Tensor):  # inject_hyperparams made it one: a count shapes the computation
        raise TypeError(f"{name}: {arg} must be an int, got a tensor (with inject_hyperparams, static_args=({arg!r},))")
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {arg} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: {arg} must be >= {minimum}, got {value}")
    return value


def flag(value: Any, *, arg: str, name: str) -> bool:
    """A bool (``True``/``False`` or a numpy bool): never a truthy stand-in such as ``None`` or ``"no"``."""
    if not _is_bool(value):
        raise TypeError(f"{name}: {arg} must be a bool, got {type(value).__name__}")
    return bool(value)


def learning_rate(value: Any, *, name: str, arg: str = "learning_rate") -> float | torch.Tensor | Schedule:
    """A learning rate: a number ``>= 0``, a 0-d tensor, or a schedule (a callable of the step count)."""
    if callable(value) and not isinstance(value, torch.Tensor):
        return value
    return non_negative(value, arg=arg, name=name, tensor=True)


def norm_type(value: Any, *, name: str) -> float:
    """A norm order: a number ``> 0``, or ``inf``."""
    return within(value, lambda v: v > 0, "> 0 or inf", arg="norm_type", name=name, finite=False)


def dtype(value: Any, *, arg: str, name: str, floating: bool = False) -> torch.dtype | None:
    """A ``torch.dtype`` (a floating one with ``floating=True``) or ``None``."""
    if value is not None and not (isinstance(value, torch.dtype) and (value.is_floating_point or not floating)):
        kind = "a floating torch.dtype" if floating else "a torch.dtype"
        raise TypeError(f"{name}: {arg} must be {kind} or None, got {value!r}")
    return value


def transform(value: Any, *, arg: str, name: str) -> GradientTransformation:
    """A :class:`GradientTransformation` (an inner transform, an optimizer to wrap)."""
    if not isinstance(value, GradientTransformation):
        raise TypeError(f"{name}: {arg} must be a GradientTransformation, got {type(value).__name__}")
    return value


def function(value: Any, *, arg: str, name: str) -> Any:
    """A callable."""
    if not callable(value):
        raise TypeError(f"{name}: {arg} must be callable, got {type(value).__name__}")
    return value


def open_unit(value: Any, *, arg: str, name: str) -> float:
    """A number in ``(0, 1)`` (an EMA decay or a reduction factor that must move)."""
    return within(value, lambda v: 0.0 < v < 1.0, "in (0, 1)", arg=arg, name=name)


def scalar(value: Any, *, arg: str, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A monitored value (a loss): a number or a one-element tensor, as a detached 0-d tensor of ``dtype`` on ``device``."""
    if isinstance(value, numbers.Real) and math.isnan(value):  # data, as in a tensor (loss.item(), a numpy float32)
        return torch.tensor(value, dtype=dtype, device=device)
    if not isinstance(value, torch.Tensor):
        return torch.tensor(number(value, arg=arg, name=name, finite=False), dtype=dtype, device=device)
    if value.numel() != 1:
        raise ValueError(f"{name}: {arg} must be a scalar, got a tensor of shape {tuple(value.shape)}")
    return value.detach().reshape(()).to(device, dtype)
