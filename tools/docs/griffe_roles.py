"""A griffe extension for the docs site: Sphinx cross-reference roles in docstrings become links.

gradtx's docstrings are Google style, with Sphinx roles (``:func:`accumulate```,
``:class:`~gradtx.comm.Comm```) for cross-references. mkdocstrings renders Markdown, where a
role would show as literal text. This extension resolves each role's target the way Sphinx
would (the object's own scope outward, then the flat ``gradtx`` namespace) and writes a
mkdocs-autorefs link to the object's canonical path; the link is optional, so a target the API
pages do not render (a private helper) shows as code. A gradtx target that resolves to nothing
is a stale reference: it is logged as a warning, which fails ``mkdocs build --strict``.
It also turns reST's ``text::`` literal-block marker into ``text:``, and a singular ``Example:``
section header into ``Examples:``, the one griffe parses into ``>>>`` code blocks (it would
render ``Example:`` as an admonition of plain text, and ``>>>`` as nested quotes).
"""

from __future__ import annotations

import html
import logging
import re
from typing import Any

import griffe

# Under the "mkdocs" logger, so that mkdocs counts its warnings (and --strict fails on them).
_log = logging.getLogger("mkdocs.plugins.gradtx_docs")

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?`")
_LITERAL_MARKER = re.compile(r"(\S)::$", re.MULTILINE)
_EXAMPLE_HEADER = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


def _follow(obj: Any) -> Any | None:
    try:
        return obj.final_target if obj.is_alias else obj
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None  # an alias to something outside the package (torch, ...)


def _lookup(pkg: griffe.Module, path: str) -> Any | None:
    parts = path.split(".")
    if parts[0] != pkg.name:
        return None
    obj: Any = pkg
    for part in parts[1:]:
        member = obj.members.get(part)
        if member is None:
            return None
        obj = _follow(member)
        if obj is None:
            return None
    return obj


def _scopes(obj: Any) -> list[str]:
    """The paths a bare name in ``obj``'s docstring may be relative to, innermost first."""
    out = []
    scope = obj if obj.kind in (griffe.Kind.CLASS, griffe.Kind.MODULE) else obj.parent
    while scope is not None:
        out.append(scope.path)
        scope = scope.parent
    return out


def _walk(obj: Any) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is None:
                continue
            obj.docstring.value = self._rewrite(pkg, obj, obj.docstring.value)

    def _rewrite(self, pkg: griffe.Module, obj: Any, text: str) -> str:
        def link(match: re.Match[str]) -> str:
            target = match["target"].lstrip(".")
            title = target.rsplit(".", 1)[-1] if match["tilde"] else target
            code = f"<code>{html.escape(title)}</code>"
            candidates = [target] if target.startswith(pkg.name + ".") else []
            candidates += [f"{scope}.{target}" for scope in _scopes(obj)]
            for candidate in candidates:
                found = _lookup(pkg, candidate)
                if found is not None:
                    return f'<autoref identifier="{found.path}" optional>{code}</autoref>'
            if target.split(".")[0] == pkg.name or "." not in target:
                # A bare name or a gradtx path that names nothing: the docstring is out of date.
                where = f"{obj.relative_filepath}:{obj.lineno}" if obj.lineno else obj.path
                _log.warning("%s: docstring of %s refers to %r, which does not exist", where, obj.path, match[0])
            return code  # torch.*, optree.*: no link

        text = _EXAMPLE_HEADER.sub(r"\1Examples:", text)
        return _LITERAL_MARKER.sub(r"\1:", _ROLE.sub(link, text))
