"""Replies and user messages are text, not HTML: real widgets, the injection corpus."""

from __future__ import annotations

import pytest

from app.qt import QLabel, QMessageBox, QTextDocument, QWidget
from app.store import Message
from app.ui.chat_view import ChatView
from app.ui.markdown import BREAK, prose_document
from app.ui.message_widget import open_link
from tests.faults.corpus import LINK_CASES, RENDER_CASES, WIDE_CASES


def _message(mid: int, role: str, content: str) -> Message:
    return Message(id=mid, conversation_id=1, parent_id=None, version=1, role=role, content=content)


def _shown_text(widget: QWidget) -> str:
    """What a person sees in a message: every label's text as plain text, breaks removed."""
    parts = []
    blocks = [widget.body.itemAt(i).widget() for i in range(widget.body.count())]
    for label in (b if isinstance(b, QLabel) else b.findChild(QLabel, "codeText") for b in blocks):
        doc = QTextDocument()
        if label.textFormat() == label.textFormat().PlainText:
            doc.setPlainText(label.text())
        else:
            doc.setHtml(label.text())
        parts.append(doc.toPlainText())
    return "\n".join(parts).replace(BREAK, "")


@pytest.fixture
def view(qtbot):
    v = ChatView()
    v.resize(700, 500)
    qtbot.addWidget(v)
    v.show()
    qtbot.waitExposed(v)
    return v


@pytest.mark.parametrize("name,text,shown", RENDER_CASES, ids=[c[0] for c in RENDER_CASES])
@pytest.mark.parametrize("role", ["assistant", "user"])
def test_every_character_is_shown(view, qtbot, role, name, text, shown):
    view.show_thread([_message(1, role, text), _message(2, "assistant", "the last line")], {})
    seen = _shown_text(view.widgets[1])
    for piece in shown if role == "assistant" else [text]:
        assert piece in seen, f"{name}: {piece!r} is not in what is shown: {seen!r}"
    # A tag never swallows what follows: the next message is there and visible.
    assert "the last line" in _shown_text(view.widgets[2])


def test_streamed_reply_with_tags_stays_whole(view, qtbot):
    """The stories260K case: a reply full of <s> shows every character while it streams."""
    reply = "<s> Once upon a time, <s> there was a <div> cat.\n" * 40
    view.start_streaming(_message(5, "assistant", ""))
    for i in range(0, len(reply), 97):
        view.append(reply[i : i + 97], "answer")
        view._flush()
    view.stop_streaming()
    # Markdown joins soft-broken lines with a space; every character is still there.
    assert _shown_text(view.widgets[5]).split() == reply.split()


def _anchors(text: str) -> list[str]:
    doc = prose_document(text)
    out, block = [], doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isAnchor() or fmt.anchorHref():
                out.append(fmt.anchorHref())
            it += 1
        block = block.next()
    return out


@pytest.mark.parametrize("markdown,target", LINK_CASES, ids=[c[0] for c in LINK_CASES])
def test_only_web_links_are_links(markdown, target):
    assert _anchors(markdown) == ([target] if target else [])


@pytest.mark.parametrize("markdown,target", LINK_CASES, ids=[c[0] for c in LINK_CASES])
def test_a_link_opens_after_its_address_is_shown(qtbot, monkeypatch, markdown, target):
    from app.ui import message_widget

    asked, opened = [], []
    monkeypatch.setattr(
        message_widget.QMessageBox,
        "question",
        lambda parent, title, text, *a: asked.append(text) or QMessageBox.StandardButton.Open,
    )
    monkeypatch.setattr(message_widget.QDesktopServices, "openUrl", lambda url: opened.append(url.toString()) or True)
    parent = QWidget()
    qtbot.addWidget(parent)
    url = target or markdown[markdown.index("(") + 1 : -1] if "(" in markdown else markdown.strip("<>")
    assert open_link(parent, url) is bool(target)
    if target:
        assert opened == [target] and target in asked[0]
    else:
        assert not opened and not asked


def test_a_declined_link_does_not_open(qtbot, monkeypatch):
    from app.ui import message_widget

    opened = []
    monkeypatch.setattr(message_widget.QMessageBox, "question", lambda *a: QMessageBox.StandardButton.Cancel)
    monkeypatch.setattr(message_widget.QDesktopServices, "openUrl", lambda url: opened.append(url) or True)
    parent = QWidget()
    qtbot.addWidget(parent)
    assert open_link(parent, "https://example.com") is False and not opened


@pytest.mark.parametrize("name,text", WIDE_CASES, ids=[c[0] for c in WIDE_CASES])
@pytest.mark.parametrize("role", ["assistant", "user"])
def test_a_long_run_does_not_widen_the_column(view, qtbot, role, name, text):
    view.show_thread([_message(1, "user", "hello there"), _message(2, role, text)], {})
    qtbot.wait(50)
    column = view.widget()
    assert column.width() <= view.viewport().width(), f"{name} widened the column to {column.width()}"
    for w in view.widgets.values():
        right = w.mapTo(column, w.rect().topRight()).x()
        assert right <= view.viewport().width(), f"{name} pushed a message past the edge ({right})"
    assert text.strip("`\n") in _shown_text(view.widgets[2])


@pytest.mark.parametrize("role", ["user", "assistant"])
def test_a_1_mb_paste_shows_its_start_at_once_and_the_rest_on_request(view, qtbot, role):
    import time

    from app.qt import QApplication
    from app.ui.message_widget import MAX_SHOWN_CHARS

    text = ("lorem ipsum dolor sit amet " * 40 + "\n") * 900  # 972,900 characters
    started = time.perf_counter()
    view.show_thread([_message(1, role, text)], {})
    QApplication.processEvents()
    took = time.perf_counter() - started
    widget = view.widgets[1]
    assert took < 1.5, f"showing a 1 MB message took {took:.1f} s"
    assert widget.more_button.isVisible()
    assert f"{len(text) - MAX_SHOWN_CHARS:,} more characters" in widget.more_button.text()
    assert widget.content == text  # Copy takes all of it
    widget.copy_button.click()
    assert QApplication.clipboard().text() == text
    widget.show_all()
    assert not widget.more_button.isVisible()
    assert _shown_text(widget).split() == text.split()


def test_names_around_a_message_are_text(view):
    """A model or adapter folder named like HTML shows its name, not a styled fragment."""
    message = _message(1, "assistant", "hi")
    message.model = "<b>bold</b>-model"
    view.show_thread([message], {})
    widget = view.widgets[1]
    widget.set_stats({"generated_tokens": 3}, adapters={"<i>x</i>": 1.0})
    for label in (widget.role_label, widget.stats_label):
        assert label.textFormat() == label.textFormat().PlainText
    assert widget.role_label.text() == "<b>bold</b>-model"
    assert "<i>x</i>" in widget.stats_label.text()
