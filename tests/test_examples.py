"""The examples run as scripts, exit 0, and train; and the user guide's code blocks run as written."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fork_server import run_script

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# The examples' last line: "initial_loss=1.534783 final_loss=0.377835".
LOSSES = re.compile(r"^initial_loss=(\S+) final_loss=(\S+)$", re.MULTILINE)


def run_example(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` from the repo root; it must exit 0.

    The script runs in a process forked from tests/fork_server.py, which imported torch and gradtx
    once for all the examples (an import costs seconds, an example's run about as much).
    """
    code, stdout, stderr = run_script([str(script), *args], timeout)
    assert code == 0, f"{script.name} exited {code}:\n{stdout}\n{stderr}"
    return subprocess.CompletedProcess([sys.executable, str(script), *args], code, stdout, stderr)


@pytest.mark.parametrize("name", ["functional_step.py", "wrap_torch_optimizer.py", "lookahead_and_ema.py", "dp_sgd.py"])
def test_example_runs_and_loss_falls(name):
    out = run_example(EXAMPLES / name).stdout
    found = LOSSES.findall(out)
    assert found, f"{name} printed no 'initial_loss=... final_loss=...' line:\n{out}"
    initial, final = (float(v) for v in found[-1])
    assert final < initial, f"{name}: final loss {final} is not below initial loss {initial}"
    if name == "wrap_torch_optimizer.py":  # the script also exits 1 if the resumed run differs
        assert "max |param diff| = 0.0e+00" in out, out


def test_torchtitan_example_resumes_exactly():
    pytest.importorskip("torchtitan")
    out = run_example(EXAMPLES / "torchtitan_gradtx.py").stdout  # exits 1 if the resumed run differs
    assert "max |resumed - uninterrupted| = 0" in out, out


def test_torchtitan_trainer_example_builds_through_the_override_and_trains():
    pytest.importorskip("torchtitan")
    out = run_example(EXAMPLES / "torchtitan_trainer.py").stdout
    norms = re.findall(r"torchtitan grad_norm (\S+) gradtx grad_norm (\S+)$", out, re.MULTILINE)
    assert norms and all(titan == ours for titan, ours in norms), out  # torchtitan's clip at inf: the same norm
    initial, final = (float(v) for v in LOSSES.findall(out)[-1])
    assert final < initial, out


def test_norm_audit_example_matches_one_device_and_shows_the_double_count():
    out = run_example(EXAMPLES / "norm_audit.py").stdout
    assert "norm_audit: ok" in out and "tp: replicated" in out, out


TINY_LM = EXAMPLES / "train_tiny_lm.py"


@pytest.mark.skipif(
    not TINY_LM.exists() or "--quick" not in TINY_LM.read_text(encoding="utf-8"),
    reason="examples/train_tiny_lm.py with --quick is not there",
)
def test_train_tiny_lm_quick_writes_its_plot(tmp_path):
    source = TINY_LM.read_text(encoding="utf-8")
    if '"--out"' in source:
        png = tmp_path / "train_tiny_lm.png"
        run_example(TINY_LM, "--quick", "--out", str(png))
    else:
        png = ROOT / "out" / "train_tiny_lm.png"
        png.unlink(missing_ok=True)
        run_example(TINY_LM, "--quick")
    assert png.is_file() and png.stat().st_size > 0


def test_train_tiny_lm_muon_quick_trains_both_and_writes_the_plot(tmp_path):
    png = tmp_path / "train_tiny_lm_muon.png"
    out = run_example(EXAMPLES / "train_tiny_lm_muon.py", "--quick", "--out", str(png)).stdout
    runs = dict(re.findall(r"^(adamw|muon \+ adamw)\s+first loss (\S+)", out, re.MULTILINE))
    assert set(runs) == {"adamw", "muon + adamw"} and runs["adamw"] == runs["muon + adamw"], out  # same start
    initial, final = (float(v) for v in LOSSES.findall(out)[-1])
    assert final < initial, out
    assert png.is_file() and png.stat().st_size > 0


def test_spike_guard_quick_guards_beat_no_guard_and_write_the_plot(tmp_path):
    png = tmp_path / "spike_guard.png"
    out = run_example(EXAMPLES / "spike_guard.py", "--quick", "--out", str(png)).stdout
    losses = dict(re.findall(r"^(.+?)\s+mean loss over the last \d+ steps: (\S+)$", out, re.MULTILINE))
    assert set(losses) == {"adamw (no guard)", "zclip + adamw", "skip_spikes(adamw)"}, out
    # After a 1000x gradient, unguarded Adam ends worse than either guarded run on the same batches.
    unguarded = float(losses["adamw (no guard)"])
    assert float(losses["zclip + adamw"]) < unguarded and float(losses["skip_spikes(adamw)"]) < unguarded, out
    assert png.is_file() and png.stat().st_size > 0


# --- the user guide's code blocks ---------------------------------------------------------

DOCS = ROOT / "docs"
# The concept pages whose every ```python block must run, in order, in one namespace per page.
DOC_PAGES = [
    "index.md",
    "transforms.md",
    "chaining.md",
    "hyperparams.md",
    "functional.md",
    "clipping.md",
    "agc.md",
    "accumulation.md",
    "wrapper.md",
    "testing.md",
    "norm_audit.md",
    "schedules.md",
    "spikes.md",
    "muon.md",
    "optax.md",
    "executor.md",
    "checkpointing.md",
    "torchtitan.md",
]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _parametrized_calls(fn) -> list[dict]:
    """The keyword arguments pytest would call ``fn`` with, from its ``parametrize`` marks."""
    calls: list[dict] = [{}]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize":
            names = [n.strip() for n in mark.args[0].split(",")]
            values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
            calls = [{**c, **dict(zip(names, v))} for c, v in itertools.product(calls, values)]
    return calls


@pytest.mark.parametrize("page", DOC_PAGES)
def test_doc_code_blocks_run(page):
    path = DOCS / page
    if not path.exists():
        pytest.skip(f"docs/{page} is not there")
    blocks = PYTHON_BLOCK.findall(path.read_text(encoding="utf-8"))
    assert blocks, f"docs/{page} has no python code block"
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for i, block in enumerate(blocks):
        # dont_inherit: the block runs as a user runs it, without this file's `from __future__ import annotations`
        code = compile(block, f"docs/{page} (python block {i + 1})", "exec", dont_inherit=True)
        exec(code, namespace)  # noqa: S102 (our own docs)
    # A page may define pytest-style tests (testing.md does): run them too.
    for name, fn in list(namespace.items()):
        if name.startswith("test_") and callable(fn):
            for kwargs in _parametrized_calls(fn):
                fn(**kwargs)


# Pages whose python blocks are whole multi-process programs, run under torchrun by tests/distributed.
TORCHRUN_PAGES = ["distributed.md"]


def test_every_python_block_in_the_docs_is_run():
    """Each page with Python code is run here or under torchrun, and no Python hides behind another fence."""
    for path in sorted(DOCS.rglob("*.md")):
        page = path.relative_to(DOCS).as_posix()
        text = path.read_text(encoding="utf-8")
        hidden = re.findall(r"^```(py|py3|python3|pycon|ipython)\s*$", text, re.MULTILINE)
        assert not hidden, f"docs/{page}: a ```{hidden[0]} block is not run; fence Python as ```python"
        if PYTHON_BLOCK.search(text):
            assert page in DOC_PAGES or page in TORCHRUN_PAGES, f"docs/{page} has python blocks no test runs"
