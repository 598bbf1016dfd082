"""The import contracts hold, and they bite: an import that crosses a layer fails them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT), "--config", str(tree / ".importlinter")],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    )


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    for name in ("engine", "app"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tree / ".importlinter")
    return tree


@pytest.mark.slow
def test_contracts_hold_and_an_upward_import_breaks_them(tmp_path):
    tree = _copy(tmp_path)
    assert _lint(tree).returncode == 0
    # The models layer reaching up into the runtime: the layers contract must fail.
    family = tree / "engine" / "models" / "llama.py"
    family.write_text(family.read_text() + "\nfrom engine.runtime import session  # noqa\n")
    broken = _lint(tree)
    assert broken.returncode != 0
    assert "engine.models is not allowed to import engine.runtime" in broken.stdout


@pytest.mark.slow
def test_the_app_importing_mlx_breaks_the_wall(tmp_path):
    tree = _copy(tmp_path)
    chat = tree / "app" / "controllers" / "chat.py"
    chat.write_text(chat.read_text() + "\nimport mlx.core  # noqa\n")
    broken = _lint(tree)
    assert broken.returncode != 0 and "app" in broken.stdout
