"""The multi-process programs users are shown run as written, under torchrun on CPU (gloo).

* ``examples/train_nd_parallel.py`` on 4 ranks: TP x FSDP2 and a 2-stage pipeline x FSDP2 end
  within fp32 rounding of a single-device run of the same model.
* every complete program in ``docs/distributed.md`` (a ``python`` block that starts its own
  process group) on 2 ranks: it exits 0 and reports its steps.
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


def _torchrun(script: Path, nproc: int, timeout: float = 600) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{script.name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_train_nd_parallel_matches_one_device():
    out = _torchrun(EXAMPLES / "train_nd_parallel.py", nproc=4)
    diffs = [float(d) for d in re.findall(r"max \|param - single-device param\| after \d+ steps.*?: (\S+)", out)]
    assert len(diffs) == 2, out  # TP x FSDP2, and the pipeline
    assert all(d < 1e-5 for d in diffs), out


PROGRAMS = [
    b for b in PYTHON_BLOCK.findall((DOCS / "distributed.md").read_text(encoding="utf-8")) if "init_process_group" in b
]


@pytest.mark.parametrize("index", range(len(PROGRAMS)))
def test_distributed_md_programs_run_on_two_ranks(index):
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / f"distributed_md_program_{index + 1}.py"
        script.write_text(PROGRAMS[index], encoding="utf-8")
        out = _torchrun(script, nproc=2)
    assert out.count("step:") == 3, out  # three windows of k micro-steps, one line each on rank 0


def test_docs_have_complete_programs_to_run():
    assert len(PROGRAMS) >= 2
