"""The package's layers: imports point one way, and the flat paths from before the layered layout still work."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path

import pytest

import gradtx as gtx

PKG = Path(gtx.__file__).parent

# Lower ranks sit below higher ones: a module imports only from its own rank or below.
RANK = {
    "core": 0,
    "comm": 0,
    "distributed": 1,
    "transforms": 2,
    "optimizers": 2,
    "schedules": 2,
    "checkpoint": 3,
    "wrapper": 3,
    "testing": 4,
}
SHIMS = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "gradtx" and parts[1] in RANK else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every gradtx module ``path`` imports, lazily inside functions too, with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            # `from gradtx.distributed import plan` imports the module gradtx.distributed.plan.
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in out if m.startswith("gradtx")]


def _layered_modules() -> list[Path]:
    return sorted(p for layer in RANK for p in (PKG / layer).rglob("*.py"))


def test_every_layer_exists_and_holds_modules():
    for layer in RANK:
        assert list((PKG / layer).glob("*.py")), f"gradtx/{layer}/ holds no module"


@pytest.mark.parametrize("path", _layered_modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down(path: Path):
    rel = path.relative_to(PKG)
    own = rel.parts[0]
    wrong = []
    for line, module in _imports(path):
        layer = _layer(module)
        if layer is None:
            if module.split(".")[1:2] and module.split(".")[1] in SHIMS:
                wrong.append(f"line {line}: {module} is an old flat path; import the layered module")
            continue
        if RANK[layer] > RANK[own]:
            wrong.append(f"line {line}: {module} ({layer}, rank {RANK[layer]}) from {own} (rank {RANK[own]})")
        if own == "comm" and layer not in ("comm", "core"):
            wrong.append(f"line {line}: comm knows nothing of {layer}")
    assert not wrong, f"gradtx/{rel} imports upward:\n" + "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from gradtx.wrapper import rules\n")
    assert [m for _, m in _imports(bad)] == ["gradtx.wrapper", "gradtx.wrapper.rules"]
    assert _layer("gradtx.wrapper.rules") == "wrapper" and RANK["wrapper"] > RANK["core"]


@pytest.mark.parametrize("old", SHIMS)
def test_old_flat_paths_are_the_moved_modules(old: str):
    module = importlib.import_module(f"gradtx.{old}")
    assert _layer(module.__name__) is not None or old == "optim", f"gradtx.{old} is {module.__name__}"
    assert getattr(gtx, old) is module


def test_a_transform_pickled_by_its_old_module_path_loads():
    # A pickle names classes by module path: gradtx.optimizers.ScaleByAdamState from before the layout.
    state = gtx.adam(1e-3).init({"w": __import__("torch").zeros(2)})
    data = pickle.dumps(state)
    assert pickle.loads(data)[0].__class__ is state[0].__class__
