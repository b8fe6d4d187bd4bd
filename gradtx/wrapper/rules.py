"""The wrapper's speed rules, in one place, applied to gradtx's own transforms by their type.

A chain is read once (nested chains flattened) into:

* a leading :class:`~gradtx.transforms.accumulation.Accumulation`: its window
  lives in ``.grad`` (autograd's own sum, no second buffer), so a micro-step
  only counts (micro-steps, tokens) and its mean ``1/denominator`` is left pending;
* the body: every other member, run as it is (``tx.update`` on the grads, the
  result written to ``.grad``); a :class:`~gradtx.core.base.Guard`'s
  ``verdict`` becomes the step's ``found_inf``;
* a trailing run of :class:`~gradtx.core.base.ScalarTransformation` s (the
  clip, ``scale``): their ``factor`` s are multiplied into the pending factor,
  which becomes the fused kernel's ``grad_scale`` (or one multiply of ``.grad``).

A user's transform is simply run; nothing here needs it to declare anything.
:class:`FusedAdam` is the one rule about the inner optimizer: it steps
``torch.optim.Adam/AdamW(fused=True)`` by calling torch's fused kernel on
lists cached per (group, device, dtype), with the optimizer's own state.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from itertools import repeat
from operator import is_, itemgetter
from typing import Any, NamedTuple

import torch
from torch.optim import optimizer as torch_optimizer

from gradtx.checkpoint.layout import members as members_of
from gradtx.core import foreach as fe
from gradtx.core import tree as tu
from gradtx.core.base import GradientTransformation, Guard, OptState, ScalarTransformation
from gradtx.distributed.context_parallel import sums_over
from gradtx.distributed.pipeline import reduced_plan
from gradtx.transforms.accumulation import Accumulation
from gradtx.transforms.combine import Chain


class Result(NamedTuple):
    """One step of the chain: ``updates`` (``None`` when held), the new state, a pending 0-d factor, a skip flag."""

    updates: Any
    state: OptState
    factor: torch.Tensor | None
    skip: torch.Tensor | None


class Plan:
    """A chain read once by the types of its members: window, body, scalar tail (see the module docstring).

    Attributes:
      window: the leading :class:`Accumulation`, or ``None``.
      start: the index of the first member after it (0 without one).
      reduce_grads: the window sums ``.grad`` over the data-parallel ranks when it closes.
      summed: the grads are summed over ranks (that window, or a :func:`~gradtx.cp_reduce`).
      body: the members run as they are, with their indices.
      tail: the trailing :class:`ScalarTransformation` s, with their indices.
    """

    def __init__(self, tx: GradientTransformation) -> None:
        self.tx = tx
        members = members_of(tx)  # _split_states and _join_states flatten alike
        self.members = members
        self.window: Accumulation | None = members[0] if members and isinstance(members[0], Accumulation) else None
        self.late = [i for i, m in enumerate(members) if i > 0 and isinstance(m, Accumulation)]
        self.start = 1 if self.window is not None else 0
        self.reduce_grads = self.window is not None and self.window.window.reduce_grads
        self.summed = self.reduce_grads or any(sums_over(m) for m in members)
        # The flat indices of tied copies that a pp_reduce sums over the stages (grads.read gives them .grad).
        ties = [reduced_plan(m) for m in members]
        self.tied = frozenset(i for plan in ties if plan is not None for idx in plan.tied.values() for i in idx)
        tail = len(members)
        while tail > self.start and isinstance(members[tail - 1], ScalarTransformation):
            tail -= 1
        self.body = [(i, members[i]) for i in range(self.start, tail)]
        self.tail: list[tuple[int, Any]] = [(i, members[i]) for i in range(tail, len(members))]

    def states(self, state: OptState) -> list[OptState]:
        return _split_states(self.tx, state)

    def join(self, states: list[OptState]) -> OptState:
        return _join_states(self.tx, iter(states))

    def window_state(self, state: OptState) -> Any:
        return self.states(state)[0] if self.window is not None else None

    def emits_next(self, state: OptState, *, flush: bool = False) -> bool:
        """Whether the next step closes the window (always True without one); host counters only."""
        return self.window is None or self.window.window.emits_next(self.window_state(state), flush=flush)

    def window_open(self, state: OptState) -> bool:
        return self.window is not None and self.window.window.is_open(self.window_state(state))

    def run(
        self,
        grads: Any,
        state: OptState,
        params: Any,
        extra: dict[str, Any],
        pending: torch.Tensor | None,
        device: torch.device,
    ) -> Result:
        """One step on ``grads`` (autograd's ``.grad``, written only with the window's sum over the ranks, once every
        member ran); ``pending`` a factor they still carry."""
        if self.late:
            # Autograd's sum in .grad is the sum of the micro-batch grads only before anything touches it.
            raise ValueError(
                f"chain: member {self.late[0]} accumulates, but autograd sums the micro-batches into .grad "
                "(TransformedOptimizer), so accumulate() must be the first transform of the chain"
            )
        states = self.states(state)
        reduced = None
        if self.window is not None:
            loss = {"loss": extra["loss"]} if extra.get("loss") is not None else {}
            stepped = self.window.window.step(
                states[0], tokens=extra.get("tokens"), flush=extra.get("flush", False), device=device, **loss
            )
            states[0] = stepped.state
            if stepped.factor is None:
                return Result(None, self.join(states), None, None)
            if self.reduce_grads:  # into new tensors: a member that raises below leaves .grad unreduced for a retry
                read = grads
                leaves, spec = tu.flatten(grads)
                grads = reduced = tu.unflatten(spec, self.window.window.reduce(leaves, write_back=False))
            mean = stepped.factor.to(device, non_blocking=True)
            pending = mean if pending is None else pending * mean
            extra = self.window.downstream_extra(states[0], extra)
        skip: torch.Tensor | None = None
        for i, member in self.body:
            if pending is not None:  # a member that is not scalar sees the true updates (.grad is not written)
                leaves, spec = tu.flatten(grads)
                grads = tu.unflatten(spec, tu.scale_leaves(leaves, pending))
                pending = None
            grads, states[i] = member.update(grads, states[i], params, **extra)
            if grads is None:  # a member held: nothing after it runs or changes
                return Result(None, self.join(states), None, None)
            if isinstance(member, Guard):
                vetoed = member.verdict(states[i])
                skip = vetoed if skip is None else skip | vetoed.to(skip.device)
        for i, member in self.tail:
            f, states[i] = member.factor(grads, states[i], params, scale=pending, **extra)
            pending = f if pending is None else pending * f.to(pending.device)
        if grads is reduced:  # no member made new grads: the sums go into .grad, as no copy of them is kept to the step
            torch._foreach_copy_(tu.local_shards(leaves), tu.local_shards(tu.flatten(grads)[0]))
            grads = read
        return Result(grads, self.join(states), pending, skip)


def has_none(items: list[Any]) -> bool:
    """Whether a list holds ``None`` (by identity: ``None in tensors`` would call each tensor's ``__eq__``)."""
    return any(map(is_, items, repeat(None)))


# --- torch.optim.Adam/AdamW(fused=True), stepped directly ----------------------------------------


def step_inner(
    optimizer: torch.optim.Optimizer,
    fused: FusedAdam | None,
    tree: list[list[torch.Tensor]],
    params: list[torch.Tensor],
    factor: torch.Tensor | None,
    skip: torch.Tensor | None,
    *,
    fp64: bool,
) -> None:
    """Step the inner optimizer on the params' ``.grad`` times ``factor``, unless ``skip``.

    The factor is a fused kernel's ``grad_scale`` (inverted: the kernel divides
    by it) and the skip its ``found_inf``; other optimizers get ``.grad``
    multiplied in place, and a skip decided on the host (one scalar read).
    """
    grads: Any = [p.grad for p in params]
    kernel_scales = scales_in_kernel(optimizer) and not torch.compiler.is_compiling()
    # Only Adam's kernel, called here, is given the skip as found_inf. A non-fused optimizer cannot skip on its own,
    # and torch's fused SGD, skipped on its first step, leaves the momentum buffers it made unwritten.
    if skip is not None and not (kernel_scales and fused is not None) and bool(skip):
        return
    if factor is not None and (fp64 or not kernel_scales):
        # Into .grad where the kernel cannot take it: torch's fused kernels read grad_scale as fp32. A step that
        # raises (a step pre-hook) divides it back out, so a retried opt.step() reads the grads it was given:
        # exactly for a power of two (a window's mean over 2^n micro-steps), to an ulp otherwise.
        scaled = tu.scale_leaves([g for g in grads if g is not None], factor, write_back=True)
        skip = skip if kernel_scales and fused is not None else None  # else read above
        try:
            return step_inner(optimizer, fused, tree, params, None, skip, fp64=fp64)
        except BaseException:
            tu.scale_leaves(scaled, torch.reciprocal(factor), write_back=True)
            raise
    if kernel_scales:
        grad_scale = None if factor is None else torch.reciprocal(factor.to(torch.float32))
        found_inf = None if skip is None else skip.to(torch.float32)
        if fused is not None and fused.step(tree, grads, grad_scale, found_inf):
            return
        opt: Any = optimizer
        opt.grad_scale = grad_scale
        opt.found_inf = found_inf
        try:
            opt.step()
        finally:  # gone, as GradScaler leaves them: it multiplies a grad_scale it finds into its own
            del opt.grad_scale, opt.found_inf
        return
    if torch.compiler.is_compiling() and not has_hooks(optimizer):
        # torch.optim's step wrappers insert graph breaks (to keep the optimizer graph an inference
        # graph, which the surrounding no_grad already makes it), so fullgraph=True could never hold.
        unwrapped(optimizer)()
        return
    optimizer.step()


_TAKE_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def scales_in_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step takes ``grad_scale`` and ``found_inf``: it says so, and every group is fused.

    torch sets ``_step_supports_amp_scaling`` when a fused optimizer is built (a copy loses it: torch's
    ``__setstate__`` does not set it again, so its fused optimizers are also known by type), and a group added
    later with ``fused=False`` (or ``differentiable=True``, which fused kernels refuse) is stepped by code that
    refuses them. Read at every step: the one check of the groups, :class:`FusedAdam` included.
    """
    declared = getattr(optimizer, "_step_supports_amp_scaling", False) or type(optimizer) in _TAKE_FUSED
    return declared and all(g.get("fused", True) and not g.get("differentiable") for g in optimizer.param_groups)


def unwrapped(optimizer: torch.optim.Optimizer, name: str = "step") -> Callable[..., Any]:
    """The optimizer's own method ``name``, bound, without torch's wrappers (profiling, hooks, dynamo's opt-out)."""
    return functools.partial(inspect.unwrap(getattr(type(optimizer), name)), optimizer)


def has_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether stepping the optimizer runs step hooks: its own, or global ones."""
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


_HYPER = ("lr", "betas", "weight_decay", "eps", "amsgrad", "maximize", "decoupled_weight_decay")
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # Adam's param-shaped state (the last with amsgrad only)


class _Bucket(NamedTuple):
    take: Any  # itemgetter over the flat grads
    params: list[torch.Tensor]
    held: dict[str, list[torch.Tensor]]  # "step" and each moment: the params' state tensors, the kernel's lists
    counter: torch.Tensor  # the steps' one buffer, on the bucket's device: each state["step"] is a 0-d view into it
    states: list[dict[str, Any]]  # the params' state dicts the lists were read from


class FusedAdam:
    """Step ``torch.optim.Adam/AdamW(fused=True)`` by calling ``torch._fused_adam(w)_`` on cached lists.

    What ``Adam.step`` does with ``fused=True``, without its per-parameter
    Python: the lists of params and of the optimizer's own state tensors
    (``optimizer.state[p]``, made at the first step exactly as ``_init_group``
    makes them) are built once per structure, grouped by param group, device
    and dtype; each step reads the groups' hyperparameters (a tensor ``lr`` too)
    and passes the pending factor as ``grad_scale`` and a skip as ``found_inf``.
    It applies only when every param the wrapper steps has a dense grad, every
    group is still fused (:func:`step_inner` calls it only then: a group added
    later may not be), and nothing else would run in the optimizer's step
    (hooks, a patched ``step``); otherwise the wrapper calls ``optimizer.step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.key: Any = None
        self.tree: Any = None  # the wrapper's tree when built: a new one (a param replaced in a group) rebuilds
        self.buckets: list[tuple[dict[str, Any], list[_Bucket]]] = []
        self.entries: list[Any] = []

    @staticmethod
    def fits(optimizer: torch.optim.Optimizer) -> bool:
        return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and scales_in_kernel(optimizer)

    def _key(self, tree: list[list[torch.Tensor]]) -> Any:
        # The groups and the tree; a replaced or reset state is caught by _holds_state.
        groups = tuple((id(g), id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups)
        return groups, tuple(map(len, tree))

    def _build(self, tree: list[list[torch.Tensor]]) -> None:
        opt = self.optimizer
        state = opt.state
        self.buckets = []
        offset = 0
        for group, params in zip(opt.param_groups, tree):
            buckets = []
            moments = _MOMENTS if group["amsgrad"] else _MOMENTS[:2]
            for (device, _), idx in fe.group_by_device_dtype(params):
                ps = [params[i] for i in idx]
                for p in ps:
                    if not state[p]:  # as Adam._init_group makes it, for fused=True
                        torch_optimizer._device_dtype_check_for_fused(p)
                        state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                        for key in moments:
                            state[p][key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                sts = [state[p] for p in ps]
                # The params' step counters become views of one buffer, so a step advances them with one
                # add (a foreach add over n 0-d tensors costs more than the fused kernel on small models).
                counter = torch.stack([s["step"].to(device, torch.float32) for s in sts])
                for j, s in enumerate(sts):
                    s["step"] = counter[j]
                take = itemgetter(*(offset + i for i in idx))
                held = {key: [s[key] for s in sts] for key in ("step", *moments)}
                buckets.append(_Bucket(take if len(idx) > 1 else (lambda g, t=take: (t(g),)), ps, held, counter, sts))
            self.buckets.append((group, buckets))
            offset += len(params)
        self.entries = list(state.values())  # every param's state dict, in the state's order
        self.key, self.tree = self._key(tree), tree

    def _holds_state(self) -> bool:
        """Whether the cached lists still hold the optimizer's own state, as ``Adam.step`` would read it (after
        ``opt.state[p] = {}``, or a new ``exp_avg``): checked by identity at each step, in C-level passes over the
        state's dicts (a lookup by param would call ``Tensor.__hash__``, Python, once per param)."""
        entries = self.entries
        if len(self.optimizer.state) != len(entries) or not all(map(is_, self.optimizer.state.values(), entries)):
            return False
        try:
            for _, buckets in self.buckets:
                for b in buckets:
                    for key, held in b.held.items():
                        if not all(map(is_, map(itemgetter(key), b.states), held)):
                            return False
        except KeyError:  # an entry gone
            return False
        return True

    def step(
        self,
        tree: list[list[torch.Tensor]],
        grads: list[torch.Tensor],
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> bool:
        """Step the optimizer on ``grads`` (flat, in ``tree`` order); False when the rule does not apply.

        ``grad_scale`` and ``found_inf`` are the kernel's (fp32; the grads are divided by ``grad_scale``).
        """
        opt = self.optimizer
        # Not when stepping runs more than the kernel: hooks, or a step patched on the instance (an lr scheduler's
        # step counter).
        if has_hooks(opt) or "step" in opt.__dict__ or has_none(grads):
            return False
        if self.key != self._key(tree) or tree is not self.tree or not self._holds_state():
            if any(g.is_sparse for g in grads):
                return False
            self._build(tree)
        # Each group's hyperparameters are read at every step, as Adam.step reads them.
        hyper: list[list[Any]] = [[group.get(k) for k in _HYPER] for group, _ in self.buckets]
        if any(isinstance(h[1][0], torch.Tensor) or isinstance(h[1][1], torch.Tensor) for h in hyper):
            return False  # tensor betas: torch's own step converts them
        adamw = type(opt) is torch.optim.AdamW
        for (lr, (beta1, beta2), wd, eps, amsgrad, maximize, decoupled), (_, buckets) in zip(hyper, self.buckets):
            kernel = torch._fused_adamw_ if decoupled or adamw else torch._fused_adam_
            for b in buckets:
                device = b.counter.device
                gs = None if grad_scale is None else grad_scale.to(device, non_blocking=True)
                fi = None if found_inf is None else found_inf.to(device, non_blocking=True)
                step_lr = lr
                if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != device:
                    step_lr = lr.to(device, non_blocking=True)
                b.counter.add_(1)
                kernel(
                    b.params,
                    list(b.take(grads)),
                    b.held["exp_avg"],
                    b.held["exp_avg_sq"],
                    b.held.get("max_exp_avg_sq", []),
                    b.held["step"],
                    amsgrad=amsgrad,
                    lr=step_lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=wd,
                    eps=eps,
                    maximize=maximize,
                    grad_scale=gs,
                    found_inf=fi,
                )
                if fi is not None:
                    b.counter.sub_(fi)
        return True


def keep_on_skip(plan: Plan, skip: torch.Tensor, old: OptState, new: OptState) -> OptState:
    """``new``, except that every member after the window keeps its ``old`` state where ``skip`` (no host sync).

    The window closes either way: a skipped window is over.
    """

    def pick(n: Any, o: Any) -> Any:
        if not isinstance(n, torch.Tensor):
            return n
        ln = tu.local(n)
        return tu.like(n, torch.where(skip.to(ln.device), tu.local(o), ln))

    olds, news = plan.states(old), plan.states(new)
    news[plan.start :] = [tu.tree_map(pick, n, o) for n, o in zip(news[plan.start :], olds[plan.start :])]
    return plan.join(news)


def _split_states(tx: GradientTransformation, state: OptState) -> list[OptState]:
    if isinstance(tx, Chain):
        return [s for member, sub in zip(tx.members, tx.member_states(state)) for s in _split_states(member, sub)]
    return [state]


def _join_states(tx: GradientTransformation, states: Iterator[OptState]) -> OptState:
    if isinstance(tx, Chain):
        return tx.join_states([_join_states(member, states) for member in tx.members])
    return next(states)
