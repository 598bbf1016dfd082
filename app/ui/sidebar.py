"""Conversation list: new, search, rename, delete, export (Markdown, JSON)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from app.memory_units import fmt_bytes
from app.qt import (
    QFileDialog,
    QFrame,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QStandardPaths,
    Qt,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.store import HistoryStore

ID_ROLE = Qt.ItemDataRole.UserRole


class Sidebar(QFrame):
    conversation_selected = Signal(object)  # int id, or None when the list has no selection
    new_requested = Signal()
    conversation_deleted = Signal(int)
    notice = Signal(str)

    def __init__(self, store: HistoryStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("sidebar")
        self.store = store
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 14, 12, 12)
        layout.setSpacing(10)
        brand = QLabel("MLX Desk", objectName="brand")
        layout.addWidget(brand)
        self.new_button = QPushButton("+   New chat", objectName="newChatButton")
        self.new_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit(objectName="searchBox")
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda _: self.reload())
        layout.addWidget(self.search)
        self.list = QListWidget(objectName="conversationList")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._selected)
        self.list.itemDoubleClicked.connect(lambda item: self.rename(item.data(ID_ROLE)))
        layout.addWidget(self.list, 1)
        self._quiet = False
        # Conversation id -> bytes of its saved KV cache (the window sets it).
        self.cache_sizes: Callable[[], dict[int, int]] | None = None

    def _tooltip(self, title: str, size: int | None) -> str:
        if not size:
            return title
        return f"{title}\nSaved cache: {fmt_bytes(size)} (reopens without re-reading the chat)"

    def update_tooltips(self) -> None:
        """Refresh each chat's tooltip after its saved cache changed."""
        sizes = self.cache_sizes() if self.cache_sizes else {}
        for row in range(self.list.count()):
            item = self.list.item(row)
            item.setToolTip(self._tooltip(item.text(), sizes.get(item.data(ID_ROLE))))

    def reload(self, select: int | None = None) -> None:
        current = select if select is not None else self.current_id()
        self._quiet = True
        self.list.clear()
        sizes = self.cache_sizes() if self.cache_sizes else {}
        for conv in self.store.list_conversations(self.search.text().strip()):
            item = QListWidgetItem(conv.title)
            item.setData(ID_ROLE, conv.id)
            item.setToolTip(self._tooltip(conv.title, sizes.get(conv.id)))
            self.list.addItem(item)
            if conv.id == current:
                self.list.setCurrentItem(item)
        self._quiet = False

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item else None

    def _selected(self, item: QListWidgetItem | None, _prev) -> None:
        if not self._quiet:
            emit(self.conversation_selected, item.data(ID_ROLE) if item else None)

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = item.data(ID_ROLE)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename(cid))
        menu.addAction("Export as Markdown…", lambda: self.export(cid, "md"))
        menu.addAction("Export as JSON…", lambda: self.export(cid, "json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete(cid))
        menu.exec(self.list.mapToGlobal(pos))

    def rename(self, cid: int, title: str | None = None) -> None:
        conv = self.store.conversation(cid)
        if conv is None:
            return
        if title is None:
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=conv.title)
            if not ok:
                return
        self.store.rename_conversation(cid, title)
        self.reload()

    def delete(self, cid: int, confirm: bool = True) -> None:
        if (
            confirm
            and QMessageBox.question(self, "Delete chat", "Delete this chat and all its messages?")
            != QMessageBox.StandardButton.Yes
        ):
            return
        self.store.delete_conversation(cid)
        self.reload()
        emit(self.conversation_deleted, cid)

    def export(self, cid: int, fmt: str, path: str | None = None) -> None:
        conv = self.store.conversation(cid)
        if conv is None:
            return
        if path is None:
            safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.title)
            path, _ = QFileDialog.getSaveFileName(
                self,
                "Export chat",
                str(export_folder() / f"{safe}.{fmt}"),
                "Markdown (*.md)" if fmt == "md" else "JSON (*.json)",
            )
            if not path:
                return
        try:
            text = (
                self.store.export_markdown(cid)
                if fmt == "md"
                else json.dumps(self.store.export_json(cid), indent=2, ensure_ascii=False)
            )
            Path(path).write_text(text, encoding="utf-8")
        except OSError as exc:
            emit(self.notice, f"Could not export to {path}: {exc.strerror or exc}")
            return
        emit(self.notice, f"Exported to {path}")


def export_folder() -> Path:
    """Where an export is offered to go: the user's Documents folder (not the folder the app
    happened to start in), else their home."""
    documents = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    if documents and Path(documents).is_dir():
        return Path(documents)
    return Path.home()
