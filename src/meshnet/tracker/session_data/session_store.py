"""Sessions, their turns (the prompt outbox) and the snapshot index, in the tracker's database.

One object over the three tables, which are written together in single
transactions: the sessions (session_rows.py), their turns (turn_rows.py) and
the snapshot index (snapshot_index.py); the records they hold are in
records.py.
"""

from __future__ import annotations

from meshnet.tracker.session_data.snapshot_index import SnapshotIndex
from meshnet.tracker.session_data.turn_rows import TurnRows


class SessionStore(TurnRows, SnapshotIndex):
    """The sessions' tables: their rows, turns and snapshots."""
