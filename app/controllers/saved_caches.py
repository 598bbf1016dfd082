"""SavedCaches: each conversation's KV cache kept in the data folder between runs.

The engine writes and reads the files (SaveSession / RestoreSession); this controller
decides when and where. A conversation's cache goes to ``kv-cache/<id>.safetensors``
when a reply ends and, for a reply still unsaved, when the app quits. Before the first
turn a conversation has in this engine, its saved cache is offered back: the engine takes
it only when the model, adapters, template and KV settings are the ones it was made
under, and skips a damaged file (the turn is prefilled in full and the file replaced).

The files share a disk budget (Settings, default 10 GB): after each save the least
recently used files go first until the rest fit. A file's modification time is its last
use: saving writes it, restoring touches it. The engine saves most chats by block (a session
file and block files in ``kv-cache/blocks/`` that chats starting the same way share,
engine/kv_files.py): the budget counts each block once, a conversation's size is what
reopening it reads, and a block goes when no remaining session names it.

The GUI thread never reads the folder: listing it, stating the files and enforcing the
budget run on a helper thread (a slow or busy disk stalled the window), and the window
shows the sizes found by the last scan (``known``), rescanned after every change.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import Counter
from pathlib import Path

from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable
from app.memory_units import GB
from app.ops import Op
from app.qt import QObject, Signal, emit
from app.store import HistoryStore
from engine import kv_files

FOLDER = "kv-cache"
BUDGET_KEY = "kv_cache_budget_bytes"
DEFAULT_BUDGET = 10 * GB


class SavedCaches(QObject):
    status = Signal(str)  # a readable line for the status bar
    changed = Signal()  # files were written or removed (sizes in the sidebar's tooltips)
    saved = Signal(int, int)  # conversation id, bytes written (0: nothing worth saving)

    def __init__(self, bridge: EngineBridge, store: HistoryStore, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge, self.store = bridge, store
        self.folder = Path(store.data_dir) / FOLDER
        self._unsaved: set[int] = set()  # conversations with a reply not saved yet
        self.last_restore: dict[int, object] = {}  # conversation id -> SessionRestore
        self.known: dict[int, int] = {}  # the sizes the last scan found (what the window shows)
        self._scans = 0  # scans asked for; only the latest one's result is taken
        self._scan_lock = threading.Lock()  # one scan at a time: a budget is kept, then read
        self.rescan()

    # ---- the budget (an app-wide preference) -------------------------------------------

    @property
    def budget(self) -> int:
        value = self.store.preference(BUDGET_KEY)
        return DEFAULT_BUDGET if value is None else max(0, int(value))

    def set_budget(self, nbytes: int | None) -> None:
        """None: back to the default. Files over the new budget go at once (on the helper
        thread; ``changed`` follows)."""
        self.store.set_preference(BUDGET_KEY, None if nbytes is None else int(nbytes))
        self.rescan(enforce=True)

    # ---- files ---------------------------------------------------------------------------

    def path_for(self, conversation_id: int) -> Path:
        return self.folder / f"{int(conversation_id)}.safetensors"

    def sizes(self) -> dict[int, int]:
        """Conversation id -> bytes of its saved cache, for every file there is."""
        out: dict[int, int] = {}
        for path in self._files():
            if path.stem.isdigit() and path.is_file():
                out[int(path.stem)] = kv_files.session_bytes(path)
        return out

    def total_bytes(self) -> int:
        """Every saved cache's bytes, a block shared by several counted once."""
        return kv_files.folder_bytes(self.folder, self._files())

    def rescan(self, enforce: bool = False, keep: int | None = None, gone: Path | None = None) -> None:
        """Scan the folder on a helper thread (first removing ``gone``'s session with its
        blocks no other session names, then enforcing the budget, with ``keep`` last to go);
        ``known`` takes the sizes and ``changed`` is emitted on the GUI thread."""
        budget = self.budget  # read here: the store is the GUI thread's
        self._scans += 1
        ticket = self._scans

        Op(self._scan, budget, keep, enforce, gone).success(lambda sizes: self._took_scan(ticket, sizes)).run(self)

    def _scan(self, budget: int, keep: int | None, enforce: bool, gone: Path | None = None) -> dict[int, int]:
        """On a helper thread: keep the budget if asked, then list the sizes."""
        with self._scan_lock:
            if gone is not None:
                self._remove(gone)
            if enforce:
                self._enforce(budget, keep)
            return self.sizes()

    def _remove(self, session: Path) -> None:
        """Delete a session file and the blocks it alone named."""
        blocks = kv_files.named_blocks(kv_files.header_metadata(session))
        session.unlink(missing_ok=True)
        kv_files.collect(self.folder, self._files(), dropped=blocks)

    def _took_scan(self, ticket: int, sizes: dict[int, int]) -> None:
        if ticket != self._scans:  # a later scan (after a later change) is on its way
            return
        self.known = sizes
        emit(self.changed)

    def _files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return [p for p in self.folder.glob("*.safetensors") if not p.name.startswith(".")]

    def forget(self, conversation_id: int) -> None:
        """The conversation is gone: so is its cache, with the blocks no other chat names
        (removed on the helper thread)."""
        self._unsaved.discard(conversation_id)
        self.known.pop(conversation_id, None)
        emit(self.changed)
        self.rescan(gone=self.path_for(conversation_id))  # a scan under way found it: stale now

    def clear(self) -> int:
        """Delete every saved cache (the engine's live caches stay); returns the bytes freed."""
        freed = self.total_bytes()
        for path in self._files():
            path.unlink(missing_ok=True)
        shutil.rmtree(self.folder / kv_files.BLOCKS, ignore_errors=True)
        freed -= self.total_bytes()
        self.known = {}
        self._scans += 1  # a scan under way found them: its result is stale
        emit(self.changed)
        return freed

    def enforce_budget(self, keep: int | None = None) -> list[int]:
        """Delete the least recently used files until the rest fit the budget; ``keep``
        (the file just written) goes last. Returns the conversations whose cache went."""
        return self._enforce(self.budget, keep)

    def _enforce(self, budget: int, keep: int | None) -> list[int]:
        entries = []
        for path in self._files():
            try:
                st = path.stat()
                entries.append((path.stem == str(keep), st.st_mtime, st.st_size, path))
            except OSError:
                continue
        names = kv_files.blocks_by_session(p for *_, p in entries)
        holders = Counter(d for blocks in names.values() for d in set(blocks))
        total = kv_files.folder_bytes(self.folder, names)
        removed, dropped = [], []
        for _, _, size, path in sorted(entries, key=lambda e: (e[0], e[1])):
            if total <= budget:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            for digest in set(names.pop(path)):  # its blocks no other session names go too
                holders[digest] -= 1
                if not holders[digest]:
                    total -= kv_files.file_size(kv_files.block_file(self.folder, digest))
                    dropped.append(digest)
            removed.append(int(path.stem) if path.stem.isdigit() else -1)
        kv_files.collect(self.folder, names, dropped=dropped)
        return removed

    # ---- engine round trips ---------------------------------------------------------------

    async def restore(self, conversation_id: int) -> int:
        """Offer the conversation's saved cache to the engine; returns the tokens it took.
        Never fails the turn: a refused or unreadable file only means a full prefill."""
        path = self.path_for(conversation_id)
        if not self.bridge.running or not await Op(path.is_file):
            return 0
        try:
            restored = await self.bridge.restore_session(conversation_id, str(path))
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.status, f"The saved cache of this chat was not used: {exc}")
            return 0
        self.last_restore[conversation_id] = restored
        if restored.tokens:
            await Op(_touch, path)  # recently used: last out under the budget
        return restored.tokens

    async def save(self, conversation_id: int) -> int:
        """Write the conversation's cache (after a reply); returns the bytes written."""
        self._unsaved.add(conversation_id)
        if not self.bridge.running:  # quitting: save_at_quit has queued it
            return 0
        path = self.path_for(conversation_id)
        try:
            written = await self.bridge.save_session(conversation_id, str(path))
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.status, f"Could not save this chat's cache (the next turn re-reads it): {exc}")
            emit(self.saved, conversation_id, 0)
            return 0
        self._unsaved.discard(conversation_id)
        self.known[conversation_id] = written
        emit(self.saved, conversation_id, written)
        self.rescan(enforce=True, keep=conversation_id)  # ``changed`` once the budget is kept
        return written

    def is_unsaved(self, conversation_id: int) -> bool:
        """Whether the conversation's cache changed since it was last saved."""
        return conversation_id in self._unsaved

    def note_reply(self, conversation_id: int) -> None:
        """A reply is under way: until it is saved, quitting saves it."""
        self._unsaved.add(conversation_id)

    def save_at_quit(self) -> None:
        """Queue a save of every conversation whose cache changed since its last save; the
        worker writes them (after any reply it is stopping) before it shuts down."""
        for conversation_id in sorted(self._unsaved):
            self.bridge.save_session_soon(conversation_id, str(self.path_for(conversation_id)))
        self._unsaved.clear()


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
