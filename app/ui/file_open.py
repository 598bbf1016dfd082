"""Files handed to the app by the system: dropped on the Dock icon, "Open With", or
double-clicked. macOS delivers them as QFileOpenEvents to the application (the bundle's
Info.plist declares the document types); a model file loads, media goes to the composer.
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


def install_file_open(window) -> FileOpenHandler:
    handler = FileOpenHandler(window)
    QApplication.instance().installEventFilter(handler)
    return handler
