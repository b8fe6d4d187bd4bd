"""TorchComm: the :class:`~gradtx.comm.Comm` over ``torch.distributed`` process groups and ``DeviceMesh`` dims.

This is the only module in gradtx that issues ``torch.distributed``
collectives (a test scans the package for any other). Everything above it
names groups with keys and never touches a process group directly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from gradtx.comm.base import GroupKey, ReduceOp
from gradtx.comm.local_ranks import group_rank, shared_to_ranks

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
      groups: extra named groups, e.g. ``{"tied": embedding_and_head_group}``; a name whose
        group is ``dist.new_group``'s ``NON_GROUP_MEMBER`` (this rank is outside it) is left out.

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
        if groups is not None and not isinstance(groups, Mapping):
            raise TypeError(f"TorchComm: groups must be a dict {{name: ProcessGroup}}, got {type(groups).__name__}")
        groups = dict(groups or {})
        # new_group's answer on a rank outside the group (a middle stage, for a tie group of the first and
        # last): the same comm can be built on every rank, and this rank just has no such group.
        self.outside = {n for n, g in groups.items() if isinstance(g, int) and g == dist.GroupMember.NON_GROUP_MEMBER}
        groups = {n: g for n, g in groups.items() if n not in self.outside}
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
            if group in self.outside:
                raise ValueError(f"TorchComm: this rank is not in group {group!r} (new_group gave it NON_GROUP_MEMBER)")
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
        reduce_op = _OPS[ReduceOp(op)]
        pg = self.resolve(group)
        tensors = list(tensors)
        device = tensors[0].device if tensors else None
        by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                raise TypeError(
                    f"TorchComm.all_reduce: tensors[{i}] must be a plain torch.Tensor (a DTensor's local shard), "
                    f"got {type(t).__name__}"
                )
            if t.device != device:
                raise ValueError(f"TorchComm.all_reduce: tensors[{i}] is on {t.device}, tensors[0] on {device}")
            by_dtype[t.dtype].append(i)
        out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for idx in by_dtype.values():
            # One flat buffer per dtype: a single collective, and the inputs are never aliased.
            flat = shared_to_ranks(torch.cat([tensors[i].detach().reshape(-1) for i in idx]))
            dist.all_reduce(flat, op=reduce_op, group=pg)
            for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
                out[i] = piece.view(tensors[i].shape)
        return out

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
        # are per-rank ints, see gradtx.comm.local_ranks) runs the same call as torchrun.
        world = cast(dist.ProcessGroup, dist.group.WORLD)
        recv = funcol.all_to_all_single(send, list(recv_numels), [t.numel() for t in tensors], pg or world)
        return list(torch.split(funcol.wait_tensor(recv), list(recv_numels)))

    def group_id(self, group: GroupKey) -> tuple:
        """What ``group`` is, as a hashable: its global ranks. Two keys (or two ``ProcessGroup`` objects, as two
        meshes over the same ranks give) with the same ranks share one collective in a plan."""
        pg = self.resolve(group)
        return ("ranks", tuple(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD)))

    def rank(self, group: GroupKey) -> int:
        """This process's rank within ``group`` (on a simulated mesh, one per simulated rank: see
        :func:`gradtx.comm.local_ranks.group_rank`)."""
        return group_rank(self.resolve(group), dist.get_rank)

    def __repr__(self) -> str:
        return f"TorchComm(mesh={self.mesh!r}, groups={sorted(self.groups)})"


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
    unique = {id(m): m for mesh in meshes for m in (mesh, mesh._get_root_mesh())}
    for m in unique.values():
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
    if dist.is_initialized() and mesh.size() == dist.get_world_size():
        return None
    # new_group and split_group rank a group's members by global rank: torch's rule, not checked here.
    return mesh.get_group(0) if mesh.ndim == 1 else mesh._flatten().get_group()


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
    backward touched since the last sync. A ``.grad`` already there when the
    state first sees its param (it is made before the first backward) counts
    as a synced sum too: a mid-window checkpoint's, restored by
    ``TransformedOptimizer.load_state_dict``, which saves a window's ``.grad``
    only once it is synced.

    Args:
      process_group: DDP's process group (``None``: the default group).
    """

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.holds_sum: set[int] = set()  # id() of params whose .grad is a synced (replicated) sum
        self.seen: set[int] = set()  # id() of params rescaled at least once

    def rescale(self, param: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Divide ``grad`` (default ``param.grad``) by the group size if the param's grad still holds a synced sum (a
        local op, no collective)."""
        first = id(param) not in self.seen
        self.seen.add(id(param))
        if first or id(param) in self.holds_sum:
            self.holds_sum.discard(id(param))
            grad = param.grad if grad is None else grad
            if grad is not None:
                grad.div_(self.world_size)


def ddp_sum_hook(state, bucket):  # unannotated: DDP compares hook annotations by identity
    """A DDP comm hook that *sums* each gradient bucket over the process group.

    DDP's stock hook divides by the group size; token-weighted accumulation
    needs the raw sum (see :func:`gradtx.sum_grad_reduction`). The all-reduce
    stays asynchronous, so DDP still overlaps it with the backward pass.

    ``state`` is the :class:`DDPSumState` that :func:`gradtx.sum_grad_reduction`
    registers, which makes the sum correct whatever the sync pattern.

    Example:
      >>> ddp_model.register_comm_hook(DDPSumState(None), ddp_sum_hook)
    """
    # A param no backward touched since the last sync still holds that sum in this bucket.
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        state.rescale(param, grad)
    params = [id(p) for p in bucket.parameters()]
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)

    def done(fut):
        state.holds_sum.update(params)
        return fut.value()[0]

    return work.get_future().then(done)
