"""Spikes and non-finite values: zero NaNs (:func:`zero_nans`), skip bad steps (:func:`skip_if` with optax's
:func:`skip_not_finite` or :func:`skip_large_updates`), skip statistical outliers (:func:`skip_spikes`).

A skipped step returns zero updates and leaves the inner state exactly as it was (no moment, count or
schedule moves), as :func:`gradtx.apply_if_finite` does. Every decision is a tensor ``torch.where``: no
host sync, no Python branch on a value. Decisions that depend on a norm use the global norm (pass
``mesh_groups=`` for sharded grads), so they are the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, Literal, NamedTuple

import torch

from gradtx.comm.base import Comm, GroupKey, ReduceOp, check_comm
from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Guard, OptState, Params, Updates, export_metrics, factory
from gradtx.distributed import global_norm as inferred
from gradtx.distributed import plan as plans
from gradtx.transforms.adaptive import global_norm_fn
from gradtx.transforms.conditionals import select_step

__all__ = [
    "ShouldSkipUpdateFunction",
    "SkipIfState",
    "SkipSpikesState",
    "ZeroNansState",
    "skip_if",
    "skip_large_updates",
    "skip_not_finite",
    "skip_spikes",
    "zero_nans",
]

ShouldSkipUpdateFunction = Callable[..., tuple[torch.Tensor, Any]]


# --- zero_nans -----------------------------------------------------------------------------


class ZeroNansState(NamedTuple):
    """Per leaf, a 0-d bool: whether the last update of that leaf had a NaN (of its local shard)."""

    found_nan: Any


@factory
def zero_nans() -> GradientTransformation:
    """Replace every NaN in the updates with zero; infinities are kept.

    The state records, per leaf, whether a NaN was found on the last step, so
    it can be logged; the transform itself does not read it.

    Returns:
      A :class:`GradientTransformation` with state :class:`ZeroNansState`.

    References:
      Optax's ``zero_nans``.

    Example:
      >>> tx = zero_nans()
      >>> tx.update({"w": torch.tensor([1.0, float("nan")])}, tx.init({"w": torch.zeros(2)}))[0]
      {'w': tensor([1., 0.])}
    """

    def init_fn(params: Params) -> ZeroNansState:
        tu.tensor_leaves(params, what="zero_nans: params")
        return ZeroNansState(
            found_nan=tu.tree_map(lambda p: torch.zeros((), dtype=torch.bool, device=tu.local(p).device), params)
        )

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, ZeroNansState, name="zero_nans")
        leaves, spec = tu.tensor_leaves(updates, what="zero_nans: updates")
        tu.check_placed("zero_nans: updates", updates, range(len(leaves)), leaves)  # a NaN term makes the sum NaN
        nans = [torch.isnan(tu.local(u)) for u in leaves]
        out = [tu.like(u, torch.where(nan, 0, tu.local(u))) for u, nan in zip(leaves, nans)]
        olds, old_spec = tu.flatten(state.found_nan)
        where = {path: i for i, path in enumerate(tu.paths(state.found_nan))}  # optree's: the same eager and traced
        found: dict[int, torch.Tensor] = {}
        for path, nan in zip(tu.paths(updates), nans):
            if path not in where:
                raise ValueError(
                    f"zero_nans: the update at {tu.path_str(path)} has no param in the state; "
                    "pass the state init() built for this tree"
                )
            found[where[path]] = nan.any()
        # A param with no grad (a None update) found no NaN; the state keeps the params' structure.
        found_nan = [found[i].to(o.device) if i in found else torch.zeros_like(o) for i, o in enumerate(olds)]
        return tu.unflatten(spec, out), ZeroNansState(found_nan=tu.unflatten(old_spec, found_nan))

    return GradientTransformation(init_fn, update_fn)


# --- optax's should_skip_update_fn functions ------------------------------------------------


def skip_not_finite(
    updates: Updates, gradient_step: Any = None, params: Params | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Whether any update is NaN or inf: optax's ``skip_not_finite``, for :func:`skip_if`.

    Args:
      updates: the proposed updates.
      gradient_step: the number of steps applied so far (unused; optax's signature).
      params: the params (unused; optax's signature).

    Returns:
      ``(should_skip, {"should_skip": ..., "num_not_finite": ...})``: a 0-d bool
      and the number of NaN and inf elements (0-d int64, of the local shards).

    References:
      Optax's ``skip_not_finite``.

    Example:
      >>> tx = skip_if(adamw(1e-3), skip_not_finite)
    """
    leaves, _ = tu.tensor_leaves(updates, what="skip_not_finite: updates")
    device = tu.device_of(leaves)
    num = sum(((~torch.isfinite(tu.local(u))).sum().to(device) for u in leaves), lw.zero_count(leaves))
    should_skip = num > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num}


def skip_large_updates(
    updates: Updates,
    gradient_step: Any,
    params: Params | None,
    max_squared_norm: float,
    *,
    mesh_groups: Any = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Whether the squared global norm of the updates is not below ``max_squared_norm``: optax's ``skip_large_updates``.

    A NaN norm also skips. Bind ``max_squared_norm`` with ``functools.partial``
    to get a ``should_skip_update_fn`` for :func:`skip_if`, as in optax.

    Args:
      updates: the proposed updates.
      gradient_step: the number of steps applied so far (unused; optax's signature).
      params: the params (unused; optax's signature).
      max_squared_norm: the largest squared L2 norm accepted (exclusive).
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (pipeline stages, tied weights,
        hand-sharded plain tensors); ``None`` reads the plan from DTensor placements, so the
        norm is the unsharded model's on every rank.

    Returns:
      ``(should_skip, {"should_skip": ..., "norm_squared": ...})`` (0-d bool, 0-d fp32).

    References:
      Optax's ``skip_large_updates``.

    Example:
      >>> tx = skip_if(adamw(1e-3), functools.partial(skip_large_updates, max_squared_norm=100.0))
    """
    fn = "skip_large_updates"
    max_squared_norm = check.number(max_squared_norm, arg="max_squared_norm", name=fn, finite=False, tensor=True)
    norm_sq = global_norm_fn(fn, mesh_groups)(updates, params).square()
    should_skip = ~(norm_sq < max_squared_norm)
    return should_skip, {"should_skip": should_skip, "norm_squared": norm_sq}


# --- skip_if --------------------------------------------------------------------------------


@export_metrics(("total_skipped", "skipped"))
class SkipIfState(NamedTuple):
    """Step counters, the skip function's own output, and the inner state.

    Attributes:
      gradient_step: steps applied so far (int64, 0-d); what the skip function receives.
      skipped: whether the last step was skipped (bool, 0-d).
      total_skipped: skipped steps over the whole run (int64, 0-d).
      skip_state: the second value the skip function returned on the last step.
      inner_state: the wrapped transform's state.
    """

    gradient_step: torch.Tensor
    skipped: torch.Tensor
    total_skipped: torch.Tensor
    skip_state: Any
    inner_state: OptState


def _agree(
    flag: torch.Tensor, updates: Updates, comm: Comm | None, group: GroupKey, params: Any, slot: Any, name: str
) -> torch.Tensor:
    """True on every rank when it is True on any rank: over ``group`` with ``comm``, else over DTensors' meshes (the
    params' too: a rank may lack a grad another holds; see ``planned``)."""
    leaves, spec = tu.flatten(updates)
    full = leaves if comm is not None else inferred.planned(leaves, updates, params, None, name, slot, spec)[0]
    return ~inferred.agree_finite(~flag, full, comm=comm, group=group).to(flag.device)


@factory
def skip_if(
    inner: GradientTransformation,
    should_skip_update_fn: ShouldSkipUpdateFunction,
    *,
    comm: Comm | None = None,
    group: GroupKey = "world",
) -> Guard:
    """Run ``inner``, but skip the step when ``should_skip_update_fn`` says so.

    ``should_skip_update_fn(updates, gradient_step, params)`` returns
    ``(should_skip, skip_state)`` with ``should_skip`` a 0-d bool tensor, the
    signature of optax's ``MultiSteps(..., should_skip_update_fn=...)``; use
    :func:`skip_not_finite` or ``functools.partial(skip_large_updates,
    max_squared_norm=...)``. A skipped step returns zero updates and leaves the
    inner state exactly as it was. The choice is a ``torch.where``: ``inner``
    runs on every step, and no value is read to the host.

    With a ``comm``, the verdict is agreed over ``group`` with one scalar MAX
    reduction: if any rank skips, every rank skips. Decisions computed from a
    global norm (``skip_large_updates`` with ``mesh_groups=``) already agree.

    Put :func:`gradtx.accumulate` before this transform, not inside it.

    Args:
      inner: the transform to guard.
      should_skip_update_fn: ``(updates, gradient_step, params) -> (should_skip, skip_state)``.
      comm: a :class:`gradtx.comm.Comm` to agree on the verdict; ``None`` for one process.
      group: the group over which ranks must agree (usually ``"world"``).

    Returns:
      A :class:`gradtx.Guard` (its verdict is ``state.skipped``, which :class:`gradtx.TransformedOptimizer`
      reads to skip the torch optimizer's step) with state :class:`SkipIfState`.

    References:
      Optax's ``MultiSteps`` ``should_skip_update_fn`` (DeepMind, 2020).

    Example:
      >>> tx = chain(clip_by_global_norm(1.0), skip_if(adamw(1e-3), skip_not_finite))
    """
    check.transform(inner, arg="inner", name="skip_if")
    check.function(should_skip_update_fn, arg="should_skip_update_fn", name="skip_if")
    if comm is not None:
        check_comm(comm, name="skip_if")
    slot = inferred.PlanSlot()  # whether the updates cover the params (see planned)

    def judge(updates: Updates, step: torch.Tensor, params: Params) -> tuple[Any, Any]:
        out = should_skip_update_fn(updates, step, params)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"skip_if: should_skip_update_fn must return (verdict, state), as optax's does; got {type(out).__name__}"
            )
        return out

    def init_fn(params: Params) -> SkipIfState:
        step = lw.zero_count(params)
        # As optax's MultiSteps does: the skip state's structure comes from a call on zero updates.
        _, skip_state = judge(tu.tree_map(torch.zeros_like, params), step, params)
        return SkipIfState(step, step.bool(), step.clone(), skip_state, inner.init(params))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, SkipIfState, name="skip_if")
        verdict, skip_state = judge(updates, state.gradient_step, params)
        if not isinstance(verdict, torch.Tensor) or verdict.dtype != torch.bool or verdict.ndim != 0:
            got = f"{verdict.dtype} {tuple(verdict.shape)}" if isinstance(verdict, torch.Tensor) else type(verdict)
            raise ValueError(f"skip_if: should_skip_update_fn must return a 0-d bool tensor first, got {got}")
        skip = _agree(verdict.to(state.gradient_step.device), updates, comm, group, params, slot, "skip_if")
        accept = ~skip
        out, inner_state = select_step(inner, accept, updates, state.inner_state, params, extra, name="skip_if")
        return out, SkipIfState(
            gradient_step=state.gradient_step + accept.to(torch.int64),
            skipped=skip,
            total_skipped=state.total_skipped + skip.to(torch.int64),
            skip_state=skip_state,
            inner_state=inner_state,
        )

    return Guard(init_fn, update_fn, attrgetter("skipped"))


# --- skip_spikes ----------------------------------------------------------------------------


@export_metrics(("total_skipped", "skipped"), ("zscore", "spike_zscore"))
class SkipSpikesState(NamedTuple):
    """Running statistics of the watched value, skip counters, and the inner state.

    Attributes:
      count: accepted finite values folded into the statistics so far (int64, 0-d).
      mean: the running mean of the watched value (fp32, 0-d).
      var: the running variance (fp32, 0-d).
      value: the last step's watched value: the global grad norm or the loss (fp32, 0-d).
      zscore: the last step's ``(value - mean) / (std + eps)`` against the statistics before it (0 in warm-up).
      skipped: whether the last step was skipped (bool, 0-d).
      consecutive: outliers in a row so far (int64, 0-d).
      total_skipped: skipped steps over the whole run (int64, 0-d).
      inner_state: the wrapped transform's state.
    """

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    mean: torch.Tensor
    var: torch.Tensor
    value: torch.Tensor
    zscore: torch.Tensor
    skipped: torch.Tensor
    consecutive: torch.Tensor
    total_skipped: torch.Tensor
    inner_state: OptState


@factory
def skip_spikes(
    inner: GradientTransformation,
    *,
    z_thresh: float = 6.0,
    alpha: float = 0.98,
    warmup_steps: int = 25,
    metric: Literal["grad_norm", "loss"] = "grad_norm",
    max_consecutive_skips: int | None = 10,
    eps: float = 1e-6,
    norm_type: float = 2.0,
    mesh_groups: Any = None,
    comm: Comm | None = None,
    group: GroupKey = "world",
) -> Guard:
    """Skip a step whose global grad norm (or loss) is an outlier; otherwise run ``inner``.

    The watched value ``x`` is the global ``norm_type``-norm of the updates
    entering this transform, or, with ``metric="loss"``, the loss passed as
    ``update(..., loss=...)``. A step is an outlier when, after the warm-up,
    ``(x - mean) / (std + eps) > z_thresh`` against the statistics of the
    accepted steps before it, or when ``x`` is not finite (at any time). An
    outlier is skipped like :func:`skip_if` skips: zero updates, inner state
    untouched, statistics untouched.

    Statistics: over the first ``warmup_steps`` accepted steps, the exact
    running mean and population variance (Welford); after them, exponential
    moving averages with decay ``alpha``:
    ``mean += (1 - alpha) * d``, ``var = alpha * (var + (1 - alpha) * d**2)``
    with ``d = x - mean``. No step is skipped for size during the warm-up.

    After ``max_consecutive_skips`` outliers in a row, the next finite one is
    accepted and folded into the statistics, so a real shift in level (a new
    data mix, a learning-rate change) cannot stall training; ``None`` never
    forces a step. Non-finite steps are always skipped.

    All ranks decide alike: the grad norm is global (pass ``mesh_groups=`` for
    sharded grads). A loss differs per data-parallel rank, so with
    ``metric="loss"`` pass a ``comm``: the loss is averaged over ``group``
    (one scalar reduction) before it is judged.

    Args:
      inner: the transform to guard (e.g. ``chain(clip_by_global_norm(1.0), adamw(3e-4))``).
      z_thresh: the z-score above which a step is an outlier; ``> 0``.
      alpha: the EMA decay of the statistics after warm-up, in ``(0, 1)``.
      warmup_steps: accepted steps before any step can be skipped for size; ``>= 1``.
      metric: ``"grad_norm"`` or ``"loss"``.
      max_consecutive_skips: outliers in a row after which one is let through; ``None`` for never.
      eps: added to the standard deviation.
      norm_type: the order of the grad norm.
      mesh_groups: a declared plan from :func:`gradtx.mesh_groups` (pipeline stages, tied weights,
        hand-sharded plain tensors); ``None`` reads the plan from DTensor placements, so the
        norm is the unsharded model's on every rank.
      comm: a :class:`gradtx.comm.Comm` to average the loss over (``metric="loss"``).
      group: the group over which ranks must agree.

    Returns:
      A :class:`gradtx.Guard` with state :class:`SkipSpikesState`.

    References:
      Inspired by ZClip (Kumar et al., 2025) and the loss-spike skipping of OLMo and
      Megatron-LM; the statistics are West's exponentially weighted mean and variance (1979).

    Example:
      >>> tx = skip_spikes(chain(clip_by_global_norm(1.0), adamw(3e-4)), z_thresh=6.0, warmup_steps=50)
      >>> updates, state = tx.update(grads, state, params)
    """
    name = "skip_spikes"
    check.transform(inner, arg="inner", name=name)
    z_thresh = check.positive(z_thresh, arg="z_thresh", name=name)
    alpha = check.open_unit(alpha, arg="alpha", name=name)
    warmup_steps = check.integer(warmup_steps, arg="warmup_steps", name=name, minimum=1)
    if metric not in ("grad_norm", "loss"):
        raise ValueError(f"{name}: metric must be 'grad_norm' or 'loss', got {metric!r}")
    if max_consecutive_skips is not None:
        max_consecutive_skips = check.integer(max_consecutive_skips, arg="max_consecutive_skips", name=name, minimum=0)
    eps = check.non_negative(eps, arg="eps", name=name)
    norm_of = global_norm_fn(name, mesh_groups, norm_type)
    if comm is not None:
        check_comm(comm, name=name)
    slot = inferred.PlanSlot()  # whether the updates cover the params (see planned)

    def init_fn(params: Params) -> SkipSpikesState:
        count = lw.zero_count(params)
        # mean, var, value, zscore; then skipped, consecutive, total_skipped. No two alias: dynamo guards an alias.
        z = [count.float() for _ in range(4)]
        return SkipSpikesState(count, z[0], z[1], z[2], z[3], count.bool(), count + 0, count + 0, inner.init(params))

    def watched(updates: Updates, params: Any, extra: dict[str, Any], device: torch.device) -> torch.Tensor:
        if metric == "grad_norm":
            return norm_of(updates, params, device=device)
        loss = extra.get("loss")
        if loss is None:
            raise ValueError(f"{name}(metric='loss'): update() needs the step's loss, as update(..., loss=loss)")
        tu.tensor_leaves(updates, what=f"{name}: updates")  # as the grad norm checks them: dense float tensors
        loss = check.scalar(loss, arg="loss", name=name, dtype=torch.float32, device=device)
        if comm is not None:
            (total,) = comm.all_reduce([loss], ReduceOp.SUM, group)
            loss = total.to(device) / comm.size(group)
        return loss

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, SkipSpikesState, name=name)
        x = watched(updates, params, extra, state.mean.device)
        finite = torch.isfinite(x)
        warm = state.count < warmup_steps
        z = (x - state.mean) / (state.var.sqrt() + eps)
        outlier = ~finite | (~warm & (z > z_thresh))
        if comm is not None or metric == "loss":  # a global grad norm already agrees; a loss may not
            outlier = _agree(outlier, updates, comm, group, params, slot, name)
        consecutive = state.consecutive + 1
        accept = ~outlier
        if max_consecutive_skips is not None:
            accept = accept | (finite & (consecutive > max_consecutive_skips))
        fold = accept & finite

        # Welford during warm-up (exact mean and population variance), EMA after.
        n = (state.count + 1).to(torch.float32)
        d = torch.where(finite, x - state.mean, 0.0)
        mean_w = state.mean + d / n
        var_w = state.var + (d * (torch.where(finite, x, 0.0) - mean_w) - state.var) / n
        mean_e = state.mean + (1 - alpha) * d
        var_e = alpha * (state.var + (1 - alpha) * d * d)
        mean = torch.where(fold, torch.where(warm, mean_w, mean_e), state.mean)
        var = torch.where(fold, torch.where(warm, var_w, var_e), state.var)

        out, inner_state = select_step(inner, accept, updates, state.inner_state, params, extra, name=name)
        skipped = ~accept
        return out, SkipSpikesState(
            count=state.count + fold.to(torch.int64),
            mean=mean,
            var=var,
            value=x,
            zscore=torch.where(warm, 0.0, z),
            skipped=skipped,
            consecutive=torch.where(accept, 0, consecutive),
            total_skipped=state.total_skipped + skipped.to(torch.int64),
            inner_state=inner_state,
        )

    tx = Guard(init_fn, update_fn, attrgetter("skipped"))
    return plans.reads_tied(tx, mesh_groups if metric == "grad_norm" else None)
