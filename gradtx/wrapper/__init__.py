"""The ``torch.optim`` wrapper: :class:`TransformedOptimizer` and its parts.

* :mod:`gradtx.wrapper.optimizer`: :class:`TransformedOptimizer`.
* :mod:`gradtx.wrapper.rules`: the chain read by type, and the speed rules.
* :mod:`gradtx.wrapper.grads`: which params the transform sees, their ``.grad`` buffers.
* :mod:`gradtx.wrapper.amp`: ``torch.amp.GradScaler`` across an accumulation window.
* :mod:`gradtx.wrapper.state_dict`: the checkpoint format, ``opt.state``, pickle and deepcopy.
* :mod:`gradtx.wrapper.loop_checks`: what the wrapper refuses (an optimizer in the chain, a per-call scheduler).
* :mod:`gradtx.wrapper.sync`: data-parallel sync (:func:`no_sync`, :func:`sum_grad_reduction`).
"""

from gradtx.wrapper.optimizer import TransformedOptimizer
from gradtx.wrapper.sync import no_sync, sum_grad_reduction

__all__ = ["TransformedOptimizer", "no_sync", "sum_grad_reduction"]
