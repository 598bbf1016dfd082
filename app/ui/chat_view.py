"""The conversation: a scrolling column of MessageWidgets with a throttled live tail.

Tokens can arrive hundreds of times a second; re-laying out Markdown that often
would stall the GUI thread. Incoming text only goes into a buffer; a timer
repaints the streaming message at most ~30 times a second.
"""

from __future__ import annotations

from collections.abc import Callable

from app.qt import (
    QFrame,
    QLabel,
    QScrollArea,
    Qt,
    QTimer,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.store import Message
from app.ui.message_widget import MessageWidget

REPAINT_INTERVAL_MS = 33


class ChatView(QScrollArea):
    edit_submitted = Signal(int, str)
    regenerate_requested = Signal(int)
    version_requested = Signal(int, int)
    repainted = Signal()  # after each throttled repaint of the streaming message

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.dark = False
        inner = QWidget(objectName="chatColumn")
        self.column = QVBoxLayout(inner)
        self.column.setContentsMargins(32, 24, 32, 24)
        self.column.setSpacing(20)
        self.empty_label = QLabel(
            "Pick a model, then say hello.\nEnter sends · Shift+Enter adds a line · Esc stops",
            objectName="emptyState",
        )
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.column.addWidget(self.empty_label, 1)
        self.column.addStretch(1)
        self.setWidget(inner)
        self.widgets: dict[int, MessageWidget] = {}
        self.streaming: MessageWidget | None = None
        # Called at each repaint while streaming: the live footer (tokens, tok/s, elapsed).
        self.footer_source: Callable[[], str] | None = None
        self._answer = ""
        self._reasoning = ""
        self._draft = ""  # block diffusion: the block still refining, shown after the answer
        self._dirty = False
        self._follow = True
        self._timer = QTimer(self)
        self._timer.setInterval(REPAINT_INTERVAL_MS)
        self._timer.timeout.connect(self._flush)
        self.verticalScrollBar().rangeChanged.connect(self._keep_at_bottom)
        self.verticalScrollBar().valueChanged.connect(self._note_scroll)

    # ---- whole thread -----------------------------------------------------------------

    def show_thread(self, messages: list[Message], versions: dict[int, tuple[int, int]]) -> None:
        self.stop_streaming()
        for w in self.widgets.values():
            self.column.removeWidget(w)
            w.deleteLater()
        self.widgets.clear()
        for m in messages:
            if m.role == "system":
                continue
            w = self._add(m.id, m.role, m.model)
            w.set_attachments(m.attachments)
            w.set_text(m.content, m.reasoning)
            w.set_stats(m.stats, m.status, m.adapters)
            w.set_versions(*versions.get(m.id, (1, 1)))
        self.empty_label.setVisible(not self.widgets)
        self._follow = True
        self._scroll_to_bottom()

    def _add(self, message_id: int, role: str, name: str = "") -> MessageWidget:
        w = MessageWidget(message_id, role, self.dark, name)
        w.edit_submitted.connect(self.edit_submitted)
        w.regenerate_requested.connect(self.regenerate_requested)
        w.version_requested.connect(self.version_requested)
        self.column.insertWidget(self.column.count() - 1, w)
        self.widgets[message_id] = w
        self.empty_label.setVisible(False)
        return w

    def add_message(self, message: Message, versions: tuple[int, int] = (1, 1)) -> MessageWidget:
        w = self._add(message.id, message.role, message.model)
        w.set_attachments(message.attachments)
        w.set_text(message.content, message.reasoning)
        w.set_versions(*versions)
        self._follow = True
        return w

    def set_busy(self, busy: bool) -> None:
        for w in self.widgets.values():
            w.set_busy(busy)

    # ---- streaming tail ------------------------------------------------------------------

    def start_streaming(self, message: Message, versions: tuple[int, int] = (1, 1)) -> None:
        self.streaming = self.add_message(message, versions)
        self.streaming.stats_label.setText("Reading the prompt…")
        self._answer, self._reasoning = message.content, message.reasoning
        self._draft = ""
        self._dirty = False
        self._timer.start()

    def append(self, text: str, channel: str) -> None:
        if channel == "reasoning":
            self._reasoning += text
        else:
            self._answer += text
        self._draft = ""  # settled text ends the block that was refining
        self._dirty = True

    def set_draft(self, text: str) -> None:
        """Replace the refining block's text (block diffusion); the next ``append`` settles it."""
        self._draft = text
        self._dirty = True

    def set_answer(self, text: str) -> None:
        """Replace the streaming reply's answer so far (a tool call's raw markers, by its record)."""
        self._answer = text
        self._dirty = True

    def _flush(self) -> None:
        if self.streaming is None:
            return
        if self.footer_source is not None:
            footer = self.footer_source()
            if footer != self.streaming.stats_label.text():
                self.streaming.stats_label.setText(footer)
        if self._dirty:
            self._dirty = False
            self.streaming.set_text(self._answer, self._reasoning)
            self.streaming.set_draft(self._draft)
            emit(self.repainted)

    def stop_streaming(self) -> None:
        if self._draft:  # a block cut short (Stop) never settles: only settled text stays
            self._draft = ""
            self._dirty = True
        self._flush()
        self._timer.stop()
        self.streaming = None

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        # Keep lines readable on wide windows: the column is at most ~880 px wide.
        side = max(28, (self.viewport().width() - 880) // 2)
        self.column.setContentsMargins(side, 24, side, 24)
        super().resizeEvent(event)

    # ---- scrolling: follow the bottom unless the user scrolled up ------------------------

    def _note_scroll(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 40

    def _keep_at_bottom(self, _min: int, _max: int) -> None:
        if self._follow:
            self._scroll_to_bottom()

    def _scroll_to_bottom(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())
