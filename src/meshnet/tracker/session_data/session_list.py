"""Sessions listed a page at a time, by state, model and tenant, for operators.

Pages are in session id order and a page's ``next`` cursor is its last id, so
a listing walked to its end sees every session that lived through the walk
once, however many are opened meanwhile. A session with no model recorded is
on the tracker's first model (one model served: nothing is recorded).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.tracker.session_data.records import SessionState
from meshnet.tracker.session_data.session_models import SessionModels
from meshnet.tracker.storage.database import Database

MAX_PAGE = 500


@dataclass(frozen=True)
class SessionFilter:
    states: tuple[SessionState, ...] = ()  # any state when empty
    model: str | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class Listed:
    id: str
    model: str
    tenant: str | None  # None for a session no tenant owns (made before tenancy)


@dataclass(frozen=True)
class Page:
    sessions: list[Listed]
    next: str | None  # the cursor of the next page; None after the last


class SessionList:
    """Reads pages of sessions from the tracker's database."""

    def __init__(self, db: Database, first_model: str) -> None:
        SessionModels(db)  # its table is joined even where one model never records one
        self._db = db
        self._first_model = first_model

    def page(self, f: SessionFilter, after: str = "", limit: int = 100) -> Page:
        """Up to ``limit`` sessions whose id follows ``after``, matching ``f``."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"a page holds 1 to {MAX_PAGE} sessions")
        where, args = ["s.id > ?"], [after]
        if f.states:
            where.append(f"s.state IN ({', '.join('?' for _ in f.states)})")
            args += [s.value for s in f.states]
        if f.model is not None:
            unrecorded = " OR m.model IS NULL" if f.model == self._first_model else ""
            where.append(f"(m.model = ?{unrecorded})")
            args.append(f.model)
        if f.tenant is not None:
            where.append("o.tenant_id = ?")
            args.append(f.tenant)
        rows = self._db.query(
            "SELECT s.id, m.model, o.tenant_id FROM sessions s "
            "LEFT JOIN session_models m ON m.session_id = s.id "
            "LEFT JOIN session_owners o ON o.session_id = s.id "
            f"WHERE {' AND '.join(where)} ORDER BY s.id LIMIT ?",
            [*args, limit + 1],
        )
        listed = [
            Listed(str(r[0]), str(r[1]) if r[1] is not None else self._first_model, r[2])
            for r in rows[:limit]
        ]
        return Page(listed, listed[-1].id if len(rows) > limit else None)
