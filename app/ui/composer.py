"""The message box: Enter sends, Shift+Enter breaks the line, Esc stops a reply.

Images, audio and video come in by drop (file URLs or raw image data), paste, the 📎
picker or the microphone. Images show as removable thumbnails above the text and go with
the message; a model that cannot see them refuses them at once, saying what to load.
Videos show their first frame and duration (a note says when the model will see only
part of a long one), play on click, and are refused at the drop by a model that cannot
watch video, naming the families that can. Audio
goes with the message when the model listens to audio; otherwise it is handed on for
transcription (``transcribe_requested``) and the transcript lands here, editable.
Documents (PDF, text, Markdown, HTML, code, .docx, .epub) and folders are not attached:
they go to the chat's documents (``documents_dropped``), read into every reply.

An image is attached at once and checked in the background: decoded in full by the
engine's opener, then thumbnailed. A damaged one is taken off again with the engine's
reason. Sending while a check runs waits for it: the text stays in the box and the
message goes by itself when the check passes (Esc cancels the wait); a failed check
keeps the message here with the reason shown, since a question about a picture makes
little sense without it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.attachments import (
    AUDIO_EXT,
    ENCODED_IMAGE_MIME,
    IMAGE_EXT,
    NO_VIDEO,
    NO_VISION,
    VIDEO_EXT,
    keep_bytes,
    media_kind,
    refusal,
)
from app.ops import Op
from app.qt import (
    QBuffer,
    QEvent,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QIcon,
    QImage,
    QIODevice,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSize,
    Qt,
    QTimer,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.resources import resource_path
from app.ui.attachment_strip import THUMB, AttachmentStrip, ImagePreview
from app.ui.choices import ChoicesRow
from app.ui.images import ImageCheck, check_image
from app.ui.video import VideoCheck, check_video, duration_text, play
from engine.api import VideoLimits
from engine.documents.limits import DOCUMENT_EXT, is_document

MIN_EDIT_HEIGHT = 48

# Attachments one message takes. Each image costs hundreds of prompt tokens (a video, many
# frames), so beyond a few dozen a message outgrows any small model's context and takes
# minutes to read; the person hears it at once instead of a failure after the wait.
MAX_ATTACHMENTS = 20
METER_INTERVAL_MS = 80
# Text one message takes: about 100k tokens, as much as a large context holds. A bigger paste
# is refused before the box lays it out (5 MB froze the window for seconds, and the engine
# refused it only after tokenizing all of it).
MAX_MESSAGE_CHARS = 400_000
# A run this long without a space or line break (encoded data, a minified file) takes the
# box seconds to lay out, growing with the square of its length.
MAX_UNBROKEN = 30_000
WAITING_FOR_CHECK = "Checking the attached images… the message goes as soon as they are verified (Esc cancels)."


def _patterns(exts: set[str]) -> str:
    # Both cases: file dialogs match case-sensitively on Linux, and phones and cameras
    # name their photos IMG_0001.HEIC, DSC_0001.JPG.
    return " ".join(f"*{e} *{e.upper()}" for e in sorted(exts))


PICK_FILTER = (
    f"Images, audio and video ({_patterns(IMAGE_EXT)} {_patterns(AUDIO_EXT)} {_patterns(VIDEO_EXT)});;"
    f"Images ({_patterns(IMAGE_EXT)});;Audio ({_patterns(AUDIO_EXT)});;Video ({_patterns(VIDEO_EXT)});;"
    f"Documents, read into the chat ({_patterns(DOCUMENT_EXT)})"
)


def text_refusal(text: str, already: int = 0) -> str | None:
    """Why pasted ``text`` (with ``already`` characters in the box) is not taken, or None."""
    total = already + len(text)
    if total > MAX_MESSAGE_CHARS:
        return (
            f"That text is too long for one message: {total:,} characters, and a message takes up to "
            f"{MAX_MESSAGE_CHARS:,} (about 100,000 tokens). Paste a shorter part."
        )
    if len(text) > MAX_UNBROKEN and re.search(rf"\S{{{MAX_UNBROKEN + 1}}}", text):
        return (
            f"That text holds a run of more than {MAX_UNBROKEN:,} characters without a space or line "
            "break (encoded data?); the message box cannot show it. Paste a shorter part."
        )
    return None


class MessageEdit(QPlainTextEdit):
    submit = Signal()
    escape = Signal()
    media_received = Signal(object)  # QMimeData with files or an image: the composer takes it
    text_refused = Signal(str)  # pasted or dropped text too large to take: why

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt override
        key, mods = event.key(), event.modifiers()
        if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (mods & Qt.KeyboardModifier.ShiftModifier):
            emit(self.submit)
            return
        if key == Qt.Key.Key_Escape:
            emit(self.escape)
            return
        super().keyPressEvent(event)

    # A drop on the text or a paste goes through these: files and pictures become
    # attachments instead of their path or nothing being typed into the message.
    def canInsertFromMimeData(self, source) -> bool:  # noqa: N802 - Qt override
        return carries_media(source) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source) -> None:  # noqa: N802 - Qt override
        if carries_media(source):
            emit(self.media_received, source)
            return
        # Measured before Qt lays the text out: refusing is instant, taking it would not be.
        selected = len(self.textCursor().selectedText())
        already = self.document().characterCount() - 1 - selected
        why = text_refusal(source.text(), already) if source.hasText() else None
        if why is not None:
            emit(self.text_refused, why)
        else:
            super().insertFromMimeData(source)


def too_many(added: int, left_out: int) -> str:
    """The line for files beyond MAX_ATTACHMENTS: how many went in, how many did not."""
    return (
        f"A message takes at most {MAX_ATTACHMENTS} attachments: {left_out} of the "
        f"{added + left_out} files were not attached. Send these first, then attach the rest."
    )


def carries_media(mime: Any) -> bool:
    """Whether dropped or pasted data holds local files or a picture."""
    if mime is None:
        return False
    if mime.hasUrls() and any(u.isLocalFile() for u in mime.urls()):
        return True
    return mime.hasImage() or _encoded_image(mime) is not None


def _encoded_image(mime: Any) -> str | None:
    """The MIME type of a HEIC/HEIF/AVIF picture carried as data (Qt cannot decode
    those into an image; their bytes are kept as they are)."""
    return next((f for f in mime.formats() if f.lower() in ENCODED_IMAGE_MIME), None)


class Composer(QFrame):
    send_requested = Signal(str, list)  # text, [(kind, path), ...]
    stop_requested = Signal()
    notice = Signal(str)  # a readable line for the status bar
    refused = Signal(str)  # an attachment refused: a line the user must see
    transcribe_requested = Signal(str)  # an audio file for a model without audio input
    documents_dropped = Signal(list)  # documents and folders, for the chat's index
    cancel_transcription = Signal()
    # Ask with choices: the question, the options typed, [(kind, path), ...]
    choices_requested = Signal(str, list, list)

    def __init__(self, data_dir: str | Path | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("composer")
        self.setAcceptDrops(True)
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.attachments: list[tuple[str, str]] = []
        self.vision: bool | None = None  # None: no model loaded
        self.audio = False
        self.video = False
        self.video_limits: VideoLimits | None = None  # the loaded model's, for the long-clip note
        self.busy = False
        # Images being checked, by path, each with the token of its latest check: a
        # result whose token is no longer here (removed, or attached again) is dropped.
        self._checks: dict[str, object] = {}
        self.send_waiting = False  # Send was pressed while a check ran: send when it ends
        # Builds the microphone Recorder (tests hand in one over a fake stream). The
        # recorder module, with numpy, is imported on the first take, not at startup.
        self.recorder_factory: Callable[[], Any] | None = None
        self.recorder: Any = None

        # The text runs the full width; the buttons sit in a row under it, so the text
        # starts at the box's edge instead of after the attach button.
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 10, 10, 8)
        layout.setSpacing(4)
        self.strip = AttachmentStrip(self)
        self.strip.removed.connect(self.remove_attachment)
        self.strip.preview_requested.connect(lambda p: ImagePreview.open_for(p, self))
        self.strip.play_requested.connect(lambda p: play(p, self))
        layout.addWidget(self.strip)
        self.attach_button = QToolButton(objectName="attachButton")
        self.attach_button.setIcon(QIcon(str(resource_path("icons/attach.svg"))))
        self.attach_button.setIconSize(QSize(18, 18))
        self.attach_button.setToolTip(
            "Attach images, audio or video, or add documents to the chat (or drop / paste them here)"
        )
        self.attach_button.clicked.connect(self._pick_files)
        self.mic_button = QToolButton(objectName="micButton")
        self.mic_button.setIcon(QIcon(str(resource_path("icons/mic.svg"))))
        self.mic_button.setIconSize(QSize(18, 18))
        self.mic_button.setCheckable(True)
        self.mic_button.setToolTip("Record a voice message")
        self.mic_button.toggled.connect(self._mic_toggled)
        self.level_bar = QProgressBar(objectName="levelMeter")
        self.level_bar.setRange(0, 100)
        self.level_bar.setTextVisible(False)
        self.level_bar.setFixedSize(90, 6)
        self.level_bar.setVisible(False)
        self.rec_label = QLabel("", objectName="recordingLabel")
        self.rec_label.setVisible(False)
        self._meter = QTimer(self)
        self._meter.setInterval(METER_INTERVAL_MS)
        self._meter.timeout.connect(self._update_meter)

        self.edit = MessageEdit(objectName="messageEdit")
        self.edit.setPlaceholderText("Send a message…  (Enter sends, Shift+Enter adds a line)")
        self.edit.setFixedHeight(MIN_EDIT_HEIGHT)
        self.edit.document().setDocumentMargin(2)
        self.edit.submit.connect(self._submit)
        self.edit.escape.connect(self.stop_requested)
        self.edit.media_received.connect(self.add_mime)
        self.edit.text_refused.connect(lambda why: emit(self.refused, why))
        self.edit.installEventFilter(self)
        self.send_button = QPushButton("Send", objectName="sendButton")
        self.send_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.send_button.clicked.connect(self._send_or_stop)

        # Transcription under way: what, how far, and a way out.
        self.transcribe_row = QWidget(objectName="transcribeRow")
        trow = QHBoxLayout(self.transcribe_row)
        trow.setContentsMargins(0, 0, 0, 0)
        self.transcribe_label = QLabel("", objectName="transcribeLabel")
        self.transcribe_bar = QProgressBar(objectName="transcribeProgress")
        self.transcribe_bar.setTextVisible(False)
        self.transcribe_bar.setFixedHeight(6)
        cancel = QToolButton(text="Cancel", objectName="actionButton")
        cancel.clicked.connect(self.cancel_transcription)
        trow.addWidget(self.transcribe_label)
        trow.addWidget(self.transcribe_bar, 1)
        trow.addWidget(cancel)
        self.transcribe_row.setVisible(False)

        layout.addWidget(self.transcribe_row)
        self.choices = ChoicesRow(self)
        self.choices.setVisible(False)
        self.choices.edit.returnPressed.connect(self._submit)
        layout.addWidget(self.choices)
        layout.addWidget(self.edit)
        self.choices_button = QToolButton(text="Choices", objectName="choicesButton")
        self.choices_button.setCheckable(True)
        self.choices_button.setToolTip("Ask with choices: type options; the model scores how likely each answer is")
        self.choices_button.toggled.connect(self.choices.setVisible)
        row = QHBoxLayout()
        row.setSpacing(4)
        row.addWidget(self.attach_button)
        row.addWidget(self.mic_button)
        row.addWidget(self.choices_button)
        row.addWidget(self.level_bar)
        row.addWidget(self.rec_label)
        row.addStretch(1)
        row.addWidget(self.send_button)
        layout.addLayout(row)

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.send_button.setText("Stop" if busy else "Send")
        self.send_button.setProperty("stop", "true" if busy else "false")
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)

    def set_capabilities(
        self, image: bool | None, audio: bool, video: bool = False, video_limits: VideoLimits | None = None
    ) -> None:
        """What the loaded model takes (``image`` None: no model loaded)."""
        self.vision, self.audio, self.video = image, audio, video
        self.video_limits = video_limits
        self.mic_button.setToolTip(
            "Record a voice message" if audio else "Record a voice message (transcribed to text for this model)"
        )

    def _send_or_stop(self) -> None:
        if self.busy:
            emit(self.stop_requested)
        else:
            self._submit()

    def _submit(self) -> None:
        text = self.edit.toPlainText().strip()
        if self.busy or not (text or self.attachments):
            return
        if len(text) > MAX_MESSAGE_CHARS:  # refused here at once, not by the engine after tokenizing it
            emit(self.refused, text_refusal(text))
            return
        if any(kind == "image" for kind, _ in self.attachments) and not self.vision:
            # The model changed since the images were attached: keep everything, say why.
            emit(self.refused, NO_VISION)
            return
        if any(kind == "video" for kind, _ in self.attachments) and not self.video:
            emit(self.refused, NO_VIDEO)
            return
        if self._checks:  # sent by itself once the images are verified (see the docstring)
            if not self.send_waiting:
                self.send_waiting = True
                emit(self.notice, WAITING_FOR_CHECK)
            return
        options = self.choices.options() if self.choices_button.isChecked() else []
        if self.choices_button.isChecked() and not (text and options):
            emit(self.refused, "Ask with choices needs a question and at least one option (split options with |).")
            return
        self.send_waiting = False
        self.edit.clear()
        attachments = self.attachments
        self.attachments = []
        self.strip.set_items([])
        if options:
            emit(self.choices_requested, text, options, attachments)
            return
        emit(self.send_requested, text, attachments)

    def restore(self, text: str, attachments: list[tuple[str, str]]) -> None:
        """Put back a message that was not sent, unless something new was typed since."""
        if not self.edit.toPlainText().strip():
            self.edit.setPlainText(text)
        self.attachments = list(attachments) + [a for a in self.attachments if a not in attachments]
        self.strip.set_items(self.attachments)
        for kind, path in attachments:  # back in the strip: checked and thumbnailed again
            if kind in ("image", "video") and path not in self._checks and self.strip.thumbnail_pending(path):
                self._check(path)

    # ---- attachments -------------------------------------------------------------------

    def add_files(self, paths: list[str]) -> None:
        """Attach files (drop, paste, picker): refused ones say why; audio for a model
        without audio input goes to transcription. Images are attached at once and
        checked in the background (a damaged one is taken off again, with the reason)."""
        added: list[tuple[str, str]] = []
        left_out = 0
        documents = [p for p in paths if is_document(p) or Path(p).is_dir()]
        if documents:
            emit(self.documents_dropped, documents)
        for path in (p for p in paths if p not in documents):
            if len(self.attachments) >= MAX_ATTACHMENTS:
                left_out += 1
                continue
            why = refusal(path, self.vision, self.video if self.vision is not None else None)
            if why is not None:
                emit(self.refused, why)
                continue
            kind = media_kind(path)
            if kind == "audio" and not self.audio:
                emit(self.transcribe_requested, path)
                continue
            if not Path(path).is_file():
                emit(self.refused, f"{Path(path).name} cannot be read: the file is missing.")
                continue
            if (kind, path) not in self.attachments:
                self.attachments.append((kind, path))
                added.append((kind, path))
        if left_out:
            emit(self.refused, too_many(len(added), left_out))
        if added:
            self.strip.set_items(self.attachments)
            for kind, path in added:
                if kind in ("image", "video"):
                    self._check(path)
            self.edit.setFocus()

    @property
    def checking(self) -> list[str]:
        """The attached images whose check has not come back yet."""
        return list(self._checks)

    def _check(self, path: str) -> None:
        token = object()
        self._checks[path] = token
        limits = self.video_limits  # the loaded model's, for a long clip's note

        def check(path: str, size: int, ratio: float) -> ImageCheck | VideoCheck:
            if media_kind(path) == "video":
                return check_video(path, size, ratio, limits=limits)
            return check_image(path, size, ratio)

        Op(check, path, THUMB, self.devicePixelRatioF()).success(lambda result: self._checked(result, token)).run(self)

    def _checked(self, result: ImageCheck | VideoCheck, token: object) -> None:
        if self._checks.get(result.path) is not token:
            return  # removed while it was checked (or attached again: a newer check owns it)
        del self._checks[result.path]
        if result.problem is not None:
            # A damaged photo or clip: taken off, and a message waiting for it stays here.
            self.attachments = [a for a in self.attachments if a[1] != result.path]
            self.strip.set_items(self.attachments)
            self.send_waiting = False
            emit(self.refused, result.problem)
            return
        if isinstance(result, VideoCheck):
            self.strip.set_thumbnail(result.path, result.thumb, f"▶ {duration_text(result.seconds)}")
            if result.note:
                emit(self.notice, result.note)
        else:
            self.strip.set_thumbnail(result.path, result.thumb)
        self._send_if_ready()

    def _send_if_ready(self) -> None:
        if self.send_waiting and not self._checks:
            self.send_waiting = False
            self._submit()

    def cancel_waiting_send(self) -> bool:
        """Esc while a message waits for its images' check: it stays here, unsent."""
        if not self.send_waiting:
            return False
        self.send_waiting = False
        emit(self.notice, "Not sent: the message stays here until you send it again.")
        return True

    def add_image(self, image: QImage) -> None:
        """A picture that came as data (pasted screenshot, image dragged from a browser):
        kept as a PNG in the attachments folder, then attached like a file."""
        if image.isNull():
            return
        if not self.vision:
            emit(self.refused, refusal("pasted.png", self.vision))
            return
        buf = QBuffer()
        buf.open(QIODevice.OpenModeFlag.WriteOnly)
        image.save(buf, "PNG")
        self._keep_then_attach(bytes(buf.data()), ".png")

    def add_encoded(self, data: bytes, ext: str) -> None:
        """A picture that came as encoded bytes Qt cannot decode (HEIC/HEIF/AVIF):
        kept byte for byte in the attachments folder, then attached like a file."""
        if not data:
            return
        if not self.vision:
            emit(self.refused, refusal(f"pasted{ext}", self.vision))
            return
        self._keep_then_attach(data, ext)

    def _keep_then_attach(self, data: bytes, ext: str) -> None:
        """Write pasted or recorded bytes into the attachments folder off the GUI thread (a
        large picture or a long take must not stall typing), then attach the kept file."""
        Op(keep_bytes, self._folder(), data, ext).success(lambda path: self.add_files([str(path)])).run(self)

    def add_mime(self, mime: Any) -> None:
        files = [u.toLocalFile() for u in mime.urls() if u.isLocalFile()] if mime.hasUrls() else []
        if files:
            self.add_files(files)
        elif (fmt := _encoded_image(mime)) is not None:  # the original bytes beat a re-encode
            self.add_encoded(bytes(mime.data(fmt)), ENCODED_IMAGE_MIME[fmt.lower()])
        elif mime.hasImage():
            self.add_image(QImage(mime.imageData()))

    def remove_attachment(self, index: int) -> None:
        if 0 <= index < len(self.attachments):
            _, path = self.attachments.pop(index)
            self._checks.pop(path, None)  # a check still running is ignored when it ends
            self.strip.set_items(self.attachments)
            self._send_if_ready()

    def _folder(self) -> Path:
        if self.data_dir is None:
            import tempfile

            self.data_dir = Path(tempfile.mkdtemp(prefix="mlx-desk-"))
        return self.data_dir

    def _pick_files(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach media or add documents", "", PICK_FILTER)
        self.add_files(paths)

    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt override
        if carries_media(event.mimeData()):
            event.acceptProposedAction()

    def dragMoveEvent(self, event) -> None:  # noqa: N802 - Qt override
        if carries_media(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt override
        if carries_media(event.mimeData()):
            event.acceptProposedAction()
            self.add_mime(event.mimeData())

    # ---- transcription -----------------------------------------------------------------

    def show_transcribing(self, name: str) -> None:
        self.transcribe_label.setText(f"Transcribing {name}…")
        self.transcribe_bar.setRange(0, 0)  # busy until the first progress report
        self.transcribe_row.setVisible(True)

    def set_transcribe_progress(self, done: float, total: float) -> None:
        if total > 0:
            self.transcribe_bar.setRange(0, 1000)
            self.transcribe_bar.setValue(int(1000 * min(1.0, done / total)))

    def end_transcribing(self) -> None:
        self.transcribe_row.setVisible(False)

    def insert_transcript(self, text: str) -> None:
        """Put a transcript where the cursor is, for the user to check before sending."""
        text = text.strip()
        if not text:
            return
        cursor = self.edit.textCursor()
        before = self.edit.toPlainText()[: cursor.position()]
        if before and not before[-1].isspace():
            text = " " + text
        cursor.insertText(text)
        self.edit.setFocus()
        self._grow()

    # ---- microphone -----------------------------------------------------------------------

    def _mic_toggled(self, on: bool) -> None:
        if on:
            self.start_recording()
        else:
            self.stop_recording()

    def start_recording(self) -> bool:
        from app.recorder import Recorder, RecorderError

        if self.recorder is not None and self.recorder.recording:
            return True
        self.recorder = (self.recorder_factory or Recorder)()
        try:
            self.recorder.start()
        except RecorderError as exc:
            self.recorder = None
            self._set_mic(False)
            emit(self.refused, str(exc))
            return False
        self._set_mic(True)
        self.level_bar.setValue(0)
        self.level_bar.setVisible(True)
        self.rec_label.setText("0:00")
        self.rec_label.setVisible(True)
        self._meter.start()
        emit(self.notice, "Recording… press the microphone again to stop.")
        return True

    def stop_recording(self) -> None:
        """End the take; it is saved as a 16 kHz WAV (off the GUI thread) and then attached
        like a dropped file."""
        recorder, self.recorder = self.recorder, None
        self._meter.stop()
        self.level_bar.setVisible(False)
        self.rec_label.setVisible(False)
        self._set_mic(False)
        if recorder is None:
            return
        try:
            samples = recorder.stop()
        except Exception as exc:  # noqa: BLE001 - a device that vanished mid-take
            emit(self.refused, f"The recording failed: {exc}")
            return
        if samples.size == 0:
            emit(self.notice, "Nothing was recorded.")
            return
        from app.recorder import write_wav

        buf = io.BytesIO()
        write_wav(buf, samples)
        self._keep_then_attach(buf.getvalue(), ".wav")

    def _set_mic(self, on: bool) -> None:
        self.mic_button.blockSignals(True)
        self.mic_button.setChecked(on)
        self.mic_button.blockSignals(False)
        self.mic_button.setToolTip("Stop recording" if on else "Record a voice message")

    def _update_meter(self) -> None:
        if self.recorder is None:
            return
        self.level_bar.setValue(int(100 * self.recorder.level))
        secs = int(self.recorder.elapsed_s)
        self.rec_label.setText(f"● {secs // 60}:{secs % 60:02d}")

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt override
        # Grow the box with its text, up to a limit.
        if obj is self.edit and event.type() == QEvent.Type.KeyRelease:
            self._grow()
        return False

    def _grow(self) -> None:
        lines = self.edit.document().blockCount()
        self.edit.setFixedHeight(min(200, max(MIN_EDIT_HEIGHT, 22 * lines + 12)))
