"""The work ledger: one record per attempt per shard, and what of it is billable.

An *attempt* is one node serving one layer range of one generation for one
epoch. It is recorded once, when the attempt ends, with the token positions
it computed in that epoch and how it ended:

- ``completed``: its KV was used to the end (or carried into the next epoch
  by a resume, which starts the next attempt where this one stopped);
- ``failed``: the node failed; its work is discarded and redone elsewhere;
- ``cancelled``: the work was abandoned (client gone, explicit cancel, the
  generation failed elsewhere, the KV was lost and recomputed, or a session
  turn's delivery that another tracker took over: ``superseded``);
- ``unverified``: completed while the verifier is on (by a node that is not
  trusted: a trusted node's work is ``completed``), and not yet settled
  (``settlement.py``): it becomes ``verified`` when a check of its span passed,
  ``completed`` when its node's verification window closed with every sampled
  check of that node passing, and ``rejected`` when a check of its node failed
  while the window was open.

Only ``completed`` and ``verified`` work is billable.

Because a resumed attempt starts at the position the previous one reached and
a replacement recomputes only what failed, the completed records of one
generation cover each layer's token positions exactly once: retries and
replays are never billed twice.

Records reach the database through a ``LedgerSpool``: a generation that has
finished is delivered even while its records cannot be written (the database
gone, busy, its disk full); they wait, in order, and are written when it can.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from meshnet.errors import DatabaseUnavailable

log = logging.getLogger(__name__)


class AttemptStatus(StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    UNVERIFIED = "unverified"
    VERIFIED = "verified"
    REJECTED = "rejected"


BILLABLE = frozenset({AttemptStatus.COMPLETED, AttemptStatus.VERIFIED})
SUPERSEDED = "superseded"  # the kind of a turn delivery's work another delivery replaced


@dataclass(frozen=True)
class LedgerRecord:
    generation_id: str  # the session id the nodes know the generation by
    epoch: int
    node_id: str
    layer_start: int
    layer_end: int
    token_start: int  # first KV position this attempt computed
    token_end: int  # one past the last
    status: AttemptStatus
    kind: str = ""  # the failure kind that ended it, when it did not complete
    # What the node committed to at its range's end, per chunk of tokens (the
    # verifier's; see docs/verification.md for the encoding); stored as hex.
    commitments: bytes = b""

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def billable(self) -> bool:
        return self.status in BILLABLE

    @property
    def layer_tokens(self) -> int:
        """Work done: tokens times layers, the unit per-node totals are kept in."""
        return self.tokens * (self.layer_end - self.layer_start)


WriteRecords = Callable[[Sequence[LedgerRecord], float], None]  # records, when they ended


class LedgerSpool:
    """Ledger records on their way to the database; call from the event loop only.

    ``submit`` never raises: it writes at once when it can and keeps, in order,
    what the database refused (``DatabaseUnavailable``), for ``flush`` to write
    again (``run_forever`` flushes every ``retry_s``). Writing a batch twice is
    harmless (the ledger keeps the first record of an attempt), so a write whose
    outcome was unknown is simply repeated. Records are lost only two ways, both
    logged and counted in ``dropped``: past ``max_pending`` waiting records the
    oldest batches go, and a batch whose write fails with anything but
    ``DatabaseUnavailable`` (a bug, which no retry would mend) is not kept.

    While ``verifying`` (the verifier samples this mesh's work), completed work is
    written ``unverified``, for settlement to bill or reject, except the work of
    ``trusted`` nodes (tracker/trust/trusted_capacity.py: checks are made against it), which
    is ``completed``, billable at once. The records of a
    generation that is ``hold``-ing wait here until ``release`` says whether the
    work was delivered: a session turn's attempt is billed only when its turn was
    completed by it, so a turn delivered again elsewhere (its lease lapsed) is
    billed once.
    """

    def __init__(
        self,
        write: WriteRecords,
        max_pending: int = 100_000,
        retry_s: float = 1.0,
        verifying: bool = False,
    ) -> None:
        self._write = write
        self.verifying = verifying
        self.trusted: frozenset[str] = frozenset()  # node ids whose work is never checked
        self._held: dict[str, list[LedgerRecord]] = {}  # generation id -> its records
        self._max_pending = max_pending
        self._retry_s = retry_s
        self._waiting: deque[tuple[list[LedgerRecord], float]] = deque()
        self.pending = 0  # records waiting to be written
        self.dropped = 0  # records given up on
        self.last_failure = ""

    def submit(self, records: Iterable[LedgerRecord], now: float | None = None) -> None:
        """Record the attempts that ended at ``now`` (default: the wall clock)."""
        batch = []
        for r in records:
            unchecked = r.node_id in self.trusted
            if self.verifying and r.status is AttemptStatus.COMPLETED and not unchecked:
                r = replace(r, status=AttemptStatus.UNVERIFIED)
            held = self._held.get(r.generation_id)
            if held is not None:
                held.append(r)
            else:
                batch.append(r)
        if not batch:
            return
        self._waiting.append((batch, time.time() if now is None else now))
        self.pending += len(batch)
        self.flush()
        while self.pending > self._max_pending and len(self._waiting) > 1:
            oldest, _ = self._waiting.popleft()
            self._drop(oldest, "too many records wait for the database")

    def hold(self, generation_id: str) -> None:
        """Keep the generation's records here until ``release``."""
        self._held.setdefault(generation_id, [])

    def release(self, generation_id: str, delivered: bool, now: float | None = None) -> None:
        """Write the held records: as they are when the work was ``delivered``, else
        with every billable or unsettled attempt ``cancelled`` as ``superseded``."""
        held = self._held.pop(generation_id, [])
        if not delivered:
            held = [_superseded(r) for r in held]
        self.submit(held, now)

    def flush(self) -> bool:
        """Write what waits, oldest first, until the database refuses; whether all is."""
        while self._waiting:
            batch, ended = self._waiting[0]
            try:
                self._write(batch, ended)
            except DatabaseUnavailable as e:
                if self.last_failure != str(e):
                    log.warning("ledger: %d records wait for the database: %s", self.pending, e)
                self.last_failure = str(e)
                return False
            except Exception as e:
                log.error("ledger: a batch cannot be written", exc_info=e)
                self._waiting.popleft()
                self._drop(batch, f"its write failed: {e}")
                continue
            self._waiting.popleft()
            self.pending -= len(batch)
            if not self._waiting and self.last_failure:
                log.info("ledger: the records that waited are written")
                self.last_failure = ""
        return True

    async def run_forever(self) -> None:
        """Flush every ``retry_s`` while records wait."""
        while True:
            await asyncio.sleep(self._retry_s)
            if self._waiting:
                self.flush()

    def _drop(self, batch: list[LedgerRecord], why: str) -> None:
        self.pending -= len(batch)
        self.dropped += len(batch)
        log.error("ledger: %d records dropped (%s)", len(batch), why)


def _superseded(r: LedgerRecord) -> LedgerRecord:
    if r.status in BILLABLE or r.status is AttemptStatus.UNVERIFIED:
        return replace(r, status=AttemptStatus.CANCELLED, kind=SUPERSEDED)
    return r
