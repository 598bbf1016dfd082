"""A newcomer's careless inputs, on the real engine: each gets a quick, visible answer and
breaks nothing later.

200 picked images, a multi-megabyte paste, a deleted attachments folder, a broken
``mcp.json``, Hub search offline, Start server with no model, load progress, single
newlines in a story, and where an export is offered to go.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
from PIL import Image

from app.controllers.tools import ToolsController
from app.qt import QApplication, QFileDialog, QMimeData
from app.tasks import spawn
from app.ui.composer import MAX_ATTACHMENTS, MAX_MESSAGE_CHARS

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

ROOT = Path(__file__).resolve().parents[2]
GEMMA = ROOT / "tests" / "golden" / "vision" / "gemma3"


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    shutil.copytree(GEMMA, folder)
    return folder


def _pictures(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"photo-{i:03d}.png"
        Image.new("RGB", (40, 30), (i % 256, 90, 160)).save(path)
        paths.append(str(path))
    return paths


# ---- the composer -------------------------------------------------------------------------------


def test_200_picked_images_keep_the_window_on_screen(qtbot, make_window, run_async, vision_model, tmp_path):
    window = make_window()
    assert run_async(window.load_model(str(vision_model)))
    window.resize(1280, 800)
    refused: list[str] = []
    window.composer.refused.connect(refused.append)
    window.composer.add_files(_pictures(tmp_path / "camera", 200))
    QApplication.processEvents()
    qtbot.wait(50)
    assert len(window.composer.attachments) == MAX_ATTACHMENTS
    assert len(refused) == 1 and f"at most {MAX_ATTACHMENTS} attachments" in refused[0]
    assert f"{200 - MAX_ATTACHMENTS} of the 200 files were not attached" in refused[0]
    assert window.error_banner.isVisible() and "at most" in window.error_banner.text()
    assert window.width() <= 1280 and window.minimumSizeHint().width() <= 1280
    send = window.composer.send_button
    corner = send.mapTo(window, send.rect().bottomRight())
    assert corner.x() < window.width() and corner.y() < window.height()  # Send stays in reach
    strip = window.composer.strip
    assert strip.scroll.horizontalScrollBar().maximum() > 0  # the thumbnails scroll sideways
    # The pictures attached are checked and sent as usual.
    qtbot.waitUntil(lambda: not window.composer.checking, timeout=60_000)


def test_a_5_mb_paste_is_refused_at_once(qtbot, make_window):
    window = make_window()
    edit = window.composer.edit
    edit.setPlainText("keep this")
    story = ("a line of a very long pasted story\n") * (5_000_000 // 35)
    for text in (story, "x" * 5_000_000, "y" * 60_000):  # lines, one line, one unbroken run
        mime = QMimeData()
        mime.setText(text)
        started = time.perf_counter()
        edit.insertFromMimeData(mime)
        QApplication.processEvents()
        assert time.perf_counter() - started < 1.0
        assert edit.toPlainText() == "keep this"  # nothing lost, nothing half-pasted
        assert window.error_banner.isVisible()
    assert "too long for one message" in window.statusBar().currentMessage() or "space" in window.error_banner.text()
    mime = QMimeData()
    mime.setText(" and a normal paste")
    edit.moveCursor(edit.textCursor().MoveOperation.End)
    edit.insertFromMimeData(mime)
    assert edit.toPlainText() == "keep this and a normal paste"
    # Text put in by other means is refused at Send just as quickly.
    edit.setPlainText("z " * (MAX_MESSAGE_CHARS // 2 + 10))
    window.error_banner.setVisible(False)
    window.composer.send_button.click()
    assert window.error_banner.isVisible() and "too long" in window.error_banner.text()
    assert edit.toPlainText()  # still in the box


def test_a_deleted_attachments_folder_does_not_break_later_messages(
    qtbot, make_window, run_async, vision_model, tmp_path
):
    data = tmp_path / "data"
    window = make_window(data)
    assert run_async(window.load_model(str(vision_model)))
    window.store.update_conversation(
        window.chat.conversation_id, settings={"max_tokens": 3, "ignore_eos": True, "temperature": 0.0}
    )
    window.composer.add_files(_pictures(tmp_path / "desk", 1))
    qtbot.waitUntil(lambda: not window.composer.checking, timeout=60_000)
    window.composer.edit.setPlainText("what is this?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as first:
        window.composer.send_button.click()
    assert first.args[1].finish_reason in ("stop", "length")

    shutil.rmtree(data / "attachments")  # the person tidies the data folder
    window.bridge.drop_session(window.chat.conversation_id)  # as after a restart: the thread is read again
    statuses: list[str] = []
    window.chat.status.connect(statuses.append)
    for text in ("and now?", "and again?"):
        window.composer.edit.setPlainText(text)
        with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as later:
            window.composer.send_button.click()
        assert later.args[1].finish_reason in ("stop", "length"), later.args[1].error
    assert any("no longer on disk" in s for s in statuses)


# ---- the tools' configuration ---------------------------------------------------------------------


def test_a_broken_mcp_json_is_reported_and_kept_when_a_server_is_added(qtbot, make_window, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    broken = '{"mcpServers": {"files": {"command": "npx", "args": ["-y", "x"]},}}\n'  # a trailing comma
    (data / "mcp.json").write_text(broken)
    window = make_window(data)
    assert "not valid JSON" in window.tools.config_problem and "line 1" in window.tools.config_problem
    assert "MCP tools are off" in window.statusBar().currentMessage()
    dialog = window.open_tools()
    assert "not valid JSON" in dialog.error.text()
    qtbot.keyClicks(dialog.name_edit, "web")
    qtbot.keyClicks(dialog.target_edit, "http://127.0.0.1:8000/mcp")
    dialog.add_button.click()
    kept = sorted(data.glob("mcp-unreadable-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == broken  # the person's file, whole
    assert json.loads((data / "mcp.json").read_text())["mcpServers"] == {"web": {"url": "http://127.0.0.1:8000/mcp"}}
    assert kept[0].name in window.statusBar().currentMessage()
    dialog.close()

    # A good file keeps what this app does not edit (env, other keys), and its last version.
    good = {"mcpServers": {"git": {"command": "uvx", "args": ["mcp-server-git"], "env": {"A": "1"}}}, "theme": "x"}
    (data / "mcp.json").write_text(json.dumps(good))
    tools = ToolsController(data)  # read again, as a new window would
    assert tools.config_problem is None
    tools.add_server("time", "uvx mcp-server-time")
    saved = json.loads((data / "mcp.json").read_text())
    assert saved["theme"] == "x" and saved["mcpServers"]["git"]["env"] == {"A": "1"}
    assert saved["mcpServers"]["time"] == {"command": "uvx", "args": ["mcp-server-time"]}
    assert json.loads((data / "mcp.json.bak").read_text()) == good


def test_an_entry_without_command_or_url_is_named(qtbot, make_window, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "mcp.json").write_text(json.dumps({"mcpServers": {"ok": {"url": "http://127.0.0.1:1/mcp"}, "odd": {}}}))
    window = make_window(data)
    assert [s.name for s in window.tools.servers] == ["ok"]
    assert "odd has neither" in window.tools.config_problem


# ---- models and the server ---------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_search_offline_gives_up_fast_and_says_so(qtbot, make_window, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    window = make_window()
    browser = window.open_model_browser()
    browser.endpoint = f"http://127.0.0.1:{_closed_port()}"  # nothing listens: as offline
    browser.query.setText("qwen")
    started = time.perf_counter()
    with qtbot.wait_signal(browser.searched, timeout=15_000) as blocker:
        spawn(browser.search())
    assert blocker.args == [-1] and time.perf_counter() - started < 5
    assert "Hub search failed" in browser.results_title.text()
    assert "cannot be reached" in browser.results_title.text()
    assert browser.minimumSizeHint().width() < 1000  # the line wraps; the dialog keeps its width
    assert "Hub search failed" in window.statusBar().currentMessage()

    # Downloading is told as quickly.
    notices: list[str] = []
    browser.notice.connect(notices.append)
    started = time.perf_counter()
    spawn(browser.download("tiny-org/tiny-model"))
    qtbot.waitUntil(lambda: any("Download of tiny-org/tiny-model failed" in n for n in notices), timeout=15_000)
    assert time.perf_counter() - started < 5 and "cannot be reached" in notices[-1]

    # A host that takes the connection and never answers: the search's deadline ends it.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        browser.endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        browser.search_timeout_s = 1.5
        started = time.perf_counter()
        with qtbot.wait_signal(browser.searched, timeout=15_000) as blocker:
            spawn(browser.search())
        assert blocker.args == [-1] and time.perf_counter() - started < 5
        assert "Hub search failed" in browser.results_title.text()
    finally:
        silent.close()


def test_start_server_with_no_model_says_so(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    menu = window.server_menu
    menu.port.setValue(_closed_port())
    menu.toggle()
    try:
        assert menu.controller.running
        assert window.error_banner.isVisible() and "no model is loaded" in window.error_banner.text()
    finally:
        menu.toggle()
    assert not window.error_banner.isVisible()  # stopped: the line no longer holds
    assert run_async(window.load_model(str(tiny_model)))
    menu.port.setValue(_closed_port())
    menu.toggle()
    try:
        assert "Server listening on" in window.statusBar().currentMessage()
        assert "no model" not in window.statusBar().currentMessage()
    finally:
        menu.toggle()


def test_loading_shows_its_progress(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    seen: list[tuple[bool, str, int]] = []

    def look(request_id, stage, done, total, message):
        if stage == "load":  # after the window's own slot: what the person sees at this moment
            seen.append((window.load_bar.isVisible(), window.model_button.text(), window.load_bar.value()))

    window.bridge.progress.connect(look)
    assert run_async(window.load_model(str(tiny_model)))
    assert seen, "the engine reported no load progress"
    assert all(visible for visible, _, _ in seen)
    assert any(text.startswith("Loading tiny-llama… ") and text.endswith("%") for _, text, _ in seen)
    assert not window.load_bar.isVisible() and window.model_button.text().startswith("tiny-llama")


# ---- what a reply and an export look like ------------------------------------------------------------


def test_markdown_keeps_single_newlines(qtbot):
    from app.ui.markdown import prose_document

    story = "Once upon a time\nthere was a fox.\nThe end.\n\nA new paragraph\n- one\n- two"
    text = prose_document(story).toPlainText()
    assert text.splitlines()[:3] == ["Once upon a time", "there was a fox.", "The end."]
    assert "A new paragraph" in text and "one" in text
    table = prose_document("| a | b |\n|---|---|\n| 1 | 2 |").toHtml()
    assert table.count("<table") == 1  # tables still tables


def test_export_is_offered_in_the_documents_folder(qtbot, make_window, monkeypatch, tmp_path):
    documents = tmp_path / "home" / "Documents"
    documents.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DOCUMENTS_DIR", str(documents))
    monkeypatch.chdir(tmp_path)  # where the app was started: not where exports go
    window = make_window()
    asked: list[str] = []

    def save_dialog(parent, caption, start, *rest, **kw):
        asked.append(start)
        return str(documents / "chat.md"), ""

    monkeypatch.setattr(QFileDialog, "getSaveFileName", save_dialog)
    cid = window.chat.conversation_id
    window.store.add_message(cid, "user", "hello", None)
    window.sidebar.export(cid, "md")
    assert Path(asked[0]).parent == documents and asked[0].endswith(".md")
    assert (documents / "chat.md").read_text().startswith("#")
