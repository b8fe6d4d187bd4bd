"""TransformedOptimizer: run a gradtx chain on ``p.grad`` in front of any ``torch.optim`` optimizer."""

from __future__ import annotations

import contextlib
import copy
import pickle
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import torch
from torch.optim import optimizer as torch_optimizer

from gradtx import checkpoint as _ckpt
from gradtx import tree as tu
from gradtx.accumulation import AccumulateState
from gradtx.base import GradientTransformation, OptState, metrics
from gradtx.combine import chain
from gradtx.executor import StepPlan
from gradtx.optimizers import OptimizerChain

try:  # a CPU-only or old build may lack torch.distributed
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
except ImportError:  # pragma: no cover
    FSDPModule = DistributedDataParallel = None  # type: ignore[assignment,misc]

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

# The extra the wrapper passes itself: it owns the .grad buffers.
_RESERVED = frozenset({"inplace"})

# Training frameworks that count every ``optimizer.step()`` call as an optimizer step (their global step, their
# scheduler), and what to use in their place when the chain accumulates.
_FRAMEWORKS = {
    "lightning": "Lightning's Trainer(accumulate_grad_batches=k)",
    "pytorch_lightning": "Lightning's Trainer(accumulate_grad_batches=k)",
    "transformers": "the Hugging Face Trainer's TrainingArguments(gradient_accumulation_steps=k)",
    "accelerate": "accelerate's Accelerator(gradient_accumulation_steps=k) with `with accelerator.accumulate(model):` "
    "(the Hugging Face Trainer: TrainingArguments(gradient_accumulation_steps=k))",
}


def _keep_on_skip(skip: torch.Tensor, old: Any, new: Any) -> Any:
    """``new``, except where ``skip``: then ``old``; the accumulation window closes either way (no host sync)."""
    if isinstance(new, AccumulateState):
        return new
    if isinstance(new, torch.Tensor):
        local_new = tu.local(new)
        return tu.like(new, torch.where(skip.to(local_new.device), tu.local(old), local_new))
    if isinstance(new, tuple) and hasattr(type(new), "_fields"):
        return type(new)(*(_keep_on_skip(skip, o, n) for o, n in zip(old, new)))
    if isinstance(new, (tuple, list)):
        return type(new)(_keep_on_skip(skip, o, n) for o, n in zip(old, new))
    if isinstance(new, dict):
        return {k: _keep_on_skip(skip, old[k], v) for k, v in new.items()}
    return new


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


def _framework_caller() -> str | None:
    """The training framework (a key of ``_FRAMEWORKS``) whose code called ``step``, if any."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        top = str(frame.f_globals.get("__name__", "")).split(".", 1)[0]
        if top in _FRAMEWORKS:
            return top
        frame = frame.f_back
    return None


class _Live:
    """What a step changes, held apart from the optimizer object.

    torch.compile drops attribute writes to a ``torch.optim.Optimizer`` instance
    inside a graph (dynamo treats optimizers specially), but tracks writes to a
    plain object: so everything a step writes lives here.
    """

    def __init__(self, tx_state: OptState) -> None:
        self.tx_state = tx_state
        self.window_open = False
        self.emitted = False
        # GradScaler inside an accumulation window: the window's scale, and whether it saw an inf.
        self.amp_scale: torch.Tensor | None = None
        self.amp_inf: torch.Tensor | None = None
        self.metrics: dict[str, torch.Tensor] = {}


class TransformedOptimizer(torch.optim.Optimizer):
    """Make any ``torch.optim`` optimizer apply a gradtx transform to ``p.grad`` first.

    ``step(closure=None, **extra)`` follows ``torch.optim.Optimizer.step``: it
    calls the closure (if any) once under ``torch.enable_grad()``, reads every
    ``p.grad``, runs ``tx`` on them (extras such as ``tokens=n`` or
    ``flush=True`` reach every member), writes the result back to ``p.grad``
    and calls the inner optimizer's ``step`` only when the chain emits. It
    returns the closure's loss (``None`` without a closure); :attr:`emitted`
    says whether the inner optimizer stepped.

    The chain runs without copying the grads where it can: with
    :func:`gradtx.accumulate` in the chain, autograd's own summation into
    ``.grad`` is the accumulator, so no second gradient-sized buffer is kept,
    and :meth:`zero_grad` does nothing while a window is open: the ordinary
    ``backward(); step(); zero_grad()`` loop accumulates unchanged. A step
    that raises leaves ``.grad``, the transform state and the inner
    optimizer's state as they were.

    When the inner optimizer is fused (``torch.optim.Adam/AdamW/SGD(fused=True)``),
    a trailing scalar factor from the chain (the clip coefficient, the
    accumulation mean) is folded into the kernel's ``grad_scale`` instead of
    costing a pass over the grads, and a skip decided by
    :func:`gradtx.apply_if_finite` rides in its ``found_inf``, with no host
    sync. Other optimizers get the scaled grads written into ``p.grad``
    before their step.

    ``torch.amp.GradScaler`` hands the wrapper its scale and inf flag (the
    wrapper declares ``_step_supports_amp_scaling``, as fused optimizers do)
    instead of unscaling ``.grad`` itself: the chain sees unscaled grads
    (clipping included), and a step with an inf or NaN is skipped, its
    transform state and inner state unchanged, while the scaler backs off.

    ``param_groups`` is the inner optimizer's own list, so
    ``torch.optim.lr_scheduler`` schedulers work on the wrapper.

    Data parallel (DDP or FSDP2): wrap each micro-step's forward and backward
    in :meth:`maybe_no_sync`, so only the backward whose ``step()`` will emit
    syncs the grads. For token-weighted accumulation, call
    :func:`sum_grad_reduction` on the model once, and give
    :func:`gradtx.accumulate` a ``comm`` to sum the token totals.

    Args:
      optimizer: the inner ``torch.optim.Optimizer``.
      tx: the gradient transformation to run on the grads.

    Example:
      >>> opt = TransformedOptimizer(torch.optim.AdamW(model.parameters(), fused=True),
      ...                            chain(accumulate(4), clip_by_global_norm(1.0)))
      >>> for batch in loader:
      ...     model(batch).backward()
      ...     opt.step()
      ...     if opt.emitted:
      ...         log(opt.metrics)
      ...     opt.zero_grad()
    """

    # GradScaler sets grad_scale/found_inf on the wrapper and leaves .grad scaled: the wrapper unscales
    # inside the chain (so clipping sees true grads) and honours found_inf itself.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, tx: GradientTransformation) -> None:
        # Deliberately no super().__init__: param_groups and state are the inner optimizer's own.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"TransformedOptimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, TransformedOptimizer):
            raise TypeError("TransformedOptimizer: optimizer is already a TransformedOptimizer; chain the transforms")
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"TransformedOptimizer: tx must be a GradientTransformation, got {type(tx).__name__}")
        full = chain(tx)
        plan = StepPlan.of(full)
        for member in plan.members:
            if isinstance(member, OptimizerChain):
                kind = member.spec.kind
                raise TypeError(
                    f"TransformedOptimizer: the chain holds gtx.{kind}(...), an optimizer: its output is an update "
                    f"(-learning_rate times a direction), which the inner {type(optimizer).__name__} would step "
                    "against once more (the loss would climb). The chain transforms the gradients the inner "
                    f"optimizer steps on: leave gtx.{kind} out and let {type(optimizer).__name__} take the step, or "
                    f"run gtx.{kind} functionally (gtx.update_and_apply)"
                )
        self.optimizer = optimizer
        self._user_tx = tx  # issue 8: what pickle stores; self.tx and self._plan are rebuilt from it
        self.tx = full
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._tree = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
        self._fp64 = any(p.dtype == torch.float64 for group in self._tree for p in group)  # grad_scale is fp32
        self._frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad]
        self._plan = plan
        self._live = _Live(self.tx.init(self.param_tree()))  # issue 8: what a step writes (see _Live)
        # issue 8: the chain's structure is fixed, so a step branches on nothing else. A chain whose body
        # transforms .grad in place is snapshotted on an emitting step, so a member that raises leaves it as it was.
        self._accumulates = self._plan.window is not None
        self._body_mutates = self._plan.tail_start > self._plan.body_start or self._plan.terminal is not None

    # torch.optim.Optimizer surface, delegated to the inner optimizer -----------------------

    @property
    def tx_state(self) -> OptState:
        """The transform's state (a pytree of tensors)."""
        return self._live.tx_state

    @tx_state.setter
    def tx_state(self, value: OptState) -> None:
        self._live.tx_state = value

    # issue 8: the names state_dict/load_state_dict use, kept on the holder a compiled step can write.
    @property
    def _window_open(self) -> bool:
        return self._live.window_open

    @_window_open.setter
    def _window_open(self, value: bool) -> None:
        self._live.window_open = value
        self._live.emitted = False
        self._live.amp_scale = self._live.amp_inf = None  # a loaded window carries no GradScaler record

    @property
    def _last_metrics(self) -> dict[str, torch.Tensor]:
        return self._live.metrics

    @_last_metrics.setter
    def _last_metrics(self, value: dict[str, torch.Tensor]) -> None:
        self._live.metrics = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"TransformedOptimizer({self.optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        # Anything this class does not define (step/state-dict hook registries, private fields that
        # torch.optim.Optimizer's methods expect) is the inner optimizer's, since we skip its __init__.
        # GradScaler's grad_scale/found_inf are the wrapper's own, never the inner optimizer's.
        if name in ("optimizer", "grad_scale", "found_inf") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        try:
            pickle.dumps(self._user_tx)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise TypeError(
                f"TransformedOptimizer cannot be pickled: its transform cannot be ({e}). Save opt.state_dict() "
                "with torch.save and rebuild the wrapper with the same chain, or copy.deepcopy(opt) in-process"
            ) from None
        # The chain around the user's transform and its plan are rebuilt on load.
        state = {k: v for k, v in self._plain_state().items() if k not in ("tx", "_plan")}
        grads = self._window_grads("pickle")
        if grads is not None:
            state[_PICKLED_GRADS] = grads
        return state

    def _window_grads(self, what: str) -> list[torch.Tensor | None] | None:
        """An open window's partial sums, the params' ``.grad``, which pickle and deepcopy leave out of a Parameter."""
        if not self._plan.window_open(self.tx_state):
            return None
        flat = [p for group in self.param_tree() for p in group]
        self._ckpt_check_sums_visible(flat, f"TransformedOptimizer {what}")
        return [None if p.grad is None else p.grad.detach() for p in flat]

    def _put_window_grads(self, grads: list[torch.Tensor | None]) -> None:
        for p, g in zip([p for group in self.param_tree() for p in group], grads):
            if p.grad is None:
                p.grad = g

    def _plain_state(self) -> dict[str, Any]:
        # An lr scheduler patches `step` on the instance with a wrapper bound to this very object (a weakref):
        # a copy keeps the class's own step, as torch.optim.Optimizer's pickling does.
        return {k: v for k, v in self.__dict__.items() if k not in ("grad_scale", "found_inf", "step")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        grads = state.pop(_PICKLED_GRADS, None)
        self.__dict__.update(state)
        if "tx" not in state:
            self.tx = chain(self._user_tx)
            self._plan = StepPlan.of(self.tx)
        if grads is not None:
            self._put_window_grads(grads)

    def __deepcopy__(self, memo: dict[int, Any]) -> TransformedOptimizer:
        # An in-process copy shares the transform and its plan (pure functions); everything else is copied.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for shared in (self.tx, self._plan, self._user_tx):
            memo[id(shared)] = shared
        new.__dict__.update(copy.deepcopy(self._plain_state(), memo))
        grads = self._window_grads("deepcopy")
        if grads is not None:
            new._put_window_grads(copy.deepcopy(grads, memo))
        return new

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer and grow the transform state for it.

        The existing groups keep their transform state; the new group's leaves
        start from ``tx.init``. Not allowed while an accumulation window is open
        (``.grad`` holds a partial sum the new group has no part in).

        Args:
          param_group: as for ``torch.optim.Optimizer.add_param_group``.
        """
        if self._live.window_open:
            raise ValueError(
                "TransformedOptimizer.add_param_group: an accumulation window is open; add the group after the "
                "step that emits (opt.emitted is True)"
            )
        self._check_tree()
        self.optimizer.add_param_group(param_group)
        group = self.optimizer.param_groups[-1]
        tree = [*self.param_tree(), [p for p in group["params"] if p.requires_grad]]
        try:
            fresh = self.tx.init(tree)
        except Exception:
            self.optimizer.param_groups.pop()  # atomic: the inner optimizer is as it was
            raise
        old = dict(zip(map(tu.path_str, tu.paths(self.tx_state)), tu.flatten(self.tx_state)[0]))
        leaves, spec = tu.flatten(fresh)
        kept = []
        for path, leaf in zip(tu.paths(fresh), leaves):
            prev = old.get(tu.path_str(path))
            same = isinstance(prev, torch.Tensor) and isinstance(leaf, torch.Tensor) and prev.shape == leaf.shape
            kept.append(prev if same else leaf)
        self.tx_state = tu.unflatten(spec, kept)
        self._tree = [list(g) for g in tree]
        self._fp64 = any(p.dtype == torch.float64 for group in self._tree for p in group)
        self._frozen = [*self._frozen, *(p for p in group["params"] if not p.requires_grad)]

    # the tree the transform sees: one list per param group, params that require grad ----------

    def param_tree(self) -> list[list[torch.Tensor]]:
        """The params tree the transform sees: one list per param group, the params that require grad.

        The tree is fixed when the wrapper is built (and grows with
        :meth:`add_param_group`). A param frozen later stays in it and gets no
        grad; a param unfrozen later is an error at the next step, since the
        transform state has no slot for it. Build a :func:`gradtx.mesh_groups`
        plan for the wrapper from this tree, so the plan's leaf order is the
        transform's.
        """
        return [list(g) for g in self._tree]

    def _check_tree(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self._tree):
            raise ValueError(
                f"TransformedOptimizer: the inner optimizer has {len(groups)} param groups, the transform state was "
                f"built for {len(self._tree)}; add groups with opt.add_param_group (the wrapper's), "
                "not opt.optimizer.add_param_group"
            )
        for p in self._frozen:
            if p.requires_grad and p.grad is not None:
                where = next(f"[{i}][{j}]" for i, g in enumerate(groups) for j, q in enumerate(g["params"]) if q is p)
                raise ValueError(
                    f"TransformedOptimizer: param {where} (shape {tuple(p.shape)}) has requires_grad=True and a grad, "
                    "but had requires_grad=False when the optimizer was wrapped, so the transform state has no slot "
                    "for it. Set requires_grad before wrapping (a param frozen later is fine), or build a new "
                    "TransformedOptimizer around the inner optimizer"
                )

    def _grads(self, params: list[list[torch.Tensor]], *, emitting: bool) -> list[list[torch.Tensor]]:
        # A param without a grad contributes zeros to an emitting step; its grad stays None, so the
        # inner optimizer skips it. A held step reads no grad values (accumulate comes first and
        # only counts), so a missing grad there, as under FSDP2's no-sync, costs no allocation.
        def missing(p: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(p) if emitting else torch.empty(0, dtype=p.dtype, device=tu.local(p).device)

        return [[p.grad if p.grad is not None else missing(p) for p in group] for group in params]

    # stepping -----------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **extra: Any) -> Any:  # type: ignore[override]
        """Run the transform on the grads and step the inner optimizer if it emitted.

        Args:
          closure: as in ``torch.optim``: reevaluates the model (forward and
            backward) and returns the loss; called once, under ``torch.enable_grad()``,
            before the grads are read. Not allowed with :func:`gradtx.accumulate`
            in the chain (the caller would count every micro-step as an optimizer step).
          **extra: forwarded to every transform, e.g. ``tokens=n``, ``flush=True``.

        Returns:
          The closure's return value, or ``None`` without a closure. Whether the
          inner optimizer stepped is :attr:`emitted`.
        """
        # issue 9: DCP's state warm-up runs the inner optimizer only (never under torch.compile).
        if not torch.compiler.is_compiling() and self._ckpt_dcp_init_step():
            return None
        if closure is not None and not callable(closure):
            raise TypeError(f"TransformedOptimizer.step: closure must be callable, got {type(closure).__name__}")
        if self._accumulates and not torch.compiler.is_compiling():
            self._refuse_framework_accumulation(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step(extra)
        return loss

    def _refuse_framework_accumulation(self, closure: Any) -> None:
        framework = _framework_caller()
        if closure is None and framework is None:
            return
        use = _FRAMEWORKS.get(framework or "", "the caller's own gradient accumulation")
        who = f"{framework} calls step()" if framework else "step(closure) is called"
        raise ValueError(
            f"TransformedOptimizer.step: gtx.accumulate is in the chain, but {who}, counting every call as an "
            f"optimizer step (its global step, its scheduler) while only every k-th call steps. Take "
            f"gtx.accumulate out of the chain and use {use}; or drive the wrapper yourself: "
            "loss.backward(); opt.step() with no closure"
        )

    def _step(self, extra: dict[str, Any]) -> None:
        reserved = sorted(_RESERVED & extra.keys())
        if reserved:
            raise ValueError(f"TransformedOptimizer.step: {reserved} are set by the wrapper itself; do not pass them")
        # Set by torch.amp.GradScaler.step for the duration of this call: the grads carry grad_scale
        # (None after scaler.unscale_(opt)), and found_inf says whether they hold an inf or NaN.
        grad_scale: torch.Tensor | None = self.__dict__.get("grad_scale")
        found_inf: torch.Tensor | None = self.__dict__.get("found_inf")
        self._check_tree()
        params = self.param_tree()
        emitting = self.emits_next(flush=bool(extra.get("flush", False)))
        if found_inf is not None and grad_scale is None and self._accumulates and not emitting:
            raise ValueError(
                "TransformedOptimizer.step: scaler.unscale_(opt) was called on a micro-step that does not emit, "
                "so it unscaled the partial sum in .grad that the next micro-steps add scaled grads to. Let the "
                "wrapper unscale (clip with gtx.clip_by_global_norm in the chain, not clip_grad_norm_), or call "
                "scaler.unscale_(opt) only when opt.emits_next()"
            )
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        grads = self._grads(params, emitting=emitting)
        updates, new_state, factor, skip = self._run_chain(grads, params, extra, inv_scale)
        window_open = self._accumulates and self._plan.window_open(new_state)

        live = self._live
        amp_scale, amp_inf = live.amp_scale, live.amp_inf
        drop_partial_sum = False
        if found_inf is not None:
            found = found_inf != 0
            if amp_inf is not None:  # an earlier micro-step of this window saw an inf
                found = found | amp_inf.to(found.device)
            if amp_scale is not None and grad_scale is not None:
                # The scaler changed the scale inside the window: .grad sums micro-batches at two scales.
                found = found | (grad_scale != amp_scale.to(grad_scale.device))
            if updates is None and window_open:
                amp_inf = found
                if amp_scale is None and grad_scale is not None:
                    amp_scale = grad_scale.detach().clone()
                drop_partial_sum = bool(found)  # one scalar read, on a held micro-step under GradScaler only
            if updates is not None:
                new_state = _keep_on_skip(found, self.tx_state, new_state)
                skip = found if skip is None else (skip | found.to(skip.device))
        if not window_open:
            amp_scale = amp_inf = None

        if updates is not None:
            self._apply(params, updates, factor, skip)
        elif drop_partial_sum:
            # The window will be skipped; an inf left in .grad would make GradScaler back off again on
            # every remaining micro-step, where torch's recipe backs off once per window.
            for group in params:
                for p in group:
                    p.grad = None
        # Commit only now: a step that raised above left the state as it was.
        live.tx_state = new_state
        live.window_open = window_open
        live.emitted = updates is not None
        live.amp_scale, live.amp_inf = amp_scale, amp_inf
        live.metrics = metrics(new_state)

    def _run_chain(
        self,
        grads: list[list[torch.Tensor]],
        params: list[list[torch.Tensor]],
        extra: dict[str, Any],
        inv_scale: torch.Tensor | None,
    ) -> tuple[Any, OptState, torch.Tensor | None, torch.Tensor | None]:
        """Run the chain on the owned grads: (updates or None, new state, pending factor, skip).

        The one place the wrapper calls into the chain. Nothing is written into
        ``.grad`` here (the caller applies the result once every member
        succeeded); ``factor`` is a 0-d fp32 scalar still to be applied,
        ``inv_scale`` (GradScaler's ``1/scale``) folded in, and ``skip`` a 0-d
        bool tensor (a step :func:`gradtx.apply_if_finite` skipped).
        """
        snapshot = None
        if self._body_mutates and self.emits_next(flush=bool(extra.get("flush", False))):
            # The executor runs the body in place on the owned grads; keep them, to restore on an error.
            snapshot = [g.clone() for group in grads for g in group]
        try:
            result = self._plan.run_owned(
                grads, self.tx_state, params, autograd_buffer=True, inv_scale=inv_scale, **extra
            )
        except BaseException:
            if snapshot is not None:
                torch._foreach_copy_([g for group in grads for g in group], snapshot)
            raise
        return result.updates, result.state, result.factor, result.skip

    def _apply(
        self,
        params: list[list[torch.Tensor]],
        updates: Any,
        factor: torch.Tensor | None,
        skip: torch.Tensor | None,
    ) -> None:
        replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        compiling = torch.compiler.is_compiling()
        for group_params, group_updates in zip(params, updates):
            for p, u in zip(group_params, group_updates):
                if p.grad is not None and u is not p.grad:
                    if compiling:
                        # Rebinding p.grad is a pending mutation of the param, which makes dynamo break the
                        # graph before the inner optimizer's _init_group; a copy into .grad is not.
                        copies.append((p.grad, u))
                    else:
                        replaced.append((p, p.grad))
                        p.grad = u
        if copies:
            torch._foreach_copy_([g for g, _ in copies], [u for _, u in copies])
        try:
            # Under torch.compile, dynamo drops writes to an optimizer's attributes, so grad_scale/found_inf
            # cannot reach the fused kernel there: the factor is applied to the grads instead (inductor fuses it).
            if self._fused and not torch.compiler.is_compiling():
                if factor is not None and self._fp64:
                    # torch's fused kernels read grad_scale as fp32: fp64 grads take the factor in fp64.
                    tu.scale_leaves(
                        [p.grad for group in params for p in group if p.grad is not None], factor, inplace=True
                    )
                    factor = None
                grad_scale = None if factor is None else (1.0 / factor).to(torch.float32)
                self.optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
                self.optimizer.found_inf = None if skip is None else skip.to(torch.float32)  # type: ignore[attr-defined]
                try:
                    self._inner_step()
                finally:
                    self.optimizer.grad_scale = None  # type: ignore[attr-defined]
                    self.optimizer.found_inf = None  # type: ignore[attr-defined]
                return
            if skip is not None and bool(skip):  # a non-fused optimizer cannot skip on its own
                return
            if factor is not None:
                grads = [p.grad for group in params for p in group if p.grad is not None]
                tu.scale_leaves(grads, factor, inplace=True)
            self._inner_step()
        except BaseException:
            for p, g in replaced:
                p.grad = g
            raise

    def _inner_step(self) -> None:
        if torch.compiler.is_compiling() and not _has_step_hooks(self.optimizer):
            # torch.optim's step wrappers insert graph breaks (to keep the optimizer graph an inference
            # graph, which the surrounding no_grad already makes it), so fullgraph=True could never hold.
            raw: Any = type(self.optimizer).step
            while hasattr(raw, "__wrapped__"):
                raw = raw.__wrapped__
            raw(self.optimizer)
        else:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grads, except while an accumulation window is open (they are the accumulator)."""
        if self._live.window_open:
            return
        if not torch.compiler.is_compiling():
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        # torch.optim's zero_grad is marked not traceable; this is its body, for a compiled step.
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    @property
    def emitted(self) -> bool:
        """Whether the last :meth:`step` emitted: the chain produced an update and the inner optimizer stepped.

        False on a micro-step that an accumulation window holds (and when a
        token-weighted window had no valid token). A step skipped for non-finite
        grads (GradScaler's inf, :func:`gradtx.apply_if_finite`) still emitted:
        its window closed; the params and optimizer state stay unchanged and
        ``metrics["skipped"]`` counts it. Reads nothing from the device.
        """
        return self._live.emitted

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """The last step's logged scalars: grad_norm, clip_coef, micro_step, tokens, skipped (as present)."""
        return dict(self._live.metrics)

    @property
    def window_open(self) -> bool:
        """Whether an accumulation window is open (the grads hold a partial sum)."""
        return self._live.window_open

    def emits_next(self, *, flush: bool = False) -> bool:
        """Whether the next :meth:`step` will emit, so its backward must sync the grads across ranks.

        True without :func:`gradtx.accumulate` in the chain (every step emits),
        on the last micro-step of a window, and when the next step will be
        passed ``flush=True``. Reads only host-side counters.

        Args:
          flush: the next ``step`` will be called with ``flush=True``.

        Returns:
          Whether the next ``step`` closes its accumulation window.
        """
        if flush or not self._accumulates:
            return True
        return self._plan.emits_next(self.tx_state, flush=flush)

    @contextlib.contextmanager
    def maybe_no_sync(self, model: torch.nn.Module, *, flush: bool = False) -> Iterator[None]:
        """Run one micro-step's forward and backward, syncing the grads only if the next ``step`` emits.

        The wrapper knows where its accumulation window stands, so the data-parallel
        sync (DDP's all-reduce, FSDP2's reduce-scatter) happens once per optimizer
        step, on the last micro-step, instead of ``k`` times. Wrap the forward
        *and* the backward: DDP decides in its forward whether the backward syncs.
        A model that is neither DDP nor FSDP2 runs unchanged. See :func:`no_sync`.

        Args:
          model: the DDP- or FSDP2-wrapped model whose backward runs inside.
          flush: this micro-step's ``step`` will get ``flush=True`` (a short final window).

        Example:
          >>> for x, y in micro_batches:
          ...     with opt.maybe_no_sync(model):
          ...         loss_sum = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
          ...         loss_sum.backward()
          ...     opt.step(tokens=int((y != -100).sum()))
          ...     opt.zero_grad()
        """
        sync = self.emits_next(flush=flush)
        # issue 9: after a backward that skipped the sync, the window's partial sums are not in .grad.
        self._ckpt_synced = sync or not any(_data_parallel_modules(model))
        with no_sync(model, sync=sync):
            yield

    # checkpoints (issue 9) ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The checkpoint in ``torch.optim``'s layout: ``state`` per parameter and ``param_groups``.

        Each parameter's entry is the inner optimizer's (``exp_avg``, ``step``, ...)
        plus a ``"gradtx"`` dict: the transform's per-parameter state (a DTensor
        where the param is one, so it reshards), the open accumulation window's
        partial sum (the param's ``.grad``; zeros at a boundary, so the keys never
        depend on where the window stands), and, on the first parameter only,
        the transform's global state under ``"global"`` (counters, the window's
        micro-step and token count, the last grad norm). So
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
        ``get_optimizer_state_dict`` (full or sharded) and ``dcp.save`` take it as
        they take any optimizer's. See ``docs/checkpointing.md``.

        Raises:
          ValueError: a window is open and its partial sums are not in ``.grad``
            (they sit inside DDP/FSDP2 after a :meth:`maybe_no_sync` backward that
            did not sync): save at a window boundary, or make the window's last
            micro-step sync (``step(flush=True)`` after ``maybe_no_sync(model, flush=True)``).
        """
        params = self.param_tree()
        flat = [p for group in params for p in group]
        layout = _ckpt._layout_of(self.tx_state, params)
        acc_key = self._ckpt_acc_key(layout)
        if acc_key is not None:
            sums = self._ckpt_partial_sums(flat)
            layout.per_param[acc_key] = [sums]  # a one-leaf tree: _export flattens it
        per_param, globals_ = _ckpt._export(
            layout, flat, self.tx, what="TransformedOptimizer.state_dict", acc_dtype=_same_dtype
        )
        inner = self.optimizer.state_dict()
        # torch's state_dict hands out the live per-param dicts: copy them before adding to them.
        state: dict[Any, Any] = {pid: {k: v for k, v in s.items() if k != _GTX} for pid, s in inner["state"].items()}
        for i, pid in enumerate(self._ckpt_pids(params)):
            entry = state.setdefault(pid, {})
            entry[_GTX] = {key: values[i] for key, values in per_param.items()}
            if i == 0:
                entry[_GTX][_GLOBAL] = globals_
                if acc_key is not None:
                    entry[_GTX][_AMP] = self._ckpt_amp()
        return {"state": state, "param_groups": inner["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`, or adopt a plain ``torch.optim`` checkpoint; checks everything first.

        Accepts what :meth:`state_dict` made, also after torch's
        ``set_optimizer_state_dict`` / ``dcp.load`` re-keyed it by parameter name.
        A checkpoint of the bare inner optimizer class (no ``"gradtx"`` entries)
        loads too: the inner state is restored and the transform starts fresh
        (``tx.init``), as when a running project adopts gradtx.

        Before anything changes it checks the param groups and counts, the
        inner state's shapes, and the transform's: the same chain (keys), the
        same accumulation ``k``, shapes and dtypes. The first difference raises a
        ``ValueError`` naming it, and the optimizer is left as it was. A window
        that was open when saved is open again, its partial sums in ``.grad``;
        one saved at a boundary leaves every ``.grad`` ``None``.
        """
        what = "TransformedOptimizer.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{what}: state_dict must be a dict, got {type(state_dict).__name__}")
        if "inner" in state_dict or "tx_state" in state_dict:
            raise ValueError(
                f"{what}: this checkpoint has gradtx's earlier layout ('inner', 'tx_state'); to adopt its inner "
                "optimizer state with the transform starting fresh, pass checkpoint['inner'] (it is a torch.optim "
                "checkpoint), after making sure it was saved at a window boundary (checkpoint['window_open'] is False)"
            )
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(
                    f"{what}: missing key {key!r} (expected torch.optim's layout: 'state', 'param_groups')"
                )
        params = self.param_tree()
        flat = [p for group in params for p in group]
        saved_groups = state_dict["param_groups"]
        groups = self.optimizer.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(
                f"{what}: the checkpoint has {len(saved_groups)} param groups, this optimizer {len(groups)}"
            )
        saved_of: dict[int, Any] = {}
        for i, (saved, group) in enumerate(zip(saved_groups, groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{what}: param group {i} has {len(saved['params'])} params in the checkpoint, "
                    f"{len(group['params'])} here"
                )
            for sid, p in zip(saved["params"], group["params"]):
                saved_of[id(p)] = sid
        all_params = [p for group in groups for p in group["params"]]
        names = self._ckpt_names(params)
        saved_state = state_dict["state"]
        inner_state = {}
        for sid, s in saved_state.items():
            if not isinstance(s, dict):
                raise TypeError(f"{what}: state[{sid!r}] is a {type(s).__name__}, not a dict")
            rest = {k: v for k, v in s.items() if k != _GTX}
            if rest:
                inner_state[sid] = rest
        _check_inner_state(inner_state, {saved_of[id(p)]: p for p in all_params}, what=what)
        entries = [saved_state.get(saved_of[id(p)], {}).get(_GTX) for p in flat]
        if all(e is None for e in entries):
            entries = self._ckpt_flattened_entries(flat) or entries
        if all(e is None for e in entries):  # a plain torch.optim checkpoint: adopt it, transform fresh
            new_state = self.tx.init(params)
            sums = amp = None
        else:
            layout = _ckpt._layout_of(self.tx_state, params)
            acc_key = self._ckpt_acc_key(layout)
            if acc_key is not None:
                layout.per_param[acc_key] = None  # the partial sums: shaped and typed like the params
            expected = list(layout.per_param)
            per_param: dict[str, list[Any]] = {key: [] for key in expected}
            first = [_GLOBAL, _AMP] if acc_key is not None else [_GLOBAL]
            for i, (name, entry) in enumerate(zip(names, entries)):
                keys = expected + (first if i == 0 else [])
                _ckpt._check_keys(entry, keys, what=f"{what}: gradtx state of {name}", hint=_ckpt._HINT)
                for key in expected:
                    per_param[key].append(entry[key])
            loaded = _ckpt._import(
                layout, self.tx_state, params, per_param, entries[0][_GLOBAL], self.tx, names,
                what=what, acc_dtype=_same_dtype,
            )  # fmt: skip
            new_state, taken = _ckpt._take_acc(loaded, params)
            sums = taken[0] if acc_key is not None and taken else None
            amp = self._ckpt_check_amp(entries[0].get(_AMP), flat, what=what) if acc_key is not None else None
        # Everything checked; the inner optimizer validates its own part before it changes anything.
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": saved_groups})
        self.tx_state = new_state
        self._window_open = self._plan.window_open(new_state)  # also clears the GradScaler record
        if amp is not None and self._window_open:
            self._live.amp_scale, self._live.amp_inf = amp
        self._ckpt_synced = True
        for i, p in enumerate(flat):
            # An open window's partial sums are the grads; at a boundary no stale partial sum survives.
            p.grad = tu.flatten(sums)[0][i] if sums is not None and self._window_open else None
        self._last_metrics = metrics(self.tx_state)

    def _ckpt_amp(self) -> dict[str, torch.Tensor]:
        """The open window's GradScaler record: the scale its grads carry (0: none) and whether it saw an inf."""
        scale, inf = self._live.amp_scale, self._live.amp_inf
        return {
            "scale": torch.zeros(()) if scale is None else scale.detach().reshape(()).float().cpu().clone(),
            "inf": torch.zeros(()) if inf is None else inf.detach().reshape(()).float().cpu().clone(),
        }

    def _ckpt_check_amp(
        self, saved: Any, flat: list[torch.Tensor], *, what: str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The GradScaler record to restore with an open window, or None; checked before anything changes."""
        _ckpt._check_keys(saved, ["scale", "inf"], what=f"{what}: GradScaler record", hint=_ckpt._HINT)
        for key in ("scale", "inf"):
            if not isinstance(saved[key], torch.Tensor) or saved[key].numel() != 1:
                raise ValueError(f"{what}: GradScaler record {key!r} must be a one-element tensor")
        if float(saved["scale"]) == 0.0:
            return None
        device = tu.local(flat[0]).device if flat else torch.device("cpu")
        return saved["scale"].reshape(()).to(device, torch.float32), (saved["inf"].reshape(()) != 0).to(device)

    def _ckpt_acc_key(self, layout: Any) -> str | None:
        """The checkpoint key of the leading window's partial sums (autograd's ``.grad``), or ``None``."""
        if self._plan.window is None or not layout.windows:
            return None
        return layout.windows[0].key("running_sum")  # the leading window's, the first in the walk

    def _ckpt_pids(self, params: list[list[torch.Tensor]]) -> list[int]:
        """torch.optim's state_dict index of each param of :meth:`param_tree`, in order."""
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        return [index[id(p)] for group in params for p in group]

    def _ckpt_names(self, params: list[list[torch.Tensor]]) -> list[str]:
        return [
            f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
            for i, g in enumerate(self.optimizer.param_groups)
            for j, p in enumerate(g["params"])
            if p.requires_grad
        ]

    def _ckpt_partial_sums(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """The open window's partial sums (the grads), or zeros at a boundary; refuses sums it cannot see."""
        if not self._plan.window_open(self.tx_state):
            return [torch.zeros_like(p) for p in flat]
        self._ckpt_check_sums_visible(flat, "TransformedOptimizer.state_dict")
        return [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in flat]

    def _ckpt_check_sums_visible(self, flat: list[torch.Tensor], what: str) -> None:
        """Refuse to save an open window whose partial sums are not in ``.grad``."""
        # GradScaler saw an inf in this window: the wrapper dropped the partial sum, the window will be skipped.
        dropped = self._live.amp_inf is not None and bool(self._live.amp_inf)
        hidden = not getattr(self, "_ckpt_synced", True) or (
            bool(flat) and all(p.grad is None for p in flat) and not dropped
        )
        if hidden:
            window_state, window = self._plan.window_state(self.tx_state), self._plan.window
            assert window_state is not None and window is not None  # the window is open
            raise ValueError(
                f"{what}: an accumulation window is open (micro-step "
                f"{int(window_state.micro_step)} of {window.k}) and its partial sums are not in .grad: they sit inside DDP/FSDP2, which skipped "
                "the gradient sync (maybe_no_sync), so a checkpoint now would lose them. Save at a window boundary "
                "(when step() returned True, opt.window_open is False), or end the window early: run its next "
                "micro-step inside opt.maybe_no_sync(model, flush=True) and call opt.step(flush=True)"
            )

    def _ckpt_flattened_entries(self, flat: list[torch.Tensor]) -> list[Any] | None:
        """The transform's entries from the flattened dict torch's ``set_optimizer_state_dict`` is loading, if any.

        With ``flatten_optimizer_state_dict=True`` (torchtitan's setting) torch
        rebuilds the optimizer dict from the live optimizer's own state keys, so
        the ``"gradtx"`` entries are dropped on the way; read them back from the
        flattened dict it was given (``state.<fqn>.gradtx.<key>``).
        """
        frame = sys._getframe(2)
        if frame is None or frame.f_code.co_name != "_load_optim_state_dict":
            return None
        flat_sd, info = frame.f_locals.get("state_dict"), frame.f_locals.get("info")
        mapping = getattr(info, "fqn_param_mapping", None)
        if not isinstance(flat_sd, dict) or "state" in flat_sd or mapping is None:
            return None
        entries: list[Any] = []
        for p in flat:
            fqns = mapping.get(p) or ()
            prefix = f"state.{next(iter(fqns))}.{_GTX}." if fqns else ""
            entry: dict[str, Any] = {}
            for key, value in flat_sd.items() if prefix else ():
                if isinstance(key, str) and key.startswith(prefix):
                    *outer, leaf = key[len(prefix) :].split(".")
                    node = entry
                    for part in outer:
                        node = node.setdefault(part, {})
                    node[leaf] = value
            entries.append(entry or None)
        return entries if any(e is not None for e in entries) else None

    def _ckpt_dcp_init_step(self) -> bool:
        """Whether this ``step()`` is torch DCP's state warm-up (``_init_optim_state``); if so, run only the inner step.

        DCP materialises a fresh optimizer's state by stepping it once on zero
        grads with ``lr = 0``. That must not count as a micro-step nor advance
        the transform, so the inner optimizer alone takes it.
        """
        frame: Any = sys._getframe(1)
        for _ in range(6):  # step's own frame and its decorators' (no_grad), then its caller
            if frame is None:
                return False
            if frame.f_code.co_name == "_init_optim_state" and frame.f_globals.get("__name__", "").startswith(
                "torch.distributed.checkpoint"
            ):
                self.optimizer.step()
                return True
            frame = frame.f_back
        return False


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype  # the wrapper's partial sums are autograd's .grad, in the params' dtype


_PICKLED_GRADS = "_pickled_window_grads"  # an open window's .grad, which pickle leaves out of a Parameter
_GTX = "gradtx"  # issue 9: the transform's entry in each param's state
_GLOBAL = "global"
_AMP = "amp"
# Inner-optimizer state tensors shaped like their param (torch.optim's names).
_PARAM_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "ax", "prev"}
)


def _check_inner_state(state: dict[Any, Any], params_by_id: dict[Any, torch.Tensor], *, what: str) -> None:
    """Raise before loading unless every saved param state belongs to a param and is shaped like it."""
    for sid, s in state.items():
        if sid not in params_by_id:
            raise ValueError(f"{what}: the checkpoint has state for param {sid!r}, which no param group lists")
        p = params_by_id[sid]
        for key, value in s.items():
            if key in _PARAM_SHAPED and isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"{what}: state[{sid!r}][{key!r}] has shape {tuple(value.shape)}, its param {tuple(p.shape)}"
                )


def _data_parallel_modules(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """Every FSDP2-like module and every DDP-like module anywhere in ``model``, itself included.

    FSDP2's ``FSDPModule`` and DDP, and any module with their sync switch
    (``set_requires_gradient_sync``, or ``no_sync()``), e.g. a wrapper's own data-parallel module.
    """
    fsdp: list[Any] = []
    ddp: list[Any] = []
    for m in model.modules():
        if (FSDPModule is not None and isinstance(m, FSDPModule)) or callable(
            getattr(m, "set_requires_gradient_sync", None)
        ):
            fsdp.append(m)
        elif (DistributedDataParallel is not None and isinstance(m, DistributedDataParallel)) or callable(
            getattr(m, "no_sync", None)
        ):
            ddp.append(m)
    return fsdp, ddp


def _set_sync(module: Any, sync: bool) -> None:  # FSDP2's and DDP's methods are not on nn.Module's type
    if FSDPModule is not None and isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync, recurse=False)  # each module's own flag: all are visited
    else:
        module.set_requires_gradient_sync(sync)


@contextlib.contextmanager
def no_sync(model: torch.nn.Module, *, sync: bool) -> Iterator[None]:
    """Skip the data-parallel gradient sync of one backward unless ``sync`` is True.

    Finds every FSDP2 module (``set_requires_gradient_sync``) and every DDP
    module (``no_sync``) wherever it sits in ``model``: the model itself, or
    FSDP2 blocks inside a plain root module, or a DDP inside a wrapper. A
    model with neither runs unchanged. Use ``sync=True`` on the last
    micro-step of an accumulation window, so the sync happens once per
    optimizer step. Wrap the forward too: DDP reads the flag in its forward.
    With a :class:`TransformedOptimizer`, :meth:`TransformedOptimizer.maybe_no_sync`
    works out ``sync`` for you.

    Args:
      model: the model, holding DDP or FSDP2 modules anywhere.
      sync: whether this backward syncs the grads across ranks.

    Example:
      >>> with no_sync(model, sync=(micro_step == k - 1)):
      ...     loss.backward()
    """
    if sync:
        yield
        return
    fsdp, ddp = _data_parallel_modules(model)
    with contextlib.ExitStack() as stack:
        for module in fsdp:
            _set_sync(module, False)
            stack.callback(_set_sync, module, True)
        for module in ddp:
            stack.enter_context(module.no_sync())
        yield


def sum_grad_reduction(model: ModuleT) -> ModuleT:
    """Make the DDP and FSDP2 modules in a model *sum* their grads across data-parallel ranks instead of averaging them.

    Token-weighted accumulation needs the raw sum ``sum over ranks of grad``:
    gradtx divides it by the global token total (see :func:`gradtx.accumulate`).
    The wrappers average by default, which would divide a second time, by the
    world size, and weight every rank equally however many tokens it saw.

    * FSDP2: every ``fully_shard``-ed module, wherever it sits in ``model``,
      gets ``set_gradient_divide_factor(1.0)`` and
      ``set_force_sum_reduction_for_comms(True)``, so the reduce-scatter (and
      HSDP's all-reduce) is a plain SUM with no pre- or post-scaling (gloo has
      no ``PREMUL_SUM``, and NCCL's zero-copy paths need plain SUM). FSDP2
      adds each sync's reduce-scattered grad to the sharded one, so any sync
      pattern is counted once.
    * DDP (``model`` itself or any DDP module inside it): a summing comm hook,
      :func:`gradtx.comm.torch_dist.ddp_sum_hook`, made correct whatever the
      sync pattern. DDP all-reduces the whole accumulated ``.grad``, so a
      plain sum hook would count every earlier synced micro-step once per rank
      (``sum_r(S + g_r) = W·S + sum_r g_r``), where DDP's mean is harmless
      (``mean_r(S + g_r) = S + mean_r g_r``). The hook therefore remembers which
      grads hold a synced (replicated) sum, and a grad hook on each param
      divides such a ``.grad`` by ``W`` before the next backward adds to it, so
      the next sum restores it: syncing on every micro-step, on the last one
      only (:meth:`TransformedOptimizer.maybe_no_sync`), or any mix, gives
      ``sum over ranks and micro-steps``. DDP takes one comm hook; call this
      once, before the first backward, on a DDP without one.
    * Pipelining (``torch.distributed.pipelining``) is configured elsewhere:
      build the schedule with ``scale_grads=False``.

    Args:
      model: a module holding DDP or FSDP2 (``fully_shard``) modules anywhere, itself included.

    Returns:
      ``model``, configured in place.

    Raises:
      TypeError: ``model`` holds neither (a one-process model sums nothing).

    References:
      xorl, "Gradient Accumulation & Token Normalization" (FSDP2 ``set_gradient_divide_factor(1.0)``).

    Example:
      >>> model = gtx.sum_grad_reduction(fully_shard(model))
      >>> tx = gtx.chain(gtx.accumulate(4, token_weighted=True, comm=comm, group="dp"), gtx.adamw(3e-4))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sum_grad_reduction: model must be a torch.nn.Module, got {type(model).__name__}")
    fsdp: list[Any] = [m for m in model.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]
    ddp: list[Any] = [
        m for m in model.modules() if DistributedDataParallel is not None and isinstance(m, DistributedDataParallel)
    ]
    if not fsdp and not ddp:
        raise TypeError(
            f"sum_grad_reduction: model must be DistributedDataParallel or contain fully_shard (FSDP2) or DDP modules, "
            f"got {type(model).__name__} with neither; a one-process model needs no call"
        )
    # Both setters act on one module's own state, not recursively, so each is visited.
    for module in fsdp:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    for module in ddp:
        _sum_ddp(module)
    return model


def _sum_ddp(module: Any) -> None:
    from gradtx.comm.torch_dist import DDPSumState, ddp_sum_hook  # the comm layer issues the collective

    state = DDPSumState(module.process_group)
    module.register_comm_hook(state, ddp_sum_hook)

    def hook_for(param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            state.rescale(param)
            return grad

        return hook

    for param in module.module.parameters():
        if param.requires_grad:
            # A leaf's tensor hook runs before autograd adds the new grad into .grad: the moment to
            # turn a synced sum back into its 1/W share.
            param.register_hook(hook_for(param))
