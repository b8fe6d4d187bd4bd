"""Schedules and inject_hyperparams."""

from gradtx.schedules.builtin import *
from gradtx.schedules.builtin import __all__ as _all

__all__ = list(_all)
