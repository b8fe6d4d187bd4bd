"""The step executor: one plan, read once from a chain's structure, runs every owned-buffer step.

A transform is plain ``init``/``update``. Running a chain member by member is
always correct, and it is what a pure ``tx.update`` does. When the caller owns
its buffers, more is possible, and this module is where it happens. It knows
the members only by the kinds they declare (:mod:`gradtx.core.kinds`):

* :class:`gradtx.TransformedOptimizer` owns ``p.grad``, and autograd is its
  accumulator: a leading window (:func:`gradtx.accumulate`, a
  :class:`~gradtx.core.kinds.Windowed`) only counts, keeps no buffer, and its ``1/k``
  is not applied yet;
* :func:`update_and_apply` with ``donate=True`` owns the grads, the state and
  the params, as ``jax.jit(donate_argnums=...)`` would.

:class:`StepPlan` reads the chain once (nested chains flattened):

1. an optional leading window (a :class:`~gradtx.core.kinds.Windowed`);
2. the body: members run in order on the owned buffers (``inplace=True``);
3. the scalar tail: the trailing run of
   :class:`~gradtx.core.kinds.ScalarFactor` s (the clip coefficient, a
   learning rate, ``scale``), whose factors are multiplied together with the
   window's normaliser instead of each costing a pass over memory;
4. the terminal kernel: for a donated step, a trailing gradtx optimizer
   (a :class:`~gradtx.core.kinds.FusableOptimizer`) applied in one fused torch
   kernel, with the pending factor as its ``grad_scale``. The wrapper's
   terminal is the inner torch optimizer, given the same factor.

A pending factor is applied (one in-place multiply) before any body member,
since a member that is not scalar must see the true updates.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeGuard

import torch

from gradtx.core import kinds
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params, Updates
from gradtx.transforms.combine import Chain, apply_updates, tie_order

__all__ = ["StepPlan", "StepResult", "update_and_apply"]

_RESERVED = ("inplace",)


class StepResult(NamedTuple):
    """What one owned-buffer step produced.

    Attributes:
      updates: the updates, written into the owned buffers where possible; ``None``
        when the step held (an open accumulation window, or a window with no tokens).
      state: the new state of the whole chain.
      factor: a 0-d fp32 factor the caller must still apply to ``updates``
        (``grad_scale = 1 / factor`` for a fused kernel), or ``None``.
      skip: a 0-d bool tensor, True when a guard (:func:`gradtx.apply_if_finite`)
        vetoed the step, or ``None`` when the chain has no guard.
    """

    updates: Updates | None
    state: OptState
    factor: torch.Tensor | None
    skip: torch.Tensor | None


def _expands(tx: GradientTransformation) -> TypeGuard[Chain]:
    # An optimizer alias stays whole: it may be the terminal kernel, and its members are its business.
    # (Read through the protocol's method, not isinstance on the runtime Protocol: this runs every step.)
    return isinstance(tx, Chain) and not callable(getattr(tx, "fused_step", None))


def _leaf_members(tx: GradientTransformation) -> list[GradientTransformation]:
    if _expands(tx):
        return [m for member in tx.members for m in _leaf_members(member)]
    return [tx]


def _split(tx: GradientTransformation, state: OptState) -> list[OptState]:
    """The states of ``tx``'s leaf members, in order (validated like the chain's own ``update``)."""
    if not _expands(tx):
        return [state]
    out: list[OptState] = []
    for member, member_state in zip(tx.members, tx.member_states(state)):
        out += _split(member, member_state)
    return out


def _join(tx: GradientTransformation, states: Any) -> OptState:
    """Inverse of :func:`_split`: ``states`` is an iterator over leaf-member states."""
    if not _expands(tx):
        return next(states)
    return tx.join_states([_join(member, states) for member in tx.members])


class StepPlan:
    """The structure of a chain, read once: window, body, scalar tail, terminal kernel.

    Build it with :meth:`of` (kept on the transform). Transforms know nothing of
    it; it relies only on the chain's structure (:class:`~gradtx.transforms.combine.Chain`) and on the
    kinds its members declare (:mod:`gradtx.core.kinds`).

    Attributes:
      tx: the planned transform.
      members: its leaf members (nested chains flattened), in order.
      window: the leading :class:`~gradtx.core.kinds.Windowed` member, or ``None``.
      tail_start: index of the first member of the trailing scalar run.
      terminal: a trailing optimizer alias a donated step may fuse, or ``None``.
    """

    def __init__(self, tx: GradientTransformation) -> None:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"StepPlan: tx must be a GradientTransformation, got {type(tx).__name__}")
        tie_order([tx], name="StepPlan")  # a lone transform reading tied weights no pp_reduce summed
        self.tx = tx
        self.members = _leaf_members(tx)
        first = self.members[0] if self.members else None
        self.window: Any = first if isinstance(first, kinds.Windowed) else None
        self.late_accumulation = [i for i, m in enumerate(self.members) if i > 0 and isinstance(m, kinds.Windowed)]
        last = self.members[-1] if self.members else None
        self.terminal: Any = last if isinstance(last, kinds.FusableOptimizer) else None
        end = len(self.members) - (self.terminal is not None)
        start = 1 if self.window is not None else 0
        self.scalar = [isinstance(m, kinds.ScalarFactor) for m in self.members]
        tail = end
        while tail > start and self.scalar[tail - 1]:
            tail -= 1
        self.body_start, self.tail_start, self.body_end = start, tail, end
        self.fresh = [kinds.returns_fresh(m) for m in self.members]
        self.guard = [isinstance(m, kinds.Verdict) for m in self.members]
        self.hands_on = [isinstance(m, kinds.DownstreamExtra) for m in self.members]

    @staticmethod
    def of(tx: GradientTransformation) -> StepPlan:
        """The plan of ``tx``, built once per transform object and kept on it (it lives as long as ``tx``)."""
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"StepPlan: tx must be a GradientTransformation, got {type(tx).__name__}")
        return tx.memo("step_plan", StepPlan)

    def __repr__(self) -> str:
        def name(m: GradientTransformation) -> str:
            return type(m).__name__

        parts = [f"window(k={self.window.k})"] if self.window is not None else []
        parts += [name(m) for m in self.members[self.body_start : self.tail_start]]
        parts += [f"scalar:{name(m)}" for m in self.members[self.tail_start : self.body_end]]
        if self.terminal is not None:
            parts.append(f"terminal:{name(self.terminal)}")
        return f"StepPlan({', '.join(parts)})"

    # --- the window, read on the host ---------------------------------------------------------

    def window_state(self, state: OptState) -> OptState | None:
        """The leading window's state inside the chain's ``state``, or ``None`` without a window."""
        return _split(self.tx, state)[0] if self.window is not None else None

    def emits_next(self, state: OptState, *, flush: bool = False) -> bool:
        """Whether the next step closes the window (always True without one). Reads host counters only."""
        ws = self.window_state(state)
        return True if ws is None or self.window is None else self.window.emits_next(ws, flush=flush)

    def window_open(self, state: OptState) -> bool:
        """Whether the leading window has counted micro-steps it has not emitted yet."""
        ws = self.window_state(state)
        return ws is not None and self.window is not None and self.window.is_open(ws)

    # --- running --------------------------------------------------------------------------------

    def run_owned(
        self,
        grads: Updates,
        state: OptState,
        params: Params | None,
        *,
        autograd_buffer: bool,
        inv_scale: torch.Tensor | None = None,
        run_terminal: bool = True,
        **extra: Any,
    ) -> StepResult:
        """Run one step on buffers the caller owns (they are overwritten), leaving a pending factor.

        Args:
          grads: the owned gradient buffers (a tree like the params).
          state: the chain's state; not modified (a new one is returned).
          params: the params, read by members that need them.
          autograd_buffer: ``grads`` already hold the window's running sum
            (autograd summed the micro-batches into ``.grad``), so the leading
            window only counts; its members read no grads on a held step.
          inv_scale: a factor the grads still carry (``1 / loss_scale`` of AMP),
            folded in first, so every member sees unscaled grads.
          run_terminal: run a trailing optimizer alias too; ``False`` leaves it
            (and its state) to the caller's fused kernel.
          **extra: forwarded to every member (``tokens=``, ``flush=``).

        Returns:
          A :class:`StepResult`.
        """
        reserved = [k for k in _RESERVED if k in extra]
        if reserved:
            raise TypeError(f"{reserved} are set by the executor itself; do not pass them")
        if autograd_buffer and self.late_accumulation:
            # Autograd's running sum is the sum of micro-batch grads only before any transform
            # touches it; a transform ahead of the window would act on partial sums every micro-step.
            raise ValueError(
                f"chain: member {self.late_accumulation[0]} accumulates, but autograd sums the micro-batches into "
                ".grad (TransformedOptimizer), so accumulate() must be the first transform of the chain"
            )
        states = _split(self.tx, state)
        pending = inv_scale
        updates = grads
        if self.window is not None:
            window = self.window
            tokens, flush = extra.get("tokens"), bool(extra.get("flush", False))
            # A loss reaches the window only when given, so a user's window need not take one.
            loss_kw = {"loss": extra["loss"]} if extra.get("loss") is not None else {}
            if autograd_buffer:
                leaves, spec = tu.flatten(grads)
                device = tu.local(leaves[0]).device if leaves else None
                closing, states[0] = window.count_step(
                    states[0], tokens=tokens, flush=flush, device=device, **loss_kw
                )
                if closing is None:
                    return StepResult(None, _join(self.tx, iter(states)), None, None)
                updates = tu.unflatten(spec, window.reduce(leaves))
                factor = closing
            else:
                total, factor, states[0] = window.sum_window(
                    grads, states[0], params, tokens=tokens, flush=flush, **loss_kw
                )
                if total is None:
                    return StepResult(None, _join(self.tx, iter(states)), None, None)
                updates = _cast_like(total, grads, factor)
                if updates is not total:
                    factor = None  # applied in fp32, before rounding to the grads' dtype
            if factor is not None:
                pending = factor if pending is None else pending * factor.to(pending.device)
            if self.hands_on[0]:  # a window that emitted hands its reduced loss to what follows
                extra = window.downstream_extra(states[0], extra)

        skip: torch.Tensor | None = None
        end = self.body_end if not run_terminal or self.terminal is None else len(self.members)
        for i in range(self.body_start, end):
            member = self.members[i]
            if self.scalar[i] and self.tail_start <= i < self.body_end:
                f, states[i] = member.factor(updates, states[i], params, scale=pending, **extra)  # type: ignore[attr-defined]
                pending = f if pending is None else pending * f.to(pending.device)
                if self.hands_on[i]:
                    extra = member.downstream_extra(states[i], extra)  # type: ignore[attr-defined]
                continue
            if pending is not None:
                updates = _scale_owned(updates, pending)
                pending = None
            old_state, given = states[i], updates
            updates, states[i] = member.update(updates, old_state, params, inplace=True, **extra)
            if updates is None:  # a member held: nothing after it runs or changes
                return StepResult(None, _join(self.tx, iter(states)), None, None)
            if not self.fresh[i]:  # what it returned may be its state's tensors: copy those before writing
                updates = kinds.owned_updates(updates, kinds.held_storages(states[i], old_state, params, given))
            if self.guard[i]:
                vetoed = member.verdict(states[i])  # type: ignore[attr-defined]
                skip = vetoed if skip is None else skip | vetoed.to(skip.device)
            if self.hands_on[i]:  # what the members after it see
                extra = member.downstream_extra(states[i], extra)  # type: ignore[attr-defined]
        return StepResult(updates, _join(self.tx, iter(states)), pending, skip)


def _scale_owned(updates: Updates, factor: torch.Tensor) -> Updates:
    leaves, spec = tu.flatten(updates)
    tu.check_tensors(leaves, tree=updates, what="updates")
    return tu.unflatten(spec, tu.scale_leaves(leaves, factor, inplace=True))


def _cast_like(total: Updates, grads: Updates, factor: torch.Tensor) -> Updates:
    """The fp32 window sum as updates: kept as is when the grads are fp32, else normalised in fp32 and rounded."""
    sums = tu.flatten(total)[0]
    leaves, spec = tu.flatten(grads)
    if all(tu.local(s).dtype == tu.local(g).dtype for s, g in zip(sums, leaves)):
        return total
    scaled = tu.scale_leaves(sums, factor, inplace=True)
    return tu.unflatten(spec, [tu.like(g, tu.local(s).to(g.dtype)) for g, s in zip(leaves, scaled)])


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
    The step runs through a :class:`StepPlan`:

    * when the chain ends in :func:`gradtx.adamw`, :func:`gradtx.adam` or
      :func:`gradtx.sgd` with every leaf fit for torch's fused kernel (params,
      grads and moments of one dtype, contiguous, on a CPU/CUDA/... device: fp32
      or fp64 params, since gradtx keeps fp32 moments for low-precision ones),
      the whole step is one ``torch._fused_adamw_`` / ``_fused_adam_`` /
      ``_fused_sgd_`` launch, with the trailing scalar factors (clip
      coefficient, accumulation mean) in its ``grad_scale``: one pass over p, g
      and the moments;
    * otherwise the updates are computed in the donated buffers and added to
      the params in place, with the trailing scalar factors folded into one multiply.

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
    if not torch.compiler.is_compiling():
        plan = StepPlan.of(tx)  # planned once per transform: a chain that cannot run right raises here
    if not donate:
        updates, new_state = tx.update(grads, state, params, **extra)
        return apply_updates(params, updates), new_state
    if "inplace" in extra:
        raise TypeError("update_and_apply: inplace is set by donate=True; do not pass it")

    if torch.compiler.is_compiling():
        # Traced, the donated step is the pure step stored into the donated buffers: inductor writes each
        # result straight into its buffer (no fresh allocation), and torch's fused kernels, which aot
        # autograd cannot functionalize, are never traced.
        updates, new_state = tx.update(grads, state, params, **extra)
        with torch.no_grad():
            return _store_into((params, state), (apply_updates(params, updates), new_state))

    # A donated step writes its inputs, so it is not differentiable; no_grad also lets it write
    # params that are leaves requiring grad (nn.Parameters), as an optimizer step does.
    with torch.no_grad():
        result = plan.run_owned(grads, state, params, autograd_buffer=False, run_terminal=False, **extra)
        if result.updates is None:  # an open accumulation window
            return params, result.state
        updates, factor = result.updates, result.factor
        states = _split(tx, result.state)
        if plan.terminal is not None:
            planned = plan.terminal.fused_step(states[-1], updates, params, factor)
            if planned is not None:
                launch, states[-1] = planned
                launch()
                return params, _join(tx, iter(states))
            if factor is not None:
                updates = _scale_owned(updates, factor)
                factor = None
            updates, states[-1] = plan.terminal.update(updates, states[-1], params, inplace=True, **extra)
        _add_in_place(params, updates, factor)
    return params, _join(tx, iter(states))
