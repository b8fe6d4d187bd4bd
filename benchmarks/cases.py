"""The benchmark cases of issue 4: (a) clip alone, (b) clip + AdamW, (c) many small tensors, (d) accumulation, (e) compile.

Each case builds its contenders, times them with :func:`harness.measure`, and
returns :class:`harness.CaseResult` s for the report. Contenders of one case
share the param and grad buffers where their semantics allow, which keeps the
GPT-2-sized cases within the machine's memory while all contenders are alive
for the round-robin. Sharing changes values, never costs: the in-place
contenders rescale the grads (or, torchopt in place, overwrite them with
Adam updates of the same magnitude), so nothing drifts toward denormals.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import nn

import gradtx as gtx
from benchmarks import peers
from benchmarks.harness import CaseResult, Contender, Skipped, Timing, measure
from gradtx.core import norms

LR = 1e-3
WEIGHT_DECAY = 0.01
MAX_NORM = 1.0
GRAD_SCALE = 1e-3  # randn * 1e-3 over GPT-2-small has a global norm of about 11: the clip is active

# Row names that ratios and targets refer to.
TORCH_CLIP = "torch clip_grad_norm_(foreach)"
GTX_CLIP_PURE = "gradtx clip_by_global_norm, pure"
GTX_CLIP_DEFERRED = "gradtx clip_by_global_norm, deferred (norm only)"
TORCH_FUSED = "torch clip + AdamW(fused)"
TORCH_FOREACH = "torch clip + AdamW(foreach)"
GTX_WRAPPER = "gradtx TransformedOptimizer(AdamW(fused), chain(clip))"
GTX_PURE = "gradtx functional, pure: update + apply_updates"
GTX_COMPILED = "gradtx functional, pure, torch.compile"
GTX_DONATED = "gradtx functional, torch.compile, params and state donated"
GTX_COMPILED_KEPT = "gradtx functional, pure, torch.compile, freed memory kept"
TORCH_FUSED_KEPT = "torch clip + AdamW(fused), freed memory kept"
TORCHOPT_PURE = "torchopt chain(clip_grad_norm, adamw), pure"
TORCHOPT_INPLACE = "torchopt chain(clip_grad_norm, adamw), in place"
OPTAX_JIT = "optax chain(clip_by_global_norm, adamw), jit + donation"
TORCHOPT_CLIP_PURE = "torchopt clip_grad_norm, pure"
TORCHOPT_CLIP_INPLACE = "torchopt clip_grad_norm, in place"
OPTAX_CLIP = "optax clip_by_global_norm, jit + donation"
D_TORCH = "torch loop: loss/k, backward; clip + AdamW(fused) every k"
D_GTX = "gradtx TransformedOptimizer(AdamW(fused), chain(accumulate(k), clip))"


@dataclass
class Context:
    """What every case needs: the device, the size of the run, and a place to log."""

    device: torch.device
    quick: bool
    reps: int
    warmup: int
    log: Callable[[str], None] = print
    cases: str = "abcdef"
    peers: bool = True
    slow_compiles: bool = False
    wait_quiet: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def torchopt(self) -> tuple[Any, str]:
        return peers.torchopt() if self.peers else (None, "left out (--no-peers)")

    def optax(self) -> tuple[Any, str]:
        return peers.optax(self.device) if self.peers else (None, "left out (--no-peers)")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# --- shapes ------------------------------------------------------------------------------------


def gpt2_shapes(
    n_layer: int = 12, n_embd: int = 768, vocab_size: int = 50257, n_positions: int = 1024
) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of GPT-2 (HF naming), from its config; 148 tensors, 124,439,808 params by default.

    The LM head is tied to ``wte``, so it is not a tensor of its own. Conv1D
    weights are ``(in, out)``, as in the released checkpoints.
    """
    d = n_embd
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab_size, d), "wpe.weight": (n_positions, d)}
    for i in range(n_layer):
        block = {
            "ln_1.weight": (d,),
            "ln_1.bias": (d,),
            "attn.c_attn.weight": (d, 3 * d),
            "attn.c_attn.bias": (3 * d,),
            "attn.c_proj.weight": (d, d),
            "attn.c_proj.bias": (d,),
            "ln_2.weight": (d,),
            "ln_2.bias": (d,),
            "mlp.c_fc.weight": (d, 4 * d),
            "mlp.c_fc.bias": (4 * d,),
            "mlp.c_proj.weight": (4 * d, d),
            "mlp.c_proj.bias": (d,),
        }
        shapes.update({f"h.{i}.{name}": shape for name, shape in block.items()})
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    return shapes


def small_shapes(count: int = 2000, low: int = 1024, high: int = 4096, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """``count`` 1-d tensors of ``low``..``high`` elements: the regime where per-tensor overhead dominates."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return {f"t{i:04d}": (n,) for i, n in enumerate(sizes)}


def numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def randn_tree(
    shapes: dict[str, tuple[int, ...]], *, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen)
        if scale != 1.0:
            t.mul_(scale)
        out[name] = t.to(device=device, dtype=dtype)
    return out


def gpt2_config(ctx: Context) -> dict[str, int]:
    return {"n_layer": 2, "n_embd": 64, "vocab_size": 1000, "n_positions": 64} if ctx.quick else {}


def describe(shapes: dict[str, tuple[int, ...]]) -> str:
    return f"{len(shapes)} tensors, {numel(shapes):,} params"


# --- a: clip alone -----------------------------------------------------------------------------


def case_a(ctx: Context) -> list[CaseResult]:
    """Clip by global norm alone, on GPT-2-small shapes, fp32 and bf16 grads."""
    shapes = gpt2_shapes(**gpt2_config(ctx))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        results.append(_clip_case(ctx, shapes, dtype))
        release_memory()
    return results


def _clip_case(ctx: Context, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> CaseResult:
    tag = str(dtype).replace("torch.", "")
    ctx.log(f"  case a ({tag}): {describe(shapes)}")
    grads = randn_tree(shapes, dtype=dtype, device=ctx.device, seed=1, scale=GRAD_SCALE)
    # torch's clip reads only .grad, so the params need no memory behind them.
    params = [torch.empty(s, dtype=dtype, device=ctx.device) for s in shapes.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g

    contenders = [
        Contender(
            TORCH_CLIP,
            partial(torch.nn.utils.clip_grad_norm_, params, MAX_NORM, foreach=True),
            "in place on .grad; the baseline",
        )
    ]
    tx = gtx.clip_by_global_norm(MAX_NORM)
    box = {"state": tx.init(grads)}

    def gtx_pure() -> None:
        tx.update(grads, box["state"])

    def gtx_deferred() -> None:
        tx.factor(grads, box["state"])

    contenders += [
        Contender(GTX_CLIP_PURE, gtx_pure, "returns new grads; the inputs are untouched"),
        Contender(GTX_CLIP_DEFERRED, gtx_deferred, "what the clip costs when its factor rides in a fused kernel"),
    ]
    skipped: list[Skipped] = []
    topt, why = ctx.torchopt()
    if topt is None:
        skipped += [Skipped(TORCHOPT_CLIP_PURE, why), Skipped(TORCHOPT_CLIP_INPLACE, why)]
    else:
        ttx = topt.clip_grad_norm(MAX_NORM)
        tstate = ttx.init(grads)
        pure = partial(ttx.update, grads, tstate, inplace=False)
        contenders.append(Contender(TORCHOPT_CLIP_PURE, pure, "reads the norm on the host"))
        contenders.append(Contender(TORCHOPT_CLIP_INPLACE, partial(ttx.update, grads, tstate, inplace=True)))
    jo, why = ctx.optax()
    if jo is None:
        skipped.append(Skipped(OPTAX_CLIP, why))
    else:
        contenders.append(optax_clip_contender(jo, grads))
    result = CaseResult(f"a-{tag}", f"a. Clip alone, GPT-2-small shapes ({describe(shapes)}), {tag} grads")
    result.timings, result.contention = measure(
        contenders, reps=ctx.reps, warmup=ctx.warmup, device=ctx.device, log=ctx.log, wait_quiet=ctx.wait_quiet
    )
    result.skipped = skipped
    for c in contenders[1:]:
        result.ratios.append((f"{c.name} / torch", c.name, TORCH_CLIP))
    if dtype == torch.bfloat16:
        result.notes.append(
            "torch's clip_grad_norm_ takes bf16 norms in bf16; gradtx accumulates them in fp32 "
            "(the DESIGN's rule), so the bf16 rows do not do identical arithmetic."
        )
    return result


def optax_clip_contender(jo: tuple[Any, Any], grads: dict[str, torch.Tensor]) -> Contender:
    jax, optax = jo
    clip = optax.clip_by_global_norm(MAX_NORM)
    state = clip.init(None)
    jgrads = {"g": peers.to_jax(jax, grads)}

    @partial(jax.jit, donate_argnums=0)
    def step(g: Any) -> Any:
        return clip.update(g, state)[0]

    def run() -> None:
        # Donated buffers are gone after the call; the clipped grads feed the next one.
        jgrads["g"] = step(jgrads["g"])
        jax.block_until_ready(jgrads["g"])

    return Contender(OPTAX_CLIP, run, f"jax {peers.version('jax')} ({jax.default_backend()})")


# --- b, c, e: a full step -----------------------------------------------------------------------


OURS = (TORCH_FUSED, TORCH_FOREACH, GTX_WRAPPER, GTX_PURE, GTX_COMPILED, GTX_DONATED)
PEERS = (TORCH_FUSED, GTX_PURE, GTX_COMPILED, TORCHOPT_PURE, TORCHOPT_INPLACE, OPTAX_JIT)
FUNCTIONAL = (GTX_COMPILED, GTX_PURE)


def compiled_step(
    ctx: Context, params: Any, state: Any, grads: Any, *, donate: bool = False
) -> Callable[[Any, Any, Any], Any]:
    """The compiled functional step, compiled once per run and reused (no recompile).

    ``donate``: the step writes its results into the params and state it was given, as
    ``jax.jit(..., donate_argnums=...)`` lets XLA reuse its inputs' buffers (what optax's row does).
    The pure step returns fresh buffers, whose pages a CPU faults in on first touch every step.
    """
    key = "donated" if donate else "compiled"
    cached = ctx.info.get(key)
    if cached is not None:
        return cached["step"]
    from torch._dynamo.utils import counters  # only the compiled contenders need dynamo

    tx = ctx.info["tx"]

    def functional_step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        return gtx.update_and_apply(tx, g, s, p)

    def donated_step(p: Any, s: Any, g: Any) -> None:
        new = gtx.update_and_apply(tx, g, s, p)
        for old, result in zip(optree.tree_leaves((p, s)), optree.tree_leaves(new)):
            old.copy_(result)  # inductor writes the result straight into the old buffer

    if not donate:
        torch.compiler.reset()
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    # As a user writes it: no fullgraph; the graph breaks are counted.
    step = torch.compile(donated_step if donate else functional_step)
    ctx.log("    compiling the functional step (torch.compile) ...")
    t0 = time.perf_counter()
    step(params, state, grads)
    ctx.sync()
    ctx.info[key] = {
        "step": step,
        "compile_seconds": time.perf_counter() - t0,
        "graph_breaks": sum(counters["graph_break"].values()) - breaks,
        # Graphs dynamo produced: 1 means the whole step is one graph.
        "unique_graphs": counters["stats"]["unique_graphs"] - graphs,
    }
    return step


def page_faults_per_step(step: Callable[[], None], steps: int = 3) -> float:
    """Minor page faults (first touches of fresh memory pages) per call of ``step``, after one warm-up call."""
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def step_contenders(
    ctx: Context, shapes: dict[str, tuple[int, ...]], rows: Sequence[str]
) -> tuple[list[Contender], list[Skipped]]:
    """The requested ways to take one clip + AdamW step on ``shapes``; they share the params and grads buffers."""
    dev = ctx.device
    torch_params = randn_tree(shapes, dtype=torch.float32, device=dev, seed=0)
    grads = randn_tree(shapes, dtype=torch.float32, device=dev, seed=1, scale=GRAD_SCALE)
    plist = []
    for p, g in zip(torch_params.values(), grads.values()):
        p.requires_grad_(True)
        p.grad = g
        plist.append(p)
    # The functional contenders see the same storage without autograd.
    params = {k: p.detach() for k, p in torch_params.items()}
    tx = ctx.info.setdefault(
        "tx", gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR, weight_decay=WEIGHT_DECAY))
    )
    contenders: list[Contender] = []
    skipped: list[Skipped] = []

    def torch_step(opt: torch.optim.Optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(plist, MAX_NORM, foreach=True)
        opt.step()

    for row in rows:
        if row in (TORCH_FUSED, TORCH_FOREACH):
            kind = {"fused": True} if row == TORCH_FUSED else {"foreach": True}
            opt = torch.optim.AdamW(plist, lr=LR, weight_decay=WEIGHT_DECAY, **kind)
            note = "clip_grad_norm_(foreach) then AdamW(fused=True).step(); the baseline" if row == TORCH_FUSED else ""
            contenders.append(Contender(row, partial(torch_step, opt), note))
        elif row == GTX_WRAPPER:
            wrapper = gtx.TransformedOptimizer(
                torch.optim.AdamW(plist, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
                gtx.chain(gtx.clip_by_global_norm(MAX_NORM)),
            )
            contenders.append(Contender(row, wrapper.step, "clip factor folded into the kernel's grad_scale"))
        elif row == GTX_PURE:
            contenders.append(
                Contender(row, _pure_step(tx, params, grads), "new moments, updates and params every step")
            )
        elif row == GTX_COMPILED:
            if "e" not in ctx.cases:
                skipped.append(Skipped(row, "case e not selected"))
                continue
            box = {"params": params, "state": tx.init(params)}
            step = compiled_step(ctx, box["params"], box["state"], grads)

            def gtx_compiled(box: dict[str, Any] = box, step: Callable[..., Any] = step) -> None:
                box["params"], box["state"] = step(box["params"], box["state"], grads)

            ctx.info["compiled"]["faults"] = page_faults_per_step(gtx_compiled)
            contenders.append(Contender(row, gtx_compiled, "inductor fuses the chain and apply_updates"))
        elif row == GTX_DONATED:
            if "e" not in ctx.cases:
                skipped.append(Skipped(row, "case e not selected"))
                continue
            own = {k: v.clone() for k, v in params.items()}  # its own buffers, written in place
            own_state = tx.init(own)
            donated = compiled_step(ctx, own, own_state, grads, donate=True)
            ctx.info["donated"]["faults"] = page_faults_per_step(partial(donated, own, own_state, grads))
            contenders.append(
                Contender(row, partial(donated, own, own_state, grads), "the results written into the old buffers")
            )
        elif row in (TORCHOPT_PURE, TORCHOPT_INPLACE):
            topt, why = ctx.torchopt()
            if topt is None:
                skipped.append(Skipped(row, why))
                continue
            contenders.append(_torchopt_step(topt, row, params, grads))
        elif row == OPTAX_JIT:
            jo, why = ctx.optax()
            if jo is not None and len(shapes) > 1000 and not ctx.slow_compiles:
                jo = None
                why = (
                    "not run: XLA takes about 6 minutes here to compile the jitted step over 2000 leaves; "
                    "`--slow-compiles` runs it (the compilation is cached on disk after the first run)"
                )
            if jo is None:
                skipped.append(Skipped(row, why))
                continue
            contenders.append(optax_step_contender(jo, params, grads))
    return contenders, skipped


def gradient_sized_allocations(step: Callable[[], None], nbytes: int) -> int:
    """How many buffers of exactly ``nbytes`` (the largest gradient's size) one call of ``step`` allocates.

    Counted from the profiler's memory events of the per-tensor ATen ops (a foreach op reports
    its inner ops' allocations again, so it is left out). On CPU every such allocation of a big
    tensor is a fresh mmap whose pages fault in on first touch: that, not arithmetic, is most
    of a pure step's cost.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(1 for e in prof.events() if e.cpu_memory_usage == nbytes and not e.name.startswith("aten::_foreach"))


def _pure_step(tx: Any, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> Callable[[], None]:
    box = {"params": params, "state": tx.init(params)}

    def run() -> None:
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = gtx.apply_updates(box["params"], updates)

    return run


def _torchopt_step(topt: Any, row: str, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> Contender:
    ttx = topt.chain(topt.clip_grad_norm(MAX_NORM), topt.adamw(LR, weight_decay=WEIGHT_DECAY))
    box = {"params": params, "state": ttx.init(params)}
    if row == TORCHOPT_PURE:

        def run() -> None:
            updates, box["state"] = ttx.update(grads, box["state"], params=box["params"], inplace=False)
            box["params"] = topt.apply_updates(box["params"], updates, inplace=False)

        return Contender(row, run, f"torchopt {peers.version('torchopt')}")

    def run_inplace() -> None:
        updates, box["state"] = ttx.update(grads, box["state"], params=params, inplace=True)
        topt.apply_updates(params, updates, inplace=True)

    return Contender(row, run_inplace, "updates written into the grads")


def optax_step_contender(
    jo: tuple[Any, Any], params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> Contender:
    jax, optax = jo
    otx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WEIGHT_DECAY))
    box = {"params": peers.to_jax(jax, params)}
    box["state"] = otx.init(box["params"])
    jgrads = peers.to_jax(jax, grads)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        updates, s = otx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def run() -> None:
        box["params"], box["state"] = step(box["params"], box["state"], jgrads)
        jax.block_until_ready(box["params"])

    return Contender(
        OPTAX_JIT, run, f"optax {peers.version('optax')}, jax {peers.version('jax')} ({jax.default_backend()})"
    )


def _step_case(
    ctx: Context, key: str, title: str, shapes: dict[str, tuple[int, ...]], rows: Sequence[str], *, reps: int
) -> CaseResult:
    contenders, skipped = step_contenders(ctx, shapes, rows)
    result = CaseResult(key, title)
    result.timings, result.contention = measure(
        contenders, reps=reps, warmup=ctx.warmup, device=ctx.device, log=ctx.log, wait_quiet=ctx.wait_quiet
    )
    result.skipped = skipped
    if key == "b":
        nbytes = max(math.prod(s) for s in shapes.values()) * 4  # fp32
        counts = {
            c.name: gradient_sized_allocations(c.step, nbytes)
            for c in contenders
            if c.name in (TORCH_FUSED, GTX_WRAPPER, GTX_PURE)
        }
        result.notes.append(
            "Gradient-sized allocations per step (buffers the size of the largest gradient, from the profiler): "
            + ", ".join(f"{name}: {n}" for name, n in counts.items())
            + "."
        )
    for row in rows:
        if row != TORCH_FUSED and result.timing(row) is not None:
            result.ratios.append((f"{row} / torch fused", row, TORCH_FUSED))
    for peer in (TORCHOPT_PURE, OPTAX_JIT):
        for ours in FUNCTIONAL:
            if result.timing(peer) is not None and result.timing(ours) is not None:
                result.ratios.append((f"{ours} / {peer}", ours, peer))
    del contenders
    release_memory()
    return result


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the next run starts lean (between runs only)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # not glibc
            pass


def case_b(ctx: Context) -> list[CaseResult]:
    """A full clip + AdamW step on GPT-2-small shapes: gradtx against torch, then against the peers.

    Two runs, so that fewer optimizer states are alive at once (each is 1 GB
    here); both hold the torch baseline and gradtx's functional paths, so
    every ratio is still taken inside one run.
    """
    shapes = gpt2_shapes(**gpt2_config(ctx))
    title = f"GPT-2-small shapes ({describe(shapes)}), fp32"
    ctx.log(f"  case b: {describe(shapes)}")
    main = _step_case(ctx, "b", f"b. Clip + AdamW step, {title}: gradtx and torch", shapes, OURS, reps=ctx.reps)
    ctx.log("  case b, the kernels inside")
    kernels = _kernels_case(ctx, shapes, title)
    ctx.log("  case b, peers")
    others = _step_case(
        ctx, "b-peers", f"b. Clip + AdamW step, {title}: gradtx and the peers", shapes, PEERS, reps=ctx.reps
    )
    return [main, kernels, others]


K_NORM_FOREACH = "torch._foreach_norm (torch's clip: the norm)"
K_NORM_GTX = "gradtx's local norm (gradtx.core.norms.local_norm)"
K_MUL = "torch._foreach_mul_ (torch's clip: the scale)"
K_FUSED = "torch._fused_adamw_ (torch's step)"
K_FUSED_GS = "torch._fused_adamw_ with grad_scale (the wrapper's step)"
K_READ = "one read pass (sum of every tensor)"


def _kernels_case(ctx: Context, shapes: dict[str, tuple[int, ...]], title: str) -> CaseResult:
    """The kernels both steps are made of, timed alone: where the wrapper's time goes."""
    dev = ctx.device
    params = list(randn_tree(shapes, dtype=torch.float32, device=dev, seed=0).values())
    grads = list(randn_tree(shapes, dtype=torch.float32, device=dev, seed=1, scale=GRAD_SCALE).values())
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    steps = [torch.ones((), device=dev)] * len(params)
    one = torch.ones((), device=dev)
    hyper = {"lr": LR, "beta1": 0.9, "beta2": 0.999, "weight_decay": WEIGHT_DECAY, "eps": 1e-8}
    hyper |= {"amsgrad": False, "maximize": False}

    def gtx_norm() -> None:
        norms.local_norm(grads, 2.0)

    contenders = [
        Contender(K_NORM_FOREACH, partial(torch._foreach_norm, grads, 2.0)),
        Contender(K_NORM_GTX, gtx_norm),
        Contender(K_MUL, partial(torch._foreach_mul_, grads, one)),
        Contender(K_FUSED, partial(torch._fused_adamw_, params, grads, exp_avg, exp_avg_sq, [], steps, **hyper)),
        Contender(
            K_FUSED_GS,
            partial(torch._fused_adamw_, params, grads, exp_avg, exp_avg_sq, [], steps, grad_scale=one, **hyper),
            "also stores the unscaled grads back: one more write pass",
        ),
        Contender(K_READ, lambda: [g.sum() for g in grads], "the memory floor of one pass"),
    ]
    result = CaseResult("b-kernels", f"b. The kernels inside the step, {title}")
    result.timings, result.contention = measure(
        contenders, reps=ctx.reps, warmup=ctx.warmup, device=dev, log=ctx.log, wait_quiet=ctx.wait_quiet
    )
    result.ratios = [
        ("grad_scale's write-back: fused with / without grad_scale", K_FUSED_GS, K_FUSED),
        ("gradtx's norm / torch's norm", K_NORM_GTX, K_NORM_FOREACH),
        ("gradtx's norm / one read pass", K_NORM_GTX, K_READ),
    ]
    med = {t.name: t.median * 1e3 for t in result.timings}
    torch_sum = med[K_NORM_FOREACH] + med[K_MUL] + med[K_FUSED]
    wrapper_sum = med[K_NORM_GTX] + med[K_FUSED_GS]
    floor_sum = med[K_NORM_GTX] + med[K_FUSED]
    result.notes.append(
        f"torch's step is foreach_norm + foreach_mul_ + fused_adamw_ = {torch_sum:.1f} ms of kernels; the "
        f"wrapper's is gradtx's norm + fused_adamw_ with grad_scale = {wrapper_sum:.1f} ms "
        f"(ratio {wrapper_sum / torch_sum:.3f}). A kernel that applied grad_scale without storing the grads "
        f"would make it gradtx's norm + fused_adamw_ = {floor_sum:.1f} ms (ratio {floor_sum / torch_sum:.3f}). "
        "The step rows add the optimizers' Python and dispatch around these kernels."
    )
    del contenders
    release_memory()
    return result


def case_c(ctx: Context) -> CaseResult:
    """The same step on ~2000 tensors of 1-4K elements: the per-tensor (Python and launch) overhead regime."""
    shapes = small_shapes(count=200 if ctx.quick else 2000)
    ctx.log(f"  case c: {describe(shapes)}")
    rows = [r for r in OURS if r not in (GTX_COMPILED, GTX_DONATED)] + [
        TORCHOPT_PURE,
        TORCHOPT_INPLACE,
        OPTAX_JIT,
    ]
    # A step here takes milliseconds, so more rounds cost little and steady the medians.
    result = _step_case(
        ctx,
        "c",
        f"c. Clip + AdamW step, many small tensors ({describe(shapes)}), fp32",
        shapes,
        rows,
        reps=3 * ctx.reps,
    )
    result.skipped.append(
        Skipped(GTX_COMPILED, "not run: inductor would compile kernels for every tensor (minutes for 2000 tensors)")
    )
    return result


# glibc's settings for a process whose allocator keeps the memory it frees, as a GPU's caching allocator
# does: no buffer gets an mmap of its own (by default one of 32 MB or more does, unmapped when freed), and
# the heap is never trimmed. jemalloc and tcmalloc, which torch's CPU launcher preloads, behave alike.
KEEP_FREED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**42)}


def e_child(quick: bool, threads: int, reps: int, warmup: int) -> None:
    """Time case b's torch baseline and compiled pure step side by side in this process; print them as JSON.

    Started by :func:`e_freed_memory_kept` with :data:`KEEP_FREED` in its environment.
    """
    torch.set_num_threads(threads)
    ctx = Context(torch.device("cpu"), quick, reps=reps, warmup=warmup, cases="e", peers=False)
    contenders, _ = step_contenders(ctx, gpt2_shapes(**gpt2_config(ctx)), (TORCH_FUSED, GTX_COMPILED))
    timings, contention = measure(contenders, reps=reps, warmup=warmup, device=ctx.device, log=lambda _: None)
    seconds = {t.name: t.seconds for t in timings}
    faults = page_faults_per_step(next(c.step for c in contenders if c.name == GTX_COMPILED))  # after the timing
    print(json.dumps({"seconds": seconds, "contention": contention, "faults": faults}))


def e_freed_memory_kept(ctx: Context) -> dict[str, Any] | None:
    """Case e's pure step against torch's in a fresh process whose allocator keeps freed memory (Linux, glibc)."""
    if ctx.device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    script = Path(__file__).resolve().parent / "run.py"
    cmd = [sys.executable, str(script), "--child-e", "--threads", str(torch.get_num_threads()), "--reps", str(ctx.reps)]
    cmd += ["--quick"] if ctx.quick else []
    env = {**os.environ, **KEEP_FREED}
    ctx.log("  case e, in a process whose allocator keeps freed memory")
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def case_e(ctx: Context, b: CaseResult | None) -> CaseResult:
    """The compiled functional step: no graph breaks, and its ratios from case b's run."""
    result = CaseResult("e", "e. torch.compile of a gradtx functional step (GPT-2-small shapes)")
    info = ctx.info.get("compiled", {})
    if b is None or "compile_seconds" not in info:
        result.notes.append("not run (case b was not run with case e selected)")
        return result
    for name in (GTX_COMPILED, GTX_DONATED, GTX_PURE, TORCH_FUSED):
        t = b.timing(name)
        if t is not None:
            result.timings.append(t)
    result.contention = b.contention
    result.ratios = [
        (f"{GTX_COMPILED} / torch fused", GTX_COMPILED, TORCH_FUSED),
        (f"{GTX_DONATED} / torch fused", GTX_DONATED, TORCH_FUSED),
        (f"{GTX_COMPILED} / eager pure", GTX_COMPILED, GTX_PURE),
    ]
    result.notes.append(
        f"step = `update_and_apply(chain(clip_by_global_norm, adamw), grads, state, params)` (pure) over a params dict, "
        f"compiled as a user writes it (torch.compile(step), no fullgraph): graph breaks {info['graph_breaks']}, graphs {info['unique_graphs']}, "
        f"compile time {info['compile_seconds']:.1f} s (inductor's on-disk cache makes later runs faster). "
        "The timings are the case-b rows, measured side by side in that run."
    )
    kept = e_freed_memory_kept(ctx)
    if kept is not None:
        seconds = kept["seconds"]
        result.timings += [
            Timing(GTX_COMPILED_KEPT, seconds[GTX_COMPILED]),
            Timing(TORCH_FUSED_KEPT, seconds[TORCH_FUSED]),
        ]
        result.ratios.append((f"{GTX_COMPILED_KEPT} / its torch fused", GTX_COMPILED_KEPT, TORCH_FUSED_KEPT))
        settings = " ".join(f"{k}={v}" for k, v in KEEP_FREED.items())
        result.notes.append(
            f"The two *freed memory kept* rows ran side by side in a fresh process started with `{settings}`: "
            "glibc then gives no buffer an mmap of its own and never trims its heap, so the pure step's new buffers "
            f"reuse the pages of last step's ({kept['faults']:,.0f} minor page faults per step there)."
        )
        if kept["contention"] is not None:
            result.notes[-1] += f" Other processes used {kept['contention']:.0%} of the CPUs while they were timed."
    donated = ctx.info.get("donated", {})
    if "faults" in donated:
        result.notes.append(
            f"Minor page faults per step: {info['faults']:,.0f} for the pure step, whose fresh result buffers the "
            f"kernel maps and zeroes on first touch, and {donated['faults']:,.0f} for the donated one "
            f"(graph breaks {donated['graph_breaks']}), which writes into the old buffers as "
            "`jax.jit(donate_argnums=...)` lets XLA do; torch's in-place step takes none. See docs/functional.md."
        )
    return result


# --- d: accumulation ---------------------------------------------------------------------------


class TinyLM(nn.Module):
    """A small causal transformer LM: the forward and backward that accumulation wraps."""

    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.norm(self.blocks(x, mask=self.mask, is_causal=True)))


D_K = 8


def d_config(quick: bool) -> dict[str, int]:
    if quick:
        return {"vocab": 64, "d_model": 32, "n_layer": 1, "n_head": 2, "seq": 16, "batch": 2}
    return {"vocab": 512, "d_model": 256, "n_layer": 4, "n_head": 4, "seq": 64, "batch": 4}


def d_setup(name: str, quick: bool, device: torch.device) -> Callable[[], None]:
    """One contender of case d: a model, its data and a function taking one optimizer step (k micro-steps)."""
    cfg = d_config(quick)
    torch.manual_seed(0)
    model = TinyLM(cfg["vocab"], cfg["d_model"], cfg["n_layer"], cfg["n_head"], cfg["seq"]).to(device)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg["vocab"], (D_K, cfg["batch"], cfg["seq"] + 1), generator=gen).to(device)
    micro = [(data[i, :, :-1], data[i, :, 1:]) for i in range(D_K)]

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    if name == D_TORCH:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def step() -> None:
            for x, y in micro:
                (loss_of(x, y) / D_K).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    wrapped = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
        gtx.chain(gtx.accumulate(D_K), gtx.clip_by_global_norm(MAX_NORM)),
    )

    def gtx_step() -> None:
        for x, y in micro:
            loss_of(x, y).backward()  # accumulate() takes the mean of the window; autograd's .grad is the sum
            wrapped.step()
            wrapped.zero_grad()

    return gtx_step


def d_child(name: str, quick: bool, threads: int, steps: int = 3) -> None:
    """Run ``steps`` optimizer steps of one case-d contender in this (fresh) process and print its peak RSS."""
    torch.set_num_threads(threads)
    step = d_setup(name, quick, torch.device("cpu"))
    for _ in range(steps):
        step()
    print(json.dumps({"maxrss_bytes": peak_rss_bytes()}))


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    Linux's ``ru_maxrss`` survives ``exec``: a child started from a big parent
    reports the parent's peak. ``VmHWM`` belongs to the process's own address
    space, so it starts afresh at ``exec``; ``ru_maxrss`` is the fallback elsewhere.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def d_peak_memory(ctx: Context, names: list[str], reps: int) -> dict[str, list[float]]:
    """Peak memory of each contender: RSS of a fresh process on CPU, ``max_memory_allocated`` on CUDA."""
    out: dict[str, list[float]] = {n: [] for n in names}
    if ctx.device.type == "cuda":
        for _ in range(reps):
            for name in names:
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(ctx.device)
                before = torch.cuda.memory_allocated(ctx.device)
                step = d_setup(name, ctx.quick, ctx.device)
                for _ in range(2):
                    step()
                ctx.sync()
                out[name].append(float(torch.cuda.max_memory_allocated(ctx.device) - before))
                del step
        return out
    script = Path(__file__).resolve().parent / "run.py"
    for _ in range(reps):
        for name in names:
            cmd = [sys.executable, str(script), "--child-d", name, "--threads", str(torch.get_num_threads())]
            cmd += ["--quick"] if ctx.quick else []
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            out[name].append(float(json.loads(done.stdout.strip().splitlines()[-1])["maxrss_bytes"]))
    return out


def case_d(ctx: Context) -> CaseResult:
    """Accumulation, k=8, on a small transformer: the wrapper against a plain torch loop."""
    cfg = d_config(ctx.quick)
    desc = (
        f"{cfg['n_layer']} layers, d_model {cfg['d_model']}, vocab {cfg['vocab']}, "
        f"{cfg['batch']}x{cfg['seq']} tokens per micro-batch"
    )
    ctx.log(f"  case d: {desc}")
    names = [D_TORCH, D_GTX]
    contenders = [Contender(n, d_setup(n, ctx.quick, ctx.device)) for n in names]
    contenders[0].note = "the baseline"
    contenders[1].note = "autograd's .grad is the accumulator; 1/k and the clip ride in grad_scale"
    result = CaseResult("d", f"d. Accumulation, k={D_K}, small transformer ({desc}): time per optimizer step")
    reps = ctx.reps if ctx.quick else 2 * ctx.reps
    result.timings, result.contention = measure(
        contenders, reps=reps, warmup=ctx.warmup, device=ctx.device, log=ctx.log, wait_quiet=ctx.wait_quiet
    )
    result.ratios = [(f"{D_GTX} / torch loop", D_GTX, D_TORCH)]
    del contenders
    gc.collect()
    ctx.log("    peak memory ...")
    result.memory = d_peak_memory(ctx, names, reps=1 if ctx.quick else 3)
    result.memory_kind = (
        "torch.cuda.max_memory_allocated over 2 optimizer steps"
        if ctx.device.type == "cuda"
        else "peak RSS (VmHWM) of a fresh process per contender, 3 optimizer steps each; contenders alternate"
    )
    return result


# --- f. per-example clipping ------------------------------------------------------------------

F_VMAP = "gradtx: vmap(grad) + vmap(clip_by_global_norm.update), summed"
F_PER_EXAMPLE = "gradtx: vmap(grad) + per_example_global_norm_clip"
F_LOOP = "Python loop: grad + clip_by_global_norm per example, summed"
F_OPACUS = "opacus GradSampleModule + DPOptimizer.clip_and_accumulate"
F_BATCH, F_CLIP = 64, 1.0


def case_g(ctx: Context) -> CaseResult:
    """Per-example clipping (DP-SGD's aggregation, no noise) of a small MLP's grads, batch of 64."""
    dev = ctx.device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(dev)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(F_BATCH, 32, device=dev), torch.randint(0, 10, (F_BATCH,), device=dev)

    def example_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    per_example_grads = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))
    clip = gtx.clip_by_global_norm(F_CLIP)
    clip_state = clip.init(params)
    clip_each = torch.func.vmap(lambda g: clip.update(g, clip_state)[0])
    out: dict[str, dict[str, torch.Tensor]] = {}

    def gtx_vmap() -> None:
        out[F_VMAP] = {k: v.sum(0) for k, v in clip_each(per_example_grads(params, x, y)).items()}

    def gtx_per_example() -> None:
        out[F_PER_EXAMPLE] = gtx.per_example_global_norm_clip(per_example_grads(params, x, y), F_CLIP)[0]

    one_grad = torch.func.grad(example_loss)

    def loop() -> None:
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        for i in range(F_BATCH):
            clipped, _ = clip.update(one_grad(params, x[i], y[i]), clip_state)
            total = {k: total[k] + clipped[k] for k in total}
        out[F_LOOP] = total

    contenders = [
        Contender(F_VMAP, gtx_vmap, "per-example grads and clip both batched by torch.func.vmap"),
        Contender(F_PER_EXAMPLE, gtx_per_example, "optax's name: clip factors then one tensordot per leaf"),
        Contender(F_LOOP, loop, f"{F_BATCH} grad and clip calls"),
    ]
    result = CaseResult("g", f"g. Per-example clipping: MLP 32-64-64-10, batch {F_BATCH}, clip {F_CLIP}, fp32")
    try:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
    except ImportError as e:  # opacus is in the bench extra; say why it is missing
        result.skipped.append(Skipped(F_OPACUS, f"opacus not importable ({type(e).__name__}: {e})"))
    else:
        gsm = GradSampleModule(copy_module(model), loss_reduction="sum")
        dp = DPOptimizer(
            torch.optim.SGD(gsm.parameters(), lr=0.0),
            noise_multiplier=0.0,
            max_grad_norm=F_CLIP,
            expected_batch_size=F_BATCH,
        )

        def opacus_step() -> None:
            dp.zero_grad(set_to_none=True)
            F.cross_entropy(gsm(x), y, reduction="sum").backward()
            dp.clip_and_accumulate()
            out[F_OPACUS] = {k.removeprefix("_module."): p.summed_grad for k, p in gsm.named_parameters()}

        contenders.append(Contender(F_OPACUS, opacus_step, "per-sample grads from backward hooks, then clip + sum"))
    # Every contender computes the same clipped sum (the 1e-6 in the coefficients aside).
    for c in contenders:
        c.step()
    for name, got in out.items():
        for k, v in got.items():
            torch.testing.assert_close(v, out[F_LOOP][k], rtol=1e-3, atol=1e-5, msg=f"{name} differs at {k}")
    result.timings, result.contention = measure(
        contenders, reps=3 * ctx.reps, warmup=ctx.warmup, device=dev, log=ctx.log, wait_quiet=ctx.wait_quiet
    )
    result.ratios = [
        ("vmap / Python loop", F_VMAP, F_LOOP),
        ("per_example_global_norm_clip / Python loop", F_PER_EXAMPLE, F_LOOP),
    ]
    if any(c.name == F_OPACUS for c in contenders):
        result.ratios += [
            ("vmap / opacus", F_VMAP, F_OPACUS),
            ("per_example_global_norm_clip / opacus", F_PER_EXAMPLE, F_OPACUS),
        ]
    return result


def copy_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)
