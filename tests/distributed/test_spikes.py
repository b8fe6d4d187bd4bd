"""Spike guards and adaptive clipping on a TP x FSDP2 model (4 gloo ranks), against one device.

ToyNet's blocks are tensor-parallel (colwise, rowwise) on a 2-rank "tp" mesh dim and
FSDP2-sharded on a 2-rank "dp" dim; the head is FSDP2 only. Over several steps (one of them a
100x spike), every rank runs zclip, autoclip, skip_spikes and skip_large_updates with a
mesh_groups plan, and clip_by_block_rms and track_norms on the DTensor grads; then all of them
again with no plan passed, where the placements define it. Every rank must
make the same decisions, and the statistics and outputs must equal a single-device run on the
unsharded model with the full batch.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch

from tests.distributed import models
from tests.distributed.harness import part_results, share_spawn

STEPS, SPIKE_STEP, SPIKE = 10, 7, 100.0


def _dp_slice(x: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    n = x.shape[0] // dp_size
    return x[dp_rank * n : (dp_rank + 1) * n]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _transforms(plan: Any) -> dict[str, Any]:
    import gradtx as gtx

    return {
        "zclip": gtx.zclip(warmup_steps=4, max_grad_norm=None, mesh_groups=plan),
        "autoclip": gtx.autoclip(40, history=6, mesh_groups=plan),
        "skip_spikes": gtx.skip_spikes(gtx.identity(), z_thresh=3.0, warmup_steps=4, mesh_groups=plan),
        "skip_large": gtx.skip_if(
            gtx.identity(), functools.partial(gtx.skip_large_updates, max_squared_norm=1.0, mesh_groups=plan)
        ),
        "block_rms": gtx.clip_by_block_rms(0.01, mesh_groups=plan),
        "track": gtx.track_norms(mesh_groups=plan),
    }


def _record(name: str, state: Any, out: Any) -> dict[str, Any]:
    if name in ("zclip", "autoclip"):
        return {"norm": state.grad_norm.clone(), "coef": state.clip_coef.clone()}
    if name == "skip_spikes":
        return {"skipped": bool(state.skipped), "mean": state.mean.clone(), "var": state.var.clone()}
    if name == "skip_large":
        return {"skipped": bool(state.skipped), "norm_sq": state.skip_state["norm_squared"].clone()}
    if name == "block_rms":
        return {"out": {n: _full(g) for n, g in out.items()}}
    return {"norms": {n: v.clone() for n, v in state.norms.items()}}


def _run(model: torch.nn.Module, grads_of, plan: Any) -> dict[str, list[dict[str, Any]]]:
    txs = _transforms(plan)
    params = dict(model.named_parameters())
    states = {name: tx.init(params) for name, tx in txs.items()}
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in txs}
    for step in range(STEPS):
        grads = grads_of(step)
        for name, tx in txs.items():
            updates, states[name] = tx.update(grads, states[name], params)
            out[name].append(_record(name, states[name], updates))
    return out


def _body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    del world_size
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = models.toy_net(seed=0)
    ref = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], models.tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh.get_local_rank("dp")

    def sharded_grads(step: int) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x, y = models.batch(seed=100 + step)
        loss = models.mse(model, _dp_slice(x, dp_rank, 2), _dp_slice(y, dp_rank, 2))
        (loss * (SPIKE if step == SPIKE_STEP else 1.0)).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    def reference_grads(step: int) -> dict[str, torch.Tensor]:
        ref.zero_grad(set_to_none=True)
        x, y = models.batch(seed=100 + step)
        (models.mse(ref, x, y) * (SPIKE if step == SPIKE_STEP else 1.0)).backward()
        return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}

    plan = gtx.mesh_groups(dict(model.named_parameters()), comm=TorchComm(mesh))
    return {
        "sharded": _run(model, sharded_grads, plan),
        "inferred": _run(model, sharded_grads, None),  # no plan passed: the placements define it
        "single": _run(ref, reference_grads, None),
    }


_SHARED = share_spawn({"body": functools.partial(_body, world_size=4)}, 4, prefix="spikes")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return part_results(_SHARED(), "body")


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("how", ["sharded", "inferred"])
@pytest.mark.parametrize("name", ["zclip", "autoclip", "skip_spikes", "skip_large", "block_rms", "track"])
def test_every_rank_decides_alike_and_matches_one_device(ranks, name, how):
    single = ranks[0]["single"][name]
    for rank, res in enumerate(ranks):
        for step, (got, want) in enumerate(zip(res[how][name], single)):
            where = f"rank {rank}, {how}, {name}, step {step}"
            for key, value in want.items():
                if isinstance(value, bool):
                    assert got[key] == value, where  # the decision itself: identical everywhere
                    assert got[key] == ranks[0][how][name][step][key], where
                elif isinstance(value, dict):
                    for leaf, v in value.items():
                        _close(got[key][leaf], v, f"{where}, {key}[{leaf}]")
                else:
                    _close(got[key], value, f"{where}, {key}")


def test_the_spike_is_acted_on(ranks):
    res = ranks[0]["sharded"]
    assert res["skip_spikes"][SPIKE_STEP]["skipped"]
    assert sum(r["skipped"] for r in res["skip_spikes"]) == 1
    assert float(res["zclip"][SPIKE_STEP]["coef"]) < 0.1
    assert float(res["autoclip"][SPIKE_STEP]["coef"]) < 0.1
    norm = float(res["zclip"][SPIKE_STEP]["norm"])
    assert math.isfinite(norm) and norm > 10 * float(res["zclip"][SPIKE_STEP - 1]["norm"])
