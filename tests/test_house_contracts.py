"""The house's machine-checked rules hold, and they bite.

The import contracts: an import that crosses a layer fails them. The sizes: no module in
engine/ or app/ over 700 lines, no function over 150 (a long one is split where it has a seam).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

needs_lint = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 150


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


@needs_lint
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


@needs_lint
@pytest.mark.slow
def test_the_app_importing_mlx_breaks_the_wall(tmp_path):
    tree = _copy(tmp_path)
    chat = tree / "app" / "controllers" / "chat.py"
    chat.write_text(chat.read_text() + "\nimport mlx.core  # noqa\n")
    broken = _lint(tree)
    assert broken.returncode != 0 and "app" in broken.stdout


def _oversized(tree: Path) -> list[str]:
    """Every module over MAX_MODULE_LINES and every function over MAX_FUNCTION_LINES under
    ``tree``'s engine/ and app/, as "path: what (lines)"."""
    found = []
    for package in ("engine", "app"):
        for path in sorted((tree / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            where = path.relative_to(tree).as_posix()
            if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
                found.append(f"{where}: module ({lines} lines)")
            for node in ast.walk(ast.parse(text, filename=where)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{where}:{node.lineno}: {node.name} ({length} lines)")
    return found


def test_no_module_over_700_lines_and_no_function_over_150():
    assert _oversized(ROOT) == []


def test_the_size_check_catches_a_long_module_and_a_long_function(tmp_path):
    tree = tmp_path / "tree"
    (tree / "engine").mkdir(parents=True)
    (tree / "app").mkdir()
    (tree / "engine" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    body = "".join(f"    y{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tree / "app" / "step.py").write_text(f"def step():\n{body}")  # 151 lines with its def
    (tree / "app" / "fine.py").write_text("def short():\n    return 1\n")
    assert _oversized(tree) == [
        f"engine/long.py: module ({MAX_MODULE_LINES + 1} lines)",
        f"app/step.py:1: step ({MAX_FUNCTION_LINES + 1} lines)",
    ]
