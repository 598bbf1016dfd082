"""The conversation: a scrolling column of MessageWidgets with a throttled live tail.

Tokens can arrive hundreds of times a second; re-laying out Markdown that often
would stall the GUI thread. Incoming text only goes into a buffer; a timer
repaints the streaming message at most ~30 times a second.

A long chat is not a long column of widgets: only the messages near the viewport (one
viewport above and below it) are real MessageWidgets. The rest are plain records with a
height (measured when they were last shown, estimated from their text before that), and
two spacers stand in for them above and below, so the scrollbar spans the whole chat and
stays honest. Scrolling builds the widgets coming into view and frees those leaving it;
appending a message adds one widget and leaves the others' layout alone; showing another
chat frees every widget of the last one. The last message is always a real widget (the
live tail while streaming). Freed message widgets are kept (a few of each role) and filled
with the next messages to show: switching chats or scrolling mostly refills widgets
rather than making new ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

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
SPACING = 20  # between messages
MARGIN_Y = 24  # above the first message and below the last
# Building a message widget costs milliseconds (Markdown, style, layout); a screenful built
# at once stalled the window for 100-240 ms. A call from the app builds AT_ONCE widgets (when
# following the bottom: the last question and its answer, so the latest exchange is there in
# the first frame); the rest are built in passes of the event loop, newest first, each
# building for at most SLICE_MS (one widget at least), so that a pass with the layout and
# paint that follow it stays within a frame or two.
AT_ONCE = 2
SLICE_MS = 6.0
DIVIDER = "context_divider"  # the entry key of the "outside the model's context" line
SPARE_PER_ROLE = 8  # freed widgets kept for reuse, per role: about a screenful in all


@dataclass
class _Entry:
    """One row of the transcript: a message, or the line where the model's context begins."""

    message: Message | None
    versions: tuple[int, int] = (1, 1)
    divider: str = ""
    height: int = 0  # last measured at ``width``; 0: never shown at this width
    width: int = 0
    guess: int = 0  # estimated from the text at ``guess_width``, until measured
    guess_width: int = 0
    draft: str | None = None  # an edit in progress when its widget was freed
    show_all: bool = False  # a long message opened in full ("Show N more characters")

    @property
    def key(self) -> int | str:
        return self.message.id if self.message is not None else DIVIDER


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
        self.column.setContentsMargins(32, MARGIN_Y, 32, MARGIN_Y)
        self.column.setSpacing(SPACING)
        self.empty_label = QLabel(
            "Pick a model, then say hello.\nEnter sends · Shift+Enter adds a line · Esc stops",
            objectName="emptyState",
        )
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.column.addWidget(self.empty_label, 1)
        # Stand-ins for the messages above and below the ones built as widgets.
        self._above, self._below = QWidget(objectName="transcriptSpacer"), QWidget(objectName="transcriptSpacer")
        for spacer in (self._above, self._below):
            spacer.setVisible(False)
            self.column.addWidget(spacer)
        self.column.addStretch(1)
        self.setWidget(inner)
        self.entries: list[_Entry] = []
        self.widgets: dict[int, MessageWidget] = {}  # the messages built as widgets now
        self._spare: dict[str, list[MessageWidget]] = {}  # role -> freed widgets, hidden, to refill
        self.divider: QLabel | None = None  # the context line, while built
        self._window = (0, 0)  # entries[lo:hi] are built (and always the last one)
        self._anchor: tuple[int, int] | None = None  # (entry, its top minus the view's top)
        self._busy = False
        self._moving = False
        self.streaming: MessageWidget | None = None
        # Called at each repaint while streaming: the live footer (tokens, tok/s, elapsed).
        self.footer_source: Callable[[], str] | None = None
        self._answer = ""
        self._reasoning = ""
        self._draft = ""  # block diffusion: the block still refining, shown after the answer
        self._draft_reasoning = ""  # its thinking part, shown in the reasoning section
        self._dirty = False
        self._follow = True
        self._timer = QTimer(self)
        self._timer.setInterval(REPAINT_INTERVAL_MS)
        self._timer.timeout.connect(self._flush)
        # Scrolling and resizing rebuild the window once the event loop is free (many
        # scroll steps in one go cost one pass).
        self._sync_timer = QTimer(self)
        self._sync_timer.setSingleShot(True)
        self._sync_timer.setInterval(0)
        self._sync_timer.timeout.connect(lambda: self._sync(SLICE_MS, 1))
        self.verticalScrollBar().rangeChanged.connect(self._keep_at_bottom)
        self.verticalScrollBar().valueChanged.connect(self._note_scroll)

    # ---- whole thread -----------------------------------------------------------------

    def show_thread(self, messages: list[Message], versions: dict[int, tuple[int, int]]) -> None:
        """Show ``messages``; those already shown unchanged (the same chat, one turn on) keep
        their widgets, the rest are freed and rebuilt as they come into view."""
        self.stop_streaming()
        self._drop_divider()  # the controller marks the context again for this thread
        wanted = [_Entry(m, versions.get(m.id, (1, 1))) for m in messages if m.role != "system"]
        same = 0
        while same < min(len(self.entries), len(wanted)) and _same(self.entries[same], wanted[same]):
            same += 1
        if same == 0:  # another chat: free every widget of the last one
            self._free_all()
        for entry in self.entries[same:]:
            self._free(entry)
        self.entries = self.entries[:same] + wanted[same:]
        self.empty_label.setVisible(not self.entries)
        self._follow = True
        self._sync(at_least=min(AT_ONCE, len(wanted) - same) if same else AT_ONCE)  # what changed, at once
        self._scroll_to_bottom()

    def add_message(self, message: Message, versions: tuple[int, int] = (1, 1)) -> MessageWidget:
        self.entries.append(_Entry(message, versions))
        self.empty_label.setVisible(False)
        self._follow = True
        self._sync(at_least=1)
        return self.widgets[message.id]

    def update_message(
        self,
        message_id: int,
        content: str,
        reasoning: str,
        stats: dict,
        status: str,
        adapters: dict[str, float],
    ) -> None:
        """A message's final text and figures (a reply that ended), widget or not."""
        i = self._find(message_id)
        if i is None:
            return
        entry = self.entries[i]
        entry.message = replace(
            entry.message, content=content, reasoning=reasoning, stats=dict(stats), status=status, adapters=adapters
        )
        entry.width = entry.guess_width = 0  # measure again
        w = self.widgets.get(message_id)
        if w is not None:
            w.set_text(content, reasoning)
            w.set_stats(stats, status, adapters)

    def set_context_start(self, dropped: int, before_id: int | None) -> None:
        """Mark where the model's memory begins: a line saying ``dropped`` earlier messages
        are outside its context, just above message ``before_id`` (none: no line). When
        more messages are above the line than were left out, the first ones are still read
        (truncate the middle keeps the first exchange), and the line says so."""
        self._drop_divider()
        i = self._find(before_id) if before_id is not None and dropped > 0 else None
        if i is None:
            return
        s = "s are" if dropped != 1 else " is"
        text = f"{dropped} earlier message{s} outside the model's context"
        if i > dropped:
            text += " (it still reads the first exchange)"
        self.entries.insert(i, _Entry(None, divider=text))
        self._sync(at_least=1)

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        for w in self.widgets.values():
            w.set_busy(busy)

    @property
    def filling(self) -> bool:
        """Whether passes are still due: widgets to build near the viewport, or to measure."""
        return self._sync_timer.isActive()

    @property
    def live_widgets(self) -> int:
        """Message widgets alive now (those built, the spares kept for reuse, and freed ones
        not yet deleted by Qt)."""
        return len(self.widget().findChildren(MessageWidget))

    # ---- streaming tail ------------------------------------------------------------------

    def start_streaming(self, message: Message, versions: tuple[int, int] = (1, 1)) -> None:
        self.streaming = self.add_message(message, versions)
        self.streaming.stats_label.setText("Reading the prompt…")
        self._answer, self._reasoning = message.content, message.reasoning
        self._draft = self._draft_reasoning = ""
        self._dirty = False
        self._timer.start()

    def append(self, text: str, channel: str) -> None:
        if channel == "reasoning":
            self._reasoning += text
        else:
            self._answer += text
        self._draft = self._draft_reasoning = ""  # settled text ends the block that was refining
        self._dirty = True

    def set_draft(self, text: str, reasoning: str = "") -> None:
        """Replace the refining block's text (block diffusion): ``text``, its answer part, muted
        after the answer; ``reasoning``, its thinking part, after the reasoning so far (the
        engine has split it as settled text, markers out). The next ``append`` settles it."""
        self._draft, self._draft_reasoning = text, reasoning
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
            self.streaming.set_text(self._answer, self._reasoning + self._draft_reasoning)
            self.streaming.set_draft(self._draft)
            i = self._find(self.streaming.message_id)
            if i is not None:
                entry = self.entries[i]
                entry.message = replace(entry.message, content=self._answer, reasoning=self._reasoning)
                entry.guess_width = 0
            emit(self.repainted)

    def stop_streaming(self) -> None:
        if self._draft or self._draft_reasoning:  # a block cut short (Stop) never settles: only settled text stays
            self._draft = self._draft_reasoning = ""
            self._dirty = True
        self._flush()
        self._timer.stop()
        self.streaming = None

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        # Keep lines readable on wide windows: the column is at most ~880 px wide.
        side = max(28, (self.viewport().width() - 880) // 2)
        self.column.setContentsMargins(side, MARGIN_Y, side, MARGIN_Y)
        super().resizeEvent(event)
        self._sync_timer.start()

    # ---- the built window ------------------------------------------------------------------

    def _find(self, key: int | str | None) -> int | None:
        for i in range(len(self.entries) - 1, -1, -1):  # recent messages are asked for most
            if self.entries[i].key == key:
                return i
        return None

    def _content_width(self) -> int:
        margins = self.column.contentsMargins()
        return max(100, self.viewport().width() - margins.left() - margins.right())

    def _height(self, entry: _Entry, width: int, line: int, char: int) -> int:
        """Measured at this width, else an estimate from the text (``line`` pixels a line of
        ``char``-pixel characters), kept until the width changes."""
        if entry.height and entry.width == width:
            return entry.height
        if entry.guess_width != width:
            entry.guess_width = width
            if entry.message is None:
                entry.guess = line + 8
            else:
                per_line = max(16, width // max(1, char))
                lines = sum(1 + len(t) // per_line for t in entry.message.content.splitlines()) or 1
                extra = 140 if entry.message.attachments else 0
                entry.guess = 3 * line + 24 + lines * line + extra
        return entry.guess

    def _measure(self, entry: _Entry, widget: QWidget, width: int) -> None:
        if not widget.isVisible() or widget.width() <= 0:
            return  # not laid out yet: measured at the next pass
        layout = widget.layout()
        hint = layout.totalHeightForWidth(widget.width()) if layout is not None and layout.hasHeightForWidth() else -1
        entry.height = hint if hint > 0 else widget.sizeHint().height()
        entry.width = width

    def _sync(self, slice_ms: float = 0.0, at_least: int = AT_ONCE) -> None:
        """Build the entries near the viewport as widgets (``at_least`` of them, more for up
        to ``slice_ms``; the rest in the next pass), free the others, and size the spacers
        for what is not built; keep the first visible entry where it was."""
        self._sync_timer.stop()
        deadline = time.perf_counter() + slice_ms / 1000  # computing the window counts too
        n = len(self.entries)
        if n == 0:
            self._set_spacer(self._above, 0)
            self._set_spacer(self._below, 0)
            self._window = (0, 0)
            return
        width = self._content_width()
        for i, entry in enumerate(self.entries):
            built = self._built(entry)
            if built is not None and (entry.width != width or i == n - 1):
                self._measure(entry, built, width)
        metrics = self.fontMetrics()
        line, char = metrics.lineSpacing(), metrics.averageCharWidth()
        heights = [self._height(e, width, line, char) for e in self.entries]
        tops, y = [], MARGIN_Y
        for h in heights:
            tops.append(y)
            y += h + SPACING
        total = y - SPACING + MARGIN_Y
        bar, view_h = self.verticalScrollBar(), max(1, self.viewport().height())
        if self._follow:
            view_top = max(0, total - view_h)
        elif self._anchor is not None and self._anchor[0] < n:
            view_top = max(0, tops[self._anchor[0]] - self._anchor[1])  # measured heights above moved it
        else:
            view_top = bar.value()
        # Wanted: a viewport above and below the visible entries.
        first = next((i for i in range(n) if tops[i] + heights[i] > view_top), n - 1)
        vhi = next((i for i in range(first, n) if tops[i] >= view_top + view_h), n)
        tlo = next((i for i in range(n) if tops[i] + heights[i] >= view_top - view_h), first)
        thi = max(vhi, next((i for i in range(vhi, n) if tops[i] > view_top + 2 * view_h), n))
        lo, hi = self._grow(
            n - 1 if self._follow else first, (first, max(vhi, first + 1)), (tlo, thi), deadline, at_least
        )
        self._rebuild(lo, hi)
        self._set_spacer(self._above, tops[lo] - MARGIN_Y - SPACING if lo > 0 else 0)
        gap_end = n - 1 if hi < n else hi  # the last entry is always built
        self._set_spacer(self._below, tops[gap_end] - tops[hi] - SPACING if gap_end > hi else 0)
        self._anchor = (first, tops[first] - view_top)
        if not self._follow and view_top != bar.value():
            self.widget().layout().activate()
            self._moving = True
            try:
                bar.setValue(view_top)
            finally:
                self._moving = False
        if (lo, hi) != (min(tlo, lo), max(thi, hi)) or any(
            self._built(e) is not None and e.width != width for e in self.entries
        ):
            self._sync_timer.start()  # more to build, or new widgets to measure once laid out

    def _grow(
        self, seed: int, visible: tuple[int, int], wanted: tuple[int, int], deadline: float, at_least: int
    ) -> tuple[int, int]:
        """The entries to have built: a run from ``seed`` (always built) over the visible
        ones, below the seed first, then above it (following the bottom, the seed is the
        newest message: the screen fills newest first), then over the wanted margin on
        both sides. Entries already built cost nothing; ``at_least`` new ones are built,
        then more until ``deadline``."""
        if self._built(self.entries[seed]) is None:
            self._build(self.entries[seed])
            at_least -= 1

        def take(i: int) -> bool:
            nonlocal at_least
            if self._built(self.entries[i]) is not None:
                return True
            if at_least <= 0 and time.perf_counter() >= deadline:
                return False
            at_least -= 1
            self._build(self.entries[i])
            return True

        lo, hi = seed, seed + 1
        while hi < visible[1] and take(hi):
            hi += 1
        while lo > visible[0] and take(lo - 1):
            lo -= 1
        if lo > visible[0] or hi < visible[1]:
            return lo, hi  # what is on screen comes first; the margin waits
        grew = True
        while grew:
            grew = False
            if lo > wanted[0] and take(lo - 1):
                lo, grew = lo - 1, True
            if hi < wanted[1] and take(hi):
                hi, grew = hi + 1, True
        return lo, hi

    def _built(self, entry: _Entry) -> QWidget | None:
        if entry.message is None:
            return self.divider
        return self.widgets.get(entry.message.id)

    def _rebuild(self, lo: int, hi: int) -> None:
        n = len(self.entries)
        keep = set(range(lo, hi)) | {n - 1}
        for i, entry in enumerate(self.entries):
            if i not in keep and self._built(entry) is not None:
                self._free(entry)
        self._window = (lo, hi)
        # Built widgets sit in entry order: those of the window between the spacers, the
        # last entry after the lower spacer when the window does not reach it.
        at = self.column.indexOf(self._above) + 1
        for i in sorted(keep):
            if i == n - 1 and hi < n:
                at = self.column.indexOf(self._below) + 1
            entry = self.entries[i]
            w = self._built(entry) or self._build(entry)
            if self.column.indexOf(w) != at:
                self.column.removeWidget(w)
                self.column.insertWidget(at, w)
            at += 1

    def _build(self, entry: _Entry) -> QWidget:
        if entry.message is None:
            self.divider = QLabel(entry.divider, objectName="contextDivider")
            self.divider.setAlignment(Qt.AlignmentFlag.AlignCenter)
            self.divider.setTextFormat(Qt.TextFormat.PlainText)
            return self.divider
        m = entry.message
        spare = self._spare.get(m.role)
        reused = bool(spare)
        if spare:
            w = spare.pop()
            w.reuse(m.id, m.model, self.dark)
        else:
            w = MessageWidget(m.id, m.role, self.dark, m.model)
            w.edit_submitted.connect(self.edit_submitted)
            w.regenerate_requested.connect(self.regenerate_requested)
            w.version_requested.connect(self.version_requested)
        w.set_attachments(m.attachments)
        w.set_text(m.content, m.reasoning)
        if m.status != "streaming":
            w.set_stats(m.stats, m.status, m.adapters)
        w.set_versions(*entry.versions)
        w.set_busy(self._busy)
        if entry.show_all:
            w.show_all()
        if entry.draft is not None:
            w.start_edit()
            w.editor.setPlainText(entry.draft)
            entry.draft = None
        if reused:  # hidden when it was freed; shown here, so a pass's time budget counts it
            w.show()
        self.widgets[m.id] = w
        return w

    def _free(self, entry: _Entry) -> None:
        w = self._built(entry)
        if w is None:
            return
        if isinstance(w, MessageWidget):
            if w.editor is not None:
                entry.draft = w.editor.toPlainText()
            entry.show_all = w._show_all
            del self.widgets[w.message_id]
        else:
            self.divider = None
        focus = w.window().focusWidget()
        if focus is not None and (focus is w or w.isAncestorOf(focus)):
            # Qt would hand focus to the next button and scroll it into view: a jump.
            self.setFocus(Qt.FocusReason.OtherFocusReason)
        self.column.removeWidget(w)
        w.hide()
        spare = self._spare.setdefault(w.role, []) if isinstance(w, MessageWidget) else None
        if spare is not None and len(spare) < SPARE_PER_ROLE:
            spare.append(w)  # hidden, out of the layout, until a message of its role needs it
        else:
            w.deleteLater()

    def _free_all(self) -> None:
        for entry in self.entries:
            self._free(entry)
        self._window = (0, 0)
        self._anchor = None

    def _drop_divider(self) -> None:
        i = self._find(DIVIDER)
        if i is not None:
            self._free(self.entries.pop(i))

    @staticmethod
    def _set_spacer(spacer: QWidget, height: int) -> None:
        spacer.setFixedHeight(max(0, height))
        spacer.setVisible(height > 0)

    # ---- scrolling: follow the bottom unless the user scrolled up ------------------------

    def _note_scroll(self, value: int) -> None:
        if self._moving:  # the window keeping its place, not the user
            return
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 40
        self._anchor = None  # the user moved: the window follows the scrollbar
        self._sync_timer.start()

    def _keep_at_bottom(self, _min: int, _max: int) -> None:
        if self._follow:
            self._scroll_to_bottom()

    def _scroll_to_bottom(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())


def _same(a: _Entry, b: _Entry) -> bool:
    """Whether entry ``a`` already shows ``b``: the same message with the same text, figures
    and versions (its save times may differ: a finished reply is updated in place)."""
    x, y = a.message, b.message
    if x is None or y is None:
        return False
    shown = ("id", "role", "content", "reasoning", "status", "stats", "model", "adapters", "attachments")
    return a.versions == b.versions and all(getattr(x, f) == getattr(y, f) for f in shown)
