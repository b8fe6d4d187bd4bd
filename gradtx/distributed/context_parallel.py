"""Context parallelism: sum the grads of the ranks that split a sequence between them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

from gradtx.comm.base import Comm, ReduceOp, check_comm
from gradtx.core import tree as tu
from gradtx.core.base import GradientTransformation, factory, init_empty_state
from gradtx.distributed.global_norm import zero_filled
from gradtx.distributed.plan import DTensor, _is_shard


@factory
def cp_reduce(group: Any, *, comm: Comm | None = None) -> GradientTransformation:
    """Sum every grad over the context-parallel group, so each CP rank holds the grad of the whole sequence.

    Context-parallel ranks hold complementary token chunks of the same
    sequences, so each computes only its tokens' part of every grad; the
    true grad is their sum. When CP is folded into the FSDP2 mesh, FSDP2's
    reduce-scatter already sums it and this transform is not needed (it
    refuses a DTensor grad sharded over CP ranks, naming the path); when it
    is not (a separate ``cp`` mesh dim that FSDP2 does not shard over), put
    this first in the chain. The grads stay as they were sharded (DTensors
    keep their placements; their local shards are summed), and the norm
    downstream (``clip_by_global_norm(max_norm)``) is read from the
    placements as usual: after the sum the grads are replicated over ``cp``,
    which is never summed in the norm. A ``None`` grad (a param another CP rank's chunk reached, this one's
    did not) joins the sum as zeros of its param's shape: pass ``params`` to ``update``.

    One coalesced all-reduce (SUM) per step for all the grads (one per dtype
    under :class:`~gradtx.comm.TorchComm`); no host sync.

    Args:
      group: the CP group: a 1-D ``DeviceMesh`` (``mesh["cp"]``), a
        ``ProcessGroup``, or a group key that ``comm`` resolves (``"cp"``).
      comm: the :class:`~gradtx.comm.Comm` that resolves ``group``; default:
        built from the mesh or process group.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      xorl, ``sync_sp_gradients`` ("Gradient Accumulation & Token Normalization"), 2025;
      Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context", 2023.

    Example:
      >>> mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
      >>> fully_shard(model, mesh=mesh["dp"])   # CP not folded into FSDP2
      >>> tx = gtx.chain(gtx.cp_reduce(mesh["cp"]), gtx.clip_by_global_norm(1.0), gtx.adamw(3e-4))
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from gradtx.comm.torch_dist import TorchComm

    if isinstance(group, DeviceMesh) and group.ndim != 1:
        raise ValueError(f"cp_reduce: group must be a 1-D DeviceMesh (e.g. mesh['cp']), got {group.ndim} dims")
    if comm is not None:
        if isinstance(group, DeviceMesh):
            raise ValueError("cp_reduce: pass either a DeviceMesh as group, or a group key with comm, not both")
        check_comm(comm, name="cp_reduce")
    elif isinstance(group, (DeviceMesh, dist.ProcessGroup)):
        comm = TorchComm()  # it resolves a 1-D mesh to its own process group
    else:
        raise ValueError(
            f"cp_reduce: group {group!r} needs a comm that names it: pass the mesh dim itself "
            "(cp_reduce(mesh['cp'])), a ProcessGroup, or comm=gtx.comm.TorchComm(mesh)"
        )

    # A grad sharded over a mesh dim that holds several CP ranks is no chunk's partial grad: CP is folded
    # into its sharding, which summed it already, and a sum of different shards is garbage.
    sharded = sharded_over(comm, group)

    def update_fn(updates, state, params=None, **extra):
        leaves, spec = tu.tensor_leaves(updates, what="cp_reduce: updates")
        if len(leaves) < len(optree.tree_leaves(updates, none_is_leaf=True)):  # another CP rank may hold the grad
            if params is None:
                raise ValueError("cp_reduce: a None update (a param with no grad) needs update(..., params)")
            index, given, _ = tu.align(params, updates, what="cp_reduce: updates", against="params")
            p_leaves, spec = tu.flatten(params)
            leaves = zero_filled(index, given, p_leaves)
        for i, g in enumerate(leaves):
            if (where := sharded(g)) is not None:
                raise ValueError(
                    f"cp_reduce: the grad at {tu.path_str(spec.paths()[i])} is sharded {where}, which holds CP ranks: "
                    "CP is folded into its sharding, which already summed it; drop cp_reduce (see docs/distributed.md)"
                )
        return tu.unflatten(spec, tu.all_reduce_leaves(comm, leaves, ReduceOp.SUM, group)), state

    tx = GradientTransformation(init_empty_state, update_fn)
    vars(tx)["sums_over_ranks"] = (comm, group)
    return tx


def sharded_over(comm: Any, group: Any) -> Callable[[Any], str | None]:
    """For a grad: where a DTensor is sharded over several ranks of ``group`` (they hold different shards, whose
    sum over ``group`` is no grad), else None. Read once per mesh and placements; ranks are known by a TorchComm.
    """
    import torch.distributed as dist

    from gradtx.comm.torch_dist import TorchComm

    seen: dict[Any, str | None] = {}

    def where(g: Any) -> str | None:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) and isinstance(comm, TorchComm) else None
        if key is not None and key not in seen:
            ranks = set(dist.get_process_group_ranks(comm.resolve(group) or dist.group.WORLD))
            over = [set(dist.get_process_group_ranks(g.device_mesh.get_group(d))) for d in range(g.device_mesh.ndim)]
            dims = [d for d, p in enumerate(g.placements) if _is_shard(p) and len(ranks & over[d]) > 1]
            seen[key] = f"({g.placements}) over mesh dim {dims[0]} of {g.device_mesh}" if dims else None
        return seen.get(key)

    return where


def sums_over(tx: GradientTransformation) -> tuple[Any, Any] | None:
    """The ``(comm, group)`` a :func:`cp_reduce` sums the grads over; None for any other transform.

    A param with no grad on this rank may have one on another (the wrapper joins it on every rank), and a window
    before it holds each rank's own sums, which a checkpoint sums over the group.
    """
    return vars(tx).get("sums_over_ranks")
