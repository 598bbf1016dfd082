"""The Server menu: start and stop the local OpenAI/Anthropic-compatible server on the
window's loaded model, its port and API key, "allow other devices on my network", the
address to copy, and a live request log.

Settings are kept in the store's preferences; the ServerController (app/server.py) does
the work. ``install_server_menu`` is the one hook the main window calls.
"""

from __future__ import annotations

from typing import Any

from app.controllers.server import DEFAULT_PORT, ServerController
from app.qt import (
    QAction,
    QApplication,
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
    QWidgetAction,
)

PORT_KEY, KEY_KEY, NETWORK_KEY = "server.port", "server.api_key", "server.allow_network"
LOG_LINES = 500


class RequestLog(QDialog):
    """The server's requests as they finish, newest last."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Server requests")
        self.resize(620, 320)
        self.view = QPlainTextEdit(objectName="serverLog")
        self.view.setReadOnly(True)
        self.view.setMaximumBlockCount(LOG_LINES)
        self.view.setPlaceholderText("Requests to the server show here.")
        layout = QVBoxLayout(self)
        layout.addWidget(self.view)

    def add(self, line: str) -> None:
        self.view.appendPlainText(line)


def _row(label: str, field: QWidget, parent: QWidget) -> QWidgetAction:
    holder = QWidget(parent)
    row = QHBoxLayout(holder)
    row.setContentsMargins(10, 3, 10, 3)
    row.addWidget(QLabel(label))
    row.addWidget(field, 1)
    action = QWidgetAction(parent)
    action.setDefaultWidget(holder)
    return action


class ServerMenu(QMenu):
    def __init__(self, controller: ServerController, store: Any, parent: QWidget | None = None):
        super().__init__("&Server", parent)
        self.controller, self.store = controller, store
        controller.port = int(store.preference(PORT_KEY, DEFAULT_PORT))
        controller.api_key = str(store.preference(KEY_KEY, "") or "")
        controller.allow_network = bool(store.preference(NETWORK_KEY, False))

        self.toggle_action = self.addAction("Start server", self.toggle)
        self.address_action = self.addAction("Copy address", self.copy_address)
        self.log_action = self.addAction("Request log…", self.show_log)
        self.addSeparator()
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.port.setValue(controller.port)
        self.port.setToolTip("The port the server listens on")
        self.addAction(_row("Port", self.port, self))
        self.key = QLineEdit(controller.api_key)
        self.key.setPlaceholderText("none")
        self.key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.key.setToolTip("Clients send it as 'Authorization: Bearer KEY'; needed for other devices")
        self.addAction(_row("API key", self.key, self))
        self.network_action = QAction("Allow other devices on my network", self, checkable=True)
        self.network_action.setChecked(controller.allow_network)
        self.network_action.setToolTip("Listen on every network interface (needs an API key)")
        self.addAction(self.network_action)

        self.log = RequestLog(parent)
        controller.logged.connect(self.log.add)
        controller.changed.connect(self._show_state)
        self._show_state(controller.address)

    def settings(self) -> None:
        """Copy the fields into the controller and remember them."""
        c = self.controller
        c.port, c.api_key, c.allow_network = self.port.value(), self.key.text().strip(), self.network_action.isChecked()
        self.store.set_preference(PORT_KEY, c.port)
        self.store.set_preference(KEY_KEY, c.api_key)
        self.store.set_preference(NETWORK_KEY, c.allow_network)

    def toggle(self) -> None:
        if self.controller.running:
            self.controller.stop()
        else:
            self.settings()
            self.controller.start()

    def copy_address(self) -> None:
        if self.controller.address:
            QApplication.clipboard().setText(self.controller.address)

    def show_log(self) -> None:
        self.log.show()
        self.log.raise_()

    def _show_state(self, address: str) -> None:
        running = bool(address)
        self.toggle_action.setText("Stop server" if running else "Start server")
        self.address_action.setEnabled(running)
        self.address_action.setText(f"Copy address  {address}" if running else "Copy address")
        for field in (self.port, self.key):
            field.setEnabled(not running)
        self.network_action.setEnabled(not running)


def _say_state(window: Any, address: str) -> None:
    if not address:
        if window.error_banner.text().startswith("Server listening on"):  # no longer true
            window.error_banner.setVisible(False)
        window.notify("Server stopped")
    elif window.bridge.model_info is None:  # it listens, but every request would get a 503
        window.show_error(
            f"Server listening on {address}, but no model is loaded: clients get “no model loaded” "
            "until you load one (Model → Models…)."
        )
    else:
        window.notify(f"Server listening on {address}")


def install_server_menu(window: Any) -> ServerMenu:
    """Add the Server menu to ``window``'s menu bar, over its bridge and store; the server
    stops with the window. Failures reach the window's error display."""
    controller = ServerController(window.bridge, window)
    menu = ServerMenu(controller, window.store, window)
    controller.failed.connect(window.show_error)
    controller.changed.connect(lambda address: _say_state(window, address))
    window.menuBar().addMenu(menu)
    return menu
