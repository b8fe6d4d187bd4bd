"""Lion: the sign of an interpolated momentum (``scale_by_lion``, and the ``lion`` alias)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Params, PyTree, factory
from gradtx.optimizers.standard import add_decayed_weights, scale_by_learning_rate
from gradtx.transforms.combine import chain

__all__ = ["ScaleByLionState", "lion", "scale_by_lion"]


class ScaleByLionState(NamedTuple):
    """Lion's step count (0-d int64) and momentum (a tree mirroring the params)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    mu: PyTree


@factory
def scale_by_lion(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.99,
    mu_dtype: torch.dtype | None = None,
    *,
    mode: Literal["hard", "smooth", "refined"] = "hard",
    smooth_beta: float = 1.0,
) -> GradientTransformation:
    """Rescale updates by the sign of ``(1 - b1) * g + b1 * m``, then decay ``m`` with ``b2``.

    ``m = b2 * m + (1 - b2) * g`` is updated after the direction is taken, so
    ``b1`` interpolates the direction and ``b2`` the memory. ``mode="smooth"``
    takes ``tanh(smooth_beta * x)`` instead of the sign, and ``"refined"``
    keeps ``|x| < 1`` linear. As optax's ``scale_by_lion``.

    Args:
      b1: the interpolation of the direction; in ``[0, 1)``.
      b2: the decay of the momentum; in ``[0, 1)``.
      mu_dtype: the dtype the momentum is kept in; ``None``: each param's own.
      mode: ``"hard"`` (the sign), ``"smooth"`` or ``"refined"``.
      smooth_beta: the slope of ``tanh`` in ``"smooth"`` mode.

    Returns:
      A :class:`GradientTransformation` with state :class:`ScaleByLionState`.

    References:
      Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.

    Example:
      >>> tx = chain(scale_by_lion(), scale_by_learning_rate(1e-4))
    """
    b1 = check.beta(b1, arg="b1", name="scale_by_lion", tensor=True)
    b2 = check.beta(b2, arg="b2", name="scale_by_lion", tensor=True)
    mu_dtype = check.dtype(mu_dtype, arg="mu_dtype", name="scale_by_lion", floating=True)
    directions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "hard": torch.sgn,  # sign(x), and x / |x| for complex x (optax's lion)
        "smooth": lambda x: torch.tanh(smooth_beta * x),  # the checked smooth_beta below
        "refined": lambda x: torch.where(x.abs() < 1.0, x, torch.sgn(x)),
    }
    if mode not in tuple(directions):
        raise ValueError(f"scale_by_lion: mode must be one of {list(directions)}, got {mode!r}")
    smooth_beta = check.number(smooth_beta, arg="smooth_beta", name="scale_by_lion")
    direction = directions[mode]

    def init_fn(params: Params) -> ScaleByLionState:
        tu.tensor_leaves(params, what="scale_by_lion: params")
        return ScaleByLionState(count=lw.zero_count(params), mu=lw.zeros_like_tree(params, mu_dtype))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, ScaleByLionState, name="scale_by_lion")

        def mix(b: Any, g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            c, dtype = lw.as_tensor(b, m), torch.promote_types(g.dtype, m.dtype)
            return (1.0 - c) * g.to(dtype) + c * m.to(dtype)

        out, (mu,) = lw.lmap_updates(
            lambda g, m: (direction(mix(b1, g, m)).to(g.dtype), mix(b2, g, m).to(m.dtype)),
            updates,
            [state.mu],
            what="scale_by_lion: updates",
            against="the state's momentum",
        )
        return out, ScaleByLionState(count=state.count + 1, mu=mu)

    return GradientTransformation(init_fn, update_fn)


@factory
def lion(
    learning_rate: float | torch.Tensor | Callable[[torch.Tensor], Any],
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.99,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float | torch.Tensor = 1e-3,
    mask: PyTree | Callable[[Params], PyTree] | None = None,
) -> GradientTransformation:
    """The Lion optimizer: ``chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr))``.

    Decoupled weight decay, scaled by the learning rate, as optax's ``lion``
    (whose defaults these are). ``update`` needs ``params``. Lion's updates
    have unit magnitude per element, so its learning rate is usually 3 to 10
    times smaller than AdamW's.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      b1: the interpolation of the direction; in ``[0, 1)``.
      b2: the decay of the momentum; in ``[0, 1)``.
      mu_dtype: the dtype the momentum is kept in; ``None``: each param's own.
      weight_decay: the decoupled decay coefficient; ``>= 0``.
      mask: decay only the leaves where this is True (a tree of bools or a
        function of the params), as for :func:`gradtx.add_decayed_weights`.

    Returns:
      A :class:`GradientTransformation` that runs that chain and has its state.

    References:
      Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.

    Example:
      >>> tx = lion(1e-4, weight_decay=0.1)
      >>> updates, state = tx.update(grads, tx.init(params), params)
    """
    learning_rate = check.learning_rate(learning_rate, name="lion")
    b1 = check.beta(b1, arg="b1", name="lion", tensor=True)
    b2 = check.beta(b2, arg="b2", name="lion", tensor=True)
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name="lion", tensor=True)
    return chain(
        scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
