"""Schedules and inject_hyperparams."""

from gradtx.schedules.builtin import *
from gradtx.schedules.builtin import __all__ as _basic
from gradtx.schedules.combined import *
from gradtx.schedules.combined import __all__ as _combined

__all__ = list(_basic) + list(_combined)
