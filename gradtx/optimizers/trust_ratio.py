"""Layer-wise trust ratios: ``scale_by_trust_ratio``, and the ``lars`` and ``lamb`` aliases built on it.

Each param's update is rescaled by ``||param|| / ||update||``. The norms are
per param, of the whole (unsharded) tensor: on DTensor grads they are read
from the placements through the same plan :func:`gradtx.adaptive_clip` uses
(one coalesced all-reduce per sharded mesh dim per step), so every rank scales
its shard by the single-device ratio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import EmptyState, GradientTransformation, Params, PyTree, factory, init_empty_state
from gradtx.distributed import global_norm as inferred
from gradtx.distributed import plan
from gradtx.optimizers.aliases import ScalarOrSchedule, _adam_checked, _checked
from gradtx.optimizers.standard import _scale_by_adam, add_decayed_weights, scale_by_learning_rate, trace
from gradtx.transforms.combine import chain, masked

__all__ = ["lamb", "lars", "scale_by_trust_ratio"]

MaskOrFn = PyTree | Callable[[Params], PyTree] | None


@factory
def scale_by_trust_ratio(
    min_norm: float | torch.Tensor = 0.0,
    trust_coefficient: float | torch.Tensor = 1.0,
    eps: float | torch.Tensor = 0.0,
    *,
    mesh_groups: Any | None = None,
) -> GradientTransformation:
    """Scale each param's update by ``trust_coefficient * ||param|| / (||update|| + eps)``.

    Norms are floored at ``min_norm``; a param or an update of norm zero keeps
    its update unchanged (ratio 1), so zero-initialised params can move. As
    optax's ``scale_by_trust_ratio``. Norms are fp32 (fp64 for fp64 params)
    whatever the dtype.

    Args:
      min_norm: the floor on both norms; ``>= 0``.
      trust_coefficient: multiplies the ratio; ``>= 0``.
      eps: added to the update's norm; ``>= 0``.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (plain tensors
        sharded by hand); ``None`` reads it from DTensor placements, so the norms
        are the unsharded tensors' on every rank.

    Returns:
      A stateless :class:`GradientTransformation`; ``update`` needs ``params``.

    References:
      You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks", 2017.

    Example:
      >>> tx = chain(scale_by_adam(), scale_by_trust_ratio(), scale_by_learning_rate(1e-3))
      >>> updates, state = tx.update(grads, tx.init(params), params)
    """
    name = "scale_by_trust_ratio"
    min_norm = check.non_negative(min_norm, arg="min_norm", name=name, tensor=True)
    trust_coefficient = check.non_negative(trust_coefficient, arg="trust_coefficient", name=name, tensor=True)
    eps = check.non_negative(eps, arg="eps", name=name, tensor=True)
    plan.check_plan(mesh_groups, name=name)
    slot = inferred.PlanSlot()  # the plan read from the updates' placements, this transform's own

    def update_fn(updates, state, params=None, **extra):
        if state is not None:
            tu.require_state(state, EmptyState, name=name)
        if params is None:
            raise ValueError(f"{name}: update() needs params (the weights whose norms set the ratio), got params=None")
        leaves, spec, u_norms, p_norms = inferred.paired_norms(
            updates, params, unitwise=False, mesh_groups=mesh_groups, slot=slot, what=name
        )
        out = []
        for u, u_norm, p_norm in zip(leaves, u_norms, p_norms):
            p_norm = torch.clamp(p_norm, min=lw.as_tensor(min_norm, p_norm))
            u_norm = torch.clamp(u_norm, min=lw.as_tensor(min_norm, u_norm))
            zero = (p_norm == 0) | (u_norm == 0)
            # A zero norm is divided as 1: the ratio is replaced anyway, but its inf would make the backward 0 * inf.
            safe = torch.where(zero, torch.ones_like(u_norm), u_norm)
            ratio = lw.as_tensor(trust_coefficient, p_norm) * p_norm / (safe + lw.as_tensor(eps, u_norm))
            ratio = torch.where(zero, torch.ones_like(ratio), ratio)
            local = tu.local(u)
            out.append(tu.like(u, (local * ratio.to(local.device)).to(local.dtype)))
        return tu.unflatten(spec, out), state

    return plan.reads_tied(GradientTransformation(init_empty_state, update_fn), mesh_groups)


@factory
def lars(
    learning_rate: ScalarOrSchedule,
    weight_decay: float | torch.Tensor = 0.0,
    weight_decay_mask: MaskOrFn = True,
    trust_coefficient: float | torch.Tensor = 0.001,
    eps: float | torch.Tensor = 0.0,
    trust_ratio_mask: MaskOrFn = True,
    momentum: float | torch.Tensor = 0.9,
    nesterov: bool = False,
) -> GradientTransformation:
    """LARS: SGD with momentum whose step for each layer is scaled by its trust ratio.

    ``chain(add_decayed_weights(weight_decay, weight_decay_mask),
    masked(scale_by_trust_ratio(trust_coefficient=..., eps=...), trust_ratio_mask),
    scale_by_learning_rate(learning_rate), trace(momentum, nesterov))``, as
    optax's ``lars`` (whose parameter order and defaults these are). ``update``
    needs ``params``. Exempt biases and norms with the masks.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      weight_decay: L2 decay added to the gradient before the trust ratio; ``>= 0``.
      weight_decay_mask: where to decay (True: everywhere), as for :func:`gradtx.masked`.
      trust_coefficient: multiplies the trust ratio; ``>= 0``.
      eps: added to the update's norm; ``>= 0``.
      trust_ratio_mask: where to apply the trust ratio (True: everywhere).
      momentum: the momentum coefficient; ``>= 0``.
      nesterov: use Nesterov momentum.

    Returns:
      A :class:`GradientTransformation` that runs that chain and has its state.

    References:
      You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks", 2017.

    Example:
      >>> tx = lars(0.1, weight_decay=1e-4)
      >>> updates, state = tx.update(grads, tx.init(params), params)
    """
    learning_rate, weight_decay = _checked("lars", learning_rate, weight_decay)
    trust_coefficient = check.non_negative(trust_coefficient, arg="trust_coefficient", name="lars", tensor=True)
    eps = check.non_negative(eps, arg="eps", name="lars", tensor=True)
    momentum = check.non_negative(momentum, arg="momentum", name="lars", tensor=True)
    nesterov = check.flag(nesterov, arg="nesterov", name="lars")
    # A mask of True covers every leaf: the transform itself, with no masking to trace (or to broadcast).
    trust = scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)
    return chain(
        add_decayed_weights(weight_decay, mask=None if weight_decay_mask is True else weight_decay_mask),
        trust if trust_ratio_mask is True else masked(trust, trust_ratio_mask),
        scale_by_learning_rate(learning_rate),
        trace(decay=momentum, nesterov=nesterov),
    )


@factory
def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-6,
    eps_root: float | torch.Tensor = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """LAMB: Adam with decoupled weight decay, each layer's step scaled by its trust ratio.

    ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
    scale_by_trust_ratio(), scale_by_learning_rate(learning_rate))``, as optax's
    ``lamb`` (whose parameter order and defaults these are; note ``eps=1e-6``).
    ``update`` needs ``params``.

    Args:
      learning_rate: a number ``>= 0`` or a schedule ``count -> learning rate``.
      b1: decay of the first moment; in ``[0, 1)``.
      b2: decay of the second moment; in ``[0, 1)``.
      eps: added to the denominator outside the square root; ``>= 0``.
      eps_root: added to the second moment inside the square root; ``>= 0``.
      weight_decay: the decoupled decay coefficient; ``>= 0``.
      mask: decay only where this is True (a tree of bools or a function of the params).

    Returns:
      A :class:`GradientTransformation` that runs that chain and has its state.

    References:
      You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", 2020.

    Example:
      >>> tx = lamb(1e-3, weight_decay=0.01)
      >>> updates, state = tx.update(grads, tx.init(params), params)
    """
    learning_rate, weight_decay = _checked("lamb", learning_rate, weight_decay)
    b1, b2, eps = _adam_checked("lamb", b1, b2, eps)
    eps_root = check.non_negative(eps_root, arg="eps_root", name="lamb", tensor=True)
    return chain(
        _scale_by_adam(b1, b2, eps, eps_root, name="lamb"),
        add_decayed_weights(weight_decay=weight_decay, mask=mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )
