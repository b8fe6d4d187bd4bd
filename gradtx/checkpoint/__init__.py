"""Checkpoints of functional states (torch.save, DCP)."""

from gradtx.checkpoint.functional import *
from gradtx.checkpoint.functional import __all__ as _all

__all__ = list(_all)
