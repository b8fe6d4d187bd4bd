"""The optimizer aliases ``sgd``, ``adam`` and ``adamw``: chains of the building blocks, as in optax.

They match ``torch.optim.SGD``, ``Adam`` and ``AdamW`` numerically (same
hyperparameters, same bias correction), to fp32 rounding. Each is an
:class:`~gradtx.optimizers.standard.OptimizerChain`: the plain chain of its
members, which also says which optimizer it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Params, PyTree, factory
from gradtx.optimizers.standard import (
    OptimizerChain,
    OptimizerSpec,
    Scalar,
    ScalarOrSchedule,
    _is_zero,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)
from gradtx.transforms.combine import chain

__all__ = ["adam", "adamw", "sgd"]


def _checked(name: str, learning_rate: Any, weight_decay: Any) -> tuple[Any, Any]:
    """The learning rate and weight decay every alias takes, checked (the members check the rest)."""
    learning_rate = check.learning_rate(learning_rate, name=name)
    return learning_rate, check.non_negative(weight_decay, arg="weight_decay", name=name, tensor=True)


def _adam_checked(name: str, b1: Any, b2: Any, eps: Any) -> tuple[Any, Any, Any]:
    b1, b2 = (check.beta(b, arg=arg, name=name, tensor=True) for b, arg in ((b1, "b1"), (b2, "b2")))
    return b1, b2, check.non_negative(eps, arg="eps", name=name, tensor=True)


def _alias(txs: list[GradientTransformation], kind: str, *args: Any, **kwargs: Any) -> OptimizerChain:
    inner = chain(*txs)
    return OptimizerChain(inner.init, inner.update, txs, OptimizerSpec(kind, *args, **kwargs))


def _decay(weight_decay: Any, mask: Any = None) -> list[GradientTransformation]:
    """``[add_decayed_weights(weight_decay, mask)]``, or no member when the decay is 0 (a no-op)."""
    return [] if _is_zero(weight_decay) else [add_decayed_weights(weight_decay, mask)]


@factory
def sgd(
    learning_rate: ScalarOrSchedule, momentum: Scalar = 0.0, nesterov: bool = False, weight_decay: Scalar = 0.0
) -> OptimizerChain:
    """Stochastic gradient descent, optionally with (Nesterov) momentum and L2 weight decay, as ``torch.optim.SGD``.

    ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov),
    scale_by_learning_rate(learning_rate))``, leaving out the members that are
    no-ops (``weight_decay == 0``, ``momentum == 0``). With weight decay,
    ``update`` needs ``params``.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      momentum: the momentum coefficient; ``>= 0``.
      nesterov: use Nesterov momentum (needs ``momentum > 0``).
      weight_decay: L2 penalty added to the gradient; ``>= 0``.

    Returns:
      An :class:`OptimizerChain`: that :func:`gradtx.chain`, and its state.

    References:
      Robbins & Monro, "A Stochastic Approximation Method", 1951;
      Sutskever, Martens, Dahl & Hinton, "On the importance of initialization and momentum in deep learning", 2013.

    Example:
      >>> tx = sgd(0.1, momentum=0.9)
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> params = apply_updates(params, updates)
    """
    learning_rate, weight_decay = _checked("sgd", learning_rate, weight_decay)
    momentum = check.non_negative(momentum, arg="momentum", name="sgd", tensor=True)
    nesterov = check.flag(nesterov, arg="nesterov", name="sgd")
    if nesterov and _is_zero(momentum):
        raise ValueError("sgd: nesterov=True needs momentum > 0, got momentum=0.0")
    txs = _decay(weight_decay)
    if not _is_zero(momentum):
        txs.append(trace(momentum, nesterov))
    txs.append(scale_by_learning_rate(learning_rate))
    return _alias(txs, "sgd", learning_rate, weight_decay, momentum=momentum, nesterov=nesterov)


@factory
def adam(
    learning_rate: ScalarOrSchedule,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
) -> OptimizerChain:
    """Adam, as ``torch.optim.Adam``: ``weight_decay`` is an L2 penalty added to the gradient.

    ``chain(add_decayed_weights(weight_decay), scale_by_adam(b1, b2, eps),
    scale_by_learning_rate(learning_rate))``, without the first member when
    ``weight_decay == 0``. With weight decay, ``update`` needs ``params``.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      b1: decay of the first moment; in ``[0, 1)``.
      b2: decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator for stability; ``>= 0``.
      weight_decay: L2 penalty added to the gradient; ``>= 0``.

    Returns:
      An :class:`OptimizerChain`: that :func:`gradtx.chain`, and its state.

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.

    Example:
      >>> tx = adam(1e-3)
      >>> updates, state = tx.update(grads, tx.init(params))
      >>> params = apply_updates(params, updates)
    """
    learning_rate, weight_decay = _checked("adam", learning_rate, weight_decay)
    b1, b2, eps = _adam_checked("adam", b1, b2, eps)
    txs = [*_decay(weight_decay), scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate)]
    return _alias(txs, "adam", learning_rate, weight_decay, b1=b1, b2=b2, eps=eps)


@factory
def adamw(
    learning_rate: ScalarOrSchedule,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.01,
    mask: PyTree | Callable[[Params], PyTree] | None = None,
) -> OptimizerChain:
    """AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay.

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay),
    scale_by_learning_rate(learning_rate))``, so the decay is scaled by the
    (scheduled) learning rate but not by Adam's denominator; the decay member
    is left out when ``weight_decay == 0``. With weight decay, ``update`` needs
    ``params``. ``mask`` exempts biases and norms, as optax's ``mask``.

    The default ``weight_decay`` is torch's (0.01); optax's ``adamw`` defaults to 1e-4.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      b1: decay of the first moment; in ``[0, 1)``.
      b2: decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator for stability; ``>= 0``.
      weight_decay: the decoupled decay coefficient; ``>= 0``.
      mask: decay only the leaves where this is True: a tree of bools (or a
        prefix of the params tree) or a function ``params -> mask``, as for
        :func:`gradtx.masked`. ``None`` decays every leaf.

    Every numeric hyperparameter may also be a 0-d tensor (what
    :func:`gradtx.inject_hyperparams` passes), read with no host sync.

    Returns:
      An :class:`OptimizerChain`: that :func:`gradtx.chain`, and its state.

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019;
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.

    Example:
      >>> tx = adamw(3e-4, weight_decay=0.1)
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> params = apply_updates(params, updates)
    """
    learning_rate, weight_decay = _checked("adamw", learning_rate, weight_decay)
    b1, b2, eps = _adam_checked("adamw", b1, b2, eps)
    txs = [scale_by_adam(b1, b2, eps), *_decay(weight_decay, mask), scale_by_learning_rate(learning_rate)]
    return _alias(txs, "adamw", learning_rate, weight_decay, b1=b1, b2=b2, eps=eps)
