"""The history's schema, and bringing a history written by another version up to it.

``SCHEMA`` is this version's tables and indexes; ``SCHEMA_VERSION`` is written into the file
(``PRAGMA user_version``) once it matches. On opening, ``bring_up_to_date``:

- refuses a history from a newer app (a ``user_version`` above ours, or a column this app
  does not know and could not fill, NOT NULL without a default) with ``NewerHistory``: this
  app would misread it or fail on its first write. The caller offers a fresh history or a
  salvage of what this app understands (app.history_recovery), never a dead start;
- adds to an older history what it lacks: whole tables, and any column that can be added
  with a default (empty text, 0, or the schema's own default), so an old file opens with its
  chats intact. A missing key column (an id or a reference) cannot be invented: that file is
  reported as damaged, and salvage copies what can be read.

Nothing is written when the file already matches (a read-only folder still opens far enough
to say it is read-only).
"""

from __future__ import annotations

import sqlite3

# 0: files written before the version was recorded (read as 1 when they match the schema).
SCHEMA_VERSION = 1

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


class NewerHistory(Exception):
    """The history was written by a newer version of the app than this one."""


def _reference() -> sqlite3.Connection:
    ref = sqlite3.connect(":memory:")
    ref.executescript(SCHEMA)
    return ref


def _columns(conn: sqlite3.Connection, table: str) -> dict[str, tuple]:
    """name -> (type, notnull, default, pk) as PRAGMA table_info reports them."""
    return {r[1]: (r[2], r[3], r[4], r[5]) for r in conn.execute(f"PRAGMA table_info({table})")}


def _add_column(table: str, name: str, spec: tuple, references: set[str]) -> str:
    """The ALTER TABLE that adds a column this version has and the file lacks."""
    kind, notnull, default, pk = spec
    if pk or name in references or (name == "role" and table == "messages"):
        # A key or a message's role cannot be made up: the rows would be wrong, not empty.
        raise sqlite3.DatabaseError(f"the {table} table has no {name} column")
    if default is None and notnull:
        default = "0" if kind.upper() in ("REAL", "INTEGER") else "''"
    return (
        f"ALTER TABLE {table} ADD COLUMN {name} {kind}"
        + (" NOT NULL" if notnull else "")
        + (f" DEFAULT {default}" if default is not None else "")
    )


def _changes(conn: sqlite3.Connection) -> list[str]:
    """What this file needs to match the schema (raises when it cannot)."""
    ref = _reference()
    try:
        wanted = [
            r[0] for r in ref.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")
        ]
        have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        statements: list[str] = []
        for table in wanted:
            if table not in have:
                (sql,) = ref.execute("SELECT sql FROM sqlite_master WHERE name=?", (table,)).fetchone()
                statements.append(sql)
                continue
            ours, theirs = _columns(ref, table), _columns(conn, table)
            for name, (kind, notnull, default, pk) in theirs.items():
                if name not in ours and notnull and default is None and not pk:
                    raise NewerHistory(
                        f"its {table} table has a column this version does not know ({name}) and cannot fill"
                    )
            references = {r[3] for r in ref.execute(f"PRAGMA foreign_key_list({table})")}
            statements += [_add_column(table, n, spec, references) for n, spec in ours.items() if n not in theirs]
        indexes = [r[0] for r in ref.execute("SELECT name FROM sqlite_master WHERE type='index' AND sql IS NOT NULL")]
        have_indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        for name in indexes:
            if name not in have_indexes:
                (sql,) = ref.execute("SELECT sql FROM sqlite_master WHERE name=?", (name,)).fetchone()
                statements.append(sql)
        return statements
    finally:
        ref.close()


def bring_up_to_date(conn: sqlite3.Connection) -> None:
    """Create, migrate or refuse (see the module's docstring). ``conn`` is in autocommit mode."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version > SCHEMA_VERSION:
        raise NewerHistory(f"it is schema version {version}; this version of MLX Desk reads up to {SCHEMA_VERSION}")
    statements = _changes(conn)
    if not statements and version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        for sql in statements:
            conn.execute(sql)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
