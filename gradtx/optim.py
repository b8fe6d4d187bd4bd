"""The ``torch.optim`` wrapper's earlier home: its names, re-exported from :mod:`gradtx.wrapper`.

Kept so ``from gradtx.optim import TransformedOptimizer`` works and a wrapper
pickled under this module's name (``gradtx.optim.TransformedOptimizer``) still loads.
"""

# A pickle stores a class by module and name: a wrapper pickled when these lived here names them here.
from gradtx.wrapper.optimizer import TransformedOptimizer, _Live  # noqa: F401
from gradtx.wrapper.sync import no_sync, sum_grad_reduction

__all__ = ["TransformedOptimizer", "no_sync", "sum_grad_reduction"]
