"""The prompt outbox: turns are accepted durably, then delivered with retries until done.

Accepting a turn writes it and the session's update in one transaction, so
a turn the client was told about is never lost. Delivery claims the turn
under a lease, so of several trackers on one database exactly one delivers
it, and a tracker that dies mid-turn lets the lease lapse and another — or
itself, restarted — delivers it again. Within one tracker a turn has at most
one delivering task at a time. The lease is renewed while the attempt runs;
a renewal the database refuses is tried again at the next beat, and an
attempt whose turn another tracker took over (its lease lapsed meanwhile) is
stopped, so two attempts of one turn never run on at once.

Each attempt is counted when claimed. A failure that says the mesh cannot
take the turn now (no route, no capacity, no database) is waited out with a
full-jitter backoff for up to ``max_wait_s`` without using up the turn's
attempts; any other retryable failure counts, and after ``max_attempts`` of
them, or a permanent one, the turn fails. Completing a turn writes its result
and the session's new history in one transaction, conditional on still
holding the lease, so a turn is applied exactly once; while the database
refuses that write, the finished result is served to waiting clients from
here and the write is retried. Turns of a session that ended are dropped,
never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import secrets
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from meshnet.errors import (
    DatabaseUnavailable,
    KVBudgetExhausted,
    MeshnetError,
    NoRoute,
    Overloaded,
    QuotaExceeded,
)
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.session_data.records import SessionRecord, TurnRecord, TurnStatus
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore
from meshnet.tracker.sessions.turns import OnToken, TurnOutcome, TurnRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutboxConfig:
    lease_s: float = 15.0  # a claimed turn's lease; renewed every third of it while running
    poll_s: float = 0.5  # how often the delivery loop looks for due turns
    max_attempts: int = 6  # attempts that ran and failed before a retryable failure fails it
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 10.0
    max_wait_s: float = 120.0  # how long a turn waits for a mesh that cannot take it
    db_grace_s: float = 5.0  # how long a waiting client rides out an unreadable database


# Failures that say the mesh could not take the turn now (no route, no capacity, no
# database), nothing about the turn itself: waiting them out uses up none of its attempts.
WAIT_KINDS = frozenset(
    {
        NoRoute.kind,
        Overloaded.kind,
        QuotaExceeded.kind,
        KVBudgetExhausted.kind,
        DatabaseUnavailable.kind,
    }
)


@dataclass(frozen=True)
class Retry:
    """What follows a failed attempt (``after_failure`` decides it)."""

    error: dict[str, Any]  # kept in the turn's row: the failure, and what the next decision needs
    in_s: float | None  # retry after this long; None: the turn fails


def after_failure(
    e: BaseException,
    previous: dict[str, Any] | None,
    attempts: int,
    now: float,
    config: OutboxConfig,
    rng: random.Random,
) -> Retry:
    """Retry or fail, after attempt ``attempts`` failed with ``e``; ``previous`` is the
    record the last failure left (``failed_runs``: failures that counted, and
    ``waiting_since``: when the current wait for the mesh began). An exception that is
    not a typed error is a bug: it counts, is retried, then fails the turn."""
    typed = isinstance(e, MeshnetError)
    kind = e.kind if isinstance(e, MeshnetError) else "internal"
    message = e.message if isinstance(e, MeshnetError) else str(e)
    retryable = e.retryable if isinstance(e, MeshnetError) else True
    runs = int((previous or {}).get("failed_runs", 0))
    since = (previous or {}).get("waiting_since")
    if typed and kind in WAIT_KINDS:
        since = now if since is None else float(since)
        give_up = now - since >= config.max_wait_s
    else:
        runs, since = runs + 1, None
        give_up = runs >= config.max_attempts
    error = {"kind": kind, "message": message, "failed_runs": runs, "waiting_since": since}
    if give_up or not retryable:
        return Retry(error, None)
    return Retry(error, backoff_s(attempts, config, rng))


def backoff_s(attempts: int, config: OutboxConfig, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2^attempts)]."""
    return rng.uniform(0.0, min(config.backoff_cap_s, config.backoff_base_s * 2**attempts))


def body_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Outbox:
    """Accepts and delivers turns; one per tracker process."""

    def __init__(
        self,
        store: SessionStore,
        runner: TurnRunner,
        snapshots: SnapshotStore,
        config: OutboxConfig = OutboxConfig(),
        owner: str | None = None,
    ) -> None:
        self.store = store
        self.runner = runner
        self.snapshots = snapshots
        self.config = config
        self.owner = owner or f"tracker-{secrets.token_hex(6)}"
        self._rng = random.Random()
        self._wake = asyncio.Event()
        self._delivering: dict[str, asyncio.Task[Any]] = {}  # the one task delivering each
        self._finished: dict[str, TurnRecord] = {}  # results finished here, not yet written
        self.health = LoopHealth("outbox")  # the delivery loop's passes

    def accept(self, session_id: str, key: str | None, body: dict[str, Any]) -> TurnRecord:
        """Durably accept a turn (or find the first one of this ``Idempotency-Key``); a
        turn the session could never take is refused here, before anything is written."""
        request = dict(body)
        if request.get("seed") is None and request["temperature"] > 0:
            # Fixed now, so a turn delivered again (after a crash) samples the same tokens.
            request["seed"] = self._rng.randrange(2**63)
        turn = self.store.accept_turn(
            session_id,
            uuid.uuid4().hex,
            key,
            body_hash(body),
            request,
            time.time(),
            validate=lambda session: self.runner.check(session, body),
        )
        self._wake.set()
        return turn

    async def deliver(self, turn: TurnRecord, on_token: OnToken | None = None) -> bool:
        """One attempt at ``turn``; False when it was not ours to deliver now (another
        tracker holds its lease, another task here delivers it, or the database could
        not say). Raises nothing but its own cancellation."""
        me = asyncio.current_task()
        assert me is not None
        if self._delivering.setdefault(turn.id, me) is not me:
            return False  # one delivering task per turn here, whoever asks
        try:
            return await self._deliver(turn, on_token)
        finally:
            if self._delivering.get(turn.id) is me:
                del self._delivering[turn.id]
            self._wake.set()

    async def _deliver(self, turn: TurnRecord, on_token: OnToken | None) -> bool:
        claimed = self._claim(turn)
        if claimed is None:
            return False
        lost = asyncio.Event()
        # The attempt's ledger records are billed only if this attempt completes the
        # turn: one that fails, or that another tracker takes over, is superseded.
        ledger = self.runner.ledger
        ledger.hold(turn.id)
        delivered = False
        attempt = asyncio.create_task(self._attempt(claimed, on_token))
        lease = asyncio.create_task(self._hold_lease(claimed, attempt, lost))
        try:
            try:
                session, outcome = await attempt
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if not lost.is_set() or (me is not None and me.cancelling()):
                    raise
                log.warning("turn %s: attempt %d stopped: taken over", turn.id, claimed.attempts)
                return True
            except Exception as e:  # typed or a bug: recorded, retried or failed, never lost
                self._record_failure(claimed, e)
                return True
            delivered = await self._complete(claimed, session, outcome, lost)
            return True
        finally:
            lease.cancel()
            ledger.release(turn.id, delivered)

    def _claim(self, turn: TurnRecord) -> TurnRecord | None:
        """The turn as claimed for one attempt (counted), or None when it is not ours."""
        now = time.time()
        try:
            if not self.store.claim(turn, self.owner, now + self.config.lease_s, now):
                return None
        except DatabaseUnavailable as e:  # claimed or not, the lease says who delivers next
            log.warning("turn %s: not delivered now: %s", turn.id, e)
            return None
        try:
            return self.store.turn(turn.id)  # its attempts, and the last failure's record
        except DatabaseUnavailable:
            return replace(turn, status=TurnStatus.RUNNING, attempts=turn.attempts + 1)

    async def _attempt(
        self, turn: TurnRecord, on_token: OnToken | None
    ) -> tuple[SessionRecord, TurnOutcome]:
        session = self.store.get(turn.session_id)
        return session, await self.runner.run(session, turn, on_token)

    def _record_failure(self, turn: TurnRecord, e: Exception) -> None:
        if not isinstance(e, MeshnetError):
            log.error("turn %s: delivery failed", turn.id, exc_info=e)
        decision = after_failure(e, turn.error, turn.attempts, time.time(), self.config, self._rng)
        try:
            if decision.in_s is None:
                log.warning("turn %s failed after %d attempts: %s", turn.id, turn.attempts, e)
                self.store.fail_turn(turn.id, self.owner, decision.error)
            else:
                log.info(
                    "turn %s attempt %d failed (%s); retry in %.2fs",
                    turn.id,
                    turn.attempts,
                    e,
                    decision.in_s,
                )
                retry_at = time.time() + decision.in_s
                self.store.retry_later(turn.id, self.owner, retry_at, decision.error)
        except DatabaseUnavailable as db:
            log.warning("turn %s: its failure is not recorded (%s): retried later", turn.id, db)

    async def _complete(
        self, turn: TurnRecord, session: SessionRecord, outcome: TurnOutcome, lost: asyncio.Event
    ) -> bool:
        """Write the finished turn; whether it was written (this attempt delivered it).
        While the database refuses, the result is served from here (``wait``) and the
        write retried, the lease still renewed, until it lands or another tracker takes
        the turn over (it then runs it again, to the same tokens: the seed was fixed at
        accept)."""
        done = TurnRecord(
            turn.id,
            turn.session_id,
            turn.seq,
            TurnStatus.DONE,
            turn.attempts,
            turn.request,
            outcome.result,
            None,
        )
        tries = 0
        try:
            while True:
                try:
                    written = self.store.complete_turn(
                        turn.id, self.owner, outcome.result, outcome.session, time.time()
                    )
                    break
                except DatabaseUnavailable as e:
                    self._finished[turn.id] = done
                    if lost.is_set():
                        return False
                    tries += 1
                    wait = self.config.backoff_base_s + backoff_s(tries, self.config, self._rng)
                    log.warning("turn %s finished, not yet written (%s)", turn.id, e)
                    await asyncio.sleep(wait)
        finally:
            self._finished.pop(turn.id, None)
        try:
            if written and session.snapshot_id:  # the KV moved on: its snapshot is stale
                self.snapshots.forget(self.store, session.id)
            elif not written and self.store.get(session.id).state.terminal:
                await self.runner.release(outcome.session.route, session.id)  # ended meanwhile
        except (DatabaseUnavailable, OSError) as e:  # retention sweeps what is left
            log.warning("turn %s: clean-up after it failed: %s", turn.id, e)
        return written

    async def _hold_lease(
        self, turn: TurnRecord, attempt: asyncio.Task[Any], lost: asyncio.Event
    ) -> None:
        """Renew the lease every third of it while the turn is delivered here. A renewal
        the database refuses is tried at the next beat; when the turn is no longer ours
        (another tracker claimed it after the lease lapsed), the attempt is stopped. A
        turn dropped because its session ended runs on (its KV is released after)."""
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                if self.store.renew(turn.id, self.owner, time.time() + self.config.lease_s):
                    continue
                status = self.store.turn(turn.id).status
            except DatabaseUnavailable as e:
                log.warning("turn %s: lease not renewed (%s); trying again", turn.id, e)
                continue
            if status is not TurnStatus.DROPPED:
                lost.set()
                attempt.cancel()
            return

    async def wait(self, turn_id: str, timeout_s: float) -> TurnRecord:
        """The turn once final, or as it stands after ``timeout_s``. A result finished
        here but not yet written is answered at once; ``DatabaseUnavailable`` when the
        turn cannot be read for ``db_grace_s`` and no attempt here can answer instead."""
        deadline = time.monotonic() + timeout_s
        unreadable_since: float | None = None
        while True:
            if (finished := self._finished.get(turn_id)) is not None:
                return finished
            task = self._delivering.get(turn_id)
            left = deadline - time.monotonic()
            try:
                turn = self.store.turn(turn_id)
            except DatabaseUnavailable:
                now = time.monotonic()
                unreadable_since = unreadable_since or now
                if left <= 0 or (task is None and now - unreadable_since >= self.config.db_grace_s):
                    raise
            else:
                unreadable_since = None
                if turn.status.final or left <= 0:
                    return turn
            if task is not None:
                await asyncio.wait({task}, timeout=min(left, 1.0))
            else:
                await asyncio.sleep(min(left, 0.05))

    def start_delivery(
        self, turn: TurnRecord, on_token: OnToken | None = None
    ) -> asyncio.Task[bool] | None:
        """Deliver now, in the background, if nobody here is delivering it already: the
        task, or None where another one is. Registered before it returns, so the loop
        (``run_forever``) never starts a second delivery without ``on_token``."""
        if turn.id in self._delivering:
            return None
        task = asyncio.create_task(self.deliver(turn, on_token))
        self._delivering[turn.id] = task
        task.add_done_callback(lambda t: self._forget(turn.id, t))
        return task

    def _forget(self, turn_id: str, task: asyncio.Task[bool]) -> None:
        """A task cancelled before it ran never cleans up after itself."""
        if self._delivering.get(turn_id) is task:
            del self._delivering[turn_id]

    async def run_forever(self) -> None:
        """Deliver due turns: new, retried, and those a dead tracker left behind."""
        while True:
            try:
                for turn in self.store.deliverable(time.time()):
                    self.start_delivery(turn)
            except Exception as e:  # a database gone for a moment, a bug: poll on
                self.health.failed(e)
            else:
                self.health.passed()
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
            # lands as the wake does, and the loop would run on past its tracker's stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_s):
                    await self._wake.wait()

    async def stop(self) -> None:
        tasks = list(self._delivering.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
