"""Build the MLX Desk bundle: `dist/MLX Desk.app` on macOS, `dist/mlx-desk/` on Linux.

    python packaging/build.py [--dist DIR] [--work DIR]

This is what `make bundle` runs after installing the `bundle` extra; it installs
nothing itself. It runs PyInstaller on packaging/mlx-desk.spec, then:
  - Linux: strips libpython, writes the .desktop entry, hicolor icons, a MIME
    type for .gguf and an install script into the bundle folder;
  - macOS: makes sure every libmlx.dylib has mlx.metallib beside it.
It prints the bundle's size and the build time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "packaging" / "mlx-desk.spec"
ICONS = ROOT / "resources" / "icons"
EXE_NAME = "mlx-desk"
APP_NAME = "MLX Desk"
HICOLOR_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)

DESKTOP_ENTRY = """\
[Desktop Entry]
Type=Application
Version=1.5
Name=MLX Desk
GenericName=Local AI Chat
Comment=Chat with local language models on your own machine
Exec={exec} %F
TryExec={exec}
Icon={icon}
Terminal=false
Categories=Utility;Development;Science;ArtificialIntelligence;
Keywords=LLM;AI;chat;MLX;model;
MimeType=application/x-gguf;image/png;image/jpeg;image/webp;image/gif;image/bmp;image/heic;image/heif;image/avif;audio/wav;audio/x-wav;audio/mpeg;audio/flac;audio/ogg;audio/mp4;
StartupNotify=true
StartupWMClass=mlx-desk
"""

GGUF_MIME = """\
<?xml version="1.0" encoding="UTF-8"?>
<mime-info xmlns="http://www.freedesktop.org/standards/shared-mime-info">
  <mime-type type="application/x-gguf">
    <comment>GGUF model</comment>
    <magic priority="60"><match type="string" offset="0" value="GGUF"/></magic>
    <glob pattern="*.gguf"/>
  </mime-type>
</mime-info>
"""

INSTALL_SCRIPT = """\
#!/bin/sh
# Add MLX Desk to the desktop menu of the current user (no root needed).
# Run it from anywhere; the bundle folder may live wherever you like, but
# run this again if you move it.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
mkdir -p "$data/applications" "$data/mime/packages"
cp -r "$here/share/icons" "$data/"
cp "$here/share/mime/packages/mlx-desk.xml" "$data/mime/packages/"
sed "s|^Exec=.*|Exec=\\"$here/mlx-desk\\" %F|; s|^TryExec=.*|TryExec=$here/mlx-desk|" \\
    "$here/mlx-desk.desktop" > "$data/applications/mlx-desk.desktop"
command -v update-mime-database >/dev/null && update-mime-database "$data/mime" || true
command -v update-desktop-database >/dev/null && update-desktop-database "$data/applications" || true
command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q "$data/icons/hicolor" || true
echo "MLX Desk added to the applications menu."
"""


def folder_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            p = Path(dirpath) / name
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def ensure_icons() -> None:
    needed = [ICONS / "mlx-desk.png", ICONS / "mlx-desk.icns"]
    needed += [ICONS / f"mlx-desk-{s}.png" for s in HICOLOR_SIZES]
    if not all(p.is_file() for p in needed):
        subprocess.run([sys.executable, str(ROOT / "packaging" / "make_icon.py")], check=True)


def run_pyinstaller(dist: Path, work: Path) -> None:
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        sys.exit("PyInstaller is not installed: run `make bundle` or `pip install -e '.[bundle]'`.")
    cmd = [
        sys.executable,
        "-m",
        "PyInstaller",
        "--noconfirm",
        "--clean",
        "--log-level",
        "WARN",
        "--distpath",
        str(dist),
        "--workpath",
        str(work),
        str(SPEC),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)


def strip_libpython(bundle: Path) -> None:
    """Drop debug symbols from libpython (~17 MiB on pyenv-built Pythons).

    Only libpython: wheels' libraries were patched by auditwheel, and stripping
    a patched ELF can break it, so PyInstaller's blanket strip stays off.
    """
    if shutil.which("strip") is None:
        return
    for lib in (bundle / "_internal").glob("libpython3*.so*"):
        if lib.is_file() and not lib.is_symlink():
            subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)


def finish_linux(bundle: Path) -> None:
    """Desktop integration files, kept inside the relocatable bundle folder."""
    strip_libpython(bundle)
    for size in HICOLOR_SIZES:
        dest = bundle / "share" / "icons" / "hicolor" / f"{size}x{size}" / "apps"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ICONS / f"mlx-desk-{size}.png", dest / "mlx-desk.png")
    shutil.copy2(ICONS / "mlx-desk.png", bundle / "mlx-desk.png")
    mime = bundle / "share" / "mime" / "packages"
    mime.mkdir(parents=True, exist_ok=True)
    (mime / "mlx-desk.xml").write_text(GGUF_MIME, encoding="utf-8")
    # As shipped, the entry names the icon by theme name; install-desktop-entry.sh
    # rewrites Exec to the folder's absolute path.
    (bundle / "mlx-desk.desktop").write_text(DESKTOP_ENTRY.format(exec=EXE_NAME, icon="mlx-desk"), encoding="utf-8")
    script = bundle / "install-desktop-entry.sh"
    script.write_text(INSTALL_SCRIPT, encoding="utf-8")
    script.chmod(0o755)


def place_metallib(app: Path) -> None:
    """Make sure every libmlx.dylib in the .app has mlx.metallib beside it.

    libmlx looks for its Metal kernels next to itself (dladdr), then in a
    Resources folder there. PyInstaller files the metallib as data (under
    Contents/Resources) and links it back into Contents/Frameworks; if the
    analysis also put a second libmlx.dylib elsewhere, that copy would find no
    kernels, so link the metallib beside it as well.
    """
    libs = [p for p in app.rglob("libmlx.dylib") if not p.is_symlink()]
    metallibs = [p for p in app.rglob("mlx.metallib") if p.is_file()]
    if not libs or not metallibs:
        sys.exit(f"{app}: libmlx.dylib or mlx.metallib is missing from the bundle")
    source = metallibs[0].resolve()
    for lib in libs:
        beside = lib.parent / "mlx.metallib"
        if not beside.exists():
            beside.symlink_to(os.path.relpath(source, lib.parent))
            print(f"linked {beside.relative_to(app)} -> {source.relative_to(app.resolve())}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="output folder")
    parser.add_argument("--work", type=Path, default=ROOT / "build", help="PyInstaller work folder")
    args = parser.parse_args(argv)

    start = time.monotonic()
    ensure_icons()
    run_pyinstaller(args.dist.resolve(), args.work.resolve())
    if sys.platform == "darwin":
        result = args.dist / f"{APP_NAME}.app"
        place_metallib(result)
    else:
        result = args.dist / EXE_NAME
        finish_linux(result)
    size = folder_size(result)
    print(f"built {result}  {size / 2**20:.0f} MiB  in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
