"""Pipeline parallelism: sum the grads of weights tied across stages.

Under pipeline parallelism a weight shared by two stages (the token embedding
on the first stage and the LM head on the last) lives as one copy per stage,
and each copy gets only its own stage's part of the gradient. The true
gradient is their sum. :func:`pp_reduce` adds the copies up, so every holder
applies the same update and the copies stay equal; the
:func:`gradtx.mesh_groups` plan it shares makes the global norm add the
stages' contributions and count the tied weight once.
"""

from __future__ import annotations

from gradtx.comm.base import ReduceOp
from gradtx.core import kinds
from gradtx.core import tree as tu
from gradtx.core.base import EmptyState, GradientTransformation, Params, factory
from gradtx.distributed.plan import MeshGroups, check_plan


@factory
def pp_reduce(mesh_groups: MeshGroups) -> GradientTransformation:
    """Sum the grads of tied weights over the stages that hold a copy, so a chain is correct under pipelining.

    The tied leaves and their tie groups come from ``mesh_groups(..., tied=...)``.
    Each tie group costs one coalesced all-reduce per step (all its tied
    leaves together) among the ranks that hold a copy; a stage holding no
    tied weight issues nothing here, and still joins the norm's reduction
    over ``pp_group`` in :func:`gradtx.clip_by_global_norm`. Put it first in
    the chain, so clipping and the optimizer see the summed grads.

    The copies must be sharded alike on every holder (same placements, same
    mesh shape), because their local shards are summed elementwise, and a
    stage holding several tied weights pairs them in flatten order.

    A transform that computes a norm over a plan with tied weights
    (``clip_by_global_norm``, ``adaptive_clip``, ... with ``mesh_groups=plan``)
    declares so, and :func:`gradtx.chain` refuses, when it is built, a chain
    where no ``pp_reduce(plan)`` comes before it: a chain that forgets it, or
    puts it after the clip, fails before its first step instead of letting the
    copies drift apart. A ``pp_reduce`` built and left out of the chain changes
    nothing.

    Args:
      mesh_groups: the plan from :func:`gradtx.mesh_groups` with ``pp_group``
        and ``tied`` set, built from this stage's params.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Press & Wolf, "Using the Output Embedding to Improve Language Models", 2017;
      Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism", 2019.

    Example:
      >>> # stage 0 holds "tok_emb.weight", stage 1 holds "head.weight": one weight, tied
      >>> tied = {"tok_emb.weight": "pp"} if stage == 0 else {"head.weight": "pp"}
      >>> plan = gtx.mesh_groups(stage_params, pp_group="pp", tied=tied)  # "pp": a dim of the DTensors' mesh
      >>> tx = gtx.chain(gtx.pp_reduce(plan), gtx.clip_by_global_norm(1.0, mesh_groups=plan), gtx.adamw(3e-4))
    """
    check_plan(mesh_groups, name="pp_reduce", required=True)
    comm = mesh_groups.comm

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params
        leaves, spec = tu.flatten(updates)
        mesh_groups.check(leaves, what="pp_reduce")
        inplace = bool(extra.get("inplace", False))
        out = list(leaves)
        for group, idx in mesh_groups.tied.items():
            summed = tu.all_reduce_leaves(comm, [leaves[i] for i in idx], ReduceOp.SUM, group, inplace=inplace)
            for i, s in zip(idx, summed):
                out[i] = s
        return tu.unflatten(spec, out), state

    tx = kinds.declare_fresh(GradientTransformation(init_fn, update_fn))
    return kinds.declare_ties(tx, reduces=(mesh_groups,))
