"""Chat history in SQLite (``<data dir>/history.sqlite3``, WAL mode).

Messages form a tree: each message points at the one before it (``parent_id``).
Editing a user message or regenerating a reply adds a sibling, so earlier
versions stay; a conversation remembers which leaf is showing (``leaf_id``) and
the visible thread is the walk from that leaf up to the root.

Every write is its own committed transaction. With WAL and synchronous=NORMAL a
killed process loses nothing that was committed and never leaves a torn file.
This module imports no Qt so that it can be used (and killed) on its own.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.attachments import mime_type

DB_NAME = "history.sqlite3"

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL DEFAULT 'New chat',
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    model TEXT NOT NULL DEFAULT '',
    adapters TEXT NOT NULL DEFAULT '{}',
    leaf_id INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    version INTEGER NOT NULL DEFAULT 1,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'complete',
    stats TEXT NOT NULL DEFAULT '{}',
    model TEXT NOT NULL DEFAULT '',
    adapters TEXT NOT NULL DEFAULT '[]',
    tool_turns TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id);
CREATE TABLE IF NOT EXISTS attachments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    path TEXT NOT NULL,
    mime TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS attachments_by_message ON attachments(message_id);
CREATE TABLE IF NOT EXISTS preferences (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


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


class StoreError(Exception):
    """A write the history could not take (full disk, read-only or failing drive); the
    transaction was rolled back, so what was saved before is intact."""


def _write_failure(exc: sqlite3.Error) -> StoreError:
    text = str(exc).lower()
    if "full" in text:
        why = "the disk is full. Free some space"
    elif "readonly" in text or "read-only" in text:
        why = "the data folder is read-only. Make it writable"
    else:
        why = f"the drive reported an error ({exc}). Check the disk"
    return StoreError(f"Could not save to the chat history: {why}; nothing saved before is lost.")


class HistoryStore:
    """All reads and writes of the chat history. One connection, GUI thread only."""

    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.data_dir / DB_NAME
        # isolation_level=None: autocommit; each write below is one explicit transaction.
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        self._migrate()
        # A reply that was streaming when the app died is whatever was saved last.
        self._write("UPDATE messages SET status='interrupted' WHERE status='streaming'")

    def _migrate(self) -> None:
        """Bring a history written by an earlier version up to this schema."""
        cols = {r["name"] for r in self._db.execute("PRAGMA table_info(conversations)")}
        if "adapters" not in cols:
            self._write("ALTER TABLE conversations ADD COLUMN adapters TEXT NOT NULL DEFAULT '{}'")
        # A reply's tool calls and results, kept apart from its text (app.controllers.tool_turns);
        # older replies hold them in their text only, and are read as text.
        cols = {r["name"] for r in self._db.execute("PRAGMA table_info(messages)")}
        if "tool_turns" not in cols:
            self._write("ALTER TABLE messages ADD COLUMN tool_turns TEXT NOT NULL DEFAULT '[]'")

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN ... COMMIT, or ROLLBACK and a StoreError when the write cannot land."""
        try:
            with self._db:
                self._db.execute("BEGIN")
                yield self._db
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as exc:
            raise _write_failure(exc) from exc

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._transaction() as db:
            return db.execute(sql, args)

    # ---- conversations ------------------------------------------------------

    def create_conversation(
        self, title: str = "New chat", system_prompt: str = "", settings: dict | None = None
    ) -> int:
        now = time.time()
        cur = self._write(
            "INSERT INTO conversations (title, system_prompt, settings, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
            (title, system_prompt, json.dumps(settings or {}), now, now),
        )
        return int(cur.lastrowid)

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def list_conversations(self, search: str = "") -> list[Conversation]:
        """Newest first. ``search`` matches titles and message text."""
        if search:
            like = f"%{search}%"
            rows = self._db.execute(
                "SELECT * FROM conversations WHERE title LIKE ? OR id IN"
                " (SELECT conversation_id FROM messages WHERE content LIKE ?)"
                " ORDER BY updated_at DESC, id DESC",
                (like, like),
            ).fetchall()
        else:
            rows = self._db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC").fetchall()
        return [_conversation(r) for r in rows]

    def update_conversation(self, conversation_id: int, **fields: Any) -> None:
        allowed = {"title", "system_prompt", "settings", "model", "leaf_id", "adapters"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown conversation fields: {sorted(unknown)}")
        for key in ("settings", "adapters"):
            if key in fields:
                fields[key] = json.dumps(fields[key])
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        self._write(f"UPDATE conversations SET {cols} WHERE id=?", (*fields.values(), conversation_id))

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.update_conversation(conversation_id, title=title.strip() or "Untitled")

    def delete_conversation(self, conversation_id: int) -> None:
        self._write("DELETE FROM conversations WHERE id=?", (conversation_id,))

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
        """Append a message after ``parent_id`` and make it the conversation's leaf."""
        now = time.time()
        with self._transaction():
            (version,) = self._db.execute(
                "SELECT COUNT(*) + 1 FROM messages WHERE conversation_id=? AND parent_id IS ?",
                (conversation_id, parent_id),
            ).fetchone()
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, parent_id, version, role, content,"
                " status, model, adapters, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    parent_id,
                    version,
                    role,
                    content,
                    status,
                    model,
                    json.dumps(adapters or {}),
                    now,
                    now,
                ),
            )
            message_id = int(cur.lastrowid)
            for kind, path in attachments or []:
                self._db.execute(
                    "INSERT INTO attachments (message_id, kind, path, mime, created_at) VALUES (?, ?, ?, ?, ?)",
                    (message_id, kind, str(path), mime_type(path), now),
                )
            self._db.execute(
                "UPDATE conversations SET leaf_id=?, updated_at=? WHERE id=?",
                (message_id, now, conversation_id),
            )
        return message_id

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
    ) -> None:
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
        cols = ", ".join(f"{k}=?" for k in fields)
        self._write(f"UPDATE messages SET {cols} WHERE id=?", (*fields.values(), message_id))

    def message(self, message_id: int) -> Message | None:
        row = self._db.execute("SELECT * FROM messages WHERE id=?", (message_id,)).fetchone()
        return _message(row) if row else None

    def attachments(self, message_id: int) -> list[tuple[str, str]]:
        rows = self._db.execute(
            "SELECT kind, path FROM attachments WHERE message_id=? ORDER BY id", (message_id,)
        ).fetchall()
        return [(r["kind"], r["path"]) for r in rows]

    def _with_attachments(self, messages: list[Message]) -> list[Message]:
        if not messages:
            return messages
        by_id = {m.id: m for m in messages}
        marks = ",".join("?" * len(by_id))
        rows = self._db.execute(
            f"SELECT message_id, kind, path FROM attachments WHERE message_id IN ({marks}) ORDER BY id",
            tuple(by_id),
        ).fetchall()
        for r in rows:
            by_id[r["message_id"]].attachments.append((r["kind"], r["path"]))
        return messages

    def thread(self, conversation_id: int) -> list[Message]:
        """The visible messages, root first: the walk up from the conversation's leaf."""
        conv = self.conversation(conversation_id)
        if conv is None or conv.leaf_id is None:
            return []
        rows = self._db.execute(
            "WITH RECURSIVE up(id) AS (SELECT ? UNION ALL"
            " SELECT m.parent_id FROM messages m JOIN up ON m.id = up.id"
            " WHERE m.parent_id IS NOT NULL)"
            " SELECT messages.* FROM messages JOIN up ON messages.id = up.id",
            (conv.leaf_id,),
        ).fetchall()
        return self._with_attachments(sorted((_message(r) for r in rows), key=lambda m: (m.created_at, m.id)))

    def siblings(self, message_id: int) -> list[int]:
        """The versions of a message (same parent, same conversation), oldest first."""
        msg = self.message(message_id)
        if msg is None:
            return []
        rows = self._db.execute(
            "SELECT id FROM messages WHERE conversation_id=? AND parent_id IS ? ORDER BY id",
            (msg.conversation_id, msg.parent_id),
        ).fetchall()
        return [r["id"] for r in rows]

    def versions(self, conversation_id: int, messages: list[Message]) -> dict[int, tuple[int, int]]:
        """For each of ``messages``: (which version it is, from 1, how many there are), in one
        query for the whole conversation (a long thread asked once per message was slow)."""
        rows = self._db.execute(
            "SELECT id, parent_id FROM messages WHERE conversation_id=? ORDER BY id", (conversation_id,)
        ).fetchall()
        by_parent: dict[int | None, list[int]] = {}
        for r in rows:
            by_parent.setdefault(r["parent_id"], []).append(r["id"])
        out = {}
        for m in messages:
            sibs = by_parent.get(m.parent_id, [m.id])
            out[m.id] = (sibs.index(m.id) + 1 if m.id in sibs else 1, len(sibs))
        return out

    def show_version(self, message_id: int) -> None:
        """Make ``message_id`` visible: the leaf becomes its newest descendant."""
        msg = self.message(message_id)
        if msg is None:
            return
        leaf = message_id
        while True:
            row = self._db.execute(
                "SELECT id FROM messages WHERE parent_id=? ORDER BY id DESC LIMIT 1", (leaf,)
            ).fetchone()
            if row is None:
                break
            leaf = row["id"]
        self.update_conversation(msg.conversation_id, leaf_id=leaf)

    def set_leaf(self, conversation_id: int, message_id: int | None) -> None:
        self.update_conversation(conversation_id, leaf_id=message_id)

    # ---- app-wide preferences (kept with the history, so a data dir carries them) ------

    def preference(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM preferences WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    def set_preference(self, key: str, value: Any) -> None:
        if value is None:
            self._write("DELETE FROM preferences WHERE key=?", (key,))
        else:
            self._write(
                "INSERT INTO preferences (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, json.dumps(value)),
            )

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
