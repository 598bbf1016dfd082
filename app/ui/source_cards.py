"""Source cards under a reply that read the chat's documents: file, page or heading, passage.

One card per source the reply cites as [n] (or, citing none, per chunk that best matched
the question), as ``stats["sources"]`` saved with the message holds them. Clicking a
card opens the file in the system's viewer, at the page where the viewer reads a
``#page=N`` fragment (PDF viewers in browsers and most desktop readers do).
"""

from __future__ import annotations

import os

from app.qt import QDesktopServices, QFrame, QPushButton, QSizePolicy, QUrl, QVBoxLayout, QWidget


def source_url(path: str, page: int | None) -> QUrl:
    url = QUrl.fromLocalFile(path)
    if page:
        url.setFragment(f"page={page}")
    return url


def card_text(source: dict) -> str:
    where = f"page {source['page']}" if source.get("page") else (source.get("heading") or "")
    head = f"[{source['number']}] " if source.get("number") else ""
    name = os.path.basename(source["path"])
    passage = " ".join(source.get("passage", "").split())
    if len(passage) > 110:
        passage = passage[:107] + "…"
    return f"{head}{name}{' · ' + where if where else ''}\n{passage}"


class SourceCards(QFrame):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("sourceCards")
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 2, 0, 2)
        self._layout.setSpacing(4)
        self.cards: list[QPushButton] = []

    def set_sources(self, sources: list[dict]) -> None:
        for card in self.cards:
            self._layout.removeWidget(card)
            card.deleteLater()
        self.cards = []
        for source in sources:
            card = QPushButton(card_text(source), objectName="sourceCard")
            card.setToolTip(f"Open {source['path']}")
            card.setStyleSheet("text-align: left; padding: 4px 8px;")
            # The passage is cut to fit the reply's width: a card never widens the transcript.
            card.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
            card.setMinimumWidth(0)
            url = source_url(source["path"], source.get("page"))
            card.clicked.connect(lambda _=False, url=url: QDesktopServices.openUrl(url))
            self._layout.addWidget(card)
            self.cards.append(card)
        self.setVisible(bool(sources))
