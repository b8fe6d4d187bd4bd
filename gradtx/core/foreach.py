"""Foreach calls that also run under ``torch.func.vmap``.

``torch._foreach_*`` kernels have no batching rules, so a transform built on
them fails inside ``vmap`` (per-example clipping, DP-SGD). Each function here
calls the foreach kernel, unless a ``vmap`` is active, in which case it runs
the same math one tensor at a time, through ops that do have batching rules.
The check reads functorch's interpreter stack: well under a microsecond, and
traced by ``torch.compile`` without a graph break.

Under ``vmap`` the in-place functions rebind the list's elements instead of
writing into the tensors (an unbatched moment updated in place by a batched
grad cannot hold the result), so a caller must own the list it passes and
read the results from it, which is how every caller here uses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C import _functorch
from torch._functorch import pyfunctorch


def under_vmap() -> bool:
    """True inside ``torch.func.vmap`` (at any depth of functorch transforms).

    Traced, any transform counts: dynamo cannot read which, and per-tensor ops are right under each.
    """
    active = torch._C._are_functorch_transforms_active()
    if not active or torch.compiler.is_compiling():
        return active
    return any(i.key() == _functorch.TransformType.Vmap for i in pyfunctorch.retrieve_all_functorch_interpreters())


def _per_tensor(scalar: Any) -> bool:
    """Whether to run one op per tensor: under vmap, or when autograd records a gradient for a 0-d factor.

    Foreach kernels broadcasting one 0-d tensor that requires grad (a learning
    rate, a beta: hypergradients) have no correct backward in torch 2.13
    ("inconsistent range for TensorList output"); per-tensor ops do.
    """
    if under_vmap():
        return True
    if isinstance(scalar, (list, tuple)):  # a list of 0-d tensors: its first stands for all
        scalar = scalar[0] if scalar else None
    return torch.is_grad_enabled() and isinstance(scalar, torch.Tensor) and scalar.ndim == 0 and scalar.requires_grad


def computed_once(scalar: Any) -> Any:
    """A 0-d tensor factor that a compiled step computes once, not once per vector of elements.

    Inductor inlines a 0-d tensor's arithmetic into each kernel that reads it, and its C++ kernels
    (built with ``-fmath-errno``, so the C++ compiler may not move a libm call out of a loop) then
    redo it for every vector of 16 floats: adam's bias corrections (two ``expm1`` and a ``sqrt``)
    doubled the time of adamw's compiled update over GPT-2-small's shapes. On CPU inductor gives a
    concatenation a buffer of its own, so the factor is computed there once and each loop reads it.
    Eager mode does not trace, and is left as it is.
    """
    if not torch.compiler.is_compiling():
        return scalar
    if isinstance(scalar, list) and scalar and all(s is scalar[0] for s in scalar):  # [factor] * n
        return [computed_once(scalar[0])] * len(scalar)
    if isinstance(scalar, torch.Tensor) and scalar.ndim == 0:
        return torch.stack((scalar, scalar))[0]
    return scalar


def _each(fn: Callable[..., torch.Tensor], *args: Any) -> list[torch.Tensor]:
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    return [fn(*(a[i] if isinstance(a, (list, tuple)) else a for a in args)) for i in range(n)]


def _rebind(xs: list[torch.Tensor], results: list[torch.Tensor]) -> list[torch.Tensor]:
    xs[:] = results
    return xs


_Op = Callable[..., Any]


def _binary(op: _Op, foreach_op: _Op, xs: list[torch.Tensor], other: Any) -> list[torch.Tensor]:
    """``op(x, other)`` for each of ``xs`` (``other`` a scalar, a 0-d tensor or a list of them), as new tensors."""
    other = computed_once(other)
    if _per_tensor(other):
        return _each(op, list(xs), other)
    return list(foreach_op(xs, other))


def _binary_(op: _Op, foreach_op_: _Op, xs: list[torch.Tensor], other: Any) -> list[torch.Tensor]:
    """:func:`_binary` into ``xs``: in place, or by rebinding its elements where it runs one op per tensor."""
    other = computed_once(other)
    if _per_tensor(other):
        return _rebind(xs, _each(op, list(xs), other))
    foreach_op_(xs, other)
    return xs


def mul(xs: list[torch.Tensor], other: Any) -> list[torch.Tensor]:
    return _binary(torch.mul, torch._foreach_mul, xs, other)


def mul_(xs: list[torch.Tensor], other: Any) -> list[torch.Tensor]:
    return _binary_(torch.mul, torch._foreach_mul_, xs, other)


def add(xs: list[torch.Tensor], other: Any, *, alpha: float = 1) -> list[torch.Tensor]:
    other = computed_once(other)
    if _per_tensor(other):
        return _each(lambda x, y: torch.add(x, y, alpha=alpha), list(xs), other)
    return list(torch._foreach_add(xs, other, alpha=alpha) if alpha != 1 else torch._foreach_add(xs, other))


def add_(xs: list[torch.Tensor], other: Any) -> list[torch.Tensor]:
    return _binary_(torch.add, torch._foreach_add_, xs, other)


def div(xs: list[torch.Tensor], other: Any) -> list[torch.Tensor]:
    return _binary(torch.div, torch._foreach_div, xs, other)


def addcmul_(
    xs: list[torch.Tensor], a: list[torch.Tensor], b: list[torch.Tensor], *, value: float
) -> list[torch.Tensor]:
    if under_vmap():
        return _rebind(xs, _each(lambda x, y, z: torch.addcmul(x, y, z, value=value), list(xs), list(a), list(b)))
    torch._foreach_addcmul_(xs, a, b, value=value)
    return xs


def lerp(xs: list[torch.Tensor], ends: list[torch.Tensor], weight: Any) -> list[torch.Tensor]:
    weight = computed_once(weight)
    if _per_tensor(weight):
        return _each(torch.lerp, list(xs), list(ends), weight)
    if isinstance(weight, torch.Tensor):  # the weights overload: a 0-d tensor as a Scalar would be read to the host
        return list(torch._foreach_lerp(xs, ends, [weight] * len(xs)))
    return list(torch._foreach_lerp(xs, ends, weight))


def sqrt(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``sqrt`` computed as ``pow(x, 0.5)`` (the same kernel): autograd keeps its input, not its result, so the
    caller may write into the result in place."""
    if under_vmap():
        return _each(lambda x: torch.pow(x, 0.5), list(xs))
    return list(torch._foreach_pow(xs, 0.5))


def clamp(xs: list[torch.Tensor], low: float, high: float) -> list[torch.Tensor]:
    if under_vmap():
        return _each(lambda x: torch.clamp(x, low, high), list(xs))
    return list(torch._foreach_clamp_max(torch._foreach_clamp_min(xs, low), high))


def group_by_device_dtype(tensors: list[torch.Tensor]) -> list[tuple[tuple[torch.device, torch.dtype], list[int]]]:
    """``[((device, dtype), indices)]``: ``tensors`` (local, not DTensors) in the groups a foreach kernel takes.

    Eager, torch's own C++ grouping (what ``torch.optim`` uses: no Python loop
    over the tensors); traced or under ``vmap``, the same grouping in Python.
    """
    if tensors and not (torch.compiler.is_compiling() or under_vmap()):
        return [(key, idx) for key, (_, idx) in torch._C._group_tensors_by_device_and_dtype([list(tensors)], True).items()]  # type: ignore[list-item]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.items())
