"""Sessions' lifecycle off the turn path: create, describe, park, evict, end, and the policy.

The ladder: ``idle`` (KV hot on its route) → ``parked`` (each node moved the
KV to its local disk, out of its hot budget) → ``evicted`` (the KV of every
hop written to the snapshot store, in the database, and indexed, node memory
freed). Moves are made by explicit call or by the policy: unused for ``park_after_s`` (parked),
unused for ``evict_after_s`` once parked (evicted), and idle sessions on a
node whose KV use passed ``pressure`` of its budget, least recently used first.
A park is all or nothing (tracker/sessions/parking.py): a hop that cannot write it leaves
the session idle and hot, and the policy tries that session again after a backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from meshnet.errors import KVImportFailed, MeshnetError, RequestError, SessionGone
from meshnet.kv.pace import paced
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.nodes.routes import Hop, route_json
from meshnet.tracker.service import Tracker
from meshnet.tracker.session_data.records import SessionRecord, SessionState, SnapshotFile
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore, SnapshotTarget
from meshnet.tracker.sessions.parking import HopPark, ParkBackoff, park_route
from meshnet.tracker.sessions.turns import TurnRunner, history_hash

log = logging.getLogger(__name__)

_MAX_SYSTEM_CHARS = 100_000


@dataclass(frozen=True)
class SessionPolicy:
    park_after_s: float = 300.0  # unused this long since the last turn: parked (0: never)
    evict_after_s: float = 1800.0  # unused this long and parked: evicted (0: never)
    pressure: float = 0.9  # a node's KV use over this share of its budget parks idle sessions
    interval_s: float = 5.0


class Sessions:
    """Session use cases over the tracker, the session store and the snapshot store."""

    def __init__(
        self,
        tracker: Tracker,
        store: SessionStore,
        snapshots: SnapshotStore,
        runner: TurnRunner,
        policy: SessionPolicy = SessionPolicy(),
    ) -> None:
        self.tracker = tracker
        self.store = store
        self.snapshots = snapshots
        self.runner = runner
        self.policy = policy
        self._relieved: dict[str, float] = {}  # node -> when the policy last parked on it
        self.park_backoff = ParkBackoff(policy.interval_s)
        self.policy_health = LoopHealth("session policy")

    def create(self, system: str | None) -> SessionRecord:
        if system is not None and len(system) > _MAX_SYSTEM_CHARS:
            raise RequestError(f"system must be at most {_MAX_SYSTEM_CHARS} characters")
        return self.store.create(f"sess-{uuid.uuid4().hex}", system, time.time())

    def describe(self, session: SessionRecord) -> dict[str, Any]:
        files = self.store.snapshot(session.snapshot_id) if session.snapshot_id else []
        return {
            "id": session.id,
            "state": session.state.value,
            "tokens": session.kv_tokens,
            "steps": session.steps,
            "turns": session.turns,
            "epoch": session.kv_epoch,
            "route": route_json(session.route),
            "park_retry": self.park_backoff.describe(session.id),
            "snapshot": {
                "id": session.snapshot_id,
                "files": [
                    {
                        "layers": [f.layers.start, f.layers.end],
                        "bytes": f.nbytes,
                        "sha256": f.file_sha256,
                        "root_hash": f.root_hash,
                    }
                    for f in files
                ],
            }
            if session.snapshot_id
            else None,
        }

    async def park(self, session_id: str) -> tuple[SessionRecord, list[HopPark]]:
        """Idle → parked: every hop moves the KV to its disk; the session and what each
        hop did (none when it was parked already). ``ParkFailed`` (with each hop's
        outcome) when a hop could not: the KV is hot again everywhere, the session idle."""
        session = self.store.get(session_id)
        _require_live(session)
        if session.state is SessionState.PARKED:
            return session, []
        if session.state is not SessionState.IDLE or not session.route:
            raise RequestError(f"only an idle session with KV can be parked ({session.state})")
        hops = await park_route(self.tracker.channels, session.id, session.kv_epoch, session.route)
        self.store.set_state(session.id, SessionState.PARKED, (SessionState.IDLE,))
        return self.store.get(session_id), hops

    async def evict(self, session_id: str) -> SessionRecord:
        """Idle or parked → evicted: each hop's KV written to the snapshot store, indexed,
        then freed on the nodes. Nothing changes unless every hop's snapshot is whole."""
        session = self.store.get(session_id)
        _require_live(session)
        if session.state is SessionState.EVICTED:
            return session
        if session.state not in (SessionState.IDLE, SessionState.PARKED) or not session.route:
            raise RequestError(f"only an idle or parked session can be evicted ({session.state})")
        snapshot_id = uuid.uuid4().hex[:16]
        prefix = history_hash(session.history)
        files: list[SnapshotFile] = []
        indexed = False
        try:
            for hop in session.route:
                files.append(await self._export(session, hop, snapshot_id, prefix))
            indexed = self.store.index_snapshot(session, files, time.time())
        finally:
            if not indexed:  # no stream the index does not name is kept
                for f in files:
                    self.snapshots.remove(f)
        if not indexed:
            raise RequestError("the session moved on while it was being evicted; try again")
        await self.runner.release(session.route, session.id, session.kv_epoch)
        return self.store.get(session_id)

    async def _export(
        self, session: SessionRecord, hop: Hop, snapshot_id: str, prefix: str
    ) -> SnapshotFile:
        stub = self.tracker.channels.stub(hop.address)
        call = stub.StateGet(
            pb.StateGetRequest(session_id=session.id, token_prefix_hash=prefix),
            metadata=self.tracker.channels.signed(hop.node_id, "StateGet"),
        )
        target = SnapshotTarget(snapshot_id, session.id, hop.layers)
        # Cut off by a deadline sized to the stream once its header says how large.
        frames = paced(call.__aiter__(), self.snapshots.pace, _header_bytes)
        try:
            return await self.snapshots.write(target, frames, prefix)
        except grpc.aio.AioRpcError as e:
            message = f"node {hop.node_id} could not export the KV: {e.code().name} {e.details()}"
            raise KVImportFailed(message, "source-missing", hop.node_id) from None
        finally:
            call.cancel()

    async def end(self, session_id: str) -> SessionRecord:
        """End a session: later turns get 410; its KV and snapshots are freed."""
        session = self.store.end(session_id, SessionState.COMPLETED, time.time())
        await self.runner.release(session.route, session.id)
        self.snapshots.forget(self.store, session.id)
        return self.store.get(session_id)

    # --- policy ---------------------------------------------------------------------

    async def apply_policy(self, now: float) -> list[tuple[str, str]]:
        """One pass of the policy; the (session, new state) moves it made."""
        moves: list[tuple[str, str]] = []
        p = self.policy
        pressed = self._pressed_nodes()
        idle = self.store.sessions((SessionState.IDLE,))
        self.park_backoff.keep_only({s.id for s in idle})
        for s in idle:
            on_pressed = {h.node_id for h in s.route} & pressed
            due = (p.park_after_s and now - s.last_used > p.park_after_s) or on_pressed
            if not due or not self.park_backoff.due(s.id, now):
                continue
            if not await self._park_by_policy(s.id, now):
                continue  # nothing freed: a pressed node's next session is tried
            moves.append((s.id, "parked"))
            for node_id in on_pressed:  # one session per node until its load is reported anew
                self._relieved[node_id] = now
            pressed -= on_pressed
        if p.evict_after_s:
            for s in self.store.sessions((SessionState.PARKED,)):
                if now - s.last_used > p.evict_after_s:
                    moves += await self._try(self.evict, s.id, "evicted")
        return moves

    def _pressed_nodes(self) -> set[str]:
        """Nodes whose last reported KV use is over the pressure line, reported after the
        policy last parked a session there."""
        return {
            n.node_id
            for n in self.tracker.store.nodes()
            if n.kv_budget_bytes > 0
            and n.load.kv_bytes > self.policy.pressure * n.kv_budget_bytes
            and n.last_seen > self._relieved.get(n.node_id, 0.0)
        }

    async def _park_by_policy(self, session_id: str, now: float) -> bool:
        """Park one session for the policy; a failure waits its backoff. Whether it parked."""
        try:
            await self.park(session_id)
        except MeshnetError as e:
            wait = self.park_backoff.failed(session_id, now, str(e))
            log.info("policy could not park %s (next try in %.0fs): %s", session_id, wait, e)
            return False
        self.park_backoff.forget(session_id)
        return True

    @staticmethod
    async def _try(move: Any, session_id: str, state: str) -> list[tuple[str, str]]:
        try:
            await move(session_id)
        except MeshnetError as e:
            log.info("policy could not move %s to %s: %s", session_id, state, e)
            return []
        return [(session_id, state)]

    async def run_policy_forever(self) -> None:
        """A policy pass every ``interval_s``; a failed pass (a database error, a bug)
        is logged, counted in ``policy_health``, and the next one runs as usual."""
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                for session_id, state in await self.apply_policy(time.time()):
                    log.info("policy: session %s %s", session_id, state)
            except Exception as e:  # a bug must not stop the policy for good
                self.policy_health.failed(e)
            else:
                self.policy_health.passed()


def _header_bytes(frame: pb.KVFrame) -> int:
    return frame.header.total_bytes if frame.WhichOneof("kind") == "header" else 0


def _require_live(session: SessionRecord) -> None:
    if session.state.terminal:
        raise SessionGone(f"session {session.id} has ended")
