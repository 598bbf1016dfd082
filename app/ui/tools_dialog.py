"""Settings → Tools: the MCP servers the chat offers tools from (a stdio command or an
HTTP URL each), with the tools each is always allowed to run."""

from __future__ import annotations

from app.controllers.tools import ToolsController
from app.qt import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
)


class ToolsDialog(QDialog):
    def __init__(self, tools: ToolsController, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Tools (MCP servers)")
        self.tools = tools
        layout = QVBoxLayout(self)
        layout.addWidget(
            QLabel(
                "The chat offers these servers' tools to the model. Each call asks you first, "
                "unless you chose to always allow that tool."
            )
        )
        self.list = QListWidget()
        layout.addWidget(self.list, 1)
        form = QFormLayout()
        self.name_edit = QLineEdit(placeholderText="files")
        self.target_edit = QLineEdit(
            placeholderText="npx -y @modelcontextprotocol/server-filesystem ~/Documents  or  http://127.0.0.1:8000/mcp"
        )
        form.addRow("Name", self.name_edit)
        form.addRow("Command or URL", self.target_edit)
        layout.addLayout(form)
        self.error = QLabel("", objectName="errorBanner")
        self.error.setWordWrap(True)
        layout.addWidget(self.error)
        row = QHBoxLayout()
        self.add_button = QPushButton("Add server")
        self.remove_button = QPushButton("Remove selected")
        self.forget_button = QPushButton("Ask again for its tools")
        for b in (self.add_button, self.remove_button, self.forget_button):
            row.addWidget(b)
        layout.addLayout(row)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.add_button.clicked.connect(self._add)
        self.remove_button.clicked.connect(self._remove)
        self.forget_button.clicked.connect(self._forget)
        self.reload()
        if tools.config_problem:  # an empty list must not look like "no servers"
            self.error.setText(
                f"{tools.config_problem}. Fix the file, or add a server here (the file is kept as a backup first)."
            )

    def reload(self) -> None:
        self.list.clear()
        for s in self.tools.servers:
            kind = "HTTP" if s.url else "command"
            allowed = f"  · always allowed: {', '.join(sorted(s.always_allow))}" if s.always_allow else ""
            item = QListWidgetItem(f"{s.name}  ({kind}: {s.target}){allowed}")
            item.setData(256, s.name)  # Qt.UserRole
            self.list.addItem(item)

    def _selected(self) -> str | None:
        item = self.list.currentItem()
        return item.data(256) if item is not None else None

    def _add(self) -> None:
        try:
            self.tools.add_server(self.name_edit.text(), self.target_edit.text())
        except ValueError as exc:
            self.error.setText(str(exc))
            return
        self.error.setText("")
        self.name_edit.clear()
        self.target_edit.clear()
        self.reload()

    def _remove(self) -> None:
        name = self._selected()
        if name is not None:
            self.tools.remove_server(name)
            self.reload()

    def _forget(self) -> None:
        name = self._selected()
        for s in self.tools.servers:
            if s.name == name:
                s.always_allow.clear()
        self.tools.set_servers(self.tools.servers)
        self.reload()
