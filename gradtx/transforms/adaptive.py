"""Adaptive clipping thresholds (ZClip, AutoClip), block-RMS clipping, and grad norms by layer.

:func:`zclip` and :func:`autoclip` learn their threshold from the history of
the global grad norm. They need no pass over the grads beyond the global norm
(the same one :func:`gradtx.clip_by_global_norm` takes) and the scaling
itself; their statistics live in the state, as fixed-size tensors, so they are
checkpointable, compile without graph breaks, and, with ``mesh_groups=`` for
sharded grads, identical on every rank.

:func:`clip_by_block_rms` is optax's per-tensor RMS clip, and
:func:`track_norms` records the norm of each parameter (or group of them) for
telemetry, exported through :func:`gradtx.metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch

from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import (
    GradientTransformation,
    Params,
    ScalarTransformation,
    export_metrics,
    factory,
    init_empty_state,
    scalar_transformation,
)
from gradtx.distributed.global_norm import PlanSlot, global_norm_of, leaf_norms_of, planned
from gradtx.distributed.plan import check_plan, reads_tied

__all__ = [
    "AUTOCLIP_DEFAULT_HISTORY",
    "AutoClipState",
    "TrackNormsState",
    "ZClipState",
    "autoclip",
    "clip_by_block_rms",
    "track_norms",
    "zclip",
]


def global_norm_fn(name: str, mesh_groups: Any, norm_type: float = 2.0) -> Callable[..., torch.Tensor]:
    """Check ``norm_type`` and ``mesh_groups`` for the transform ``name``; return ``norm(updates, params, **kwargs)``.

    ``norm`` is the global norm of ``updates`` (:func:`global_norm_of`'s keywords), naming ``name`` on a
    non-tensor leaf, over ``mesh_groups`` or, when it is ``None``, the plan read from the updates'
    placements, which it keeps from one call to the next (each transform its own).
    """
    norm_type = check.norm_type(norm_type, name=name)
    check_plan(mesh_groups, name=name)
    slot = PlanSlot()

    def norm(updates: Any, params: Any, **kwargs: Any) -> torch.Tensor:
        leaves, spec = tu.tensor_leaves(updates, what=f"{name}: updates")
        leaves, tree, _ = planned(leaves, updates, params, mesh_groups, name, slot, spec)
        return global_norm_of(leaves, norm_type, mesh_groups=mesh_groups, what=name, tree=tree, slot=slot, **kwargs)

    return norm


# --- ZClip ---------------------------------------------------------------------------------


@export_metrics(("grad_norm", "grad_norm"), ("clip_coef", "clip_coef"), ("mean", "zclip_mean"))
class ZClipState(NamedTuple):
    """ZClip's statistics and the last step's norm and coefficient.

    Attributes:
      count: finite global norms seen so far (int64, 0-d); warm-up ends when it reaches ``warmup_steps``.
      buffer: the warm-up norms (fp32, ``(warmup_steps,)``); unused after warm-up.
      mean: the EMA of the (clipped) grad norm (fp32, 0-d).
      var: the EMA of its variance (fp32, 0-d).
      grad_norm: the last step's pre-clip global norm (fp32, 0-d).
      clip_coef: the coefficient applied on the last step (fp32, 0-d).
    """

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    buffer: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor
    grad_norm: torch.Tensor
    clip_coef: torch.Tensor


@factory
def zclip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | None = 1.0,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: Literal["zscore", "percentile"] = "zscore",
    clip_option: Literal["adaptive_scaling", "mean"] = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
    *,
    norm_type: float = 2.0,
    mesh_groups: Any = None,
) -> ScalarTransformation:
    """ZClip: clip the global grad norm when it is a z-score outlier against its EMA mean and variance.

    The arguments, defaults and step-by-step behaviour are those of the
    reference package (``zclip`` on PyPI, ``ZClip.step``):

    * **Warm-up.** For the first ``warmup_steps`` steps the norms are collected
      and the grads are clipped to ``max_grad_norm`` as
      ``torch.nn.utils.clip_grad_norm_`` would (not at all when it is ``None``).
      On the last warm-up step the mean and (population) variance of the
      collected norms seed the EMA.
    * **After warm-up**, with ``g`` the global norm, ``mu`` and ``sigma`` the EMA
      mean and standard deviation:

      - ``mode="zscore"``: ``z = (g - mu) / (sigma + eps)``; when ``z > z_thresh``
        the threshold is ``mu + z_thresh * sigma / (z / z_thresh)`` times
        ``clip_factor`` (``clip_option="adaptive_scaling"``), or ``mu``
        (``clip_option="mean"``);
      - ``mode="percentile"``: when ``g > mu + z_thresh * sigma``, that is the threshold.

      The threshold is capped at ``max_grad_norm``; the grads are scaled by
      ``threshold / (g + 1e-6)`` when ``g`` exceeds it. The EMA is then updated
      with the clipped norm (the threshold on a spike, ``g`` otherwise):
      ``mu = alpha * mu + (1 - alpha) * x``, then
      ``var = alpha * var + (1 - alpha) * (x - mu) ** 2`` with the new ``mu``,
      unless ``skip_update_on_spike`` and the step was a spike.

    Two deliberate differences, both about non-finite norms: a NaN or inf norm
    never enters the statistics (the package's would turn NaN for good), and
    it does not count towards warm-up. ``warmup_steps=0`` behaves as 1, as in
    the package. Everything is a tensor op: no host sync, no Python branch.

    Args:
      alpha: the EMA decay, in ``(0, 1)``.
      z_thresh: the z-score threshold; ``> 0``.
      max_grad_norm: an absolute cap on the norm, also the warm-up clip; ``None`` for none.
      eps: added to ``sigma`` in the z-score.
      warmup_steps: steps whose norms seed the statistics.
      mode: ``"zscore"`` or ``"percentile"``.
      clip_option: with ``mode="zscore"``: ``"adaptive_scaling"`` or ``"mean"``.
      clip_factor: multiplies the adaptive-scaling threshold (0.5-0.9 is more aggressive).
      skip_update_on_spike: leave the statistics unchanged on a spike.
      norm_type: the order of the global norm (the package uses 2).
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (pipeline stages, tied weights,
        hand-sharded plain tensors); ``None`` reads the plan from DTensor placements, so the
        norm is the unsharded model's on every rank.

    Returns:
      A :class:`gradtx.ScalarTransformation` (its factor is the clip coefficient, so the executor can
      fold it into a fused optimizer kernel) with state :class:`ZClipState`.

    References:
      Kumar, Owen, Ashary & Ravindran, "ZClip: Adaptive Spike Mitigation for LLM
      Pre-Training", 2025 (arXiv:2504.02507).

    Example:
      >>> tx = chain(zclip(alpha=0.97, z_thresh=2.5), adamw(3e-4))
    """
    name = "zclip"
    alpha = check.open_unit(alpha, arg="alpha", name=name)
    z_thresh = check.positive(z_thresh, arg="z_thresh", name=name)
    if max_grad_norm is not None:
        max_grad_norm = check.positive(max_grad_norm, arg="max_grad_norm", name=name)
    eps = check.non_negative(eps, arg="eps", name=name)
    warmup_steps = check.integer(warmup_steps, arg="warmup_steps", name=name, minimum=0)
    # Case-insensitive, as the package's are.
    mode_ = mode.lower() if isinstance(mode, str) else None
    if mode_ not in ("zscore", "percentile"):
        raise ValueError(f"{name}: mode must be 'zscore' or 'percentile', got {mode!r}")
    option = clip_option.lower() if isinstance(clip_option, str) else None
    if mode_ == "zscore" and option not in ("adaptive_scaling", "mean"):
        raise ValueError(
            f"{name}: clip_option must be 'adaptive_scaling' or 'mean' in zscore mode, got {clip_option!r}"
        )
    clip_factor = check.positive(clip_factor, arg="clip_factor", name=name)
    skip_update_on_spike = check.flag(skip_update_on_spike, arg="skip_update_on_spike", name=name)
    norm_of = global_norm_fn(name, mesh_groups, norm_type)
    window = max(1, warmup_steps)

    def init_fn(params: Params) -> ZClipState:
        count = lw.zero_count(params)
        zero = count.float()  # count, buffer, mean, var, grad_norm, clip_coef
        return ZClipState(count, zero.repeat(window), zero, zero.clone(), zero.clone(), zero + 1)

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        tu.require_state(state, ZClipState, name=name)
        g = norm_of(updates, params, scale=scale, device=state.mean.device)
        finite = torch.isfinite(g)
        ready = state.count >= window  # the EMA was seeded on an earlier step

        # Warm-up: collect, clip to max_grad_norm as clip_grad_norm_ does, seed the EMA on the last one.
        slot = torch.clamp(state.count, max=window - 1).reshape(1)
        buffer = torch.where(finite & ~ready, state.buffer.scatter(0, slot, g.reshape(1)), state.buffer)
        seeds = finite & (state.count + 1 == window)
        seed_mean = buffer.mean()
        seed_var = (buffer - seed_mean).square().mean()
        warm_coef = torch.ones_like(g) if max_grad_norm is None else torch.clamp(max_grad_norm / (g + 1e-6), max=1.0)

        # After warm-up: the adaptive threshold.
        std = state.var.sqrt()
        if mode_ == "percentile":
            threshold = state.mean + z_thresh * std
            spike = g > threshold
        else:
            z = (g - state.mean) / (std + eps)
            spike = z > z_thresh
            if option == "adaptive_scaling":
                threshold = (state.mean + (z_thresh * std) / (z / z_thresh)) * clip_factor
            else:
                threshold = state.mean
        x = torch.where(spike, threshold, g)  # the clipped norm: what the EMA sees
        limit = x if max_grad_norm is None else torch.clamp(x, max=max_grad_norm)
        ready_coef = torch.where(g > limit, limit / (g + 1e-6), 1.0)
        ema_mean = alpha * state.mean + (1 - alpha) * x
        ema_var = alpha * state.var + (1 - alpha) * (x - ema_mean).square()
        moves = ready & finite
        if skip_update_on_spike:
            moves = moves & ~spike
        mean = torch.where(moves, ema_mean, torch.where(seeds, seed_mean, state.mean))
        var = torch.where(moves, ema_var, torch.where(seeds, seed_var, state.var))

        coef = torch.where(ready, ready_coef, warm_coef)
        return coef, ZClipState(state.count + finite.to(torch.int64), buffer, mean, var, g, coef)

    return reads_tied(scalar_transformation(init_fn, factor_fn), mesh_groups)


# --- AutoClip ------------------------------------------------------------------------------

AUTOCLIP_DEFAULT_HISTORY = 10_000
"""The window of :func:`autoclip` with ``history=None``: every norm of the first 10,000 steps, then the latest 10,000."""


@export_metrics(("grad_norm", "grad_norm"), ("clip_coef", "clip_coef"), ("clip_value", "autoclip_value"))
class AutoClipState(NamedTuple):
    """AutoClip's ring buffer of past global norms and the last step's norm and coefficient.

    Attributes:
      norms: the recorded norms (fp32, ``(history,)``), NaN where nothing is recorded yet.
      count: finite norms recorded so far (int64, 0-d); the next goes to slot ``count % history``.
      grad_norm: the last step's pre-clip global norm (fp32, 0-d).
      clip_value: the last step's threshold, the percentile of the recorded norms (fp32, 0-d).
      clip_coef: the coefficient applied on the last step (fp32, 0-d).
    """

    norms: torch.Tensor
    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    grad_norm: torch.Tensor
    clip_value: torch.Tensor
    clip_coef: torch.Tensor


@factory
def autoclip(
    percentile: float = 10.0, history: int | None = None, *, norm_type: float = 2.0, mesh_groups: Any = None
) -> ScalarTransformation:
    """AutoClip: clip the global grad norm at a percentile of the norms seen so far.

    Each step records the global norm (a finite one), then clips to the
    ``percentile``-th percentile of the recorded norms, this step's included,
    with linear interpolation (``numpy.percentile``'s default), exactly as the
    paper's reference code calls ``torch.nn.utils.clip_grad_norm_``: the
    coefficient is ``clamp(clip_value / (norm + 1e-6), max=1)``.

    The norms live in a fixed-size ring buffer, so the state is
    checkpointable and compiles without graph breaks. ``history`` bounds the
    window to the latest ``history`` norms; ``None`` keeps every norm up to
    :data:`AUTOCLIP_DEFAULT_HISTORY` (10,000) steps and then the latest 10,000.
    Each step sorts the buffer on the device (``torch.nanquantile``).

    Args:
      percentile: the percentile, in ``[0, 100]``; the paper recommends 10.
      history: the window length (``>= 1``), or ``None`` (see above).
      norm_type: the order of the global norm.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (pipeline stages, tied weights,
        hand-sharded plain tensors); ``None`` reads the plan from DTensor placements, so the
        norm is the unsharded model's on every rank.

    Returns:
      A :class:`gradtx.ScalarTransformation` with state :class:`AutoClipState`.

    References:
      Seetharaman, Wichern, Pardo & Le Roux, "AutoClip: Adaptive Gradient Clipping
      for Source Separation Networks", 2020.

    Example:
      >>> tx = chain(autoclip(percentile=10, history=1000), adamw(3e-4))
    """
    name = "autoclip"
    percentile = check.within(percentile, lambda v: 0 <= v <= 100, "in [0, 100]", arg="percentile", name=name)
    if history is not None:
        history = check.integer(history, arg="history", name=name, minimum=1)
    size = AUTOCLIP_DEFAULT_HISTORY if history is None else history
    norm_of = global_norm_fn(name, mesh_groups, norm_type)
    q = percentile / 100.0

    def init_fn(params: Params) -> AutoClipState:
        count = lw.zero_count(params)
        zero = count.float()  # norms, count, grad_norm, clip_value, clip_coef
        return AutoClipState(zero.new_full((size,), torch.nan), count, zero, zero.clone(), zero + 1)

    def factor_fn(updates, state, params=None, *, scale=None, **extra):
        tu.require_state(state, AutoClipState, name=name)
        g = norm_of(updates, params, scale=scale, device=state.norms.device)
        finite = torch.isfinite(g)
        slot = torch.remainder(state.count, size).reshape(1)
        recorded = torch.where(finite, state.norms.scatter(0, slot, g.reshape(1)), state.norms)
        # NaN marks an empty slot; nanquantile skips them, so a part-filled buffer is the history so far.
        clip_value = torch.nanquantile(recorded, q, interpolation="linear")
        coef = torch.clamp(clip_value / (g + 1e-6), max=1.0)
        return coef, AutoClipState(recorded, state.count + finite.to(torch.int64), g, clip_value, coef)

    return reads_tied(scalar_transformation(init_fn, factor_fn), mesh_groups)


# --- clip_by_block_rms ---------------------------------------------------------------------


@factory
def clip_by_block_rms(threshold: float, *, mesh_groups: Any = None) -> GradientTransformation:
    """Scale each update tensor so that its root-mean-square is at most ``threshold``.

    Each leaf ``u`` becomes ``u / max(1, rms(u) / threshold)`` with
    ``rms(u) = sqrt(mean(u ** 2))``, accumulated in fp32, as optax's
    ``clip_by_block_rms``.

    Args:
      threshold: the largest RMS a tensor keeps; ``> 0``.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups`; ``None`` reads the plan from
        DTensor placements, so the RMS is the whole tensor's on every rank.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Optax's ``clip_by_block_rms``.

    Example:
      >>> tx = clip_by_block_rms(1.0)
      >>> tx.update({"w": torch.full((4,), 3.0)}, tx.init(None))[0]
      {'w': tensor([1., 1., 1., 1.])}
    """
    name = "clip_by_block_rms"
    threshold = check.positive(threshold, arg="threshold", name=name)
    check_plan(mesh_groups, name=name)
    plans = PlanSlot()  # the plan read from the updates' placements, this transform's own

    def update_fn(updates, state, params=None, **extra):
        leaves, spec = tu.tensor_leaves(updates, what=f"{name}: updates")
        l2 = leaf_norms_of(leaves, spec, mesh_groups=mesh_groups, what=name, tree=updates, slot=plans, params=params)
        out = []
        for u, n in zip(leaves, l2):
            local = tu.local(u)
            rms = n / math.sqrt(u.numel())  # NaN (0 / 0) for an empty tensor
            denom = torch.clamp(rms.to(local.device) / threshold, min=1.0)
            out.append(tu.like(u, (local / denom).to(local.dtype)))
        return tu.unflatten(spec, out), state

    return reads_tied(GradientTransformation(init_empty_state, update_fn), mesh_groups)


# --- norms by layer ------------------------------------------------------------------------


@export_metrics(("norms", "grad_norm_by_layer"))
class TrackNormsState(NamedTuple):
    """The last step's L2 norm of each parameter or group: ``{name: 0-d fp32 tensor}``."""

    norms: dict[str, torch.Tensor]


@factory
def track_norms(group_by: Callable[[str], str] | None = None, *, mesh_groups: Any = None) -> GradientTransformation:
    """Record the L2 norm of each update tensor, or of each group of them, for logging; updates pass unchanged.

    Names are the leaves' dotted paths (``"blocks.0.fc.weight"``), or the
    names ``group_by(path)`` returns (the norm of a group is the L2 norm of
    its members taken together). :func:`gradtx.metrics` exports them as one
    entry, ``"grad_norm_by_layer"``: a dict ready for TensorBoard's
    ``add_scalars``. Place it where you want to measure (before clipping to
    see raw grads). Costs one fp32 norm per tensor; no host sync.

    Args:
      group_by: maps a dotted leaf path to a group name, e.g. ``lambda p: p.rsplit(".", 1)[0]``
        to group a module's weight and bias; ``None`` for one entry per leaf.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (pipeline stages, tied weights,
        hand-sharded plain tensors); ``None`` reads the plan from DTensor placements, so the
        norm is the whole tensor's on every rank.

    Returns:
      A :class:`GradientTransformation` with state :class:`TrackNormsState`.

    Example:
      >>> tx = chain(track_norms(lambda p: p.split(".")[0]), clip_by_global_norm(1.0), adamw(3e-4))
      >>> updates, state = tx.update(grads, state, params)
      >>> writer.add_scalars("grad_norm", metrics(state)["grad_norm_by_layer"], step)
    """
    name = "track_norms"
    if group_by is not None and not callable(group_by):
        raise TypeError(f"{name}: group_by must be callable or None, got {type(group_by).__name__}")
    check_plan(mesh_groups, name=name)
    plans = PlanSlot()  # the plan read from the updates' placements, this transform's own

    def names_of(tree: Any) -> list[str]:
        names = [tu.dotted(p) for p in tu.paths(tree)]
        if group_by is None:
            return names
        out = [group_by(p) for p in names]
        for p, g in zip(names, out):
            if not isinstance(g, str):
                raise TypeError(f"{name}: group_by({p!r}) returned {type(g).__name__}, not a str")
        return out

    def init_fn(params: Params) -> TrackNormsState:
        return TrackNormsState({n: lw.zero_count(params).float() for n in dict.fromkeys(names_of(params))})

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, TrackNormsState, name=name)
        leaves, spec = tu.tensor_leaves(updates, what=f"{name}: updates")
        names = names_of(updates)
        l2 = leaf_norms_of(leaves, spec, mesh_groups=mesh_groups, what=name, tree=updates, slot=plans, params=params)
        grouped: dict[str, list[torch.Tensor]] = {}
        for n, v in zip(names, l2):
            grouped.setdefault(n, []).append(v)
        device = next(iter(state.norms.values())).device if state.norms else torch.device("cpu")
        # fp32 whatever the grads' dtype (fp64 leaves have fp64 norms), so the state's dtypes never change.
        norms = {
            n: (vs[0] if len(vs) == 1 else torch.linalg.vector_norm(torch.stack(vs))).to(device, torch.float32)
            for n, vs in grouped.items()
        }
        unknown = sorted(set(norms) - set(state.norms))
        if unknown:
            raise ValueError(
                f"{name}: the updates have names {unknown[:5]} that the state (built from the params) lacks; "
                "pass the state init() built for this tree"
            )
        # A param with no grad (a None update) reports 0; the state keeps every name init() gave it.
        full = {n: norms[n] if n in norms else torch.zeros_like(v) for n, v in state.norms.items()}
        return updates, TrackNormsState(norms=full)

    return reads_tied(GradientTransformation(init_fn, update_fn), mesh_groups)
