"""Running one turn of a session: put its KV back on a route, generate, record the history.

The cheapest correct resume path is taken and reported:

- ``hot`` — the route that ran the last turn still holds the KV: every hop
  resumes it on a new epoch (cutting back anything an unfinished attempt left);
- ``parked`` — the same, but a node read the KV back from its local disk;
- ``snapshot`` — the session was evicted: its verified snapshots (in the
  database, readable by every tracker on it) are streamed to nodes serving the
  same layer spans (any such nodes, not only the original ones), which
  check every hash before the KV becomes visible;
- ``reprefill`` — none of those worked (a node lost the KV, a snapshot is
  missing or failed verification, no node serves a snapshot's span): the
  stored history is replayed from token zero, each prompt as it was sent and
  each run of decoded tokens as the decode steps they were, so the KV is
  bit-identical to the one lost and the turn's output is the same whichever
  path was taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np

from meshnet.auth.signing import PREFIX_KEY
from meshnet.errors import ContextTooLong, DatabaseUnavailable, KVImportFailed, RequestError
from meshnet.model.chat import ChatMessage
from meshnet.model.sampling import SamplingParams
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.accounting.ledger import LedgerSpool
from meshnet.tracker.nodes.prefix_routes import PromptBlocks
from meshnet.tracker.nodes.routes import Hop, Route, route_json
from meshnet.tracker.routing.driver import DoneEvent, TokenEvent
from meshnet.tracker.service import Tracker
from meshnet.tracker.session_data.records import SessionRecord, SnapshotFile, TurnRecord
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore

log = logging.getLogger(__name__)

_SENTINEL = "\x00meshnet-reply\x00"
ALL_EPOCHS = 2**63 - 1  # a release of a session that has ended
_RELEASE_TIMEOUT_S = 10.0

OnToken = Callable[[TokenEvent], Awaitable[None]]
Owners = Callable[[str], str | None]  # a session's tenant (None: it has none)


def _no_owner(session_id: str) -> str | None:
    return None


@dataclass(frozen=True)
class TurnOutcome:
    result: dict[str, Any]  # what the client gets
    session: SessionRecord  # the session as the turn leaves it


def history_hash(history: Sequence[Sequence[int]]) -> str:
    """Names a token history step by step (the same tokens split otherwise differ)."""
    h = hashlib.sha256()
    for step in history:
        h.update(len(step).to_bytes(8, "little"))
        h.update(np.asarray(step, dtype="<i8").tobytes())
    return h.hexdigest()


class TurnRunner:
    """Delivers turns through the tracker's routes; one per tracker."""

    def __init__(self, tracker: Tracker, store: SessionStore, snapshots: SnapshotStore) -> None:
        self.tracker = tracker
        self.store = store
        self.snapshots = snapshots
        self._background: set[asyncio.Task[None]] = set()
        # Whose each session is (the API's ownership table, set where the app is
        # assembled): its first turn's prompt is in that tenant's prefix-cache scope.
        self.owner_of: Owners = _no_owner

    @property
    def ledger(self) -> LedgerSpool:
        """Where the turns' ledger records go (the outbox holds them per attempt)."""
        return self.tracker.ledger

    def input_ids(self, session: SessionRecord, content: str) -> list[int]:
        """What the turn feeds: the last reply's final token, then the rendered user turn."""
        model = self.tracker.model
        template = model.template
        if not session.history:
            system = [] if session.system is None else [ChatMessage("system", session.system)]
            text = template.render([*system, ChatMessage("user", content)])
            return [*session.tail, *model.tokenizer.encode(text)]
        probe = template.render(
            [
                ChatMessage("user", "-"),
                ChatMessage("assistant", _SENTINEL),
                ChatMessage("user", content),
            ]
        )
        if _SENTINEL not in probe:
            raise RequestError("the chat template cannot continue a conversation")
        text = probe.split(_SENTINEL, 1)[1]
        closing = model.tokenizer.decode(session.tail) if session.closed else ""
        if closing and text.startswith(closing):
            text = text[len(closing) :]  # the reply's final token (eos, eot...) closed it already
        # A continuation, not a new prompt: no BOS in the middle of the conversation.
        return [*session.tail, *model.tokenizer.encode(text, add_special=False)]

    def check(
        self, session: SessionRecord, request: dict[str, Any]
    ) -> tuple[list[int], SamplingParams]:
        """The turn's input ids and sampling; ``RequestError`` when the session cannot
        take it (bad sampling values, or past the context length)."""
        params = sampling_params(request)
        ids = self.input_ids(session, request["content"])
        context = session.kv_tokens + len(ids) + params.max_tokens
        limit = self.tracker.planner.context_limit()
        if context > limit:
            raise ContextTooLong(
                f"the session holds {session.kv_tokens} tokens; this turn's {len(ids)} and "
                f"max_tokens {params.max_tokens} exceed the context length {limit}"
            )
        return ids, params

    def prefix_scope(self, session: SessionRecord) -> bytes:
        """The prefix-cache scope of the session's tenant (empty: a session nobody owns)."""
        owner = self.owner_of(session.id)
        return b"" if owner is None else self.tracker.prefix_scope(owner)

    async def run(
        self, session: SessionRecord, turn: TurnRecord, on_token: OnToken | None = None
    ) -> TurnOutcome:
        """Deliver ``turn`` (one attempt); raises a typed error when it cannot."""
        t0 = time.monotonic()
        ids, params = self.check(session, turn.request)
        epoch = self.store.next_epoch(session.id)
        scope = b"" if session.history else self.prefix_scope(session)  # a first turn's
        if session.history:
            route, path, failures = await self._place(session)
            _, held = self.tracker.planner.reserve(
                route
            )  # Overloaded: the outbox tries again later
        else:  # a first turn: routed by load and by what its nodes hold of the prompt
            blocks = PromptBlocks(ids, scope)
            (route, held), path, failures = self.tracker.planner.reserve(None, blocks), "hot", []
        gen = self.tracker.driver.new_generation(turn.id, route, params)  # ledger records
        gen.session_id, gen.keep, gen.epoch = session.id, True, epoch
        gen.prefix_scope = scope
        gen.first_step = session.steps
        for step, step_ids in enumerate(session.history):
            gen.record_input(0, step, np.asarray(step_ids, dtype=np.int64))
        try:
            if not session.history:  # opens on the nodes' cached prefix of its prompt
                await self.tracker.driver.open(gen, ids)
                self.tracker.metrics.cached_prompt_tokens.labels("turn").inc(gen.reused)
                self.tracker.planner.routed(route, blocks)  # its blocks go to their caches
            elif path == "reprefill":
                await self.tracker.driver.open(gen)
            elif not await self.tracker.driver.resume(gen, (session.kv_tokens, session.steps)):
                path = "reprefill"
            elif path == "hot" and any(link.unparked for link in gen.links):
                path = "parked"
        except BaseException:
            held.release()
            for link in gen.links:
                link.close()
            raise
        history = [t for step in session.history for t in step]
        done: DoneEvent | None = None
        async for event in self.tracker.drive(gen, held, ids, params, history):
            if isinstance(event, DoneEvent):
                done = event
            elif on_token is not None:
                await on_token(event)
        assert done is not None
        ready = gen.ready_at if gen.ready_at is not None else time.monotonic()
        out = done.ids
        after = replace(
            session,
            kv_epoch=done.epoch,
            route=done.route,
            history=[*session.history, *_prompt_steps(ids, gen.reused), *([t] for t in out[:-1])],
            tail=[out[-1]],
            closed=out[-1] in self.tracker.model.tokenizer.eog_ids,
            snapshot_id=None,
        )
        result = {
            "turn_id": turn.id,
            "text": done.text,
            "ids": out,
            "finish_reason": done.finish_reason,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "total_tokens": len(ids) + len(out),
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            },
            "resume_path": path,
            "resume_ms": round((ready - t0) * 1000, 2),
            "resume_failures": failures,
            "route": route_json(done.route),
            "epoch": done.epoch,
            "recoveries": [r.as_json() for r in done.recoveries],
        }
        self._release_elsewhere(session, done.route, done.epoch)
        return TurnOutcome(result, after)

    async def release(self, route: Route, session_id: str, epoch: int = ALL_EPOCHS) -> None:
        """Every hop frees what it holds of the session (hot or parked), up to ``epoch``."""
        await asyncio.gather(*(self._release(hop, session_id, epoch) for hop in route))

    async def _place(self, session: SessionRecord) -> tuple[Route, str, list[dict[str, Any]]]:
        """The route for the turn and the resume path it starts on."""
        if session.snapshot_id is not None:
            files = self.store.snapshot(session.snapshot_id)
            route = self._snapshot_route(files)
            if route is None:
                failure = {"reason": "no-node", "message": "no node serves a snapshot's layers"}
                return self.tracker.planner.route(), "reprefill", [failure]
            failures = await self._import(session, files, route)
            return route, ("reprefill" if failures else "snapshot"), failures
        if session.route and self.tracker.planner.usable(session.route):
            return session.route, "hot", []
        return self.tracker.planner.route(), "reprefill", []

    def _snapshot_route(self, files: list[SnapshotFile]) -> Route | None:
        hops: list[Hop] = []
        for f in files:
            hop = self.tracker.planner.single_hop_for(f.layers)
            if hop is None:
                return None
            hops.append(hop)
        spans = [h.layers for h in hops]
        whole = self.tracker.model.spec.n_layers
        if not spans or spans[0].start != 0 or spans[-1].end != whole:
            return None
        return tuple(hops)

    async def _import(
        self, session: SessionRecord, files: list[SnapshotFile], route: Route
    ) -> list[dict[str, Any]]:
        """Stream each snapshot file to its hop; the failures, each with its reason."""
        prefix = history_hash(session.history)
        results = await asyncio.gather(
            *(self._import_one(f, hop, prefix) for f, hop in zip(files, route, strict=True))
        )
        return [r for r in results if r is not None]

    async def _import_one(
        self, snapshot: SnapshotFile, hop: Hop, prefix: str
    ) -> dict[str, Any] | None:
        local: list[KVImportFailed] = []
        frames = _guarded(self.snapshots.frames(snapshot, prefix), local)
        stub = self.tracker.channels.stub(hop.address)
        try:
            vouched = ((PREFIX_KEY, prefix), *self.tracker.channels.signed(hop.node_id, "StatePut"))
            # The stream's size sizes the call's deadline (the node holds it to its own).
            limit = self.snapshots.pace.limit_s(snapshot.nbytes)
            reply = await stub.StatePut(frames, timeout=limit, metadata=vouched)
        except grpc.aio.AioRpcError as e:
            reason = local[0].reason if local else "transport"
            message = local[0].message if local else f"{e.code().name} {e.details() or ''}"
            return _import_failure(hop, reason, message)
        if local:  # the snapshot was bad: the node saw a cut-off stream and kept nothing
            return _import_failure(hop, local[0].reason, local[0].message)
        if not reply.imported:
            return _import_failure(hop, reply.reason, reply.failure.message)
        return None

    def _release_elsewhere(self, session: SessionRecord, route: Route, epoch: int) -> None:
        """Nodes of the old route that are not on the new one drop what they hold of it."""
        keep = {(h.node_id, h.layers) for h in route}
        for hop in session.route:
            if (hop.node_id, hop.layers) not in keep:
                task = asyncio.create_task(self._release(hop, session.id, epoch))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _release(self, hop: Hop, session_id: str, epoch: int) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.tracker.channels.stub(hop.address).Release(
                pb.ReleaseRequest(session_id=session_id, epoch=epoch),
                timeout=_RELEASE_TIMEOUT_S,
                metadata=self.tracker.channels.signed(hop.node_id, "Release"),
            )


def _prompt_steps(ids: list[int], reused: int) -> list[list[int]]:
    """The steps a turn's prompt was fed in: a cached prefix the hops opened on is a step
    of its own (step 0 of a first turn), the rest of the prompt the next."""
    return [ids[:reused], ids[reused:]] if reused else [ids]


def sampling_params(request: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_tokens=int(request["max_tokens"]),
        temperature=float(request["temperature"]),
        top_k=int(request.get("top_k", 0)),
        top_p=float(request.get("top_p", 1.0)),
        repetition_penalty=float(request.get("repetition_penalty", 1.0)),
        seed=request.get("seed"),
        stop=tuple(request.get("stop", ())),
    )


def _import_failure(hop: Hop, reason: str, message: str) -> dict[str, Any]:
    log.warning("snapshot import to %s failed (%s): %s", hop.node_id, reason, message)
    return {
        "node_id": hop.node_id,
        "layers": [hop.layers.start, hop.layers.end],
        "reason": reason,
        "message": message,
    }


async def _guarded(
    frames: Generator[pb.KVFrame, None, None], failures: list[KVImportFailed]
) -> AsyncIterator[pb.KVFrame]:
    """The snapshot's frames, each read in a worker thread (it may fetch rows of the
    database, or read a file); a bad snapshot ends the stream early (the node then
    keeps nothing) and its reason is kept for the caller. A snapshot the database or
    the disk fails to give is a bad one too: the turn re-prefills instead of failing."""
    try:
        while (frame := await asyncio.to_thread(next, frames, None)) is not None:
            yield frame
    except KVImportFailed as e:
        failures.append(e)
    except DatabaseUnavailable as e:
        failures.append(KVImportFailed(f"snapshot unreadable: {e.message}", "missing"))
    except OSError as e:
        failures.append(KVImportFailed(f"snapshot file unreadable: {e}", "missing"))
    finally:
        # A read still running in its thread (the call was cancelled) ends on its own.
        with contextlib.suppress(ValueError):
            frames.close()
