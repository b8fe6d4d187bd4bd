"""Run the benchmarks of issue 4 side by side and write ``docs/benchmarks.md`` and its chart.

Usage::

    .venv/bin/python benchmarks/run.py                    # every case, ~10 minutes on 2 CPU cores
    .venv/bin/python benchmarks/run.py --quick --out-dir /tmp/bench   # a smoke run on tiny shapes
    .venv/bin/python benchmarks/run.py --cases ab         # some cases only

Peers (torchopt, optax) come from the ``bench`` extra; a missing one is shown
as a skipped row. On a machine with CUDA the same cases run on the GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `gradtx` and `benchmarks` importable
    sys.path.insert(0, str(REPO))

import torch

from benchmarks import cases, peers, simulated
from benchmarks.harness import CaseResult
from benchmarks.report import MISSED_NOTES, Target, write_chart, write_markdown


def machine(load_before: float | None = None) -> dict[str, str]:
    """What the numbers were measured on, and how busy the machine was (other processes share its cores)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "cpu": f"{cpu}, {torch.get_num_threads()} torch threads",
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "optree": peers.version("optree") or "?",
        "torchopt": peers.version("torchopt") or "not installed",
        "jax / optax": f"{peers.version('jax') or 'not installed'} / {peers.version('optax') or 'not installed'}",
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    if load_before is not None and hasattr(os, "getloadavg"):
        info["load average (1 min), start / end"] = (
            f"{load_before:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
        )
    return info


def targets(results: dict[str, CaseResult], compiled: dict[str, Any]) -> list[Target]:
    """The issue's targets, each checked on a ratio of medians from one side-by-side run."""
    a, b, bp, c, d, f = (results.get(k) for k in ("a-float32", "b", "b-peers", "c", "d", "f"))

    def ratio(res: CaseResult | None, num: str | None, den: str) -> float | None:
        return None if res is None or num is None else res.ratio(num, den)

    best = None
    if b is not None and bp is not None:  # the best of the functional paths the peers run also timed
        functional = [n for n in cases.FUNCTIONAL if b.timing(n) is not None and bp.timing(n) is not None]
        best = min(functional, key=lambda n: b.timing(n).median) if functional else None  # type: ignore[union-attr]
    path = f" ({best.split(': ', 1)[-1]})" if best else ""
    mem = None
    if d is not None and d.memory:
        mem = statistics.median(d.memory[cases.D_GTX]) / statistics.median(d.memory[cases.D_TORCH])
    breaks = compiled.get("graph_breaks")
    return [
        Target("a", "a: clip alone, fp32: gradtx (pure) / torch foreach (in place)", "<= 1.0",
               ratio(a, cases.GTX_CLIP_PURE, cases.TORCH_CLIP), 1.0),
        Target("b-wrapper", "b: wrapper / torch clip + AdamW(fused)", "<= 0.80",
               ratio(b, cases.GTX_WRAPPER, cases.TORCH_FUSED), 0.80),
        Target("b-pure", "b: pure eager functional step / torch clip + AdamW(fused)", "<= 3.5",
               ratio(b, cases.GTX_PURE, cases.TORCH_FUSED), 3.5),
        Target("b-torchopt", f"b: best functional path{path} / torchopt pure chain", "<= 0.2 (>= 5x faster)",
               ratio(bp, best, cases.TORCHOPT_PURE), 0.2),
        Target("b-optax", f"b: best functional path{path} / optax jit", "<= 0.5",
               ratio(bp, best, cases.OPTAX_JIT), 0.5),
        Target("c", "c: wrapper / torch clip + AdamW(fused), many small tensors", "<= 1.0",
               ratio(c, cases.GTX_WRAPPER, cases.TORCH_FUSED), 1.0),
        Target("d-time", "d: accumulation, time: wrapper / torch loop", "<= 1.02",
               ratio(d, cases.D_GTX, cases.D_TORCH), 1.02),
        Target("d-memory", "d: accumulation, peak memory: wrapper / torch loop", "<= 1.02", mem, 1.02),
        # A graph break fails the target whatever the time; with none, the time decides.
        Target("e", f"e: compiled pure step (graph breaks = {breaks}) / torch clip + AdamW(fused)",
               "<= 1.0 and 0 breaks", ratio(b, cases.GTX_COMPILED, cases.TORCH_FUSED) if breaks is not None else None,
               1.0 if breaks == 0 else None, passed=False if breaks not in (0, None) else None),
        Target("e-kept", "e: the same step, in a process whose allocator keeps freed memory (see case e)",
               "<= 1.0", ratio(results.get("e"), cases.GTX_COMPILED_KEPT, cases.TORCH_FUSED_KEPT), 1.0),
        Target("f", "f: assert_matches_single_device, simulated 2x2 mesh / 4 gloo processes", "<= 0.2",
               ratio(f, simulated.F_SIM, simulated.F_GLOO), 0.2),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions: a smoke run")
    parser.add_argument("--cases", default="abcdefg", help="which cases to run, e.g. 'ab' (default: abcdefg)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "docs", help="where benchmarks.md and the PNG go")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per case (default 15, quick 3)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--no-peers", action="store_true", help="leave torchopt and optax out (rows say so)")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        help="before each case, wait up to this many seconds for other processes to leave the CPUs "
        "(default 600, quick 0)",
    )
    parser.add_argument(
        "--slow-compiles", action="store_true", help="also jit optax over case c's 2000 leaves (~6 min of XLA compile)"
    )
    parser.add_argument("--child-d", default=None, help=argparse.SUPPRESS)  # one case-d memory run
    parser.add_argument("--child-e", action="store_true", help=argparse.SUPPRESS)  # case e, freed memory kept
    args = parser.parse_args(argv)

    if args.child_e:
        cases.e_child(args.quick, args.threads, args.reps or (3 if args.quick else 15), 1 if args.quick else 2)
        return 0
    if args.child_d is not None:
        cases.d_child(args.child_d, args.quick, args.threads)
        return 0
    unknown = set(args.cases) - set("abcdefg")
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from a, b, c, d, e, f")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reps = args.reps or (3 if args.quick else 15)
    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {line}", flush=True)

    ctx = cases.Context(
        device,
        args.quick,
        log=log,
        reps=reps,
        warmup=1 if args.quick else 2,
        cases=args.cases,
        peers=not args.no_peers,
        slow_compiles=args.slow_compiles,
        wait_quiet=args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 600.0),
    )
    command = "benchmarks/run.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"gradtx benchmarks on {device} ({'quick' if args.quick else 'full'}), cases {args.cases}", flush=True)

    t0 = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results: dict[str, CaseResult] = {}
    if "a" in args.cases:
        for r in cases.case_a(ctx):
            results[r.key] = r
        cases.release_memory()
    if "b" in args.cases or "e" in args.cases:
        for r in cases.case_b(ctx):
            results[r.key] = r
        cases.release_memory()
    if "c" in args.cases:
        results["c"] = cases.case_c(ctx)
    if "d" in args.cases:
        results["d"] = cases.case_d(ctx)
    if "e" in args.cases:
        results["e"] = cases.case_e(ctx, results.get("b"))
    if "f" in args.cases:
        results["f"] = simulated.case_f(ctx)
    if "g" in args.cases:
        results["g"] = cases.case_g(ctx)
    elapsed = time.perf_counter() - t0

    args.out_dir.mkdir(parents=True, exist_ok=True)
    chart = args.out_dir / "benchmarks.png"
    write_chart(list(results.values()), chart)
    md = write_markdown(
        list(results.values()),
        targets(results, ctx.info.get("compiled", {})),
        out=args.out_dir / "benchmarks.md",
        chart=chart.name,
        machine=machine(load_before),
        command=f".venv/bin/python {command.strip()}",
        device=str(device),
        quick=args.quick,
        elapsed=elapsed,
        reps=reps,
        missed_notes=MISSED_NOTES,
    )
    print(md)
    print(f"wrote {args.out_dir / 'benchmarks.md'} and {chart} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
