"""Token-weighted accumulation across 2 data-parallel gloo ranks, against a one-process full-batch step.

Each rank runs k=4 micro-batches per optimizer step with unequal padding per
micro-batch and per rank; rank 1 has one all-padding micro-batch. After two
optimizer steps (SGD with momentum, whose update scales with the gradient, so a
wrong normalisation cannot hide the way it would under Adam's first step) the
params must equal the single-process run that takes the token mean over the
whole global batch. Three ways of running the same thing:

* functional: ``torch.func.grad`` per rank, ``accumulate(..., reduce_grads=True)``;
* ``TransformedOptimizer`` + DDP, with ``sum_grad_reduction`` and ``maybe_no_sync``;
* ``TransformedOptimizer`` + FSDP2, likewise.

Each also counts its collectives: grads are synced once per optimizer step
(on the last micro-step), and the token total costs one scalar collective.

All parts run in one spawn of 2 processes (a spawn costs seconds); each part
reports its own error, so one failing part does not hide the others.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Self

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradtx.testing import assert_trees_close
from tests.distributed.harness import part_results, share_spawn

WORLD, K, STEPS = 2, 4, 2
VOCAB, DIM, BATCH, SEQ = 13, 8, 2, 6
LR, MOMENTUM = 0.5, 0.9
# Fraction of padded targets per (rank, micro-step): unequal everywhere; rank 1's micro-step 2 is all padding.
PAD = ((0.0, 0.2, 0.5, 0.1), (0.7, 0.9, 1.0, 0.3))


def lm(seed: int = 0) -> nn.Sequential:
    """Embedding, then an LM head: the smallest model whose grads depend on which tokens are valid."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB))


def micro_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y[torch.rand(BATCH, SEQ, generator=g) < PAD[rank][micro]] = -100
    return x, y


def n_valid(y: torch.Tensor) -> int:
    return int((y != -100).sum())


def sum_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def reference_params() -> dict[str, torch.Tensor]:
    """One process, no gradtx: SGD on the token-mean loss over each step's whole global batch."""
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        batches = [micro_batch(r, step, i) for r in range(WORLD) for i in range(K)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def global_tokens(step: int) -> int:
    return sum(n_valid(micro_batch(r, step, i)[1]) for r in range(WORLD) for i in range(K))


# --- the parts, run on every rank ----------------------------------------------------------------


def _functional(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.func import functional_call, grad

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm
    from gradtx.testing import RecordingComm

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    comm = RecordingComm(TorchComm(mesh))
    model = lm()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    tx = gtx.chain(
        gtx.accumulate(K, token_weighted=True, comm=comm, group="dp", reduce_grads=True),
        gtx.sgd(LR, momentum=MOMENTUM),
    )
    state = tx.init(params)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return sum_loss(functional_call(model, p, (x,)), y)

    calls_after_each_micro_step, tokens = [], []
    for step in range(STEPS):
        for i in range(K):
            x, y = micro_batch(rank, step, i)
            updates, state = tx.update(grad(loss_fn)(params, x, y), state, params, tokens=n_valid(y))
            params = gtx.apply_updates(params, updates)
            calls_after_each_micro_step.append(len(comm.calls))
        tokens.append(int(gtx.metrics(state)["tokens"]))
    return {
        "params": params,
        "calls_after_each_micro_step": calls_after_each_micro_step,
        "calls": [(c.op, c.group, c.num_tensors, c.shapes) for c in comm.calls],
        "tokens": tokens,
        "num_leaves": len(params),
    }


def _global_zero_tokens(rank: int) -> dict[str, Any]:
    """A window with no valid tokens on any rank is skipped everywhere, in step, and the run goes on."""
    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    tx = gtx.accumulate(2, token_weighted=True, comm=TorchComm(), group="world", reduce_grads=True)
    state = tx.init({"w": torch.zeros(3)})
    _, state = tx.update({"w": torch.zeros(3)}, state, tokens=0)
    skipped, state = tx.update({"w": torch.zeros(3)}, state, tokens=0)
    # A fresh window; only rank 0 has tokens in it.
    g = torch.full((3,), 6.0 * (rank + 1))
    _, state = tx.update({"w": g}, state, tokens=3 if rank == 0 else 0)
    out, state = tx.update({"w": torch.zeros(3)}, state, tokens=0)
    return {
        "skipped": skipped is None,
        "empty_windows": int(state.empty_windows),
        "out": out["w"],
        "tokens": int(state.last_tokens),
    }


class _CountingAllReduce:
    """Count every ``torch.distributed.all_reduce`` by (step, micro-step, dtype, numel) while installed."""

    def __init__(self) -> None:
        self.where: tuple[int, int] = (-1, -1)
        self.log: list[tuple[int, int, str, int]] = []
        self._orig: Callable[..., Any] | None = None

    def __enter__(self) -> Self:
        self._orig = dist.all_reduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.log.append((*self.where, str(tensor.dtype), tensor.numel()))
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._orig


def _train_wrapped(rank: int, model: nn.Module, comm: Any, group: str, where: Callable[[int, int], None]) -> Any:
    import gradtx as gtx

    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        gtx.accumulate(K, token_weighted=True, comm=comm, group=group),
    )
    stepped, synced_flags, tokens = [], [], []
    for step in range(STEPS):
        for i in range(K):
            where(step, i)
            x, y = micro_batch(rank, step, i)
            synced_flags.append(opt.emits_next())
            with opt.maybe_no_sync(model):
                sum_loss(model(x), y).backward()
            opt.step(tokens=n_valid(y))
            stepped.append(opt.emitted)
            opt.zero_grad()
        tokens.append(int(opt.metrics["tokens"]))
    return {"stepped": stepped, "synced": synced_flags, "tokens": tokens}


def _ddp(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradtx.comm.torch_dist import TorchComm
    from gradtx.wrapper import sum_grad_reduction

    model = sum_grad_reduction(DDP(lm()))
    with _CountingAllReduce() as counter:
        result = _train_wrapped(rank, model, TorchComm(), "world", lambda s, i: setattr(counter, "where", (s, i)))
    result["params"] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    result["all_reduces"] = counter.log
    return result


def _fsdp2(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    from gradtx.comm.torch_dist import TorchComm
    from gradtx.wrapper import sum_grad_reduction

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # a view output; harmless here
    where = [(-1, -1)]
    reduce_scatters: list[tuple[int, int, int]] = []

    class CountingReduceScatter(DefaultReduceScatter):
        # Installed through FSDP2's public set_custom_reduce_scatter: sees every grad reduce-scatter.
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
            reduce_scatters.append((*where[0], input_tensor.numel()))
            return super().__call__(output_tensor, input_tensor, *args, **kw)

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    model = lm()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_grad_reduction(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(CountingReduceScatter())
    divide = [
        (g.gradient_divide_factor, g.force_sum_reduction_for_comms)
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups
    ]
    with _CountingAllReduce() as counter:

        def at(step: int, micro: int) -> None:
            where[0] = (step, micro)
            counter.where = (step, micro)

        result = _train_wrapped(rank, model, TorchComm(mesh), "dp", at)
    result["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    result["reduce_scatters"] = reduce_scatters
    result["all_reduces"] = counter.log
    result["divide"] = divide
    return result


def _ddp_resumed_mid_window(rank: int) -> dict[str, Any]:
    """DDP with sum_grad_reduction, syncing every micro-step: saved in the middle of step 1's window, rebuilt as a
    restarted job builds it (a new DDP, its sum hook, a new wrapper), loaded, and run to the end."""
    import io

    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    def build(inner: nn.Module) -> tuple[nn.Module, Any]:
        model = gtx.sum_grad_reduction(DDP(inner))
        opt = gtx.TransformedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            gtx.accumulate(K, token_weighted=True, comm=TorchComm(), group="world"),
        )
        return model, opt

    inner = lm()
    model, opt = build(inner)
    steps = [(step, i) for step in range(STEPS) for i in range(K)]
    for n, (step, i) in enumerate(steps):
        if (step, i) == (1, 2):  # two micro-steps into step 1's window
            saved = io.BytesIO()
            torch.save({"model": inner.state_dict(), "opt": opt.state_dict()}, saved)
            saved.seek(0)
            checkpoint = torch.load(saved, weights_only=False)
            inner = lm(seed=1)  # other weights: the load must bring them back
            inner.load_state_dict(checkpoint["model"])
            model, opt = build(inner)
            opt.load_state_dict(checkpoint["opt"])
        x, y = micro_batch(rank, step, i)
        sum_loss(model(x), y).backward()  # synced on every micro-step: no maybe_no_sync
        opt.step(tokens=n_valid(y))
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in inner.named_parameters()}}


def _ddp_flush_not_told_to_maybe_no_sync(rank: int) -> list[dict[str, Any]]:
    """A short window flushed on every rank after backwards that maybe_no_sync(model) kept from syncing: its last
    micro-step run without flush=True, or a bare opt.step(flush=True) after a held micro-step. Each rank's .grad
    held only its own micro-batches; the step used to take them, and the replicas stepped apart. It must refuse,
    with the params and the window as they were."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradtx as gtx

    results = []
    for micro_steps in (2, 1):  # 2: the flushing micro-step ran in maybe_no_sync(model); 1: a bare flush
        model = DDP(lm())
        opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), gtx.accumulate(K))
        before = [p.detach().clone() for p in model.parameters()]
        for i in range(micro_steps):
            x, y = micro_batch(rank, 0, i)
            with opt.maybe_no_sync(model):  # flush=True forgotten for the last
                sum_loss(model(x), y).backward()
            if i < micro_steps - 1 or micro_steps == 1:
                opt.step()
        try:
            opt.step(flush=True)
            refused = None
        except ValueError as err:
            refused = str(err)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        results.append({"refused": refused, "unchanged": unchanged, "window_open": opt.window_open})
    return results


def _window_loss_resumed_mid_window(rank: int) -> dict[str, Any]:
    """Functional token-weighted window with each micro-step's summed loss, checkpointed with DCP after 2 of its K
    micro-steps and resumed in a fresh state; the window's loss (what a loss guard after it sees) after the last."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    comm = TorchComm(init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
    model = lm()
    params = {n: p.detach() for n, p in model.named_parameters()}
    tx = gtx.chain(gtx.accumulate(K, token_weighted=True, comm=comm, group="dp"), gtx.sgd(LR))
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    state = tx.init(params)
    for i in range(K):
        if i == 2:
            saved = {"tx": gtx.checkpoint.state_dict(state, params, tx=tx)}
            dcp.save(saved, checkpoint_id=path[0])
            loaded = {"tx": gtx.checkpoint.state_dict(tx.init(params), params, tx=tx)}
            dcp.load(loaded, checkpoint_id=path[0])
            state = gtx.checkpoint.load_state_dict(loaded["tx"], tx.init(params), params, tx=tx)
        x, y = micro_batch(rank, 0, i)
        with torch.no_grad():
            loss = sum_loss(model(x), y)
        grads = {n: torch.zeros_like(p) for n, p in params.items()}  # the loss is what is checked here
        _, state = tx.update(grads, state, params, tokens=n_valid(y), loss=loss)
    return {"window_loss": float(state[0].last_loss), "emitted": bool(state[0].emitted)}


def _plain_window_loss_saved_mid_window(rank: int) -> dict[str, Any]:
    """A plain window's loss is each rank's own mean, which a checkpoint cannot keep per rank (DCP writes one copy
    of a tensor that is not a DTensor): a mid-window save through DCP (functional, reduce_grads) and the DDP
    wrapper's state_dict are refused; the same run without the save gives each rank its own loss."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    comm = TorchComm(init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
    model = lm()
    params = {n: p.detach() for n, p in model.named_parameters()}
    tx = gtx.chain(gtx.accumulate(K, comm=comm, group="dp", reduce_grads=True), gtx.sgd(LR))
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    out: dict[str, Any] = {"refused": None, "wrapper_refused": None}
    for save in (False, True):
        state = tx.init(params)
        try:
            for i in range(K):
                if save and i == 2:
                    dcp.save({"tx": gtx.checkpoint.state_dict(state, params, tx=tx)}, checkpoint_id=path[0])
                    loaded = {"tx": gtx.checkpoint.state_dict(tx.init(params), params, tx=tx)}
                    dcp.load(loaded, checkpoint_id=path[0])
                    state = gtx.checkpoint.load_state_dict(loaded["tx"], tx.init(params), params, tx=tx)
                x, y = micro_batch(rank, 0, i)
                with torch.no_grad():
                    loss = sum_loss(model(x), y) / max(n_valid(y), 1)
                _, state = tx.update({n: torch.zeros_like(p) for n, p in params.items()}, state, params, loss=loss)
            out["resumed" if save else "own"] = float(state[0].last_loss)
        except ValueError as err:
            out["refused"] = str(err)
    ddp = DDP(lm())
    opt = gtx.TransformedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), gtx.accumulate(K))
    for i in range(2):
        x, y = micro_batch(rank, 0, i)
        loss = sum_loss(ddp(x), y) / max(n_valid(y), 1)
        loss.backward()
        opt.step(loss=loss.detach())
    try:
        opt.state_dict()
    except ValueError as err:
        out["wrapper_refused"] = str(err)
    return out


def _window_summed_by_cp_reduce_resumed_mid_window(rank: int) -> dict[str, Any]:
    """chain(accumulate(k), cp_reduce(mesh)): the window holds each rank's own sums, which cp_reduce sums over the
    ranks when it emits. Saved mid-window through DCP, which writes one copy of a plain tensor, every rank used to
    resume with rank 0's sums."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import gradtx as gtx

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    tx = gtx.chain(gtx.accumulate(K), gtx.cp_reduce(mesh["cp"]), gtx.sgd(LR))
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    params = {n: p.detach() for n, p in lm().named_parameters()}
    state, model = tx.init(params), lm()

    def loss(p, x, y):
        return sum_loss(torch.func.functional_call(model, p, (x,)), y)

    for i in range(K):
        if i == 2:
            dcp.save({"tx": gtx.checkpoint.state_dict(state, params, tx=tx)}, checkpoint_id=path[0])
            loaded = {"tx": gtx.checkpoint.state_dict(tx.init(params), params, tx=tx)}
            dcp.load(loaded, checkpoint_id=path[0])
            state = gtx.checkpoint.load_state_dict(loaded["tx"], tx.init(params), params, tx=tx)
        grads = torch.func.grad(loss)(params, *micro_batch(rank, 0, i))
        params, state = gtx.update_and_apply(tx, grads, state, params)
    return {"params": params}


def _gradscaler_with_grads_summed_in_the_step(rank: int) -> list[dict[str, Any]]:
    """GradScaler on every micro-step of a wrapper whose chain sums .grad over the ranks inside the step; rank 0's
    loss is inf on one micro-step. GradScaler's inf flag is each rank's own (read before the step sums), so rank 0
    skipped the window and rank 1 stepped: the replicas parted (and their scales)."""
    from torch.distributed.device_mesh import init_device_mesh

    import gradtx as gtx
    from gradtx.comm.torch_dist import TorchComm

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    results = []
    # The last: no window, so GradScaler itself skipped rank 0's step, and rank 1 waited in cp_reduce's sum (a hang).
    for summing, inf_at in (("reduce_grads", 0), ("reduce_grads", 1), ("cp_reduce", 1), ("cp_reduce alone", 0)):
        if summing == "reduce_grads":
            tx = gtx.chain(gtx.accumulate(2, comm=TorchComm(mesh), reduce_grads=True), gtx.clip_by_global_norm(1.0))
        elif summing == "cp_reduce":
            tx = gtx.chain(gtx.accumulate(2), gtx.cp_reduce(mesh))
        else:
            tx = gtx.cp_reduce(mesh)
        model = lm()
        opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), tx)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        before = [p.detach().clone() for p in model.parameters()]
        refused = None
        for i in range(2):
            x, y = micro_batch(rank, 0, i)
            loss = sum_loss(model(x), y) * (float("inf") if rank == 0 and i == inf_at else 1.0)
            scaler.scale(loss).backward()
            try:
                scaler.step(opt)
            except ValueError as err:
                refused = str(err)
                break
            scaler.update()
            opt.zero_grad()
        params = [p.detach().clone() for p in model.parameters()]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, params))
        results.append({"params": params, "unchanged": unchanged, "refused": refused, "scale": scaler.get_scale()})
    return results


PARTS: dict[str, Callable[[int], Any]] = {
    "functional": _functional,
    "global_zero_tokens": _global_zero_tokens,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
    "ddp_resumed_mid_window": _ddp_resumed_mid_window,
    "ddp_flush_not_told": _ddp_flush_not_told_to_maybe_no_sync,
    "window_loss_resumed": _window_loss_resumed_mid_window,
    "plain_window_loss_saved": _plain_window_loss_saved_mid_window,
    "cp_reduce_window_resumed": _window_summed_by_cp_reduce_resumed_mid_window,
    "gradscaler_summed": _gradscaler_with_grads_summed_in_the_step,
}


_SHARED = share_spawn(PARTS, WORLD, prefix="accumulation_dp")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return _SHARED()


def _assert_params_match_reference(results: list[dict[str, Any]]) -> None:
    expected = reference_params()
    start = {n: p.detach() for n, p in lm().named_parameters()}
    for rank, res in enumerate(results):
        assert set(res["params"]) == set(expected)
        for name, want in expected.items():
            assert not torch.equal(want, start[name]), "the reference did not move; the test would prove nothing"
            torch.testing.assert_close(res["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


def test_test_data_has_unequal_padding_and_an_all_padding_micro_batch() -> None:
    counts = [[n_valid(micro_batch(r, 0, i)[1]) for i in range(K)] for r in range(WORLD)]
    assert 0 in counts[1] and 0 not in counts[0]
    assert len({c for row in counts for c in row}) > 3 and sum(counts[0]) != sum(counts[1])


def test_functional_token_weighted_equals_full_batch_token_mean(ranks: list[dict[str, Any]]) -> None:
    results = part_results(ranks, "functional")
    _assert_params_match_reference(results)
    for res in results:
        assert res["tokens"] == [global_tokens(s) for s in range(STEPS)]


def test_functional_communicates_once_per_step(ranks: list[dict[str, Any]]) -> None:
    for res in part_results(ranks, "functional"):
        # Nothing on the 3 holding micro-steps; 2 collectives on the emitting one.
        assert res["calls_after_each_micro_step"] == [0, 0, 0, 2, 2, 2, 2, 4]
        token_call, grad_call = res["calls"][:2]
        assert token_call == ("sum", "dp", 1, ((3,),))  # tokens, loss weight, loss sum
        assert grad_call[:3] == ("sum", "dp", res["num_leaves"])  # one coalesced call for every leaf
        assert res["calls"][2:] == res["calls"][:2]


def test_global_zero_tokens_skips_on_every_rank_and_a_zero_rank_is_fine(ranks: list[dict[str, Any]]) -> None:
    results = part_results(ranks, "global_zero_tokens")
    for res in results:
        assert res["skipped"] and res["empty_windows"] == 1
        # Rank 1 had no tokens: it still contributes its (here nonzero) grad sum to the global sum.
        torch.testing.assert_close(res["out"], torch.full((3,), (6.0 + 12.0) / 3), rtol=0, atol=0)
        assert res["tokens"] == 3


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_wrapper_token_weighted_equals_full_batch_token_mean(ranks: list[dict[str, Any]], wrapper: str) -> None:
    results = part_results(ranks, wrapper)
    _assert_params_match_reference(results)
    for res in results:
        assert res["stepped"] == [False, False, False, True] * STEPS
        assert res["synced"] == res["stepped"]
        assert res["tokens"] == [global_tokens(s) for s in range(STEPS)]


def test_ddp_with_sum_reduction_resumed_mid_window_equals_the_full_batch_token_mean(
    ranks: list[dict[str, Any]],
) -> None:
    """The restored window's .grad is a synced sum: the sum hook turns it back into this rank's share before the
    next backward, so the resumed run adds what the uninterrupted run adds."""
    _assert_params_match_reference(part_results(ranks, "ddp_resumed_mid_window"))


def test_ddp_syncs_grads_once_per_step(ranks: list[dict[str, Any]]) -> None:
    for res in part_results(ranks, "ddp"):
        grad_syncs = [(s, i) for s, i, dtype, _ in res["all_reduces"] if dtype == "torch.float32"]
        token_syncs = [(s, i, n) for s, i, dtype, n in res["all_reduces"] if dtype == "torch.float64"]
        assert grad_syncs, "no DDP grad all-reduce was seen; the counter is broken"
        assert {i for _, i in grad_syncs} == {K - 1}, f"DDP synced on non-final micro-steps: {grad_syncs}"
        per_step = [sum(1 for s, _ in grad_syncs if s == step) for step in range(STEPS)]
        assert per_step[0] == per_step[1] >= 1
        assert token_syncs == [(s, K - 1, 3) for s in range(STEPS)]  # tokens, loss weight, loss sum


def test_fsdp2_sums_and_reduce_scatters_once_per_step(ranks: list[dict[str, Any]]) -> None:
    for res in part_results(ranks, "fsdp2"):
        assert res["divide"] and all(d == (1.0, True) for d in res["divide"])
        # Two param groups (embedding, head): one reduce-scatter each, on the last micro-step only.
        assert [(s, i) for s, i, _ in res["reduce_scatters"]] == [(s, K - 1) for s in range(STEPS) for _ in range(2)]
        assert [(s, i, d, n) for s, i, d, n in res["all_reduces"]] == [
            (s, K - 1, "torch.float64", 3) for s in range(STEPS)
        ]


def test_a_flush_whose_backward_skipped_the_sync_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank_results in part_results(ranks, "ddp_flush_not_told"):
        for res in rank_results:
            assert res["refused"] is not None and "maybe_no_sync(model, flush=True)" in res["refused"]
            assert res["unchanged"] and res["window_open"]


def test_a_window_loss_resumed_mid_window_is_still_the_global_token_mean(ranks: list[dict[str, Any]]) -> None:
    """The open window's loss sum and weight are per rank, as its tokens are: a checkpoint sums them over the ranks
    and hands the totals to the first rank. Kept as they were, every rank restored the saved copy (DCP keeps one of
    a tensor that is not a DTensor), and the resumed window's loss counted it once per rank."""
    model = lm()
    with torch.no_grad():
        summed = sum(sum_loss(model(x), y) for x, y in (micro_batch(r, 0, i) for r in range(WORLD) for i in range(K)))
    want = float(summed) / global_tokens(0)
    for res in part_results(ranks, "window_loss_resumed"):
        assert res["emitted"]
        assert res["window_loss"] == pytest.approx(want, rel=1e-6)


def test_a_plain_window_loss_is_each_ranks_own_and_a_mid_window_save_of_it_is_refused(
    ranks: list[dict[str, Any]],
) -> None:
    """Saved and resumed, rank 1's window took rank 0's partial loss (DCP keeps one copy of the window's loss sum)."""
    model = lm()
    for rank, res in enumerate(part_results(ranks, "plain_window_loss_saved")):
        with torch.no_grad():
            own = [sum_loss(model(x), y) / max(n_valid(y), 1) for x, y in (micro_batch(rank, 0, i) for i in range(K))]
        assert res["own"] == pytest.approx(float(sum(own)) / K, rel=1e-6)
        for refused in (res["refused"], res["wrapper_refused"]):
            assert refused is not None and "own loss" in refused and "flush=True" in refused, res


def test_a_window_summed_by_cp_reduce_resumed_mid_window_equals_the_global_sum(ranks: list[dict[str, Any]]) -> None:
    """One process, no gradtx: SGD on the sum over the ranks of each rank's mean over its micro-steps' summed losses."""
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sum(sum_loss(model(x), y) for x, y in (micro_batch(r, 0, i) for r in range(WORLD) for i in range(K))).div(
        K
    ).backward()
    opt.step()
    for res in part_results(ranks, "cp_reduce_window_resumed"):
        assert_trees_close(res["params"], dict(model.named_parameters()), rtol=1e-5, atol=1e-6)


def test_gradscaler_is_refused_where_the_chain_sums_the_grads_over_the_ranks(ranks: list[dict[str, Any]]) -> None:
    """GradScaler's inf check sees each rank's grads before the step sums them: refused with the params as they were
    on every rank, where the replicas used to part (rank 0 skipped the window, rank 1 stepped, the scales differed)."""
    per_rank = part_results(ranks, "gradscaler_summed")
    for rank_results in per_rank:
        for res in rank_results:
            assert res["refused"] is not None and "GradScaler" in res["refused"] and "DDP or FSDP2" in res["refused"]
            assert res["unchanged"]
    for a, b in zip(*per_rank):  # the replicas agree, whatever happened
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])) and a["scale"] == b["scale"]
