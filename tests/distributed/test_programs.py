"""The multi-process programs users are shown run as written, under torchrun on CPU (gloo).

* ``examples/train_nd_parallel.py`` on 4 ranks: TP x FSDP2 and a 2-stage pipeline x FSDP2 end
  within fp32 rounding of a single-device run of the same model.
* every ``python`` block of ``docs/distributed.md``, each a complete program that starts its own
  process group, on the number of ranks its first line names (``# torchrun --nproc-per-node 4``;
  2 if it names none): it exits 0 and reports three optimizer steps on rank 0. The programs assert
  what the text around them claims (norms against one device or the gathered grads, copies equal).

The programs of one rank count run one after another in a single torchrun launch
(tests/distributed/torchrun_programs.py: each as ``__main__``, with a fresh rendezvous for its
process group), since a launch costs seconds of CPU before the first line of a program runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.test_examples import DOCS, EXAMPLES, PYTHON_BLOCK, ROOT

DRIVER = Path(__file__).resolve().parent / "torchrun_programs.py"
PROGRAMS = PYTHON_BLOCK.findall((DOCS / "distributed.md").read_text(encoding="utf-8"))
NPROC = re.compile(r"\A#\s*torchrun\b.*?--nproc[-_]per[-_]node[ =](\d+)")


def _nproc(block: str) -> int:
    """The rank count a block's first-line comment names (``# torchrun --nproc-per-node 4``), else 2."""
    match = NPROC.match(block)
    return int(match.group(1)) if match else 2


# Every program, by name: (its script, or the docs block's source; its rank count).
SCRIPTS: dict[str, tuple[Path | str, int]] = {
    "train_nd_parallel": (EXAMPLES / "train_nd_parallel.py", 4),
    **{f"distributed_md_{i}": (block, _nproc(block)) for i, block in enumerate(PROGRAMS)},
}
_launched: dict[int, tuple[list[str], subprocess.CompletedProcess[str]]] = {}


def _torchrun(nproc: int, scripts: list[Path], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(DRIVER)]
    cmd += [str(s) for s in scripts]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _run(name: str) -> str:
    """Rank 0's output of program ``name``; it must have exited 0 on every rank.

    The first call for a rank count runs every program of that count, in one torchrun launch.
    """
    nproc = SCRIPTS[name][1]
    if nproc not in _launched:
        names = [n for n, (_, n_proc) in SCRIPTS.items() if n_proc == nproc]
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for n in names:
                script = SCRIPTS[n][0]
                if isinstance(script, str):  # a docs block: a program file of its own, as a user would save it
                    path = Path(tmp) / f"{n}.py"
                    path.write_text(script, encoding="utf-8")
                    script = path
                paths.append(script)
            _launched[nproc] = (names, _torchrun(nproc, paths))
    names, result = _launched[nproc]
    i = names.index(name)
    start, ok = f"::program {i} start::\n", f"::program {i} ok::\n"
    log = f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-8000:]}"
    assert start in result.stdout, f"{name} did not start: a program before it in the launch failed\n{log}"
    assert ok in result.stdout, f"{name} failed\n{log}"
    return result.stdout.split(start, 1)[1].split(ok, 1)[0]


def test_train_nd_parallel_matches_one_device():
    out = _run("train_nd_parallel")
    diffs = [float(d) for d in re.findall(r"max \|param - single-device param\| after \d+ steps.*?: (\S+)", out)]
    assert len(diffs) == 2, out  # TP x FSDP2, and the pipeline
    assert all(d < 1e-5 for d in diffs), out


@pytest.mark.parametrize("index", range(len(PROGRAMS)))
def test_distributed_md_programs_run(index):
    out = _run(f"distributed_md_{index}")
    assert out.count("step:") == 3, out  # three optimizer steps, one line each on rank 0


def test_distributed_md_has_no_fragments():
    # Every python block is a complete program, so the test above runs all of them: no fragment slips back in.
    assert len(PROGRAMS) >= 6
    fragments = [i + 1 for i, b in enumerate(PROGRAMS) if "init_process_group" not in b]
    assert not fragments, f"docs/distributed.md python blocks {fragments} start no process group"


def test_nproc_comment_is_read():
    assert _nproc("# torchrun --nproc-per-node 4\nimport torch\n") == 4
    assert _nproc("# torchrun --nproc-per-node=3 this.py\n") == 3
    assert _nproc("import torch\n# torchrun --nproc-per-node 4\n") == 2
