"""Files handed to the app by the system: dropped on the Dock icon, "Open With", or
double-clicked. macOS delivers them as QFileOpenEvents to the application (the bundle's
Info.plist declares the document types); Linux desktops pass them on the command line
(the .desktop entry's %F). A model file loads, media goes to the composer.
"""

from __future__ import annotations

from pathlib import Path

from app import tasks
from app.qt import QApplication, QEvent, QObject


def is_model(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" or (path.is_dir() and (path / "config.json").is_file())


class FileOpenHandler(QObject):
    def __init__(self, window) -> None:
        super().__init__(window)
        self.window = window

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt override
        if event.type() != QEvent.Type.FileOpen:
            return False
        path = Path(event.file() or event.url().toLocalFile())
        self.window.raise_()
        self.window.activateWindow()
        if is_model(path):
            tasks.spawn(self.window.load_model(str(path)))
        else:
            self.window.composer.add_files([str(path)])
        return True


async def open_paths(window, paths: list[Path], model: str | None = None) -> None:
    """Files named at launch: the model (``model``, else the last model file among them)
    loads first, so media it can take is attached rather than refused; with no model at
    all, the model loaded last time loads again, else the first-run offer of models appears."""
    files = [p for p in paths if not is_model(p)]
    model = model or next((str(p) for p in reversed(paths) if is_model(p)), None)
    if model:
        await window.load_model(model)
    elif not await window.reload_last_model():
        await window.offer_models_on_first_run()
    if files:
        window.composer.add_files([str(p) for p in files])


def install_file_open(window) -> FileOpenHandler:
    handler = FileOpenHandler(window)
    QApplication.instance().installEventFilter(handler)
    return handler
