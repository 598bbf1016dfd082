"""One app per data folder.

Two windows on one history fight over it: the second marks the first one's live reply
as interrupted at start-up and attaches messages to replies nobody sees. So the first
instance listens on a local socket named after its data folder; a second one started on
the same folder connects, hands over its command-line files (as a Dock drop does on
macOS) and exits before it touches the history. The running window comes to the front
and opens the files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from app.qt import QLocalServer, QLocalSocket, QObject, Signal, emit

CONNECT_TIMEOUT_MS = 1000
MAX_MESSAGE_BYTES = 1 << 20  # a list of paths, never more


def server_name(data_dir: str | Path) -> str:
    """A socket name per data folder (the same folder however it is spelled)."""
    key = str(Path(data_dir).expanduser().resolve())
    return "mlx-desk-" + hashlib.sha256(key.encode()).hexdigest()[:20]


class SingleInstance(QObject):
    """``claim`` is True for the first instance on a folder; later ones hand over and get False.
    ``files_received(files, model)`` fires in the first instance for each hand-over."""

    files_received = Signal(list, str)

    def __init__(self, data_dir: str | Path, parent: QObject | None = None):
        super().__init__(parent)
        self.name = server_name(data_dir)
        self.server: QLocalServer | None = None
        self._buffers: dict[QLocalSocket, bytes] = {}

    def claim(self, files: list[str] | None = None, model: str | None = None) -> bool:
        if self._hand_over(files or [], model or ""):
            return False
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.name):
            # A socket file left by an instance that crashed: nobody answered above.
            QLocalServer.removeServer(self.name)
            if not server.listen(self.name):
                return True  # cannot listen (odd platform): run, as before this guard existed
        server.newConnection.connect(self._accept)
        self.server = server
        return True

    def _hand_over(self, files: list[str], model: str) -> bool:
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if not socket.waitForConnected(CONNECT_TIMEOUT_MS):
            return False
        payload = (
            json.dumps({"files": [str(Path(f).expanduser().resolve()) for f in files], "model": model}).encode() + b"\n"
        )
        socket.write(payload)
        socket.waitForBytesWritten(CONNECT_TIMEOUT_MS)
        socket.waitForReadyRead(CONNECT_TIMEOUT_MS)  # the running window's "ok" (not required)
        socket.disconnectFromServer()
        return True

    def _accept(self) -> None:
        while self.server is not None and self.server.hasPendingConnections():
            socket = self.server.nextPendingConnection()
            self._buffers[socket] = b""
            socket.readyRead.connect(lambda s=socket: self._read(s))
            socket.disconnected.connect(lambda s=socket: self._drop(s))
            self._read(socket)

    def _read(self, socket: QLocalSocket) -> None:
        data = self._buffers.get(socket, b"") + bytes(socket.readAll().data())
        if len(data) > MAX_MESSAGE_BYTES:
            socket.abort()
            return
        self._buffers[socket] = data
        if not data.endswith(b"\n"):
            return
        try:
            message = json.loads(data)
            files = [str(f) for f in message.get("files", []) if isinstance(f, str)]
            model = message.get("model") if isinstance(message.get("model"), str) else ""
        except (ValueError, AttributeError):
            socket.abort()
            return
        socket.write(b"ok\n")
        socket.flush()
        self._buffers[socket] = b""
        emit(self.files_received, files, model)

    def _drop(self, socket: QLocalSocket) -> None:
        self._buffers.pop(socket, None)  # the socket is the server's child: it goes with it

    def close(self) -> None:
        for socket in list(self._buffers):
            socket.blockSignals(True)  # nothing may call back into a closing instance
        self._buffers.clear()
        if self.server is not None:
            self.server.blockSignals(True)
            self.server.close()
            self.server = None


def bring_forward(window, files: list[str], model: str = "") -> None:
    """A second instance's hand-over: this window to the front, a model among the files
    loaded, the other files attached (as a Dock drop does)."""
    from app.tasks import spawn
    from app.ui.file_open import is_model

    window.showNormal()
    window.raise_()
    window.activateWindow()
    paths = [Path(f) for f in files]
    model = model or next((str(p) for p in reversed(paths) if is_model(p)), "")
    attach = [str(p) for p in paths if not is_model(p)]

    async def open_them() -> None:
        if model:
            await window.load_model(model)
        if attach:
            window.composer.add_files(attach)

    if model or attach:
        spawn(open_them())
