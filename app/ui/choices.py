"""Ask with choices: the user types a question and a few options; the model scores each
option as an answer (the engine's decision scoring) and a bar chart of the options'
probabilities appears under the question.

``ChoicesRow`` is the composer's options field (options split by ``|`` or new lines);
``ChoicesResult`` shows the question and a ``ChoiceChart``: one bar per option, its
length the probability, the percentage and the option's text beside it.
"""

from __future__ import annotations

from app.qt import (
    QColor,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPainter,
    QRectF,
    QSize,
    Qt,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

BAR_HEIGHT = 18
BAR_GAP = 6
LABEL_WIDTH = 160


def split_options(text: str) -> list[str]:
    """The options typed in the field: split by ``|`` or new lines, blanks dropped."""
    return [part.strip() for part in text.replace("\n", "|").split("|") if part.strip()]


class ChoicesRow(QWidget):
    """The options field, shown while the composer's Choices button is on."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("choicesRow")
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(QLabel("Options:"))
        self.edit = QLineEdit(objectName="choicesEdit")
        self.edit.setPlaceholderText("yes | no | maybe   (the model scores each as an answer)")
        row.addWidget(self.edit, 1)

    def options(self) -> list[str]:
        return split_options(self.edit.text())


class ChoiceChart(QWidget):
    """Horizontal bars: each option's probability, the most likely one highlighted."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("choiceChart")
        self.items: list[tuple[str, float]] = []

    def set_items(self, items: list[tuple[str, float]]) -> None:
        self.items = list(items)
        self.setMinimumHeight(self.sizeHint().height())
        self.updateGeometry()
        self.update()

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(LABEL_WIDTH + 240, max(1, len(self.items)) * (BAR_HEIGHT + BAR_GAP))

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        if not self.items:
            return
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        text_color = self.palette().color(self.foregroundRole())
        best = max(p for _, p in self.items)
        room = max(10.0, self.width() - LABEL_WIDTH - 56.0)
        for i, (label, prob) in enumerate(self.items):
            top = i * (BAR_HEIGHT + BAR_GAP)
            painter.setPen(text_color)
            label_rect = QRectF(0, top, LABEL_WIDTH - 8, BAR_HEIGHT)
            shown = painter.fontMetrics().elidedText(label, Qt.TextElideMode.ElideRight, LABEL_WIDTH - 8)
            painter.drawText(label_rect, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, shown)
            color = QColor("#3b82f6") if prob == best else QColor("#94a3b8")
            painter.fillRect(QRectF(LABEL_WIDTH, top + 2, max(1.0, room * prob), BAR_HEIGHT - 4), color)
            painter.drawText(
                QRectF(LABEL_WIDTH + room * prob + 6, top, 56, BAR_HEIGHT),
                Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                f"{prob:.0%}" if prob >= 0.01 else f"{prob:.1%}",
            )
        painter.end()


class ChoicesResult(QFrame):
    """The last question asked with choices and its chart, under the conversation."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("choicesResult")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 6, 12, 6)
        head = QHBoxLayout()
        self.question = QLabel("", objectName="choicesQuestion")
        self.question.setWordWrap(True)
        close = QToolButton(text="×", objectName="actionButton")
        close.setToolTip("Hide the choices")
        close.clicked.connect(lambda: self.setVisible(False))
        head.addWidget(self.question, 1)
        head.addWidget(close)
        layout.addLayout(head)
        self.chart = ChoiceChart(self)
        layout.addWidget(self.chart)
        self.setVisible(False)

    def show_waiting(self, question: str) -> None:
        self.question.setText(f"{question}\n(scoring the options…)")
        self.chart.set_items([])
        self.setVisible(True)

    def show_result(self, question: str, options: list[str], probabilities: list[float]) -> None:
        self.question.setText(question)
        self.chart.set_items(list(zip(options, probabilities)))
        self.setVisible(True)
