"""Clipping: by value, by global norm, and adaptive (AGC)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradtx.core import foreach as fe
from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import (
    EmptyState,
    GradientTransformation,
    Params,
    ScalarTransformation,
    export_metrics,
    factory,
    init_empty_state,
    scalar_transformation,
)
from gradtx.core.norms import norm_dtype, unitwise_norm  # noqa: F401  (gradtx.unitwise_norm, re-exported from here)
from gradtx.distributed import plan
from gradtx.distributed.global_norm import PlanSlot, paired_norms
from gradtx.transforms.adaptive import global_norm_fn

# --- clip by value ---------------------------------------------------------------------


@factory
def clip(max_delta: float) -> GradientTransformation:
    """Clip every update element to ``[-max_delta, max_delta]``.

    Matches ``torch.nn.utils.clip_grad_value_``.

    Args:
      max_delta: the largest magnitude an element may keep; ``>= 0``.

    Returns:
      A stateless :class:`GradientTransformation`.

    Example:
      >>> tx = clip(0.5)
      >>> tx.update({"w": torch.tensor([-2.0, 0.1])}, tx.init(None))[0]
      {'w': tensor([-0.5000,  0.1000])}
    """
    max_delta = check.non_negative(max_delta, arg="max_delta", name="clip", finite=False)

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, EmptyState, name="clip")  # as every transform: the state init() returned
        leaves, spec = tu.tensor_leaves(updates, what="clip: updates")
        tu.check_placed("clip: updates", updates, range(len(leaves)), leaves)
        # One foreach call: torch groups the leaves by device and dtype itself (and refuses an empty list).
        try:
            clamped = fe.clamp([tu.local(t) for t in leaves], -max_delta, max_delta) if leaves else []
        except NotImplementedError:  # torch's clamp (as clip_grad_value_) refuses complex tensors: name the leaf
            bad = [tu.path_str(path) for path, t in zip(tu.paths(updates), leaves) if t.is_complex()]
            if not bad:
                raise
            raise TypeError(f"clip: updates leaf at {bad[0]} is complex, which has no order to clip by value") from None
        return tu.unflatten(spec, [tu.like(t, c) for t, c in zip(leaves, clamped)]), state

    return GradientTransformation(init_empty_state, update_fn)


# --- clip by global norm -----------------------------------------------------------------


@export_metrics(("grad_norm", "grad_norm"), ("clip_coef", "clip_coef"))
class ClipByGlobalNormState(NamedTuple):
    """The last step's pre-clip global norm and the coefficient applied (fp32, 0-d)."""

    grad_norm: torch.Tensor
    clip_coef: torch.Tensor


@factory
def clip_by_global_norm(
    max_norm: float | torch.Tensor,
    *,
    norm_type: float = 2.0,
    mesh_groups: Any | None = None,
) -> ScalarTransformation:
    """Scale all updates together so that their global norm is at most ``max_norm``.

    The coefficient is ``clamp(max_norm / (norm + 1e-6), max=1)``, exactly as in
    ``torch.nn.utils.clip_grad_norm_``, and is computed as a tensor, with no
    host sync. The norm is accumulated in fp32 whatever the grads' dtype, the
    grads keep their dtype, and the pre-clip norm is kept in the state.

    Args:
      max_norm: the largest global norm allowed; ``> 0`` (``inf`` only measures),
        or a 0-d tensor (what :func:`gradtx.inject_hyperparams` passes).
      norm_type: the order of the norm: any ``p > 0`` or ``inf``.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups`, for what
        placements cannot say: pipeline stages (``pp_group``), weights tied
        across stages, plain tensors sharded by hand. ``None`` (the default)
        reads the plan from DTensor placements (TP, FSDP2, HSDP, EP, and any
        mix), so the norm is the single-device one on every rank; plain
        tensors get torch's semantics: each rank's local norm, no collective
        (right for DDP's replicas; a pipeline stage declares ``pp_group``).

    Returns:
      A :class:`GradientTransformation` with state :class:`ClipByGlobalNormState`.

    References:
      Pascanu, Mikolov & Bengio, "On the difficulty of training recurrent neural networks", 2013.

    Example:
      >>> tx = clip_by_global_norm(1.0)
      >>> updates, state = tx.update(grads, tx.init(params))
      >>> state.grad_norm  # the norm before clipping
    """
    name = "clip_by_global_norm"
    max_norm = check.positive(max_norm, arg="max_norm", name=name, finite=False, tensor=True)
    norm_of = global_norm_fn(name, mesh_groups, norm_type)

    def init_fn(params: Params) -> ClipByGlobalNormState:
        # fp32, or fp64 when a param is: a finite fp64 norm (1e200) must not overflow in the state.
        dtype = norm_dtype([t for t in tu.flatten(params)[0] if isinstance(t, torch.Tensor)])
        return ClipByGlobalNormState(grad_norm=torch.zeros((), dtype=dtype), clip_coef=torch.ones((), dtype=dtype))

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        tu.require_state(state, ClipByGlobalNormState, name=name)
        norm = norm_of(updates, params, scale=scale)  # of the true updates, leaves * scale
        coef = torch.clamp(lw.as_tensor(max_norm, norm) / (norm + 1e-6), max=1.0)
        dtype = state.grad_norm.dtype  # the state keeps one dtype across steps (checkpoints, compiled steps)
        return coef, ClipByGlobalNormState(grad_norm=norm.to(dtype), clip_coef=coef.to(dtype))

    return plan.reads_plan(scalar_transformation(init_fn, factor_fn), mesh_groups)


# --- adaptive gradient clipping ----------------------------------------------------------


def _apply_factor(g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``g * factor`` on the local shard, computed in at least fp32 so a tiny factor does not round away in fp16."""
    g_local = tu.local(g)
    if g_local.dtype.itemsize < 4 and not g_local.is_complex():
        return tu.like(g, (g_local.float() * factor).to(g_local.dtype))
    return tu.like(g, g_local * factor)


@factory
def adaptive_clip(
    clipping: float | torch.Tensor = 0.01, *, eps: float = 1e-3, unitwise: bool = True, mesh_groups: Any | None = None
) -> GradientTransformation:
    """Adaptive gradient clipping (AGC): clip each unit's gradient relative to its weight.

    A unit's gradient ``g_u`` is rescaled to norm ``clipping * max(||w_u||, eps)``
    when it is larger than that. Units follow PyTorch layouts (see
    :func:`unitwise_norm`): dim 0 is the output unit. Optax's default axes
    assume JAX's ``(in, out)`` layout; this does not.

    Args:
      clipping: the largest allowed ratio of gradient norm to weight norm; ``> 0``,
        or a 0-d tensor (what :func:`gradtx.inject_hyperparams` passes).
      eps: the floor on a unit's weight norm, so zero-initialised units can move.
      unitwise: clip per output unit (True) or per whole tensor (False).
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (plain
        tensors sharded by hand); ``None`` reads it from DTensor placements.
        A weight split along dim 0 (``Shard(0)``, colwise TP, FSDP2) has its
        units on one rank and needs nothing; one split along another dim
        (``Shard(1)``, rowwise TP) has units that span ranks, so the partial
        unit sums of squares of grads and weights are all-reduced over those
        groups: one collective per group per step.

    Returns:
      A stateless :class:`GradientTransformation`; ``update`` needs ``params``.

    References:
      Brock, De, Smith & Simonyan, "High-Performance Large-Scale Image Recognition
      Without Normalization", 2021.

    Example:
      >>> tx = adaptive_clip(0.01)
      >>> updates, state = tx.update(grads, tx.init(params), params)
    """
    clipping = check.positive(clipping, arg="clipping", name="adaptive_clip", tensor=True)
    eps = check.non_negative(eps, arg="eps", name="adaptive_clip")
    unitwise = check.flag(unitwise, arg="unitwise", name="adaptive_clip")
    plan.check_plan(mesh_groups, name="adaptive_clip")
    if isinstance(mesh_groups, plan.MeshGroups):
        for i in range(len(mesh_groups)):  # fail now, not mid-training, on a manual shard with no dim
            mesh_groups.unit_groups(i, unitwise=unitwise)
    slot = PlanSlot()

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, EmptyState, name="adaptive_clip")
        if params is None:
            raise ValueError("adaptive_clip: update() needs params (the weights), got params=None")
        # A None update (a param with no gradient) stays None; its weight is not read.
        leaves, spec, g_norms, w_norms = paired_norms(
            updates, params, unitwise=unitwise, mesh_groups=mesh_groups, slot=slot, what="adaptive_clip"
        )
        out = []
        for g, w_norm, g_norm in zip(leaves, w_norms, g_norms):
            limit = clipping.to(w_norm.device) if isinstance(clipping, torch.Tensor) else clipping  # its own dtype
            max_norm = limit * torch.clamp(w_norm, min=eps)
            factor = torch.where(g_norm > max_norm, max_norm / torch.clamp(g_norm, min=1e-6), 1.0)
            out.append(_apply_factor(g, factor))
        return tu.unflatten(spec, out), state

    return plan.reads_plan(GradientTransformation(init_empty_state, update_fn), mesh_groups)
