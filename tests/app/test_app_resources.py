"""Resources are found from a source checkout, an installed package and a PyInstaller bundle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ["style.qss", "presets.json", "icons/mlx-desk.svg", "icons/attach.svg", "icons/mic.svg"]

PROBE = (
    "from app.resources import resource_dir, resource_path; import sys; "
    "print(resource_dir()); sys.exit(0 if all(resource_path(n).is_file() "
    f"for n in {NEEDED!r}) else 3)"
)


def test_source_checkout_finds_resources():
    from app.resources import resource_dir, resource_path

    assert resource_dir() == ROOT / "resources"
    assert all(resource_path(n).is_file() for n in NEEDED)


def test_installed_package_carries_resources(tmp_path):
    """What pip installs from the wheel: the resources as data files under the prefix,
    found through the installed distribution's file list."""
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "wheel").glob("*.whl"))
    here_before = _project_in_this_venv()
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip takes the project's own editable install in this
    # venv for an older copy and uninstalls it, and `make run` after `make test` finds no
    # mlx-desk. The prefix is a place of its own; nothing in the venv changes.
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "--prefix",
            str(prefix),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    assert _project_in_this_venv() == here_before, "installing the wheel elsewhere changed this venv's mlx-desk"
    site = next(prefix.glob("lib/python*/site-packages"))
    probe = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert Path(probe.stdout.strip()) == prefix / "share" / "mlx-desk" / "resources"


def _project_in_this_venv() -> str | None:
    """Where this interpreter's own mlx-desk distribution lives (None when only the source tree is on the path)."""
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.metadata as m\ntry: print(m.distribution('mlx-desk')._path)\nexcept m.PackageNotFoundError: pass",
        ],
        cwd="/",
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    return found.stdout.strip() or None


def test_frozen_bundle_finds_resources(tmp_path, monkeypatch):
    from app import resources

    for layout in ("resources",):
        bundle = tmp_path / layout.replace("/", "_")
        shutil.copytree(ROOT / "resources", bundle / layout)
        monkeypatch.setattr(sys, "_MEIPASS", str(bundle), raising=False)
        assert resources.resource_dir() == bundle / layout
        assert all(resources.resource_path(n).is_file() for n in NEEDED)
