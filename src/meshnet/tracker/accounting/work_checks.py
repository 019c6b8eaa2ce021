"""The verifier's verdicts on nodes' work, kept beside the ledger they settle.

A check re-ran one span of one node's work (a chunk of token positions of a
generation, at the end of the node's layer range) on trusted capacity and
compared it with what the node committed to. Checks are kept as rows of their
own, not as a status on the ledger, because a check and the record of the
attempt it checked arrive in either order: a check runs while the generation
is still going, and its records are written when the attempt ends.
``settlement.py`` reads both and decides what is billable.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.tracker.accounting.ledger import AttemptStatus
from meshnet.tracker.storage.database import Database, Tx

_SCHEMA = """
CREATE TABLE IF NOT EXISTS span_checks (
    id {serial},
    node_id TEXT NOT NULL,
    generation_id TEXT NOT NULL,
    layer_start INTEGER NOT NULL,
    layer_end INTEGER NOT NULL,
    token_start INTEGER NOT NULL,
    token_end INTEGER NOT NULL,
    passed INTEGER NOT NULL,
    detail TEXT NOT NULL,
    checked DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS span_checks_node ON span_checks (node_id, checked);
CREATE INDEX IF NOT EXISTS span_checks_generation ON span_checks (generation_id)
"""

VERIFICATION_FAILED = "verification-failed"  # the kind of work rejected by a failed check


@dataclass(frozen=True)
class SpanCheck:
    """One check of ``node_id``'s output for ``[token_start, token_end)`` of a generation
    at the end of its layers ``[layer_start, layer_end)``."""

    node_id: str
    generation_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    passed: bool
    detail: str = ""  # why it failed (what differed), or how it was checked


def create_schema(db: Database) -> None:
    db.create_schema(_SCHEMA)


def record_check(db: Database, check: SpanCheck, now: float) -> None:
    """Keep ``check``; a failed one rejects at once every unsettled attempt of its node
    (the rest of the node's open window is rejected by settlement as it is written)."""
    with db.transaction() as tx:
        tx.run(
            "INSERT INTO span_checks (node_id, generation_id, layer_start, layer_end, "
            "token_start, token_end, passed, detail, checked) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                check.node_id,
                check.generation_id,
                check.layer_start,
                check.layer_end,
                check.token_start,
                check.token_end,
                int(check.passed),
                check.detail[:1000],
                now,
            ),
        )
        if not check.passed:
            reject_unsettled(tx, check.node_id)


def reject_unsettled(tx: Tx, node_id: str) -> int:
    """Reject every attempt of ``node_id`` still waiting to be settled; how many."""
    return tx.run(
        "UPDATE ledger SET status = ?, kind = ? WHERE node_id = ? AND status = ?",
        (
            AttemptStatus.REJECTED.value,
            VERIFICATION_FAILED,
            node_id,
            AttemptStatus.UNVERIFIED.value,
        ),
    )


def checks(
    db: Database, node_id: str | None = None, limit: int = 1000
) -> list[tuple[SpanCheck, float]]:
    """Checks, oldest first, with when each was made; of one node when named."""
    where, args = (" WHERE node_id = ?", (node_id,)) if node_id is not None else ("", ())
    rows = db.query(
        "SELECT node_id, generation_id, layer_start, layer_end, token_start, token_end, "
        f"passed, detail, checked FROM span_checks{where} ORDER BY id LIMIT ?",
        (*args, limit),
    )
    return [
        (SpanCheck(str(n), str(g), int(a), int(b), int(s), int(e), bool(p), str(d)), float(t))
        for n, g, a, b, s, e, p, d, t in rows
    ]


def purge_checks(db: Database, before: float, limit: int) -> int:
    """Delete up to ``limit`` checks made before ``before``, oldest first; how many."""
    return db.run(
        "DELETE FROM span_checks WHERE id IN "
        "(SELECT id FROM span_checks WHERE checked < ? ORDER BY id LIMIT ?)",
        (before, limit),
    )
