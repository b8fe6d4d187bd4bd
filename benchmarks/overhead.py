"""Host work of one optimizer step: gradtx against torch on many tiny tensors, one thread, side by side.

Usage::

    python benchmarks/overhead.py                          # 148 and 1,000 tensors; CPU, and CUDA when present
    python benchmarks/overhead.py --out docs/benchmarks.md  # also write this table's section into that file
    python benchmarks/overhead.py --quick                  # a smoke run: few rounds, small blocks

Every tensor has 256 fp32 elements, so the kernels cost next to nothing and what is timed is
the Python and dispatch around them: the regime a GPU step at GPT-2 size lives in, where the
host has to queue the kernels faster than the device runs them. The cases (issue 27's targets):

* **a.** The wrapper, ``gtx.TransformedOptimizer(AdamW(fused=True), clip_by_global_norm(1.0)).step()``,
  against ``clip_grad_norm_(params, 1.0)`` + ``AdamW(fused=True).step()``.
* **b.** The eager functional step, ``chain(clip_by_global_norm(1.0), adamw(1e-3))``'s ``update`` then
  ``apply_updates`` over a dict, against ``clip_grad_norm_`` + ``AdamW(foreach=True).step()``.
* **c.** ``gtx.global_norm(grads)`` against ``get_total_norm(grads, foreach=True)``.
* **d.** Python calls in one wrapper step, counted with ``cProfile`` after warm-up, against torch's
  clip + fused AdamW step.

Method: the two contenders of a case run in one process on one thread
(``torch.set_num_threads(1)``), in rounds: each round times one block of steps of each, the
order alternating between rounds (A B, B A, ...), after untimed warm-up blocks. A block's time
over its steps is one sample; the table gives the medians and their ratio, and the median of the
per-round ratios (steadier under drift). On CUDA each block ends with ``torch.cuda.synchronize``.
Grads are set once (``p.grad = g``) and not changed between steps: a step's host work does not
depend on their values, and they are small enough (total norm 0.5) that no clip rescales them.
Before timing, each pair is checked to compute the same numbers from the same start.

Only public gradtx API is used, so the script keeps measuring while the internals change.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `gradtx` importable from this checkout
    sys.path.insert(0, str(REPO))

import torch

import gradtx as gtx

NUMEL = 256
LR = 1e-3
MAX_NORM = 1.0
SECTION = "Host work per step (benchmarks/overhead.py)"
BEGIN = "<!-- begin: benchmarks/overhead.py (generated; rerun the script to replace this section) -->"
END = "<!-- end: benchmarks/overhead.py -->"
TARGETS = {"a": 0.8, "b": 1.0, "c": 1.0}  # gradtx / torch, at most (issue 27)


@dataclass
class Pair:
    """One case on one model: torch's way and gradtx's way of doing the same step."""

    case: str
    what: str
    torch_name: str
    gtx_name: str
    torch_step: Callable[[], object]
    gtx_step: Callable[[], object]


@dataclass
class Row:
    """One timed pair: medians per step in µs, and the median of the per-round ratios gradtx / torch."""

    case: str
    what: str
    torch_name: str
    gtx_name: str
    n: int
    device: str
    torch_us: float
    gtx_us: float
    paired: float
    steps: int
    rounds: int

    @property
    def ratio(self) -> float:
        return self.gtx_us / self.torch_us


# --- the models ----------------------------------------------------------------------------------


def _tensors(n: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g).to(device) for _ in range(n)]


def _grads(n: int, device: torch.device) -> list[torch.Tensor]:
    # Total norm 0.5: under max_norm, so neither clip rescales them (no drift over thousands of steps),
    # and the work done is the same as when it does (neither side branches on the value).
    gs = _tensors(n, device, seed=1)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in gs]))
    return [t * (0.5 / total) for t in gs]


def _params_with_grads(n: int, device: torch.device) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(t) for t in _tensors(n, device, seed=0)]
    for p, g in zip(params, _grads(n, device)):
        p.grad = g
    return params


def _check(torch_params: list[torch.Tensor], gtx_params: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(torch_params, gtx_params)):
        torch.testing.assert_close(
            b.detach(), a.detach(), rtol=1e-5, atol=1e-7, msg=lambda m, i=i: f"{what}, tensor {i}: {m}"
        )


# --- the cases -----------------------------------------------------------------------------------


def wrapper_pair(n: int, device: torch.device) -> tuple[Pair, Callable[[], None], Callable[[], None]]:
    """Case a; also returns one torch step and one wrapper step for the call counts of case d."""
    tp = _params_with_grads(n, device)
    topt = torch.optim.AdamW(tp, lr=LR, fused=True)

    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(tp, MAX_NORM)
        topt.step()

    gp = _params_with_grads(n, device)
    gopt = gtx.TransformedOptimizer(torch.optim.AdamW(gp, lr=LR, fused=True), gtx.clip_by_global_norm(MAX_NORM))

    def gtx_step() -> None:
        gopt.step()

    torch_step()
    gtx_step()
    _check(tp, gp, "case a after one step")
    pair = Pair(
        "a",
        "wrapper: clip + AdamW(fused=True)",
        "clip_grad_norm_ + AdamW(fused).step()",
        "TransformedOptimizer(AdamW(fused), clip).step()",
        torch_step,
        gtx_step,
    )
    return pair, torch_step, gtx_step


def functional_pair(n: int, device: torch.device) -> Pair:
    tp = _params_with_grads(n, device)
    topt = torch.optim.AdamW(tp, lr=LR, foreach=True)

    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(tp, MAX_NORM)
        topt.step()

    # The same start as torch's, and torch's default weight decay, so the check compares like with like.
    tx = gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.adamw(LR, weight_decay=0.01))
    box: dict[str, object] = {"params": {f"p{i}": t for i, t in enumerate(_tensors(n, device, seed=0))}}
    grads = {f"p{i}": g for i, g in enumerate(_grads(n, device))}
    box["state"] = tx.init(box["params"])

    def gtx_step() -> None:
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = gtx.apply_updates(box["params"], updates)

    torch_step()
    gtx_step()
    _check(tp, list(box["params"].values()), "case b after one step")  # type: ignore[union-attr]
    return Pair(
        "b",
        "functional eager: clip + adamw",
        "clip_grad_norm_ + AdamW(foreach).step()",
        "chain(clip, adamw).update + apply_updates",
        torch_step,
        gtx_step,
    )


def norm_pair(n: int, device: torch.device) -> Pair:
    grads = _grads(n, device)
    out: dict[str, torch.Tensor] = {}

    def torch_step() -> None:
        out["torch"] = torch.nn.utils.get_total_norm(grads, foreach=True)

    def gtx_step() -> None:
        out["gtx"] = gtx.global_norm(grads)

    torch_step()
    gtx_step()
    torch.testing.assert_close(out["gtx"], out["torch"], rtol=1e-5, atol=0)
    return Pair("c", "global norm", "get_total_norm(foreach=True)", "gtx.global_norm", torch_step, gtx_step)


# --- timing --------------------------------------------------------------------------------------


def _block(step: Callable[[], object], steps: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def time_pair(pair: Pair, *, n: int, device: torch.device, rounds: int, warmup: int, block_s: float) -> Row:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        _block(pair.torch_step, 5, sync)
        _block(pair.gtx_step, 5, sync)
    # Steps per block: about block_s seconds of the slower contender, at least 5.
    per_step = max(_block(pair.torch_step, 5, sync), _block(pair.gtx_step, 5, sync))
    steps = max(5, int(block_s / per_step))
    ts: list[float] = []
    gs: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection landing inside one block would be charged to that contender alone
    try:
        for r in range(rounds):
            if r % 2 == 0:
                ts.append(_block(pair.torch_step, steps, sync))
                gs.append(_block(pair.gtx_step, steps, sync))
            else:
                gs.append(_block(pair.gtx_step, steps, sync))
                ts.append(_block(pair.torch_step, steps, sync))
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return Row(
        case=pair.case,
        what=pair.what,
        torch_name=pair.torch_name,
        gtx_name=pair.gtx_name,
        n=n,
        device=device.type,
        torch_us=statistics.median(ts) * 1e6,
        gtx_us=statistics.median(gs) * 1e6,
        paired=statistics.median(g / t for g, t in zip(gs, ts)),
        steps=steps,
        rounds=rounds,
    )


@dataclass
class Calls:
    """What cProfile saw in one call of a step."""

    total: int  # every call, C builtins included
    python: int  # calls of Python functions only
    gtx_functions: int  # distinct named functions of gradtx's package entered (comprehensions left out)
    gtx_modules: int  # distinct gradtx modules those live in


def count_calls(step: Callable[[], object]) -> Calls:
    """Profile one call of ``step`` and count what it called."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    package = str(Path(gtx.__file__).resolve().parent)
    ours = {(file, line, name) for file, line, name in stats if str(Path(file).resolve()).startswith(package)}
    return Calls(
        # The profiler's own disable() call is recorded too; leave it out.
        total=sum(nc for _, nc, *_ in stats.values()) - 1,
        python=sum(nc for (file, _, _), (_, nc, *_) in stats.items() if file != "~"),
        gtx_functions=sum(not name.startswith("<") for _, _, name in ours),
        gtx_modules=len({file for file, _, _ in ours}),
    )


# --- report --------------------------------------------------------------------------------------


def _verdict(value: float, limit: float) -> str:
    return "met" if value <= limit else "not met"


def markdown(rows: list[Row], calls: list[tuple[int, str, Calls, Calls]], meta: dict[str, str]) -> str:
    lines = [
        f"## {SECTION}",
        "",
        (
            f"{meta['machine']}; {meta['torch']}; one thread (`torch.set_num_threads(1)`); load average "
            f"{meta['load_before']} before and {meta['load_after']} after (the machine is shared: read the ratios, "
            f"not the absolute times). Command: `{meta['command']}`."
        ),
        "",
        (
            f"Models of {meta['sizes']} fp32 tensors of {NUMEL} elements, grads set once. Each row times the two "
            "contenders side by side in one process, in alternating blocks of steps; µs are medians per step over "
            "the rounds, *ratio* is gradtx's median over torch's, *paired* the median of the per-round ratios; "
            "a target is met when both are within it."
        ),
        "",
        "| case | tensors | device | torch | torch µs/step | gradtx | gradtx µs/step | ratio | paired | target | verdict |",
        "|---|---:|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        limit = TARGETS[r.case]
        lines.append(
            f"| {r.case}. {r.what} | {r.n:,} | {r.device} | `{r.torch_name}` | {r.torch_us:,.1f} | `{r.gtx_name}` | "
            f"{r.gtx_us:,.1f} | "
            f"{r.ratio:.2f} | {r.paired:.2f} | <= {limit:.1f} | {_verdict(max(r.ratio, r.paired), limit)} |"
        )
    if calls:
        lines += [
            "",
            (
                "d. Python calls in one step after warm-up, counted with `cProfile` (all calls, C builtins "
                "included; in brackets, calls of Python functions only). Target: the wrapper's below torch's. "
                "The last column counts the distinct gradtx functions (comprehensions left out) and modules "
                "the wrapper step entered."
            ),
            "",
            "| tensors | device | torch clip + AdamW(fused) | gradtx wrapper | ratio | verdict | gradtx functions / modules |",
            "|---:|---|---:|---:|---:|---|---:|",
        ]
        for n, dev, t, g in calls:
            verdict = "met" if g.total < t.total else "not met"
            lines.append(
                f"| {n:,} | {dev} | {t.total:,} ({t.python:,}) | {g.total:,} ({g.python:,}) | "
                f"{g.total / t.total:.2f} | {verdict} | {g.gtx_functions} / {g.gtx_modules} |"
            )
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Put ``section`` between this script's markers in ``path``, replacing what was there; the rest stays."""
    block = f"{BEGIN}\n{section}{END}"
    text = path.read_text() if path.exists() else ""
    start, end = text.find(BEGIN), text.find(END)
    if start >= 0 and end > start:
        text = text[:start] + block + text[end + len(END) :]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block + "\n"
    path.write_text(text)


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _load() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", help="numbers of tensors, comma-separated (default 148,1000; 16 with --quick)")
    ap.add_argument("--cases", default="abcd", help="which cases to run (default abcd)")
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all", help="all: CPU, and CUDA when present")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds per row (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed blocks of 5 steps per contender first")
    ap.add_argument("--block-ms", type=float, default=50.0, help="length of one timed block, in ms (default 50)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 tensors, 3 rounds of short blocks")
    ap.add_argument("--out", type=Path, help="write the table as a section of this markdown file, keeping the rest")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.block_ms = 3, 1, 1.0
    torch.set_num_threads(1)
    sizes = [int(s) for s in (args.sizes or ("16" if args.quick else "148,1000")).split(",")]
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    if not devices:
        print("no device to run on (--device cuda without CUDA)", file=sys.stderr)
        return 2
    meta = {
        "machine": _machine() + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "torch": f"torch {torch.__version__}, Python {platform.python_version()}",
        "load_before": _load(),
        "sizes": " and ".join(f"{n:,}" for n in sizes),
        "command": " ".join(["python benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    rows: list[Row] = []
    calls: list[tuple[int, str, Calls, Calls]] = []
    for device in devices:
        for n in sizes:
            pairs: list[Pair] = []
            wrapper, t_step, g_step = wrapper_pair(n, device)
            if "a" in args.cases:
                pairs.append(wrapper)
            if "b" in args.cases:
                pairs.append(functional_pair(n, device))
            if "c" in args.cases:
                pairs.append(norm_pair(n, device))
            for pair in pairs:
                row = time_pair(
                    pair, n=n, device=device, rounds=args.rounds, warmup=args.warmup, block_s=args.block_ms / 1e3
                )
                rows.append(row)
                print(
                    f"{row.case} n={n} {device.type}: torch {row.torch_us:.1f} us, gradtx {row.gtx_us:.1f} us, "
                    f"ratio {row.ratio:.3f} (paired {row.paired:.3f}; {row.rounds} rounds of {row.steps} steps)",
                    file=sys.stderr,
                )
            if "d" in args.cases:
                for _ in range(3):  # warm-up: lazy state, caches keyed on the structure
                    t_step()
                    g_step()
                calls.append((n, device.type, count_calls(t_step), count_calls(g_step)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    meta["load_after"] = _load()
    text = markdown(rows, calls, meta)
    print(text)
    if args.out is not None:
        write_section(args.out, text)
        print(f"wrote the section to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
