"""TransformedOptimizer: run a gradtx chain on ``p.grad`` in front of any ``torch.optim`` optimizer.

The facade. Its parts: :mod:`gradtx.wrapper.grads` (which params, their
``.grad``), :mod:`gradtx.wrapper.amp` (GradScaler across a window),
:mod:`gradtx.wrapper.inner` (the inner optimizer's state and step),
:mod:`gradtx.wrapper.state_dict` (the checkpoint format and the state in
``optimizer.state``), :mod:`gradtx.wrapper.sync` (data-parallel sync) and
:mod:`gradtx.wrapper.kinds` (what it reads about the chain's members).
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradtx.checkpoint import functional as _ckpt
from gradtx.core.base import GradientTransformation, OptState, metrics
from gradtx.optimizers.standard import OptimizerChain
from gradtx.runtime.executor import StepPlan
from gradtx.transforms.combine import chain
from gradtx.wrapper import amp, grads, inner, kinds
from gradtx.wrapper import state_dict as _sd
from gradtx.wrapper.sync import data_parallel_modules, no_sync

# The extra the wrapper passes itself: it owns the .grad buffers.
_RESERVED = frozenset({"inplace"})
_PICKLED_GRADS = "_pickled_window_grads"  # an open window's .grad, which pickle leaves out of a Parameter


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
        # Stand-ins for the inner state of params the inner optimizer has not stepped yet (see wrapper.inner),
        # and each param's "gradtx" entry: what opt.state shows.
        self.stand_ins: dict[torch.Tensor, dict[str, Any]] = {}
        self.entries: dict[torch.Tensor, dict[str, Any]] = {}
        # False after a backward that skipped the data-parallel sync: the window's partial sums are not in .grad.
        self.synced = True
        # The learning rates when the window opened: a change inside the window means a per-call scheduler.
        self.window_lrs: list[Any] | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A _Live pickled before the newer fields existed gets their defaults.
        self.__init__(state.get("tx_state"))  # type: ignore[misc]
        self.__dict__.update(state)


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
        needs_closure = inner.needs_closure(optimizer)
        if needs_closure and kinds.accumulates(plan):
            raise ValueError(
                f"TransformedOptimizer: {type(optimizer).__name__} reevaluates the model through its closure several "
                "times per step, and the chain is applied to the grads of every evaluation, but the chain holds "
                "gtx.accumulate, which cannot be applied per evaluation; take gtx.accumulate out of the chain "
                "(a closure can sum micro-batches itself)"
            )
        self.optimizer = optimizer
        self._user_tx = tx  # what pickle stores; self.tx and self._plan are rebuilt from it
        self.tx = full
        self._plan = plan
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._needs_closure = needs_closure
        self._tree = grads.trainable(optimizer.param_groups)
        self._frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad]
        self._fp64 = any(p.dtype == torch.float64 for p in grads.flat(self._tree))  # grad_scale is fp32
        self._live = _Live(self.tx.init(self.param_tree()))  # what a step writes (see _Live)
        # The chain's structure is fixed, so a step branches on nothing else. A chain whose body transforms
        # .grad in place is snapshotted on an emitting step, so a member that raises leaves it as it was.
        self._accumulates = kinds.accumulates(plan)
        self._body_mutates = self._plan.tail_start > self._plan.body_start or self._plan.terminal is not None
        self._mirror = _sd.Mirror()
        self._install()

    def _install(self) -> None:
        """Give every param a state to show (a stand-in where the inner optimizer has none) and its gradtx entry."""
        live = self._live
        self._drop_stand_ins()
        live.stand_ins.update(inner.materialize(self.optimizer, [p for p in self._flat() if p not in live.stand_ins]))
        self._publish(force=True)

    def _drop_stand_ins(self) -> None:
        """Forget the stand-ins of params the inner optimizer now holds a state for."""
        live = self._live
        if live.stand_ins:
            live.stand_ins = {p: s for p, s in live.stand_ins.items() if not inner.started(self.optimizer, p)}

    def _flat(self) -> list[torch.Tensor]:
        return grads.flat(self._tree)

    def _publish(self, *, force: bool = False) -> None:
        """Point ``optimizer.state[p]["gradtx"]`` at the live transform state."""
        if force:
            self._mirror.reset()
        self._mirror.publish(self._live.entries, self._live.tx_state, self._tree)

    # torch.optim.Optimizer surface, delegated to the inner optimizer -----------------------

    @property
    def tx_state(self) -> OptState:
        """The transform's state (a pytree of tensors); also in ``optimizer.state[p]["gradtx"]``."""
        return self._live.tx_state

    @tx_state.setter
    def tx_state(self, value: OptState) -> None:
        self._live.tx_state = value
        self._publish()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """Each param's state: the inner optimizer's (a stand-in before its first step) and a ``"gradtx"`` entry.

        The ``"gradtx"`` entry holds the transform's state for the param (the
        first param's also holds the global part under ``"global"``), present
        from the moment the wrapper is built, so code that reads or rebuilds
        an optimizer's state from ``optimizer.state`` carries it. After a
        compiled step the entries catch up at the next eager call.
        """
        return _sd.StateView(self)

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"TransformedOptimizer({self.optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        # Anything this class does not define (step/state-dict hook registries, private fields that
        # torch.optim.Optimizer's methods expect) is the inner optimizer's, since we skip its __init__.
        # GradScaler's grad_scale/found_inf are the wrapper's own, never the inner optimizer's.
        if name in ("optimizer", "grad_scale", "found_inf", "_live", "_tree", "_mirror") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    # copies: pickle and deepcopy ----------------------------------------------------------------

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
        window = self._window_grads("pickle")
        if window is not None:
            state[_PICKLED_GRADS] = window
        return state

    def _window_grads(self, what: str) -> list[torch.Tensor | None] | None:
        if not kinds.window_open(self._plan, self.tx_state):
            return None
        _sd.check_sums_visible(self, grads.flat(self._tree), f"TransformedOptimizer {what}")
        return grads.window_grads(self._tree)

    def _plain_state(self) -> dict[str, Any]:
        # An lr scheduler patches `step` on the instance with a wrapper bound to this very object (a weakref):
        # a copy keeps the class's own step, as torch.optim.Optimizer's pickling does.
        return {k: v for k, v in self.__dict__.items() if k not in ("grad_scale", "found_inf", "step", "_mirror")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        window = state.pop(_PICKLED_GRADS, None)
        synced = state.pop("_ckpt_synced", True)  # a wrapper pickled by an earlier version kept it here
        self.__dict__.update(state)
        if "tx" not in state:
            self.tx = chain(self._user_tx)
            self._plan = StepPlan.of(self.tx)
        if "_needs_closure" not in state:
            self._needs_closure = inner.needs_closure(self.optimizer)
        if "synced" not in state["_live"].__dict__:
            self._live.synced = synced
        if window is not None:
            grads.put_window_grads(self._tree, window)
        # A wrapper pickled by 0.1.0 holds no running-sum placeholders: give it the structure it keeps now.
        self._live.tx_state = _ckpt.with_empty_sums(self._live.tx_state, self.param_tree())
        self._mirror = _sd.Mirror()
        self._install()

    def __deepcopy__(self, memo: dict[int, Any]) -> TransformedOptimizer:
        # An in-process copy shares the transform and its plan (pure functions); everything else is copied.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for shared in (self.tx, self._plan, self._user_tx):
            memo[id(shared)] = shared
        new.__dict__.update(copy.deepcopy(self._plain_state(), memo))
        window = self._window_grads("deepcopy")
        if window is not None:
            grads.put_window_grads(new._tree, copy.deepcopy(window, memo))
        new._mirror = _sd.Mirror()
        new._install()
        return new

    # the params the transform sees -------------------------------------------------------------

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
        self._check_groups()
        self.optimizer.add_param_group(param_group)
        group = self.optimizer.param_groups[-1]
        tree = [*self.param_tree(), [p for p in group["params"] if p.requires_grad]]
        try:
            new_state = grads.regrow(self.tx, self.tx_state, self._tree, tree)
        except Exception:
            self.optimizer.param_groups.pop()  # atomic: the inner optimizer is as it was
            raise
        self._frozen = [*self._frozen, *(p for p in group["params"] if not p.requires_grad)]
        self._grow(tree, new_state)

    def _grow(self, tree: grads.ParamTree, new_state: OptState) -> None:
        self._tree = [list(g) for g in tree]
        self._fp64 = any(p.dtype == torch.float64 for p in grads.flat(tree))
        self._live.tx_state = new_state
        self._install()

    def param_tree(self) -> list[list[torch.Tensor]]:
        """The params tree the transform sees: one list per param group.

        The params that required grad when the wrapper was built, those of
        groups added with :meth:`add_param_group`, and params unfrozen since:
        a param whose ``requires_grad`` became True joins at the first step
        where it has a grad, with a fresh transform state (as a ``torch.optim``
        optimizer starts stepping it then). A param frozen later stays and gets
        no grad. Build a :func:`gradtx.mesh_groups` plan for the wrapper from
        this tree, so the plan's leaf order is the transform's.
        """
        return [list(g) for g in self._tree]

    def _check_groups(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self._tree):
            raise ValueError(
                f"TransformedOptimizer: the inner optimizer has {len(groups)} param groups, the transform state was "
                f"built for {len(self._tree)}; add groups with opt.add_param_group (the wrapper's), "
                "not opt.optimizer.add_param_group"
            )

    def _join_unfrozen(self) -> None:
        """Params unfrozen since the tree was built, now holding a grad, join it with a fresh transform state."""
        if not any(p.requires_grad and p.grad is not None for p in self._frozen):
            return
        tree = grads.joined(self._tree, self.optimizer.param_groups)
        if tree is None:  # pragma: no cover - the check above found one
            return
        new_state = grads.regrow(self.tx, self.tx_state, self._tree, tree)
        members = {id(p) for p in grads.flat(tree)}
        self._frozen = [p for p in self._frozen if id(p) not in members]
        self._grow(tree, new_state)

    def _check_lrs(self) -> None:
        """Refuse a learning rate that changed inside an accumulation window: something steps per call."""
        saved = self._live.window_lrs
        if not self._live.window_open or saved is None:
            return
        for i, (group, lr) in enumerate(zip(self.optimizer.param_groups, saved)):
            now = group.get("lr")
            if isinstance(now, (int, float)) and isinstance(lr, (int, float)) and now != lr:
                raise ValueError(
                    f"TransformedOptimizer.step: param group {i}'s lr changed from {lr} to {now} inside an "
                    "accumulation window: an lr scheduler steps once per step() call, so whatever drives it counts "
                    "every micro-step as an optimizer step (the Hugging Face Trainer and accelerate do). Take "
                    "gtx.accumulate out of the chain and use that framework's own accumulation (TrainingArguments("
                    "gradient_accumulation_steps=k), Accelerator(gradient_accumulation_steps=k)), or step the "
                    "scheduler only when opt.emitted is True"
                )

    # stepping -----------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **extra: Any) -> Any:  # type: ignore[override]
        """Run the transform on the grads and step the inner optimizer if it emitted.

        Args:
          closure: as in ``torch.optim``: reevaluates the model (forward and
            backward) and returns the loss. With an inner optimizer whose step
            takes a closure (``torch.optim.LBFGS``), the inner optimizer calls it
            as often as it needs and the chain runs on the grads of every
            evaluation. Otherwise it is called once, under ``torch.enable_grad()``,
            before the grads are read; not allowed with :func:`gradtx.accumulate`
            in the chain (whoever passes a closure, Lightning for one, counts
            every call as an optimizer step).
          **extra: forwarded to every transform, e.g. ``tokens=n``, ``flush=True``.

        Returns:
          The closure's return value, or ``None`` without a closure. Whether the
          inner optimizer stepped is :attr:`emitted`.
        """
        if closure is not None and not callable(closure):
            raise TypeError(f"TransformedOptimizer.step: closure must be callable, got {type(closure).__name__}")
        if self._needs_closure:
            if closure is None:
                raise TypeError(
                    f"TransformedOptimizer.step: the inner {type(self.optimizer).__name__} needs a closure that "
                    "reevaluates the model and returns the loss: opt.step(closure)"
                )
            return self._closure_step(closure, extra)
        if closure is not None and self._accumulates:
            raise ValueError(
                "TransformedOptimizer.step: gtx.accumulate is in the chain, but step(closure) is called: whoever "
                "passes the closure (Lightning's automatic optimization does) counts every call as an optimizer "
                "step (its global step, its scheduler) while only every k-th call steps. Take gtx.accumulate out "
                "of the chain and use the caller's own accumulation (Lightning: Trainer(accumulate_grad_batches=k)); "
                "or drive the wrapper yourself: loss.backward(); opt.step() with no closure"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step(extra)
        return loss

    def _prepare(self, extra: dict[str, Any]) -> None:
        reserved = sorted(_RESERVED & extra.keys())
        if reserved:
            raise ValueError(f"TransformedOptimizer.step: {reserved} are set by the wrapper itself; do not pass them")
        self._check_groups()
        if self._frozen:
            self._join_unfrozen()
        if self._accumulates:
            self._check_lrs()

    def _step(self, extra: dict[str, Any]) -> None:
        self._prepare(extra)
        # Set by torch.amp.GradScaler.step for the duration of this call: the grads carry grad_scale
        # (None after scaler.unscale_(opt)), and found_inf says whether they hold an inf or NaN.
        grad_scale: torch.Tensor | None = self.__dict__.get("grad_scale")
        found_inf: torch.Tensor | None = self.__dict__.get("found_inf")
        params = self.param_tree()
        emitting = self.emits_next(flush=bool(extra.get("flush", False)))
        amp.check_unscale(found_inf, grad_scale, accumulates=self._accumulates, emitting=emitting)
        owned = grads.read(params, emitting=emitting)
        updates, new_state, factor, skip = self._run_chain(owned, params, extra, amp.inv_scale(grad_scale))
        window_open = self._accumulates and kinds.window_open(self._plan, new_state)

        live = self._live
        verdict = amp.verdict(
            found_inf, grad_scale, live.amp_scale, live.amp_inf, emitted=updates is not None, window_open=window_open
        )
        if verdict.found is not None:
            new_state = kinds.keep_on_skip(verdict.found, self.tx_state, new_state)
            skip = verdict.found if skip is None else (skip | verdict.found.to(skip.device))
        if updates is not None:
            self._apply(params, updates, factor, skip)
        elif verdict.drop_partial_sum:
            # The window will be skipped; an inf left in .grad would make GradScaler back off again on
            # every remaining micro-step, where torch's recipe backs off once per window.
            grads.drop(params)
        # Commit only now: a step that raised above left the state as it was.
        self._commit(new_state, window_open, emitted=updates is not None)
        live.amp_scale, live.amp_inf = verdict.scale, verdict.inf

    def _commit(self, new_state: OptState, window_open: bool, *, emitted: bool) -> None:
        live = self._live
        if window_open and not live.window_open and not torch.compiler.is_compiling():
            live.window_lrs = [g.get("lr") for g in self.optimizer.param_groups]
        live.tx_state = new_state
        live.window_open = window_open
        live.emitted = emitted
        live.metrics = metrics(new_state)
        if not torch.compiler.is_compiling():  # a compiled step's entries catch up at the next eager call
            if emitted:
                self._drop_stand_ins()
            self._publish()

    def _closure_step(self, closure: Callable[[], Any], extra: dict[str, Any]) -> Any:
        """The inner optimizer drives the closure; the chain runs on the grads of every evaluation."""

        def evaluate() -> Any:
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                params = self.param_tree()
                updates, new_state, factor, skip = self._run_chain(
                    grads.read(params, emitting=True), params, extra, None
                )
                if skip is not None:  # a guard's skip: this evaluation's grads count as zero
                    keep = (~skip).to(torch.float32)
                    factor = keep if factor is None else factor * keep.to(factor.device)
                grads.write(params, updates)
                if factor is not None:
                    grads.scale(params, factor)
                self._commit(new_state, False, emitted=True)
            return loss

        with torch.no_grad():
            self._prepare(extra)
            return self._inner_step(evaluate)

    def _run_chain(
        self,
        owned: list[list[torch.Tensor]],
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
            snapshot = [g.clone() for group in owned for g in group]
        try:
            result = self._plan.run_owned(
                owned, self.tx_state, params, autograd_buffer=True, inv_scale=inv_scale, **extra
            )
        except BaseException:
            if snapshot is not None:
                torch._foreach_copy_([g for group in owned for g in group], snapshot)
            raise
        return result.updates, result.state, result.factor, result.skip

    def _apply(
        self,
        params: list[list[torch.Tensor]],
        updates: Any,
        factor: torch.Tensor | None,
        skip: torch.Tensor | None,
    ) -> None:
        replaced = grads.write(params, updates)
        try:
            # Under torch.compile, dynamo drops writes to an optimizer's attributes, so grad_scale/found_inf
            # cannot reach the fused kernel there: the factor is applied to the grads instead (inductor fuses it).
            if self._fused and not torch.compiler.is_compiling():
                if factor is not None and self._fp64:
                    # torch's fused kernels read grad_scale as fp32: fp64 grads take the factor in fp64.
                    grads.scale(params, factor)
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
                grads.scale(params, factor)
            self._inner_step()
        except BaseException:
            grads.undo(replaced)
            raise

    def _inner_step(self, closure: Callable[[], Any] | None = None) -> Any:
        if torch.compiler.is_compiling() and not inner.has_step_hooks(self.optimizer):
            # torch.optim's step wrappers insert graph breaks (to keep the optimizer graph an inference
            # graph, which the surrounding no_grad already makes it), so fullgraph=True could never hold.
            return inner.raw_step(self.optimizer, closure)
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

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
        # After a backward that skipped the sync, the window's partial sums are not in .grad.
        self._live.synced = sync or not any(data_parallel_modules(model))
        with no_sync(model, sync=sync):
            yield

    # checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The checkpoint in ``torch.optim``'s layout: ``state`` per parameter and ``param_groups``.

        Each parameter's entry is the inner optimizer's (``exp_avg``, ``step``, ...)
        plus a ``"gradtx"`` dict: the transform's per-parameter state (a DTensor
        where the param is one, so it reshards), the open accumulation window's
        partial sum (a copy of the param's ``.grad``; zeros at a boundary, so the
        keys never depend on where the window stands) and whether the param had
        a grad, whether the inner optimizer has stepped the param yet, and, on
        the first parameter only, the transform's global state under
        ``"global"`` (counters, the window's micro-step and token count, the
        last grad norm). So ``torch.distributed.checkpoint.state_dict.get_state_dict``
        / ``get_optimizer_state_dict`` (full or sharded, flattened or not),
        ``dcp.save`` and ``torch.save`` take it as they take any optimizer's.
        See ``docs/checkpointing.md``.

        Raises:
          ValueError: a window is open and its partial sums are not in ``.grad``
            (they sit inside DDP/FSDP2 after a :meth:`maybe_no_sync` backward that
            did not sync): save at a window boundary, or make the window's last
            micro-step sync (``step(flush=True)`` after ``maybe_no_sync(model, flush=True)``).
        """
        return _sd.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`, or adopt a plain ``torch.optim`` checkpoint; checks everything first.

        Accepts what :meth:`state_dict` made, also after torch's
        ``set_optimizer_state_dict`` / ``dcp.load`` (flattened or not) or
        torchtitan's loader re-keyed it. A checkpoint of the bare inner
        optimizer class (no ``"gradtx"`` entries) loads too: the inner state is
        restored and the transform starts fresh (``tx.init``), as when a running
        project adopts gradtx.

        Before anything changes it checks the param groups and counts, the
        inner state's shapes, and the transform's: the same chain (keys), the
        same accumulation ``k``, shapes and dtypes. The first difference raises a
        ``ValueError`` naming it, and the optimizer is left as it was. A window
        that was open when saved is open again, its partial sums in ``.grad``
        (a param that had no grad has none); one saved at a boundary leaves
        every ``.grad`` ``None``.
        """
        _sd.load_state_dict(self, state_dict)

    def _commit_loaded(
        self,
        new_state: OptState,
        window_open: bool,
        record: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        live = self._live
        live.tx_state = new_state
        live.window_open = window_open
        live.emitted = False
        live.amp_scale, live.amp_inf = record if record is not None and window_open else (None, None)
        live.synced = True
        live.window_lrs = [g.get("lr") for g in self.optimizer.param_groups] if window_open else None
        live.metrics = metrics(new_state)
        self._install()
