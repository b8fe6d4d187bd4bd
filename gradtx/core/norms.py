"""Local norms of gradient trees: sums of p-th powers in one pass, fp32 kernels, fp64 partial sums.

Everything here is computed on each tensor's local shard, with no
communication. Turning local parts into the norm of a sharded model (summing
p-th powers over the mesh dims where a grad is sharded) is the job of the
plan in :mod:`gradtx.distributed.plan`; see ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

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
    partial sums are added in fp64, so a 38M-element tensor is within about
    1e-7 of an fp64 reference, where one long fp32 running sum drifts 3e-3;
    bf16/fp16 rows are upcast a piece at a time, never as a whole copy. The
    rows go in chunks (an fp32 chunk is one op) to ``torch.get_num_threads()``
    helper threads that take the next chunk as they finish one, each running
    torch's kernels on itself alone, so a core held up by other work slows
    only its own share. On a GPU the foreach kernel's own block-wise reduction does
    the same in one launch.

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
    """:func:`tensor_powsums` as ``(indices, 1-d tensor of their contributions)`` pairs, a few per (device, dtype)."""
    if not locals_:
        return []
    if _plain_ops_only(locals_):
        return [([i], _plain_powsum(t, norm_type).reshape(1)) for i, t in enumerate(locals_)]
    inf = math.isinf(norm_type)
    groups: list[tuple[list[int], torch.Tensor]] = []
    small: list[list[int]] = []  # per (device, dtype): the tensors its one foreach call takes
    rows: list[int] = []  # big CPU tensors of every dtype: summed by rows
    # The tensors are sorted: empty shards (FSDP2 gives one to a rank whenever a param has fewer
    # rows than ranks) contribute 0 for every p, and _foreach_norm refuses the inf-norm of an empty
    # tensor; big CPU tensors are summed by rows; the rest go to one foreach call per (device, dtype).
    for (device, dtype), idx in tu.group_by_device_dtype(locals_).items():
        by_rows = device.type == "cpu" and not inf and not dtype.is_complex
        empty = [i for i in idx if locals_[i].numel() == 0]
        if empty:
            groups.append((empty, torch.zeros(len(empty), dtype=partial_dtype(device), device=device)))
        big = {i for i in idx if by_rows and locals_[i].numel() >= _MIN_ROWS and locals_[i].is_contiguous()}
        rows += [i for i in idx if i in big]
        rest = [i for i in idx if locals_[i].numel() != 0 and i not in big]
        if rest:
            small.append(rest)
    for idx in small:
        groups.append((idx, _small_powsums([locals_[i] for i in idx], norm_type)))
    if rows:
        groups.append((rows, _rows_powsums([locals_[i] for i in rows], norm_type)))
    return groups


def _small_powsums(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The contributions of tensors of one device and dtype, in one foreach call (1-d, fp64 where it exists)."""
    device, dtype = tensors[0].device, tensors[0].dtype
    acc = tu.acc_dtype(dtype)
    if math.isinf(norm_type) or dtype.is_complex:  # max|x| is exact in any dtype; complex magnitudes: the norm kernel
        kwargs = {} if dtype.is_complex else {"dtype": acc}  # foreach takes no real dtype= for complex
        norms = torch._foreach_norm(tensors, norm_type, **kwargs)
        sums: Sequence[torch.Tensor] = norms if math.isinf(norm_type) else torch._foreach_pow(norms, norm_type)
    else:
        sums = _foreach_powsum(tensors, norm_type, acc)
    return torch.stack(list(sums)).to(partial_dtype(device))


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

# CPU tensors of 128K elements or more are viewed as rows of 32K elements whose fp32 sums are
# added in fp64: for p = 2, running sums that short stay within about 1e-7 of fp64 (one long fp32
# running sum drifts 3e-3 on GPT-2's 38M-element embedding), and the fp64 sum of the row partials
# costs nothing. A chunk of rows is one ``dim=1`` op of torch's powsum (or norm) kernel, which sums
# each row on its own (in vector lanes for p = 2, one running sum otherwise): the row length sets
# the accuracy, not the number of ops (an op per row cost about 5 us, as much as the memory traffic
# saved). bf16/fp16 chunks are copied to fp32 a piece at a time into a buffer the thread keeps
# (the kernels' own upcast allocates a copy per op, and allocations on two threads at once cost
# more than the sum). The chunks, of 4M elements, are taken in turn from one shared counter by
# ``torch.get_num_threads()`` helper threads (no more than the cores the caller may run on), each
# of which sets its own OpenMP thread count to 1 (OpenMP keeps that count per thread: the
# caller's, and torch's setting, are untouched), so no op opens a parallel region. A thread that
# the machine's other work holds up takes fewer chunks, and none waits for it, where torch's
# parallel regions split every tensor evenly up front and wait for their slowest thread (the same
# ``dim=1`` ops spread over those regions took 0.71 of torch's time on 2 quiet cores but 2x to 11x
# beside two other torch processes). Kernels release the GIL; a row's sum does not depend on the
# thread that took it, and the rows are added in one order, so the total is the same bit for bit.
# Where helpers cannot be made serial (a torch whose parallel backend is not OpenMP), or one would
# miss the caller's state, the calling thread takes one chunk per tensor, with torch's kernels
# parallel as usual. On a GPU the foreach kernel already reduces in blocks and adds the block
# partials by a tree, so there big tensors go to it whole, in one launch.
_ROW = 1 << 15
_MIN_ROWS = 4 * _ROW  # shorter tensors go to the group's one foreach call (at least a row: see _rows_powsums)
_CHUNK = 1 << 22  # elements per chunk a thread takes
_PIECE = 1 << 19  # elements of a low-precision chunk copied to fp32 at a time (2 MB)
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


def _rows_powsums(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """``sum(|t|**p)`` of each big contiguous CPU tensor (1-d, fp64): its row sums (fp32, or fp64) added in fp64."""
    threads = 1
    if sum(t.numel() for t in tensors) >= _MIN_THREADED and _threads_see_the_same(tensors):
        threads = _helper_threads()  # (never under dynamo: checked first)
    chunks: list[tuple[torch.Tensor, int, int]] = []  # (tensor, first row, end row); a tensor's last takes its tail
    counts: list[int] = []  # each tensor's rows, its tail counted as one
    for t in tensors:
        n_rows = t.numel() // _ROW  # (at least 4: _MIN_ROWS)
        # 4M-element chunks where threads share them; else (one thread, a traced graph) one per tensor
        starts = range(0, n_rows, _CHUNK // _ROW if threads > 1 else n_rows)
        chunks += [(t, first, min(first + starts.step, n_rows)) for first in starts]
        counts.append(n_rows + (t.numel() % _ROW > 0))
    powsum = _use_powsum()
    parts = _shared_map(lambda c, scratch: _chunk_row_sums(*c, norm_type, powsum, scratch), chunks, threads)
    # The rows are added here, in one order whichever thread took them: a sum per tensor (an index of
    # each row's tensor, for one index_add, is a slow torch.tensor of a long list or a
    # repeat_interleave, which opens a parallel region).
    rows = torch.cat([r for part in parts for r in part]).to(torch.float64)
    rows = rows if powsum else norm_to_power(rows, norm_type)
    return torch.stack([sums.sum() for sums in rows.split(counts)])


def _chunk_row_sums(
    t: torch.Tensor, first: int, end: int, norm_type: float, powsum: bool, scratch: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """The ``sum(|row|**p)`` (``powsum``) or norm of rows ``first:end`` of ``t`` (fp32; fp64 for fp64), one tensor per op.

    A tensor's last chunk also takes its tail past the last whole row, as one
    more, short row. Low-precision rows are copied to fp32 a piece at a time
    into a buffer this thread keeps in ``scratch``: an upcasting kernel would
    allocate a copy per op, and allocations on two threads at once cost more
    than the sum; under dynamo, inductor fuses the upcast into its reduction
    instead. Older torch, and dynamo (which cannot trace the powsum kernels),
    take the norm kernel, raised to the p-th power in fp64 by the caller.
    """
    reduce = torch.linalg._powsum if powsum else torch.linalg.vector_norm
    start, stop = first * _ROW, (t.numel() if end == t.numel() // _ROW else end * _ROW)
    acc = tu.acc_dtype(t.dtype)
    if t.dtype == acc or torch.compiler.is_compiling():
        kwargs = {} if t.dtype == acc else {"dtype": acc}
        return [reduce(rows, norm_type, dim=1, **kwargs) for rows in _as_rows(t.view(-1)[start:stop])]
    if "buf" not in scratch:
        scratch["buf"] = torch.empty(_PIECE, dtype=acc, device=t.device)
    buf = scratch["buf"]
    out: list[torch.Tensor] = []
    for piece in range(start, stop, _PIECE):
        n = min(_PIECE, stop - piece)
        x = buf[:n].copy_(t.view(-1)[piece : piece + n])
        out += [reduce(rows, norm_type, dim=1) for rows in _as_rows(x)]
    return out


def _as_rows(x: torch.Tensor) -> list[torch.Tensor]:
    """A 1-d tensor as 2-d views: its whole rows, then the rest as one short row."""
    whole = x.numel() // _ROW * _ROW
    rows = [x[:whole].view(-1, _ROW)] if whole else []
    if whole < x.numel():
        rows.append(x[whole:].view(1, -1))
    return rows


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


def _helper_threads() -> int:
    """How many helper threads share the rows: torch's thread count, at most the cores this thread may run on.

    1 where helpers cannot run torch's kernels on themselves alone; then the
    calling thread takes every chunk.
    """
    if not _helpers_run_serially():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else torch.get_num_threads()
    return min(torch.get_num_threads(), cores)  # (OMP_PROC_BIND pins the caller, and its helpers, to one core)


@contextlib.contextmanager
def _alone_on_this_thread() -> Iterator[None]:
    """Run the block's torch ops on this thread alone: its own OpenMP thread count 1, restored after.

    torch asks OpenMP for the thread count before each parallel region, and
    OpenMP keeps that count per thread, so no other thread is touched. torch's
    first query on a new thread sets its count from torch's setting; the one
    here comes first, so the count set after it stays.
    """
    set_threads = _OMP_SET_NUM_THREADS
    prev = torch.get_num_threads()
    if set_threads is not None:
        set_threads(1)
    try:
        yield
    finally:
        if set_threads is not None:
            set_threads(prev)


@functools.cache
def _helpers_run_serially() -> bool:
    """True where :func:`_alone_on_this_thread` works (torch's OpenMP backend); asked once, of a thread of its own.

    The probe sets the thread's count to 2 and then to 1 and reads torch's
    count after each, so the answer does not depend on torch's own setting.
    It also checks that the thread is a thread of its own (not the caller's,
    as under a library that patches threads).
    """
    set_threads = _OMP_SET_NUM_THREADS
    if set_threads is None:
        return False
    seen: list[object] = []

    def ask() -> None:
        torch.get_num_threads()  # torch's first query sets a new thread's count (see _alone_on_this_thread)
        set_threads(2)
        seen.append(torch.get_num_threads())
        set_threads(1)
        seen.append(torch.get_num_threads())
        seen.append(threading.get_native_id())

    probe = threading.Thread(target=ask)
    probe.start()
    probe.join()
    return seen[:2] == [2, 1] and seen[2] != threading.get_native_id()


def _openmp_set_num_threads() -> Callable[[int], object] | None:
    try:  # torch loads its OpenMP runtime with global symbols; a build without one has no such symbol
        return ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return None


_OMP_SET_NUM_THREADS = _openmp_set_num_threads()


def _shared_map(fn: Callable[[_T, dict[str, Any]], _R], items: list[_T], threads: int) -> list[_R]:
    """``[fn(x, scratch) for x in items]``, by up to ``threads`` serial helper threads taking items in turn.

    Each thread passes ``fn`` a dict of its own, ``scratch``, for what it
    keeps from one item to the next (a buffer). With one thread (or one item)
    the calling thread maps them all, its OpenMP thread count set to 1 for the
    map and restored after; otherwise it only waits (and raises the first
    failure of any helper). Either way no op of the map opens a parallel region.
    """
    threads = min(threads, len(items))
    if threads <= 1:
        scratch: dict[str, Any] = {}
        if torch.compiler.is_compiling() or not _helpers_run_serially():
            return [fn(x, scratch) for x in items]
        # This thread alone, as a helper runs them: the ops' parallel regions would oversubscribe the
        # cores where several ranks share a machine (and torch's own norm runs on one thread).
        with _alone_on_this_thread():
            return [fn(x, scratch) for x in items]
    out: list[_R] = [None] * len(items)  # type: ignore[list-item]
    claim = itertools.count()
    lock = threading.Lock()
    failed: list[BaseException] = []

    def drain() -> None:
        try:
            scratch: dict[str, Any] = {}
            # no_grad: the caller's mode, or no tensor requires grad (see _threads_see_the_same)
            with _alone_on_this_thread(), torch.no_grad():
                while not failed:
                    with lock:
                        i = next(claim)
                    if i >= len(items):
                        return
                    out[i] = fn(items[i], scratch)
        except BaseException as e:  # noqa: BLE001 - any failure, KeyboardInterrupt included, is re-raised by the caller
            failed.append(e)

    helpers = [threading.Thread(target=drain, name="gradtx-norm", daemon=True) for _ in range(threads)]
    for h in helpers:
        h.start()
    for h in helpers:
        h.join()
    if failed:
        raise failed[0]
    return out
