"""Parking a session on every hop of its route, all or nothing, and the policy's backoff.

A park is made in two phases. Every hop first writes the session's KV to its
disk and keeps it hot (``PREPARE``); each answers what it did (written, or
refused with the failure's kind: its disk full, its park directory unusable,
the session busy, the node gone). Only when every hop has written it are they
told to free the hot KV (``COMMIT``), each answering the bytes that freed;
otherwise the written files are dropped (``ABORT``) and the session is left
exactly as it was, idle and hot, while the tracker reports every hop's outcome
(``ParkFailed``). The policy then waits before it asks again, longer after each
failure of the same session (``ParkBackoff``), so a node that cannot park is
not asked every pass.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

import grpc

from meshnet.errors import DeadlineExceeded, ParkFailed, WorkerDeath
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.nodes.routes import Hop, Route

log = logging.getLogger(__name__)

PARK_TIMEOUT_S = 30.0
BACKOFF_CAP_S = 600.0  # the longest the policy waits before parking a session again


@dataclass(frozen=True)
class HopPark:
    """One hop's answer to one phase of a park."""

    hop: Hop
    done: bool
    freed_bytes: int = 0  # hot KV bytes the commit freed there (0: parked already)
    kind: str = ""  # the failure's kind when not done
    message: str = ""

    def json(self, parked: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node_id": self.hop.node_id,
            "layers": [self.hop.layers.start, self.hop.layers.end],
            "parked": parked,
            "freed_bytes": self.freed_bytes if parked else 0,
        }
        if self.kind:
            out["failure"] = {"kind": self.kind, "message": self.message}
        return out


async def park_route(
    channels: ChannelPool, session_id: str, epoch: int, route: Route
) -> list[HopPark]:
    """Park ``session_id`` on every hop; what each did. ``ParkFailed``, with each hop's
    outcome, when one could not write it: then no hop has freed anything."""
    prepared = await _all(channels, route, session_id, epoch, pb.PARK_PREPARE)
    if all(o.done for o in prepared):
        committed = await _all(channels, route, session_id, epoch, pb.PARK_COMMIT)
        if all(o.done for o in committed):
            return committed
        # A hop's session moved on between the phases (a turn began): the others' KV
        # is parked, which that turn's resume reads back; the session is not parked.
        raise _failed(session_id, committed, "stays idle; the hops that parked it resume it")
    await _all(channels, route, session_id, epoch, pb.PARK_ABORT)
    raise _failed(session_id, prepared, "stays hot")


def park_json(outcomes: list[HopPark]) -> dict[str, Any]:
    """A park's outcome as the API shows it: each hop's, and the hot bytes freed in all."""
    hops = [o.json(parked=True) for o in outcomes]
    return {"freed_bytes": sum(h["freed_bytes"] for h in hops), "hops": hops}


def _failed(session_id: str, outcomes: list[HopPark], then: str) -> ParkFailed:
    first = next(o for o in outcomes if not o.done)
    return ParkFailed(
        f"node {first.hop.node_id} could not park session {session_id} "
        f"({first.kind}: {first.message}); it {then}",
        hops=[o.json(parked=o.done and o.freed_bytes > 0) for o in outcomes],
    )


async def _all(
    channels: ChannelPool, route: Route, session_id: str, epoch: int, phase: pb.ParkPhase.ValueType
) -> list[HopPark]:
    request = pb.ParkRequest(session_id=session_id, epoch=epoch, phase=phase)
    return list(await asyncio.gather(*(_park(channels, hop, request) for hop in route)))


async def _park(channels: ChannelPool, hop: Hop, request: pb.ParkRequest) -> HopPark:
    try:
        reply = await channels.stub(hop.address).Park(
            request, timeout=PARK_TIMEOUT_S, metadata=channels.signed(hop.node_id, "Park")
        )
    except grpc.aio.AioRpcError as e:
        late = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        kind = (DeadlineExceeded if late else WorkerDeath).kind
        detail = f"{e.code().name} {e.details() or ''}".strip()
        log.warning("park of %s on %s: %s", request.session_id, hop.node_id, detail)
        return HopPark(hop, False, kind=kind, message=detail)
    if not reply.parked:
        return HopPark(hop, False, kind=reply.failure.kind, message=reply.failure.message)
    return HopPark(hop, True, freed_bytes=reply.freed_bytes)


@dataclass
class _Failures:
    count: int
    retry_at: float
    last: str


class ParkBackoff:
    """When the policy may next try to park each session whose park failed.

    After the n-th failure in a row a session waits a uniform time in
    [d/2, d], d = min(``BACKOFF_CAP_S``, ``base_s`` · 2^(n-1)); a success or the
    session's leaving ``idle`` forgets it. Owned by one ``Sessions``; call from
    the tracker's event loop.
    """

    def __init__(self, base_s: float, rng: random.Random | None = None) -> None:
        self.base_s = max(base_s, 0.1)
        self._rng = rng or random.Random()
        self._failures: dict[str, _Failures] = {}

    def due(self, session_id: str, now: float) -> bool:
        f = self._failures.get(session_id)
        return f is None or now >= f.retry_at

    def failed(self, session_id: str, now: float, error: str) -> float:
        """Count a failure; the seconds until the next try."""
        count = self._failures[session_id].count + 1 if session_id in self._failures else 1
        ceiling = min(BACKOFF_CAP_S, self.base_s * 2 ** (count - 1))
        wait = self._rng.uniform(ceiling / 2, ceiling)
        self._failures[session_id] = _Failures(count, now + wait, error)
        return wait

    def forget(self, session_id: str) -> None:
        self._failures.pop(session_id, None)

    def keep_only(self, session_ids: set[str]) -> None:
        """Forget sessions no longer idle (so it holds at most the idle sessions)."""
        for sid in [s for s in self._failures if s not in session_ids]:
            del self._failures[sid]

    def describe(self, session_id: str) -> dict[str, Any] | None:
        f = self._failures.get(session_id)
        if f is None:
            return None
        return {"failures": f.count, "retry_at": f.retry_at, "last_failure": f.last}
