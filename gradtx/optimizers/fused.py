"""The donated step, :func:`update_and_apply` with ``donate=True``: the functional path's explicit fast path.

A pure step must write new moments, new updates and new params: on a big model those are
fresh gradient-sized buffers every step. A donated step may instead update them in place.
When the chain ends in :func:`gradtx.adamw`, :func:`gradtx.adam` or :func:`gradtx.sgd`, that
is one fused torch kernel (``torch._fused_adamw_`` / ``_fused_adam_`` / ``_fused_sgd_``): it
reads p, g and the moments once and writes p and the moments once, and the factors of the
scalar transforms just before it (the clip coefficient, ``scale``) ride in its ``grad_scale``.
Everything else in the chain is simply run. The user chooses it (``donate=True``), as torch's
users choose ``fused=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, ScalarTransformation, Updates
from gradtx.optimizers.standard import (
    OptimizerChain,
    OptimizerSpec,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
)
from gradtx.transforms.accumulation import Accumulation
from gradtx.transforms.combine import Chain, apply_updates

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# torch.optim's own list of device types with fused optimizer kernels; a guess if it moves.
try:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    _FUSED_DEVICE_TYPES = frozenset(_get_fused_kernels_supported_devices())
except ImportError:  # pragma: no cover
    _FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})


def _fused_groups(
    lists: Sequence[Sequence[torch.Tensor]],
) -> dict[tuple[torch.device, torch.dtype], list[list[Any]]] | None:
    """Group parallel lists of local tensors by (device, dtype) for a fused kernel, or ``None`` if one does not suit it.

    The kernels walk each tensor's memory flat and check neither shapes nor
    layouts, so every tensor of a leaf must have the same dtype, device and
    shape, and be contiguous.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[list[Any]]] = {}
    for ts in zip(*lists):
        p = ts[0]
        if not isinstance(p, torch.Tensor) or p.dtype not in _FUSED_DTYPES or p.device.type not in _FUSED_DEVICE_TYPES:
            return None
        for t in ts:
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != p.dtype
                or t.device != p.device
                or t.shape != p.shape
                or not t.is_contiguous()
            ):
                return None
        group = groups.get((p.device, p.dtype))
        if group is None:
            group = groups[(p.device, p.dtype)] = [[] for _ in ts]
        for column, t in zip(group, ts):
            column.append(t)
    return groups


def launch_for(
    spec: OptimizerSpec, state: OptState, updates: Updates, params: Params, factor: torch.Tensor | None
) -> tuple[Callable[[], None], OptState] | None:
    """The fused kernel launch and the alias's new state, or ``None`` when a leaf or the state does not suit it.

    ``state`` is the optimizer alias's own (its members' states, in the order ``spec`` describes).
    """
    if not isinstance(state, tuple) or not spec.fused_ok():  # tensor hyperparameters, or a masked weight decay
        return None
    core_state = state[spec.core] if spec.core is not None and spec.core < len(state) else None
    if spec.core is not None and not isinstance(core_state, ScaleByAdamState if spec.kind != "sgd" else TraceState):
        return None
    lr_state = state[-1] if state else None
    scheduled = callable(spec.learning_rate)
    if scheduled != isinstance(lr_state, ScaleByScheduleState):
        return None
    g_leaves, g_spec = tu.flatten(updates)
    p_leaves, p_spec = tu.flatten(params)
    if g_spec != p_spec:
        return None
    lists = [[tu.local(t) for t in p_leaves], [tu.local(t) for t in g_leaves]]
    if core_state is not None:
        moments = (core_state.mu, core_state.nu) if isinstance(core_state, ScaleByAdamState) else (core_state.trace,)
        for buffers in moments:
            b_leaves, b_spec = tu.flatten(buffers)
            if b_spec != p_spec:
                return None
            lists.append([tu.local(t) for t in b_leaves])
    groups = _fused_groups(lists)
    if groups is None:
        return None

    lr: Any = spec.learning_rate
    if scheduled:
        value = spec.learning_rate(lr_state.count)  # type: ignore[operator,union-attr]
        lr = value.to(torch.float32) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    count = core_state.count + 1 if isinstance(core_state, ScaleByAdamState) else None

    def launch() -> None:
        for (device, dtype), columns in groups.items():
            kw: dict[str, Any] = {"weight_decay": spec.weight_decay, "maximize": False}
            if factor is not None and dtype == torch.float64:
                # The kernel reads grad_scale as fp32: fp64 grads take the factor in fp64, one pass of their own.
                torch._foreach_mul_(columns[1], factor.to(device, torch.float64))
                kw["grad_scale"] = None
            else:
                # The kernel divides the grads by grad_scale (it unscales AMP grads): the factor goes in inverted.
                kw["grad_scale"] = None if factor is None else torch.reciprocal(factor.to(device, torch.float32))
            kw["lr"] = lr.to(device, non_blocking=True) if isinstance(lr, torch.Tensor) else lr
            if spec.kind == "sgd":
                ps, gs, *bufs = columns
                kw.update(momentum=spec.momentum, dampening=0.0, nesterov=spec.nesterov, is_first_step=False)
                packet = torch.ops.aten._fused_sgd_
                op = packet.tensor_lr if isinstance(lr, torch.Tensor) else packet.default
                op(ps, gs, bufs[0] if bufs else [], **kw)
            else:
                ps, gs, ms, vs = columns
                assert count is not None
                step = count.to(device, torch.float32, non_blocking=True)
                kw.update(beta1=spec.b1, beta2=spec.b2, eps=spec.eps, amsgrad=False)
                packet = torch.ops.aten._fused_adamw_ if spec.kind == "adamw" else torch.ops.aten._fused_adam_
                op = packet.tensor_lr if isinstance(lr, torch.Tensor) else packet.default
                op(ps, gs, ms, vs, [], [step] * len(ps), **kw)

    new_state = list(state)
    if isinstance(core_state, ScaleByAdamState):
        # The moments are the donated buffers: the launch advances them in place.
        assert count is not None  # set together with core_state
        new_state[spec.core] = ScaleByAdamState(count=count, mu=core_state.mu, nu=core_state.nu)  # type: ignore[index]
    if scheduled:
        new_state[-1] = ScaleByScheduleState(count=lr_state.count + 1)  # type: ignore[union-attr]
    return launch, tuple(new_state)


# --- the donated step ----------------------------------------------------------------------------


def _times(u: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    local = tu.local(u)
    dtype = torch.promote_types(local.dtype, torch.float32)
    return tu.like(u, (local.to(dtype) * factor.to(local.device, dtype)).to(local.dtype))


def members(tx: GradientTransformation) -> list[GradientTransformation]:
    """The chain's members, nested chains flattened; an optimizer alias stays whole (it may be the kernel).

    :func:`split_states` and :func:`join_states` take the chain's state apart along the same lines.
    """
    if isinstance(tx, Chain) and not isinstance(tx, OptimizerChain):
        return [m for member in tx.members for m in members(member)]
    return [tx]


def split_states(tx: GradientTransformation, state: OptState, out: list[OptState]) -> list[OptState]:
    if isinstance(tx, Chain) and not isinstance(tx, OptimizerChain):
        for member, member_state in zip(tx.members, tx.member_states(state)):
            split_states(member, member_state, out)
    else:
        out.append(state)
    return out


def join_states(tx: GradientTransformation, states: Iterator[OptState]) -> OptState:
    if isinstance(tx, Chain) and not isinstance(tx, OptimizerChain):
        return tx.join_states([join_states(member, states) for member in tx.members])
    return next(states)


def _add_in_place(params: Params, updates: Updates, factor: torch.Tensor | None) -> None:
    """``params += factor * updates``, in place, through local shards; ``updates`` are owned and may be scaled."""
    index, leaves, _ = tu.align(params, updates, what="updates", against="params")
    all_params = tu.flatten(params)[0]
    p_leaves = [tu.local(all_params[i]) for i in index]  # a None update (no gradient) leaves its param alone
    u_leaves = [tu.local(u) for u in leaves]
    for (device, _), idx in tu.group_by_device_dtype(p_leaves).items():
        ps = [p_leaves[i] for i in idx]
        us = [u_leaves[i] for i in idx]
        if factor is not None:
            torch._foreach_mul_(us, factor.to(device, non_blocking=True))
        torch._foreach_add_(ps, us)


def _store_into(donated: Any, result: Any) -> Any:
    """``result``, with each tensor leaf copied into the donated tensor at its place where one fits.

    The trees are matched from the root down: where their structures differ (an accumulation window
    that closed, say) tuples are matched field by field, and anything else keeps ``result``'s own
    leaves. A leaf fits when the two tensors have the same shape, dtype and device. A donated tensor
    that ``result`` still holds (anywhere) is never written, so no leaf of ``result`` changes value;
    nor is one the donated tree holds at several places (a state whose fields share one zero tensor).
    """
    keep = {id(leaf) for leaf in tu.flatten(result)[0]}
    seen: set[int] = set()
    for leaf in tu.flatten(donated)[0]:
        if id(leaf) in seen:
            keep.add(id(leaf))
        seen.add(id(leaf))

    def store(d: Any, r: Any) -> Any:
        d_leaves, d_spec = tu.flatten(d)
        r_leaves, r_spec = tu.flatten(r)
        if d_spec == r_spec:
            return tu.unflatten(r_spec, [_store_leaf(a, b, keep) for a, b in zip(d_leaves, r_leaves)])
        if isinstance(d, tuple) and type(d) is type(r) and len(d) == len(r):
            parts = [store(a, b) for a, b in zip(d, r)]
            return r._make(parts) if hasattr(r, "_make") else type(r)(parts)
        return r

    return store(donated, result)


def _store_leaf(d: Any, r: Any, keep: set[int]) -> Any:
    if (
        isinstance(d, torch.Tensor)
        and isinstance(r, torch.Tensor)
        and r is not d
        and id(d) not in keep
        and (d.shape, d.dtype, d.device) == (r.shape, r.dtype, r.device)
        and _layout(d) == _layout(r)  # a DTensor keeps its placements: a copy_ across them would redistribute
    ):
        d.copy_(r)
        return d
    return r


def _layout(t: torch.Tensor) -> Any:
    return (t.device_mesh, tuple(t.placements)) if tu.DTensor is not None and isinstance(t, tu.DTensor) else None


def update_and_apply(
    tx: GradientTransformation,
    grads: Updates,
    state: OptState,
    params: Params,
    *,
    donate: bool = False,
    **extra: Any,
) -> tuple[Params, OptState]:
    """One optimizer step: ``tx.update`` then :func:`gradtx.apply_updates`, optionally on donated buffers.

    With ``donate=False`` this is exactly::

        updates, state = tx.update(grads, state, params, **extra)
        params = apply_updates(params, updates)

    and it is pure. With ``donate=True`` the caller hands ``grads``, ``state``
    and ``params`` over to the step, as with ``jax.jit(..., donate_argnums=...)``:
    the step may overwrite them, and the returned params and state share
    their storage. Do not use the inputs afterwards (keep the returned ones).
    When the chain ends in :func:`gradtx.adamw`, :func:`gradtx.adam` or
    :func:`gradtx.sgd` with every leaf fit for torch's fused kernel (params,
    grads and moments of one dtype, contiguous, on a CPU/CUDA/... device: fp32
    or fp64 params, since gradtx keeps fp32 moments for low-precision ones),
    the members before it run as they are, and the optimizer is one
    ``torch._fused_adamw_`` / ``_fused_adam_`` / ``_fused_sgd_`` launch with
    the factors of the scalar transforms just before it (the clip coefficient)
    in its ``grad_scale``: one pass over p, g and the moments. Otherwise the
    updates are computed as the pure step does and added to the params in place.

    Under ``torch.compile`` the donated step is the pure step's arithmetic,
    stored into the donated params and state: inductor writes each result
    straight into its buffer, so nothing gradient-sized is allocated, and it
    compiles with ``fullgraph=True`` (torch's fused kernels are not traced).

    The numbers equal the pure path's to fp32 rounding. The grads' values
    after a donated step are unspecified.

    Args:
      tx: the gradient transformation.
      grads: the gradients, a pytree matching ``params``.
      state: ``tx``'s state.
      params: the parameters, a pytree of tensors.
      donate: hand ``grads``, ``state`` and ``params`` to the step to update in place.
      **extra: forwarded to ``tx.update`` (``tokens=...``, ``flush=...``).

    Returns:
      ``(new_params, new_state)``. With ``donate=True`` they are (or share
      storage with) the donated inputs. When the chain holds (an open
      accumulation window) the params come back unchanged.

    Example:
      >>> tx = chain(clip_by_global_norm(1.0), adamw(3e-4, weight_decay=0.1))
      >>> state = tx.init(params)
      >>> for batch in loader:
      ...     grads = torch.func.grad(loss_fn)(params, batch)
      ...     params, state = update_and_apply(tx, grads, state, params, donate=True)
    """

    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"update_and_apply: tx must be a GradientTransformation, got {type(tx).__name__}")
    donate = check.flag(donate, arg="donate", name="update_and_apply")
    if "inplace" in extra:
        raise TypeError("update_and_apply: inplace is not an extra; donate=True hands the buffers over")
    if not donate:
        updates, new_state = tx.update(grads, state, params, **extra)
        return apply_updates(params, updates), new_state
    if torch.compiler.is_compiling():
        # Traced, the donated step is the pure step stored into the donated buffers: inductor writes each
        # result straight into its buffer (no fresh allocation), and torch's fused kernels are never traced.
        updates, new_state = tx.update(grads, state, params, **extra)
        with torch.no_grad():
            return _store_into((params, state), (apply_updates(params, updates), new_state))
    # A donated step writes its inputs, so it is not differentiable; no_grad also lets it write
    # params that are leaves requiring grad (nn.Parameters), as an optimizer step does.
    with torch.no_grad():
        chain_members = members(tx)
        terminal = chain_members[-1] if isinstance(chain_members[-1], OptimizerChain) else None
        if terminal is None:
            updates, new_state = tx.update(grads, state, params, **extra)
            if updates is not None:
                _add_in_place(params, updates, None)
            return params, new_state
        states = split_states(tx, state, [])
        end = tail = len(chain_members) - 1
        while tail > 0 and isinstance(chain_members[tail - 1], ScalarTransformation):
            tail -= 1
        updates = grads
        for i in range(tail):
            updates, states[i] = chain_members[i].update(updates, states[i], params, **extra)
            if updates is None:  # a member held (an open accumulation window): nothing after it runs
                return params, join_states(tx, iter(states))
            if isinstance(chain_members[i], Accumulation):  # what follows a window sees the window's loss
                extra = chain_members[i].downstream_extra(states[i], extra)
        factor: torch.Tensor | None = None
        for i in range(tail, end):
            f, states[i] = chain_members[i].factor(updates, states[i], params, scale=factor, **extra)  # type: ignore[attr-defined]
            factor = f if factor is None else factor * f.to(factor.device)
        planned = launch_for(terminal.spec, states[end], updates, params, factor)
        if planned is not None:
            launch, states[end] = planned
            launch()
            return params, join_states(tx, iter(states))
        if factor is not None:  # in fp32 at least, as a kernel's grad_scale would be applied
            leaves, spec = tu.flatten(updates)
            updates = tu.unflatten(spec, [_times(u, factor) for u in leaves])
        updates, states[end] = terminal.update(updates, states[end], params, **extra)
        _add_in_place(params, updates, None)
    return params, join_states(tx, iter(states))
