"""Which model each session is on, and its conversation as text, in the tracker's database.

A session's token history is in its model's vocabulary, so a session belongs to
the model it was opened on (``bind``). When that model is replaced, the next
turn runs on the replacement: the history's ids mean nothing there, so the turn
re-prefills from the conversation as text (``conversation``: the system prompt
is the session's; each completed turn's user content and reply text), rendered
with the new model's chat template (``model_turns``).
"""

from __future__ import annotations

import json

from meshnet.model.chat import ChatMessage
from meshnet.tracker.session_data.records import TurnStatus
from meshnet.tracker.storage.database import Database

_SCHEMA = """
CREATE TABLE IF NOT EXISTS session_models (
    session_id TEXT PRIMARY KEY,
    model TEXT NOT NULL
)
"""


class SessionModels:
    """The session -> model table; any thread may call (each call is one statement)."""

    def __init__(self, db: Database) -> None:
        self._db = db
        db.create_schema(_SCHEMA)

    def bind(self, session_id: str, model: str) -> None:
        """Record that ``session_id``'s history is in ``model``'s vocabulary now."""
        self._db.run(
            "INSERT INTO session_models (session_id, model) VALUES (?, ?) "
            "ON CONFLICT (session_id) DO UPDATE SET model = excluded.model",
            (session_id, model),
        )

    def model_of(self, session_id: str) -> str | None:
        """The model the session is on; None for a session opened before models were
        recorded (it is on the tracker's first model)."""
        rows = self._db.query(
            "SELECT model FROM session_models WHERE session_id = ?", (session_id,)
        )
        return str(rows[0][0]) if rows else None

    def conversation(self, session_id: str) -> list[ChatMessage]:
        """Every completed turn of the session as a user and an assistant message."""
        rows = self._db.query(
            "SELECT request, result FROM turns WHERE session_id = ? AND status = ? ORDER BY seq",
            (session_id, TurnStatus.DONE.value),
        )
        messages: list[ChatMessage] = []
        for request, result in rows:
            asked = json.loads(request)
            answered = json.loads(result) if result else {}
            messages.append(ChatMessage("user", str(asked.get("content", ""))))
            messages.append(ChatMessage("assistant", str(answered.get("text", ""))))
        return messages

    def purge_orphans(self, limit: int) -> int:
        """Delete up to ``limit`` rows whose session is no longer kept (retention)."""
        return self._db.run(
            "DELETE FROM session_models WHERE session_id IN ("
            " SELECT m.session_id FROM session_models m"
            " LEFT JOIN sessions s ON s.id = m.session_id WHERE s.id IS NULL LIMIT ?)",
            (limit,),
        )
