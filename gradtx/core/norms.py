"""Local norms of gradient trees: sums of p-th powers in one pass, fp32 kernels, fp64 partial sums.

Everything here is computed on each tensor's local shard, on the calling
thread, with no communication. Turning local parts into the norm of a sharded
model (summing p-th powers over the mesh dims where a grad is sharded) is the
job of the plan in :mod:`gradtx.distributed.plan`; see ``docs/distributed.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gradtx.comm.local_ranks import per_rank
from gradtx.core import tree as tu

# CPU tensors of 128K elements or more are viewed as rows of 32K elements whose fp32 sums are added
# in fp64: running sums that short stay within about 1e-7 of fp64, where one long fp32 running sum
# drifts 3e-3 on GPT-2's 38M-element embedding (torch's get_total_norm is that far off). A row block
# of 4M elements is one ``dim=1`` op, which torch spreads over its own intra-op threads; the block
# bounds the fp32 copy a low-precision tensor is upcast through. On a GPU the foreach kernel reduces
# in blocks and adds the block partials by a tree already, so there every tensor goes to it whole.
_ROW = 1 << 15
_MIN_ROWS = 4 * _ROW
_BLOCK = 1 << 22
_HAS_POWSUM = hasattr(torch, "_foreach_powsum") and hasattr(torch.linalg, "_powsum")
_FP64 = frozenset({torch.float64, torch.complex128})


def partial_dtype(device: torch.device) -> torch.dtype:
    """The dtype contributions are added in on ``device``: fp64, or fp32 where the device has no fp64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def norm_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype a norm of ``tensors`` is returned in: fp64 if any of them is fp64/complex128, else fp32."""
    return torch.float32 if _FP64.isdisjoint({t.dtype for t in tensors}) else torch.float64


def norm_to_power(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The additive form of a norm: ``norm**p``, or the norm itself for ``inf`` (combined with MAX)."""
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def power_to_norm(power: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Invert :func:`norm_to_power`."""
    return power if math.isinf(norm_type) else power.pow(1.0 / norm_type)


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the precision its norms are taken in (fp32, fp64 for fp64/complex128); ``|x|`` for complex ``x``."""
    if x.is_complex():
        return x.abs().to(tu.acc_dtype(x.dtype))
    return x.to(tu.acc_dtype(x.dtype))


def total(sums: Sequence[torch.Tensor], norm_type: float, device: torch.device | None = None) -> torch.Tensor:
    """Add up contributions from :func:`tensor_powsums` (``max`` for ``inf``) into one 0-d tensor; 0 if none."""
    if not sums:
        return torch.zeros((), dtype=torch.float64, device=device)
    device = device if device is not None else sums[0].device
    dtype = sums[0].dtype if all(s.dtype == sums[0].dtype for s in sums) else torch.float64
    stacked = torch.stack([s if s.device == device and s.dtype == dtype else s.to(device, dtype) for s in sums])
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


def tensor_powsums(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's local contribution to a ``norm_type``-norm: ``sum(|x|**p)``, or ``max(|x|)`` for ``inf`` (0-d each).

    This is the additive form every reduction works on: contributions of the
    shards of one tensor, or of many tensors, are summed (or maxed for ``inf``)
    and the root is taken once, at the end. One foreach call per (device, dtype)
    group; big CPU tensors are summed by rows (see the module's notes). The
    results are fp64 (fp32 on a device without fp64); an empty shard
    contributes 0; complex tensors are measured by magnitude.
    """
    return list(_powsums([tu.local(t) for t in tensors], norm_type))


@per_rank  # simulated ranks hold shards of different sizes, empty ones included
def _powsums(locals_: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [None] * len(locals_)  # type: ignore[list-item]
    for idx, sums in _groups(locals_, norm_type):
        for i, s in zip(idx, sums.unbind()):
            out[i] = s
    return out


def local_norm(leaves: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of the local shards of ``leaves`` taken together (0-d, fp32 or fp64); no communication.

    Matches ``torch.nn.utils.get_total_norm`` on fp32 tensors, and is closer
    than it to the exact norm of long tensors. For the norm of a sharded model
    use :func:`gradtx.global_norm`, which reduces it over the mesh dims where
    each leaf is sharded.
    """
    locals_ = [tu.local(t) for t in leaves] if any(type(t) is not torch.Tensor for t in leaves) else list(leaves)
    dtype = norm_dtype(locals_)
    if dtype == torch.float64 and not _plain_ops_only(locals_):
        # fp64 norms by torch's norm kernel, which scales: a finite fp64 norm past 1e154 has no finite square
        norms = _fp64_norms(locals_, norm_type)
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return power_to_norm(_local_total(locals_, norm_type), norm_type).to(dtype)


@per_rank
def _local_total(locals_: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not locals_:
        return torch.zeros((), dtype=torch.float64)
    inf = math.isinf(norm_type)
    parts = [sums.max() if inf else sums.sum() for _, sums in _groups(locals_, norm_type)]
    return parts[0] if len(parts) == 1 else total(parts, norm_type, locals_[0].device)


def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type``-norm of each tensor's local shard: fp32, or fp64 for fp64/complex128; an empty shard has 0."""
    locals_ = [tu.local(t) for t in tensors]
    if norm_dtype(locals_) == torch.float64 and not _plain_ops_only(locals_):
        return list(_fp64_norms(locals_, norm_type))
    sums = tensor_powsums(tensors, norm_type)
    return [power_to_norm(s, norm_type).to(tu.acc_dtype(t.dtype)) for s, t in zip(sums, locals_)]


@per_rank
def _fp64_norms(locals_: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    out = []
    for t in locals_:
        acc = tu.acc_dtype(t.dtype)
        if t.numel() == 0:
            out.append(torch.zeros((), dtype=acc, device=t.device))
        else:
            out.append(torch.linalg.vector_norm(t, norm_type, dtype=None if t.is_complex() else acc).to(acc))
    return out


def unitwise_norm(x: torch.Tensor, *, unitwise: bool = True) -> torch.Tensor:
    """The L2 norm of each output unit of ``x``'s local shard, in PyTorch layouts, broadcastable to it.

    A Linear weight is ``(out, in)`` and a Conv weight ``(out, in, kh, kw)``, so
    a unit is a slice along dim 0 and the norm reduces over dims ``1..ndim-1``.
    A 0-d or 1-d tensor is one unit, and so is any tensor when ``unitwise`` is
    False. An empty shard gives zeros of the right shape. fp32, fp64 for
    fp64/complex128; a complex tensor's units are measured by magnitude.
    """
    x = magnitudes(tu.local(x))
    if x.ndim <= 1 or not unitwise:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


# --- the local pass --------------------------------------------------------------------------------


def _groups(locals_: list[torch.Tensor], norm_type: float) -> list[tuple[list[int], torch.Tensor]]:
    """The contributions of ``locals_`` as ``(indices, 1-d tensor)`` pairs: one foreach call per (device, dtype)."""
    if _plain_ops_only(locals_):
        return [([i], _plain_powsum(t, norm_type).reshape(1)) for i, t in enumerate(locals_)]
    inf = math.isinf(norm_type)
    out = []
    for (device, dtype), idx in tu.group_by_device_dtype(locals_).items():
        part = partial_dtype(device)
        rows = device.type == "cpu" and not inf and not dtype.is_complex
        if rows or inf:  # big CPU tensors by rows; no inf-norm of an empty tensor (it has no identity)
            sizes = [locals_[i].numel() for i in idx]
            big = [i for i, n in zip(idx, sizes) if rows and n >= _MIN_ROWS]
            if big:
                out.append((big, torch.stack([_rows_powsum(locals_[i], norm_type) for i in big])))
            empty = [i for i, n in zip(idx, sizes) if inf and n == 0]
            if empty:
                out.append((empty, torch.zeros(len(empty), dtype=part, device=device)))
            if big or empty:
                idx = [i for i, n in zip(idx, sizes) if not (rows and n >= _MIN_ROWS) and not (inf and n == 0)]
        if idx:
            out.append((idx, torch.stack(_foreach_powsum([locals_[i] for i in idx], norm_type)).to(part)))
    return out


def _foreach_powsum(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """``sum(|x|**p)`` (``max|x|`` for inf) of each tensor of one device and dtype, in one foreach call."""
    dtype = tensors[0].dtype
    acc = tu.acc_dtype(dtype)
    kwargs = {} if dtype.is_complex or dtype == acc else {"dtype": acc}  # no real dtype= for complex; none needed
    if math.isinf(norm_type):
        return list(torch._foreach_norm(tensors, norm_type, **kwargs))
    # On CPU, _foreach_powsum with an upcasting dtype= takes a slow path (150x _foreach_norm's on bf16,
    # torch 2.13), and dynamo cannot trace it: the norm kernel raised to the p-th power is one pass too.
    upcast_on_cpu = dtype != acc and tensors[0].device.type == "cpu"
    if _HAS_POWSUM and not dtype.is_complex and not upcast_on_cpu and not torch.compiler.is_compiling():
        return list(torch._foreach_powsum(tensors, norm_type, **kwargs))
    return list(torch._foreach_pow(torch._foreach_norm(tensors, norm_type, **kwargs), norm_type))


def _rows_powsum(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum(|t|**p)`` of a big CPU tensor (0-d fp64): fp32 sums of rows of ``_ROW`` elements, added in fp64."""
    flat = t.reshape(-1)
    acc = tu.acc_dtype(t.dtype)
    whole = flat.numel() // _ROW * _ROW
    blocks = [flat[s : min(s + _BLOCK, whole)].view(-1, _ROW) for s in range(0, whole, _BLOCK)]
    if whole < flat.numel():
        blocks.append(flat[whole:].view(1, -1))  # the tail: one short row
    if _HAS_POWSUM and not torch.compiler.is_compiling():
        # a low-precision block is upcast first (a bounded copy): the upcasting powsum is slow on CPU
        parts = [torch.linalg._powsum(rows.to(acc), norm_type, dim=1) for rows in blocks]
    else:  # dynamo cannot trace powsum; inductor fuses the norm's rows as well
        parts = [torch.linalg.vector_norm(rows.to(acc), norm_type, dim=1).double().pow(norm_type) for rows in blocks]
    return torch.cat(parts).sum(dtype=torch.float64)


def _plain_ops_only(locals_: Sequence[torch.Tensor]) -> bool:
    """Under ``torch.func.vmap``, or while autograd records through a leaf (a gradient through the clip).

    ``_foreach_powsum`` has neither a batching rule nor a derivative (torch 2.13);
    ``vector_norm`` and ``pow`` have both.
    """
    if not locals_:
        return False
    if not torch.compiler.is_compiling():
        is_batched = getattr(getattr(torch._C, "_functorch", None), "is_batchedtensor", None)
        if is_batched is not None and is_batched(locals_[0]):
            return True
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and any(t.requires_grad for t in locals_)


def _plain_powsum(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One tensor's contribution with ops that have batching rules and derivatives (vector_norm, pow)."""
    n = torch.linalg.vector_norm(magnitudes(t), norm_type)
    return norm_to_power(n, norm_type).to(partial_dtype(t.device))
