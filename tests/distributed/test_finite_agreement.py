"""apply_if_finite's global agreement on 2 gloo ranks: a NaN on one rank makes every rank skip.

A NaN that only one rank sees is the normal case once grads are sharded: after
FSDP2's reduce-scatter, a bad element lands in exactly one rank's shard. Each
part injects a NaN on rank 1 only and checks that every rank skips, that the
params (and optimizer state) stay bitwise unchanged and equal across ranks,
and that the next finite step goes ahead everywhere. Each part also runs the
same thing without a comm, where rank 0 steps and rank 1 does not: that proves
the NaN really was rank-local, so the agreement is what kept the ranks together.

All parts run in one spawn of 2 processes; each part reports its own error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.harness import part_results, share_spawn

WORLD, VOCAB, DIM = 2, 11, 6
NAN_RANK = 1


def lm(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5), generator=g)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each rank's own piece of every param (a DTensor's local shard), bitwise."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def _functional(rank: int) -> dict[str, Any]:
    """Rank-local grads (e.g. after a rank-local transform): identical except for rank 1's NaN."""
    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm
    from gradtx.testing import RecordingComm

    params = {"w": torch.arange(4.0), "b": torch.ones(2)}
    grads = {"w": torch.full((4,), 0.5), "b": torch.full((2,), -1.0)}
    if rank == NAN_RANK:
        grads["w"] = grads["w"].clone()
        grads["w"][2] = float("nan")
    out: dict[str, Any] = {}
    for name, comm in (("agreed", RecordingComm(TorchComm())), ("local", None)):
        tx = gtx.apply_if_finite(gtx.sgd(0.1, momentum=0.9), 3, comm=comm, group="world")
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        out[name] = {
            "params": gtx.apply_updates(params, updates),
            "skipped": bool(state.skipped),
            "notfinite_count": int(state.notfinite_count),
            "calls": None if comm is None else [(c.op, c.group, c.shapes) for c in comm.calls],
        }
    out["start"] = params
    return out


def _wrapper_steps(
    rank: int, model: nn.Module, opt: Any, inject: Callable[[nn.Module], None], k: int = 1
) -> dict[str, Any]:
    """Step 0 finite, step 1 with a NaN injected on rank 1 after backward, step 2 finite again."""
    steps = []
    for step in range(3):
        before = _snapshot(model)
        for micro in range(k):
            x, y = batch(rank, 3 * step + micro)
            with opt.maybe_no_sync(model):
                loss_fn(model(x), y).backward()
            if step == 1 and micro == k - 1 and rank == NAN_RANK:
                inject(model)
            opt.step()
            stepped = opt.emitted
            opt.zero_grad()
        after = _snapshot(model)
        steps.append(
            {
                "stepped": stepped,
                "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                "opt_steps": sorted({float(s["step"]) for s in opt.optimizer.state.values()}),
            }
        )
    return {"steps": steps}


def _fsdp2(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))

    def inject(model: nn.Module) -> None:
        # One element of this rank's shard only: exactly what a reduce-scatter leaves behind.
        model[2].weight.grad.to_local()[0, 0] = float("nan")

    out: dict[str, Any] = {}
    # "zero_config": no comm at all, the DTensors' mesh is the agreement group; "local": a LocalComm
    # opts out of agreement, the control that shows the NaN really is rank-local.
    for name, comm in (("agreed", TorchComm(mesh)), ("zero_config", None), ("local", gtx.comm.LocalComm())):
        model = lm()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = gtx.TransformedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05),
            gtx.apply_if_finite(gtx.identity(), 3, comm=comm, group="dp"),
        )
        out[name] = _wrapper_steps(rank, model, opt, inject)
        out[name]["full"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return out


def _ddp_fused(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    def inject(model: nn.Module) -> None:
        # After DDP's sync, so only this rank's (replicated) copy of the grad is bad.
        model.module[0].weight.grad[3, 1] = float("inf")

    out: dict[str, Any] = {}
    for name, comm in (("agreed", TorchComm()), ("local", None)):
        model = DDP(lm())
        tx = gtx.chain(gtx.accumulate(2), gtx.apply_if_finite(gtx.clip_by_global_norm(1.0), 3, comm=comm))
        opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05, fused=True), tx)
        out[name] = _wrapper_steps(rank, model, opt, inject, k=2)
        out[name]["params"] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return out


PARTS: dict[str, Callable[[int], Any]] = {"functional": _functional, "fsdp2": _fsdp2, "ddp_fused": _ddp_fused}


_SHARED = share_spawn(PARTS, WORLD, prefix="finite_agreement")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return _SHARED()


def _assert_equal_trees(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_functional_nan_on_one_rank_makes_every_rank_skip(ranks: list[dict[str, Any]]) -> None:
    results = part_results(ranks, "functional")
    for res in results:
        agreed = res["agreed"]
        assert agreed["skipped"] and agreed["notfinite_count"] == 1
        _assert_equal_trees(agreed["params"], res["start"])
        assert agreed["calls"] == [("max", "world", ((),))]  # one scalar collective per step
    _assert_equal_trees(results[0]["agreed"]["params"], results[1]["agreed"]["params"])
    # Without agreement the ranks part ways: the NaN was local to rank 1.
    assert not results[0]["local"]["skipped"] and results[1]["local"]["skipped"]
    assert not torch.equal(results[0]["local"]["params"]["w"], results[1]["local"]["params"]["w"])


@pytest.mark.parametrize("part", ["fsdp2", "ddp_fused"])
def test_wrapper_nan_on_one_rank_makes_every_rank_skip(ranks: list[dict[str, Any]], part: str) -> None:
    results = part_results(ranks, part)
    variants = ["agreed", "zero_config"] if part == "fsdp2" else ["agreed"]
    for res in results:
        for variant in variants:
            first, bad, after = res[variant]["steps"]
            assert first["stepped"] and not first["unchanged"] and first["opt_steps"] == [1.0]
            # Every rank skipped: params bitwise unchanged, and the optimizer's step count did not move.
            assert bad["unchanged"] and bad["opt_steps"] == [1.0]
            assert after["stepped"] and not after["unchanged"] and after["opt_steps"] == [2.0]
    # The skipped step still closed its window (opt.emitted); the skip itself is in metrics["skipped"].
    assert all(r[v]["steps"][1]["stepped"] for r in results for v in variants)
    if part == "ddp_fused":
        _assert_equal_trees(results[0]["agreed"]["params"], results[1]["agreed"]["params"])
    else:
        for variant in variants:
            _assert_equal_trees(results[0][variant]["full"], results[1][variant]["full"])
    # The control that opts out (no comm on plain DDP grads, LocalComm on FSDP2): rank 0 stepped, rank 1 skipped.
    assert not results[0]["local"]["steps"][1]["unchanged"]
    assert results[1]["local"]["steps"][1]["unchanged"]
