"""Chat history in SQLite (``<data dir>/history.sqlite3``, WAL mode).

Messages form a tree: each message points at the one before it (``parent_id``).
Editing a user message or regenerating a reply adds a sibling, so earlier
versions stay; a conversation remembers which leaf is showing (``leaf_id``) and
the visible thread is the walk from that leaf up to the root.

The GUI thread never waits on the disk in a chat: reads come from memory (every
conversation, and the messages of the chats opened lately), and a write changes memory
at once and is queued to one writer thread, which commits the writes in the order they
were made, each its own transaction. Ids are handed out here (one app per data folder),
so a message has its id before it is on disk. A write returns its Future; a caller that
must know it landed (the user's message before the engine is asked) awaits it and takes
the change back when it did not. Closing the store commits everything queued.

With WAL and synchronous=NORMAL a killed process loses nothing that was committed and
never leaves a torn file; what was still queued (a few milliseconds of writes) is lost.
This module imports no Qt so that it can be used (and killed) on its own.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.attachments import mime_type
from app.history_schema import SCHEMA, bring_up_to_date  # noqa: F401 - SCHEMA stays importable from here
from app.history_writer import Statement, StoreError, Writer, transaction

DB_NAME = "history.sqlite3"


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    settings: dict[str, Any]
    model: str
    leaf_id: int | None
    created_at: float
    updated_at: float
    adapters: dict[str, float] = field(default_factory=dict)  # chosen adapters -> scale


@dataclass
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    version: int
    role: str
    content: str
    reasoning: str = ""
    status: str = "complete"  # complete | streaming | cancelled | error
    stats: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    adapters: dict[str, float] = field(default_factory=dict)  # active when it was written
    created_at: float = 0.0
    updated_at: float = 0.0
    attachments: list[tuple[str, str]] = field(default_factory=list)  # (kind, stored path)
    # An assistant reply's tool rounds (app.controllers.tool_turns); [] for none or an older reply.
    tool_turns: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Chat:
    """One conversation's messages in memory: by id, and each parent's children in id order."""

    messages: dict[int, Message] = field(default_factory=dict)
    children: dict[int | None, list[int]] = field(default_factory=dict)

    def add(self, message: Message) -> None:
        self.messages[message.id] = message
        self.children.setdefault(message.parent_id, []).append(message.id)


# Chats whose messages stay in memory after another is opened; older ones are read again
# when next asked for (only once their writes have landed).
KEPT_CHATS = 16


class HistoryStore:
    """All reads and writes of the chat history, from the GUI thread (see the module's
    docstring: reads from memory, writes queued to one writer thread)."""

    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.data_dir / DB_NAME
        # isolation_level=None: autocommit. This connection reads (and sets up the file);
        # the writer thread has its own.
        self._reader = sqlite3.connect(self.path, isolation_level=None)
        self._reader.row_factory = sqlite3.Row
        # First, before anything is written: a newer app's file is refused untouched.
        bring_up_to_date(self._reader)  # an older history gains what it lacks
        self._reader.execute("PRAGMA journal_mode=WAL")
        self._reader.execute("PRAGMA synchronous=NORMAL")
        self._reader.execute("PRAGMA foreign_keys=ON")
        # A reply that was streaming when the app died is whatever was saved last.
        self._setup("UPDATE messages SET status='interrupted' WHERE status='streaming'")
        rows = self._reader.execute("SELECT * FROM conversations").fetchall()
        self._conversations = {r["id"]: _conversation(r) for r in rows}
        self._preferences = {
            r["key"]: json.loads(r["value"]) for r in self._reader.execute("SELECT key, value FROM preferences")
        }
        self._next_ids = {table: self._last_id(table) + 1 for table in ("conversations", "messages")}
        self._chats: OrderedDict[int, _Chat] = OrderedDict()  # most recently used last
        self._chat_of: dict[int, int] = {}  # message id -> conversation id, for the chats in memory
        self._pending = 0  # writes queued and not yet run
        self._pending_lock = threading.Lock()
        # Called on the writer thread for every write that failed (the window says it).
        self.on_failure: Callable[[StoreError], None] | None = None
        self.last_write: Future | None = None  # the Future of the write queued last
        self._writer = Writer(self.path, self._failed)
        # A store never closed (an exception on the way out) still commits what is queued
        # when the interpreter exits, before the writer's daemon thread is stopped.
        self._close_writer = weakref.finalize(self, self._writer.close)

    def _setup(self, sql: str) -> None:
        """A write made while opening, before the writer thread starts."""
        transaction(self._reader, [(sql, ())])

    def _last_id(self, table: str) -> int:
        """The highest id the table ever handed out (AUTOINCREMENT never hands one out twice)."""
        row = self._reader.execute("SELECT seq FROM sqlite_sequence WHERE name=?", (table,)).fetchone()
        (top,) = self._reader.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()
        return max(int(row["seq"]) if row else 0, int(top))

    def _new_id(self, table: str) -> int:
        self._next_ids[table] += 1
        return self._next_ids[table] - 1

    def close(self) -> None:
        """Commit everything queued, then close both connections."""
        self._close_writer()
        self._reader.close()

    # ---- the writer -------------------------------------------------------------------

    def _write(self, *statements: Statement) -> Future:
        with self._pending_lock:
            self._pending += 1
        done = self._writer.write(list(statements))
        done.add_done_callback(self._landed)
        self.last_write = done
        return done

    def _landed(self, _done: Future) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _failed(self, exc: StoreError) -> None:
        if self.on_failure is not None:
            self.on_failure(exc)

    def flush(self) -> None:
        """Wait until every write queued so far has landed (or failed)."""
        self._writer.flush()

    def on_writer(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``work`` with the writer's connection, in turn with the writes; its result.
        (Tests make the drive refuse writes this way.)"""
        return self._writer.call(work).result()

    @property
    def _db(self) -> sqlite3.Connection:
        """The reading connection once every queued write has landed: for looking at the
        file itself (integrity checks, salvage, tests), never in a chat's path."""
        self.flush()
        return self._reader

    # ---- conversations ------------------------------------------------------

    def create_conversation(
        self, title: str = "New chat", system_prompt: str = "", settings: dict | None = None
    ) -> int:
        now = time.time()
        cid = self._new_id("conversations")
        settings_json = json.dumps(settings or {})
        self._conversations[cid] = Conversation(
            cid, title, system_prompt, json.loads(settings_json), "", None, now, now, {}
        )
        self._remember(cid, _Chat())
        self._write(
            (
                "INSERT INTO conversations (id, title, system_prompt, settings, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (cid, title, system_prompt, settings_json, now, now),
            )
        )
        return cid

    def conversation(self, conversation_id: int) -> Conversation | None:
        conv = self._conversations.get(conversation_id)
        if conv is None:
            return None
        return replace(conv, settings=dict(conv.settings), adapters=dict(conv.adapters))  # the caller's own

    def list_conversations(self, search: str = "") -> list[Conversation]:
        """Newest first. ``search`` matches titles and message text."""
        convs = self._conversations.values()
        if search:
            like = f"%{search}%"
            found = {
                r["id"]
                for r in self._db.execute(  # searching every message: the file, once the writes landed
                    "SELECT id FROM conversations WHERE title LIKE ? OR id IN"
                    " (SELECT conversation_id FROM messages WHERE content LIKE ?)",
                    (like, like),
                )
            }
            convs = [c for c in convs if c.id in found]
        ranked = sorted(convs, key=lambda c: (c.updated_at, c.id), reverse=True)
        return [self.conversation(c.id) for c in ranked]

    def update_conversation(self, conversation_id: int, **fields: Any) -> Future:
        allowed = {"title", "system_prompt", "settings", "model", "leaf_id", "adapters"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown conversation fields: {sorted(unknown)}")
        for key in ("settings", "adapters"):
            if key in fields:
                fields[key] = json.dumps(fields[key])
        fields["updated_at"] = time.time()
        conv = self._conversations.get(conversation_id)
        if conv is not None:
            shown = {k: json.loads(v) if k in ("settings", "adapters") else v for k, v in fields.items()}
            if "adapters" in shown:
                shown["adapters"] = _scales(fields["adapters"])
            self._conversations[conversation_id] = replace(conv, **shown)
        cols = ", ".join(f"{k}=?" for k in fields)
        return self._write((f"UPDATE conversations SET {cols} WHERE id=?", (*fields.values(), conversation_id)))

    def rename_conversation(self, conversation_id: int, title: str) -> Future:
        return self.update_conversation(conversation_id, title=title.strip() or "Untitled")

    def delete_conversation(self, conversation_id: int) -> Future:
        self._conversations.pop(conversation_id, None)
        self._forget(conversation_id)
        return self._write(("DELETE FROM conversations WHERE id=?", (conversation_id,)))

    # ---- the chats in memory ------------------------------------------------------

    def _chat(self, conversation_id: int) -> _Chat:
        """The conversation's messages, read from the file the first time they are asked for."""
        chat = self._chats.get(conversation_id)
        if chat is not None:
            self._chats.move_to_end(conversation_id)
            return chat
        chat = _Chat()
        if conversation_id in self._conversations:
            rows = self._reader.execute(
                "SELECT * FROM messages WHERE conversation_id=? ORDER BY id", (conversation_id,)
            ).fetchall()
            for message in self._with_attachments([_message(r) for r in rows]):
                chat.add(message)
        self._remember(conversation_id, chat)
        return chat

    def _remember(self, conversation_id: int, chat: _Chat) -> None:
        self._chats[conversation_id] = chat
        for message_id in chat.messages:
            self._chat_of[message_id] = conversation_id
        if len(self._chats) > KEPT_CHATS and not self._pending:  # the file holds all of them now
            while len(self._chats) > KEPT_CHATS:
                oldest = next(iter(self._chats))
                self._forget(oldest)

    def _forget(self, conversation_id: int) -> None:
        chat = self._chats.pop(conversation_id, None)
        for message_id in chat.messages if chat is not None else ():
            self._chat_of.pop(message_id, None)

    def _find(self, message_id: int) -> tuple[_Chat, Message] | None:
        cid = self._chat_of.get(message_id)
        if cid is None:  # a message of a chat not in memory: written earlier, so in the file
            row = self._reader.execute("SELECT conversation_id FROM messages WHERE id=?", (message_id,)).fetchone()
            if row is None:
                return None
            cid = row["conversation_id"]
        chat = self._chat(cid)
        message = chat.messages.get(message_id)
        return (chat, message) if message is not None else None

    # ---- messages -------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        parent_id: int | None,
        *,
        status: str = "complete",
        model: str = "",
        adapters: dict[str, float] | None = None,
        attachments: list[tuple[str, str]] | None = None,
    ) -> int:
        """Append a message after ``parent_id`` and make it the conversation's leaf. Its
        write is ``last_write``."""
        now = time.time()
        chat = self._chat(conversation_id)
        version = len(chat.children.get(parent_id, [])) + 1
        message_id = self._new_id("messages")
        adapters_json = json.dumps(adapters or {})
        kept = [(kind, str(path)) for kind, path in attachments or []]
        message = Message(message_id, conversation_id, parent_id, version, role, content, status=status, model=model)
        message.adapters, message.attachments = _scales(adapters_json), kept
        message.created_at = message.updated_at = now
        chat.add(message)
        self._chat_of[message_id] = conversation_id
        conv = self._conversations.get(conversation_id)
        if conv is not None:
            self._conversations[conversation_id] = replace(conv, leaf_id=message_id, updated_at=now)
        row = (message_id, conversation_id, parent_id, version, role, content, status, model, adapters_json, now, now)
        self._write(
            (
                "INSERT INTO messages (id, conversation_id, parent_id, version, role, content,"
                " status, model, adapters, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            ),
            *(
                (
                    "INSERT INTO attachments (message_id, kind, path, mime, created_at) VALUES (?, ?, ?, ?, ?)",
                    (message_id, kind, path, mime_type(path), now),
                )
                for kind, path in kept
            ),
            ("UPDATE conversations SET leaf_id=?, updated_at=? WHERE id=?", (message_id, now, conversation_id)),
        )
        return message_id

    def take_back(self, message_id: int) -> None:
        """Forget a message whose write failed (it never reached the file): the
        conversation's leaf goes back to its parent, in memory, as in the file."""
        found = self._find(message_id)
        if found is None:
            return
        chat, message = found
        del chat.messages[message_id]
        chat.children[message.parent_id].remove(message_id)
        self._chat_of.pop(message_id, None)
        conv = self._conversations.get(message.conversation_id)
        if conv is not None and conv.leaf_id == message_id:
            self._conversations[conv.id] = replace(conv, leaf_id=message.parent_id)

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        reasoning: str | None = None,
        status: str | None = None,
        stats: dict | None = None,
        adapters: dict[str, float] | None = None,
        tool_turns: list[dict[str, Any]] | None = None,
    ) -> Future:
        fields: dict[str, Any] = {"updated_at": time.time()}
        if tool_turns is not None:
            fields["tool_turns"] = json.dumps(tool_turns)
        if adapters is not None:
            fields["adapters"] = json.dumps(adapters)
        if content is not None:
            fields["content"] = content
        if reasoning is not None:
            fields["reasoning"] = reasoning
        if status is not None:
            fields["status"] = status
        if stats is not None:
            fields["stats"] = json.dumps(stats)
        found = self._find(message_id)
        if found is not None:
            # What the file will hold, parsed back: the caller keeps its own lists and dicts.
            shown = {k: _loads(v) if k in ("tool_turns", "stats") else v for k, v in fields.items()}
            if "adapters" in shown:
                shown["adapters"] = _scales(fields["adapters"])
            chat, message = found
            chat.messages[message_id] = replace(message, **shown)  # never changed in place: views hold them
        cols = ", ".join(f"{k}=?" for k in fields)
        return self._write((f"UPDATE messages SET {cols} WHERE id=?", (*fields.values(), message_id)))

    def message(self, message_id: int) -> Message | None:
        found = self._find(message_id)
        return found[1] if found is not None else None

    def attachments(self, message_id: int) -> list[tuple[str, str]]:
        message = self.message(message_id)
        return list(message.attachments) if message is not None else []

    def _with_attachments(self, messages: list[Message]) -> list[Message]:
        if not messages:
            return messages
        by_id = {m.id: m for m in messages}
        marks = ",".join("?" * len(by_id))
        rows = self._reader.execute(
            f"SELECT message_id, kind, path FROM attachments WHERE message_id IN ({marks}) ORDER BY id",
            tuple(by_id),
        ).fetchall()
        for r in rows:
            by_id[r["message_id"]].attachments.append((r["kind"], r["path"]))
        return messages

    def thread(self, conversation_id: int) -> list[Message]:
        """The visible messages, root first: the walk up from the conversation's leaf."""
        conv = self._conversations.get(conversation_id)
        if conv is None or conv.leaf_id is None:
            return []
        chat = self._chat(conversation_id)
        out, at = [], chat.messages.get(conv.leaf_id)
        while at is not None:
            out.append(at)
            at = chat.messages.get(at.parent_id) if at.parent_id is not None else None
        return sorted(out, key=lambda m: (m.created_at, m.id))

    def siblings(self, message_id: int) -> list[int]:
        """The versions of a message (same parent, same conversation), oldest first."""
        found = self._find(message_id)
        if found is None:
            return []
        chat, message = found
        return list(chat.children.get(message.parent_id, []))

    def versions(self, conversation_id: int, messages: list[Message]) -> dict[int, tuple[int, int]]:
        """For each of ``messages``: (which version it is, from 1, how many there are)."""
        chat = self._chat(conversation_id)
        out = {}
        for m in messages:
            sibs = chat.children.get(m.parent_id, [m.id])
            out[m.id] = (sibs.index(m.id) + 1 if m.id in sibs else 1, len(sibs))
        return out

    def show_version(self, message_id: int) -> None:
        """Make ``message_id`` visible: the leaf becomes its newest descendant."""
        found = self._find(message_id)
        if found is None:
            return
        chat, message = found
        leaf = message_id
        while chat.children.get(leaf):
            leaf = chat.children[leaf][-1]
        self.update_conversation(message.conversation_id, leaf_id=leaf)

    def set_leaf(self, conversation_id: int, message_id: int | None) -> None:
        self.update_conversation(conversation_id, leaf_id=message_id)

    # ---- app-wide preferences (kept with the history, so a data dir carries them) ------

    def preference(self, key: str, default: Any = None) -> Any:
        return json.loads(json.dumps(self._preferences[key])) if key in self._preferences else default

    def set_preference(self, key: str, value: Any) -> None:
        """Waits for its commit (a preference is rare, and its caller says when the history
        could not keep it): raises StoreError, and memory keeps the old value, when it failed."""
        if value is None:
            done = self._write(("DELETE FROM preferences WHERE key=?", (key,)))
        else:
            done = self._write(
                (
                    "INSERT INTO preferences (key, value) VALUES (?, ?)"
                    " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    (key, json.dumps(value)),
                )
            )
        done.result()
        if value is None:
            self._preferences.pop(key, None)
        else:
            self._preferences[key] = json.loads(json.dumps(value))

    # ---- export -----------------------------------------------------------------

    def export_json(self, conversation_id: int) -> dict[str, Any]:
        conv = self.conversation(conversation_id)
        if conv is None:
            raise KeyError(conversation_id)
        return {
            "title": conv.title,
            "system_prompt": conv.system_prompt,
            "settings": conv.settings,
            "model": conv.model,
            "created_at": conv.created_at,
            "messages": [
                {
                    "role": m.role,
                    "content": m.content,
                    **({"reasoning": m.reasoning} if m.reasoning else {}),
                    **({"stats": m.stats} if m.stats else {}),
                    **({"model": m.model} if m.model else {}),
                    **({"adapters": m.adapters} if m.adapters else {}),
                    **({"attachments": [{"kind": k, "path": p} for k, p in m.attachments]} if m.attachments else {}),
                    **({"tool_turns": m.tool_turns} if m.tool_turns else {}),
                    "created_at": m.created_at,
                }
                for m in self.thread(conversation_id)
            ],
        }

    def export_markdown(self, conversation_id: int) -> str:
        data = self.export_json(conversation_id)
        parts = [f"# {data['title']}\n"]
        if data["system_prompt"]:
            parts.append(f"**System:** {data['system_prompt']}\n")
        for m in data["messages"]:
            parts.append(f"## {m['role'].capitalize()}\n")
            if m.get("reasoning"):
                quoted = "\n".join("> " + line for line in m["reasoning"].splitlines())
                parts.append(f"<details><summary>Reasoning</summary>\n\n{quoted}\n\n</details>\n")
            for a in m.get("attachments", []):
                name = Path(a["path"]).name
                parts.append(
                    f"![{name}]({Path(a['path']).as_uri()})\n"
                    if a["kind"] == "image"
                    else f"[{a['kind']}: {name}]({Path(a['path']).as_uri()})\n"
                )
            parts.append(m["content"].rstrip() + "\n")
        return "\n".join(parts)


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        id=row["id"],
        title=row["title"],
        system_prompt=row["system_prompt"],
        settings=json.loads(row["settings"] or "{}"),
        model=row["model"],
        leaf_id=row["leaf_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        adapters=_scales(row["adapters"]),
    )


def _message(row: sqlite3.Row) -> Message:
    return Message(
        id=row["id"],
        conversation_id=row["conversation_id"],
        parent_id=row["parent_id"],
        version=row["version"],
        role=row["role"],
        content=row["content"],
        reasoning=row["reasoning"],
        status=row["status"],
        stats=_loads(row["stats"] or "{}"),
        model=row["model"],
        adapters=_scales(row["adapters"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        tool_turns=_loads(row["tool_turns"] or "[]"),
    )


_EMPTY = {"{}": dict, "[]": list}


def _loads(text: str) -> Any:
    """JSON, where the empty values most rows hold skip the parser: a thread is read whole
    when a chat opens and at each turn, three columns a message."""
    make = _EMPTY.get(text)
    return make() if make is not None else json.loads(text)


def _scales(text: str | None) -> dict[str, float]:
    """Adapters as name -> scale; an older row's plain list of names means scale 1."""
    value = _loads(text or "{}")
    if isinstance(value, list):
        return {str(name): 1.0 for name in value}
    return {str(k): float(v) for k, v in value.items()}
