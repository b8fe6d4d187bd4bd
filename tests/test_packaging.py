"""The package as a user gets it: a wheel of this checkout, in a clean venv, with its types.

Marked ``packaging`` and deselected from the default run (it builds a wheel and installs torch
into a new venv, about a minute with a warm pip cache): ``make package-check`` runs it, and so
does CI.
"""

from __future__ import annotations

import ast
import email
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent


def _source_version() -> str:
    """``__version__`` as written in gradtx/__init__.py, the one version source."""
    tree = ast.parse((ROOT / "gradtx" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("gradtx/__init__.py sets no __version__")


def _run(*cmd: str | Path, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MYPYPATH")}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if check:
        assert result.returncode == 0, f"{cmd} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", dist, ROOT, cwd=dist)
    (found,) = dist.glob("gradtx-*.whl")
    return found


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A new venv (no system site-packages) with only the wheel and its dependencies, pinned: CPU torch."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=venv.parent)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "-c", ROOT / "constraints.txt", wheel, cwd=venv.parent)
    return python


def test_wheel_ships_the_license_the_types_and_one_version(wheel):
    version = _source_version()
    assert wheel.name == f"gradtx-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = email.message_from_bytes(zf.read(f"gradtx-{version}.dist-info/METADATA"))
        license_text = zf.read(f"gradtx-{version}.dist-info/licenses/LICENSE").decode()
    assert "gradtx/py.typed" in names
    assert meta["Version"] == version
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert not any(c.startswith("License ::") for c in meta.get_all("Classifier")), "PEP 639: no license classifiers"
    assert {u.split(",")[0] for u in meta.get_all("Project-URL")} >= {"Homepage", "Repository", "Changelog"}
    assert not any(n.startswith(("tests/", "docs/", "examples/", "tools/")) for n in names)


def test_wheel_imports_in_a_clean_venv_with_the_pinned_cpu_torch(venv_python, tmp_path):
    out = _run(
        venv_python,
        "-c",
        "import importlib.metadata as md, gradtx, torch; "
        "print(gradtx.__file__); print(gradtx.__version__, md.version('gradtx')); print(torch.__version__)",
        cwd=tmp_path,
    ).stdout.split("\n")
    location, versions, torch_version = out[0], out[1].split(), out[2]
    assert Path(location).is_relative_to(venv_python.parent.parent), f"gradtx imported from {location}, not the venv"
    assert versions == [_source_version()] * 2
    pinned = next(line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    assert torch_version == pinned.split("==")[1] + "+cpu", torch_version
    installed = _run(venv_python, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).stdout
    assert "nvidia" not in installed.lower(), installed


USER_SCRIPT = """\
from __future__ import annotations

import torch

import gradtx as gtx

params: dict[str, torch.Tensor] = {"w": torch.zeros(3, 2), "b": torch.zeros(3)}
tx = gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3, weight_decay=0.1))
reveal_type(tx)
state = tx.init(params)
grads = {k: torch.ones_like(v) for k, v in params.items()}
updates, state = tx.update(grads, state, params)
params = gtx.apply_updates(params, updates)
norm: torch.Tensor = gtx.global_norm(grads)
logged: dict[str, torch.Tensor] = gtx.metrics(state)

model = torch.nn.Linear(2, 3)
opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(1.0))
stepped: bool = opt.step()
reveal_type(opt.metrics)
"""


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mypy_cache")  # torch's types are read once for both scripts


def _mypy(venv_python: Path, cache: Path, tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    """This repo's pinned mypy, resolving imports in the user's venv (so only the wheel's py.typed counts)."""
    (tmp_path / "user_script.py").write_text(script, encoding="utf-8")
    (tmp_path / "mypy.ini").write_text("[mypy]\nstrict = True\n", encoding="utf-8")
    return _run(
        sys.executable, "-m", "mypy", "--python-executable", venv_python, "--config-file", "mypy.ini",
        "--cache-dir", cache, "user_script.py",
        cwd=tmp_path, check=False,
    )  # fmt: skip


def test_user_script_type_checks_against_the_installed_wheel(venv_python, mypy_cache, tmp_path):
    result = _mypy(venv_python, mypy_cache, tmp_path, USER_SCRIPT)
    out = result.stdout + result.stderr
    assert "py.typed" not in out and "import-untyped" not in out, out
    assert 'Revealed type is "tuple[' in out and "fallback=gradtx.core.base.GradientTransformation]" in out, out
    assert 'Revealed type is "dict[str, torch._tensor.Tensor]"' in out, out
    assert result.returncode == 0 and "error:" not in out, out


def test_user_script_type_errors_are_caught_through_the_wheel(venv_python, mypy_cache, tmp_path):
    # The same check must be able to fail: gradtx's own signatures reject a wrong argument.
    result = _mypy(venv_python, mypy_cache, tmp_path, USER_SCRIPT + 'gtx.clip_by_global_norm("1.0")\n')
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert 'Argument 1 to "clip_by_global_norm" has incompatible type "str"; expected "float' in out, out
