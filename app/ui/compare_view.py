"""The Compare window: two columns, each a header (its adapters, or that it waits), the
answer streaming in, its source cards when the chat has documents, its stats, and "Keep
this" to make it the chat's reply."""

from __future__ import annotations

from app.controllers.compare import CompareController
from app.qt import QDialog, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, Qt, QVBoxLayout, QWidget
from app.ui.source_cards import SourceCards


class CompareView(QDialog):
    def __init__(self, compare: CompareController, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Compare")
        self.resize(960, 560)
        self.compare = compare
        columns = QHBoxLayout(self)
        self.headers: list[QLabel] = []
        self.texts: list[QPlainTextEdit] = []
        self.stats: list[QLabel] = []
        self.keep_buttons: list[QPushButton] = []
        self.cards: list[SourceCards] = []
        for col in range(2):
            header = QLabel("", objectName="compareHeader")
            header.setTextFormat(Qt.TextFormat.PlainText)  # adapter names are not HTML
            text = QPlainTextEdit(readOnly=True)
            stats = QLabel("", objectName="statsLabel")
            cards = SourceCards()
            cards.setVisible(False)
            keep = QPushButton("Keep this", enabled=False)
            keep.clicked.connect(lambda _=False, col=col: self._keep(col))
            column = QVBoxLayout()
            column.addWidget(header)
            column.addWidget(text, 1)
            column.addWidget(cards)
            column.addWidget(stats)
            column.addWidget(keep)
            columns.addLayout(column)
            self.headers.append(header)
            self.texts.append(text)
            self.stats.append(stats)
            self.keep_buttons.append(keep)
            self.cards.append(cards)
        compare.header.connect(lambda col, line: self.headers[col].setText(line))
        compare.token.connect(self._append)
        compare.column_done.connect(self._done)

    def start(self) -> None:
        for col in range(2):
            self.texts[col].clear()
            self.stats[col].setText("")
            self.keep_buttons[col].setEnabled(False)
            self.cards[col].set_sources([])

    def _append(self, col: int, text: str) -> None:
        self.texts[col].insertPlainText(text)

    def _done(self, col: int, text: str, stats: dict) -> None:
        self.texts[col].setPlainText(text)
        parts = [f"{stats.get('generated_tokens', 0)} tokens"]
        if stats.get("generation_tps"):
            parts.append(f"{stats['generation_tps']:.1f} tok/s")
        if stats.get("time_to_first_token"):
            parts.append(f"TTFT {stats['time_to_first_token'] * 1000:.0f} ms")
        self.stats[col].setText("  ·  ".join(parts))
        self.cards[col].set_sources(stats.get("sources") or [])
        self.keep_buttons[col].setEnabled(True)

    def _keep(self, col: int) -> None:
        if self.compare.keep(col) is not None:
            self.accept()
