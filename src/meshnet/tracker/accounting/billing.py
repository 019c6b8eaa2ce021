"""What the ledger's work is worth: settling verified work, tenants' usage, nodes' earnings.

Work is billable when it is ``completed`` or ``verified`` (ledger.py). While
the verifier is on, completed attempts are written ``unverified`` and a
settlement pass decides, in one transaction, per attempt:

1. ``rejected`` when a check of its node failed at or after the attempt's
   recording time less the window (``work_checks.py`` rejects at once what is
   already written when a check fails; this catches what is written after);
2. else ``verified`` when a passing check covers part of its span;
3. else ``completed`` once its window has closed: every sampled check of its
   node in that time passed.

Usage is counted per tenant, by who asked for the generation (``attribute``:
a completion's tenant when it starts, a session turn's when it is accepted),
in tokens (positions at layer 0, each once) and layer-tokens; earnings per
node in layer-tokens, the unit of work the ledger counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from meshnet.errors import DatabaseUnavailable
from meshnet.tracker.accounting.ledger import BILLABLE, AttemptStatus
from meshnet.tracker.accounting.work_checks import VERIFICATION_FAILED
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.storage.database import Database

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_owners (
    generation_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    recorded DOUBLE PRECISION NOT NULL
)
"""

ADMIN = "(admin)"  # the tenant of an operator's generations (the admin token's)


@dataclass(frozen=True)
class SettlementPolicy:
    window_s: float = 60.0  # how long a node's unverified work waits for a failed check
    interval_s: float = 5.0  # between settlement passes


@dataclass
class Settled:
    rejected: int = 0
    verified: int = 0
    completed: int = 0


def create_schema(db: Database) -> None:
    db.create_schema(_SCHEMA)


def attribute(db: Database, generation_id: str, tenant_id: str, now: float | None = None) -> None:
    """Charge ``generation_id``'s work to ``tenant_id`` (a repeat changes nothing).

    Never raises for the database: the generation is already under way, and a
    request is not failed for its bill; a generation whose attribution could not
    be written shows as ``(unattributed)`` (logged)."""
    try:
        db.run(
            "INSERT INTO ledger_owners (generation_id, tenant_id, recorded) VALUES (?, ?, ?) "
            "ON CONFLICT (generation_id) DO NOTHING",
            (generation_id, tenant_id, time.time() if now is None else now),
        )
    except DatabaseUnavailable as e:
        log.warning("generation %s of tenant %s is not attributed: %s", generation_id, tenant_id, e)


def settle(db: Database, now: float, window_s: float) -> Settled:
    """One settlement pass over every unverified attempt (see the module docstring)."""
    unverified = AttemptStatus.UNVERIFIED.value
    with db.transaction() as tx:
        rejected = tx.run(
            "UPDATE ledger SET status = ?, kind = ? WHERE status = ? AND EXISTS ("
            "SELECT 1 FROM span_checks c WHERE c.node_id = ledger.node_id AND c.passed = 0 "
            "AND c.checked >= ledger.recorded - ?)",
            (AttemptStatus.REJECTED.value, VERIFICATION_FAILED, unverified, window_s),
        )
        verified = tx.run(
            "UPDATE ledger SET status = ? WHERE status = ? AND EXISTS ("
            "SELECT 1 FROM span_checks c WHERE c.generation_id = ledger.generation_id "
            "AND c.node_id = ledger.node_id AND c.layer_end = ledger.layer_end "
            "AND c.passed = 1 AND c.token_start < ledger.token_end "
            "AND c.token_end > ledger.token_start)",
            (AttemptStatus.VERIFIED.value, unverified),
        )
        completed = tx.run(
            "UPDATE ledger SET status = ? WHERE status = ? AND recorded < ?",
            (AttemptStatus.COMPLETED.value, unverified, now - window_s),
        )
    return Settled(rejected, verified, completed)


def usage(db: Database) -> dict[str, Any]:
    """Per tenant and per node: billable, unsettled and rejected work."""
    tenants: dict[str, dict[str, int]] = {}
    rows = db.query(
        "SELECT COALESCE(o.tenant_id, ''), l.status, "
        "SUM(CASE WHEN l.layer_start = 0 THEN l.token_end - l.token_start ELSE 0 END), "
        "SUM((l.token_end - l.token_start) * (l.layer_end - l.layer_start)), "
        "COUNT(DISTINCT l.generation_id) "
        "FROM ledger l LEFT JOIN ledger_owners o ON o.generation_id = l.generation_id "
        "GROUP BY COALESCE(o.tenant_id, ''), l.status"
    )
    for tenant, status, tokens, layer_tokens, generations in rows:
        t = tenants.setdefault(tenant or "(unattributed)", _zero("billable_generations"))
        _add(t, str(status), int(tokens or 0), int(layer_tokens or 0))
        if AttemptStatus(status) in BILLABLE:
            t["billable_generations"] += int(generations)
    nodes: dict[str, dict[str, int]] = {}
    rows = db.query(
        "SELECT node_id, status, SUM(token_end - token_start), "
        "SUM((token_end - token_start) * (layer_end - layer_start)), COUNT(*) "
        "FROM ledger GROUP BY node_id, status"
    )
    for node_id, status, tokens, layer_tokens, attempts in rows:
        n = nodes.setdefault(str(node_id), _zero("billable_attempts"))
        _add(n, str(status), int(tokens or 0), int(layer_tokens or 0))
        if AttemptStatus(status) in BILLABLE:
            n["billable_attempts"] += int(attempts)
    return {
        "tenants": [{"tenant": k, **v} for k, v in sorted(tenants.items())],
        "nodes": [{"node_id": k, **v} for k, v in sorted(nodes.items())],
    }


def _zero(count_key: str) -> dict[str, int]:
    return {
        count_key: 0,
        "billable_tokens": 0,
        "billable_layer_tokens": 0,
        "unverified_layer_tokens": 0,
        "rejected_layer_tokens": 0,
    }


def _add(into: dict[str, int], status: str, tokens: int, layer_tokens: int) -> None:
    if AttemptStatus(status) in BILLABLE:
        into["billable_tokens"] += tokens
        into["billable_layer_tokens"] += layer_tokens
    elif status == AttemptStatus.UNVERIFIED.value:
        into["unverified_layer_tokens"] += layer_tokens
    elif status == AttemptStatus.REJECTED.value:
        into["rejected_layer_tokens"] += layer_tokens


def purge_owners(db: Database, before: float, limit: int) -> int:
    """Delete up to ``limit`` attributions made before ``before``; how many."""
    return db.run(
        "DELETE FROM ledger_owners WHERE generation_id IN "
        "(SELECT generation_id FROM ledger_owners WHERE recorded < ? LIMIT ?)",
        (before, limit),
    )


@dataclass
class Settlement:
    """The loop that settles unverified work every ``interval_s``."""

    db: Database
    policy: SettlementPolicy = field(default_factory=SettlementPolicy)
    health: LoopHealth = field(default_factory=lambda: LoopHealth("settlement"))

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                done = await asyncio.to_thread(settle, self.db, time.time(), self.policy.window_s)
            except Exception as e:  # a database gone for a moment, a bug: next pass
                self.health.failed(e)
                continue
            self.health.passed()
            if done.rejected or done.verified or done.completed:
                log.info("settled: %s", done)
