"""What the wrapper refuses or warns about: chains and loops it cannot run right.

An optimizer in the chain, a window with a closure, a scheduler stepped on
every micro-step, a loss divided by ``k``. The last two are traps of
accumulation in ``.grad`` (see "Port nanoGPT's loop" in
``docs/accumulation.md``); they read only host values the step has anyway:
the param groups' learning rates, and the autograd node that made the loss.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from gradtx.core.base import GradientTransformation
from gradtx.optimizers.standard import OptimizerChain
from gradtx.transforms.accumulation import Window
from gradtx.transforms.combine import Chain

CLOSURE_WITH_WINDOW = (
    "TransformedOptimizer.step: gtx.accumulate is in the chain, but step(closure) is called: whoever "
    "passes the closure (Lightning's automatic optimization does) counts every call as an optimizer "
    "step (its global step, its scheduler) while only every k-th call steps. Take gtx.accumulate out "
    "of the chain and use the caller's own accumulation (Lightning: Trainer(accumulate_grad_batches=k)); "
    "or drive the wrapper yourself: loss.backward(); opt.step() with no closure"
)


def closure_optimizer_with_window(optimizer: torch.optim.Optimizer) -> str:
    return (
        f"TransformedOptimizer: {type(optimizer).__name__} reevaluates the model through its closure several "
        "times per step, and the chain is applied to the grads of every evaluation, but the chain holds "
        "gtx.accumulate, which cannot be applied per evaluation; take gtx.accumulate out of the chain "
        "(a closure can sum micro-batches itself)"
    )


def _nested(tx: GradientTransformation) -> Iterator[GradientTransformation]:
    yield tx
    for member in tx.members if isinstance(tx, Chain) else ():
        yield from _nested(member)


def check_no_optimizer(tx: GradientTransformation, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a gradtx optimizer in the chain: the inner optimizer would step against its update."""
    for member in _nested(tx):
        if isinstance(member, OptimizerChain):
            kind, inner = member.spec.kind, type(optimizer).__name__
            raise TypeError(
                f"TransformedOptimizer: the chain holds gtx.{kind}(...), an optimizer: its output is an update "
                f"(-learning_rate times a direction), which the inner {inner} would step against once more "
                f"(the loss would climb). The chain transforms the gradients the inner optimizer steps on: "
                f"leave gtx.{kind} out and let {inner} take the step, or run gtx.{kind} functionally"
            )


def check_lrs(live: Any, groups: list[dict[str, Any]]) -> None:
    """Refuse an lr that keeps changing inside accumulation windows: a scheduler stepped on every micro-step.

    One change inside a window is what a scheduler stepped once per epoch
    does, and it is accepted as torch's own loop accepts it (the window's
    closing step reads the lr). Changes inside two windows in a row, or twice
    inside one, are a scheduler stepped on every ``step()`` call.

    Args:
      live: the wrapper's step record: ``lrs`` (the lrs at its last step),
        ``window_open``, ``lr_changes`` and ``lr_changes_last`` (changes seen
        inside this window and inside the last one); updated here.
      groups: the param groups.
    """
    lrs = [g.get("lr") for g in groups]
    before, live.lrs = live.lrs, lrs
    if before is None or not live.window_open:
        return
    changed = [
        (i, a, b)
        for i, (a, b) in enumerate(zip(before, lrs))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a != b
    ]
    if not changed:
        return
    live.lr_changes += 1
    if live.lr_changes + live.lr_changes_last < 2:
        return
    i, a, b = changed[0]
    raise ValueError(
        f"TransformedOptimizer.step: param group {i}'s lr changed from {a} to {b} inside an accumulation window, "
        "as it did in the last one: something steps the lr scheduler on every step() call, counting every "
        "micro-step as an optimizer step (the Hugging Face Trainer and accelerate do). Step the scheduler only "
        "when opt.emitted is True, or take gtx.accumulate out of the chain and use that framework's own "
        "accumulation (TrainingArguments(gradient_accumulation_steps=k)). A scheduler stepped once per epoch "
        "may change the lr inside a window (the window's last step reads it); to start the next epoch with a "
        "fresh window, end the epoch with opt.step(flush=True)"
    )


def check_divided_loss(live: Any, window: Window, loss: Any) -> None:
    """Warn once when the ``loss=`` given to ``step`` was divided by the window's ``k``: the mean is taken twice.

    nanoGPT's loop divides each micro-batch's loss by ``grad_accum_steps``;
    with :func:`gradtx.accumulate` (which averages the micro-steps itself) that
    makes the grads, the logged norm and the clip's input ``k`` times too small.
    Seen from the loss's autograd node (a division by ``k``, or a product with
    ``1/k``), so only when the loss is passed to ``step``.
    """
    fn = getattr(loss, "grad_fn", None)
    if live.warned_divided or fn is None or window.token_weighted or window.k < 2:
        return
    other = getattr(fn, "_saved_other", None)
    name = fn.name()
    if (name == "DivBackward0" and other == window.k) or (name == "MulBackward0" and other == 1 / window.k):
        live.warned_divided = True
        warnings.warn(
            f"TransformedOptimizer.step: the loss was divided by {window.k}, the accumulation window's k; "
            f"gtx.accumulate({window.k}) averages the micro-steps itself, so the grads are divided twice (the "
            "logged grad_norm is k times smaller and the clip hardly fires). Backpropagate each micro-batch's "
            "own mean loss (see 'Port nanoGPT's loop' in docs/accumulation.md)",
            stacklevel=4,
        )
