"""The Linux bundle: built once per test run, then run with no Python around it.

Building takes a few minutes on two cores, so the bundle is made once into a
temporary folder (or taken from MLX_DESK_BUNDLE_DIR when a bundle was built
already). The bundle runs with a scrubbed environment: no virtualenv on PATH,
no PYTHONPATH/PYTHONHOME, a working directory outside the checkout.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.timeout(1500),  # the first test pays for the build
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bundle test builds the Linux bundle"),
]

# What must never be shipped (heavy reference tooling, test machinery).
FORBIDDEN_PACKAGES = {"torch", "transformers", "mlx_lm", "pytest", "_pytest", "pytestqt", "tests"}


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a machine without this project's Python."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "QT_QPA_PLATFORM": "offscreen",
    }
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get("MLX_DESK_BUNDLE_DIR")
    if prebuilt:
        return Path(prebuilt)
    if importlib.util.find_spec("PyInstaller") is None:
        pytest.skip("PyInstaller is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    if shutil.which("objdump") is None:
        pytest.skip("PyInstaller needs objdump on Linux: apt-get install binutils")
    out = tmp_path_factory.mktemp("bundle")
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "packaging" / "build.py"),
            "--dist",
            str(out / "dist"),
            "--work",
            str(out / "work"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"bundle build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    print(f"\n{proc.stdout.strip().splitlines()[-1]} (test build: {time.monotonic() - start:.0f} s)")
    return out / "dist" / "mlx-desk"


def run_bundle(bundle: Path, *args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bundle / "mlx-desk"), *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_version_is_the_project_version(bundle: Path, tmp_path: Path) -> None:
    proc = run_bundle(bundle, "--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"MLX Desk {project_version()}"


def test_bundle_carries_what_the_app_loads(bundle: Path) -> None:
    internal = bundle / "_internal"
    must_have = [
        "mlx/lib/libmlx.so",
        "PySide6/Qt/plugins/platforms/libqoffscreen.so",
        "PySide6/Qt/plugins/platforms/libqxcb.so",
        "PySide6/Qt/plugins/platforms/libqwayland.so",
        "PySide6/Qt/plugins/imageformats/libqjpeg.so",
        "PySide6/Qt/plugins/imageformats/libqwebp.so",
        "PySide6/Qt/plugins/iconengines/libqsvgicon.so",
        "resources/icons/mlx-desk.svg",
        "resources/style.qss",
        "resources/recommended_models.json",
    ]
    missing = [p for p in must_have if not (internal / p).exists()]
    assert not missing, f"missing from the bundle: {missing}"
    assert list(internal.glob("mlx/core.*.so")), "mlx's extension module is missing"
    assert list(internal.glob("tokenizers/tokenizers*.so")), "the tokenizers native module is missing"
    # libmlx finds its BLAS/LAPACK through a RUNPATH relative to itself.
    assert any((internal / "mlx_cpu.libs").glob("libblas*")) or any((internal / "mlx/lib").glob("libblas*"))
    # HEIC photos: pillow-heif is imported lazily, and its extension sits beside its package.
    assert list(internal.glob("_pillow_heif.*.so")), "pillow-heif's extension module is missing"
    assert list(internal.glob("**/libheif*.so*")) and list(internal.glob("**/libde265*.so*")), (
        "libheif or its HEVC decoder is missing"
    )


def test_bundle_is_lean(bundle: Path) -> None:
    from_archive = set()
    if importlib.util.find_spec("PyInstaller") is not None:
        from PyInstaller.archive.readers import CArchiveReader

        pyz = CArchiveReader(str(bundle / "mlx-desk")).open_embedded_archive("PYZ.pyz")
        from_archive = {name.split(".")[0] for name in pyz.toc}
        assert {"engine", "app", "pillow_heif"} <= from_archive
    on_disk = {p.name for p in (bundle / "_internal").iterdir()}
    assert not FORBIDDEN_PACKAGES & (from_archive | on_disk)
    # Only the Qt platform plugins a desktop or a headless run can use.
    platforms = {p.name for p in (bundle / "_internal/PySide6/Qt/plugins/platforms").iterdir()}
    assert not {"libqvnc.so", "libqeglfs.so", "libqlinuxfb.so"} & platforms
    assert not (bundle / "_internal/PySide6/Qt/translations").exists()


def test_desktop_entry(bundle: Path) -> None:
    entry = configparser.ConfigParser(interpolation=None, strict=True)
    entry.optionxform = str  # keys are case-sensitive
    entry.read(bundle / "mlx-desk.desktop", encoding="utf-8")
    d = entry["Desktop Entry"]
    assert d["Type"] == "Application" and d["Name"] == "MLX Desk"
    assert d["Exec"].split()[0] == "mlx-desk" and (bundle / "mlx-desk").is_file()
    assert {"application/x-gguf", "image/jpeg", "image/heic", "image/heif"} <= set(d["MimeType"].split(";"))
    for size in (16, 32, 48, 128, 256, 512):
        assert (bundle / f"share/icons/hicolor/{size}x{size}/apps/{d['Icon']}.png").is_file()
    assert (bundle / "share/mime/packages/mlx-desk.xml").is_file()
    assert os.access(bundle / "install-desktop-entry.sh", os.X_OK)


def _tiny_model(folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "tests" / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_llama(folder)


def test_offscreen_window_loads_a_model_and_streams_a_reply(bundle: Path, tmp_path: Path) -> None:
    helped = run_bundle(bundle, "--help", cwd=tmp_path)
    # A bundle whose --help crashes is broken, not a reason to skip.
    assert helped.returncode == 0, f"--help failed:\n{helped.stderr[-2000:]}"
    assert "--smoke-test" in helped.stdout, "the bundled app lost its --smoke-test mode"
    model = _tiny_model(tmp_path / "tiny-llama")
    prompt = "hello there"
    proc = run_bundle(
        bundle,
        "--model",
        str(model),
        "--data-dir",
        str(tmp_path / "data"),
        "--smoke-test",
        prompt,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["window_shown_s"] <= report["model_loaded_s"], "the model must load after the window is up"
    assert report["streamed_chunks"] >= 2, "the reply reached the window in one piece, not streamed"
    assert report["finish_reason"] in ("stop", "length")
    assert report["generated_tokens"] > 0

    # Outside referee: the engine run from source, greedy, on the same chat prompt.
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            str(model),
            "--prompt",
            prompt,
            "--chat",
            "--temp",
            "0",
            "--max-tokens",
            str(report["generated_tokens"]),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr
    expected = json.loads(ref.stdout.strip().splitlines()[-1])
    assert report["reply"].strip() == expected["text"].strip()
