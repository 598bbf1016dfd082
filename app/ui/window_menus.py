"""The main window's menu bar and top bar, and the pickers and dialogs their entries open.

A mixin of ``MainWindow``: these methods read the window's controllers and widgets
(``self.bridge``, ``self.chat``, ``self.adapters_menu`` ...) and call its actions; the
window builds them in its ``__init__`` (``_top_bar`` first, ``_menus`` once the widgets
they toggle exist).
"""

from __future__ import annotations

from app import tasks
from app.qt import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QKeySequence,
    QLabel,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    Qt,
    QToolButton,
    QWidget,
)
from app.ui.adapters_menu import AdaptersMenu
from app.ui.tools_dialog import ToolsDialog
from app.ui.train_dialog import TrainDialog


class WindowMenus:
    """The menus, the top bar and what their entries open (mixed into MainWindow)."""

    def _menus(self) -> None:
        bar = self.menuBar()
        chat = bar.addMenu("&Chat")
        chat.addAction("New chat", QKeySequence.StandardKey.New, self.new_chat)
        chat.addAction("Stop reply (Esc)", self.stop)
        chat.addAction("Add a folder of documents…", self._pick_document_folder)
        chat.addAction("Compare with and without adapters…", lambda: tasks.spawn(self.compare_prompt()))
        chat.addAction("Compare with another model…", self._pick_compare_model)
        chat.addAction("Clear saved caches", self.clear_saved_caches)
        chat.addSeparator()
        chat.addAction("Settings", QKeySequence("Ctrl+,"), self.settings_toggle.toggle)
        chat.addAction("Tools (MCP servers)…", self.open_tools)
        chat.addSeparator()
        chat.addAction("Quit", QKeySequence.StandardKey.Quit, self.close)
        model = bar.addMenu("&Model")
        model.addAction("Models…", QKeySequence("Ctrl+L"), self.open_model_browser)
        model.addAction("Draft model or DFlash drafter for speculative decoding…", self._pick_draft)
        model.addAction("Embedding model for documents…", self._pick_embedder)
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

    def _pick_compare_model(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "The model to compare with")
        if path:
            tasks.spawn(self.compare_prompt(path))

    def _pick_document_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "A folder of documents for this chat")
        if path:
            tasks.spawn(self.add_documents([path]))

    def _pick_embedder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Embedding model folder (e.g. Qwen3-Embedding-0.6B)")
        if path:
            tasks.spawn(self.set_embedder(path))

    def _pick_adapter(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Mount an adapter folder")
        if folder:
            tasks.spawn(self.mount_adapter(folder))

    def _pick_draft(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a draft model or DFlash drafter folder")
        if folder:
            tasks.spawn(self.set_draft_model(folder))

    def _pick_whisper(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a Whisper model folder")
        if folder:
            self.set_whisper_model(folder)

    def open_training(self) -> TrainDialog:
        """Adapters → Train…: the dialog; its adapter is mounted and on for this chat when done."""
        dialog = TrainDialog(self)
        dialog.finished_training.connect(lambda folder, name: tasks.spawn(self._use_trained(folder, name)))
        dialog.show()
        return dialog

    async def _use_trained(self, folder: str, name: str) -> None:
        info = self.bridge.model_info
        if info is not None and any(a.name == name for a in info.adapters):  # a resumed run: mount it afresh
            await self.unmount_adapter(name)
        if await self.mount_adapter(folder, name):
            chosen = dict(self.adapters_menu.choice())
            chosen[name] = 1.0
            await self.choose_adapters(chosen)

    def open_machines(self):  # -> app.ui.machines_dialog.MachinesDialog (imported when first opened)
        """Model → Machines…: the machines a model too large for this one may be split across."""
        from app.ui.machines_dialog import MachinesDialog

        dialog = MachinesDialog(self.machines, self)
        dialog.show()
        dialog.check_all()
        return dialog

    def open_tools(self) -> ToolsDialog:
        """Settings → Tools: the MCP servers whose tools the chat offers."""
        dialog = ToolsDialog(self.tools, self)
        dialog.show()
        return dialog
