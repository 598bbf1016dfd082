"""The main window: sidebar | chat (model bar, messages, composer) | settings."""

from __future__ import annotations

import asyncio
import os

from app import tasks
from app.bridge import EngineBridge, run_in_thread
from app.controllers.adapters import AdapterController
from app.controllers.chat import ChatController
from app.controllers.models import ModelController
from app.controllers.saved_caches import SavedCaches
from app.controllers.tools import ToolsController
from app.controllers.transcription import WHISPER_KEY, TranscriptionController
from app.qt import (
    QApplication,
    QEvent,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QKeySequence,
    QLabel,
    QMainWindow,
    QObject,
    QProgressBar,
    QPushButton,
    QShortcut,
    QSizePolicy,
    QSplitter,
    Qt,
    QTimer,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.store import HistoryStore
from app.ui.adapters_menu import AdaptersMenu
from app.ui.chat_view import ChatView
from app.ui.composer import Composer
from app.ui.load_setup import LoadSetup
from app.ui.memory_gauge import MemoryGauge
from app.ui.model_browser import ModelBrowser, fmt_params
from app.ui.settings_panel import SettingsPanel
from app.ui.sidebar import Sidebar
from app.ui.tool_approval import ToolApprovalBar
from app.ui.tools_dialog import ToolsDialog


class MainWindow(QMainWindow):
    model_loaded = Signal(object)  # ModelInfo
    load_failed = Signal(str)  # the readable reason
    transcription_finished = Signal(str)  # the transcript put in the box ("" when none)
    _history_failed = Signal(str)  # from the store's writer thread: a write that did not land

    def __init__(self, store: HistoryStore, bridge: EngineBridge, dark: bool = False):
        super().__init__()
        self.setWindowTitle("MLX Desk")
        self.resize(1280, 820)
        self.store, self.bridge = store, bridge
        self._history_failed.connect(self.notify)
        store.on_failure = self._tell_history_failed
        # Debug aid for docs and end-to-end tests: save the window mid-reply (each reply).
        self.screenshot_path = os.environ.get("MLX_DESK_SCREENSHOT", "")
        self.screenshot_chars = int(os.environ.get("MLX_DESK_SCREENSHOT_CHARS", "60"))
        self._shot_for: int | None = None
        self.browser: ModelBrowser | None = None

        self.sidebar = Sidebar(store)
        self.chat_view = ChatView()
        self.chat_view.dark = dark
        self.composer = Composer(store.data_dir)
        self.settings = SettingsPanel(store.data_dir)
        self.settings.setVisible(False)
        self.gauge = MemoryGauge()
        self.load_setup = LoadSetup(store, bridge, self.settings, self.gauge, self)
        self.chat = ChatController(store, bridge, self.chat_view, self)
        self.caches = SavedCaches(bridge, store, self)
        self.chat.caches = self.caches
        self.sidebar.cache_sizes = lambda: self.caches.known  # as last scanned, off this thread
        self.adapter_control = AdapterController(store, bridge, self.chat, self.load_setup, self)
        self.models = ModelController(bridge, self.load_setup, self.adapter_control, self)
        self.transcription = TranscriptionController(store, bridge, self)
        self.tool_approval = ToolApprovalBar()
        self.tools = ToolsController(store.data_dir, self)
        self.tools.approve = self.tool_approval.ask
        self.chat.tools = self.tools

        center = QWidget(objectName="center")
        cv = QVBoxLayout(center)
        cv.setContentsMargins(0, 0, 0, 0)
        cv.setSpacing(0)
        cv.addWidget(self._top_bar())
        cv.addWidget(self.chat_view, 1)
        cv.addWidget(self.tool_approval)
        holder = QWidget()
        hl = QHBoxLayout(holder)
        hl.setContentsMargins(28, 8, 28, 18)
        hl.addWidget(self.composer)
        cv.addWidget(holder)

        split = QSplitter(Qt.Orientation.Horizontal)
        split.setHandleWidth(1)
        split.setChildrenCollapsible(False)
        split.addWidget(self.sidebar)
        split.addWidget(center)
        split.addWidget(self.settings)
        split.setStretchFactor(1, 1)
        split.setSizes([250, 800, 290])
        self.sidebar.setMinimumWidth(200)
        self.settings.setMinimumWidth(300)
        self.setCentralWidget(split)
        self.statusBar().addPermanentWidget(self.gauge)
        self._menus()

        # ---- wiring
        self.sidebar.new_requested.connect(self.new_chat)
        self.sidebar.conversation_selected.connect(self.open_conversation)
        self.sidebar.conversation_deleted.connect(self._deleted)
        self.sidebar.notice.connect(self.notify)
        self.composer.send_requested.connect(lambda text, att: tasks.spawn(self._send(text, att)))
        self.composer.send_requested.connect(lambda text, _att: self.check_memory(len(text) // 4))
        self.composer.stop_requested.connect(self.stop)
        self.composer.notice.connect(self.notify)
        self.composer.refused.connect(self.show_error)
        self.composer.transcribe_requested.connect(lambda path: tasks.spawn(self.transcribe(path)))
        self.composer.cancel_transcription.connect(self.transcription.cancel)
        self.settings.whisper_requested.connect(self._pick_whisper)
        self.settings.tools_requested.connect(self.open_tools)
        self.settings.whisper_cleared.connect(lambda: self.set_whisper_model(None))
        self.settings.set_whisper(store.preference(WHISPER_KEY))
        for controller in (self.models, self.adapter_control, self.transcription, self.tools):
            controller.status.connect(self.notify)
            controller.failed.connect(self.show_error)
        self.models.loading.connect(self._show_loading)
        self.models.load_ended.connect(self._show_load_ended)
        self.models.loaded.connect(self._show_model)
        self.models.now_holding.connect(self._show_held_model)
        self.models.load_failed.connect(self.load_failed)
        self.models.ready.connect(self.model_loaded)
        self.adapter_control.shown.connect(
            lambda mounted, chosen, loaded: self.adapters_menu.set_adapters(mounted, chosen, model_loaded=loaded)
        )
        self.adapter_control.draft_changed.connect(self.settings.set_draft)
        self.transcription.whisper_changed.connect(self.settings.set_whisper)
        self.transcription.whisper_needed.connect(lambda: self.settings_toggle.setChecked(True))
        self.transcription.started.connect(self._show_transcribing)
        self.transcription.ended.connect(self.composer.end_transcribing)
        self.transcription.transcribed.connect(self.composer.insert_transcript)
        self.transcription.finished.connect(self.transcription_finished)
        self.load_setup.notice.connect(self.notify)
        self.chat.busy_changed.connect(self.composer.set_busy)
        self.chat.status.connect(self.notify)
        self.caches.status.connect(self.notify)
        self.caches.changed.connect(self.sidebar.update_tooltips)
        self.settings.show_cache_budget(self.caches.budget)
        self.settings.cache_budget_changed.connect(self.caches.set_budget)
        self.chat.failed.connect(self.show_error)
        self.chat.conversations_changed.connect(lambda: self.sidebar.reload(self.chat.conversation_id))
        self.chat.reply_finished.connect(self._reply_finished)
        self.chat_view.repainted.connect(self._maybe_screenshot)
        self.settings.changed.connect(self._settings_changed)
        self.settings.draft_requested.connect(self._pick_draft)
        self.settings.draft_cleared.connect(lambda: tasks.spawn(self.set_draft_model(None)))
        self.adapters_menu.changed.connect(lambda scales: tasks.spawn(self.choose_adapters(scales)))
        self.adapters_menu.mount_requested.connect(self._pick_adapter)
        self.adapters_menu.unmount_requested.connect(lambda name: tasks.spawn(self.unmount_adapter(name)))
        bridge.memory.connect(self.gauge.update_figures)
        bridge.progress.connect(self._progress)
        tasks.set_reporter(self.notify)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, activated=self.stop)

        recent = store.list_conversations()
        self.sidebar.reload(recent[0].id if recent else None)
        if recent:
            self.open_conversation(recent[0].id)
        else:
            self.new_chat()
        self.notify("Ready. Pick a model to start.")

    def _menus(self) -> None:
        bar = self.menuBar()
        chat = bar.addMenu("&Chat")
        chat.addAction("New chat", QKeySequence.StandardKey.New, self.new_chat)
        chat.addAction("Stop reply (Esc)", self.stop)
        chat.addAction("Clear saved caches", self.clear_saved_caches)
        chat.addSeparator()
        chat.addAction("Settings", QKeySequence("Ctrl+,"), self.settings_toggle.toggle)
        chat.addAction("Tools (MCP servers)…", self.open_tools)
        chat.addSeparator()
        chat.addAction("Quit", QKeySequence.StandardKey.Quit, self.close)
        model = bar.addMenu("&Model")
        model.addAction("Models…", QKeySequence("Ctrl+L"), self.open_model_browser)
        model.addAction("Draft model for speculative decoding…", self._pick_draft)
        model.addAction("Machines…", self.open_machines)
        self.adapters_menu = AdaptersMenu(self)
        bar.addMenu(self.adapters_menu)
        self.adapters_menu.set_adapters([], {}, model_loaded=False)
        from app.ui.server_menu import install_server_menu

        self.server_menu = install_server_menu(self)

    def _top_bar(self) -> QWidget:
        bar = QFrame(objectName="topBar")
        row = QHBoxLayout(bar)
        row.setContentsMargins(20, 10, 14, 10)
        row.setSpacing(10)
        self.model_button = QPushButton("Select a model  ▾", objectName="modelButton")
        self.model_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.model_button.setSizePolicy(QSizePolicy.Policy.Maximum, QSizePolicy.Policy.Fixed)
        self.model_button.clicked.connect(self.open_model_browser)
        self.model_meta = QLabel("", objectName="modelMeta")
        self.load_bar = QProgressBar(objectName="loadProgress")
        self.load_bar.setTextVisible(False)
        self.load_bar.setFixedWidth(160)
        self.load_bar.setVisible(False)
        self.cancel_load = QToolButton(text="Cancel", objectName="actionButton")
        self.cancel_load.setVisible(False)
        self.cancel_load.clicked.connect(lambda: self.bridge.cancel(self.bridge.active_load))
        self.template_notice = QLabel(
            "this model has no chat template: plain text continuation", objectName="templateNotice"
        )
        self.template_notice.setToolTip(
            "A base model: your messages are continued as plain text, not answered as a chat."
        )
        self.template_notice.setVisible(False)
        self.error_banner = QLabel("", objectName="errorBanner")
        self.error_banner.setTextFormat(Qt.TextFormat.PlainText)  # messages quote user text
        self.error_banner.setWordWrap(True)
        self.error_banner.setVisible(False)
        self.error_banner.setStyleSheet("color: #e5484d; font-size: 12px;")
        toggle = QToolButton(text="⚙  Settings", objectName="settingsToggle")
        toggle.setCheckable(True)
        toggle.toggled.connect(self.settings.setVisible)
        self.settings_toggle = toggle
        for w in (self.model_button, self.model_meta, self.template_notice, self.load_bar, self.cancel_load):
            row.addWidget(w)
        row.addWidget(self.error_banner, 1)
        row.addWidget(toggle)
        return bar

    # ---- messages to the user ------------------------------------------------------------

    def notify(self, text: str) -> None:
        self.statusBar().showMessage(text, 8000)

    def _tell_history_failed(self, exc: Exception) -> None:
        """On the store's writer thread: the line goes to the status bar through a queued signal."""
        try:
            emit(self._history_failed, str(exc))
        except RuntimeError:  # the window is gone
            pass

    def show_error(self, text: str) -> None:
        """A failure the user must see: banner in the top bar and the status bar."""
        self.error_banner.setText(text)
        self.error_banner.setToolTip(text)
        self.error_banner.setVisible(True)
        self.statusBar().showMessage(text, 15000)

    # ---- conversations -----------------------------------------------------------------------

    def new_chat(self) -> None:
        if self.chat.busy:
            self.notify("Stop the reply before starting a new chat.")
            return
        cur = self.chat.conversation_id
        if cur is not None and not self.store.thread(cur):
            cid = cur  # reuse an untouched chat instead of piling up empty ones
        else:
            cid = self.store.create_conversation()
        self.sidebar.reload(cid)
        self.open_conversation(cid)
        self.composer.edit.setFocus()

    def open_conversation(self, cid: int | None) -> None:
        if cid is None or cid == self.chat.conversation_id and self.chat_view.widgets:
            return
        if self.chat.busy:
            self.notify("Stop the reply before switching chats.")
            self.sidebar.reload(self.chat.conversation_id)
            return
        conv = self.store.conversation(cid)
        if conv is None:
            return
        self.chat.open(cid)
        self.settings.load(conv.system_prompt, conv.settings)
        self.check_memory()
        if self.bridge.model_info is not None:
            tasks.spawn(self.apply_adapters())

    def _deleted(self, cid: int) -> None:
        self.bridge.drop_session(cid)
        self.caches.forget(cid)
        if cid == self.chat.conversation_id:
            self.chat.conversation_id = None
            recent = self.store.list_conversations()
            if recent:
                self.sidebar.reload(recent[0].id)
                self.open_conversation(recent[0].id)
            else:
                self.new_chat()

    def _settings_changed(self, system_prompt: str, settings: dict) -> None:
        if self.chat.conversation_id is not None:
            self.store.update_conversation(self.chat.conversation_id, system_prompt=system_prompt, settings=settings)
            self.check_memory()

    async def _send(self, text: str, attachments: list[tuple[str, str]]) -> None:
        if not await self.chat.send(text, attachments):  # refused: the reason is already shown
            self.composer.restore(text, attachments)

    def stop(self) -> None:
        if self.composer.cancel_waiting_send():  # Esc first takes back a send still waiting
            return
        self.tool_approval.withdraw()  # a call still waiting for approval is denied
        if self.chat.stop():
            self.notify("Stopping…")
        elif self.bridge.active_transcription is not None:  # as the Cancel button beside its bar
            self.transcription.cancel()
        elif self.bridge.active_load is not None:
            self.bridge.cancel(self.bridge.active_load)

    # ---- models --------------------------------------------------------------------------------

    def open_model_browser(self, first_run: bool = False) -> ModelBrowser:
        browser = ModelBrowser(self.bridge, parent=self)
        browser.budget = self.load_setup.budget_for_load()
        browser.load_requested.connect(lambda path: tasks.spawn(self.load_model(path)))
        browser.notice.connect(self.notify)
        if first_run:
            browser.show_recommended(first_run=True)
        browser.show()
        tasks.spawn(browser.refresh())
        self.browser = browser
        return browser

    async def offer_models_on_first_run(self) -> bool:
        """With no model on disk, go straight to the browser's recommended downloads.
        Returns whether the browser was opened."""
        from engine.artifacts import hub  # the cache scan reads folders only: no mlx

        try:
            found = await run_in_thread(hub.scan_local_models, [])
        except Exception:  # noqa: BLE001 - an unreadable cache counts as empty
            found = []
        if any(m.error is None for m in found):
            return False
        self.open_model_browser(first_run=True)
        self.notify("No models yet: download a small one to start.")
        return True

    async def load_model(self, path: str, memory_budget: int | None = None) -> bool:
        return await self.models.load(path, memory_budget)

    def _show_loading(self, name: str) -> None:
        self.error_banner.setVisible(False)
        self.template_notice.setVisible(False)
        self.model_button.setText(f"Loading {name}…")
        self.model_button.setEnabled(False)
        self.load_bar.setRange(0, 0)
        self.load_bar.setVisible(True)
        self.cancel_load.setVisible(True)

    def _show_load_ended(self) -> None:
        self.model_button.setEnabled(True)
        self.load_bar.setVisible(False)
        self.cancel_load.setVisible(False)

    def _show_model(self, info) -> None:
        self.model_button.setText(f"{info.name}  ▾")
        self.chat_view.empty_label.setText(
            f"{info.name} is ready: say hello.\nEnter sends · Shift+Enter adds a line · Esc stops"
        )
        self.setWindowTitle(f"MLX Desk — {info.name}")
        meta = [info.family, fmt_params(info.parameters), info.quantization, f"{info.context_length:,} ctx"]
        self.model_meta.setText("  ·  ".join(m for m in meta if m))
        self.settings.set_model_defaults(info.generation_defaults or {})
        self.settings.set_pan_and_scan_default(getattr(info, "pan_and_scan", None))
        self.settings.set_reasoning_control(getattr(info, "reasoning_control", None))
        conv = self.store.conversation(self.chat.conversation_id) if self.chat.conversation_id else None
        if conv is not None:
            self.settings.load(conv.system_prompt, conv.settings)
        self.gauge.set_plan(info.plan)
        self.check_memory()
        self.settings.set_draft(None)
        self.settings.set_mtp(getattr(info, "mtp", False), getattr(info, "mtp_note", ""))
        self.composer.set_capabilities(info.vision, info.audio, info.video, getattr(info, "video_limits", None))
        self.template_notice.setVisible(not info.chat_template)

    def _show_held_model(self, info) -> None:
        """After a failed load: what the engine holds now."""
        if info is not None:
            self.model_button.setText(f"{info.name}  ▾")
            return
        self.model_button.setText("Select a model  ▾")
        self.model_meta.setText("")
        self.setWindowTitle("MLX Desk")
        self.gauge.clear_model()
        self.settings.set_draft(None)
        self.settings.set_mtp(False)
        self.settings.set_pan_and_scan_default(None)
        self.settings.set_reasoning_control(None)
        self.composer.set_capabilities(None, False)

    # ---- adapters and the draft model -----------------------------------------------------

    async def apply_adapters(self) -> None:
        await self.adapter_control.apply()

    async def choose_adapters(self, scales: dict[str, float]) -> None:
        await self.adapter_control.choose(scales)

    def _pick_adapter(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Mount an adapter folder")
        if folder:
            tasks.spawn(self.mount_adapter(folder))

    async def mount_adapter(self, path: str, name: str | None = None) -> bool:
        return await self.adapter_control.mount(path, name)

    async def unmount_adapter(self, name: str) -> None:
        await self.adapter_control.unmount(name)

    def _pick_draft(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a draft model folder")
        if folder:
            tasks.spawn(self.set_draft_model(folder))

    async def set_draft_model(self, path: str | None) -> bool:
        return await self.adapter_control.set_draft_model(path)

    # ---- speech to text ---------------------------------------------------------------------

    def _pick_whisper(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a Whisper model folder")
        if folder:
            self.set_whisper_model(folder)

    def set_whisper_model(self, path: str | None) -> None:
        self.transcription.set_whisper_model(path)

    async def transcribe(self, path: str) -> str | None:
        return await self.transcription.transcribe(path)

    def _show_transcribing(self, name: str) -> None:
        self.error_banner.setVisible(False)
        self.composer.show_transcribing(name)

    def _progress(self, request_id: int, stage: str, done: float, total: float, message: str) -> None:
        if request_id == self.bridge.active_transcription:
            self.composer.set_transcribe_progress(done, total)
            return
        if request_id == self.bridge.active_load and total > 0:
            self.load_bar.setRange(0, 1000)
            self.load_bar.setValue(int(1000 * done / total))
            if message:
                self.notify(message)

    def check_memory(self, extra_tokens: int = 0) -> str:
        """Project the next reply of this conversation against the memory budget; the gauge
        turns amber or red, and the warning goes to the status bar (red: the banner too)."""
        max_tokens = int(self.settings.values(everything=True).get("max_tokens", 512))
        before = self.gauge.level
        warning = self.gauge.check_context(self.chat.context_tokens() + extra_tokens, max_tokens)
        if warning and (self.gauge.level != before or extra_tokens):
            if self.gauge.level == "red":
                self.show_error(warning)
            else:
                self.notify(warning)
        return warning

    def clear_saved_caches(self) -> None:
        from app.memory_units import fmt_bytes

        freed = self.caches.clear()
        self.notify(
            f"Saved chat caches cleared ({fmt_bytes(freed)} freed); the next turn of each chat reads it in full once."
        )

    def _reply_finished(self, message_id: int, result) -> None:
        self.check_memory()
        self._maybe_screenshot(final=True)

    def _maybe_screenshot(self, final: bool = False) -> None:
        """With MLX_DESK_SCREENSHOT set, save the window once per reply, mid-stream."""
        if not self.screenshot_path:
            return
        streaming = self.chat_view.streaming
        reply = self.chat.reply_id
        if reply is None or reply == self._shot_for:
            if final and self._shot_for is None:  # a reply too short to catch mid-stream
                self.grab().save(self.screenshot_path)
            return
        if streaming is not None and len(streaming.content) >= self.screenshot_chars:
            self.grab().save(self.screenshot_path)
            self._shot_for = reply

    def open_machines(self):  # -> app.ui.machines_dialog.MachinesDialog (imported when first opened)
        """Model → Machines…: the machines a model too large for this one may be split across."""
        from app.controllers.machines import MachinesController
        from app.ui.machines_dialog import MachinesDialog

        dialog = MachinesDialog(MachinesController(self.store.data_dir), self)
        dialog.show()
        dialog.check_all()
        return dialog

    def open_tools(self) -> ToolsDialog:
        """Settings → Tools: the MCP servers whose tools the chat offers."""
        dialog = ToolsDialog(self.tools, self)
        dialog.show()
        return dialog

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.tool_approval.withdraw()
        self.tools.close()
        self.server_menu.controller.stop()
        self.chat.stop()
        self.caches.save_at_quit()  # queued behind the reply being stopped
        self.bridge.shutdown(5.0)
        super().closeEvent(event)


class _FirstPaint(QObject):
    """Resolves a future when a widget of ``window`` first paints (the window is up)."""

    def __init__(self, window: QWidget, future: asyncio.Future):
        super().__init__(window)
        self.window, self.future = window, future

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt override
        if (
            event.type() == QEvent.Type.Paint
            and isinstance(obj, QWidget)
            and obj.window() is self.window
            and not self.future.done()
        ):
            # Resolve after this paint has finished and been flushed to the screen.
            QTimer.singleShot(0, lambda: self.future.done() or self.future.set_result(None))
            QApplication.instance().removeEventFilter(self)
        return False


def first_paint(window: QWidget) -> asyncio.Future:
    """A future that is done once ``window`` has been painted for the first time.
    Call before ``show()``, with the asyncio loop (qasync) installed."""
    future = asyncio.get_event_loop().create_future()
    QApplication.instance().installEventFilter(_FirstPaint(window, future))
    return future
