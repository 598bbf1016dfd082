"""Entry point: ``mlx-desk [--model PATH] [--data-dir DIR]`` (also ``python -m app.main``).

The window is shown first; the engine (and with it mlx) is imported and the
model loaded afterwards, on the event loop, so the app opens at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from app import __version__ as APP_VERSION  # noqa: N812


def default_data_dir() -> Path:
    """The platform's app-data folder (Qt's AppDataLocation when available)."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "MLX Desk"
    if os.name == "nt":
        return Path(os.environ.get("APPDATA", Path.home())) / "MLX Desk"
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "mlx-desk"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlx-desk", description="Chat with local models on MLX.")
    p.add_argument("--model", help="model folder, .gguf file or Hugging Face repo id to load")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where history.sqlite3 and presets live (default: the app-data folder)")
    p.add_argument("--version", action="version", version=f"MLX Desk {APP_VERSION}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import qasync

    from app.bridge import EngineBridge, EngineUnavailable
    from app.qt import QApplication, QIcon
    from app.resources import resource_path
    from app.store import HistoryStore
    from app.tasks import spawn
    from app.ui.main_window import MainWindow
    from app.ui.theme import apply_theme

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("MLX Desk")
    app.setOrganizationName("MLX Desk")
    app.setApplicationVersion(APP_VERSION)
    icon = resource_path("icons/mlx-desk.svg")
    if icon.exists():
        app.setWindowIcon(QIcon(str(icon)))
    dark = apply_theme(app)

    data_dir = args.data_dir or default_data_dir()
    try:
        store = HistoryStore(data_dir)
    except Exception as exc:  # noqa: BLE001 - a readable line, then out
        print(f"mlx-desk: cannot open the history in {data_dir}: {exc}", file=sys.stderr)
        return 2

    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    bridge = EngineBridge()
    window = MainWindow(store, bridge, dark=dark)
    window.show()
    # Follow the system when it switches between light and dark while the app runs.
    app.styleHints().colorSchemeChanged.connect(lambda _scheme: apply_theme(app))
    window.composer.edit.setFocus()

    async def start_engine() -> None:
        await asyncio.sleep(0)  # let the window paint before the heavy import
        try:
            bridge.start()
        except EngineUnavailable as exc:
            window.show_error(str(exc))
            return
        if args.model:
            await window.load_model(args.model)

    app_closing = asyncio.Event()
    app.aboutToQuit.connect(app_closing.set)
    with loop:
        spawn(start_engine())
        loop.run_until_complete(app_closing.wait())
    bridge.shutdown(5.0)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
