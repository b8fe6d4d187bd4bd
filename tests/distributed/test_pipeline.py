"""pp_reduce and the pipeline-aware norm on a real 2-stage torch.distributed.pipelining run, against one device.

The model is a tiny LM whose LM head is tied to its token embedding: stage 0
holds the embedding, stage 1 the head, each as its own copy. The reference is
the same LM on one device, where the two are one ``Parameter``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import gradtx as gtx
from gradtx.comm import TorchComm
from gradtx.distributed.pipeline import pp_reduce
from gradtx.distributed.plan import mesh_groups
from gradtx.testing import RecordingComm
from tests.distributed import models
from tests.distributed.harness import part_results, share_spawn

NORM_TYPES = (2.0, math.inf)
MAX_NORM = 0.05
LR = 0.5


def _ref_name(stage: int, name: str) -> str:
    # The reference's tied weight appears once, under the embedding's name.
    return "stage0.emb.weight" if (stage, name) == (1, "head.weight") else f"stage{stage}.{name}"


def _body(rank: int, world: int) -> bytes:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    comm = TorchComm(mesh)
    ref = models.TiedLM(seed=0)
    module = models.tied_lm_stages(seed=0)[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=models.lm_loss)
    ids, targets = models.lm_batch(seed=1)
    if rank == 0:
        schedule.step(ids)
    else:
        schedule.step(target=targets)
    ref_grads = models.reference_grads(ref, models.lm_loss(ref(ids), targets))

    tied = {"emb.weight": "pp"} if rank == 0 else {"head.weight": "pp"}
    params = dict(module.named_parameters())
    out: dict = {"rank": rank}
    for norm_type in NORM_TYPES:
        rec = RecordingComm(comm)
        plan = mesh_groups(params, comm=rec, pp_group="pp", tied=tied)
        tx = gtx.chain(pp_reduce(plan), gtx.clip_by_global_norm(MAX_NORM, norm_type=norm_type, mesh_groups=plan))
        grads = {n: p.grad.clone() for n, p in params.items()}
        clipped, state = tx.update(grads, tx.init(params), params)
        ref_norm, ref_clipped = models.reference_clip(ref_grads, MAX_NORM, norm_type)
        out[norm_type] = {
            "norm": gtx.metrics(state)["grad_norm"],
            "ref_norm": ref_norm,
            "clipped": clipped,
            "ref_clipped": {n: ref_clipped[_ref_name(rank, n)] for n in clipped},
            "calls": [(c.op, c.group, c.num_tensors) for c in rec.calls],
            "grads_untouched": all(torch.equal(grads[n], p.grad) for n, p in params.items()),
        }

    # A rank with no grads at all still joins the PP reduction, and gets the same norm.
    x = torch.tensor([3.0, -4.0])
    empty = {} if rank == 1 else {"x": x}
    out["empty"] = [
        gtx.global_norm(list(empty.values()), p, mesh_groups=mesh_groups(empty, comm=comm, pp_group="pp"))
        for p in NORM_TYPES
    ]

    # The same chain through TransformedOptimizer (in-place path, tree of param groups, tie by identity).
    tie = module.emb.weight if rank == 0 else module.head.weight
    plan = mesh_groups([list(module.parameters())], comm=comm, pp_group="pp", tied={lambda path, p: p is tie: "pp"})
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(module.parameters(), lr=LR),
        gtx.chain(pp_reduce(plan), gtx.clip_by_global_norm(MAX_NORM, mesh_groups=plan)),
    )
    opt.step()
    _, ref_clipped = models.reference_clip(ref_grads, MAX_NORM, 2.0)
    ref_params = dict(ref.named_parameters())
    out["stepped"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["ref_stepped"] = {
        n: (ref_params[_ref_name(rank, n)] - LR * ref_clipped[_ref_name(rank, n)]).detach() for n in out["stepped"]
    }
    out["tied_after_step"] = tie.detach().clone()

    # A tied plan used without pp_reduce, and no plan at all on plain stage tensors.
    plan = mesh_groups(params, comm=comm, pp_group="pp", tied=tied)
    try:
        tx = gtx.chain(gtx.clip_by_global_norm(MAX_NORM, mesh_groups=plan))  # refused when built
        tx.update(grads, tx.init(params))
        out["no_pp_reduce_error"] = None
    except ValueError as err:
        out["no_pp_reduce_error"] = str(err)

    # Several AdamW steps under GPipe and 1F1B, functional and wrapped, against torch on one device.
    for name, schedule_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        for path in ("functional", "wrapped"):
            out[(name, path)] = _train(rank, world, comm, schedule_cls, path)
    return models.pack(out)


ADAM_LR, STEPS = 0.05, 3


def _train(rank: int, world: int, comm: TorchComm, schedule_cls, path: str) -> dict:
    ref = models.TiedLM(seed=0)
    module = models.tied_lm_stages(seed=0)[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=comm.resolve("pp"))
    schedule = schedule_cls(stage, n_microbatches=2, loss_fn=models.lm_loss)
    tied = {"emb.weight": "pp"} if rank == 0 else {"head.weight": "pp"}
    plan = mesh_groups(dict(module.named_parameters()), comm=comm, pp_group="pp", tied=tied)
    if path == "wrapped":
        wrapped_plan = mesh_groups(
            [list(module.parameters())],
            comm=comm,
            pp_group="pp",
            tied={lambda p_, t: t is (module.emb.weight if rank == 0 else module.head.weight): "pp"},
        )
        opt = gtx.TransformedOptimizer(
            torch.optim.AdamW(module.parameters(), lr=ADAM_LR),
            gtx.chain(pp_reduce(wrapped_plan), gtx.clip_by_global_norm(MAX_NORM, mesh_groups=wrapped_plan)),
        )
    else:
        tx = gtx.chain(pp_reduce(plan), gtx.clip_by_global_norm(MAX_NORM, mesh_groups=plan), gtx.adamw(ADAM_LR))
        state = tx.init({n: p.detach() for n, p in module.named_parameters()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=ADAM_LR)
    norms, ref_norms = [], []
    for step in range(STEPS):
        ids, targets = models.lm_batch(seed=20 + step)
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=targets)
        if path == "wrapped":
            opt.step()
            norms.append(opt.metrics["grad_norm"].clone())
            opt.zero_grad()
        else:
            cur = {n: p.detach() for n, p in module.named_parameters()}
            updates, state = tx.update({n: p.grad for n, p in module.named_parameters()}, state, cur)
            norms.append(gtx.metrics(state)["grad_norm"].clone())
            with torch.no_grad():
                for n, p in module.named_parameters():
                    p.copy_(gtx.apply_updates(cur, updates)[n])
            module.zero_grad(set_to_none=True)
        ref_opt.zero_grad()
        models.lm_loss(ref(ids), targets).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        ref_opt.step()
    ref_params = dict(ref.named_parameters())
    return {
        "norms": norms,
        "ref_norms": ref_norms,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "ref_params": {n: ref_params[_ref_name(rank, n)].detach().clone() for n, _ in module.named_parameters()},
    }


def _body_part(rank: int) -> bytes:
    return _body(rank, 2)


_SHARED = share_spawn({"body": _body_part}, 2, prefix="pipeline")


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return [models.unpack(r) for r in part_results(_SHARED(), "body")]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_pipeline_norm_and_clipped_grads_match_single_device(results, norm_type):
    norms = [r[norm_type]["norm"] for r in results]
    assert torch.equal(norms[0], norms[1])
    for r in results:
        got = r[norm_type]
        torch.testing.assert_close(got["norm"], got["ref_norm"], rtol=1e-5, atol=0)
        assert set(got["clipped"]) == set(got["ref_clipped"])
        for name, ref in got["ref_clipped"].items():
            torch.testing.assert_close(got["clipped"][name], ref, rtol=1e-5, atol=1e-7, msg=f"rank {r['rank']} {name}")
        assert got["grads_untouched"]  # the pure path never writes into the grads it is given


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_pipeline_collectives_one_tie_reduce_and_one_norm_reduce(results, norm_type):
    op = "max" if math.isinf(norm_type) else "sum"
    for r in results:
        # pp_reduce: the tied grad, summed once; the norm: one reduction over the PP group.
        assert r[norm_type]["calls"] == [("sum", "pp", 1), (op, "pp", 1)]


def test_empty_stage_joins_the_pp_reduction(results):
    for r in results:
        torch.testing.assert_close(r["empty"][0], torch.tensor(5.0))
        torch.testing.assert_close(r["empty"][1], torch.tensor(4.0))


def test_transformed_optimizer_step_matches_single_device_and_keeps_tied_copies_equal(results):
    for r in results:
        for name, ref in r["ref_stepped"].items():
            torch.testing.assert_close(r["stepped"][name], ref, rtol=1e-5, atol=1e-7, msg=f"rank {r['rank']} {name}")
    assert torch.equal(results[0]["tied_after_step"], results[1]["tied_after_step"])


def test_a_tied_plan_without_pp_reduce_is_refused(results):
    for r in results:
        err = r["no_pp_reduce_error"]
        assert err is not None and "tied weights" in err and "gtx.pp_reduce(plan)" in err


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("path", ["functional", "wrapped"])
def test_adamw_steps_match_single_device(results, schedule, path):
    for r in results:
        got = r[(schedule, path)]
        for n, ref in zip(got["norms"], got["ref_norms"]):
            torch.testing.assert_close(n, ref, rtol=1e-5, atol=0)
        for name, ref in got["ref_params"].items():
            torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-5, msg=f"rank {r['rank']} {name}")
