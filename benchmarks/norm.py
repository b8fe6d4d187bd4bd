"""The global norm's benchmarks: the local pass against torch, the fused step on a GPU, and the reductions over gloo ranks.

Usage::

    python benchmarks/norm.py                 # the local pass on CUDA if present, else CPU (+ the step on CUDA)
    python benchmarks/norm.py --cuda-only     # the GPU table only; exits 2 without CUDA (about 1 minute on an H100)
    python benchmarks/norm.py --dist          # also 4 gloo ranks on CPU, TP x FSDP layout: a reduction per mesh dim
                                              # against one over the mesh, and the TP x FSDP2 model below
    python benchmarks/norm.py --tp-fsdp-model # 4 gloo ranks, a TP x FSDP2 transformer: the clip's norm with a
                                              # reduction per mesh dim, and zero-config (also run by --dist)
    python benchmarks/norm.py --quick         # tiny shapes, a smoke run

It needs torch, optree and this repository only (no torchopt, no JAX), and
writes its markdown table to ``--out`` (default ``norm-bench-<device>.md``)
as well as printing it, so the table can be pasted into ``docs/benchmarks.md``
with the device named. Every ratio is between rows timed in the same run,
round-robin, medians of the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import operator
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `gradtx` and `benchmarks` importable
    sys.path.insert(0, str(REPO))

import torch

import gradtx as gtx
from benchmarks.cases import gpt2_shapes, randn_tree

# Nominal HBM bandwidth, bytes/s, by the name CUDA reports; the measured copy bandwidth is shown beside it.
NOMINAL_BW = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100": 2.0e12}


def timed(contenders: dict[str, Callable[[], object]], rounds: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds per call of each contender, timed round-robin in a shuffled order, after two warm-ups."""
    for f in contenders.values():
        f()
        f()
    sync()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(contenders)
        rng.shuffle(order)
        for k in order:
            sync()
            t0 = time.perf_counter()
            contenders[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def load() -> str:
    if not hasattr(os, "getloadavg"):
        return "?"
    return f"{os.getloadavg()[0]:.2f} (1-min load average) on {os.cpu_count()} cores"


# Other work on the machine, as a list of programs run beside the timed pair: a spinning process
# holds one core; two torch processes whose matmuls keep their intra-op threads busy are a parallel
# test run in miniature, and oversubscribe every core.
BUSY = {
    "one busy process": ["while True: pass"],
    "two torch processes on all cores": ["import torch\na = torch.randn(384, 384)\nwhile True: a @ a"] * 2,
}


@contextlib.contextmanager
def beside(programs: list[str]) -> Iterator[None]:
    """Run ``programs`` (Python sources) in processes of their own while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", src]) for src in programs]
    try:
        time.sleep(2.0)  # let them start (torch's import) and take their cores
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def local_pass(device: torch.device, quick: bool, rounds: int, sync: Callable[[], None]) -> list[tuple[str, str]]:
    """gtx.global_norm against torch.nn.utils.get_total_norm(foreach=True) on GPT-2-small grads: time and accuracy."""
    cfg = {"n_layer": 2, "n_embd": 64, "vocab_size": 1000, "n_positions": 64} if quick else {}
    shapes = gpt2_shapes(**cfg)
    rows: list[tuple[str, str]] = []
    for dtype in (torch.float32, torch.bfloat16):
        grads = randn_tree(shapes, dtype=dtype, device=device, seed=1, scale=1e-3)
        leaves = list(grads.values())
        kind = str(dtype).replace("torch.", "")
        contenders = {
            "torch": lambda leaves=leaves: torch.nn.utils.get_total_norm(leaves, foreach=True),
            "gtx": lambda grads=grads: gtx.global_norm(grads),
        }
        t = timed(contenders, rounds, sync)
        loaded = []
        if device.type == "cpu" and not quick:  # steady under load: the same pair beside other work
            for what, busy in BUSY.items():
                with beside(busy):
                    b = timed(contenders, rounds, sync)
                loaded.append((f"{kind}: time, gtx / torch, beside {what}", f"**{b['gtx'] / b['torch']:.3f}**"))
        wte = grads["wte.weight"]
        ref = torch.linalg.vector_norm(wte.double()).item()
        err_torch = abs(torch.nn.utils.get_total_norm([wte], foreach=True).double().item() / ref - 1)
        err_gtx = abs(gtx.global_norm([wte]).double().item() / ref - 1)
        n = sum(t.numel() for t in leaves)
        note = " (torch sums bf16 in bf16)" if dtype != torch.float32 else ""
        rows += [
            (
                f"{kind}: torch get_total_norm(foreach=True), {len(leaves)} tensors, {n:,} params",
                f"{t['torch'] * 1e3:.3f} ms",
            ),
            (f"{kind}: gtx.global_norm", f"{t['gtx'] * 1e3:.3f} ms"),
            (f"{kind}: time, gtx / torch", f"**{t['gtx'] / t['torch']:.3f}**"),
            *loaded,
            (
                f"{kind}: rel. error on wte ({wte.numel():,} el.) vs fp64, torch / gtx{note}",
                f"{err_torch:.2e} / **{err_gtx:.2e}**",
            ),
        ]
        del grads, leaves
    return rows


def fused_step(device: torch.device, quick: bool, rounds: int, sync: Callable[[], None]) -> list[tuple[str, str]]:
    """The wrapper's fused clip + AdamW step on GPT-2-small: achieved bandwidth vs the device's, the norm's share."""
    cfg = {"n_layer": 2, "n_embd": 64, "vocab_size": 1000, "n_positions": 64} if quick else {}
    shapes = gpt2_shapes(**cfg)
    params = randn_tree(shapes, dtype=torch.float32, device=device, seed=0)
    grads = randn_tree(shapes, dtype=torch.float32, device=device, seed=1, scale=1e-3)
    plist = []
    for p, g in zip(params.values(), grads.values()):
        p.requires_grad_(True)
        p.grad = g
        plist.append(p)
    n = sum(p.numel() for p in plist)
    wrapper = gtx.TransformedOptimizer(
        torch.optim.AdamW(plist, lr=1e-4, weight_decay=0.1, fused=True), gtx.chain(gtx.clip_by_global_norm(1.0))
    )
    baseline = torch.optim.AdamW(plist, lr=1e-4, weight_decay=0.1, fused=True)

    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(plist, 1.0, foreach=True)
        baseline.step()

    big = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB: the copy that measures bandwidth
    dst = torch.empty_like(big)
    gl = list(grads.values())
    t = timed(
        {
            "wrapper": wrapper.step,
            "torch": torch_step,
            "norm": lambda: gtx.global_norm(gl),
            "copy": lambda: dst.copy_(big),
        },
        rounds,
        sync,
    )
    # The wrapper's step reads each grad once for the norm, then the fused AdamW kernel reads param,
    # grad and both moments and writes param and moments: 8 fp32 passes over the model.
    step_bytes = 8 * 4 * n
    copy_bw = 2 * big.numel() * 4 / t["copy"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    nominal = next((bw for key, bw in NOMINAL_BW.items() if key in name), None)
    achieved = step_bytes / t["wrapper"]
    rows = [
        ("fused wrapper step (clip + AdamW(fused)), GPT-2-small fp32", f"{t['wrapper'] * 1e3:.3f} ms"),
        ("torch clip_grad_norm_(foreach) + AdamW(fused).step()", f"{t['torch'] * 1e3:.3f} ms"),
        ("step time, wrapper / torch", f"**{t['wrapper'] / t['torch']:.3f}**"),
        ("wrapper's achieved bandwidth (8 fp32 passes)", f"{achieved / 1e9:.0f} GB/s"),
        ("device-to-device copy bandwidth (1 GiB, read + write)", f"{copy_bw / 1e9:.0f} GB/s"),
        ("achieved / copy bandwidth", f"**{achieved / copy_bw:.2f}**"),
    ]
    if nominal is not None:
        rows.append((f"achieved / nominal {nominal / 1e12:.2f} TB/s", f"**{achieved / nominal:.2f}**"))
    rows += [
        ("gtx.global_norm alone", f"{t['norm'] * 1e3:.3f} ms"),
        (
            "the norm's share of the wrapper step (what a norm in the backward would take off it)",
            f"**{t['norm'] / t['wrapper']:.2f}**",
        ),
    ]
    return rows


# --- 4 gloo ranks, TP x FSDP layout -----------------------------------------------------------


def _dist_worker(rank: int, world: int, port: int, quick: bool, rounds: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gradtx.comm.torch_dist import TorchComm
    from gradtx.core import tree as tu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        d, layers, vocab = (64, 2, 512) if quick else (768, 12, 50304)
        gen = torch.Generator().manual_seed(0)
        grads: dict[str, torch.Tensor] = {}

        def put(name: str, shape: tuple[int, ...], placements: list) -> None:
            grads[name] = distribute_tensor(torch.randn(shape, generator=gen) * 1e-3, mesh, placements)

        put("wte", (vocab, d), [Shard(0), Shard(0)])  # vocab-parallel embedding, FSDP over dp
        for i in range(layers):
            put(f"h{i}.qkv", (3 * d, d), [Shard(0), Shard(0)])  # colwise
            put(f"h{i}.proj", (d, d), [Shard(0), Shard(1)])  # rowwise
            put(f"h{i}.fc", (4 * d, d), [Shard(0), Shard(0)])
            put(f"h{i}.out", (d, 4 * d), [Shard(0), Shard(1)])
            for b in ("ln1", "ln2", "proj_bias", "out_bias"):
                put(f"h{i}.{b}", (d,), [Shard(0), Replicate()])  # replicated over tp: the dp-only bucket
        leaves, _ = tu.flatten(grads)  # the flatten order the plan is bound to
        # the clip's norm (its factor, no scaling), with the plan it holds from one step to the next
        declared = gtx.clip_by_global_norm(1.0, mesh_groups=gtx.mesh_groups(grads, comm=TorchComm(mesh)))
        zero = gtx.clip_by_global_norm(1.0)  # the placements' plan: one reduction over the whole mesh
        states = {"per dim": declared.init(grads), "one reduction": zero.init(grads)}
        a = declared.factor(grads, states["per dim"])[1].grad_norm
        b = zero.factor(grads, states["one reduction"])[1].grad_norm
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0)
        from gradtx.core import norms

        shards = [t._local_tensor for t in leaves]
        times: dict[str, list[float]] = {"one reduction": [], "per dim": [], "local": []}
        runs = {
            "per dim": lambda: declared.factor(grads, states["per dim"]),
            "one reduction": lambda: zero.factor(grads, states["one reduction"]),
            # the floor: the local pass alone, no collective (what no reordering can hide)
            "local": lambda: norms.local_norm(shards, 2.0),
        }
        for r in range(rounds + 2):
            for k in sorted(runs, reverse=r % 2 == 1):  # the same order on every rank
                dist.barrier()
                t0 = time.perf_counter()
                runs[k]()
                if r >= 2:
                    times[k].append(time.perf_counter() - t0)
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            local = sum(t._local_tensor.numel() for t in leaves)
            with open(out, "w") as f:
                f.write(f"{med['one reduction']}\n{med['per dim']}\n{local}\n{med['local']}\n")
    finally:
        dist.destroy_process_group()


def dist_reductions(quick: bool, rounds: int) -> list[tuple[str, str]]:
    import tempfile

    import torch.multiprocessing as mp

    out = os.path.join(tempfile.mkdtemp(), "dist.txt")
    port = 29500 + random.Random(os.getpid()).randrange(2000)
    mp.spawn(_dist_worker, args=(4, port, quick, rounds, out), nprocs=4, join=True)
    one, per_dim, local, alone = Path(out).read_text().splitlines()
    return [
        (
            (
                f"4 gloo ranks, mesh (dp=2, tp=2), {int(local):,} local fp32 grads per rank: the clip's norm with a "
                "declared plan, one reduction per mesh dim (tp, then dp)"
            ),
            f"{float(per_dim) * 1e3:.2f} ms",
        ),
        ("the same, zero-config clip: one reduction over the whole mesh", f"{float(one) * 1e3:.2f} ms"),
        ("one reduction / one per mesh dim", f"**{float(one) / float(per_dim):.3f}**"),
        (
            "the local pass alone (no collective): the floor no ordering can go below, / one per mesh dim",
            f"{float(alone) * 1e3:.2f} ms = {float(alone) / float(per_dim):.3f}",
        ),
    ]


# --- 4 gloo ranks, a TP x FSDP2 model: the clip's norm, a reduction per mesh dim or one over the mesh -----


class _Block(torch.nn.Module):
    """A pre-norm transformer block: attention (heads split over tp) and an MLP, Megatron-style TP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.hd = d // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.proj = torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # colwise q/k/v: each tp rank holds whole heads, so attention needs no collective
        q, k, v = (m(h).view(b, t, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))  # rowwise: the all-reduce over tp
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


def _tp_fsdp_worker(rank: int, world: int, port: int, quick: bool, rounds: int, out: str) -> None:
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gradtx.comm.torch_dist import TorchComm
    from gradtx.core import norms

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        d, heads, layers, seq = (32, 4, 2, 8) if quick else (256, 8, 6, 64)
        torch.manual_seed(0)
        base = torch.nn.Sequential(*(_Block(d, heads) for _ in range(layers)))
        plan = {
            **{m: ColwiseParallel() for m in ("q", "k", "v", "fc")},
            **{m: RowwiseParallel() for m in ("proj", "out")},
        }

        def shard(model: torch.nn.Module) -> torch.nn.Module:
            for block in model:
                parallelize_module(block, mesh["tp"], plan)
                fully_shard(block, mesh=mesh["dp"])
            return fully_shard(model, mesh=mesh["dp"])

        model = shard(copy.deepcopy(base))
        # one batch per dp rank, the same on both tp ranks of it
        x = torch.randn(4, seq, d, generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))

        def backward(model: torch.nn.Module) -> dict[str, torch.Tensor]:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            return {k: p.grad for k, p in model.named_parameters()}

        grads = backward(model)
        clips = {
            # a declared plan: one reduction per mesh dim, each waited on before the next line
            "sequential": gtx.clip_by_global_norm(1.0, mesh_groups=gtx.mesh_groups(grads, comm=TorchComm(mesh))),
            # zero-config: the placements' plan, one reduction over the whole mesh
            "overlapped": gtx.clip_by_global_norm(1.0),
        }
        states = {k: tx.init(grads) for k, tx in clips.items()}
        extra = ["local", "two scalars", "one scalar"]
        times: dict[str, dict[str, list[float]]] = {k: {"backward": [], "norm": []} for k in [*clips, *extra]}
        tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
        for r in range(rounds + 2):
            seen = {}
            for k in sorted([*clips, *extra], reverse=r % 2 == 1):  # the same order on every rank
                dist.barrier()
                t0 = time.perf_counter()
                g = backward(model)
                t1 = time.perf_counter()
                # Every rank past its backward before the clock starts: what the norm itself costs, not the
                # ranks' skew from the backward (4 ranks on few cores are scheduled in turns), which any
                # first collective of the step would absorb.
                dist.barrier()
                t1b = time.perf_counter()
                if k == "local":  # the local pass alone, no collective: all that the backward can take over
                    norms.local_norm(list(g.values()), 2.0)
                elif k == "two scalars":  # what a reduction per mesh dim costs: one scalar over tp, then one over dp
                    v = torch.zeros((), dtype=torch.float64)
                    dist.all_reduce(v, group=tp_group)
                    dist.all_reduce(v, group=dp_group)
                elif k == "one scalar":  # the floor of (b): one scalar over the whole mesh
                    dist.all_reduce(torch.zeros((), dtype=torch.float64))
                else:
                    _, st = clips[k].factor(g, states[k])  # the clip's norm (and its coefficient), no scaling
                    seen[k] = st.grad_norm
                t2 = time.perf_counter()
                if r >= 2:
                    times[k]["backward"].append(t1 - t0)
                    times[k]["norm"].append(t2 - t1b)
            # the same norm on every path: the measured parts are the step-time ones, to fp32 rounding
            torch.testing.assert_close(seen["sequential"], seen["overlapped"], rtol=2e-6, atol=0)
        if rank == 0:
            med = {k: {w: statistics.median(v) for w, v in t.items()} for k, t in times.items()}
            # each round times both paths back to back: the median of their ratios cancels the drift between rounds
            paired = statistics.median(map(operator.truediv, times["overlapped"]["norm"], times["sequential"]["norm"]))
            n = sum(p.numel() for p in base.parameters())
            local = sum(g.to_local().numel() for g in grads.values())
            with open(out, "w") as f:
                f.write(repr((med, paired, n, local, len(grads), rounds)))
    finally:
        dist.destroy_process_group()


def tp_fsdp_model(quick: bool, rounds: int) -> list[tuple[str, str]]:
    import ast
    import tempfile

    import torch.multiprocessing as mp

    out = os.path.join(tempfile.mkdtemp(), "tp_fsdp.txt")
    port = 29500 + random.Random(os.getpid() + 2).randrange(2000)
    mp.spawn(_tp_fsdp_worker, args=(4, port, quick, rounds, out), nprocs=4, join=True)
    med, paired, n, local, leaves, rounds = ast.literal_eval(Path(out).read_text())
    seq, ov, alone = med["sequential"], med["overlapped"], med["local"]
    per_dim, floor = med["two scalars"], med["one scalar"]
    return [
        (
            (
                f"4 gloo ranks, a TP x FSDP2 transformer (mesh dp=2 x tp=2), {n:,} fp32 params in {leaves} "
                f"DTensors ({local:,} per rank): every rank past its backward (a barrier) to the end of the clip's norm, "
                "(a) a declared plan, one reduction per mesh dim (sequential)"
            ),
            f"{seq['norm'] * 1e3:.2f} ms",
        ),
        (
            ("(b) the same, zero-config clip: one reduction over the whole mesh"),
            f"{ov['norm'] * 1e3:.2f} ms",
        ),
        (
            "the local pass alone (no collective): all the backward can take off the step, / (b)",
            f"{alone['norm'] * 1e3:.2f} ms = {alone['norm'] / ov['norm']:.3f}",
        ),
        (
            "one scalar all-reduce over the mesh alone (gloo's latency): the floor of (b), / (b)",
            f"{floor['norm'] * 1e3:.2f} ms = {floor['norm'] / ov['norm']:.3f}",
        ),
        ("two scalar all-reduces, over tp then dp (one per mesh dim, as in (a))", f"{per_dim['norm'] * 1e3:.2f} ms"),
        ("(b) / (a): one reduction / one per mesh dim, the ratio of the medians", f"{ov['norm'] / seq['norm']:.3f}"),
        (f"(b) / (a), the median of the {rounds} rounds' ratios (each round times both)", f"{paired:.3f}"),
        (
            "(b) / (a), the larger of the two (the target's overlapped / sequential)",
            f"**{max(ov['norm'] / seq['norm'], paired):.3f}**",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda-only", action="store_true", help="the GPU table only; exit 2 when CUDA is absent")
    ap.add_argument("--dist", action="store_true", help="also 4 gloo ranks on CPU (TP x FSDP layout, and the model)")
    ap.add_argument(
        "--tp-fsdp-model",
        action="store_true",
        help="only 4 gloo ranks, a TP x FSDP2 model: the clip's norm per mesh dim and zero-config",
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes, a smoke run")
    ap.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per contender (default 30 on CUDA, 9 on CPU)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=None, help="where the markdown table goes (default norm-bench-<device>.md)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    if args.cuda_only and not cuda:
        print("benchmarks/norm.py --cuda-only: no CUDA device here; nothing was run", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda" if cuda else "cpu")
    rounds = args.rounds or (3 if args.quick else 30 if cuda else 9)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    load_start = load()
    t0 = time.perf_counter()
    if args.tp_fsdp_model:
        rows = tp_fsdp_model(args.quick, max(5, rounds) if args.quick else max(31, rounds))
    else:
        rows = local_pass(device, args.quick, rounds, sync)
        if cuda:
            rows += fused_step(device, args.quick, rounds, sync)
        else:
            rows.append(("fused wrapper step's bandwidth vs peak (CUDA only)", "not run: no CUDA device"))
    if args.dist and not args.cuda_only:
        rows += dist_reductions(args.quick, max(3, rounds))
        # 4 ranks on a few shared cores: ms-scale medians need more rounds than the 2-rank cases
        rows += tp_fsdp_model(args.quick, max(5, rounds) if args.quick else max(31, rounds))
    command = "python benchmarks/norm.py " + " ".join(sys.argv[1:])
    lines = [
        "# The global norm: benchmarks",
        "",
        (
            f"Generated by `{command.strip()}` (`make bench` runs it with `--dist`). Do not edit by hand: rerun the "
            "script. On a GPU it also times the fused wrapper step; `--cuda-only` gives that table alone, for "
            "a lent GPU machine. Every ratio is between rows timed round-robin in this run (medians)."
        ),
        "",
        (
            f"Device: **{name}** ({torch.get_num_threads()} CPU threads); torch {torch.__version__}; Python {sys.version.split()[0]}; "
            f"load {load_start} at the start, {load()} at the end; {time.perf_counter() - t0:.0f} s."
        ),
        "",
        "| what | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out or f"norm-bench-{device.type}.md")
    out.write_text(text)
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
