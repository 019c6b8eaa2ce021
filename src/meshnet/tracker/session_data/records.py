"""What the tracker keeps of a session, its turns and its snapshots: states, records, rows.

The session's and the turn's lifecycles are enums here (``SessionState``,
``TurnStatus``); the records are frozen, parsed from their database rows by
the ``parse_*`` functions, which the tables' modules share (session_rows.py,
turn_rows.py, snapshot_index.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from meshnet.layer_range import LayerRange
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.storage.database import Row

# Epochs one delivery attempt may use (its opening one plus failovers); attempts never share.
EPOCH_STRIDE = 100


class SessionState(StrEnum):
    IDLE = "idle"  # KV hot on its route
    ACTIVE = "active"  # a turn is accepted and not yet delivered
    PARKED = "parked"  # KV on the nodes' local disks, out of their hot budgets
    EVICTED = "evicted"  # KV in the snapshot store only
    COMPLETED = "completed"  # ended by the client
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (SessionState.COMPLETED, SessionState.FAILED)


ENDED = (SessionState.COMPLETED.value, SessionState.FAILED.value)  # terminal states, as stored


class TurnStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"  # claimed by a tracker under a lease
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"  # its session ended before it was delivered

    @property
    def final(self) -> bool:
        return self in (TurnStatus.DONE, TurnStatus.FAILED, TurnStatus.DROPPED)


FINAL = tuple(s.value for s in TurnStatus if s.final)  # final turn states, as stored


@dataclass(frozen=True)
class SessionRecord:
    id: str
    state: SessionState
    system: str | None
    epoch: int  # the highest epoch reserved by a delivery attempt
    kv_epoch: int  # the epoch the route holds the KV at (of the last completed turn)
    route: Route
    history: list[list[int]]  # every step the nodes were fed: prompts and decoded tokens
    tail: list[int]  # generated, not yet fed (the last reply's final token)
    closed: bool  # the last reply ended with the end-of-turn token (or there was none)
    turns: int
    snapshot_id: str | None
    last_used: float

    @property
    def kv_tokens(self) -> int:
        return sum(len(step) for step in self.history)

    @property
    def steps(self) -> int:
        return len(self.history)


@dataclass(frozen=True)
class TurnRecord:
    id: str
    session_id: str
    seq: int
    status: TurnStatus
    attempts: int
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None


@dataclass(frozen=True)
class SnapshotFile:
    """One shard's snapshot, as indexed: its KV stream is ``chunks`` rows of the
    database (tracker/session_data/snapshot_rows.py), or, written by a meshnet before snapshots
    moved there (``chunks`` 0), the file at ``path`` on one tracker's disk."""

    snapshot_id: str
    session_id: str
    layers: LayerRange
    epoch: int
    tokens: int
    steps: int
    path: str  # "" for a snapshot in the database
    nbytes: int  # the length-prefixed stream's bytes
    file_sha256: str  # of the stream
    root_hash: str
    prefix_hash: str
    chunks: int = 0  # rows holding the stream; 0: a file at ``path``


SESSION_COLUMNS = (
    "id, state, system_prompt, epoch, kv_epoch, route, history, tail, closed, turns, "
    "snapshot_id, last_used"
)
TURN_COLUMNS = "id, session_id, seq, status, attempts, request, result, error"
SNAPSHOT_COLUMNS = (
    "snapshot_id, session_id, layer_start, layer_end, epoch, tokens, steps, path, bytes, "
    "file_sha256, root_hash, prefix_hash, chunks"
)


def route_json(route: Route) -> str:
    return json.dumps([[h.node_id, h.address, h.layers.start, h.layers.end] for h in route])


def parse_session(r: Row) -> SessionRecord:
    sid, state, system, epoch, kv_epoch, route, history, tail, closed, turns, snapshot_id, used = r
    hops = tuple(Hop(n, a, LayerRange(s, e)) for n, a, s, e in json.loads(route))
    return SessionRecord(
        id=sid,
        state=SessionState(state),
        system=system,
        epoch=int(epoch),
        kv_epoch=int(kv_epoch),
        route=hops,
        history=json.loads(history),
        tail=json.loads(tail),
        closed=bool(closed),
        turns=int(turns),
        snapshot_id=snapshot_id,
        last_used=float(used),
    )


def parse_turn(r: Row) -> TurnRecord:
    tid, sid, seq, status, attempts, request, result, error = r
    return TurnRecord(
        id=tid,
        session_id=sid,
        seq=int(seq),
        status=TurnStatus(status),
        attempts=int(attempts),
        request=json.loads(request),
        result=json.loads(result) if result else None,
        error=json.loads(error) if error else None,
    )


def parse_snapshot(r: Row) -> SnapshotFile:
    sid, session, start, end, epoch, tokens, steps, path, nbytes, fsha, root, prefix, chunks = r
    return SnapshotFile(
        sid,
        session,
        LayerRange(start, end),
        int(epoch),
        int(tokens),
        int(steps),
        path,
        int(nbytes),
        fsha,
        root,
        prefix,
        int(chunks),
    )
