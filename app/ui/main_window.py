"""The main window: sidebar | chat (model bar, messages, composer) | settings."""

from __future__ import annotations

import os

from app import model_prefs, tasks
from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable
from app.controllers.adapters import AdapterController
from app.controllers.chat import ChatController
from app.controllers.compare import CompareController
from app.controllers.documents import DocumentsController
from app.controllers.machines import MachinesController
from app.controllers.models import ModelController
from app.controllers.saved_caches import SavedCaches
from app.controllers.tools import ToolsController
from app.controllers.transcription import WHISPER_KEY, TranscriptionController
from app.history_writer import StoreError
from app.ops import Op
from app.qt import (
    QApplication,
    QHBoxLayout,
    QKeySequence,
    QMainWindow,
    QShortcut,
    QSplitter,
    Qt,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.store import HistoryStore
from app.ui.chat_view import ChatView
from app.ui.choices import ChoicesResult
from app.ui.compare_view import CompareView
from app.ui.composer import Composer
from app.ui.documents_button import DocumentsButton
from app.ui.first_paint import first_paint as first_paint  # app.main imports it from here
from app.ui.load_setup import LoadSetup
from app.ui.memory_gauge import MemoryGauge
from app.ui.model_browser import ModelBrowser, fmt_params
from app.ui.rank_gauge import RankGauge
from app.ui.settings_panel import SettingsPanel
from app.ui.sidebar import Sidebar
from app.ui.tool_approval import ToolApprovalBar
from app.ui.window_menus import WindowMenus


class MainWindow(WindowMenus, QMainWindow):
    model_loaded = Signal(object)  # ModelInfo
    load_failed = Signal(str)  # the readable reason
    transcription_finished = Signal(str)  # the transcript put in the box ("" when none)
    _history_failed = Signal(str)  # from the store's writer thread: a write that did not land

    def __init__(self, store: HistoryStore, bridge: EngineBridge, dark: bool = False):
        super().__init__()
        self.setWindowTitle("MLX Desk")
        self._fit_to_screen(1280, 820)
        self.store, self.bridge = store, bridge
        self._history_failed.connect(self.notify)
        store.on_failure = self._tell_history_failed
        # Debug aid for docs and end-to-end tests: save the window mid-reply (each reply).
        self.screenshot_path = os.environ.get("MLX_DESK_SCREENSHOT", "")
        self.screenshot_chars = int(os.environ.get("MLX_DESK_SCREENSHOT_CHARS", "60"))
        self._shot_for: int | None = None
        self.browser: ModelBrowser | None = None
        self._loading_name = ""

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
        self.machines = MachinesController(store.data_dir)  # Model → Machines…, and splits across them
        self.models.machines = self.machines
        self.transcription = TranscriptionController(store, bridge, self)
        self.tool_approval = ToolApprovalBar()
        self.tools = ToolsController(store.data_dir, self)
        self.tools.approve = self.tool_approval.ask
        self.chat.tools = self.tools
        self.documents = DocumentsController(store.data_dir, self)
        self.chat.documents = self.documents
        self.compare = CompareController(self.chat, bridge, self.load_model, self)
        self.compare_view: CompareView | None = None

        center = QWidget(objectName="center")
        cv = QVBoxLayout(center)
        cv.setContentsMargins(0, 0, 0, 0)
        cv.setSpacing(0)
        cv.addWidget(self._top_bar())
        cv.addWidget(self.chat_view, 1)
        cv.addWidget(self.tool_approval)
        self.choices_result = ChoicesResult()
        cv.addWidget(self.choices_result)
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
        self.setCentralWidget(split)
        self.documents_button = DocumentsButton(self.documents)
        self.statusBar().addPermanentWidget(self.documents_button)
        self.statusBar().addPermanentWidget(self.gauge)
        self.rank_gauge = RankGauge()  # one bar per machine while a model is split across several
        self.statusBar().addPermanentWidget(self.rank_gauge)
        self._menus()

        # ---- wiring
        self.sidebar.new_requested.connect(self.new_chat)
        self.sidebar.conversation_selected.connect(self.open_conversation)
        self.sidebar.conversation_deleted.connect(self._deleted)
        self.sidebar.notice.connect(self.notify)
        self.composer.send_requested.connect(lambda text, att: tasks.spawn(self._send(text, att)))
        self.composer.send_requested.connect(lambda text, _att: self.check_memory(len(text) // 4))
        self.composer.choices_requested.connect(
            lambda text, options, att: tasks.spawn(self.ask_with_choices(text, options, att))
        )
        self.composer.stop_requested.connect(self.stop)
        self.composer.notice.connect(self.notify)
        self.composer.refused.connect(self.show_error)
        self.composer.transcribe_requested.connect(lambda path: tasks.spawn(self.transcribe(path)))
        self.composer.cancel_transcription.connect(self.transcription.cancel)
        self.composer.documents_dropped.connect(lambda paths: tasks.spawn(self.add_documents(paths)))
        self.documents.progress.connect(self.notify)
        self.documents.finished.connect(lambda _cid, line: self.notify(line))
        self.documents.finished.connect(lambda cid, _line: self.documents_button.show_chat(cid))
        self.documents.failed.connect(self.show_error)
        self.compare.failed.connect(self.show_error)
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
        self.adapters_menu.train_requested.connect(self.open_training)
        self.adapters_menu.unmount_requested.connect(lambda name: tasks.spawn(self.unmount_adapter(name)))
        bridge.memory.connect(self.gauge.update_figures)
        bridge.memory.connect(self.rank_gauge.update_figures)
        self.models.progress.connect(self._load_progress)
        self.transcription.progress.connect(self.composer.set_transcribe_progress)
        tasks.set_reporter(self.notify)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, activated=self.stop)

        recent = store.list_conversations()
        self.sidebar.reload(recent[0].id if recent else None)
        if recent:
            self.open_conversation(recent[0].id)
        else:
            self.new_chat()
        self.notify("Ready. Pick a model to start.")
        if self.tools.config_problem:
            self.notify(f"MCP tools are off: {self.tools.config_problem} (Chat → Tools).")

    def _fit_to_screen(self, width: int, height: int) -> None:
        """Start at ``width`` x ``height``, or the screen's free area when that is smaller
        (a 1280x800 laptop less its menu bar and dock)."""
        screen = self.screen() or QApplication.primaryScreen()
        if screen is not None:
            free = screen.availableGeometry()
            width, height = min(width, free.width()), min(height, free.height())
        self.resize(width, height)

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
        self.documents_button.show_chat(cid)
        self.settings.load(conv.system_prompt, conv.settings)
        self.check_memory()
        if self.bridge.model_info is not None:
            tasks.spawn(self.apply_adapters())

    async def compare_prompt(self, other_model: str | None = None) -> bool:
        """The message in the box answered twice, side by side (see CompareController)."""
        text = self.composer.edit.toPlainText().strip()
        if not text:
            self.show_error("Type the message to compare in the box first.")
            return False
        if self.compare_view is None:
            self.compare_view = CompareView(self.compare, self)
            self.compare_view.accepted.connect(self.composer.edit.clear)  # kept: it is in the chat now
        self.compare_view.start()
        self.compare_view.show()
        return await self.compare.run(text, other_model=other_model)

    async def set_embedder(self, path: str | None) -> bool:
        """Load an embedding model beside the chat model; documents then rank by meaning too."""
        try:
            info = await self.bridge.load_embedder(path)
        except (EngineRequestError, EngineUnavailable) as exc:
            self.show_error(f"The embedding model was not loaded: {exc}")
            return False
        self.documents.use_embedder(info.name if info else None, self.bridge.embed_beside)
        self.notify(f"Documents are ranked with {info.name} too." if info else "Documents are ranked by their words.")
        return True

    async def add_documents(self, paths: list[str]) -> list[str]:
        """Index dropped documents into this chat (a new one, named after them, if none)."""
        cid = self.chat.conversation_id
        if cid is None:
            cid = self.store.create_conversation()
            self.store.rename_conversation(cid, os.path.basename(paths[0].rstrip("/")))
            self.sidebar.reload(cid)
            self.open_conversation(cid)
        return await self.documents.add(cid, paths)

    def _deleted(self, cid: int) -> None:
        self.bridge.drop_session(cid)
        self.documents.forget(cid)
        if cid == self.documents_button.conversation_id:
            self.documents_button.show_chat(None)
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

    async def ask_with_choices(self, text: str, options: list[str], attachments: list[tuple[str, str]]) -> None:
        """Score the typed options as answers to the question (attachments included) and
        show their probabilities under it; a refusal is shown and the input given back."""
        from engine.api import MediaInput

        if self.bridge.model_info is None or self.bridge.active_training is not None:
            from app.controllers.chat import TRAINING

            self.show_error(TRAINING if self.bridge.model_info else "Load a model first to ask with choices.")
            self.composer.restore(text, attachments)
            return
        # Parts only with media: a text-only template may take nothing but a string.
        parts = [{"type": kind} for kind, _ in attachments] + [{"type": "text", "text": text}]
        content = parts if attachments else text
        media = [MediaInput(kind, path) for kind, path in attachments]  # type: ignore[arg-type]
        self.choices_result.show_waiting(text)
        try:
            decision = await self.bridge.decide([{"role": "user", "content": content}], options, media)
        except Exception as exc:  # noqa: BLE001 - every failure reaches the user as one line
            self.choices_result.setVisible(False)
            self.show_error(str(exc))
            self.composer.restore(text, attachments)
            return
        self.choices_result.show_result(text, options, decision.probabilities)
        best = max(range(len(options)), key=lambda i: decision.probabilities[i])
        self.notify(f"Most likely: {options[best]} ({decision.probabilities[best]:.0%})")

    def stop(self) -> None:
        if self.composer.cancel_waiting_send():  # Esc first takes back a send still waiting
            return
        self.tool_approval.withdraw()  # a call still waiting for approval is denied
        if self.chat.stop():
            self.notify("Stopping…")
        elif self.documents.cancel():
            self.notify("Stopping the indexing; the files read so far are kept.")
        elif self.bridge.active_transcription is not None:  # as the Cancel button beside its bar
            self.transcription.cancel()
        elif self.bridge.active_load is not None:
            self.bridge.cancel(self.bridge.active_load)

    # ---- models --------------------------------------------------------------------------------

    def known_model_places(self) -> list[str]:
        """Beyond the Hugging Face cache: the folders added in the browser, the models loaded
        lately (a folder given on the command line included) and the one loaded now."""
        places = model_prefs.added_folders(self.store) + model_prefs.recent_models(self.store)
        if self.bridge.model_info is not None:
            places.append(self.bridge.model_info.path)
        return list(dict.fromkeys(places))

    def _remember(self, change, *args) -> None:
        """Keep a choice in the history's preferences; a history that cannot take it says so."""
        try:
            change(self.store, *args)
        except StoreError as exc:
            self.notify(str(exc))

    def open_model_browser(self, first_run: bool = False) -> ModelBrowser:
        browser = ModelBrowser(self.bridge, extra_dirs=self.known_model_places(), parent=self)
        browser.budget = self.load_setup.budget_for_load()
        browser.machines = self.machines
        browser.load_requested.connect(lambda path: tasks.spawn(self.load_model(path)))
        browser.folder_added.connect(lambda folder: self._remember(model_prefs.add_folder, folder))
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
            found = await Op(hub.scan_local_models, self.known_model_places())
        except Exception:  # noqa: BLE001 - an unreadable cache counts as empty
            found = []
        if any(m.error is None for m in found):
            return False
        self.open_model_browser(first_run=True)
        self.notify("No models yet: download a small one to start.")
        return True

    async def load_model(self, path: str, memory_budget: int | None = None) -> bool:
        return await self.models.load(path, memory_budget)

    async def reload_last_model(self) -> bool:
        """At start, load the model loaded last time (if it is still there). Returns whether
        one was asked for."""
        path = model_prefs.last_model(self.store)
        if path is None:
            return False
        if not os.path.exists(path):
            self._remember(model_prefs.forget_model, path)
            self.notify(f"The model loaded last time is gone ({path}): pick another.")
            return False
        await self.load_model(path)
        return True

    def _show_loading(self, name: str) -> None:
        self.error_banner.setVisible(False)
        self.template_notice.setVisible(False)
        self._loading_name = name
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
        self._remember(model_prefs.note_loaded_model, info.path)  # listed, and loaded at the next start
        self.model_button.setText(f"{info.name}  ▾")
        self.chat_view.empty_label.setText(
            f"{info.name} is ready: say hello.\nEnter sends · Shift+Enter adds a line · Esc stops"
        )
        self.setWindowTitle(f"MLX Desk — {info.name}")
        meta = [info.family, fmt_params(info.parameters), info.quantization, f"{info.context_length:,} ctx"]
        self.model_meta.setText("  ·  ".join(m for m in meta if m))
        self.settings.set_model_defaults(info.generation_defaults or {})
        self.settings.set_pan_and_scan_default(info.pan_and_scan)
        self.settings.set_reasoning_control(info.reasoning_control)
        conv = self.store.conversation(self.chat.conversation_id) if self.chat.conversation_id else None
        if conv is not None:
            self.settings.load(conv.system_prompt, conv.settings)
        self.gauge.set_plan(info.plan)
        split = self.machines.split_for(info.path)
        self.rank_gauge.set_rooms(split.rooms if split is not None else [])
        self.check_memory()
        self.settings.set_draft(None)
        self.settings.set_mtp(info.mtp, info.mtp_note)
        self.composer.set_capabilities(info.vision, info.audio, info.video, info.video_limits)
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

    async def mount_adapter(self, path: str, name: str | None = None) -> bool:
        return await self.adapter_control.mount(path, name)

    async def unmount_adapter(self, name: str) -> None:
        await self.adapter_control.unmount(name)

    async def set_draft_model(self, path: str | None) -> bool:
        return await self.adapter_control.set_draft_model(path)

    # ---- speech to text ---------------------------------------------------------------------

    def set_whisper_model(self, path: str | None) -> None:
        self.transcription.set_whisper_model(path)

    async def transcribe(self, path: str) -> str | None:
        return await self.transcription.transcribe(path)

    def _show_transcribing(self, name: str) -> None:
        self.error_banner.setVisible(False)
        self.composer.show_transcribing(name)

    def _load_progress(self, done: float, total: float, message: str) -> None:
        if total > 0:
            share = min(1.0, done / total)
            self.load_bar.setRange(0, 1000)
            self.load_bar.setValue(int(1000 * share))
            # The share in words beside the bar, where the eye already is.
            self.model_button.setText(f"Loading {self._loading_name}… {int(100 * share)}%")
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
                self._save_screenshot()
            return
        if streaming is not None and len(streaming.content) >= self.screenshot_chars:
            self._save_screenshot()
            self._shot_for = reply

    def _save_screenshot(self) -> None:
        # Written whole under another name, then renamed: whoever waits for the file (a test,
        # a script) never reads it half written.
        partial = self.screenshot_path + ".partial.png"
        if self.grab().save(partial):
            os.replace(partial, self.screenshot_path)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.tool_approval.withdraw()
        self.tools.close()
        self.server_menu.controller.stop()
        self.chat.stop()
        self.caches.save_at_quit()  # queued behind the reply being stopped
        self.bridge.shutdown(5.0)
        super().closeEvent(event)
