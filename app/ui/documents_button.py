"""The status bar's "📄 2 documents · 53 pages" button: what the open chat reads, with a
menu to open or take out each document (the files themselves are never touched)."""

from __future__ import annotations

import os

from app.controllers.documents import DocumentsController
from app.qt import QDesktopServices, QMenu, QToolButton, QUrl, QWidget


class DocumentsButton(QToolButton):
    def __init__(self, documents: DocumentsController, parent: QWidget | None = None):
        super().__init__(parent)
        self.documents = documents
        self.conversation_id: int | None = None
        self.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.setMenu(QMenu(self))
        self.setVisible(False)

    def show_chat(self, conversation_id: int | None) -> None:
        self.conversation_id = conversation_id
        files = self.documents.listing(conversation_id)
        self.setVisible(bool(files))
        pages = sum(f["pages"] or 0 for f in files)
        self.setText(f"📄 {len(files)} document{'s' if len(files) != 1 else ''} · {pages:,} pages")
        self.setToolTip("The documents this chat reads: click to open one or take it out")
        menu = self.menu()
        menu.clear()
        for f in files:
            sub = menu.addMenu(os.path.basename(f["path"]))
            sub.addAction("Open", lambda p=f["path"]: QDesktopServices.openUrl(QUrl.fromLocalFile(p)))
            sub.addAction("Take out of this chat", lambda p=f["path"]: self._remove(p))

    def _remove(self, path: str) -> None:
        if self.conversation_id is not None:
            self.documents.remove(self.conversation_id, path)
            self.show_chat(self.conversation_id)
