"""The multi-process programs users are shown run as written, under torchrun on CPU (gloo).

* ``examples/train_nd_parallel.py`` on 4 ranks: TP x FSDP2 and a 2-stage pipeline x FSDP2 end
  within fp32 rounding of a single-device run of the same model.
* ``examples/ddp_backward_norm.py`` on 2 ranks: the norm measured in DDP's backward clips as
  ``torch.nn.utils.clip_grad_norm_`` does.
* every ``python`` block of ``docs/distributed.md``, each a complete program that starts its own
  process group, on the number of ranks its first line names (``# torchrun --nproc-per-node 4``;
  2 if it names none): it exits 0 and reports three optimizer steps on rank 0. The programs assert
  what the text around them claims (norms against one device or the gathered grads, copies equal).
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


def test_ddp_backward_norm_example_matches_clip_grad_norm():
    out = _torchrun(EXAMPLES / "ddp_backward_norm.py", nproc=2)  # asserts each step against clip_grad_norm_
    assert out.count("step:") == 3, out


PROGRAMS = PYTHON_BLOCK.findall((DOCS / "distributed.md").read_text(encoding="utf-8"))
NPROC = re.compile(r"\A#\s*torchrun\b.*?--nproc[-_]per[-_]node[ =](\d+)")


def _nproc(block: str) -> int:
    """The rank count a block's first-line comment names (``# torchrun --nproc-per-node 4``), else 2."""
    match = NPROC.match(block)
    return int(match.group(1)) if match else 2


@pytest.mark.parametrize("index", range(len(PROGRAMS)))
def test_distributed_md_programs_run(index):
    block = PROGRAMS[index]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / f"distributed_md_program_{index + 1}.py"
        script.write_text(block, encoding="utf-8")
        out = _torchrun(script, nproc=_nproc(block))
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
