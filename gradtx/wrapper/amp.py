"""The wrapper's side of ``torch.amp.GradScaler``: its scale and inf flag across an accumulation window.

GradScaler hands the wrapper ``grad_scale`` and ``found_inf`` (the wrapper
declares ``_step_supports_amp_scaling`` when its inner optimizer is fused or
its chain accumulates, as fused optimizers do) and leaves ``.grad`` scaled.
The chain unscales (clipping sees true grads). Inside an accumulation window
``.grad`` sums several scaled micro-batches, so the window remembers the
scale its grads carry and whether any micro-step saw an inf; the window's
step is skipped if one did, or if the scale changed inside it. These rules,
and the record a checkpoint keeps of them, live here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradtx.checkpoint import layout as lo


class AmpVerdict(NamedTuple):
    """What GradScaler's flags mean for one step.

    Attributes:
      found: on an emitting step, a 0-d bool tensor: skip it (``None`` without GradScaler).
      scale: the window's scale after this step (``None``: no window, or no scale seen yet).
      inf: whether the window has seen an inf after this step (``None`` likewise).
      drop_partial_sum: a held micro-step saw an inf: the window will be skipped, drop ``.grad``.
    """

    found: torch.Tensor | None
    scale: torch.Tensor | None
    inf: torch.Tensor | None
    drop_partial_sum: bool


def check_flags(
    found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None, *, emitting: bool, summed: bool
) -> None:
    """Refuse GradScaler's flags where they would be wrong: an inf flag read from this rank's grads alone when the
    chain sums them over the ranks, and ``scaler.unscale_(opt)`` on a micro-step that does not emit."""
    if found_inf is not None and summed:
        raise ValueError(
            "TransformedOptimizer.step: torch.amp.GradScaler checked this rank's own grads for an inf, but the chain "
            "sums them over the ranks inside the step (accumulate(reduce_grads=True), cp_reduce): one rank would skip "
            "the step and another take it, and their scales would part. Let DDP or FSDP2 sum the grads in the "
            "backward, or train without GradScaler (bf16 needs none)"
        )
    if found_inf is not None and grad_scale is None and not emitting:
        raise ValueError(
            "TransformedOptimizer.step: scaler.unscale_(opt) was called on a micro-step that does not emit, "
            "so it unscaled the partial sum in .grad that the next micro-steps add scaled grads to. Let the "
            "wrapper unscale (clip with gtx.clip_by_global_norm in the chain, not clip_grad_norm_), or call "
            "scaler.unscale_(opt) only when opt.emits_next()"
        )


def inv_scale(grad_scale: torch.Tensor | None) -> torch.Tensor | None:
    """``1 / grad_scale`` in fp32, computed in fp64 (the chain folds it into its scalar factor)."""
    return None if grad_scale is None else grad_scale.double().reciprocal().float()


def verdict(
    found_inf: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    scale: torch.Tensor | None,
    inf: torch.Tensor | None,
    *,
    emitted: bool,
    window_open: bool,
) -> AmpVerdict:
    """Combine this step's GradScaler flags with the window's record (``scale``, ``inf``)."""
    found = None
    drop = False
    if found_inf is not None:
        seen = found_inf != 0
        if inf is not None:  # an earlier micro-step of this window saw an inf
            seen = seen | inf.to(seen.device)
        if scale is not None and grad_scale is not None:
            # The scaler changed the scale inside the window: .grad sums micro-batches at two scales.
            seen = seen | (grad_scale != scale.to(grad_scale.device))
        if not emitted and window_open:
            inf = seen
            if scale is None and grad_scale is not None:
                scale = grad_scale.detach().clone()
            drop = bool(seen)  # one scalar read, on a held micro-step under GradScaler only
        if emitted:
            found = seen
    if not window_open:
        scale = inf = None
    return AmpVerdict(found, scale, inf, drop)


# --- the checkpoint's record of an open window ---------------------------------------------------

RECORD_KEYS = ["scale", "inf"]


def record(scale: torch.Tensor | None, inf: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The open window's GradScaler record: the scale its grads carry (0: none) and whether it saw an inf."""
    values = zip(RECORD_KEYS, (scale, inf))
    return {k: torch.zeros(()) if v is None else v.detach().reshape(()).float().cpu().clone() for k, v in values}


def restore(saved: Any, device: torch.device, *, what: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GradScaler record to restore with an open window, or None; checked before anything changes."""
    lo.check_keys(saved, RECORD_KEYS, what=f"{what}: GradScaler record", hint=lo.HINT)
    for key in RECORD_KEYS:
        lo.flag(saved[key], what=f"{what}: GradScaler record {key!r}")  # a one-element tensor
    if float(saved["scale"]) == 0.0:
        return None
    return saved["scale"].reshape(()).to(device, torch.float32), (saved["inf"].reshape(()) != 0).to(device)
