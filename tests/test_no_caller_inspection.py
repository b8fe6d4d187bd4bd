"""No behaviour in gradtx depends on who called: no frame inspection, no caller-module checks."""

import re
from pathlib import Path

import gradtx

# Frame access, and the ways code finds its caller's module or function name.
FORBIDDEN = re.compile(
    r"_getframe|currentframe\(|inspect\.stack\(|inspect\.trace\(|getouterframes|\bf_back\b|\bf_locals\b|"
    r"\bf_globals\b|\bf_code\b|\bco_name\b|traceback\.extract_stack|walk_stack"
)


def test_the_package_reads_no_frames():
    root = Path(gradtx.__file__).parent
    hits = [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not hits, "frame inspection in the package:\n" + "\n".join(hits)


def test_the_scan_finds_what_it_looks_for():
    assert FORBIDDEN.search("frame = sys._getframe(2)")
    assert FORBIDDEN.search("top = frame.f_globals.get('__name__')")
    assert not FORBIDDEN.search("self.frames = []")
