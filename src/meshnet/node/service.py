"""The node's gRPC service: parses wire messages at the edge, hands typed work to the engine.

A ``Forward`` stream serves one (session, epoch): an ``Open`` first, then steps
in order. When the ``Open`` carries sampling parameters (the route's last hop),
each step answers the token sampled from its last row, with log-probabilities,
instead of the logits. A node holds at most ``max_streams`` of them (each takes a server
thread for its life); one more is answered ``overloaded`` at once, so control
calls (probes, fences, releases) always find a thread. A failed step answers a
``Failure`` and leaves the stream (and the session's KV) usable; the KV is
released when the stream ends, however it ends, unless the open asked to
``keep`` it (a session between turns), in which case it stays until a
``Release``, and can be ``Park``ed on local disk meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import grpc
import numpy as np

from meshnet.auth.grpc_auth import NodeGate
from meshnet.auth.mesh_keys import SERVICE
from meshnet.auth.signing import METADATA_KEY
from meshnet.backends.fast import FastBackend
from meshnet.backends.shard import Shard
from meshnet.errors import MalformedBundle, MeshnetError, Overloaded, ShardMismatch
from meshnet.kv.pace import TransferPace
from meshnet.model.sampling import SamplingParams
from meshnet.node.autorun import Inbox
from meshnet.node.autorun_stream import AutorunHandling
from meshnet.node.configure import Configurator, StreamLimit
from meshnet.node.engine import NodeEngine
from meshnet.node.engine_types import EngineStats
from meshnet.node.forward_steps import failure_reply
from meshnet.node.grammar import GrammarTokenizers
from meshnet.node.head_assist import HeadAssists
from meshnet.node.kv_offers import KVOffers
from meshnet.node.kv_service import KVService
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.model_fetch import NodeModels
from meshnet.node.parking import ParkPhase
from meshnet.node.relay import Mailbox, RelaySender
from meshnet.node.relay_wire import Ask
from meshnet.node.step_input import array_input, tensor_input
from meshnet.node.tally import Once, Tally
from meshnet.node.wire import CONTROL_TIMEOUT_S, MAX_SESSION_ID, fail
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_MAX_RELAY_STREAMS = 8  # previous hops relaying to this node at once (a thread each)
_RELAYS_PER_STREAM = 4  # relayed inputs waiting per stream the node holds
_MAILBOX_BYTES = 256 << 20


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    model_path: str | None  # the model loaded at start, if any
    model_dirs: ModelDirs  # where Configure may load models from
    models: NodeModels | None = None  # fetches models given by reference (None: refused)


class NodeService(AutorunHandling, pb_grpc.NodeServicer):
    """Serves one ``NodeEngine``: Forward and relays, control calls, and (through
    ``KVService``) KV transfers. ``gate`` (the server's interceptor) has let in only the
    tracker's calls and peers' tokens; handlers check what a token's scope allows."""

    def __init__(
        self,
        identity: NodeIdentity,
        engine: NodeEngine,
        gate: NodeGate,
        offers: KVOffers | None = None,
        head_assist: bool = False,
        kv_pace: TransferPace | None = None,
    ) -> None:
        self.identity = identity
        self.engine = engine
        # Sized by the engine's config as it is at each open (tier 1 moves it), never past
        # the count the server's threads were sized for at start.
        self._streams = StreamLimit(lambda: engine.config.max_streams)
        limit = engine.config.max_streams * _RELAYS_PER_STREAM
        self.mailbox = Mailbox(limit, _MAILBOX_BYTES)  # inputs relayed by previous hops
        self.relay = RelaySender()  # outputs to next hops
        # a ring's last hop shares its head with the first (node/head_assist.py)
        self.assists = HeadAssists(self.relay.port_of) if head_assist else None
        self.relay_port = 0  # the relay port's, offered to previous hops (0: none)
        self.gate = gate
        self._relays = threading.BoundedSemaphore(_MAX_RELAY_STREAMS)  # from previous hops
        self._rings = Tally()  # ring runs under way on this hop
        self.kv = KVService(engine, gate, offers, kv_pace)
        self.grammars = GrammarTokenizers()  # for a constrained sampling hop
        self.configurator = Configurator(
            engine,
            identity.model_dirs,
            identity.model_path,
            engine.config.max_streams,
            identity.models,
        )

    def close(self) -> None:
        """Close the links to next hops."""
        self.relay.close()
        if self.assists is not None:
            self.assists.close()

    def stats(self) -> EngineStats:
        """What the node reports with its heartbeat."""
        asked, late = self.assists.counts() if self.assists is not None else (0, 0)
        stats = self.engine.stats()
        return replace(
            stats, relayed=self.mailbox.delivered, head_parts=asked, head_parts_late=late
        )

    def Forward(
        self, request_iterator: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardResponse]:
        if not self._streams.acquire(blocking=False):
            limit = self.engine.config.max_streams
            yield failure_reply(Overloaded(f"this node holds its {limit} streams"))
            return
        free = Once(self._streams.release)
        context.add_callback(free)  # the call ended (also cancelled while the handler waits)
        try:
            yield from self._forward(request_iterator, context)
        finally:
            free()

    def _forward(
        self, request_iterator: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardResponse]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            yield failure_reply(MalformedBundle("a Forward stream must start with Open"))
            return
        opened = first.open
        try:
            sampling = self._sampling(opened)
            held = self._open(opened)
        except MeshnetError as e:
            yield failure_reply(e)
            return
        # However the call ends (the driver cancels it, the connection drops), the
        # session's KV and queued steps go at once, not when this handler next wakes.
        sid, epoch = opened.session_id, opened.epoch
        self.mailbox.opened(sid, epoch)
        if not opened.keep:

            def release() -> None:
                self.engine.release(sid, epoch)  # queued on the engine's loop, not awaited

            context.add_callback(release)
        shard = self.engine.shard
        assert shard is not None  # _open checked it
        yield pb.ForwardResponse(
            opened=pb.Opened(
                node_id=self.identity.node_id,
                layer_start=shard.layers.start,
                layer_end=shard.layers.end,
                kv_tokens=held.kv_tokens,
                steps=held.steps,
                unparked=held.unparked,
            )
        )
        try:
            yield from self._serve_steps(opened, sampling, request_iterator, context)
        finally:
            self.mailbox.drop(sid, epoch)
            if not opened.keep:
                self.engine.release(sid, epoch).result(CONTROL_TIMEOUT_S)

    def _serve_steps(
        self,
        o: pb.Open,
        sampling: SamplingParams | None,
        requests: Iterator[pb.ForwardRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[pb.ForwardResponse]:
        """Answer each step; an autorun step runs on until its end (node/autorun.py)."""
        inbox: Inbox | None = None  # once a stream autoruns, a thread reads its requests
        resume: pb.Step | None = None  # where a finished autorun would go on
        while True:
            request = inbox.get() if inbox is not None else next(requests, None)
            if request is None:
                return
            kind = request.WhichOneof("kind")
            if kind == "extend" and resume is not None and request.extend.until > resume.step:
                resume.autorun_until = request.extend.until
                request, kind = pb.ForwardRequest(step=resume), "step"
            elif kind == "extend":
                continue  # an extension the run no longer needed
            step = request.step
            if kind == "step" and step.autorun_until > step.step:
                inbox = inbox or Inbox(requests)
                resume = yield from self._autorun(o, sampling, step, inbox, context)
            else:
                resume = None
                yield self._step(o, sampling, request, context)

    def RelayStream(
        self, request_iterator: Iterator[pb.RelayFrame], context: grpc.ServicerContext
    ) -> Iterator[pb.RelayAck]:
        if not self._relays.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many relay streams")
        try:
            for frame in request_iterator:
                refused = self.file_tensor(frame.session_id, frame.epoch, frame.step, frame.input)
                if refused is not None:
                    yield pb.RelayAck(failure=fail(refused), relay_port=self.relay_port)
                else:
                    yield pb.RelayAck(relay_port=self.relay_port)
        finally:
            self._relays.release()

    def file_tensor(
        self, session_id: str, epoch: int, step: int, tensor: pb.Tensor
    ) -> MeshnetError | None:
        """File a ``RelayStream`` frame's input in the mailbox, checked; the refusal for
        its sender, or None when filed. Any thread."""
        return self._file(session_id, epoch, step, lambda shard: tensor_input(shard, tensor))

    def file_array(
        self, session_id: str, epoch: int, step: int, x: np.ndarray
    ) -> MeshnetError | None:
        """File an input read off the relay port (its lengths bounded there) in the
        mailbox, held to a tensor's checks; the refusal, or None when filed. Any thread."""
        return self._file(session_id, epoch, step, lambda shard: array_input(shard, x))

    def _file(
        self, session_id: str, epoch: int, step: int, read: Callable[[Shard], np.ndarray]
    ) -> MeshnetError | None:
        shard = self.engine.shard
        try:
            if shard is None:
                raise ShardMismatch("this node is empty")
            if not session_id or len(session_id) > MAX_SESSION_ID:
                raise MalformedBundle(f"session_id must have 1 to {MAX_SESSION_ID} characters")
            self.mailbox.put((session_id, epoch, step), read(shard))
        except MeshnetError as e:
            return e
        return None

    def answer_head(self, ask: Ask, x: np.ndarray) -> np.ndarray:
        """A ring's last hop's ask (node/head_assist.py): ``x`` times this node's head
        rows ``[0, ask.stop)``, its tied head being its embedding; raises the typed
        refusal. Any thread (the asking connection's)."""
        shard = self.engine.shard
        if shard is None or not isinstance(shard.backend, FastBackend):
            raise ShardMismatch("this node holds no quantized head")
        if (ask.fingerprint, ask.backend) != (shard.fingerprint, shard.backend.name):
            raise ShardMismatch("this node serves another model file or backend")
        try:
            return shard.backend.head_part(x, ask.stop)
        except ValueError as e:
            raise MalformedBundle(f"a head ask: {e}") from None

    def check_relay_token(self, token: str) -> None:
        """Let a relay-port connection in as a ``RelayStream`` call with ``token`` would
        be; raises the typed refusal."""
        self.gate.check(SERVICE + "RelayStream", ((METADATA_KEY, token),))

    def Outputs(
        self, request: pb.OutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StepOutput]:
        if not request.session_id or len(request.session_id) > MAX_SESSION_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad session_id")
        if request.end_step < request.first_step:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "end_step before first_step")
        sent = self.engine.sent(request.session_id, request.first_step, request.end_step)
        for step, x in sent.result(CONTROL_TIMEOUT_S):
            yield pb.StepOutput(step=step, output=codec.encode(x))

    def Configure(
        self, request: pb.ConfigureRequest, context: grpc.ServicerContext
    ) -> pb.ConfigureResponse:
        """Apply one tier of configuration (node/configure.py); a refusal says why and
        changes nothing."""
        return self.configurator.configure(request)

    def Fence(self, request: pb.FenceRequest, context: grpc.ServicerContext) -> pb.FenceResponse:
        if request.session_id and len(request.session_id) <= MAX_SESSION_ID:
            self.engine.fence(request.session_id, request.epoch).result(CONTROL_TIMEOUT_S)
        return pb.FenceResponse()

    def Release(
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseResponse:
        if not request.session_id or len(request.session_id) > MAX_SESSION_ID:
            return pb.ReleaseResponse(released=False)
        freed = self.engine.release(request.session_id, request.epoch).result(CONTROL_TIMEOUT_S)
        return pb.ReleaseResponse(released=freed)

    def Park(self, request: pb.ParkRequest, context: grpc.ServicerContext) -> pb.ParkResponse:
        """Park a session's KV on local disk, in one call or one phase of two
        (``ParkPhase``); a failure is answered with its kind and leaves the KV hot."""
        try:
            if not request.session_id or len(request.session_id) > MAX_SESSION_ID:
                raise MalformedBundle(f"session_id must have 1 to {MAX_SESSION_ID} characters")
            if request.phase not in {p.value for p in ParkPhase}:
                raise MalformedBundle(f"no park phase {request.phase}")
            phase = ParkPhase(request.phase)
            epoch = request.epoch or None
            done = self.engine.park(request.session_id, epoch, phase).result(CONTROL_TIMEOUT_S)
        except MeshnetError as e:
            return pb.ParkResponse(parked=False, failure=fail(e))
        return pb.ParkResponse(parked=True, tokens=done.tokens, freed_bytes=done.freed_bytes)

    # KV export and import (node/kv_service.py)

    def StateGet(
        self, request: pb.StateGetRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KVFrame]:
        return self.kv.get(request, context)

    def StateOffer(
        self, request: pb.StateGetRequest, context: grpc.ServicerContext
    ) -> pb.StateOfferResponse:
        return self.kv.offer(request, context)

    def StatePull(
        self, request: pb.StatePullRequest, context: grpc.ServicerContext
    ) -> pb.StatePutResponse:
        return self.kv.pull(request, context)

    def StatePut(
        self, request_iterator: Iterator[pb.KVFrame], context: grpc.ServicerContext
    ) -> pb.StatePutResponse:
        return self.kv.put(request_iterator, context)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        s = self.engine.stats()
        return pb.InfoResponse(
            node_id=self.identity.node_id,
            fingerprint=s.fingerprint,
            loaded=s.loaded,
            layer_start=s.layers.start if s.layers else 0,
            layer_end=s.layers.end if s.layers else 0,
            sessions=s.sessions,
            kv_bytes=s.kv_bytes,
            parked=s.parked,
        )
