"""The message box: Enter sends, Shift+Enter breaks the line, Esc stops a reply.

Images and audio can be attached (button or drop); a model that cannot take
them says so instead of silently ignoring them.
"""

from __future__ import annotations

from pathlib import Path

from app.qt import (
    emit,
    QEvent,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QIcon,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSize,
    Qt,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
)
from app.resources import resource_path

IMAGE_EXT = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"}
MIN_EDIT_HEIGHT = 48
AUDIO_EXT = {".wav", ".mp3", ".flac", ".ogg", ".m4a"}


def media_kind(path: str) -> str | None:
    ext = Path(path).suffix.lower()
    return "image" if ext in IMAGE_EXT else "audio" if ext in AUDIO_EXT else None


class MessageEdit(QPlainTextEdit):
    submit = Signal()
    escape = Signal()

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt override
        key, mods = event.key(), event.modifiers()
        if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            mods & Qt.KeyboardModifier.ShiftModifier
        ):
            emit(self.submit)
            return
        if key == Qt.Key.Key_Escape:
            emit(self.escape)
            return
        super().keyPressEvent(event)


class Composer(QFrame):
    send_requested = Signal(str, list)  # text, [(kind, path), ...]
    stop_requested = Signal()
    notice = Signal(str)  # a readable line for the status bar

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("composer")
        self.setAcceptDrops(True)
        self.attachments: list[tuple[str, str]] = []
        self.accepts = {"image": False, "audio": False}
        self.busy = False

        # The text runs the full width; the buttons sit in a row under it, so the text
        # starts at the box's edge instead of after the attach button.
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 10, 10, 8)
        layout.setSpacing(4)
        self.chips = QLabel("", objectName="attachmentChips")
        self.chips.setVisible(False)
        layout.addWidget(self.chips)
        self.attach_button = QToolButton(objectName="attachButton")
        self.attach_button.setIcon(QIcon(str(resource_path("icons/attach.svg"))))
        self.attach_button.setIconSize(QSize(18, 18))
        self.attach_button.setToolTip("Attach an image or audio clip")
        self.attach_button.clicked.connect(self._pick_files)
        self.mic_button = QToolButton(objectName="micButton")
        self.mic_button.setIcon(QIcon(str(resource_path("icons/mic.svg"))))
        self.mic_button.setIconSize(QSize(18, 18))
        self.mic_button.setToolTip("Voice input needs an audio model")
        self.mic_button.setEnabled(False)
        self.edit = MessageEdit(objectName="messageEdit")
        self.edit.setPlaceholderText("Send a message…  (Enter sends, Shift+Enter adds a line)")
        self.edit.setFixedHeight(MIN_EDIT_HEIGHT)
        self.edit.document().setDocumentMargin(2)
        self.edit.submit.connect(self._submit)
        self.edit.escape.connect(self.stop_requested)
        self.edit.installEventFilter(self)
        self.send_button = QPushButton("Send", objectName="sendButton")
        self.send_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.send_button.clicked.connect(self._send_or_stop)
        layout.addWidget(self.edit)
        row = QHBoxLayout()
        row.setSpacing(4)
        row.addWidget(self.attach_button)
        row.addWidget(self.mic_button)
        row.addStretch(1)
        row.addWidget(self.send_button)
        layout.addLayout(row)

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.send_button.setText("Stop" if busy else "Send")
        self.send_button.setProperty("stop", "true" if busy else "false")
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)

    def set_capabilities(self, image: bool, audio: bool) -> None:
        self.accepts = {"image": image, "audio": audio}
        self.mic_button.setToolTip(
            "Voice input" if audio else "Voice input needs an audio model"
        )

    def _send_or_stop(self) -> None:
        if self.busy:
            emit(self.stop_requested)
        else:
            self._submit()

    def _submit(self) -> None:
        text = self.edit.toPlainText().strip()
        if not text or self.busy:
            return
        self.edit.clear()
        attachments, self.attachments = self.attachments, []
        self._show_chips()
        emit(self.send_requested, text, attachments)

    # ---- attachments -------------------------------------------------------------------

    def add_files(self, paths: list[str]) -> None:
        for path in paths:
            kind = media_kind(path)
            if kind is None:
                emit(self.notice, f"{Path(path).name}: not an image or audio file.")
            elif not self.accepts[kind]:
                emit(self.notice, f"{Path(path).name}: this needs a {'vision' if kind == 'image' else 'audio'} model.")
            else:
                self.attachments.append((kind, path))
        self._show_chips()

    def _show_chips(self) -> None:
        self.chips.setText("   ".join(f"📎 {Path(p).name}" for _, p in self.attachments))
        self.chips.setVisible(bool(self.attachments))

    def _pick_files(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(
            self, "Attach", "", "Images and audio (*.png *.jpg *.jpeg *.webp *.gif *.bmp "
            "*.wav *.mp3 *.flac *.ogg *.m4a)"
        )
        self.add_files(paths)

    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.add_files([u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()])

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt override
        # Grow the box with its text, up to a limit.
        if obj is self.edit and event.type() == QEvent.Type.KeyRelease:
            lines = self.edit.document().blockCount()
            self.edit.setFixedHeight(min(200, max(MIN_EDIT_HEIGHT, 22 * lines + 12)))
        return False
