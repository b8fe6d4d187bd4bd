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
from typing import Any

from gradtx.base import Schedule


def _is_bool(value: Any) -> bool:
    # numpy.bool_ (named "bool" in numpy 2), recognised without importing numpy
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def number(value: Any, *, arg: str, name: str, finite: bool = True) -> float:
    """A real number (not a bool), never NaN; finite unless ``finite=False``."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: {arg} must be a number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name}: {arg} must not be NaN")
    if finite and math.isinf(value):
        raise ValueError(f"{name}: {arg} must be finite, got {value}")
    return value


def non_negative(value: Any, *, arg: str, name: str, finite: bool = True) -> float:
    """A number ``>= 0``."""
    value = number(value, arg=arg, name=name, finite=finite)
    if value < 0:
        raise ValueError(f"{name}: {arg} must be >= 0, got {value}")
    return value


def positive(value: Any, *, arg: str, name: str, finite: bool = True) -> float:
    """A number ``> 0``."""
    value = number(value, arg=arg, name=name, finite=finite)
    if value <= 0:
        raise ValueError(f"{name}: {arg} must be > 0, got {value}")
    return value


def beta(value: Any, *, arg: str, name: str) -> float:
    """A decay rate in ``[0, 1)``."""
    value = number(value, arg=arg, name=name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: {arg} must be in [0, 1), got {value}")
    return value


def integer(value: Any, *, arg: str, name: str, minimum: int | None = None) -> int:
    """An integer (not a bool), ``>= minimum`` when given."""
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


def learning_rate(value: Any, *, name: str) -> float | Schedule:
    """A learning rate: a number ``>= 0``, or a schedule (a callable of the step count)."""
    if callable(value):
        return value
    return non_negative(value, arg="learning_rate", name=name)


def norm_type(value: Any, *, name: str) -> float:
    """A norm order: a number ``> 0``, or ``inf``."""
    value = number(value, arg="norm_type", name=name, finite=False)
    if value <= 0:
        raise ValueError(f"{name}: norm_type must be > 0 or inf, got {value}")
    return value
