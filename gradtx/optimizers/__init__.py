"""Optimizers as transforms: scale..., sgd, adam, adamw and friends."""

from gradtx.optimizers.standard import *
from gradtx.optimizers.standard import __all__ as _all

__all__ = list(_all)
