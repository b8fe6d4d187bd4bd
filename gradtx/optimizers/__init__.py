"""Optimizers as transforms: scale..., sgd, adam, adamw and friends."""

from gradtx.optimizers.aliases import *
from gradtx.optimizers.aliases import __all__ as _aliases
from gradtx.optimizers.standard import *
from gradtx.optimizers.standard import __all__ as _blocks

__all__ = list(_blocks) + list(_aliases)
