"""Local norms of gradient trees: sums of p-th powers in one pass, fp32 kernels, fp64 partial sums.

Everything here is computed on each tensor's local shard, with no
communication. Turning local parts into the norm of a sharded model (summing
p-th powers over the mesh dims where a grad is sharded) is the job of the
plan in :mod:`gradtx.distributed.plan`; see ``docs/distributed.md``.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from gradtx.core import tree as tu

_T = TypeVar("_T")
_R = TypeVar("_R")

try:  # torch's simulated ranks (gtx.testing.simulated_mesh): the shard-size branch below must run per rank
    from torch.distributed._local_tensor import maybe_run_for_local_tensor
except ImportError:  # pragma: no cover

    def maybe_run_for_local_tensor(func):  # type: ignore[no-redef,misc]
        return func


def tensor_powsums(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's local contribution to a ``norm_type``-norm: ``sum(|x|**p)``, or ``max(|x|)`` for ``inf`` (0-d each).

    This is the additive form every reduction works on: contributions of the
    shards of one tensor, or of many tensors, are summed (or maxed for ``inf``)
    and the ``p``-th root is taken once, at the end. One pass over each
    tensor, with no root-then-power round trip: ``torch._foreach_powsum``
    where the installed torch has it, else ``_foreach_norm`` raised to the
    ``p``. Big CPU tensors are summed in rows of a fixed length whose fp32
    partial sums are added in fp64, so a 38M-element tensor is within a few
    1e-7 of an fp64 reference, where one long fp32 running sum drifts 3e-3;
    bf16/fp16 rows are upcast one row at a time, never as a whole copy. The
    rows are shared by ``torch.get_num_threads()`` threads, each taking the
    next chunk as it finishes one, so a core held up by other work slows
    only its own share. On a GPU the foreach kernel's own block-wise
    reduction does the same in one launch.

    The results are fp64 (fp32 on a device without fp64), whatever the input
    dtype; an empty shard contributes 0. Complex tensors are measured by
    magnitude. Under ``torch.func.vmap`` (a batched first leaf) only plain
    per-tensor ops run: foreach kernels have no batching rules.
    """
    return list(_local_powsums([tu.local(t) for t in tensors], norm_type))


@maybe_run_for_local_tensor  # under simulated ranks, once per rank: their shards differ in size (empty included)
def _local_powsums(locals_: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [None] * len(locals_)  # type: ignore[list-item]
    for idx, sums in _powsum_groups(locals_, norm_type):
        for i, v in zip(idx, sums.unbind()):
            out[i] = v
    return out


def _powsum_groups(locals_: list[torch.Tensor], norm_type: float) -> list[tuple[list[int], torch.Tensor]]:
    """:func:`tensor_powsums` as ``(indices, 1-d tensor of their contributions)`` per (device, dtype) group."""
    if not locals_:
        return []
    if _plain_ops_only(locals_):
        return [([i], _plain_powsum(t, norm_type).reshape(1)) for i, t in enumerate(locals_)]
    inf = math.isinf(norm_type)
    groups: list[tuple[list[int], torch.Tensor]] = []
    for (device, dtype), idx in tu.group_by_device_dtype(locals_).items():
        sum_dtype = partial_dtype(device)
        acc = tu.acc_dtype(dtype)
        # One pass over the group sorts its tensors: empty shards (FSDP2 gives one to a rank whenever a
        # param has fewer rows than ranks) contribute 0 for every p, and _foreach_norm refuses the
        # inf-norm of an empty tensor; big CPU tensors are summed by rows; the rest go to one foreach call.
        by_rows = device.type == "cpu" and not inf and not dtype.is_complex
        empty: list[int] = []
        rows: list[int] = []
        small: list[int] = []
        for i in idx:
            t = locals_[i]
            n = t.numel()
            if n == 0:
                empty.append(i)
            elif by_rows and n >= _MIN_ROWS and t.is_contiguous():
                rows.append(i)
            else:
                small.append(i)
        if empty:
            groups.append((empty, torch.zeros(len(empty), dtype=sum_dtype, device=device)))
        if rows:
            groups.append((rows, _rows_powsums([locals_[i] for i in rows], norm_type, acc, sum_dtype)))
        if not small:
            continue
        tensors = [locals_[i] for i in small]
        if inf or dtype.is_complex:  # max|x| is exact in any dtype; complex magnitudes take the norm kernel
            kwargs = {} if dtype.is_complex else {"dtype": acc}  # foreach takes no real dtype= for complex
            norms = torch._foreach_norm(tensors, norm_type, **kwargs)
            sums: Sequence[torch.Tensor] = norms if inf else torch._foreach_pow(norms, norm_type)
        else:
            sums = _foreach_powsum(tensors, norm_type, acc)
        groups.append((small, torch.stack(list(sums)).to(sum_dtype)))
    return groups


def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type``-norm of each tensor's local shard, from :func:`tensor_powsums`.

    Low-precision tensors' norms are fp32; fp64 and complex128 ones keep an
    fp64 norm. A complex tensor's norm is that of its magnitudes, as
    ``torch.linalg.vector_norm`` takes it. An empty shard has norm 0.
    """
    locals_ = [tu.local(t) for t in tensors]
    if norm_dtype(locals_) == torch.float64 and not _is_batched(locals_[0]):  # see _fp64_norms
        return _fp64_norms(locals_, norm_type)
    sums = tensor_powsums(tensors, norm_type)
    return [power_to_norm(s, norm_type).to(tu.acc_dtype(t.dtype)) for s, t in zip(sums, tensors)]


@maybe_run_for_local_tensor  # per simulated rank, as _local_powsums
def _fp64_norms(locals_: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Norms taken by torch's norm kernel, which scales: a finite fp64 norm past 1e154 has no finite square."""
    out: list[torch.Tensor] = [None] * len(locals_)  # type: ignore[list-item]
    for (device, dtype), idx in tu.group_by_device_dtype(locals_).items():
        acc = tu.acc_dtype(dtype)
        for i in idx:
            if locals_[i].numel() == 0:  # _foreach_norm refuses the inf-norm of an empty tensor
                out[i] = torch.zeros((), dtype=acc, device=device)
        idx = [i for i in idx if locals_[i].numel() != 0]
        if idx:
            kwargs = {} if dtype.is_complex else {"dtype": acc}  # foreach takes no real dtype= for complex
            for i, n in zip(idx, torch._foreach_norm([locals_[i] for i in idx], norm_type, **kwargs)):
                out[i] = n.to(acc)
    return out


def total(sums: Sequence[torch.Tensor], norm_type: float, device: torch.device | None = None) -> torch.Tensor:
    """Add up contributions from :func:`tensor_powsums` (``max`` for ``inf``) into one 0-d tensor; 0 if none."""
    if not sums:
        return torch.zeros((), dtype=torch.float64, device=device)
    device = device if device is not None else sums[0].device
    dtype = sums[0].dtype if all(s.dtype == sums[0].dtype for s in sums) else torch.float64
    # Only cross-device values move: a .to() per tensor is most of the cost on many small ones.
    stacked = torch.stack([s if s.device == device and s.dtype == dtype else s.to(device, dtype) for s in sums])
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


def norm_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype a norm of ``tensors`` is returned in: fp64 if any of them is fp64/complex128, else fp32."""
    return torch.float32 if _FP64.isdisjoint({t.dtype for t in tensors}) else torch.float64


_FP64 = frozenset({torch.float64, torch.complex128})


def norm_to_power(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The additive form of a norm: ``norm**p``, or the norm itself for ``inf`` (combined with MAX)."""
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def power_to_norm(power: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Invert :func:`norm_to_power`."""
    return power if math.isinf(norm_type) else power.pow(1.0 / norm_type)


def local_norm(leaves: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of the local shards of ``leaves`` taken together (0-d, fp32 or fp64); no communication.

    Matches ``torch.nn.utils.get_total_norm`` on fp32 tensors, and is closer
    than it to the exact norm of long tensors (see :func:`tensor_powsums`). For the
    norm of a sharded model use :func:`gradtx.global_norm`, which reduces it
    over the mesh dims where each leaf is sharded.
    """
    locals_ = [tu.local(t) for t in leaves]
    device = locals_[0].device if locals_ else None
    dtype = norm_dtype(locals_)
    if dtype == torch.float64 and not _is_batched(locals_[0]):  # fp64 leaves: norms, combined by the scaling norm kernel too
        norms = _fp64_norms(locals_, norm_type)
        return torch.linalg.vector_norm(torch.stack([n.to(device, torch.float64) for n in norms]), norm_type)
    return power_to_norm(_local_total(locals_, norm_type, device), norm_type).to(dtype)


@maybe_run_for_local_tensor  # per simulated rank, as _local_powsums
def _local_total(locals_: list[torch.Tensor], norm_type: float, device: torch.device | None) -> torch.Tensor:
    inf = math.isinf(norm_type)
    parts = [sums.max() if inf else sums.sum() for _, sums in _powsum_groups(locals_, norm_type)]
    return parts[0] if len(parts) == 1 else total(parts, norm_type, device)


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


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the precision its norms are taken in (fp32, fp64 for fp64/complex128); ``|x|`` for complex ``x``."""
    if x.is_complex():
        return x.abs().to(tu.acc_dtype(x.dtype))
    return x.to(tu.acc_dtype(x.dtype))


# --- the local pass, by device and feature -------------------------------------------------------

# Big CPU tensors are viewed as rows whose fp32 sums are added in fp64: running sums that short
# stay within about 3e-7 of fp64 (one long fp32 sum drifts 3e-3 on GPT-2's 38M-element embedding),
# and the fp64 sum of the row partials costs nothing. Each row is one op of torch's own norm or
# powsum kernel, which runs on the calling thread: fp32 rows are 64K elements; bf16/fp16 rows are
# 32K, so that the op's upcast of one row stays under torch's parallel grain (32K elements) and on
# that thread too, never a whole upcast copy. The rows are cut into chunks of 2M elements that
# ``torch.get_num_threads()`` threads take in turn from one shared counter: a thread that the
# machine's other work holds up takes fewer chunks and none waits for it, where torch's intra-op
# parallel regions split every tensor evenly up front and wait for their slowest thread. (A
# row-wise ``dim=1`` reduction over those regions took 0.71 of torch's time on 2 quiet cores but
# 2x to 11x beside two other torch processes.) Kernels release the GIL; each chunk's result has its
# own slot, so the sum is the same whichever thread took it. One thread, or a traced graph, takes
# one chunk per tensor. On a GPU the foreach kernel already reduces in
# blocks and adds the block partials by a tree, so there big tensors go to it whole, in one launch.
_ROW = 1 << 16
_LOWP_ROW = 1 << 15
_MIN_ROWS = 2 * _ROW  # shorter tensors go to the group's one foreach call
_CHUNK = 1 << 21  # elements per chunk a thread takes
_MIN_THREADED = 1 << 22  # fewer elements than this stay on the calling thread
_HAS_POWSUM = hasattr(torch, "_foreach_powsum") and hasattr(torch.linalg, "_powsum")


def partial_dtype(device: torch.device) -> torch.dtype:
    """The dtype contributions are added in on ``device``: fp64, or fp32 where the device has no fp64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _is_batched(t: torch.Tensor) -> bool:
    """True under ``torch.func.vmap``, whose batched tensors foreach kernels cannot take."""
    if torch.compiler.is_compiling():  # dynamo cannot trace the check; a compiled vmap is not supported here
        return False
    is_batched = getattr(getattr(torch._C, "_functorch", None), "is_batchedtensor", None)
    return bool(is_batched(t)) if is_batched is not None else False


def _plain_ops_only(locals_: list[torch.Tensor]) -> bool:
    """Under ``torch.func.vmap``, or while autograd records through a leaf (a gradient through the clip).

    ``_foreach_powsum`` has neither a batching rule nor a derivative (torch 2.13);
    ``vector_norm`` and ``pow`` have both.
    """
    if _is_batched(locals_[0]):
        return True
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and any(t.requires_grad for t in locals_)


def _plain_powsum(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One tensor's contribution with ops that have batching rules (vector_norm, pow)."""
    n = torch.linalg.vector_norm(magnitudes(t), norm_type)
    return norm_to_power(n, norm_type).to(partial_dtype(t.device))


def _use_powsum() -> bool:
    # dynamo cannot trace the powsum kernels yet (torch 2.13); inside a compiled step inductor
    # generates its own reduction from the norm ops instead.
    return _HAS_POWSUM and not torch.compiler.is_compiling()


def _foreach_powsum(tensors: list[torch.Tensor], norm_type: float, acc: torch.dtype) -> Sequence[torch.Tensor]:
    # On CPU, _foreach_powsum with an upcasting dtype= takes a slow path (150x _foreach_norm's, measured
    # on bf16 in torch 2.13); the norm kernel raised to the p-th power is one pass too.
    if _use_powsum() and (tensors[0].dtype == acc or tensors[0].device.type != "cpu"):
        return torch._foreach_powsum(tensors, norm_type, dtype=acc)
    return torch._foreach_pow(torch._foreach_norm(tensors, norm_type, dtype=acc), norm_type)  # older torch


def _rows_powsums(
    tensors: list[torch.Tensor], norm_type: float, acc: torch.dtype, sum_dtype: torch.dtype
) -> torch.Tensor:
    """``sum(|t|**p)`` of each big contiguous CPU tensor (1-d, ``sum_dtype``): fp32 row sums added in fp64."""
    row = _ROW if tensors[0].dtype == acc else _LOWP_ROW
    threads = 1
    if sum(t.numel() for t in tensors) >= _MIN_THREADED and _threads_see_the_same(tensors):
        threads = torch.get_num_threads()  # (never while dynamo traces: _threads_see_the_same says so first)
    chunks: list[tuple[torch.Tensor, int, int]] = []  # (tensor, first row, end row); a tensor's last takes its tail
    owner: list[int] = []
    for i, t in enumerate(tensors):
        n_rows = t.numel() // row
        # 2M-element chunks where threads share them; else (one thread, a traced graph) one per tensor
        starts = range(0, n_rows, _CHUNK // row if threads > 1 else n_rows)
        chunks += [(t, first, min(first + starts.step, n_rows)) for first in starts]
        owner += [i] * len(starts)
    parts = torch.stack(_shared_map(lambda c: _chunk_powsum(*c, row, norm_type, acc, sum_dtype), chunks, threads))
    if len(chunks) == len(tensors):
        return parts
    return torch.zeros(len(tensors), dtype=sum_dtype).index_add_(0, torch.tensor(owner), parts)


def _chunk_powsum(
    t: torch.Tensor, first: int, end: int, row: int, norm_type: float, acc: torch.dtype, sum_dtype: torch.dtype
) -> torch.Tensor:
    """``sum(|x|**p)`` of rows ``first:end`` of ``t`` (and of its tail past the last whole row, if ``end`` is the last)."""
    flat = t.view(-1)
    rows = list(flat[first * row : end * row].view(-1, row).unbind(0))
    if end == flat.numel() // row and end * row < flat.numel():
        rows.append(flat[end * row :])  # the tail shorter than a row is one more, short row
    if rows[0].dtype == acc and _use_powsum():
        return torch.stack(torch._foreach_powsum(rows, norm_type, dtype=acc)).sum(dtype=sum_dtype)
    # bf16/fp16 (powsum's upcasting dtype= takes a slow path on CPU) and older torch: the norm kernel,
    # raised to the p-th power in fp64, which rounds one fp32 result per row.
    norms = torch.stack(torch._foreach_norm(rows, norm_type, dtype=acc)).to(sum_dtype)
    return (norms if norm_type == 1 else norms.pow(norm_type)).sum()


def _threads_see_the_same(tensors: list[torch.Tensor]) -> bool:
    """True where a helper thread computes what this one would: it inherits none of this thread's state."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_function_stack()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._is_any_autocast_enabled()
        or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        or any(type(t) is not torch.Tensor for t in tensors)
    )


def _shared_map(fn: Callable[[_T], _R], items: list[_T], threads: int) -> list[_R]:
    """``[fn(x) for x in items]``, by up to ``threads`` threads (this one included) taking items in turn."""
    threads = min(threads, len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    out: list[_R] = [None] * len(items)  # type: ignore[list-item]
    claim = itertools.count()
    lock = threading.Lock()
    failed: list[BaseException] = []

    def drain() -> None:
        try:
            while not failed:
                with lock:
                    i = next(claim)
                if i >= len(items):
                    return
                out[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 - any failure, KeyboardInterrupt included, is re-raised by the caller
            failed.append(e)

    helpers = [threading.Thread(target=drain, name="gradtx-norm", daemon=True) for _ in range(threads - 1)]
    for h in helpers:
        h.start()
    drain()
    for h in helpers:
        h.join()
    if failed:
        raise failed[0]
    return out
