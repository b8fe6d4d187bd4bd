"""TorchComm: the :class:`~gradtx.comm.Comm` over ``torch.distributed`` process groups and ``DeviceMesh`` dims.

This is the only module in gradtx that issues ``torch.distributed``
collectives (a test scans the package for any other). Everything above it
names groups with keys and never touches a process group directly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from gradtx.comm.base import GroupKey, ReduceOp

_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}


class TorchComm:
    """A :class:`~gradtx.comm.Comm` that reduces over ``torch.distributed`` process groups.

    A group key is one of:

    * a ``ProcessGroup``, used as is (this is what :func:`gradtx.mesh_groups`
      derives from a DTensor's mesh dims);
    * a string naming a dim of ``mesh`` (``"dp"``, ``"tp"``, ``"pp"``), resolved
      with ``mesh.get_group(name)``, or a key of ``groups``;
    * ``"world"`` (or ``None``), the default group;
    * a ``DeviceMesh``: one group over all of its ranks, ranked by global rank
      (the default group when the mesh spans the world, the mesh's own group
      when it is 1-d, else its flattened group).

    Every call to :meth:`all_reduce` issues one collective for its whole list
    of tensors: they are flattened into one buffer, reduced, and split back.
    Tensors of different dtypes cost one collective per dtype, because a sum
    must run in each tensor's own dtype to stay exact for integers.

    The comm is what to pass to :func:`gradtx.mesh_groups`, :func:`gradtx.pp_reduce`
    and the other transforms that communicate.

    Args:
      mesh: the device mesh whose dim names are valid group keys, or ``None``.
      groups: extra named groups, e.g. ``{"tied": embedding_and_head_group}``.

    Example:
      >>> mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
      >>> comm = TorchComm(mesh)
      >>> total, peak = comm.all_reduce([x, y], ReduceOp.SUM, "tp")
    """

    def __init__(
        self, mesh: DeviceMesh | None = None, *, groups: Mapping[str, dist.ProcessGroup] | None = None
    ) -> None:
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"TorchComm: mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
        groups = dict(groups or {})
        for name, group in groups.items():
            if not isinstance(name, str):
                raise TypeError(f"TorchComm: groups keys must be strings, got {name!r}")
            if not isinstance(group, dist.ProcessGroup):
                raise TypeError(f"TorchComm: groups[{name!r}] must be a ProcessGroup, got {type(group).__name__}")
        dim_names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
        clash = sorted(set(dim_names) & set(groups))
        if clash:
            raise ValueError(f"TorchComm: groups names {clash} are also mesh dim names; pick other names")
        self.mesh = mesh
        self.groups = groups

    def resolve(self, group: GroupKey) -> dist.ProcessGroup | None:
        """The process group a key names (``None`` is the default group)."""
        if group is None or (isinstance(group, str) and group == "world"):
            return None
        if isinstance(group, dist.ProcessGroup):
            return group
        if isinstance(group, DeviceMesh):
            return mesh_process_group(group)
        if isinstance(group, str):
            if group in self.groups:
                return self.groups[group]
            if self.mesh is not None and group in (self.mesh.mesh_dim_names or ()):
                return self.mesh.get_group(group)
            known = sorted(self.groups) + list(self.mesh.mesh_dim_names or () if self.mesh is not None else ())
            raise ValueError(
                f"TorchComm: unknown group {group!r}; known names are {['world', *known]}"
                + ("" if self.mesh is not None else " (pass mesh=DeviceMesh to name its dims)")
            )
        raise TypeError(
            f"TorchComm: a group key is a ProcessGroup, a mesh dim name or 'world', got {type(group).__name__}"
        )

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
        """Reduce every tensor over ``group`` in one collective (per dtype); returns new tensors.

        Args:
          tensors: dense tensors, all on one device; the inputs are not modified.
          op: ``ReduceOp.SUM`` or ``ReduceOp.MAX``.
          group: a group key (see the class docstring).

        Returns:
          The reduced tensors, in order, with the inputs' shapes and dtypes.
        """
        return self.all_reduce_async(tensors, op, group).wait()

    def all_reduce_async(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> _Pending:
        """Start :meth:`all_reduce` (``async_op=True``) and return at once; ``.wait()`` gives the results."""
        reduce_op = _OPS[ReduceOp(op)]
        pg = self.resolve(group)
        tensors = list(tensors)
        if not tensors:
            return _Pending([], [], [])
        device = tensors[0].device
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                raise TypeError(
                    f"TorchComm.all_reduce: tensors[{i}] must be a plain torch.Tensor (a DTensor's local shard), "
                    f"got {type(t).__name__}"
                )
            if t.device != device:
                raise ValueError(f"TorchComm.all_reduce: tensors[{i}] is on {t.device}, tensors[0] on {device}")
        by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            by_dtype[t.dtype].append(i)
        works, flats = [], []
        simulated = _simulation()
        for idx in by_dtype.values():
            # One flat buffer per dtype: a single collective, and the inputs are never aliased.
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
            if simulated is not None:
                flat = _per_simulated_rank(flat, simulated)
            works.append(dist.all_reduce(flat, op=reduce_op, group=pg, async_op=True))
            flats.append((flat, idx))
        return _Pending(works, flats, [tuple(t.shape) for t in tensors])

    def size(self, group: GroupKey) -> int:
        """The number of ranks in ``group``."""
        return dist.get_world_size(self.resolve(group))

    def all_to_all(
        self, tensors: Sequence[torch.Tensor], recv_numels: Sequence[int], group: GroupKey
    ) -> list[torch.Tensor]:
        """Send ``tensors[r]`` to rank ``r`` of ``group``; receive ``recv_numels[r]`` elements from each rank.

        One ``all_to_all_single`` over one flat buffer, whatever the number of
        ranks: the sends are concatenated, and the receive is split by
        ``recv_numels``, which every rank knows from the shapes it exchanges.

        Args:
          tensors: one 1-d dense tensor per rank of ``group`` (empty where
            nothing goes), all of one dtype and device; not modified.
          recv_numels: the number of elements each rank sends to this one.
          group: a group key (see the class docstring).

        Returns:
          One 1-d tensor per rank of ``group``: what that rank sent here.
        """
        pg = self.resolve(group)
        n = dist.get_world_size(pg)
        tensors = list(tensors)
        if len(tensors) != n or len(recv_numels) != n:
            raise ValueError(
                f"TorchComm.all_to_all: the group has {n} ranks; got {len(tensors)} tensors and "
                f"{len(recv_numels)} recv_numels"
            )
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                raise TypeError(f"TorchComm.all_to_all: tensors[{i}] must be a plain torch.Tensor")
            if t.dtype != tensors[0].dtype or t.device != tensors[0].device:
                raise ValueError("TorchComm.all_to_all: every tensor must share tensors[0]'s dtype and device")
        send = torch.cat([t.detach().reshape(-1) for t in tensors])
        # The functional collective takes each rank's own split sizes, so a simulated mesh (where the sizes
        # are per-rank ints, see gradtx.comm.per_rank) runs the same call as torchrun.
        world = cast(dist.ProcessGroup, dist.group.WORLD)
        recv = funcol.all_to_all_single(send, list(recv_numels), [t.numel() for t in tensors], pg or world)
        return list(torch.split(funcol.wait_tensor(recv), list(recv_numels)))

    def group_id(self, group: GroupKey) -> tuple:
        """What ``group`` is, as a hashable: its global ranks. Two keys (or two ``ProcessGroup`` objects, as two
        meshes over the same ranks give) with the same ranks share one collective in a plan."""
        pg = self.resolve(group)
        return ("ranks", tuple(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD)))

    def rank(self, group: GroupKey) -> int:
        """This process's rank within ``group``.

        On a simulated mesh (torch's ``LocalTensorMode``, see :func:`gradtx.testing.simulated_mesh`) this
        process is every rank at once, so the answer is one rank per simulated rank: a ``SymInt`` over
        torch's ``LocalIntNode``, as ``DeviceMesh.get_rank()`` gives there (a plain ``int`` where every
        simulated rank has the same one). It compares and computes per rank; code that needs a Python
        ``int`` from it (a list index) must run once per rank, e.g. through torch's
        ``maybe_run_for_local_tensor``.
        """
        pg = self.resolve(group)
        mode = _simulation()
        if mode is None:
            return dist.get_rank(pg)
        return _simulated_ranks(pg, mode)

    def __repr__(self) -> str:
        return f"TorchComm(mesh={self.mesh!r}, groups={sorted(self.groups)})"


class _Pending:
    """TorchComm's reductions in flight: ``wait()`` waits on each collective, then splits the flat buffers."""

    def __init__(self, works: list, flats: list[tuple[torch.Tensor, list[int]]], shapes: list[tuple[int, ...]]) -> None:
        self._works = works
        self._flats = flats
        self._shapes = shapes

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        out: list[torch.Tensor] = [None] * len(self._shapes)  # type: ignore[list-item]
        for flat, idx in self._flats:
            offset = 0
            for i in idx:
                n = math.prod(self._shapes[i])
                out[i] = flat[offset : offset + n].view(self._shapes[i])
                offset += n
        return out


def mesh_comm(meshes: Iterable[DeviceMesh]) -> TorchComm:
    """The :class:`TorchComm` over the dims of ``meshes`` and of their root meshes: the zero-configuration comm.

    This is the comm a plan inferred from DTensor placements reduces with: its
    groups are the process groups of each DTensor's own mesh. Every dim name
    that names one process group across all the meshes is a group key (so logs
    and :class:`~gradtx.testing.RecordingComm` read ``"dp"``, ``"tp"``); a name
    that two meshes use for different groups is left out, and those groups are
    keyed by their ``ProcessGroup``.

    Args:
      meshes: the device meshes of a tree's DTensors, in any order, repeats allowed.

    Returns:
      A :class:`TorchComm` with ``groups={dim_name: process_group}``.
    """
    groups: dict[str, dist.ProcessGroup] = {}
    ambiguous: set[str] = {"world"}
    seen: set[int] = set()
    for mesh in meshes:
        for m in (mesh, mesh._get_root_mesh()):
            if id(m) in seen:
                continue
            seen.add(id(m))
            for dim, name in enumerate(m.mesh_dim_names or ()):
                group = m.get_group(dim)
                if groups.get(name, group) is not group:
                    ambiguous.add(name)
                groups[name] = group
    return TorchComm(groups={n: g for n, g in groups.items() if n not in ambiguous})


def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of ``mesh``, in mesh order (row-major over its dims); no communication."""
    return tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())


def mesh_process_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """One process group over every rank of ``mesh`` (``None``: the default group), ranked by global rank.

    A mesh over the whole world uses the default group and a 1-d mesh its own
    group, so neither creates a group; any other mesh is flattened once
    (``DeviceMesh._flatten``, cached by the mesh), which every rank of the
    world must reach together, as the mesh's creation did.
    """
    ranks = mesh_ranks(mesh)
    if dist.is_initialized() and len(ranks) == dist.get_world_size():
        return None
    pg = mesh.get_group(0) if mesh.ndim == 1 else mesh._flatten().get_group()
    if tuple(dist.get_process_group_ranks(pg)) != tuple(sorted(ranks)):  # pragma: no cover - torch's own rule
        raise ValueError("TorchComm: a mesh's process group must rank its members by global rank")
    return pg


def world_size() -> int:
    """The number of processes in the default group, or 1 when ``torch.distributed`` is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _simulation() -> object | None:
    """The enabled ``LocalTensorMode`` (a simulated mesh), or ``None`` in a real run."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:  # pragma: no cover - a build without local tensors simulates nothing
        return None
    return enabled_local_tensor_mode()


def _simulated_ranks(pg: dist.ProcessGroup | None, mode: object) -> int:
    """Each simulated rank's rank in its own copy of ``pg`` (as torch's local collectives lay groups out), as one SymInt.

    Under ``LocalTensorMode`` a mesh dim's ``ProcessGroup`` is rank 0's; every other simulated rank's group is
    a translate of it (torch's ``_prepare_collective_groups``), which is how its collectives pair the ranks up.
    """
    from torch.distributed._local_tensor import _combine_int_rank_results
    from torch.distributed._local_tensor._c10d import _prepare_collective_groups

    group = pg if pg is not None else dist.group.WORLD
    assert group is not None  # initialised: a simulated mesh started the default group
    ranks, offsets, _ = _prepare_collective_groups(group)
    within = {offset + r: i for offset in offsets for i, r in enumerate(ranks)}
    return _combine_int_rank_results({r: within[r] for r in sorted(mode.ranks)})  # type: ignore[attr-defined,return-value]


def _per_simulated_rank(flat: torch.Tensor, mode: object) -> torch.Tensor:
    """``flat`` as one copy per simulated rank, when it is a plain tensor that every simulated rank shares.

    torch's local collectives reduce over a ``LocalTensor``'s per-rank values and leave a plain tensor as it
    is, so a SUM of a value every rank holds (a token count kept as a plain tensor) would come back as one
    rank's value instead of their total.
    """
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(flat, LocalTensor):
        return flat
    return mode.rank_map(lambda r: flat.clone())  # type: ignore[attr-defined]


def fingerprint_device() -> torch.device:
    """Where a small tensor for a collective over the default group lives when no tensor says: CUDA under NCCL, else CPU."""
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else ""
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DDPSumState:
    """The state of :func:`ddp_sum_hook`: the group, and which params' ``.grad`` hold an already-summed value.

    A summing all-reduce is not idempotent: a ``.grad`` that still holds last
    sync's sum ``S`` (replicated on every rank) would come back as ``W·S``.
    DDP's stock *mean* does not have this problem (``mean(S + g_r) = S + mean(g)``),
    so this state makes the sum behave the same way: a replicated ``S`` is
    divided by ``W`` before it is summed again, which restores ``S`` exactly
    (within an ulp for a ``W`` that is not a power of two). The division
    happens in the param's grad hook, before autograd adds new local grads
    (see :func:`gradtx.sum_grad_reduction`), or in this hook for a param no
    backward touched since the last sync.

    Args:
      process_group: DDP's process group (``None``: the default group).
    """

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.holds_sum: set[int] = set()  # id() of params whose .grad is a synced (replicated) sum

    def rescale(self, param: torch.Tensor) -> None:
        """Divide ``param.grad`` by the group size if it still holds a synced sum (a local op, no collective)."""
        if id(param) in self.holds_sum:
            self.holds_sum.discard(id(param))
            if param.grad is not None:
                param.grad.div_(self.world_size)


def ddp_sum_hook(state, bucket):  # unannotated: DDP compares hook annotations by identity
    """A DDP comm hook that *sums* each gradient bucket over the process group.

    DDP's stock hook divides by the group size; token-weighted accumulation
    needs the raw sum (see :func:`gradtx.sum_grad_reduction`). The all-reduce
    stays asynchronous, so DDP still overlaps it with the backward pass.

    ``state`` is a :class:`DDPSumState` (what :func:`gradtx.sum_grad_reduction`
    registers: correct whatever the sync pattern), or a ``ProcessGroup``/``None``
    for a bare sum, correct only when each window syncs exactly once.

    Example:
      >>> ddp_model.register_comm_hook(DDPSumState(None), ddp_sum_hook)
    """
    if isinstance(state, DDPSumState):
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        # A param no backward touched since the last sync still holds that sum in this bucket.
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            if id(param) in state.holds_sum:
                state.holds_sum.discard(id(param))
                grad.div_(state.world_size)
        params = [id(p) for p in bucket.parameters()]
    else:
        group = state if state is not None else dist.group.WORLD
        params = None
    future = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()

    def done(fut):
        if params is not None:
            state.holds_sum.update(params)
        return fut.value()[0]

    return future.then(done)


def backward_norm_hook(state, bucket):  # unannotated, as ddp_sum_hook
    """A DDP comm hook that reduces each bucket, then measures its part of the global norm: see :class:`BackwardNorm`.

    The reduction is DDP's mean over ``state.process_group`` (divided before
    the sum, as DDP's own hook does), or :func:`ddp_sum_hook`'s sum when
    ``state.sum_state`` is set. When a bucket's all-reduce completes, its
    reduced flat buffer (every grad of the bucket, replicated on every rank)
    is measured param by param in one pass (:func:`gradtx.core.norms.tensor_powsums`),
    while autograd goes on with the earlier layers. DDP waits for the
    returned future before the backward ends, so after ``loss.backward()``
    only adding one value per bucket remains for the clip. No collective is
    added: the grads are replicated.

    Example:
      >>> bn = gtx.BackwardNorm(2.0)
      >>> ddp_model.register_comm_hook(bn, backward_norm_hook)
    """
    from gradtx.comm.backward_norm import BackwardNorm

    if not isinstance(state, BackwardNorm):
        raise TypeError(f"backward_norm_hook: state must be a gradtx.BackwardNorm, got {type(state).__name__}")
    state.bucket_started(bucket.index(), bucket.is_last(), list(bucket.parameters()))
    if state.sum_state is not None:
        future = ddp_sum_hook(state.sum_state, bucket)
    else:
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(group))  # before the sum, as DDP's mean: no overflow in fp16
        future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()

    # Per-param views of the flat buffer, which both reductions above write in place: measured param by
    # param, every sum covers values of one scale (a sum over a flat bucket that mixes a layer's tiny grads
    # into a row of large ones drops them: 2e-5 low on GPT-2's MLP buckets).
    grads = list(bucket.gradients())

    def measure(fut):
        value = fut.value()
        reduced = value[0] if isinstance(value, list) else value
        state.bucket_done(grads, reduced.numel())
        return reduced

    return future.then(measure)
