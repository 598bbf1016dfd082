"""Model browser: models on disk (with fits badge), hub search, download, delete, load.

"On this computer" lists the Hugging Face cache and the places the window passes in
(``extra_dirs``: folders the person added, models loaded lately, the one loaded now, which
is marked), each model once. Offline, a search or a download says so within seconds: the
Hub's host must take a connection first, and the search has a deadline.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from app.bridge import EngineBridge
from app.memory_units import fmt_bytes, machine_memory
from app.ops import Op
from app.qt import (
    QAbstractItemView,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.recommended import recommended_models
from app.tasks import spawn
from engine.api import ModelInfo

CONNECT_TIMEOUT_S = 4.0  # the Hub's address must take a connection this fast
SEARCH_TIMEOUT_S = 20.0  # and the search answer within this


def reachable(endpoint: str | None, timeout: float) -> None:
    """Raise OSError (one readable line) unless the Hub's host takes a TCP connection."""
    url = urlsplit(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return  # through a proxy the host itself may be out of reach: the search's deadline decides
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise OSError(f"{host} cannot be reached ({exc.strerror or exc})") from None


COLUMNS = ["Model", "Family", "Params", "Quant", "Size", "Context", "Fits"]


def fmt_params(n: int) -> str:
    if not n:
        return "—"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def fits_badge(info: ModelInfo, budget: int | None = None) -> str:
    """Whether the model fits the memory budget (``budget``: the one chosen in Settings;
    None: the engine's automatic one, which its plan was made under)."""
    plan = info.plan
    if plan is None:
        return "?"
    if budget:
        plan = replace(plan, budget_bytes=budget)
    experts = plan.experts
    if plan.fits and experts is not None and experts.streamed:
        return f"runs with experts from disk (about {experts.speed_share:.0%} of full speed)"
    if not plan.fits:
        return "✗ too big"
    context = info.context_length
    if not plan.kv_limits_context:  # every layer keeps a fixed window: any context fits
        return f"✓ fits ({context:,} tok)" if context else "✓ fits (any length)"
    # Memory for more tokens than the model reads is no use: say the smaller of the two.
    tokens = min(plan.max_context, context) if context else plan.max_context
    return f"✓ fits ({tokens:,} tok)"


def _same_path(a: Any, b: Any) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError, ValueError):
        return str(a) == str(b)


def _unique(found: list[Any]) -> list[Any]:
    """One row a model: a folder added and remembered as loaded, or a cache snapshot also
    added by hand, is listed once (the first, the cache's, with its repo id)."""
    seen: set[str] = set()
    rows = []
    for model in found:
        try:
            key = str(Path(model.path).resolve())
        except (OSError, RuntimeError, ValueError):
            key = str(model.path)
        if key not in seen:
            seen.add(key)
            rows.append(model)
    return rows


def _hub():
    from engine.artifacts import hub  # imported on demand: the catalogue is optional at start

    return hub


class ModelBrowser(QDialog):
    load_requested = Signal(str)  # model path
    notice = Signal(str)
    refreshed = Signal()
    searched = Signal(int)  # number of hub results shown (-1: the search failed)
    downloaded = Signal(str)  # repo id, once its files are all in the cache
    folder_added = Signal(str)  # a folder the person added (the window remembers it)
    _download_progress = Signal(float, float)  # from the download thread

    def __init__(self, bridge: EngineBridge, extra_dirs: list[str] | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("modelBrowser")
        self.setWindowTitle("Models")
        self.resize(860, 520)
        self.bridge = bridge
        self.extra_dirs = list(extra_dirs or [])
        self.local: list[tuple[Any, Any]] = []  # (LocalModel, ModelInfo | None)
        self.budget: int | None = None  # the memory budget "fits" is judged by (None: automatic)
        self.machines: Any = None  # app.controllers.machines: "fits across N machines"
        self._cancel_download: threading.Event | None = None
        # The Hub to talk to; None means huggingface_hub's default (HF_ENDPOINT or the real one).
        self.endpoint: str | None = None
        self.connect_timeout_s = CONNECT_TIMEOUT_S
        self.search_timeout_s = SEARCH_TIMEOUT_S
        layout = QVBoxLayout(self)
        tabs = QTabWidget()
        layout.addWidget(tabs)

        # ---- on disk
        local = QWidget()
        lv = QVBoxLayout(local)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        # "✓ fits (32,768 tok)" whole: the answer the person opened the list for.
        self.table.horizontalHeader().setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.ResizeToContents)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.doubleClicked.connect(lambda _: self._load_selected())
        lv.addWidget(self.table)
        row = QHBoxLayout()
        add = QPushButton("Add folder…", objectName="addFolder")
        add.clicked.connect(self._add_folder)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self._delete_selected)
        self.load_button = QPushButton("Load", objectName="primaryButton")
        self.load_button.clicked.connect(self._load_selected)
        row.addWidget(add)
        row.addWidget(self.delete_button)
        row.addStretch(1)
        row.addWidget(self.load_button)
        lv.addLayout(row)
        tabs.addTab(local, "On this computer")

        # ---- hub
        hub = QWidget()
        hv = QVBoxLayout(hub)
        srow = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search Hugging Face (e.g. mlx-community qwen)")
        self.query.returnPressed.connect(lambda: spawn(self.search()))
        srow.addWidget(self.query, 1)
        hv.addLayout(srow)
        self.results_title = QLabel("", objectName="fieldTitle")
        self.results_title.setWordWrap(True)  # a long failure wraps instead of widening the dialog
        hv.addWidget(self.results_title)
        self.results = QTableWidget(0, 3)
        self.results.setHorizontalHeaderLabels(["Repository", "Size", "About"])
        header = self.results.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.results.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.results.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.results.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.results.verticalHeader().setVisible(False)
        self.results.doubleClicked.connect(lambda _: self._download_selected())
        hv.addWidget(self.results)
        drow = QHBoxLayout()
        self.progress = QProgressBar()
        self.progress.setVisible(False)
        self.download_label = QLabel("")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setVisible(False)
        self.cancel_button.clicked.connect(self.cancel_download)
        self.download_button = QPushButton("Download", objectName="primaryButton")
        self.download_button.clicked.connect(self._download_selected)
        self.download_button.setSizePolicy(QSizePolicy.Policy.Maximum, QSizePolicy.Policy.Fixed)
        drow.addWidget(self.download_label)
        drow.addWidget(self.progress, 1)
        drow.addWidget(self.cancel_button)
        drow.addWidget(self.download_button)
        hv.addLayout(drow)
        tabs.addTab(hub, "Download")
        self.tabs = tabs
        self._download_progress.connect(self._show_progress)
        self.show_recommended()

    # ---- local models ------------------------------------------------------------------

    async def refresh(self) -> None:
        """Scan the HF cache and added folders, then inspect each (memory plan, fits)."""
        try:
            found = await Op(_hub().scan_local_models, self.extra_dirs)
        except Exception as exc:  # noqa: BLE001 - shown to the user
            emit(self.notice, f"Could not list local models: {exc}")
            found = []
        self.local = [(m, None) for m in _unique(found)]
        self._fill_local()  # headers are quick: show the list, then add the memory plans
        for i, (model, _) in enumerate(self.local):
            if model.error:
                continue
            try:
                self.local[i] = (model, await self.bridge.inspect(str(model.path)))
            except Exception as exc:  # noqa: BLE001 - one bad folder must not hide the rest
                model.error = str(exc)
        if self.machines is not None:  # too big here: across this and the saved machines?
            too_big = [
                str(m.path)
                for m, info in self.local
                if info is not None and fits_badge(info, self.budget).startswith("✗")
            ]
            await self.machines.plan_all(self.bridge, too_big)
        self._fill_local()
        emit(self.refreshed)

    def _fill_local(self) -> None:
        self.table.setRowCount(len(self.local))
        for r, (m, info) in enumerate(self.local):
            badge = "can't load" if m.error else fits_badge(info, self.budget) if info else "…"
            if badge.startswith("✗") and self.machines is not None:
                badge = self.machines.fits_across(str(m.path)) or badge
            cells = [
                m.name,
                m.family or "—",
                fmt_params(m.parameters),
                m.quantization or "—",
                fmt_bytes(m.size_on_disk),
                f"{m.context_length:,}" if m.context_length else "—",
                badge,
            ]
            loaded = self._is_loaded(m.path)
            tip = m.error or (f"{m.path} (loaded now)" if loaded else str(m.path))
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(tip)
                if loaded:  # the model in use stands out, and is where the selection starts
                    font = item.font()
                    font.setBold(True)
                    item.setFont(font)
                self.table.setItem(r, c, item)
            if loaded and self.table.currentRow() < 0:
                self.table.selectRow(r)

    def _is_loaded(self, path: Any) -> bool:
        info = self.bridge.model_info
        return info is not None and _same_path(info.path, path)

    def _selected_local(self) -> str | None:
        row = self.table.currentRow()
        return str(self.local[row][0].path) if 0 <= row < len(self.local) else None

    def _load_selected(self) -> None:
        path = self._selected_local()
        if path:
            emit(self.load_requested, path)
            self.accept()

    def _add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a model folder")
        if folder:
            self.extra_dirs.append(folder)
            emit(self.folder_added, folder)
            spawn(self.refresh())

    def _delete_selected(self) -> None:
        row = self.table.currentRow()
        if not 0 <= row < len(self.local):
            emit(self.notice, "Select a model to delete.")
            return
        model = self.local[row][0]
        if not model.repo_id:
            emit(self.notice, f"{model.name} is a folder you added: remove it with your file manager.")
            return
        if self.bridge.model_info is not None and self.bridge.model_info.path == str(model.path):
            emit(self.notice, f"{model.repo_id} is loaded: load another model before deleting it.")
            return
        box = QMessageBox(
            QMessageBox.Icon.Warning,
            "Delete model",
            f"Delete {model.repo_id} ({fmt_bytes(model.size_on_disk)}) from disk?",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            self,
        )
        box.setObjectName("confirmDelete")
        box.setInformativeText("You can download it again later.")
        box.setDefaultButton(QMessageBox.StandardButton.No)
        if box.exec() == QMessageBox.StandardButton.Yes:
            spawn(self.delete(model.repo_id))

    async def delete(self, repo_id: str) -> None:
        try:
            await Op(_hub().delete_local_model, repo_id)
        except Exception as exc:  # noqa: BLE001 - shown to the user
            emit(self.notice, f"Could not delete {repo_id}: {exc}")
            return
        emit(self.notice, f"Deleted {repo_id}")
        await self.refresh()

    # ---- hub -------------------------------------------------------------------------------

    def show_recommended(self, first_run: bool = False) -> None:
        """Offer the small models a new user should start with (default first, selected)."""
        picks = recommended_models(machine_memory())
        self.results_title.setText(
            "No models on this computer yet. Download a small one to start:"
            if first_run
            else "Recommended to start with:"
        )
        self._fill_results(
            [(m.repo_id, f"≈ {fmt_bytes(m.approx_size_bytes)}" if m.approx_size_bytes else "—", m.why) for m in picks]
        )
        if first_run:
            self.tabs.setCurrentIndex(1)
        self.results.selectRow(0)

    def _fill_results(self, rows: list[tuple[str, str, str]]) -> None:
        self.results.setRowCount(len(rows))
        for r, cells in enumerate(rows):
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                self.results.setItem(r, c, item)

    async def search(self) -> None:
        query = self.query.text().strip()
        if not query:
            self.show_recommended()
            return
        self.results_title.setText(f"Searching the Hugging Face Hub for “{query}”…")
        self._fill_results([])
        try:
            # Offline, the Hub client retries for close to a minute: a quick look at the
            # address first, and a deadline on the whole search, answer in seconds instead.
            await asyncio.wait_for(Op(reachable, self.endpoint, self.connect_timeout_s), self.search_timeout_s)
            found = await asyncio.wait_for(
                Op(_hub().search_hub, query, 50, endpoint=self.endpoint), self.search_timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - shown to the user, in the browser and the status bar
            why = (
                f"no answer within {self.search_timeout_s:.0f} s"
                if isinstance(exc, asyncio.TimeoutError)
                else " ".join(str(exc).split())
            )
            line = (
                f"Hub search failed: {why}. Searching needs the internet; models already on this "
                "computer are under “On this computer”."
            )
            self.results_title.setText(line)
            emit(self.notice, line)
            emit(self.searched, -1)
            return
        self.results_title.setText(f"{len(found)} models on the Hub match “{query}”:")
        self._fill_results(
            [
                (
                    hit.repo_id,
                    "—",
                    "  ·  ".join(
                        part
                        for part in (hit.library or "", f"{hit.downloads:,} downloads", (hit.last_modified or "")[:10])
                        if part
                    ),
                )
                for hit in found
            ]
        )
        emit(self.searched, len(found))

    def _download_selected(self) -> None:
        item = self.results.item(self.results.currentRow(), 0)
        if item is not None:
            spawn(self.download(item.text()))

    async def download(self, repo_id: str) -> str | None:
        """Download (resuming partial files); progress shows, Cancel stops it."""
        self._cancel_download = cancel = threading.Event()
        self.progress.setVisible(True)
        # Busy until the first figure: a resumed download starts past zero, not at it.
        self.progress.setRange(0, 0)
        self.cancel_button.setVisible(True)
        self.download_button.setEnabled(False)
        self.download_label.setText(repo_id)

        def progress(done: float, total: float, *_: Any) -> None:  # download thread
            emit(self._download_progress, float(done), float(total))

        try:
            # Offline, say so in seconds rather than after the Hub client's retries.
            await Op(reachable, self.endpoint, self.connect_timeout_s)
            path = await Op(_hub().download, repo_id, progress=progress, cancel=cancel, endpoint=self.endpoint)
        except Exception as exc:  # noqa: BLE001 - shown to the user
            emit(
                self.notice,
                f"Download of {repo_id} stopped; run it again to resume."
                if cancel.is_set()
                else f"Download of {repo_id} failed: {exc}",
            )
            return None
        finally:
            self.progress.setVisible(False)
            self.cancel_button.setVisible(False)
            self.download_button.setEnabled(True)
            self.download_label.setText("")
        emit(self.notice, f"Downloaded {repo_id}")
        await self.refresh()
        self.tabs.setCurrentIndex(0)
        for row, (model, _) in enumerate(self.local):
            if model.repo_id == repo_id:
                self.table.selectRow(row)
        emit(self.downloaded, repo_id)
        return str(path)

    def cancel_download(self) -> None:
        if self._cancel_download is not None:
            self._cancel_download.set()

    def _show_progress(self, done: float, total: float) -> None:
        self.progress.setRange(0, 1000 if total else 0)
        if total:
            self.progress.setValue(int(1000 * done / total))
            self.progress.setFormat(f"{fmt_bytes(done)} / {fmt_bytes(total)}")
