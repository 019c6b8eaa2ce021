"""The served set as the database keeps it, so a restarted tracker serves what it served.

One row per model served or replaced through the admin calls: its name, the
file as the tracker and as the nodes see it, and — once replaced — the model
its name leads to. A release deletes the model's row and the rows of names
that led to it. At start (``ModelAdmin.restore``) the tracker serves its
``--model`` flags, then every recorded model not among them (whose nodes
re-register with what they hold, so their routes come back), then the
recorded replacements: a replaced name leads to its replacement again, also
when it is a ``--model`` flag (the database is the record of what the
operator did since). Trackers sharing one database each read it at start;
they do not see each other's later changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.tracker.storage.database import Database

_SCHEMA = """
CREATE TABLE IF NOT EXISTS served_models (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    node_path TEXT NOT NULL,
    replaced_by TEXT
)
"""


@dataclass(frozen=True)
class ServedRow:
    name: str
    path: str  # as the tracker sees it
    node_path: str  # as the nodes see it ("": their start model)
    replaced_by: str | None  # the model the name leads to, once replaced


class ServedStore:
    """The ``served_models`` table; any thread may call (each call is one statement)."""

    def __init__(self, db: Database) -> None:
        self._db = db
        db.create_schema(_SCHEMA)

    def rows(self) -> list[ServedRow]:
        rows = self._db.query("SELECT name, path, node_path, replaced_by FROM served_models")
        return [ServedRow(str(n), str(p), str(np), rb and str(rb)) for n, p, np, rb in rows]

    def served(self, name: str, path: str, node_path: str) -> None:
        """``name`` is served from ``path`` (a name served anew is no alias any more)."""
        self._put(ServedRow(name, path, node_path, None))

    def replaced(self, old: ServedRow, new: str) -> None:
        """``old`` was replaced by ``new``: its name, and every name that led to it, lead
        to ``new`` from now on."""
        self._put(ServedRow(old.name, old.path, old.node_path, new))
        self._db.run(
            "UPDATE served_models SET replaced_by = ? WHERE replaced_by = ?", (new, old.name)
        )

    def released(self, name: str) -> None:
        """``name`` is no longer served, and no name leads to it."""
        self._db.run("DELETE FROM served_models WHERE name = ? OR replaced_by = ?", (name, name))

    def _put(self, row: ServedRow) -> None:
        self._db.run(
            "INSERT INTO served_models (name, path, node_path, replaced_by) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (name) DO UPDATE SET path = excluded.path, "
            "node_path = excluded.node_path, replaced_by = excluded.replaced_by",
            (row.name, row.path, row.node_path, row.replaced_by),
        )
