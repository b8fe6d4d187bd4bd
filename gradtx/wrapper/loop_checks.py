"""What the wrapper refuses: chains and loops it cannot run right.

An optimizer in the chain, a window with a closure, a scheduler stepped on
every micro-step. The last is a trap of accumulation in ``.grad`` (see "Port
nanoGPT's loop" in ``docs/accumulation.md``), seen from host values the step
reads anyway: the param groups' learning rates.
"""

from __future__ import annotations

from typing import Any

import torch

from gradtx.core.base import GradientTransformation, built_from
from gradtx.optimizers.standard import OptimizerChain

CLOSURE_WITH_WINDOW = (
    "TransformedOptimizer.step: gtx.accumulate is in the chain, but step(closure) is called: whoever "
    "passes the closure (Lightning's automatic optimization does) counts every call as an optimizer "
    "step (its global step, its scheduler) while only every k-th call steps. Take gtx.accumulate out "
    "of the chain and use the caller's own accumulation (Lightning: Trainer(accumulate_grad_batches=k)); "
    "or drive the wrapper yourself: loss.backward(); opt.step() with no closure"
)

UNSYNCED_EMIT = (
    "TransformedOptimizer.step: this step closes the accumulation window, but the last opt.maybe_no_sync(model) "
    "skipped the data-parallel sync, so the grads may be each rank's own (DDP) or still inside FSDP2. Run the "
    "window's last micro-step in opt.maybe_no_sync(model) too (it syncs there; the wrapper cannot see a backward "
    "run outside it), and the one whose step gets flush=True in opt.maybe_no_sync(model, flush=True)"
)


def closure_optimizer_with_window(optimizer: torch.optim.Optimizer) -> str:
    return (
        f"TransformedOptimizer: {type(optimizer).__name__} reevaluates the model through its closure several "
        "times per step, and the chain is applied to the grads of every evaluation, but the chain holds "
        "gtx.accumulate, which cannot be applied per evaluation; take gtx.accumulate out of the chain "
        "(a closure can sum micro-batches itself)"
    )


def check_no_optimizer(members: list[GradientTransformation], optimizer: torch.optim.Optimizer) -> None:
    """Refuse a gradtx optimizer among the chain's members, or inside one (``apply_if_finite(gtx.adamw(...))``, as
    the member was built): the inner optimizer would step against its update."""
    for member in members:
        if isinstance(member, OptimizerChain):
            kind, inner = member.spec.kind, type(optimizer).__name__
            raise TypeError(
                f"TransformedOptimizer: the chain holds gtx.{kind}(...), an optimizer: its output is an update "
                f"(-learning_rate times a direction), which the inner {inner} would step against once more "
                f"(the loss would climb). The chain transforms the gradients the inner optimizer steps on: "
                f"leave gtx.{kind} out and let {inner} take the step, or run gtx.{kind} functionally"
            )
        check_no_optimizer(built_from(member), optimizer)


def check_lrs(live: Any, groups: list[dict[str, Any]], window: Any, *, record: bool = False) -> None:
    """Refuse an lr that changes on every micro-step: a scheduler stepped on every ``step()`` call.

    A scheduler stepped once per epoch (``ReduceLROnPlateau``, ``StepLR``) may
    change the lr while a window is open; that is accepted, as torch's own
    loop accepts it: the window's closing step reads the lr. A scheduler
    stepped on every call changes it on consecutive calls, one of them inside
    a window, which an epoch scheduler (or one stepped when ``opt.emitted``)
    never does.

    Args:
      live: the wrapper's step record: ``lrs`` (the lrs at its last step),
        ``window_open``, and ``lr_prev`` (whether the lr changed at the last
        step, and whether inside a window).
      groups: the param groups.
      window: the chain's accumulation window; without one (``None``) nothing is checked or recorded.
      record: record this step's lrs in ``live`` instead of checking them: when the step commits, so a step
        refused later (a bad ``tokens=``) leaves the record as it was.
    """
    if window is None:
        return
    lrs = [g.get("lr") for g in groups]
    changed = [
        (i, a, b)
        for i, (a, b) in enumerate(zip(live.lrs or (), lrs))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a != b
    ]
    if record:
        live.lrs, live.lr_prev = lrs, (bool(changed), live.window_open)
        return
    prev_changed, prev_inside = live.lr_prev
    if not (changed and prev_changed and (live.window_open or prev_inside)):
        return
    i, a, b = changed[0]
    raise ValueError(
        f"TransformedOptimizer.step: param group {i}'s lr changed from {a} to {b} inside an accumulation window, "
        "and at the step before: something steps the lr scheduler on every step() call, counting every "
        "micro-step as an optimizer step (the Hugging Face Trainer and accelerate do). Step the scheduler only "
        "when opt.emitted is True, or take gtx.accumulate out of the chain and use that framework's own "
        "accumulation (TrainingArguments(gradient_accumulation_steps=k)). A scheduler stepped once per epoch "
        "may change the lr inside a window (the window's last step reads it); to start each epoch with a "
        "fresh window, end the last one with opt.step(flush=True)"
    )
