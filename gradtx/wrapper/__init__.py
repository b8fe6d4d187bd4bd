"""The ``torch.optim`` wrapper: :class:`TransformedOptimizer` and its parts.

* :mod:`gradtx.wrapper.optimizer`: the facade, :class:`TransformedOptimizer`.
* :mod:`gradtx.wrapper.grads`: which params the transform sees, their ``.grad`` buffers.
* :mod:`gradtx.wrapper.amp`: ``torch.amp.GradScaler`` across an accumulation window.
* :mod:`gradtx.wrapper.inner`: the inner optimizer's state before its first step, and its step (fused or not).
* :mod:`gradtx.wrapper.state_dict`: the checkpoint format, and the state mirrored in ``optimizer.state``.
* :mod:`gradtx.wrapper.sync`: data-parallel sync (:func:`no_sync`, :func:`sum_grad_reduction`).
* :mod:`gradtx.wrapper.kinds`: what the wrapper reads about the chain's members.
"""

from gradtx.wrapper.optimizer import TransformedOptimizer
from gradtx.wrapper.sync import no_sync, sum_grad_reduction

__all__ = ["TransformedOptimizer", "no_sync", "sum_grad_reduction"]
