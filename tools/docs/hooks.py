"""mkdocs hooks for the docs site (mkdocs.yml: ``hooks``): pages made from files outside docs/.

* ``examples.md``: every script in examples/, with its source. The guide links to
  ``../examples/NAME.py``, which works when the Markdown is read in the repository; on the site
  such a link goes to that script's section of this page instead.
* ``changelog.md``: CHANGELOG.md.

Any other link out of docs/ is left alone, so mkdocs' link check still reports it.
"""

from __future__ import annotations

import ast
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# A Markdown link target leaving docs/: ](../examples/functional_step.py) or ](../examples/x.py#frag)
_OUT_LINK = re.compile(r"\]\((?P<path>(?:\.\./)+[^)\s#]+)(?:#[^)\s]*)?\)")


def _anchor(script: Path) -> str:
    return script.stem.replace("_", "-")


def _examples_page() -> str:
    lines = [
        "# Examples",
        "",
        "The scripts in `examples/`, as they are in the repository. Each runs on CPU, and "
        + "`tests/test_examples.py` runs the small ones.",
        "",
    ]
    for script in sorted(EXAMPLES.glob("*.py")):
        source = script.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(source)) or ""
        summary = doc.strip().split("\n\n", 1)[0].replace("\n", " ")
        lines += [f"## examples/{script.name} {{ #{_anchor(script)} }}", "", summary, ""]
        lines += ["```python", source.rstrip("\n"), "```", ""]
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "examples.md", content=_examples_page()))
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "changelog.md", content=changelog))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = posixpath.dirname(page.file.src_uri)

    def relink(match: re.Match[str]) -> str:
        target = posixpath.normpath(posixpath.join(here, match["path"]))  # relative to docs/
        script = ROOT / "docs" / target
        if target.startswith("../examples/") and target.endswith(".py") and script.resolve().is_file():
            page_link = posixpath.relpath("examples.md", here or ".")
            return f"]({page_link}#{_anchor(script)})"
        return match[0]

    return _OUT_LINK.sub(relink, markdown)
