"""Model → Machines…: the machines a large model may be split across (see
app.controllers.machines): add or remove one, and check each (reachable or not, its MLX
and engine versions, free memory, a Thunderbolt link when JACCL is available), and how
a model is split across them (pipeline: layer ranges; tensor: a slice of every layer)."""

from __future__ import annotations

from app.controllers.machines import MachinesController, MachineStatus
from app.qt import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    Qt,
    QVBoxLayout,
    QWidget,
)
from app.tasks import spawn

HOST_ROLE = Qt.ItemDataRole.UserRole


class MachinesDialog(QDialog):
    def __init__(self, machines: MachinesController, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Machines")
        self.machines = machines
        self.status: dict[str, MachineStatus] = {}
        layout = QVBoxLayout(self)
        layout.addWidget(
            QLabel(
                "Machines that can hold part of a model too large for this one. Each needs MLX Desk "
                "(the same version) and ssh from this Mac without a password; see docs/sharding.md."
            )
        )
        self.list = QListWidget()
        layout.addWidget(self.list, 1)
        row = QHBoxLayout()
        self.host_edit = QLineEdit(placeholderText="studio-2.local or 10.0.0.2")
        self.add_button = QPushButton("Add")
        self.remove_button = QPushButton("Remove selected")
        self.check_button = QPushButton("Check all")
        for w in (self.host_edit, self.add_button, self.remove_button, self.check_button):
            row.addWidget(w)
        layout.addLayout(row)
        split_row = QHBoxLayout()
        split_row.addWidget(QLabel("Split a model across them by"))
        self.shard_combo = QComboBox()
        self.shard_combo.addItem("pipeline (layer ranges: machines of any size, any link)", "pipeline")
        self.shard_combo.addItem("tensor (a slice of every layer: equal machines, fast link)", "tensor")
        self.shard_combo.setCurrentIndex(max(0, self.shard_combo.findData(machines.shard)))
        self.shard_combo.currentIndexChanged.connect(lambda _i: machines.set_shard(self.shard_combo.currentData()))
        split_row.addWidget(self.shard_combo, 1)
        layout.addLayout(split_row)
        self.error = QLabel("", objectName="errorBanner")
        self.error.setWordWrap(True)
        layout.addWidget(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.add_button.clicked.connect(self._add)
        self.remove_button.clicked.connect(self._remove)
        self.check_button.clicked.connect(self.check_all)
        self.reload()

    def reload(self) -> None:
        self.list.clear()
        for host in self.machines.hosts:
            status = self.status.get(host)
            text = f"{host} — {'checking…' if status is None else ('' if status.reachable else '⚠ ') + status.detail}"
            item = QListWidgetItem(text)
            item.setData(HOST_ROLE, host)
            self.list.addItem(item)

    def _add(self) -> None:
        host = self.host_edit.text().strip()
        try:
            self.machines.add(host)
        except ValueError as e:
            self.error.setText(str(e))
            return
        self.error.setText("")
        self.host_edit.clear()
        self.reload()
        spawn(self._check(host))

    def _remove(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.machines.remove(item.data(HOST_ROLE))
            self.reload()

    def check_all(self) -> None:
        for host in self.machines.hosts:
            spawn(self._check(host))

    async def _check(self, host: str) -> None:
        self.status.pop(host, None)
        self.reload()
        self.status[host] = await self.machines.check(host)
        self.reload()
