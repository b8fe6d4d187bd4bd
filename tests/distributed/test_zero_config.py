"""The zero-configuration calls on every layout, against a single-device run of the same model (4 gloo ranks).

``clip_by_global_norm(max_norm)``, ``global_norm(tree)``, ``adaptive_clip(...)``
and ``apply_if_finite(...)`` with no plan and no comm read the reduction plan
from the DTensors' placements. For each layout (DDP, FSDP2 with an empty shard,
HSDP, TP, TP x FSDP2, EP x FSDP2, CP with ``cp_reduce``, PP x FSDP2 with a tied
embedding under GPipe and 1F1B) each rank checks, against the same model on one
device fed the whole global batch:

* the norm (p = 1, 2, inf) and the clipped grads, zero-config and explicit;
* the collectives a zero-config clip issues (counted by the profiler) equal
  the explicit plan's (counted by ``RecordingComm``);
* the params after several clipped AdamW steps, through the functional path
  (``tx.update`` + ``apply_updates``) and through ``TransformedOptimizer``.

Plus the misuses of issue 7: each gives the right numbers or a clear error.
All parts share one spawn; each part reports its own error.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import gradtx as gtx
from gradtx.comm import TorchComm
from gradtx.testing import RecordingComm
from tests.distributed import models
from tests.distributed.harness import part_results, share_spawn

WORLD = 4
NORM_TYPES = (1.0, 2.0, math.inf)
MAX_NORM, LR, STEPS = 0.05, 0.05, 3


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _count_all_reduces(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` and count the all-reduces torch really issued (the profiler's c10d events)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(1 for e in prof.events() if e.name == "c10d::allreduce_")


def _slice(x: torch.Tensor, i: int, n: int) -> torch.Tensor:
    k = x.shape[0] // n
    return x[i * k : (i + 1) * k]


class Layout:
    """How to build one layout: a fresh (sharded model, single-device model) pair, and each rank's batch."""

    def __init__(
        self,
        make: Callable[[], tuple[nn.Module, nn.Module]],
        local_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
        comm: Any,
        prefix: tuple[gtx.GradientTransformation, ...] = (),
        ref_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.make, self.local_batch, self.loss, self.comm, self.prefix = make, local_batch, loss, comm, prefix
        self.ref_loss = ref_loss or models.mse


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _checks(layout: Layout, *, agc: bool = False) -> dict[str, Any]:
    model, ref = layout.make()
    x, y = layout.local_batch(0)
    layout.loss(model, x, y).backward()
    params = dict(_inner(model).named_parameters())
    grads = {n: p.grad for n, p in params.items()}
    if layout.prefix:
        pre = gtx.chain(*layout.prefix)
        grads, _ = pre.update(grads, pre.init(params), params)
    fx, fy = models.batch(seed=100)
    ref_grads = models.reference_grads(ref, layout.ref_loss(ref, fx, fy))
    out: dict[str, Any] = {
        "names": sorted(grads),
        "placements": {n: str(getattr(p, "placements", "plain")) for n, p in params.items()},
    }
    out["empty_shards"] = sorted(n for n, g in grads.items() if _local(g).numel() == 0)
    rec = RecordingComm(layout.comm)
    plan = gtx.mesh_groups(params, comm=rec)
    zero_plan = gtx.mesh_groups(params)  # no comm: the DTensors' own meshes
    out["plans"] = (plan.num_collectives(), zero_plan.num_collectives())
    # The first zero-config norm builds the plan and issues only the plan's collectives: plain leaves are
    # each rank's own (torch's semantics), with no check that they are replicas (gtx.norm_audit does that).
    _, out["first_calls"] = _count_all_reduces(lambda: gtx.global_norm(grads))
    for p in NORM_TYPES:
        ref_norm, ref_clipped = models.reference_clip(ref_grads, MAX_NORM, p)
        tx = gtx.clip_by_global_norm(MAX_NORM, norm_type=p)
        (clipped, state), zero_calls = _count_all_reduces(lambda tx=tx: tx.update(grads, tx.init(params)))
        rec.reset()
        explicit = gtx.clip_by_global_norm(MAX_NORM, norm_type=p, mesh_groups=plan)
        e_clipped, e_state = explicit.update(grads, explicit.init(params))
        out[p] = {
            "norm": state.grad_norm,
            "global_norm": gtx.global_norm(grads, p),
            "explicit_norm": e_state.grad_norm,
            "ref_norm": ref_norm,
            "clipped": {n: _full(g) for n, g in clipped.items()},
            "explicit_clipped": {n: _full(g) for n, g in e_clipped.items()},
            "ref_clipped": ref_clipped,
            "zero_calls": zero_calls,
            "explicit_calls": len(rec.calls),
            "explicit_groups": [c.group if isinstance(c.group, str) else "<pg>" for c in rec.calls],
        }
    # The finite check on the same tree (every norm type is inf there: an empty shard must not raise).
    fin = gtx.apply_if_finite(gtx.identity(), 2)
    _, fin_state = fin.update(grads, fin.init(params))
    out["finite"] = bool(fin_state.last_finite)
    if agc:
        clipping = 0.05
        agc_out, _ = gtx.adaptive_clip(clipping).update(grads, gtx.EmptyState(), params)
        out["agc"] = {n: _full(g) for n, g in agc_out.items()}
        out["agc_ref"] = models.reference_agc(ref_grads, dict(ref.named_parameters()), clipping)
    out["train"] = _train(layout)
    return out


def _train(layout: Layout) -> dict[str, Any]:
    """STEPS clipped AdamW steps: functional and wrapped, against torch on one device."""
    result: dict[str, Any] = {}
    # functional: tx.update + apply_updates, the new params copied into the module's (sharded) params
    model, ref = layout.make()
    tx = gtx.chain(*layout.prefix, gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR))
    inner = _inner(model)
    state = tx.init({n: p.detach() for n, p in inner.named_parameters()})
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        layout.loss(model, *layout.local_batch(step)).backward()
        cur = {n: p.detach() for n, p in inner.named_parameters()}
        grads = {n: p.grad for n, p in inner.named_parameters()}
        updates, state = tx.update(grads, state, cur)
        new = gtx.apply_updates(cur, updates)
        with torch.no_grad():
            for n, p in inner.named_parameters():
                _local(p).copy_(_local(new[n]))
    result["functional"] = {n: _full(p) for n, p in _inner(model).named_parameters()}
    # wrapped: gtx.TransformedOptimizer over torch.optim.AdamW
    model, ref = layout.make()
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), gtx.chain(*layout.prefix, gtx.clip_by_global_norm(MAX_NORM))
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        with opt.maybe_no_sync(model):
            layout.loss(model, *layout.local_batch(step)).backward()
        opt.step()
        norms.append(opt.metrics["grad_norm"].clone())
        opt.zero_grad()
        ref_opt.zero_grad()
        fx, fy = models.batch(seed=100 + step)
        layout.ref_loss(ref, fx, fy).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
    result["wrapped"] = {n: _full(p) for n, p in _inner(model).named_parameters()}
    result["wrapped_norms"] = norms
    result["ref"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return result


# --- layouts ------------------------------------------------------------------------------------


def _dp_batch(rank: int, world: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = models.batch(seed=100 + step)
        return _slice(x, rank, world), _slice(y, rank, world)

    return batch


def _ddp(rank: int) -> dict[str, Any]:
    def make():
        ref = models.toy_net(seed=6)
        return DDP(copy.deepcopy(ref)), ref

    def loss(model, x, y):
        return models.mse(model, x, y)

    return _checks(Layout(make, _dp_batch(rank, WORLD), loss, TorchComm()))


class Narrow(nn.Module):
    """An MLP whose last layer has ``rows`` rows: under FSDP2 over more ranks than that, some hold empty shards
    (2 rows on 4 ranks: ranks 2 and 3)."""

    def __init__(self, rows: int = 2) -> None:
        super().__init__()
        self.body = models.toy_net(seed=2)
        self.out = nn.Linear(models.OUT, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.body(x)))


def _narrow_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.mse_loss(out, y[:, : out.shape[-1]])


def _fsdp_empty(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))

    def make():
        torch.manual_seed(2)
        ref = Narrow()
        model = copy.deepcopy(ref)
        for block in model.body.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, ref

    return _checks(Layout(make, _dp_batch(rank, WORLD), _narrow_loss, TorchComm(mesh), ref_loss=_narrow_loss), agc=True)


def _hsdp(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))

    def make():
        ref = models.toy_net(seed=4)
        model = copy.deepcopy(ref)
        fully_shard(model, mesh=mesh)
        return model, ref

    return _checks(Layout(make, _dp_batch(rank, WORLD), models.mse, TorchComm(mesh)))


def _tp(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))

    def make():
        ref = models.toy_net(seed=5)
        model = copy.deepcopy(ref)
        for block in model.blocks:
            parallelize_module(block, mesh, models.tp_plan())
        return model, ref

    def batch(step):  # every TP rank sees the whole batch
        return models.batch(seed=100 + step)

    return _checks(Layout(make, batch, models.mse, TorchComm(mesh)), agc=True)


def _tp_fsdp_make(mesh):
    def make():
        ref = models.toy_net(seed=0)
        model = copy.deepcopy(ref)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], models.tp_plan())
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, ref

    return make


def _tp_fsdp(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = _checks(
        Layout(_tp_fsdp_make(mesh), _dp_batch(mesh.get_local_rank("dp"), 2), models.mse, TorchComm(mesh)), agc=True
    )
    # One clip transform, two layouts in turn: the cached plan is rebuilt when the placements change.
    tx = gtx.clip_by_global_norm(MAX_NORM)
    reused = []
    flat = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    for make, dp, n in ((_tp_fsdp_make(mesh), mesh.get_local_rank("dp"), 2), (_fsdp_make(flat), rank, WORLD)):
        model, ref = make()
        x, y = _dp_batch(dp, n)(0)
        models.mse(model, x, y).backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        _, st = tx.update(grads, tx.init(grads))
        fx, fy = models.batch(seed=100)
        reused.append(
            (st.grad_norm, models.reference_clip(models.reference_grads(ref, models.mse(ref, fx, fy)), 1, 2.0)[0])
        )
    out["reused"] = reused
    return out


def _fsdp_make(mesh):
    def make():
        ref = models.toy_net(seed=0)
        model = copy.deepcopy(ref)
        fully_shard(model, mesh=mesh)
        return model, ref

    return make


# EP x FSDP2: experts stacked in one (E, DIM, DIM) weight, Shard(0) over "ep"; every module FSDP2 over "dp".


class _CopyToEP(torch.autograd.Function):
    """Identity forward; backward sums over ep (each ep rank's local experts see only their part)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromEP(torch.autograd.Function):
    """Sum over ep forward; identity backward (every ep rank computes the same loss)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


NUM_EXPERTS = 4


class MoE(nn.Module):
    """Dense in, a softmax-gated mixture of NUM_EXPERTS tanh experts, dense out (every token to every expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(models.DIM, models.DIM)
        self.router = nn.Linear(models.DIM, NUM_EXPERTS)
        self.experts = nn.Parameter(torch.randn(NUM_EXPERTS, models.DIM, models.DIM) * 0.3)
        self.out = nn.Linear(models.DIM, models.OUT)
        self.ep_group = None  # set on the sharded copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        gate = torch.softmax(self.router(h), dim=-1)
        w = self.experts
        if isinstance(w, DTensor):  # this rank's experts only
            rank = dist.get_rank(self.ep_group)
            h, gate = _CopyToEP.apply(h, self.ep_group), _CopyToEP.apply(gate, self.ep_group)
            w = w.to_local()
            gate = gate[:, rank * w.shape[0] : (rank + 1) * w.shape[0]]
        mixed = torch.einsum("ne,neo->no", gate, torch.tanh(torch.einsum("ni,eoi->neo", h, w)))
        if isinstance(self.experts, DTensor):
            mixed = _ReduceFromEP.apply(mixed, self.ep_group)
        return self.out(mixed)


def _ep_fsdp(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))

    def make():
        torch.manual_seed(7)
        ref = MoE()
        model = copy.deepcopy(ref)
        model.experts = nn.Parameter(distribute_tensor(model.experts.detach(), mesh["ep"], [Shard(0)]))
        model.ep_group = mesh.get_group("ep")
        fully_shard(model, mesh=mesh["dp"])
        return model, ref

    out = _checks(Layout(make, _dp_batch(mesh.get_local_rank("dp"), 2), models.mse, TorchComm(mesh)), agc=True)
    try:  # torch's own clip on this layout (pytorch#180346)
        model, _ = make()
        models.mse(model, *_dp_batch(mesh.get_local_rank("dp"), 2)(0)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["torch_clip_error"] = None
    except RuntimeError as err:
        out["torch_clip_error"] = str(err)
    return out


# CP: ("dp", "cp"); FSDP2 over "dp" only, so the CP ranks' grads must be summed by gtx.cp_reduce.


def _cp(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")

    def make():
        ref = models.toy_net(seed=8)
        model = copy.deepcopy(ref)
        fully_shard(model, mesh=mesh["dp"])
        return model, ref

    def batch(step):  # this dp rank's rows, then this cp rank's chunk of them ("tokens" of one sequence)
        x, y = _dp_batch(dp, 2)(step)
        return _slice(x, cp, 2), _slice(y, cp, 2)

    def loss(model, x, y):
        # The global token mean: this chunk's summed loss over all tokens, times the dp size FSDP2 divides by.
        n_total = models.batch(seed=0)[0].numel() // models.DIM * models.OUT
        return F.mse_loss(model(x), y, reduction="sum") * 2 / n_total

    return _checks(Layout(make, batch, loss, TorchComm(mesh), prefix=(gtx.cp_reduce(mesh["cp"]),)))


# PP x FSDP2: ("pp", "dp"); a tied LM cut into two stages, each FSDP2 over "dp".


def _pp_fsdp(rank: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_idx, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    out: dict[str, Any] = {"stage": stage_idx}
    for name, schedule_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ref = models.TiedLM(seed=0)
        module = models.tied_lm_stages(seed=0)[stage_idx]
        fully_shard(module, mesh=mesh["dp"])
        stage = PipelineStage(module, stage_idx, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        schedule = schedule_cls(stage, n_microbatches=2, loss_fn=models.lm_loss)
        tie = module.emb.weight if stage_idx == 0 else module.head.weight
        params = [list(module.parameters())]
        if name == "gpipe":  # the misuses: no plan at all, and a tied plan without pp_reduce
            errors = []
            zeros = [[torch.zeros_like(p) for p in params[0]]]
            tied_plan = gtx.mesh_groups(params, pp_group="pp", tied={lambda path, p, tie=tie: p is tie: "pp"})
            for bad in (
                gtx.clip_by_global_norm(1.0),  # no plan: the pipeline dim is refused
                None,  # global_norm, likewise
                lambda plan=tied_plan: gtx.chain(gtx.clip_by_global_norm(1.0, mesh_groups=plan)),  # no pp_reduce
            ):
                try:
                    if bad is None:
                        gtx.global_norm(zeros)
                    else:
                        bad = bad() if not isinstance(bad, gtx.GradientTransformation) else bad
                        bad.update(zeros, bad.init(zeros))
                    errors.append(None)
                except ValueError as err:
                    errors.append(str(err))
            out["errors"] = errors
        plan = gtx.mesh_groups(params, pp_group="pp", tied={lambda path, p, tie=tie: p is tie: "pp"})  # no comm needed
        rec = RecordingComm(plan.comm)
        plan_rec = gtx.mesh_groups(params, comm=rec, pp_group="pp", tied={lambda path, p, tie=tie: p is tie: "pp"})
        opt = gtx.TransformedOptimizer(
            torch.optim.AdamW(module.parameters(), lr=LR),
            gtx.chain(gtx.pp_reduce(plan_rec), gtx.clip_by_global_norm(MAX_NORM, mesh_groups=plan_rec)),
        )
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        norms, ref_norms = [], []
        for step in range(STEPS):
            ids, targets = models.lm_batch(seed=50 + step, n=8)
            mine = slice(dp * 4, (dp + 1) * 4)
            if stage_idx == 0:
                schedule.step(ids[mine])
            else:
                schedule.step(target=targets[mine])
            rec.reset()
            opt.step()
            calls = [(c.op, c.group if isinstance(c.group, str) else "<pg>") for c in rec.calls]
            norms.append(opt.metrics["grad_norm"].clone())
            opt.zero_grad()
            ref_opt.zero_grad()
            models.lm_loss(ref(ids), targets).backward()
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
            ref_opt.step()
        ref_params = dict(ref.named_parameters())
        out[name] = {
            "norms": norms,
            "ref_norms": ref_norms,
            "calls": calls,
            "params": {n: _full(p) for n, p in module.named_parameters()},
            "ref_params": {
                n: ref_params["stage0.emb.weight" if (stage_idx, n) == (1, "head.weight") else f"stage{stage_idx}.{n}"]
                .detach()
                .clone()
                for n, _ in module.named_parameters()
            },
            "plan_collectives": plan.num_collectives(),
        }
    return out


# --- misuses that are not about norms -----------------------------------------------------------


class Root(nn.Module):
    """A plain root module holding FSDP2 (or DDP) modules: where maybe_no_sync used to find nothing."""

    def __init__(self, inner: list[nn.Module]) -> None:
        super().__init__()
        self.inner = nn.ModuleList(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.inner:
            x = m(x)
        return x


def _no_sync_finds_nested(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    a, b = nn.Linear(models.DIM, models.DIM), nn.Linear(models.DIM, models.OUT)
    fully_shard(a, mesh=mesh)
    fully_shard(b, mesh=mesh)
    root = Root([a, b])  # not itself fully_shard-ed
    x, y = _dp_batch(rank, WORLD)(0)

    def backward(sync: bool) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof, gtx.no_sync(root, sync=sync):
            models.mse(root, x, y).backward()
        return sum(1 for e in prof.events() if e.name.startswith("c10d::") and "reduce_scatter" in e.name)

    held, synced = backward(False), backward(True)
    # The wrapper's public API: with accumulate(2), only the window's second backward reduce-scatters.
    root.zero_grad(set_to_none=True)
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(root.parameters(), lr=LR), gtx.accumulate(2))
    wrapped = []
    for _ in range(4):
        with profile(activities=[ProfilerActivity.CPU]) as prof, opt.maybe_no_sync(root):
            models.mse(root, x, y).backward()
        wrapped.append(sum(1 for e in prof.events() if e.name.startswith("c10d::") and "reduce_scatter" in e.name))
        opt.step()
        opt.zero_grad()
    # DDP inside a plain wrapper: no_sync must find it too (no all-reduce in a held backward).
    wrapper = Root([DDP(nn.Linear(models.DIM, models.OUT))])

    def ddp_backward(sync: bool) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof, gtx.no_sync(wrapper, sync=sync):
            models.mse(wrapper, x, y).backward()
        return sum(1 for e in prof.events() if e.name == "c10d::allreduce_")

    return {"fsdp": (held, synced), "ddp": (ddp_backward(False), ddp_backward(True)), "wrapped": wrapped}


def _ddp_sum_patterns(rank: int) -> dict[str, Any]:
    """sum_grad_reduction on DDP: every sync pattern over 3 micro-steps gives the sum over ranks and micro-steps."""
    patterns = {"last_only": (False, False, True), "every": (True, True, True), "mixed": (True, False, True)}
    torch.manual_seed(3)
    base = nn.Linear(models.DIM, models.OUT)
    out: dict[str, Any] = {}
    for name, syncs in patterns.items():
        wrapper = gtx.sum_grad_reduction(Root([DDP(copy.deepcopy(base))]))  # DDP found inside a plain module
        for micro, sync in enumerate(syncs):
            x, y = models.batch(seed=10 * micro + rank, n=4)
            with gtx.no_sync(wrapper, sync=sync):
                F.mse_loss(wrapper(x), y, reduction="sum").backward()
        out[name] = {n: p.grad.clone() for n, p in wrapper.inner[0].module.named_parameters()}
        # A second window after zero_grad(set_to_none=False): the zeros are not a stale sum.
        wrapper.zero_grad(set_to_none=False)
        for micro in range(2):
            x, y = models.batch(seed=10 * micro + rank, n=4)
            F.mse_loss(wrapper(x), y, reduction="sum").backward()
        out[name + "_again"] = {n: p.grad.clone() for n, p in wrapper.inner[0].module.named_parameters()}
    ref = copy.deepcopy(base)
    for r in range(WORLD):
        for micro in range(3):
            x, y = models.batch(seed=10 * micro + r, n=4)
            F.mse_loss(ref(x), y, reduction="sum").backward()
    out["ref"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    for r in range(WORLD):
        for micro in range(2):
            x, y = models.batch(seed=10 * micro + r, n=4)
            F.mse_loss(ref(x), y, reduction="sum").backward()
    out["ref_again"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return out


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(models.DIM, 1), nn.Linear(models.DIM, 1)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _ddp_sum_unused(rank: int) -> dict[str, Any]:
    """Two synced backwards; the second touches branch b on rank 0 only, so the other ranks' b grads still
    hold the first sum when DDP reduces them: the comm hook's share of the rescaling (the grad hook never ran)."""
    torch.manual_seed(4)
    base = TwoBranches()
    model = gtx.sum_grad_reduction(DDP(copy.deepcopy(base), find_unused_parameters=True))
    ref = copy.deepcopy(base)
    for micro in range(2):
        x, _ = models.batch(seed=10 * micro + rank, n=4)
        model(x, micro == 0 or rank == 0).sum().backward()
        for r in range(WORLD):
            ref(models.batch(seed=10 * micro + r, n=4)[0], micro == 0 or r == 0).sum().backward()
    return {
        n: (p.grad.clone(), dict(ref.named_parameters())[n].grad.clone()) for n, p in model.module.named_parameters()
    }


def _every_transform(rank: int) -> dict[str, Any]:
    """Every public transform on a TP x FSDP2 DTensor tree: the single-device result, or a clear error."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, ref = _tp_fsdp_make(mesh)()
    x, y = _dp_batch(mesh.get_local_rank("dp"), 2)(0)
    models.mse(model, x, y).backward()
    params = {n: p.detach() for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    fx, fy = models.batch(seed=100)
    ref_grads = models.reference_grads(ref, models.mse(ref, fx, fy))
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    labels = {n: "decay" if n.endswith("weight") else "none" for n in params}
    transforms = {
        "identity": lambda: gtx.identity(),
        "clip": lambda: gtx.clip(1e-3),
        "clip_by_global_norm": lambda: gtx.clip_by_global_norm(MAX_NORM),
        "adaptive_clip": lambda: gtx.adaptive_clip(0.05),
        "scale": lambda: gtx.scale(-0.5),
        "scale_by_learning_rate": lambda: gtx.scale_by_learning_rate(0.1),
        "scale_by_schedule": lambda: gtx.scale_by_schedule(lambda step: 0.5 / (1.0 + step)),
        "scale_by_adam": lambda: gtx.scale_by_adam(),
        "add_decayed_weights": lambda: gtx.add_decayed_weights(0.1),
        "trace": lambda: gtx.trace(0.9),
        "sgd": lambda: gtx.sgd(0.1, momentum=0.9),
        "adam": lambda: gtx.adam(0.01),
        "adamw": lambda: gtx.adamw(0.01),
        "chain": lambda: gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(0.01)),
        "named_chain": lambda: gtx.named_chain(("clip", gtx.clip_by_global_norm(MAX_NORM)), ("opt", gtx.sgd(0.1))),
        "masked": lambda: gtx.masked(gtx.add_decayed_weights(0.1), {n: lab == "decay" for n, lab in labels.items()}),
        "partition": lambda: gtx.partition({"decay": gtx.adamw(0.01), "none": gtx.adam(0.01)}, labels),
        "apply_if_finite": lambda: gtx.apply_if_finite(gtx.clip_by_global_norm(MAX_NORM), 2),
        "accumulate": lambda: gtx.accumulate(2),
        "accumulate_token_weighted": lambda: gtx.accumulate(2, token_weighted=True),
        "pp_reduce": lambda ps: gtx.pp_reduce(gtx.mesh_groups(ps)),  # a plan with no tied weight: the identity
        "cp_reduce": lambda: gtx.cp_reduce("cp", comm=gtx.comm.LocalComm()),  # a one-rank CP group: the identity
    }
    out: dict[str, Any] = {}
    for name, make in transforms.items():
        got: list[Any] = []
        want: list[Any] = []
        try:
            if name == "pp_reduce":  # each side's plan is built from its own params
                tx, ref_tx = make(params), make(ref_params)
            else:
                tx, ref_tx = make(), make()
            state, ref_state = tx.init(params), ref_tx.init(ref_params)
            extra = {"tokens": 8} if name == "accumulate_token_weighted" else {}
            for _ in range(2):
                u, state = tx.update(grads, state, params, **extra)
                ru, ref_state = ref_tx.update(ref_grads, ref_state, ref_params, **extra)
                got.append(None if u is None else {n: _full(t) for n, t in u.items()})
                want.append(ru)
            out[name] = {"got": got, "want": want}
        except (ValueError, TypeError) as err:
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out


# --- functional accumulation on DTensor grads (FSDP2 and TP), update + apply_updates and update_and_apply, with a
# flushed short window ---

ACC_SCHEDULE = ((0, False), (1, False), (2, True))  # k=2: micro-steps 0+1 emit, then 2 alone is flushed


def _accumulate_run(make, local, *, token_weighted: bool, tokens_comm: Any, sum_grads: bool, one_call: bool) -> dict:
    model, ref = make()
    if token_weighted and sum_grads:
        gtx.sum_grad_reduction(model)  # FSDP2 sums over dp; gradtx divides by the global token total
    acc = gtx.accumulate(2, token_weighted=True, comm=tokens_comm) if token_weighted else gtx.accumulate(2)
    tx = gtx.chain(acc, gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR))
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = tx.init(params)
    emitted = []
    for micro, flush in ACC_SCHEDULE:
        model.zero_grad(set_to_none=True)
        x, y = local(micro)
        loss = F.mse_loss(model(x), y, reduction="sum") if token_weighted else models.mse(model, x, y)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        extra: dict[str, Any] = {"tokens": y.numel()} if token_weighted else {}
        if flush:
            extra["flush"] = True
        if one_call:
            params, state = gtx.update_and_apply(tx, grads, state, params, **extra)
        else:
            updates, state = tx.update(grads, state, params, **extra)
            emitted.append(updates is not None)
            params = gtx.apply_updates(params, updates)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if _local(p).data_ptr() != _local(params[n]).data_ptr():
                    _local(p).copy_(_local(params[n]))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for window in ((0, 1), (2,)):
        batches = [models.batch(seed=200 + m) for m in window]
        fx, fy = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        ref_opt.zero_grad()
        models.mse(ref, fx, fy).backward()  # the token mean of the whole window (every token is valid)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
    return {
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "ref": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "emitted": emitted,
    }


def _accumulate_layouts(rank: int) -> dict[str, Any]:
    dp_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    tp_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))

    def tp_make():
        ref = models.toy_net(seed=5)
        model = copy.deepcopy(ref)
        for block in model.blocks:
            parallelize_module(block, tp_mesh, models.tp_plan())
        return model, ref

    def dp_local(micro):
        x, y = models.batch(seed=200 + micro)
        return _slice(x, rank, WORLD), _slice(y, rank, WORLD)

    def tp_local(micro):
        return models.batch(seed=200 + micro)

    layouts = {
        # FSDP2: the token total is summed over "dp" (each rank saw its own tokens).
        "fsdp": (_fsdp_make(dp_mesh), dp_local, TorchComm(dp_mesh), True),
        # TP alone: every rank saw the same tokens, so there is nothing to sum; said explicitly.
        "tp": (tp_make, tp_local, gtx.comm.LocalComm(), False),
    }
    out: dict[str, Any] = {}
    for name, (make, local, comm, sum_grads) in layouts.items():
        for token_weighted in (False, True):
            for one_call in (False, True):
                key = f"{name}-{'tokens' if token_weighted else 'mean'}-{'one-call' if one_call else 'pure'}"
                out[key] = _accumulate_run(
                    make, local, token_weighted=token_weighted, tokens_comm=comm, sum_grads=sum_grads, one_call=one_call
                )
    # The misuse: token-weighted without a comm in a multi-process run.
    try:
        gtx.accumulate(2, token_weighted=True).update(
            {"w": torch.ones(2)}, gtx.accumulate(2, token_weighted=True).init({"w": torch.ones(2)}), tokens=3
        )
        out["no_comm_error"] = None
    except ValueError as err:
        out["no_comm_error"] = str(err)
    return out


def _flat_empty(rank: int) -> dict[str, Any]:
    """One reduction per mesh where most ranks hold only empty shards: every rank issues the same one."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = {"w": torch.tensor([[-3.0]]), "ln": torch.tensor([2.0]), "r": torch.tensor([0.5, -1.0])}
    grads = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0), Shard(1)]),  # rank 0 alone holds an element
        "ln": distribute_tensor(full["ln"], mesh["dp"], [Shard(0)]),  # on the dp sub-mesh: ranks 0 and 1
        "r": distribute_tensor(full["r"], mesh, [Replicate(), Replicate()]),
    }
    out: dict[str, Any] = {"numel": {k: _local(t).numel() for k, t in grads.items()}}
    for p in (1.0, 2.0, 3.0, math.inf):
        norm, calls = _count_all_reduces(lambda p=p: gtx.global_norm(grads, p))
        ref = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in full.values()]), p)
        out[p] = {"norm": norm, "ref": ref, "calls": calls}
    return out


def _compiled_flat(rank: int) -> dict[str, Any]:
    """torch.compile(step, fullgraph=True) on a 2x2 mesh: the one-reduction plan is read inside the trace."""
    from torch._dynamo.utils import counters

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = {"a": torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), "ln": torch.linspace(-1, 2, 4)}
    layout = {"a": [Shard(0), Shard(1)], "ln": [Replicate(), Replicate()]}
    params = {k: distribute_tensor(v, mesh, layout[k]) for k, v in full.items()}
    tx = gtx.chain(gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2))

    def step(p, g, s):
        updates, s = tx.update(g, s, p)
        return gtx.apply_updates(p, updates), s

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    eager, traced = (params, tx.init(params)), (params, tx.init(params))
    for i in range(2):
        gen = torch.Generator().manual_seed(i + 1)
        g = {k: distribute_tensor(torch.randn(v.shape, generator=gen), mesh, layout[k]) for k, v in full.items()}
        eager, traced = step(*eager[:1], g, eager[1]), compiled(*traced[:1], g, traced[1])
    norm = torch.compile(lambda t: gtx.global_norm(t, 3.0), fullgraph=True)(params)  # a plan per call, traced
    return {
        "eager": {k: v.full_tensor() for k, v in eager[0].items()},
        "compiled": {k: v.full_tensor() for k, v in traced[0].items()},
        "norm": norm,
        "ref_norm": torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in full.values()]), 3.0),
        "breaks": sum(counters["graph_break"].values()),
    }


PARTS: dict[str, Callable[[int], Any]] = {
    "ddp": _ddp,
    "fsdp_empty": _fsdp_empty,
    "hsdp": _hsdp,
    "tp": _tp,
    "tp_fsdp": _tp_fsdp,
    "ep_fsdp": _ep_fsdp,
    "cp": _cp,
    "pp_fsdp": _pp_fsdp,
    "no_sync_nested": _no_sync_finds_nested,
    "ddp_sum_patterns": _ddp_sum_patterns,
    "ddp_sum_unused": _ddp_sum_unused,
    "every_transform": _every_transform,
    "accumulate": _accumulate_layouts,
    "flat_empty": _flat_empty,
    "compiled_flat": _compiled_flat,
}


_SHARED = share_spawn(PARTS, WORLD, prefix="zero_config")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore")
    return _SHARED()


def _close(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=msg)


# Per step, the collectives of the norm: one per sharded mesh dim (plus pp) for a declared plan; the
# zero-config one issues one in all when every leaf lives on one root mesh over the world (TP x FSDP2,
# whose layer norms sit on its dp sub-mesh), and keeps one per dim across two root meshes (EP's experts
# and FSDP2's mesh here): the table in docs/distributed.md.
EXPECTED_NORM_COLLECTIVES = {"ddp": 0, "fsdp_empty": 1, "hsdp": 1, "tp": 1, "tp_fsdp": 2, "ep_fsdp": 2, "cp": 1}
ZERO_CONFIG_COLLECTIVES = {**EXPECTED_NORM_COLLECTIVES, "tp_fsdp": 1}


@pytest.mark.parametrize("layout", sorted(EXPECTED_NORM_COLLECTIVES))
def test_zero_config_norm_and_clip_match_single_device(ranks, layout):
    results = part_results(ranks, layout)
    for rank, r in enumerate(results):
        for p in NORM_TYPES:
            got = r[p]
            for key in ("norm", "global_norm", "explicit_norm"):
                _close(got[key], got["ref_norm"], msg=f"rank {rank} {key} p={p}")
            assert torch.equal(got["norm"], results[0][p]["norm"])  # every rank the same, bitwise
            for name, ref in got["ref_clipped"].items():
                _close(got["clipped"][name], ref, msg=f"rank {rank} {name} p={p}")
                _close(got["explicit_clipped"][name], ref, msg=f"rank {rank} {name} p={p} explicit")
            # The zero-config clip issues one collective per mesh, the declared plan one per sharded mesh dim.
            assert got["explicit_calls"] == EXPECTED_NORM_COLLECTIVES[layout], got
            assert got["zero_calls"] == ZERO_CONFIG_COLLECTIVES[layout], got
        assert r["plans"] == (EXPECTED_NORM_COLLECTIVES[layout],) * 2
        assert r["first_calls"] == ZERO_CONFIG_COLLECTIVES[layout], (r["first_calls"], r["placements"])
        assert r["finite"]


@pytest.mark.parametrize("layout", sorted(EXPECTED_NORM_COLLECTIVES))
def test_zero_config_training_matches_single_device(ranks, layout):
    for rank, r in enumerate(part_results(ranks, layout)):
        train = r["train"]
        for path in ("functional", "wrapped"):
            for name, ref in train["ref"].items():
                torch.testing.assert_close(
                    train[path][name], ref, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {path} {name}"
                )


def test_fsdp2_empty_shard_every_norm_type(ranks):
    results = part_results(ranks, "fsdp_empty")
    assert results[0]["empty_shards"] == [] and results[3]["empty_shards"] == ["out.bias", "out.weight"]
    for r in results:
        for name, ref in r["agc_ref"].items():
            _close(r["agc"][name], ref, msg=name)


@pytest.mark.parametrize("layout", ["tp", "tp_fsdp", "ep_fsdp"])
def test_zero_config_adaptive_clip_matches_single_device(ranks, layout):
    for r in part_results(ranks, layout):
        for name, ref in r["agc_ref"].items():
            _close(r["agc"][name], ref, msg=name)


def test_a_compiled_step_on_a_2x2_mesh_traces_whole_and_matches_eager(ranks):
    for rank, r in enumerate(part_results(ranks, "compiled_flat")):
        assert r["breaks"] == 0
        for name, ref in r["eager"].items():
            _close(r["compiled"][name], ref, msg=f"rank {rank} {name}")
        _close(r["norm"], r["ref_norm"], msg=f"rank {rank} norm")


def test_one_reduction_per_mesh_where_ranks_hold_only_empty_shards(ranks):
    results = part_results(ranks, "flat_empty")
    assert [r["numel"] for r in results] == [
        {"w": 1, "ln": 1, "r": 2},
        {"w": 0, "ln": 1, "r": 2},
        {"w": 0, "ln": 0, "r": 2},
        {"w": 0, "ln": 0, "r": 2},
    ]
    for p in (1.0, 2.0, 3.0, math.inf):
        for rank, r in enumerate(results):
            got = r[p]
            assert got["calls"] == 1, (rank, p, got)  # the same one collective on every rank: no hang
            assert torch.equal(got["norm"], results[0][p]["norm"])  # bitwise alike on every rank
            _close(got["norm"], got["ref"], msg=f"rank {rank} p={p}")


def test_layouts_really_are_sharded(ranks):
    tp_fsdp = part_results(ranks, "tp_fsdp")[0]["placements"]
    assert "_StridedShard" in tp_fsdp["blocks.0.w1.weight"] and "Shard(dim=1)" in tp_fsdp["blocks.0.w2.weight"]
    hsdp = part_results(ranks, "hsdp")[0]["placements"]
    assert "Replicate" in hsdp["head.weight"]
    ep = part_results(ranks, "ep_fsdp")[0]
    assert "Shard(dim=0)" in ep["placements"]["experts"] and ep["placements"]["inp.weight"].count("Shard") == 1
    assert ep["torch_clip_error"] is not None  # torch's clip cannot mix the two meshes


def test_one_clip_transform_rebuilds_its_plan_when_the_layout_changes(ranks):
    for r in part_results(ranks, "tp_fsdp"):
        for got, ref in r["reused"]:
            _close(got, ref)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_x_fsdp2_tied_embedding_matches_single_device(ranks, schedule):
    results = part_results(ranks, "pp_fsdp")
    for r in results:
        got = r[schedule]
        for n, ref in zip(got["norms"], got["ref_norms"]):
            _close(n, ref)
        for name, ref in got["ref_params"].items():
            torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-5, msg=f"stage {r['stage']} {name}")
        # pp_reduce: the tied grad over "pp"; the norm: "dp" (both stages FSDP2), then "pp".
        assert got["calls"] == [("sum", "pp"), ("sum", "dp"), ("sum", "pp")], got["calls"]
        assert got["plan_collectives"] == 2


def test_pp_misuses_are_loud(ranks):
    for r in part_results(ranks, "pp_fsdp"):
        no_plan_clip, no_plan_norm, no_pp_reduce = r["errors"]
        for err in (no_plan_clip, no_plan_norm):
            assert err is not None and "pipeline dim 'pp'" in err and "pp_group='pp'" in err
        assert no_pp_reduce is not None and "pp_reduce(plan)" in no_pp_reduce


def test_no_sync_finds_fsdp2_and_ddp_inside_plain_modules(ranks):
    for r in part_results(ranks, "no_sync_nested"):
        held, synced = r["fsdp"]
        assert held == 0 and synced >= 1
        held, synced = r["ddp"]
        assert held == 0 and synced >= 1
        assert [n > 0 for n in r["wrapped"]] == [False, True, False, True], r["wrapped"]


@pytest.mark.parametrize("pattern", ["last_only", "every", "mixed"])
def test_ddp_sum_reduction_is_right_whatever_the_sync_pattern(ranks, pattern):
    for r in part_results(ranks, "ddp_sum_patterns"):
        for name, ref in r["ref"].items():
            _close(r[pattern][name], ref, msg=f"{pattern} {name}")
            _close(r[pattern + "_again"][name], r["ref_again"][name], msg=f"{pattern} again {name}")


def test_ddp_sum_reduction_counts_an_untouched_synced_grad_once(ranks):
    for r in part_results(ranks, "ddp_sum_unused"):
        for name, (got, ref) in r.items():
            _close(got, ref, msg=name)


def test_every_public_transform_matches_single_device_or_raises(ranks):
    for r in part_results(ranks, "every_transform"):
        assert len(r) == 22  # every public transform factory (accumulate twice), cp_reduce and pp_reduce included
        for name, res in r.items():
            if name == "accumulate_token_weighted":
                # The one refusal: token totals of 4 processes with no comm to sum them.
                assert "error" in res and "needs comm=" in res["error"], res
                continue
            assert "error" not in res, (name, res)
            for got, want in zip(res["got"], res["want"]):
                assert (got is None) == (want is None), name
                if got is not None:
                    for leaf, ref in want.items():
                        torch.testing.assert_close(got[leaf], ref, rtol=1e-5, atol=1e-6, msg=f"{name} {leaf}")


ACC_CASES = [
    f"{lay}-{mode}-{path}" for lay in ("fsdp", "tp") for mode in ("mean", "tokens") for path in ("pure", "one-call")
]


@pytest.mark.parametrize("case", ACC_CASES)
def test_functional_accumulation_on_dtensor_grads_matches_single_device(ranks, case):
    for rank, r in enumerate(part_results(ranks, "accumulate")):
        got = r[case]
        if got["emitted"]:
            assert got["emitted"] == [False, True, True]  # the flushed short window emits alone
        for name, ref in got["ref"].items():
            torch.testing.assert_close(got["params"][name], ref, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {case} {name}")


def test_token_weighted_accumulation_without_comm_is_refused_across_ranks(ranks):
    for r in part_results(ranks, "accumulate"):
        assert r["no_comm_error"] is not None and "comm" in r["no_comm_error"]
