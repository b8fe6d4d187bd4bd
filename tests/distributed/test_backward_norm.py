"""The norm measured in DDP's backward (gtx.norm_in_backward) clips exactly as torch's clip_grad_norm_ does.

Two gloo ranks, one spawn. A small MLP under DDP with tiny buckets (several
per backward), its grads reduced by DDP's mean or by gradtx's sum; the
reference is a second DDP copy without the hook, clipped by
``torch.nn.utils.clip_grad_norm_``. p = 2 and inf, the functional clip and
the wrapper; and the cases where the clip must not use the measured value
(no sync since the last step, a transform before the clip) fall back to
computing the norm, with the same result.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch

from tests.distributed.harness import part_results, share_spawn

WORLD = 2
MAX_NORM = 0.05  # below every norm here, so the clip scales


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    # 1.1 MB of params: past DDP's 1 MB first bucket, so a backward has several buckets
    return torch.nn.Sequential(
        torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 4)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y, reduction="sum").backward()


def _pair(sum_reduction: bool, norm_type: float) -> tuple[Any, Any, Any]:
    """A DDP model measured in the backward, and a reference DDP copy reduced the same way without the hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradtx as gtx

    base = _mlp()
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    bn = gtx.norm_in_backward(model, norm_type, sum_reduction=sum_reduction)
    if sum_reduction:
        gtx.sum_grad_reduction(ref)
    return model, ref, bn


def _functional(rank: int, sum_reduction: bool, norm_type: float) -> dict[str, Any]:
    import gradtx as gtx

    model, ref, bn = _pair(sum_reduction, norm_type)
    params = dict(model.module.named_parameters())
    tx = gtx.clip_by_global_norm(MAX_NORM, norm_type=norm_type, precomputed=bn)
    state = tx.init(params)
    out: dict[str, Any] = {"norms": [], "ref_norms": [], "updates": [], "ref_updates": []}
    for step in range(2):
        _backward(model, rank, step)
        _backward(ref, rank, step)
        grads = {n: p.grad for n, p in params.items()}
        updates, state = tx.update(grads, state, params)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)
        out["norms"].append(state.grad_norm.clone())
        out["ref_norms"].append(ref_norm.clone())
        out["updates"].append({n: u.detach().clone() for n, u in updates.items()})
        out["ref_updates"].append({n: p.grad.clone() for n, p in ref.module.named_parameters()})
        for m in (model, ref):
            m.zero_grad(set_to_none=False)  # keep the .grad tensors: the hook's value is matched to them
    out["used_after_steps"] = bn.used
    # No backward since the last step: the value was consumed, so the clip computes the norm itself.
    _backward(model, rank, 5)
    grads = {n: p.grad for n, p in params.items()}
    _, state = tx.update(grads, state, params)
    _, state2 = tx.update(grads, state, params)
    out["stale"] = (state.grad_norm.clone(), state2.grad_norm.clone(), bn.used, bn.fallbacks)
    # A transform before the clip makes new tensors: not the grads the hook measured.
    _backward(model, rank, 6)
    scaled = gtx.chain(gtx.scale(2.0), tx)
    s = scaled.init(params)
    _, s = scaled.update({n: p.grad for n, p in params.items()}, s, params)
    direct = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(2.0 * p.grad, norm_type) for p in params.values()]), norm_type
    )
    out["chained"] = (s[1].grad_norm.clone(), direct, bn.fallbacks)
    out["generation"] = bn.generation
    out["buckets"] = bn.buckets
    return out


def _wrapper(rank: int, sum_reduction: bool, norm_type: float) -> dict[str, Any]:
    import gradtx as gtx

    model, ref, bn = _pair(sum_reduction, norm_type)
    tx = gtx.clip_by_global_norm(MAX_NORM, norm_type=norm_type, precomputed=bn)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), tx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        _backward(model, rank, step)
        opt.step()
        opt.zero_grad()
        _backward(ref, rank, step)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)
        ref_opt.step()
        ref_opt.zero_grad()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "ref_params": [p.detach().clone() for p in ref.parameters()],
        "used": bn.used,
        "fallbacks": bn.fallbacks,
    }


def _fsdp2(rank: int, norm_type: float) -> dict[str, Any]:
    """FSDP2: each sharded grad measured by its post-accumulate-grad hook; the plan's reduction at the clip."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradtx as gtx

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    model = _mlp()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    bn = gtx.norm_in_backward(model, norm_type)
    params = dict(model.named_parameters())
    tx = gtx.clip_by_global_norm(MAX_NORM, norm_type=norm_type, precomputed=bn)
    plain = gtx.clip_by_global_norm(MAX_NORM, norm_type=norm_type)
    state, plain_state = tx.init(params), plain.init(params)
    out: dict[str, Any] = {"norms": [], "ref_norms": [], "plain_norms": []}
    for step in range(2):
        _backward(model, rank, step)
        grads = {n: p.grad for n, p in params.items()}
        _, state = tx.update(grads, state, params)
        _, plain_state = plain.update(grads, plain_state, params)
        full = [g.full_tensor() for g in grads.values()]  # the unsharded grads, on every rank
        out["norms"].append(state.grad_norm.clone())
        out["plain_norms"].append(plain_state.grad_norm.clone())
        out["ref_norms"].append(torch.nn.utils.get_total_norm(full, norm_type))
        model.zero_grad()
    out["used"], out["early"] = bn.used, bn.early
    _, state = tx.update({n: p.grad for n, p in params.items()}, state, params)  # no backward since: computed
    out["stale"] = (bn.used, bn.fallbacks)
    return out


CASES = [(s, p) for s in (False, True) for p in (2.0, math.inf)]


def _body(rank: int, world_size: int) -> dict[str, Any]:
    del world_size
    out: dict[Any, Any] = {
        case: {"functional": _functional(rank, *case), "wrapper": _wrapper(rank, *case)} for case in CASES
    }
    out["fsdp2"] = {p: _fsdp2(rank, p) for p in (2.0, math.inf)}
    return out


_SHARED = share_spawn({"body": functools.partial(_body, world_size=WORLD)}, WORLD, prefix="backward_norm")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return part_results(_SHARED(), "body")


def _ids(case: tuple[bool, float]) -> str:
    return f"{'sum' if case[0] else 'mean'}-p{case[1]:g}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_functional_clip_matches_clip_grad_norm(ranks: list[dict[str, Any]], case: tuple[bool, float]) -> None:
    for out in ranks:
        got = out[case]["functional"]
        assert got["used_after_steps"] == 2  # both steps took the value measured in the backward
        for norm, ref_norm in zip(got["norms"], got["ref_norms"]):
            torch.testing.assert_close(norm, ref_norm, rtol=2e-6, atol=0)
            assert norm > MAX_NORM
        for upd, ref_upd in zip(got["updates"], got["ref_updates"]):
            for name in upd:
                torch.testing.assert_close(upd[name], ref_upd[name], rtol=2e-6, atol=1e-9)
    # Replicated grads: every rank measured the same norm.
    torch.testing.assert_close(ranks[0][case]["functional"]["norms"], ranks[1][case]["functional"]["norms"])


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_a_stale_or_foreign_value_is_not_used(ranks: list[dict[str, Any]], case: tuple[bool, float]) -> None:
    for out in ranks:
        got = out[case]["functional"]
        first, again, used, fallbacks = got["stale"]
        assert used == 3 and fallbacks == 1  # the new sync was used once, then computed
        torch.testing.assert_close(first, again, rtol=1e-6, atol=0)
        chained, direct, fallbacks = got["chained"]
        assert fallbacks == 2
        torch.testing.assert_close(chained, direct.to(chained.dtype), rtol=2e-6, atol=0)
        assert got["generation"] == 4
        assert got["buckets"] >= 2  # the parts of several buckets, completing on gloo's threads, were added


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_wrapper_steps_match_clip_grad_norm_and_sgd(ranks: list[dict[str, Any]], case: tuple[bool, float]) -> None:
    for out in ranks:
        got = out[case]["wrapper"]
        assert (got["used"], got["fallbacks"]) == (3, 0)
        for p, ref in zip(got["params"], got["ref_params"]):
            torch.testing.assert_close(p, ref, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["p2", "pinf"])
def test_fsdp2_sharded_grads_measured_in_the_backward(ranks: list[dict[str, Any]], norm_type: float) -> None:
    for out in ranks:
        got = out["fsdp2"][norm_type]
        assert got["used"] == 2  # both steps took the per-param parts measured after the reduce-scatter
        assert got["early"] == 0  # one mesh dim: the plan's reduction is over dp, at the step
        for norm, ref, plain in zip(got["norms"], got["ref_norms"], got["plain_norms"]):
            torch.testing.assert_close(norm, ref, rtol=2e-6, atol=0)
            torch.testing.assert_close(norm, plain, rtol=1e-6, atol=0)
        assert got["stale"] == (2, 1)


def test_the_clip_refuses_a_mismatched_norm_type() -> None:
    import gradtx as gtx

    bn = gtx.BackwardNorm(2.0)
    with pytest.raises(ValueError, match="norm_type"):
        gtx.clip_by_global_norm(1.0, norm_type=math.inf, precomputed=bn)
    with pytest.raises(TypeError, match="precomputed"):
        gtx.clip_by_global_norm(1.0, precomputed=2.0)  # type: ignore[arg-type]


def test_one_process_without_a_backward_falls_back() -> None:
    import pickle

    import gradtx as gtx

    bn = gtx.BackwardNorm(2.0)
    tx = gtx.clip_by_global_norm(1.0, precomputed=bn)
    grads = {"w": torch.tensor([3.0, 4.0])}
    updates, state = tx.update(grads, tx.init(grads))
    assert state.grad_norm.item() == pytest.approx(5.0) and bn.fallbacks == 1
    torch.testing.assert_close(updates["w"], torch.tensor([3.0, 4.0]) / (5.0 + 1e-6))
    restored = pickle.loads(pickle.dumps(tx))  # the settings travel; a measured value never does
    _, state = restored.update(grads, restored.init(grads))
    assert state.grad_norm.item() == pytest.approx(5.0)
