"""benchmarks/overhead.py runs, checks its pairs agree, and replaces its section of a file, keeping the rest.

A smoke run: it checks the script, not timings (those live in docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.overhead import BEGIN, END
from tests.fork_server import run_script

REPO = Path(__file__).resolve().parent.parent


def test_overhead_quick_runs_and_replaces_only_its_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nan old table\n{END}\n\nafter\n")
    code, stdout, stderr = run_script(
        [str(REPO / "benchmarks" / "overhead.py"), "--quick", "--device", "cpu", "--out", str(out)], timeout=60
    )
    assert code == 0, stderr[-3000:]
    md = out.read_text()
    assert md.startswith(f"# Benchmarks\n\nbefore\n\n{BEGIN}\n## Host work per step (benchmarks/overhead.py)\n")
    assert md.endswith(f"{END}\n\nafter\n") and "an old table" not in md
    for case in ("a. wrapper", "b. functional eager", "c. global norm"):
        assert f"| {case}" in md and f"| {case}" in stdout
    assert "| torch clip + AdamW(fused) | gradtx wrapper |" in md  # d: the cProfile call counts
