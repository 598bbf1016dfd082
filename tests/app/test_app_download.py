"""Search, download (progress, cancel, resume) and delete in the model browser, against a
local server that answers as the Hugging Face Hub does (tests/fake_hub.py). No network."""

from __future__ import annotations

import pytest

from app.qt import QApplication, QMessageBox, Qt, QTimer
from tests.fake_hub import FakeHub

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

REPO = "mlx-community/tiny-llama-chat"


@pytest.fixture
def hub(tiny_model):
    with FakeHub() as server:
        server.repos[REPO] = {f.name: f.read_bytes() for f in sorted(tiny_model.iterdir())}
        server.repos["someone/unrelated-model"] = {"config.json": b"{}"}
        yield server


def _answer_confirmation(qtbot, button: QMessageBox.StandardButton, seen: list[str]) -> None:
    """Click ``button`` in the confirmation box as soon as it is up."""

    def click():
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, click)
            return
        seen.append(box.text())
        box.button(button).click()

    QTimer.singleShot(0, click)


def test_search_download_cancel_resume_then_delete(qtbot, make_window, hub, tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    window = make_window()
    browser = window.open_model_browser()
    browser.endpoint = hub.endpoint
    with qtbot.wait_signal(browser.refreshed, timeout=30_000):
        pass
    assert browser.table.rowCount() == 0

    # Search: Enter in the search box asks the hub.
    browser.tabs.setCurrentIndex(1)
    qtbot.keyClicks(browser.query, "tiny")
    with qtbot.wait_signal(browser.searched, timeout=30_000) as searched:
        qtbot.keyClick(browser.query, Qt.Key.Key_Return)
    assert searched.args == [1]
    assert browser.results.item(0, 0).text() == REPO
    browser.results.selectRow(0)

    # Download, held back at the weights, then cancelled there.
    names = sorted(hub.repos[REPO])
    release = hub.hold("model.safetensors")
    values: list[int] = []
    browser.progress.valueChanged.connect(values.append)
    notices: list[str] = []
    browser.notice.connect(notices.append)
    browser.download_button.click()
    qtbot.waitUntil(lambda: hub.gets["model.safetensors"] == 1, timeout=30_000)
    qtbot.waitUntil(lambda: browser.progress.value() > 0, timeout=10_000)
    assert browser.progress.isVisible() and browser.cancel_button.isVisible()
    assert not browser.download_button.isEnabled()
    before_weights = sum(len(hub.repos[REPO][n]) for n in names[: names.index("model.safetensors")])
    total = sum(len(b) for b in hub.repos[REPO].values())
    assert browser.progress.value() == int(1000 * before_weights / total)
    browser.cancel_button.click()
    release.set()
    qtbot.waitUntil(lambda: any("stopped" in n for n in notices), timeout=30_000)
    assert "run it again to resume" in notices[-1]
    assert not browser.progress.isVisible()
    assert browser.download_button.isEnabled()

    # Resume: the files finished before the cancel are not fetched again.
    values.clear()
    with qtbot.wait_signal(browser.downloaded, timeout=60_000):
        browser.download_button.click()
    for name in names:
        expected = 2 if name == "model.safetensors" else 1
        assert hub.gets[name] == expected, (name, dict(hub.gets))
    assert values[-1] == 1000 and values == sorted(values)  # from the resumed point up to done
    shown = [v for v in values if v >= 0]  # -1: Qt's busy bar before the first figure
    assert shown[0] == int(1000 * before_weights / total)  # not back to zero

    # The download shows up on the local tab, selected, with its memory badge.
    assert browser.tabs.currentIndex() == 0
    row = browser.table.currentRow()
    assert browser.table.item(row, 0).text() == REPO
    assert browser.table.item(row, 6).text().startswith("✓ fits")

    # Delete asks first: "No" keeps it, "Yes" removes it from disk and from the list.
    seen: list[str] = []
    _answer_confirmation(qtbot, QMessageBox.StandardButton.No, seen)
    browser.delete_button.click()
    assert seen and REPO in seen[0]
    assert browser.table.rowCount() == 1
    _answer_confirmation(qtbot, QMessageBox.StandardButton.Yes, seen)
    with qtbot.wait_signal(browser.refreshed, timeout=30_000):
        browser.delete_button.click()
    assert browser.table.rowCount() == 0
    assert not (cache / ("models--" + REPO.replace("/", "--"))).exists()
    assert f"Deleted {REPO}" in notices
