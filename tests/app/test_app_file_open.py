"""Files the system hands to the app (dropped on the Dock icon, "Open With"): a model
loads, an image goes to the message box. Sent as the QFileOpenEvents macOS delivers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app import tasks
from app.main import parse_args
from app.qt import QApplication, QFileOpenEvent
from app.ui.file_open import install_file_open, open_paths

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints", "does not support raise")  # offscreen noise

VISION_MODEL = Path(__file__).resolve().parents[1] / "golden" / "vision" / "gemma3"


def _open(path) -> None:
    assert QApplication.sendEvent(QApplication.instance(), QFileOpenEvent(str(path)))


def test_opened_model_loads_and_opened_image_is_attached(qtbot, make_window, tmp_path, shared_data):
    model = shutil.copytree(VISION_MODEL, tmp_path / "tiny-gemma3")
    photo = shared_data / "images" / "coffee.png"
    window = make_window()
    handler = install_file_open(window)
    try:
        # Before a vision model is up, the photo is refused with the reason.
        with qtbot.wait_signal(window.composer.refused, timeout=5_000) as refused:
            _open(photo)
        assert "vision model" in refused.args[0] and window.composer.attachments == []

        with qtbot.wait_signal(window.model_loaded, timeout=60_000):
            _open(model)
        assert window.bridge.model_info.path == str(model) and window.bridge.model_info.vision
        _open(photo)
        assert window.composer.attachments == [("image", str(photo))]
    finally:
        QApplication.instance().removeEventFilter(handler)


def test_files_named_at_launch_load_the_model_first_then_attach(qtbot, make_window, tmp_path, shared_data):
    """Linux's "Open With" runs `mlx-desk FILE...` (the .desktop entry's %F): the model
    among them loads before the photo is attached, so a vision model takes it."""
    model = shutil.copytree(VISION_MODEL, tmp_path / "tiny-gemma3")
    photo = shared_data / "images" / "coffee.png"
    args = parse_args([str(photo), str(model)])
    assert args.files == [photo, model] and args.model is None
    window = make_window()
    done = tasks.spawn(open_paths(window, args.files, model=args.model))
    qtbot.wait_until(done.done, timeout=60_000)
    assert done.exception() is None
    assert window.bridge.model_info.path == str(model)
    assert window.composer.attachments == [("image", str(photo))]
