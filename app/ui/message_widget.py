"""One chat message: Markdown body, code blocks with copy, reasoning, stats, versions."""

from __future__ import annotations

from app.qt import (
    QApplication,
    QDesktopServices,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSize,
    QSizePolicy,
    Qt,
    QToolButton,
    QUrl,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.ui.attachment_strip import AttachmentRow
from app.ui.markdown import (
    Block,
    breakable,
    highlight_html,
    is_live_link,
    prose_html,
    split_blocks,
)
from app.ui.source_cards import SourceCards


def open_link(parent: QWidget, url: str) -> bool:
    """Open a web link in the browser once the user has seen its address; other schemes
    (file:, javascript:, ...) never open. True when it was opened."""
    if not is_live_link(url):
        return False
    answer = QMessageBox.question(
        parent,
        "Open link",
        f"Open this address in your browser?\n\n{url}",
        QMessageBox.StandardButton.Open | QMessageBox.StandardButton.Cancel,
        QMessageBox.StandardButton.Cancel,
    )
    if answer != QMessageBox.StandardButton.Open:
        return False
    return bool(QDesktopServices.openUrl(QUrl(url)))


def _label(text: str = "", name: str = "", rich: bool = False) -> QLabel:
    label = QLabel(text)
    if name:
        label.setObjectName(name)
    label.setWordWrap(True)
    label.setTextInteractionFlags(
        Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.LinksAccessibleByMouse
    )
    # Links go through open_link (http(s) only, address shown first), never straight out.
    label.setOpenExternalLinks(False)
    label.linkActivated.connect(lambda url: open_link(label, url))
    if rich:
        label.setTextFormat(Qt.TextFormat.RichText)
    label.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
    return label


class _SideScroll(QScrollArea):
    """Scrolls its content sideways instead of asking the column for its width: a code
    line of any length stays inside its block."""

    def __init__(self, content: QWidget, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWidget(content)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.viewport().setAutoFillBackground(False)
        content.setAutoFillBackground(False)
        self._fit_height()

    def _fit_height(self) -> None:
        content = self.widget()
        bar = self.horizontalScrollBar().sizeHint().height()
        wide = content.sizeHint().width() > self.viewport().width()
        self.setFixedHeight(content.sizeHint().height() + (bar if wide else 0))

    def sizeHint(self) -> QSize:
        return QSize(0, self.height())

    def minimumSizeHint(self) -> QSize:
        return QSize(0, self.height())

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_height()


class CodeBlock(QFrame):
    """A fenced code block: language, copy button, highlighted monospace text."""

    def __init__(self, block: Block, dark: bool, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        self.code = block.text
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        header = QWidget(objectName="codeHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(12, 4, 6, 4)
        row.addWidget(QLabel(block.language or "code", objectName="codeLanguage"))
        row.addStretch(1)
        self.copy_button = QToolButton(text="Copy", objectName="copyButton")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        row.addWidget(self.copy_button)
        layout.addWidget(header)
        self.body = _label(highlight_html(block.text, block.language, dark), "codeText", rich=True)
        self.body.setWordWrap(False)  # <pre>: long lines scroll sideways instead
        self.body.setContentsMargins(12, 8, 12, 10)
        self.scroller = _SideScroll(self.body)
        layout.addWidget(self.scroller)

    def copy(self) -> None:
        QApplication.clipboard().setText(self.code)
        self.copy_button.setText("Copied")


# Laying out text costs time in proportion to its length (a 1 MB paste froze the window
# for seconds, at every relayout): longer messages show their start and a button for the rest.
MAX_SHOWN_CHARS = 20_000


class MessageWidget(QFrame):
    edit_submitted = Signal(int, str)  # message id, new text
    regenerate_requested = Signal(int)
    version_requested = Signal(int, int)  # message id, +1 / -1

    def __init__(self, message_id: int, role: str, dark: bool = False, name: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.message_id = message_id
        self.role = role
        self.dark = dark
        self.content = ""
        self.reasoning = ""
        self.adapters: dict[str, float] = {}
        self._rendered: list[Block] = []
        self._show_all = False
        self.setObjectName("userMessage" if role == "user" else "assistantMessage")

        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(4)
        self.role_label = QLabel("You" if role == "user" else (name or "Assistant"), objectName="roleLabel")
        self.role_label.setTextFormat(Qt.TextFormat.PlainText)  # a model's name is not HTML
        outer.addWidget(self.role_label)
        # Parts most messages never show (reasoning, the block still refining, "show more",
        # the version arrows) are made the first time one is needed: a chat opens a
        # screenful of messages at once, and every widget made costs its share of that.
        self._reasoning_parts: tuple[QToolButton, QLabel] | None = None
        self._draft_label: QLabel | None = None
        self._more_button: QToolButton | None = None
        self._version_parts: tuple[QToolButton, QLabel, QToolButton] | None = None

        # Attached images and clips sit above the words, as in messaging apps.
        self.attachment_row: AttachmentRow | None = None
        self.source_cards: SourceCards | None = None

        self.bubble = QFrame(objectName="bubble")
        self.body = QVBoxLayout(self.bubble)
        # A user's words sit in a bubble; a reply is plain text aligned with its name and footer.
        if role == "user":
            self.body.setContentsMargins(14, 10, 14, 10)
        else:
            self.body.setContentsMargins(0, 0, 0, 0)
        self.body.setSpacing(8)
        outer.addWidget(self.bubble)
        if role == "user":
            self.role_label.setAlignment(Qt.AlignmentFlag.AlignRight)

        self.editor: QPlainTextEdit | None = None
        self.footer = QHBoxLayout()
        self.footer.setContentsMargins(2, 0, 2, 0)
        self.footer.setSpacing(4)
        self.stats_label = QLabel("", objectName="statsLabel")
        self.stats_label.setTextFormat(Qt.TextFormat.PlainText)  # adapter names are not HTML
        self.footer.addWidget(self.stats_label)
        self.footer.addStretch(1)
        self.copy_button = QToolButton(text="Copy", objectName="actionButton")
        self.copy_button.clicked.connect(lambda: QApplication.clipboard().setText(self.content))
        self.footer.addWidget(self.copy_button)
        if role == "user":
            self.action_button = QToolButton(text="Edit", objectName="actionButton")
            self.action_button.clicked.connect(self.start_edit)
        else:
            self.action_button = QToolButton(text="Regenerate", objectName="actionButton")
            self.action_button.clicked.connect(lambda: emit(self.regenerate_requested, self.message_id))
        self.footer.addWidget(self.action_button)
        outer.addLayout(self.footer)

    # ---- parts made when first needed ---------------------------------------------------

    @property
    def reasoning_toggle(self) -> QToolButton:
        return self._reasoning()[0]

    @property
    def reasoning_label(self) -> QLabel:
        return self._reasoning()[1]

    def _reasoning(self) -> tuple[QToolButton, QLabel]:
        if self._reasoning_parts is None:
            toggle = QToolButton(objectName="reasoningToggle")
            toggle.setCheckable(True)
            toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
            toggle.setArrowType(Qt.ArrowType.RightArrow)
            toggle.setText("Thinking")
            toggle.toggled.connect(self._toggle_reasoning)
            label = _label("", "reasoningText")
            label.setTextFormat(Qt.TextFormat.PlainText)  # never guessed as HTML
            label.setVisible(False)
            toggle.setVisible(False)
            self.layout().insertWidget(1, toggle)  # under the name, above attachments and words
            self.layout().insertWidget(2, label)
            self._reasoning_parts = (toggle, label)
        return self._reasoning_parts

    @property
    def draft_label(self) -> QLabel:
        """Block diffusion: the block still being denoised, muted, until its text settles."""
        if self._draft_label is None:
            self._draft_label = _label("", "draftText")
            self._draft_label.setTextFormat(Qt.TextFormat.PlainText)  # an unsettled canvas is not Markdown
            self._draft_label.setVisible(False)
            self.layout().insertWidget(self.layout().indexOf(self.bubble) + 1, self._draft_label)
        return self._draft_label

    @property
    def more_button(self) -> QToolButton:
        if self._more_button is None:
            self._more_button = QToolButton(objectName="actionButton")
            self._more_button.setVisible(False)
            self._more_button.clicked.connect(self.show_all)
            self.layout().insertWidget(self.layout().count() - 1, self._more_button)  # above the footer
        return self._more_button

    @property
    def prev_button(self) -> QToolButton:
        return self._version_nav()[0]

    @property
    def version_label(self) -> QLabel:
        return self._version_nav()[1]

    @property
    def next_button(self) -> QToolButton:
        return self._version_nav()[2]

    def _version_nav(self) -> tuple[QToolButton, QLabel, QToolButton]:
        if self._version_parts is None:
            prev = QToolButton(text="‹", objectName="versionButton")
            label = QLabel("", objectName="versionLabel")
            after = QToolButton(text="›", objectName="versionButton")
            prev.clicked.connect(lambda: emit(self.version_requested, self.message_id, -1))
            after.clicked.connect(lambda: emit(self.version_requested, self.message_id, +1))
            for i, w in enumerate((prev, label, after)):
                w.setVisible(False)
                self.footer.insertWidget(i, w)
            self._version_parts = (prev, label, after)
        return self._version_parts

    def reuse(self, message_id: int, name: str = "", dark: bool = False) -> None:
        """Become a fresh widget for another message of the same role: the transcript keeps
        the widgets it frees and builds the next messages from them (making a widget costs
        more than filling one). The caller then sets the text, stats and versions."""
        self.end_edit()
        self.message_id, self.dark = message_id, dark
        if self.role != "user":
            self.role_label.setText(name or "Assistant")
        self._show_all = False
        self.set_draft("")
        if self._reasoning_parts is not None:
            self._reasoning_parts[0].setChecked(False)  # folded, as in a new widget
        self.stats_label.setText("")
        self.stats_label.setToolTip("")
        self.set_sources([])
        self.adapters = {}
        self.set_versions(1, 1)

    # ---- content --------------------------------------------------------------------

    def set_attachments(self, attachments: list[tuple[str, str]]) -> None:
        if self.attachment_row is not None:
            self.layout().removeWidget(self.attachment_row)
            self.attachment_row.deleteLater()
            self.attachment_row = None
        if attachments:
            self.attachment_row = AttachmentRow(attachments, self)
            self.layout().insertWidget(self.layout().indexOf(self.bubble), self.attachment_row)

    def set_text(self, content: str, reasoning: str = "") -> None:
        """Re-render only the blocks that changed (the tail, while streaming)."""
        self.content = content
        if reasoning != self.reasoning:
            self.reasoning = reasoning
            toggle, label = self._reasoning()
            label.setText(breakable(reasoning))
            toggle.setVisible(bool(reasoning))
        hidden = 0 if self._show_all else max(0, len(content) - MAX_SHOWN_CHARS)
        if hidden:
            content = content[:MAX_SHOWN_CHARS]
            self.more_button.setText(f"Show {hidden:,} more characters (Copy takes them all)")
        if hidden or self._more_button is not None:
            self.more_button.setVisible(bool(hidden))
        blocks = split_blocks(content) if self.role != "user" else [Block("prose", content)]
        keep = 0
        while keep < len(blocks) and keep < len(self._rendered) and blocks[keep] == self._rendered[keep]:
            keep += 1
        # A prose block that changed keeps its label and takes the new text (the streaming
        # tail; a reused widget's words): setting a label's text costs less than a new label.
        while (
            keep < min(len(blocks), len(self._rendered), self.body.count())
            and blocks[keep].kind == self._rendered[keep].kind == "prose"
            and self.editor is None
        ):
            self.body.itemAt(keep).widget().setText(self._prose_text(blocks[keep].text))
            keep += 1
        while self.body.count() > keep:
            item = self.body.takeAt(keep)
            if item.widget() is not None:
                item.widget().deleteLater()
        for block in blocks[keep:]:
            self.body.addWidget(self._make_block(block))
        self._rendered = blocks
        self.bubble.setVisible(bool(blocks))
        if self.role == "user":
            self._fit_user_bubble(content)

    def set_draft(self, text: str) -> None:
        """Show ``text`` as the block still refining (empty: none)."""
        if not text and self._draft_label is None:
            return
        if text != self.draft_label.text():
            self.draft_label.setText(text)
        self.draft_label.setVisible(bool(text))

    def show_all(self) -> None:
        """Lay out the whole of a very long message (slow: the person asked for it)."""
        self._show_all = True
        self.set_text(self.content, self.reasoning)

    def _fit_user_bubble(self, shown: str) -> None:
        """Short questions sit in a compact bubble on the right, as in messaging apps;
        long ones wrap across the column (a wrapped QLabel cannot size itself to fit)."""
        metrics = self.fontMetrics()
        widest = max((metrics.horizontalAdvance(line) for line in shown.splitlines()), default=0)
        compact = widest < 520
        label = self.body.itemAt(0).widget() if self.body.count() else None
        if isinstance(label, QLabel):
            label.setWordWrap(not compact)
        layout = self.layout()
        layout.setAlignment(self.bubble, Qt.AlignmentFlag.AlignRight if compact else Qt.AlignmentFlag(0))

    def _make_block(self, block: Block) -> QWidget:
        if block.kind == "code":
            return CodeBlock(block, self.dark)
        # User text is shown as typed; replies are Markdown with raw HTML shown as text.
        if self.role == "user":
            label = _label(self._prose_text(block.text), "prose")
            label.setTextFormat(Qt.TextFormat.PlainText)
            return label
        return _label(self._prose_text(block.text), "prose", rich=True)

    def _prose_text(self, text: str) -> str:
        return breakable(text) if self.role == "user" else prose_html(text)

    def _toggle_reasoning(self, shown: bool) -> None:
        toggle, label = self._reasoning()
        label.setVisible(shown)
        toggle.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    def set_sources(self, sources: list[dict]) -> None:
        """Source cards above the footer, made the first time a reply has any."""
        if self.source_cards is None and sources:
            self.source_cards = SourceCards()
            outer = self.layout()
            outer.insertWidget(outer.count() - 1, self.source_cards)  # just above the footer
        if self.source_cards is not None:
            self.source_cards.set_sources(sources)

    def set_stats(self, stats: dict, status: str = "complete", adapters: dict[str, float] | None = None) -> None:
        self.set_sources(stats.get("sources") or [])
        parts, details = [], []
        if stats.get("generated_tokens"):
            parts.append(f"{stats['generated_tokens']} tokens")
        if stats.get("generation_tps"):
            parts.append(f"{stats['generation_tps']:.1f} tok/s")
        if stats.get("time_to_first_token"):
            parts.append(f"TTFT {stats['time_to_first_token'] * 1000:.0f} ms")
        if stats.get("draft_tokens"):
            rate = stats.get("accepted_draft_tokens", 0) / stats["draft_tokens"]
            parts.append(f"accepted {rate:.0%}")
            if stats.get("speedup"):
                parts.append(f"×{stats['speedup']:.2f} speed")
            method = {"ngram": "n-gram lookup", "draft": "a draft model", "mtp": "the built-in MTP layer"}.get(
                stats.get("speculative", ""), "speculative decoding"
            )
            details.append(
                f"Speculative decoding with {method}: {stats.get('accepted_draft_tokens', 0)} of "
                f"{stats['draft_tokens']} drafted tokens accepted ({rate:.0%})"
                + (
                    f", {stats['speedup']:.2f}× the plain decoding speed"
                    if stats.get("speedup")
                    else "; speed-up shows once a plain reply of this model has been timed"
                )
            )
        if adapters:
            from app.controllers.adapters import fmt_adapters

            parts.append(f"adapters: {fmt_adapters(adapters)}")
            details.append(f"Written with adapters {fmt_adapters(adapters)}")
        if stats.get("cached_tokens"):
            details.append(
                f"{stats['cached_tokens']} of {stats.get('prompt_tokens', 0)} prompt tokens reused from the cache"
            )
        if stats.get("context_full"):
            parts.append("stopped at the context limit")
            details.append(
                "The reply reached the end of the model's context. Start a new chat, or choose "
                "Truncate the middle or Rolling window in Settings to leave out older turns."
            )
        if stats.get("dropped_messages"):
            n = stats["dropped_messages"]
            parts.append(f"{n} earlier message{'s' if n != 1 else ''} outside the model's context")
        if status in ("cancelled", "interrupted"):
            parts.append("stopped")
        elif status == "error":
            parts.append("failed")
        self.adapters = dict(adapters or {})
        self.stats_label.setText("  ·  ".join(parts))
        self.stats_label.setToolTip("\n".join(details))

    def set_versions(self, index: int, count: int) -> None:
        """Show ‹ index/count › when a message has more than one version."""
        many = count > 1
        if not many and self._version_parts is None:
            return
        prev, label, after = self._version_nav()
        for w in (prev, label, after):
            w.setVisible(many)
        label.setText(f"{index}/{count}")
        prev.setEnabled(index > 1)
        after.setEnabled(index < count)

    def set_busy(self, busy: bool) -> None:
        self.action_button.setEnabled(not busy)

    # ---- inline editing -----------------------------------------------------------------

    def start_edit(self) -> None:
        if self.editor is not None:
            return
        self.editor = QPlainTextEdit(self.content, objectName="editBox")
        self.editor.setMinimumHeight(80)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        cancel = QPushButton("Cancel")
        send = QPushButton("Save && send", objectName="primaryButton")
        buttons.addWidget(cancel)
        buttons.addWidget(send)
        self._edit_row = QWidget()
        self._edit_row.setLayout(buttons)
        self.body.addWidget(self.editor)
        self.body.addWidget(self._edit_row)
        for i in range(self.body.count() - 2):
            self.body.itemAt(i).widget().setVisible(False)
        cancel.clicked.connect(self.end_edit)
        send.clicked.connect(self._submit_edit)
        self.editor.setFocus()

    def _submit_edit(self) -> None:
        text = self.editor.toPlainText().strip() if self.editor else ""
        self.end_edit()
        if text:
            emit(self.edit_submitted, self.message_id, text)

    def end_edit(self) -> None:
        if self.editor is None:
            return
        for w in (self.editor, self._edit_row):
            self.body.removeWidget(w)
            w.deleteLater()
        self.editor = None
        for i in range(self.body.count()):
            self.body.itemAt(i).widget().setVisible(True)
