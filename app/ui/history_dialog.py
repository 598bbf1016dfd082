"""The dialog that says why the history could not be opened and offers the way out."""

from __future__ import annotations

from pathlib import Path

from app.history_recovery import Choice, HistoryProblem
from app.qt import QDialog, QFileDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout


class HistoryDialog(QDialog):
    def __init__(self, problem: HistoryProblem, parent=None):
        super().__init__(parent)
        self.setWindowTitle("MLX Desk: chat history")
        self.problem = problem
        self.choice: tuple[str, Path | None] = ("quit", None)
        layout = QVBoxLayout(self)
        self.text = QLabel(problem.message, objectName="historyProblem")
        self.text.setWordWrap(True)
        layout.addWidget(self.text)
        row = QHBoxLayout()
        self.buttons: dict[str, QPushButton] = {}
        actions = (
            [("fresh", "Start a fresh history"), ("salvage", "Salvage what can be read")]
            if problem.kind in ("damaged", "newer")
            else [("retry", "Try again")]
        )
        actions += [("folder", "Choose another folder…"), ("quit", "Quit")]
        for key, label in actions:
            button = QPushButton(label, objectName=f"history_{key}")
            button.clicked.connect(lambda _=False, key=key: self._choose(key))
            row.addWidget(button)
            self.buttons[key] = button
        layout.addLayout(row)

    def _choose(self, key: str) -> None:
        folder = None
        if key == "folder":
            chosen = QFileDialog.getExistingDirectory(
                self, "Folder for the chat history", str(self.problem.data_dir.parent)
            )
            if not chosen:
                return  # still deciding
            folder = Path(chosen)
        self.choice = (key, folder)
        self.accept()


def ask_with_dialog(problem: HistoryProblem) -> Choice:
    dialog = HistoryDialog(problem)
    dialog.exec()
    choice = dialog.choice
    dialog.deleteLater()  # a parentless dialog left to the garbage collector outlives Qt at exit
    return choice
