"""The prompt outbox: turns are accepted durably, then delivered with retries until done.

Accepting a turn writes it and the session's update in one transaction, so
a turn the client was told about is never lost. Delivery claims the turn
under a lease (renewed while it runs), so of several trackers on one
database exactly one delivers it, and a tracker that dies mid-turn lets the
lease lapse and another — or itself, restarted — delivers it again. Each
attempt is counted when claimed; a retryable failure waits a full-jitter
backoff, a permanent one fails the turn. Completing a turn writes its result
and the session's new history in one transaction, conditional on still
holding the lease, so a turn is applied exactly once. Turns of a session
that ended are dropped, never retried.
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
from dataclasses import dataclass
from typing import Any

from meshnet.errors import MeshnetError
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.session_store import SessionStore, TurnRecord
from meshnet.tracker.snapshots import SnapshotStore
from meshnet.tracker.turns import OnToken, TurnRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutboxConfig:
    lease_s: float = 15.0  # a claimed turn's lease; renewed every third of it while running
    poll_s: float = 0.5  # how often the delivery loop looks for due turns
    max_attempts: int = 6  # attempts before a retryable failure fails the turn
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 10.0


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
        self._delivering: dict[str, asyncio.Task[bool]] = {}
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
        """One attempt at ``turn``; False when it was not ours to deliver now."""
        now = time.time()
        if not self.store.claim(turn, self.owner, now + self.config.lease_s, now):
            return False
        attempts = turn.attempts + 1
        renewing = asyncio.create_task(self._renew(turn.id))
        try:
            session = self.store.get(turn.session_id)
            outcome = await self.runner.run(session, turn, on_token)
        except MeshnetError as e:
            error = {"kind": e.kind, "message": e.message}
            if e.retryable and attempts < self.config.max_attempts:
                wait = backoff_s(attempts, self.config, self._rng)
                log.info(
                    "turn %s attempt %d failed (%s); retry in %.2fs", turn.id, attempts, e, wait
                )
                self.store.retry_later(turn.id, self.owner, time.time() + wait, error)
            else:
                log.warning("turn %s failed after %d attempts: %s", turn.id, attempts, e)
                self.store.fail_turn(turn.id, self.owner, error)
            return True
        except Exception as e:  # a bug: the turn is retried, then failed, never lost
            log.exception("turn %s: delivery failed", turn.id)
            error = {"kind": "internal", "message": str(e)}
            if attempts < self.config.max_attempts:
                wait = backoff_s(attempts, self.config, self._rng)
                self.store.retry_later(turn.id, self.owner, time.time() + wait, error)
            else:
                self.store.fail_turn(turn.id, self.owner, error)
            return True
        finally:
            renewing.cancel()
            self._wake.set()
        after = outcome.session
        if self.store.complete_turn(turn.id, self.owner, outcome.result, after, time.time()):
            if session.snapshot_id:  # the KV moved on: its snapshot is stale
                self.snapshots.forget(self.store, session.id)
        elif self.store.get(session.id).state.terminal:  # ended while this turn ran
            await self.runner.release(after.route, session.id)
        return True

    async def _renew(self, turn_id: str) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            self.store.renew(turn_id, self.owner, time.time() + self.config.lease_s)

    async def wait(self, turn_id: str, timeout_s: float) -> TurnRecord:
        """The turn once final, or as it stands after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            turn = self.store.turn(turn_id)
            left = deadline - time.monotonic()
            if turn.status.final or left <= 0:
                return turn
            task = self._delivering.get(turn_id)
            if task is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(task), min(left, 1.0))
            else:
                await asyncio.sleep(min(left, 0.05))

    def start_delivery(self, turn: TurnRecord, on_token: OnToken | None = None) -> None:
        """Deliver now, in the background, if nobody here is delivering it already."""
        if turn.id not in self._delivering:
            task = asyncio.create_task(self.deliver(turn, on_token))
            self._delivering[turn.id] = task
            task.add_done_callback(lambda _: self._delivering.pop(turn.id, None))

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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)

    async def stop(self) -> None:
        tasks = list(self._delivering.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
