"""Local norms of gradient trees, accumulated in fp32 with foreach kernels.

Everything here is computed on each tensor's local shard, with no
communication. Turning local parts into the norm of a sharded model (summing
p-th powers over the mesh dims where a grad is sharded) is the job of the
plan in :mod:`gradtx.plan`; see ``docs/distributed.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gradtx import _foreach as fe
from gradtx import tree as tu


def check_norm_type(norm_type: float, *, name: str) -> float:
    """Validate a norm order: a positive number or ``inf``."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"{name}: norm_type must be a number, got {type(norm_type).__name__}")
    norm_type = float(norm_type)
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"{name}: norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type``-norm of each tensor's local shard, one foreach kernel per (device, dtype).

    Low-precision tensors accumulate in fp32, and their norm is fp32; fp64 and
    complex128 ones accumulate in fp64 and keep an fp64 norm (nothing is
    rounded to fp32). A complex tensor's norm is that of its magnitudes, as
    ``torch.linalg.vector_norm`` takes it. An empty shard has norm 0.
    """
    locals_ = [tu.local(t) for t in tensors]
    if fe.under_vmap():  # per-example norms: foreach kernels have no batching rule
        return [torch.linalg.vector_norm(magnitudes(t), norm_type) for t in locals_]
    out: list[torch.Tensor] = [None] * len(locals_)  # type: ignore[list-item]
    for (device, dtype), idx in tu.group_by_device_dtype(locals_).items():
        acc = tu.acc_dtype(dtype)
        norms: Sequence[torch.Tensor]
        # An empty shard (FSDP2 gives one to a rank whenever a param has fewer rows than ranks)
        # has norm 0 for every p; _foreach_norm refuses the inf-norm of an empty tensor.
        empty = [i for i in idx if locals_[i].numel() == 0]
        if empty:
            for i in empty:
                out[i] = torch.zeros((), dtype=acc, device=device)
            idx = [i for i in idx if locals_[i].numel() != 0]
            if not idx:
                continue
        if norm_type == 2.0 and dtype in _CPU_L2_DTYPES and device.type == "cpu":
            norms = _l2_norms_cpu([locals_[i] for i in idx])
        elif dtype.is_complex:  # foreach takes no real dtype= for complex; the norm comes out real
            norms = [n.to(acc) for n in torch._foreach_norm([locals_[i] for i in idx], norm_type)]
        else:
            norms = torch._foreach_norm([locals_[i] for i in idx], norm_type, dtype=acc)
        for i, n in zip(idx, norms):
            out[i] = n
    return out


# On CPU, _foreach_norm runs one ATen norm per tensor, whose fp32 running sums drift (2e-3
# relative, measured, on GPT-2's 38M-element embedding), and which upcasts a bf16/fp16 tensor to
# a whole fp32 copy first. BLAS dot (sdot) accumulates in blocks: 8x more accurate there, and at
# the memory-bound floor (~1.6x faster). Low-precision tensors reach it through a small fp32
# scratch buffer, chunk by chunk: ~3x faster than the upcast, and short chunks keep the error
# near 1e-6. Small tensors stay in one foreach call, where a Python call per tensor would cost
# more than it saves.
_CPU_L2_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DOT_MIN_NUMEL = 1 << 16
_LOWP_CHUNK = 1 << 18  # 1 MiB of fp32 scratch: stays in cache


def _l2_norms_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 L2 norms of CPU fp32/bf16/fp16 tensors of one dtype: BLAS ``dot`` for big contiguous ones."""
    out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    small: list[int] = []
    scratch: torch.Tensor | None = None
    for i, t in enumerate(tensors):
        if t.numel() < _DOT_MIN_NUMEL or not t.is_contiguous():
            small.append(i)
            continue
        flat = t.view(-1)
        if t.dtype == torch.float32:
            out[i] = torch.dot(flat, flat).sqrt()
            continue
        if scratch is None:
            scratch = torch.empty(_LOWP_CHUNK, dtype=torch.float32, device=t.device)
        parts = []
        for start in range(0, flat.numel(), _LOWP_CHUNK):
            chunk = flat[start : start + _LOWP_CHUNK]
            buf = scratch[: chunk.numel()]
            buf.copy_(chunk)
            parts.append(torch.dot(buf, buf))
        out[i] = torch.stack(parts).sum().sqrt()
    if small:
        for i, n in zip(small, torch._foreach_norm([tensors[i] for i in small], 2.0, dtype=torch.float32)):
            out[i] = n
    return out


def combine_norms(norms: Sequence[torch.Tensor], norm_type: float, device: torch.device | None = None) -> torch.Tensor:
    """The norm of a vector of norms, as ``torch.nn.utils.clip_grad_norm_`` combines them (0-d; fp32, fp64 if any is)."""
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    device = device if device is not None else norms[0].device
    # Only cross-device norms move: a .to() per tensor is most of this function's cost on many small ones.
    return torch.linalg.vector_norm(torch.stack([n if n.device == device else n.to(device) for n in norms]), norm_type)


def norm_to_power(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The additive form of a norm: ``norm**p``, or the norm itself for ``inf`` (combined with MAX)."""
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def power_to_norm(power: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Invert :func:`norm_to_power`."""
    return power if math.isinf(norm_type) else power.pow(1.0 / norm_type)


def local_norm(leaves: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of the local shards of ``leaves`` taken together (0-d, fp32 or fp64); no communication.

    Matches ``torch.nn.utils.get_total_norm`` on fp32 tensors. For the norm of
    a sharded model use :func:`gradtx.global_norm`, which reduces it over the
    mesh dims where each leaf is sharded.
    """
    return combine_norms(tensor_norms(leaves, norm_type), norm_type)


def unitwise_norm(x: torch.Tensor, *, unitwise: bool = True) -> torch.Tensor:
    """The L2 norm of each output unit of ``x``'s local shard (dim 0 is the unit), broadcastable to it.

    A 0-d or 1-d tensor is one unit, and so is any tensor when ``unitwise`` is
    False. An empty shard gives zeros of the right shape. fp32, fp64 for
    fp64/complex128; a complex tensor's units are measured by magnitude.
    """
    x = magnitudes(tu.local(x))
    if x.ndim <= 1 or not unitwise:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the precision its norms are taken in (fp32, fp64 for fp64/complex128); ``|x|`` for complex ``x``."""
    if x.is_complex():
        return x.abs().to(tu.acc_dtype(x.dtype))
    return x.to(tu.acc_dtype(x.dtype))
