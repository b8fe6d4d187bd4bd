"""Fused torch kernels for a donated optimizer step: one ``torch._fused_adamw_`` / ``_fused_adam_`` / ``_fused_sgd_`` launch.

A pure step must write new moments, new updates and new params: on a big model those are
fresh gradient-sized buffers every step. A donated step may instead update them in place
with one fused torch kernel: it reads p, g and the moments once and writes p and the moments
once, and the pending factor rides in its ``grad_scale``. :class:`gradtx.OptimizerChain`
offers it as its ``fused_step`` (the :class:`gradtx.core.kinds.FusableOptimizer` kind).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradtx.core import tree as tu
from gradtx.core.base import OptState, Params, Updates
from gradtx.optimizers.standard import OptimizerSpec, ScaleByAdamState, ScaleByScheduleState, TraceState

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
