"""examples/checkpoint_resume.py: saved on 4 ranks under torchrun, resumed on 2, the params match."""

from __future__ import annotations

from tests.test_examples import EXAMPLES, run_example


def test_checkpoint_resume_example_saves_on_4_resumes_on_2_and_matches():
    out = run_example(EXAMPLES / "checkpoint_resume.py", timeout=600).stdout
    assert "saved on 4 ranks after micro-step 8, window open: False" in out, out
    assert "resumed on 2 ranks at micro-step 8, window open: False" in out, out
    assert "match: True" in out, out
