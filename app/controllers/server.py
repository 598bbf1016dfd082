"""The local server from the window: the loaded model behind OpenAI- and Anthropic-
compatible HTTP, on the window's own worker (one model, one memory budget).

No widgets here: the Server menu drives ``start``/``stop``; ``changed`` says the address
(empty when stopped), ``logged`` brings one line per finished request, on the GUI thread.
The engine's server modules (and with them mlx) are imported on the first start only.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from app.qt import QObject, Signal, emit

DEFAULT_PORT = 8080


def lan_address() -> str:
    """This machine's address as other devices on the network see it (best effort)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "0.0.0.0"


class ServerController(QObject):
    changed = Signal(str)  # the address clients use ("http://HOST:PORT/v1"), "" when stopped
    logged = Signal(str)  # one finished request: "12:00:01  POST /v1/chat/completions 200 0.42 s"
    failed = Signal(str)  # the server could not start, in one readable line

    def __init__(self, bridge: Any, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.port = DEFAULT_PORT
        self.api_key = ""
        self.allow_network = False
        self.address = ""
        self._server: Any = None
        self._backend: Any = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> bool:
        """Listen with the current settings; False (and ``failed``) when it cannot."""
        if self._server is not None:
            return True
        from engine.errors import EngineError
        from engine.serve.backend import Backend
        from engine.serve.server import make_server

        host = "0.0.0.0" if self.allow_network else "127.0.0.1"
        bridge = self.bridge
        backend = Backend.shared(bridge.worker, lambda: bridge.model_info)
        try:
            server = make_server(backend, host, self.port, api_key=self.api_key or None, on_request=self._on_request)
        except EngineError as e:
            message = str(e)
            if "--api-key" in message:
                message = "Set an API key before allowing other devices on the network."
            emit(self.failed, message)
            return False
        bridge.add_event_tap(backend.route)
        self._server, self._backend = server, backend
        self._thread = threading.Thread(target=server.serve_forever, name="app-server", daemon=True)
        self._thread.start()
        port = server.server_address[1]
        self.address = f"http://{lan_address() if self.allow_network else '127.0.0.1'}:{port}/v1"
        emit(self.changed, self.address)
        return True

    def stop(self) -> None:
        server, backend = self._server, self._backend
        if server is None:
            return
        self._server = self._backend = None
        server.shutdown()
        server.server_close()
        self.bridge.remove_event_tap(backend.route)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.address = ""
        emit(self.changed, "")

    def _on_request(self, entry: dict[str, Any]) -> None:
        """Runs on the request's thread: the signal carries the line to the GUI thread."""
        stamp = time.strftime("%H:%M:%S")
        emit(
            self.logged,
            f"{stamp}  {entry['client']}  {entry['method']} {entry['path']}  "
            f"{entry['status']}  {entry['seconds']:.2f} s",
        )
