"""Resources are found from a source checkout, an installed package and a PyInstaller bundle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ["style.qss", "presets.json", "icons/mlx-desk.svg", "icons/attach.svg", "icons/mic.svg"]

PROBE = ("from app.resources import resource_dir, resource_path; import sys; "
         "print(resource_dir()); sys.exit(0 if all(resource_path(n).is_file() "
         f"for n in {NEEDED!r}) else 3)")


def test_source_checkout_finds_resources():
    from app.resources import resource_dir, resource_path

    assert resource_dir() == ROOT / "app" / "resources"
    assert all(resource_path(n).is_file() for n in NEEDED)


def test_installed_package_carries_resources(tmp_path):
    """What pip installs is what setuptools' build_py lays out, package data included."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "app", src / "app", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
         "--build-lib", str(tmp_path / "lib")],
        cwd=src, capture_output=True, text=True, timeout=120,
    )
    assert build.returncode == 0, build.stderr
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "lib")})
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert Path(probe.stdout.strip()) == tmp_path / "lib" / "app" / "resources"


def test_frozen_bundle_finds_resources(tmp_path, monkeypatch):
    from app import resources

    for layout in ("resources", "app/resources"):
        bundle = tmp_path / layout.replace("/", "_")
        shutil.copytree(ROOT / "app" / "resources", bundle / layout)
        monkeypatch.setattr(sys, "_MEIPASS", str(bundle), raising=False)
        assert resources.resource_dir() == bundle / layout
        assert all(resources.resource_path(n).is_file() for n in NEEDED)
