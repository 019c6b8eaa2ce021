"""The node's gRPC service: parses wire messages at the edge, hands typed work to the engine.

``NodeService`` is the servicer; it holds the parts that serve its calls and
delegates to them: ``Forward`` streams to ``ForwardStreams``
(node/forward_stream.py), whose single steps are ``ForwardSteps``'
(node/forward_steps.py) and whose runs of steps are ``AutorunStreams``'
(node/autorun_stream.py); KV transfers to ``KVService`` (node/kv_service.py);
``Configure`` to the ``Configurator`` (node/configure.py). Itself it files the
inputs previous hops relay (``RelayStream``, and the relay port's reads) in the
mailbox those parts read, and answers the control calls (fences, releases,
parking, a session's sent outputs, info).
"""

from __future__ import annotations

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
from meshnet.errors import MalformedBundle, MeshnetError, ShardMismatch
from meshnet.kv.pace import TransferPace
from meshnet.node.autorun_stream import AutorunStreams
from meshnet.node.configure import Configurator
from meshnet.node.engine import NodeEngine
from meshnet.node.engine_types import EngineStats
from meshnet.node.forward_steps import ForwardSteps
from meshnet.node.forward_stream import ForwardStreams
from meshnet.node.head_assist import HeadAssists
from meshnet.node.kv_offers import KVOffers
from meshnet.node.kv_service import KVService
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.model_fetch import NodeModels
from meshnet.node.parking import ParkPhase
from meshnet.node.relay import Mailbox, RelaySender
from meshnet.node.relay_wire import Ask
from meshnet.node.step_input import array_input, tensor_input
from meshnet.node.wire import CONTROL_TIMEOUT_S, MAX_SESSION_ID, fail
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

_MAX_RELAY_STREAMS = 8  # previous hops relaying to this node at once (a thread each)
_RELAYS_PER_STREAM = 4  # relayed inputs waiting per stream the node holds
_MAILBOX_BYTES = 256 << 20


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    model_path: str | None  # the model loaded at start, if any
    model_dirs: ModelDirs  # where Configure may load models from
    models: NodeModels | None = None  # fetches models given by reference (None: refused)


class NodeService(pb_grpc.NodeServicer):
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
        limit = engine.config.max_streams * _RELAYS_PER_STREAM
        self.mailbox = Mailbox(limit, _MAILBOX_BYTES)  # inputs relayed by previous hops
        self.relay = RelaySender()  # outputs to next hops
        # a ring's last hop shares its head with the first (node/head_assist.py)
        self.assists = HeadAssists(self.relay.port_of) if head_assist else None
        self.relay_port = 0  # the relay port's, offered to previous hops (0: none)
        self.gate = gate
        self._relays = threading.BoundedSemaphore(_MAX_RELAY_STREAMS)  # from previous hops
        steps = ForwardSteps(engine, self.mailbox, self.relay)
        autorun = AutorunStreams(engine, steps, self.mailbox, self.relay, self.assists)
        self.forward = ForwardStreams(
            identity.node_id,
            engine,
            lambda: engine.config.max_streams,
            self.mailbox,
            steps,
            autorun,
        )
        self.kv = KVService(engine, gate, offers, kv_pace)
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
        return self.forward.serve(request_iterator, context)

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
        sent = self.engine.sessions.sent(request.session_id, request.first_step, request.end_step)
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
            self.engine.sessions.fence(request.session_id, request.epoch).result(CONTROL_TIMEOUT_S)
        return pb.FenceResponse()

    def Release(
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseResponse:
        if not request.session_id or len(request.session_id) > MAX_SESSION_ID:
            return pb.ReleaseResponse(released=False)
        released = self.engine.sessions.release(request.session_id, request.epoch)
        freed = released.result(CONTROL_TIMEOUT_S)
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
            parked = self.engine.parking.park(request.session_id, epoch, phase)
            done = parked.result(CONTROL_TIMEOUT_S)
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
