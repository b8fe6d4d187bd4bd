"""TransformedOptimizer: run a gradtx chain on ``p.grad`` in front of any ``torch.optim`` optimizer.

Its parts: :mod:`gradtx.wrapper.rules` (the chain read by type, and the speed
rules), :mod:`gradtx.wrapper.amp` (GradScaler across a window),
:mod:`gradtx.wrapper.state_dict` (the checkpoint format, ``opt.state``), :mod:`gradtx.wrapper.copies`
(pickle, deepcopy), :mod:`gradtx.wrapper.grads` (which params, their ``.grad``), :mod:`gradtx.wrapper.live`
(what a step writes) and :mod:`gradtx.wrapper.sync` (data-parallel sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, metrics
from gradtx.transforms.combine import chain
from gradtx.wrapper import amp, copies, grads, loop_checks, rules
from gradtx.wrapper import state_dict as _sd
from gradtx.wrapper.live import Live
from gradtx.wrapper.sync import data_parallel_modules, no_sync


class TransformedOptimizer(torch.optim.Optimizer):
    """Make any ``torch.optim`` optimizer apply a gradtx transform to ``p.grad`` first.

    ``step(closure=None, **extra)`` follows ``torch.optim.Optimizer.step``: it
    calls the closure (if any) once under ``torch.enable_grad()``, reads every
    ``p.grad``, runs ``tx`` on them (extras such as ``tokens=n`` or
    ``flush=True`` reach every member), writes the result back to ``p.grad``
    and calls the inner optimizer's ``step`` only when the chain emits. It
    returns the closure's loss (``None`` without a closure); :attr:`emitted`
    says whether the inner optimizer stepped.

    The wrapper is a ``torch.optim.Optimizer``: ``param_groups`` is the inner
    optimizer's list (schedulers work on it), step hooks registered on it run,
    and ``opt.state[p]`` shows the inner state with a ``"gradtx"`` entry, so
    engines that checkpoint optimizers generically carry it. The transform's
    state is :attr:`tx_state`.

    Speed rules (:mod:`gradtx.wrapper.rules`), for gradtx's own transforms:
    with :func:`gradtx.accumulate` first in the chain, autograd's own summation
    into ``.grad`` is the window (no second buffer; :meth:`zero_grad` does
    nothing while a window is open, so the ordinary ``backward(); step();
    zero_grad()`` loop accumulates unchanged); the window's mean and a trailing
    clip coefficient become a fused optimizer's ``grad_scale`` (one multiply of
    ``.grad`` otherwise), and :func:`gradtx.apply_if_finite`'s verdict its
    ``found_inf``. ``torch.optim.Adam/AdamW(fused=True)`` is stepped by calling
    torch's fused kernel directly on cached lists of its own state. A step that
    raises leaves ``.grad``, the transform state and the inner state as they were.

    ``torch.amp.GradScaler``: the chain sees unscaled grads (clipping
    included), and a step with an inf or NaN is skipped, its transform and
    inner state unchanged. GradScaler hands the wrapper its scale and inf flag
    when the inner optimizer is fused or the chain accumulates (see
    :attr:`_step_supports_amp_scaling`); otherwise it unscales and skips as
    for the inner optimizer alone.

    Data parallel (DDP or FSDP2): wrap each micro-step's forward and backward
    in :meth:`maybe_no_sync` (see ``docs/accumulation.md``).

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

    @property
    def _step_supports_amp_scaling(self) -> bool:  # read by GradScaler.step (and Lightning)
        """Whether GradScaler hands the wrapper its scale and inf flag rather than unscaling ``.grad`` and not
        calling a step it skips: when the inner optimizer takes them (fused: the scale rides in the kernel), the
        chain accumulates (a window sums micro-steps GradScaler would each unscale; its skip is the wrapper's), or
        it sums the grads over ranks (the step refuses a skip read from this rank's grads alone, which would leave
        the others waiting in the sum). Otherwise GradScaler does what it does for the inner optimizer alone, which
        accelerate and the Hugging Face Trainer read: a step it does not call was skipped, and their schedulers
        hold."""
        # getattr: a framework's proxy of the wrapper (see add_param_group) reads the wrapper's plan and answer.
        plan = getattr(self, "_plan", None)
        return plan is not None and (plan.window is not None or plan.summed or rules.scales_in_kernel(self.optimizer))

    def __init__(self, optimizer: torch.optim.Optimizer, tx: GradientTransformation) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"TransformedOptimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, TransformedOptimizer):
            raise TypeError("TransformedOptimizer: optimizer is already a TransformedOptimizer; chain the transforms")
        check.transform(tx, arg="tx", name="TransformedOptimizer")
        grads.check_unique(optimizer.param_groups)
        self.optimizer = optimizer
        self._user_tx = tx  # what pickle stores; self.tx and self._plan are rebuilt from it
        self._setup_tx()
        self._needs_closure = grads.needs_closure(optimizer)
        if self._needs_closure and self._plan.window is not None:
            raise ValueError(loop_checks.closure_optimizer_with_window(optimizer))
        # torch.optim.Optimizer's own set-up (hooks, step profiling); the groups are then the inner optimizer's list.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._set_tree(grads.trainable(optimizer.param_groups))
        self._live = Live(self.tx.init(self._tree), self._device)

    def _setup_tx(self) -> None:
        self.tx = chain(self._user_tx)
        self._plan = rules.Plan(self.tx)
        loop_checks.check_no_optimizer(self._plan.members, self.optimizer)
        self._fused = rules.FusedAdam(self.optimizer) if rules.FusedAdam.fits(self.optimizer) else None
        self._state_view = _sd.StateView(self)

    def _set_tree(self, tree: grads.ParamTree) -> None:
        self._tree = [list(g) for g in tree]
        self._flat = tu.flatten(self._tree)[0]
        self._position = {p: i for i, p in enumerate(self._flat)}  # by identity: a tensor hashes by id
        # The groups' params the transform does not see (frozen when they joined the groups): checked at each step.
        self._frozen = [p for g in self.optimizer.param_groups for p in g["params"] if p not in self._position]
        self._lists = [list(g["params"]) for g in self.optimizer.param_groups]
        # Fused kernels read grad_scale as fp32. Read at the next step: torch.optim allows a cast (model.double())
        # after it is built, up to its first step, where it makes its state.
        self._fp64: bool | None = None

    @property
    def _device(self) -> torch.device:
        # Read each time: accelerate's prepare moves the model after the optimizer is built (see load_state_dict).
        return tu.device_of(self._flat[:1])

    # torch.optim.Optimizer surface ----------------------------------------------------------------

    @property
    def state(self) -> Any:  # type: ignore[override]
        """Each param's state: the inner optimizer's and a ``"gradtx"`` entry, the transform's state for it.

        The ``"gradtx"`` entry is there from the moment the wrapper is built
        (the first param's also holds the global part under ``"global"``), so
        code that checks whether an optimizer has state, or rebuilds a loaded
        state from the keys it finds here, carries it. Before the inner
        optimizer's first step its keys are shown with stand-in values, made
        when first asked for (see :mod:`gradtx.wrapper.state_dict`).
        """
        return self._state_view

    @state.setter
    def state(self, value: Any) -> None:
        # torch.optim.Optimizer.__init__ sets an empty dict first: ignored. After that, as for a torch optimizer,
        # assigning a mapping (``defaultdict(dict)`` to reset) replaces every param's state with the mapping's.
        if "_live" in self.__dict__ and value is not self._state_view:
            entries = {p: _sd.plain(s) for p, s in dict(value).items()}
            self._state_view.clear()
            self._state_view.update(entries)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's own list (its ``load_state_dict`` replaces it), so schedulers drive both."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        if "_live" in self.__dict__:  # torch.optim.Optimizer.__init__ sets an empty list first: ignored
            self.optimizer.param_groups = value

    @property
    def tx_state(self) -> OptState:
        """The transform's state (a pytree of tensors); also in ``opt.state[p]["gradtx"]``."""
        return self._live.tx_state

    @tx_state.setter
    def tx_state(self, value: OptState) -> None:
        self._live.tx_state = value

    def __repr__(self) -> str:
        return f"TransformedOptimizer({self.optimizer!r})"

    # copies: pickle and deepcopy --------------------------------------------------------------------

    __getstate__ = copies.getstate
    __setstate__ = copies.setstate
    __deepcopy__ = copies.deepcopy

    # the params the transform sees -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer and grow the transform state for it.

        The existing groups keep their transform state; the new group's leaves
        start from ``tx.init``. Not allowed while an accumulation window is open
        (``.grad`` holds a partial sum the new group has no part in).

        Args:
          param_group: as for ``torch.optim.Optimizer.add_param_group``.
        """
        if isinstance(self.optimizer, TransformedOptimizer):
            # A framework's proxy of the wrapper (Lightning's self.optimizers(), Fabric's): an instance of a subclass
            # of this class made around it (its .optimizer), forwarding only what it lacks. The wrapper acts.
            return self.optimizer.add_param_group(param_group)
        if "_live" not in self.__dict__:  # torch.optim.Optimizer.__init__ registering the inner groups
            return
        if self._live.window_open:
            raise ValueError(
                "TransformedOptimizer.add_param_group: an accumulation window is open; add the group after the "
                "step that emits (opt.emitted is True)"
            )
        grads.check_groups(self.optimizer.param_groups, self._tree)
        self._follow_groups()  # a hand edit first: _grow below records the lists as they are now
        self.optimizer.add_param_group(param_group)
        try:
            grads.check_unique(self.optimizer.param_groups)
            self._grow([*self._tree, grads.trainable(self.optimizer.param_groups[-1:])[0]])
        except Exception:
            self.optimizer.param_groups.pop()  # atomic: the inner optimizer is as it was
            raise

    def param_tree(self) -> list[list[torch.Tensor]]:
        """The params tree the transform sees: one list per param group.

        The params that required grad when the wrapper was built, those of
        groups added with :meth:`add_param_group`, and params unfrozen since:
        a param frozen then joins at the first step where it has a grad, with a
        fresh transform state (as a ``torch.optim`` optimizer, which steps every
        param with a grad, starts stepping it then). A param frozen later stays and gets
        no grad. Build a :func:`gradtx.mesh_groups` plan for the wrapper from
        this tree, so the plan's leaf order is the transform's.
        """
        return [list(g) for g in self._tree]

    def _grow(self, tree: grads.ParamTree) -> None:
        """Make ``tree`` the transform's: its params already there keep their state, new ones start fresh."""
        new_state = grads.regrow(self.tx, self._live.tx_state, self._tree, tree)
        self._set_tree(tree)
        self._live.tx_state = new_state

    # stepping -----------------------------------------------------------------------------------------

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
          **extra: forwarded to every transform, e.g. ``tokens=n``, ``flush=True``, ``loss=...``.

        Returns:
          The closure's return value, or ``None`` without a closure. Whether the
          inner optimizer stepped is :attr:`emitted`.
        """
        if rules.has_hooks(self):
            return self._step_with_hooks(closure, **extra)
        return self._step_closure(closure, **extra)

    # torch.optim.Optimizer.__init__ wraps a class's step with its profiling and hook runner unless it is
    # marked; those wrappers cost a graph break under torch.compile, so step calls the runner only for hooks.
    step.hooked = True  # type: ignore[attr-defined]

    def _step_closure(self, closure: Callable[[], Any] | None = None, **extra: Any) -> Any:
        if closure is not None and not callable(closure):
            raise TypeError(f"TransformedOptimizer.step: closure must be callable, got {type(closure).__name__}")
        if self._needs_closure:
            if closure is None:
                raise TypeError(
                    f"TransformedOptimizer.step: the inner {type(self.optimizer).__name__} needs a closure that "
                    "reevaluates the model and returns the loss: opt.step(closure)"
                )
            return self._closure_step(closure, extra)
        if closure is not None and self._plan.window is not None:
            raise ValueError(loop_checks.CLOSURE_WITH_WINDOW)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step(extra)
        return loss

    # torch's own runner of the step hooks (registered on the wrapper, and global ones), in its profiler range.
    _step_with_hooks = torch.optim.Optimizer.profile_hook_step(_step_closure)

    def _follow_groups(self) -> None:
        """Params added to a group's list by hand (as torch.optim takes them) join once they have a grad, as frozen
        ones do (:meth:`_prepare`); params taken out leave the transform."""
        groups = self.optimizer.param_groups
        if len(groups) == len(self._tree) and not grads.same_lists(self._lists, groups):
            self._grow([[p for p in g["params"] if p in self._position] for g in groups])

    def _prepare(self) -> None:
        grads.check_groups(self.optimizer.param_groups, self._tree)
        self._follow_groups()
        grown = grads.joined(self._tree, self.optimizer.param_groups, self._frozen, self._plan.summed)
        if grown is not None:  # params frozen at the build, now with a grad, join with a fresh state
            self._grow(grown)
        loop_checks.check_lrs(self._live, self.optimizer.param_groups, self._plan.window)

    def _step(self, extra: dict[str, Any]) -> None:
        if not self._live.synced and self._plan.emits_next(self._live.tx_state, flush=extra.get("flush", False)):
            raise ValueError(loop_checks.UNSYNCED_EMIT)
        self._prepare()
        # Set by torch.amp.GradScaler.step for the duration of this call: the grads carry grad_scale
        # (None after scaler.unscale_(opt)), and found_inf says whether they hold an inf or NaN.
        grad_scale: torch.Tensor | None = self.__dict__.get("grad_scale")
        found_inf: torch.Tensor | None = self.__dict__.get("found_inf")
        plan = self._plan
        emitting = plan.emits_next(self._live.tx_state, flush=extra.get("flush", False))
        amp.check_flags(found_inf, grad_scale, emitting=emitting, summed=plan.summed)
        tree = grads.read(self._tree, emitting, summed=plan.summed, tied=plan.tied)
        result = plan.run(tree, self._live.tx_state, self._tree, extra, amp.inv_scale(grad_scale), self._device)
        new_state, skip = result.state, result.skip
        emitted = result.updates is not None
        window_open = not emitted and plan.window_open(new_state)
        verdict = amp.verdict(
            found_inf, grad_scale, self._live.amp_scale, self._live.amp_inf, emitted=emitted, window_open=window_open
        )
        if verdict.found is not None:
            new_state = rules.keep_on_skip(plan, verdict.found, self._live.tx_state, new_state)
            skip = verdict.found if skip is None else (skip | verdict.found.to(skip.device))
        if emitted:
            self._apply(result.updates, tree, new_state, result.factor, skip)
        elif verdict.drop_partial_sum:
            # The window will be skipped; an inf left in .grad would make GradScaler back off again on
            # every remaining micro-step, where torch's recipe backs off once per window.
            for p in self._flat:
                p.grad = None
        # Commit only now: a step that raised above left the state as it was.
        self._commit(new_state, window_open, emitted)
        self._live.amp_scale, self._live.amp_inf = verdict.scale, verdict.inf

    def _commit(self, new_state: OptState, window_open: bool, emitted: bool) -> None:
        loop_checks.check_lrs(self._live, self.optimizer.param_groups, self._plan.window, record=True)
        self._live.tx_state = new_state
        self._live.window_open = window_open
        self._live.emitted = emitted
        if emitted and self._live.stand_ins:
            self._live.stand_ins = {p: s for p, s in self._live.stand_ins.items() if not self.optimizer.state.get(p)}

    def _closure_step(self, closure: Callable[[], Any], extra: dict[str, Any]) -> Any:
        """The inner optimizer drives the closure; the chain runs on the grads of every evaluation."""

        def evaluate() -> Any:
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                tree = grads.read(self._tree, True, summed=self._plan.summed, tied=self._plan.tied)
                result = self._plan.run(tree, self._live.tx_state, self._tree, extra, None, self._device)
                factor = result.factor
                if result.skip is not None:  # a guard's skip: this evaluation's grads count as zero
                    keep = (~result.skip).to(torch.float32)
                    factor = keep if factor is None else factor * keep.to(factor.device)
                grads.write(self._tree, grads.not_holding(result.updates, (result.state, self._flat)))
                if factor is not None:
                    tu.scale_leaves([p.grad for p in self._flat if p.grad is not None], factor, write_back=True)
                self._commit(result.state, False, True)
            return loss

        with torch.no_grad():
            self._prepare()
            return self.optimizer.step(evaluate)

    def _apply(self, updates: Any, tree: Any, state: OptState, factor: Any, skip: torch.Tensor | None) -> None:
        replaced = []
        if updates is not tree:
            # A member's updates may be its state's own tensors (optax's trace returns its new trace): those
            # are copied, so nothing that writes .grad (a scaling, zero_grad, the next backward) writes the state.
            updates = grads.not_holding(updates, (state, self._flat))
            replaced = grads.write(self._tree, updates)
        if self._fp64 is None:
            self._fp64 = any(p.dtype == torch.float64 for p in self._flat)
        # The inner optimizer makes its own state for the params it steps: their stand-ins go first, so that state is
        # never held twice (Lightning's setup reads opt.state, which makes stand-ins of the whole inner state).
        if self._live.stand_ins:
            self._live.stand_ins = {p: s for p, s in self._live.stand_ins.items() if p.grad is None}
        try:
            rules.step_inner(self.optimizer, self._fused, self._tree, self._flat, factor, skip, fp64=self._fp64)
        except BaseException:
            for p, g in replaced:
                p.grad = g
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grads, except while an accumulation window is open (they are the accumulator)."""
        if self._live.window_open:
            return
        if torch.compiler.is_compiling():
            # torch.optim's zero_grad is marked not traceable; its own body traces, for a compiled step. A subclass's
            # override runs as in eager (where it calls torch's, the graph breaks, as it does in plain torch).
            rules.unwrapped(self.optimizer, "zero_grad")(set_to_none=set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

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
        return metrics(self._live.tx_state)

    @property
    def window_open(self) -> bool:
        """Whether an accumulation window is open (the grads hold a partial sum)."""
        return self._live.window_open

    def emits_next(self, *, flush: bool = False) -> bool:
        """Whether the next :meth:`step` will emit, so its backward must sync the grads across ranks.

        True without :func:`gradtx.accumulate` in the chain, on the last
        micro-step of a window, and with ``flush=True`` (the next ``step`` will
        get it). Reads only host-side counters.
        """
        return self._plan.emits_next(self._live.tx_state, flush=flush)

    @contextlib.contextmanager
    def maybe_no_sync(self, model: torch.nn.Module, *, flush: bool = False) -> Iterator[None]:
        """Run one micro-step's forward and backward, syncing the grads only if the next ``step`` emits.

        The wrapper knows where its accumulation window stands, so the data-parallel
        sync (DDP's all-reduce, FSDP2's reduce-scatter) happens once per optimizer
        step, on the last micro-step, instead of ``k`` times. Wrap the forward
        *and* the backward: DDP decides in its forward whether the backward syncs.
        A model that is neither DDP nor FSDP2 runs unchanged. See :func:`no_sync`
        and ``docs/accumulation.md``.

        Args:
          model: the DDP- or FSDP2-wrapped model whose backward runs inside.
          flush: this micro-step's ``step`` will get ``flush=True`` (a short final window).
        """
        sync = self.emits_next(flush=flush)
        self._live.synced = sync or not any(data_parallel_modules(model))
        with no_sync(model, sync=sync):
            yield

    # checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The checkpoint in ``torch.optim``'s layout: ``state`` per parameter and ``param_groups``.

        Each parameter's entry is the inner optimizer's plus a ``"gradtx"`` dict
        (the transform's state for it; see :mod:`gradtx.wrapper.state_dict`). At
        a window boundary nothing gradient-sized is added; with a window open
        the window's partial sums (copies of ``.grad``) are. See ``docs/checkpointing.md``.

        Raises:
          ValueError: a window is open and its partial sums are not in ``.grad``
            (they sit inside DDP/FSDP2 after a :meth:`maybe_no_sync` backward
            that did not sync).
        """
        if isinstance(self.optimizer, TransformedOptimizer):  # a framework's proxy (see add_param_group)
            return self.optimizer.state_dict()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # hooks registered on the wrapper, as torch
            pre_hook(self)
        self._follow_groups()
        state_dict = _sd.state_dict(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`, or adopt a plain ``torch.optim`` checkpoint; checks everything first.

        A checkpoint of the bare inner optimizer (no ``"gradtx"`` entries) loads
        too: the inner state is restored and the transform starts fresh. Before
        anything changes it checks the param groups and counts, the inner
        state's shapes, and the transform's keys, ``k``, shapes and dtypes; the
        first difference raises a ``ValueError`` naming it. A window that was
        open when saved is open again, its partial sums in ``.grad``; one saved
        at a boundary leaves every ``.grad`` ``None``.
        """
        if isinstance(self.optimizer, TransformedOptimizer):  # a framework's proxy (see add_param_group)
            return self.optimizer.load_state_dict(state_dict)
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # as torch: a pre-hook may change the dict, never the caller's
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        self._follow_groups()
        _sd.load_state_dict(self, state_dict)  # the fused rule sees the inner optimizer's new state dict
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
