"""Checkpoints of functional states (torch.save, DCP)."""

from gradtx.checkpoint.functional import *
from gradtx.checkpoint.functional import __all__ as __all__
