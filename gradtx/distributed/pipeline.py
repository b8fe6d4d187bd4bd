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

from collections.abc import Sequence
from typing import Any

from gradtx.comm.base import ReduceOp
from gradtx.core import tree as tu
from gradtx.core.base import GradientTransformation, factory, init_empty_state
from gradtx.distributed.global_norm import zero_filled
from gradtx.distributed.plan import NO_PLAN, MeshGroups, check_plan, plan_read_by


def reduced_plan(tx: Any) -> MeshGroups | None:
    """The plan whose tied copies ``tx`` sums, when it is a :func:`pp_reduce`; else ``None``."""
    return getattr(tx, "__dict__", {}).get("pp_reduce_plan")


def check_chain(txs: Sequence[Any], *, name: str) -> None:
    """Refuse, when a chain is built, a norm that a pipeline chain computes over the wrong plan.

    ``txs`` are the chain's members, in order. A :func:`pp_reduce` member
    declares a pipeline plan: a member after it that computes a norm must use
    that plan (``mesh_groups=plan``); one with no plan would take one stage's
    norm for the model's. A member that computes a norm over a plan with tied
    weights needs a ``pp_reduce`` of that plan before it, which sums the tied
    copies' grads. Nested chains are checked as they are built.
    """
    declared = [(i, reduced_plan(tx)) for i, tx in enumerate(txs)]
    reduced: list[tuple[int, MeshGroups]] = [(i, plan) for i, plan in declared if plan is not None]
    for i, tx in enumerate(txs):
        plan = plan_read_by(tx)
        if plan is NO_PLAN:
            continue
        before = [p for j, p in reduced if j < i]
        if plan is None and before:
            raise ValueError(
                f"{name}: member {i} computes a norm with no plan, but member {reduced[0][0]} is a gradtx.pp_reduce "
                "of a pipeline plan: a stage's norm must add the other stages'. Pass the same plan: "
                "gtx.clip_by_global_norm(..., mesh_groups=plan) (see docs/distributed.md)"
            )
        if plan is None or not plan.tied or any(plan is p for p in before):
            continue
        where = "comes only after it" if any(plan is p for _, p in reduced) else "comes before it"
        raise ValueError(
            f"{name}: member {i} computes a norm over the tied weights ({', '.join(plan.leaf(i).path for idx in plan.tied.values() for i in idx)}) of a "
            f"mesh_groups plan, but no gradtx.pp_reduce(plan) {where}, so the tied copies' grads are not summed; "
            "put it first in the same chain: gtx.chain(gtx.pp_reduce(plan), gtx.clip_by_global_norm(..., "
            "mesh_groups=plan), ...) (see docs/distributed.md)"
        )


@factory
def pp_reduce(mesh_groups: MeshGroups) -> GradientTransformation:
    """Sum the grads of tied weights over the stages that hold a copy, so a chain is correct under pipelining.

    The tied leaves and their tie groups come from ``mesh_groups(..., tied=...)``.
    Each tie group costs one coalesced all-reduce per step (all its tied
    leaves together) among the ranks that hold a copy; a stage holding no
    tied weight issues nothing here, and still joins the norm's reduction
    over ``pp_group`` in :func:`gradtx.clip_by_global_norm`. Put it first in
    the chain, so clipping and the optimizer see the summed grads.

    With ``params``, a ``None`` grad is allowed, as in the clip: a tied
    copy with none joins the sum as zeros and takes the holders' sum.

    The copies must be sharded alike on every holder (same placements, same
    mesh shape), because their local shards are summed elementwise, and a
    stage holding several tied weights pairs them in flatten order.

    :func:`gradtx.chain` refuses, when it is built (see :func:`check_chain`),
    a chain where a transform computes a norm over a plan with tied weights
    and no ``pp_reduce(plan)`` comes before it, and a chain holding
    ``pp_reduce(plan)`` whose clip has no plan: either fails before its first
    step instead of letting the copies drift apart or clipping by one stage's norm.

    Args:
      mesh_groups: the plan from :func:`gradtx.mesh_groups` with ``pp_group``
        and ``tied`` set, built from this stage's params.

    Returns:
      A stateless :class:`GradientTransformation`, which carries its plan (as ``pp_reduce_plan``) for :func:`check_chain`.

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
    # One order of the tie groups on every rank (by what they are, not by this stage's flatten order), so
    # stages holding several never wait on each other in a cycle (0: emb~head, W; 1: W, V; 2: V, head).
    tied = sorted(mesh_groups.tied.items(), key=lambda item: repr(comm.group_id(item[0])))

    def update_fn(updates, state, params=None, **extra):
        leaves, spec = tu.tensor_leaves(updates, what="pp_reduce: updates")  # as every transform: float or complex
        out = list(leaves)
        if params is not None and len(leaves) != len(mesh_groups):
            # A param with no grad (None), as the clip allows: a tied one joins the sum as zeros and takes the
            # holders' sum, so every holder issues the same collective and the copies stay equal.
            index, leaves, _ = tu.align(params, updates, what="pp_reduce: updates", against="params")
            p_leaves, spec = tu.flatten(params)
            out, leaves = tu.scatter(len(p_leaves), index, leaves), zero_filled(index, leaves, p_leaves)
        mesh_groups.check(leaves, what="pp_reduce")
        for group, idx in tied:
            for i, s in zip(idx, tu.all_reduce_leaves(comm, [leaves[i] for i in idx], ReduceOp.SUM, group)):
                out[i] = s
        return tu.unflatten(spec, out), state

    tx = GradientTransformation(init_empty_state, update_fn)
    vars(tx)["pp_reduce_plan"] = mesh_groups
    return tx
