"""The Adapters menu: mounted LoRA adapters as checkable rows with a scale each,
``Mount adapter…`` and ``Unmount``.

The menu shows a choice; it does not talk to the engine. The main window turns
``changed`` into the conversation's remembered choice and the worker's active set.
"""

from __future__ import annotations

from typing import Any

from app.qt import (
    QAction,
    QCheckBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QMenu,
    QWidget,
    QWidgetAction,
    Signal,
    emit,
)


class AdapterRow(QWidget):
    """One mounted adapter: a check box (active or not) and its scale."""

    def __init__(self, adapter: Any, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("adapterRow")
        self.name = adapter.name
        row = QHBoxLayout(self)
        row.setContentsMargins(10, 3, 10, 3)
        row.setSpacing(10)
        self.check = QCheckBox(adapter.name)
        self.check.setToolTip(
            f"{adapter.path}\n{adapter.format} {adapter.kind}, rank {adapter.rank}, "
            f"{adapter.targets} layers" + (f"\ntrained on {adapter.base_model}" if adapter.base_model else "")
        )
        self.scale = QDoubleSpinBox()
        self.scale.setPrefix("×")
        self.scale.setRange(-4.0, 4.0)
        self.scale.setSingleStep(0.1)
        self.scale.setDecimals(2)
        self.scale.setValue(1.0)
        self.scale.setToolTip("How strongly the adapter applies (1 = as trained)")
        row.addWidget(self.check, 1)
        row.addWidget(self.scale)


class AdaptersMenu(QMenu):
    changed = Signal(dict)  # the chosen active set: name -> scale
    mount_requested = Signal()
    train_requested = Signal()
    unmount_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__("&Adapters", parent)
        self.setObjectName("adaptersMenu")
        self.rows: dict[str, AdapterRow] = {}
        self._quiet = False
        self.set_adapters([], {})

    def set_adapters(self, mounted: list[Any], active: dict[str, float], model_loaded: bool = True) -> None:
        """Rebuild for these mounted adapters, ticking (and scaling) the active ones."""
        self.clear()
        self.rows = {}
        self._quiet = True
        if not mounted:
            empty = QAction("No adapters mounted" if model_loaded else "Load a model first", self)
            empty.setEnabled(False)
            self.addAction(empty)
        for adapter in mounted:
            row = AdapterRow(adapter, self)
            row.check.setChecked(adapter.name in active)
            if adapter.name in active:
                row.scale.setValue(active[adapter.name])
            row.check.toggled.connect(self._emit_choice)
            row.scale.valueChanged.connect(self._scale_changed(row))
            action = QWidgetAction(self)
            action.setDefaultWidget(row)
            self.addAction(action)
            self.rows[adapter.name] = row
        self._quiet = False
        self.addSeparator()
        self.mount_action = self.addAction("Mount adapter…")
        self.mount_action.setEnabled(model_loaded)
        self.mount_action.triggered.connect(lambda: emit(self.mount_requested))
        self.train_action = self.addAction("Train…")
        self.train_action.setEnabled(model_loaded)
        self.train_action.triggered.connect(lambda: emit(self.train_requested))
        self.unmount_menu = self.addMenu("Unmount")
        self.unmount_menu.setEnabled(bool(mounted))
        for adapter in mounted:
            act = self.unmount_menu.addAction(adapter.name)
            act.triggered.connect(lambda _=False, n=adapter.name: emit(self.unmount_requested, n))

    def choice(self) -> dict[str, float]:
        return {name: round(row.scale.value(), 4) for name, row in self.rows.items() if row.check.isChecked()}

    def _scale_changed(self, row: AdapterRow):
        def changed(_value: float) -> None:
            if row.check.isChecked():  # an unticked adapter's scale waits for its tick
                self._emit_choice()

        return changed

    def _emit_choice(self, *_args) -> None:
        if not self._quiet:
            emit(self.changed, self.choice())
