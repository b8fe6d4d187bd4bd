"""Local norms of gradient trees: one foreach norm per (device, dtype) group, the norms combined in fp64.

Everything here is computed on each tensor's local shard, on the calling
thread, with no communication. Turning local parts into the norm of a sharded
model (summing p-th powers over the mesh dims where a grad is sharded) is the
job of the plan in :mod:`gradtx.distributed.plan`; see ``docs/distributed.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors

from gradtx.comm.local_ranks import per_rank
from gradtx.core import foreach as fe
from gradtx.core import tree as tu

# A CPU tensor of 128K elements or more is split into rows of 1K elements, whose fp32 norms are combined
# in fp64, in one ``vector_norm(rows, dim=1)``: one parallel region for the whole tensor. Rows that short
# keep the sums within 1e-7 of fp64 even on values with few mantissa bits (the fp32 grads of a bf16
# autocast, whose squares tie when rounded: rows of 64K drift 3e-6 there), at the speed of longer rows;
# one pass over GPT-2's 38M-element embedding drifts 2.7e-3 (torch's get_total_norm is that far off).
# A smaller tensor keeps one foreach norm (up to 3e-6 off on such values): a split of each, with its
# Python, would double the time of a model of 64K-element tensors.
#
# A bf16/fp16 tensor of more than 32K elements is split into rows of 32K for a foreach norm, which
# upcasts as it reads, one row per kernel on one thread (about 2e-6 off fp64). Upcasting it to fp32
# first, even in pieces, takes less time on idle cores but many parallel regions, which run 2 to 50
# times slower beside busy processes.
#
# A group of many small fp32 tensors is copied into one buffer and reduced in the same rows (see
# ``_small``). On a GPU the foreach kernel adds its block partials by a tree already, so there every
# tensor goes to it whole.
_ROW = 1 << 10
_MIN_ROWS = 1 << 17
_LOW_ROW = 1 << 15
_FP64 = frozenset({torch.float64, torch.complex128})
_SMALL = 1 << 10  # mean elements a tensor up to which a group's norm is taken over a flat copy (see _small)


def partial_dtype(device: torch.device) -> torch.dtype:
    """The dtype contributions are added in on ``device``: fp64, or fp32 where the device has no fp64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def norm_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype a norm of ``tensors`` is returned in: fp64 if any of them is fp64/complex128, else fp32."""
    return torch.float32 if _FP64.isdisjoint({t.dtype for t in tensors}) else torch.float64


def power_to_norm(power: torch.Tensor, norm_type: float) -> torch.Tensor:
    """A norm from its additive form (``norm**p``, or the norm itself for ``inf``, combined with MAX)."""
    return power if math.isinf(norm_type) else power.pow(1.0 / norm_type)


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the precision its norms are taken in (fp32, fp64 for fp64/complex128); ``|x|`` for complex ``x``."""
    return (x.abs() if x.is_complex() else x).to(tu.acc_dtype(x.dtype))


def total(sums: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Add up contributions from :func:`tensor_powsums` (``max`` for ``inf``) into one 0-d tensor on ``device``; 0 if none."""
    if not sums:
        return torch.zeros((), dtype=torch.float64, device=device)
    dtype = sums[0].dtype if all(s.dtype == sums[0].dtype for s in sums) else torch.float64
    stacked = torch.stack([s if s.device == device and s.dtype == dtype else s.to(device, dtype) for s in sums])
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


def tensor_powsums(tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each tensor's local contribution to a ``norm_type``-norm: ``sum(|x|**p)``, or ``max(|x|)`` for ``inf``.

    This is the additive form every reduction works on: contributions of the
    shards of one tensor, or of many tensors, are summed (or maxed for ``inf``)
    and the root is taken once, at the end. They come as one 1-d tensor in the
    order of ``tensors``, on the first one's device, fp64 (fp32 on a device
    without fp64): a plan sums them in one pass, with no Python per tensor. An
    empty shard contributes 0; complex tensors are measured by magnitude.
    """
    locals_ = tu.local_shards(tensors)
    if not locals_:
        return torch.zeros(0, dtype=torch.float64)
    return _powsums(locals_, norm_type)


@per_rank
def _powsums(locals_: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    device = locals_[0].device
    part = partial_dtype(device)
    if fe.under_vmap():
        vec = torch.stack([_plain_norm(t, norm_type).to(device) for t in locals_])
    else:
        pieces = [(idx, norms.to(device, part)) for idx, norms in _group_norms(locals_, norm_type, with_indices=True)]
        vec = pieces[0][1] if len(pieces) == 1 else torch.cat([norms for _, norms in pieces])
        order = [i for idx, _ in pieces for i in idx]
        if order != list(range(len(order))):  # groups (device, dtype; a big CPU tensor's rows) back in tensor order
            vec = vec[torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=device)]
    return vec if math.isinf(norm_type) else vec.pow(norm_type)


def local_norm(leaves: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of the local shards of ``leaves`` taken together (0-d, fp32 or fp64); no communication.

    Matches ``torch.nn.utils.get_total_norm`` on fp32 tensors, and is closer
    than it to the exact norm of long tensors. For the norm of a sharded model
    use :func:`gradtx.global_norm`, which reduces it over the mesh dims where
    each leaf is sharded.
    """
    # (C-level passes over the leaves, no Python loop: this is most of a small model's host work)
    locals_ = tu.local_shards(leaves)
    if not locals_:
        return torch.zeros(())
    return _local_norm(locals_, norm_type)


@per_rank  # simulated ranks hold shards of different sizes, empty ones included
def _local_norm(locals_: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    device = locals_[0].device
    if fe.under_vmap():
        norms = [_plain_norm(t, norm_type).to(device) for t in locals_]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type).to(norm_dtype(locals_))
    parts = [norms for _, norms in _group_norms(locals_, norm_type, with_indices=False)]
    part = partial_dtype(device)
    # ||x||_p is the p-norm of its pieces' p-norms: the pieces' norms are combined in fp64.
    if len(parts) == 1:
        return torch.linalg.vector_norm(parts[0], norm_type, dtype=part).to(tu.acc_dtype(locals_[0].dtype))
    joined = torch.cat([n.to(device, part) for n in parts])
    return torch.linalg.vector_norm(joined, norm_type).to(norm_dtype(locals_))


def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type``-norm of each tensor's local shard: fp32, or fp64 for fp64/complex128; an empty shard has 0."""
    locals_ = tu.local_shards(tensors)
    return [n.to(tu.acc_dtype(t.dtype)) for n, t in zip(_tensor_norms(locals_, norm_type), locals_)]


@per_rank
def _tensor_norms(locals_: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's norm, 0-d in the partial dtype of its device."""
    if not locals_:
        return []
    if fe.under_vmap():
        return [_plain_norm(t, norm_type) for t in locals_]
    out: list[torch.Tensor] = [None] * len(locals_)  # type: ignore[list-item]
    for idx, norms in _group_norms(locals_, norm_type, with_indices=True):
        for i, n in zip(idx, norms.to(partial_dtype(norms.device)).unbind()):
            out[i] = n
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


def _group_norms(
    locals_: list[torch.Tensor], norm_type: float, *, with_indices: bool
) -> list[tuple[list[int], torch.Tensor]]:
    """The norms of ``locals_`` as ``(indices, 1-d tensor)`` pairs: one foreach call per (device, dtype).

    The norms are fp32, or fp64 for fp64 tensors and for big CPU tensors'
    rows; the indices are given only ``with_indices``.
    """
    inf = math.isinf(norm_type)
    out = []
    for (device, dtype), (ts, idx) in _grouped(locals_, with_indices).items():
        part = partial_dtype(device)
        rows = device.type == "cpu" and not inf and dtype not in _FP64 and not dtype.is_complex
        if rows or inf:  # big CPU tensors by rows; no inf-norm of an empty tensor (it has no identity): 0
            sizes = list(map(torch.Tensor.numel, ts))
            least = _MIN_ROWS if dtype == torch.float32 else _LOW_ROW + 1
            if (rows and max(sizes) >= least) or (inf and min(sizes) == 0):
                special = [i for i, n in enumerate(sizes) if (n >= least if rows else n == 0)]
                norms = [
                    _rows_norm(ts[i], norm_type) if rows else torch.zeros((), dtype=part, device=device)
                    for i in special
                ]
                out.append(([idx[i] for i in special] if with_indices else [], torch.stack(norms)))
                keep = sorted(set(range(len(ts))) - set(special))
                ts, idx = [ts[i] for i in keep], [idx[i] for i in keep] if with_indices else idx
        if ts and not with_indices and _small(ts, device, dtype):
            out.append((idx, _rows_norm(_flatten_dense_tensors(ts), norm_type).reshape(1)))
        elif ts:
            out.append((idx, _foreach_norms(ts, norm_type)))
    return out


def _small(ts: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the norms of ``_ROW``-element (1K) rows of a flat copy of ``ts`` (eager, CPU, fp32) beat a foreach norm.

    Below about 1K elements a tensor, copying the group into one buffer takes a third of the time of a
    foreach norm, which runs a kernel and makes a 0-d tensor for each (1,000 tensors of 256 elements:
    0.7 against 1.9 ms, one thread); from a few thousand elements up the copy costs more than it saves.
    Rows as short as the tensors keep the sums as close to fp64 as per-tensor norms are. fp64 keeps
    torch's per-tensor order, which code that checks fp64 steps against torch's to 1e-9 relies on.
    """
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and not torch.compiler.is_compiling()
        and sum(map(torch.Tensor.numel, ts)) <= _SMALL * len(ts)
    )


def _grouped(
    locals_: list[torch.Tensor], with_indices: bool
) -> dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]]:
    """``locals_`` by (device, dtype), as torch's optimizers group them (in C++; in Python for dynamo)."""
    if torch.compiler.is_compiling():
        return {k: ([locals_[i] for i in idx], idx) for k, idx in fe.group_by_device_dtype(locals_)}
    grouped = torch._C._group_tensors_by_device_and_dtype([list(locals_)], with_indices)  # type: ignore[list-item]
    return {k: (ts, idx) for k, ([ts], idx) in grouped.items()}  # type: ignore[misc]


def _foreach_norms(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of each tensor of one device and dtype, in one foreach call, as a 1-d fp32/fp64 tensor."""
    dtype = tensors[0].dtype
    acc = tu.acc_dtype(dtype)
    kwargs = {} if dtype.is_complex or dtype == acc else {"dtype": acc}  # no real dtype= for complex; none needed
    return torch.stack(torch._foreach_norm(tensors, norm_type, **kwargs))


def _rows_norm(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of a big CPU tensor (0-d fp64): fp32 norms of rows of ``_ROW`` (``_LOW_ROW``) elements, combined in fp64."""
    flat = t.reshape(-1)
    acc = tu.acc_dtype(t.dtype)
    row = _ROW if t.dtype == acc else _LOW_ROW
    whole = flat.numel() // row * row
    rows = flat[:whole].view(-1, row)
    kwargs = {} if t.dtype == acc else {"dtype": acc}
    # One reduction over the rows: traced, inductor fuses the rows and the upcast; eager, fp32 rows take half the
    # time of a foreach norm over them (one parallel region, not one a row) with the same result. A low-precision
    # eager reduction with dtype= would first copy the tensor to fp32: there the foreach kernel upcasts as it reads.
    if torch.compiler.is_compiling() or not kwargs:
        parts = [torch.linalg.vector_norm(rows, norm_type, dim=1, **kwargs)]
    else:
        parts = [torch.stack(torch._foreach_norm(list(rows.unbind()), norm_type, **kwargs))]
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:], norm_type, dtype=acc).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts), norm_type, dtype=torch.float64)


def _plain_norm(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One tensor's norm with ops that have batching rules, in the partial dtype: the path under ``torch.func.vmap``.

    The foreach norm has no batching rule (torch 2.13); ``vector_norm`` has one. At any depth: under
    ``vmap(grad(f))`` a shard is a grad-tracking tensor whose batched one is inside it. (Autograd and
    ``torch.func.grad`` alone go through the foreach norm: it has a derivative. Traced, any functorch
    transform takes the plain ops, see :func:`~gradtx.core.foreach.under_vmap`.)
    """
    return torch.linalg.vector_norm(magnitudes(t), norm_type).to(partial_dtype(t.device))
