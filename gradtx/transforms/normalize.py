"""Rescaling by the updates' own statistics: ``normalize_by_update_norm`` and ``centralize``."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradtx.comm.base import ReduceOp
from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import (
    EmptyState,
    GradientTransformation,
    ScalarTransformation,
    factory,
    init_empty_state,
    scalar_transformation,
)
from gradtx.distributed import plan
from gradtx.distributed.global_norm import PlanSlot, planned
from gradtx.transforms.adaptive import global_norm_fn

__all__ = ["centralize", "normalize_by_update_norm"]


@factory
def normalize_by_update_norm(
    scale_factor: float | torch.Tensor = 1.0, eps: float | torch.Tensor = 1e-6, *, mesh_groups: Any | None = None
) -> ScalarTransformation:
    """Divide all updates by their global L2 norm: ``g * scale_factor / (||g|| + eps)``.

    The norm is the whole model's, taken as :func:`gradtx.clip_by_global_norm`
    takes it (fp32, from DTensor placements or a declared plan, equal on every
    rank). A scalar transformation, so the executor can fold it with a clip or
    a learning rate. As optax's ``normalize_by_update_norm``.

    Args:
      scale_factor: the global norm of the result (up to ``eps``); a number or a 0-d tensor.
      eps: added to the norm, so zero updates stay zero; ``>= 0``.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (pipeline
        stages, tied weights, plain tensors sharded by hand); ``None`` reads the
        plan from DTensor placements.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Optax's ``normalize_by_update_norm`` (DeepMind, 2024); Hazan, Levy &
      Shalev-Shwartz, "Beyond Convexity: Stochastic Quasi-Convex Optimization", 2015.

    Example:
      >>> tx = chain(normalize_by_update_norm(), scale_by_learning_rate(0.1))
    """
    name = "normalize_by_update_norm"
    scale_factor = check.number(scale_factor, arg="scale_factor", name=name, tensor=True)
    eps = check.non_negative(eps, arg="eps", name=name, tensor=True)
    norm_of = global_norm_fn(name, mesh_groups)

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        if state is not None:
            tu.require_state(state, EmptyState, name=name)
        norm = norm_of(updates, params, scale=scale)  # of the true updates, leaves * scale
        return lw.as_tensor(scale_factor, norm) / (norm + lw.as_tensor(eps, norm)), state

    return plan.reads_tied(scalar_transformation(init_empty_state, factor_fn), mesh_groups)


def _split_rows(x: torch.Tensor, path: str) -> list[int]:
    """The mesh dims of a DTensor that split its rows (dim 0 slices) across ranks: where the row mean needs a sum.

    ``Replicate`` and a split of dim 0 (``Shard(0)``, ``_StridedShard(0)``: FSDP2,
    colwise TP and both together) keep every row whole on one rank; a split of
    another dim (rowwise TP's ``Shard(1)``) cuts each row over that mesh dim.
    """
    if tu.DTensor is None or not isinstance(x, tu.DTensor):
        return []
    out = []
    for d, placement in enumerate(x.placements):
        if placement.is_partial():
            raise ValueError(
                f"centralize: the update at {path} is a DTensor placed {placement!r} (a pending sum) on mesh dim "
                f"{d}; reduce it (redistribute to Replicate or Shard) before centralizing"
            )
        dim = getattr(placement, "dim", None)  # Shard's and _StridedShard's (not a Shard to is_shard())
        if dim is not None and dim % x.ndim != 0:
            out.append(d)
    return out


@factory
def centralize() -> GradientTransformation:
    """Gradient centralization: subtract from each row of a 2-d or larger update its mean.

    For a tensor with more than one dim, the mean over dims ``1..ndim-1`` is
    subtracted, keeping dim 0: in PyTorch layouts (a Linear weight is
    ``(out, in)``, a Conv weight ``(out, in, kh, kw)``) that is each output
    unit's weights, as in the paper. 0-d and 1-d updates pass through. The
    same arithmetic as optax's ``centralize`` on the same array.

    On DTensors, a row whole on one rank (``Replicate``, ``Shard(0)`` and
    ``_StridedShard(0)``: FSDP2, colwise TP, FSDP2 over TP) is centralized where
    it is. A row cut over a mesh dim (rowwise TP's ``Shard(1)``) takes its sum
    over that mesh dim's group: one all-reduce per group for all such leaves,
    on the DTensors' own meshes; given the params, a DTensor param whose update this
    rank lacks (``None``) joins it as zeros. A ``Partial`` update is refused, naming the path.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Yong et al., "Gradient Centralization: A New Optimization Technique for Deep Neural Networks", 2020.

    Example:
      >>> tx = chain(centralize(), sgd(0.1, momentum=0.9))
    """

    slot = PlanSlot()  # whether the updates cover the params (see planned)

    def update_fn(updates, state, params=None, **extra):
        if state is not None:
            tu.require_state(state, EmptyState, name="centralize")
        leaves, spec = tu.tensor_leaves(updates, what="centralize: updates")
        leaves, tree, index = planned(leaves, updates, params, None, "centralize", slot, spec)
        out = list(leaves)
        cut: dict[Any, list[int]] = {}  # process group -> the leaves whose rows it cuts
        sums: dict[int, torch.Tensor] = {}
        for i, (path, g) in enumerate(zip(tu.paths(tree), leaves)):
            if g.ndim <= 1:
                continue
            local, dims = tu.local(g), tuple(range(1, g.ndim))
            mesh_dims = _split_rows(g, tu.path_str(path))
            if not mesh_dims:
                out[i] = tu.like(g, local - local.mean(dim=dims, keepdim=True))
                continue
            sums[i] = local.sum(dim=dims, keepdim=True, dtype=tu.acc_dtype(local.dtype))
            for d in mesh_dims:
                cut.setdefault(g.device_mesh.get_group(d), []).append(i)
        for group, idx in cut.items():  # in leaf order on every rank
            from gradtx.comm.torch_dist import TorchComm  # DTensors whose rows are split: torch.distributed is there

            sums.update(zip(idx, TorchComm().all_reduce([sums[i] for i in idx], ReduceOp.SUM, group)))
        for i, total in sums.items():
            g, local = leaves[i], tu.local(leaves[i])
            out[i] = tu.like(g, local - (total / math.prod(g.shape[1:])).to(local.dtype))
        return tu.unflatten(spec, out if index is None else [out[i] for i in index]), state

    return GradientTransformation(init_empty_state, update_fn)
