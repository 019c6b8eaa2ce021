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
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import grpc
import numpy as np

from meshnet.auth.grpc_auth import NodeGate
from meshnet.auth.mesh_keys import SERVICE
from meshnet.auth.signing import METADATA_KEY, PREFIX_KEY, require_peer
from meshnet.errors import (
    DeadlineExceeded,
    KVImportFailed,
    MalformedBundle,
    MeshnetError,
    Overloaded,
    PermissionDenied,
    RequestError,
    ShardMismatch,
)
from meshnet.kv.bulk import recv_stream
from meshnet.kv.transfer import KVShape, check_header, export_frames, read_stream
from meshnet.layer_range import LayerRange
from meshnet.model.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from meshnet.model.sampling import Sampler, SamplingParams
from meshnet.model.shard import Shard
from meshnet.node.engine import EngineStats, ExportedKV, NodeEngine, OpenedSlot
from meshnet.node.kv_offers import KVOffers
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.relay import Mailbox, RelaySender
from meshnet.node.scheduler import StepWork
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS

log = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 30.0
_MAX_SESSION_ID = 128
_NO_DEADLINE_S = 7 * 24 * 3600.0
_TRANSFER_TIMEOUT_S = 60.0  # one KV import, whole stream
_MAX_ADDRESS = 256
_MAX_PREFIX_HASH = 128
MAX_IMPORTS = 4  # KV imports at once; one more is refused (reason "busy") before it reads
_CONNECT_TIMEOUT_S = 5.0
_RELAY_TIMEOUT_S = 10.0  # the next hop only files the input: more means it is stuck
_MAX_RELAY_STREAMS = 8  # previous hops relaying to this node at once (a thread each)
_RELAYS_PER_STREAM = 4  # relayed inputs waiting per stream the node holds
_MAILBOX_BYTES = 256 << 20


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    model_path: str | None  # the model loaded at start, if any
    model_dirs: ModelDirs  # where Configure may load models from


class NodeService(pb_grpc.NodeServicer):
    """Serves Forward, Configure and Info for one ``NodeEngine``. ``gate`` (the server's
    interceptor) has let in only the tracker's calls and peers' tokens; the handlers
    check what a peer token's scope allows."""

    def __init__(
        self,
        identity: NodeIdentity,
        engine: NodeEngine,
        gate: NodeGate,
        offers: KVOffers | None = None,
    ) -> None:
        self.identity = identity
        self.engine = engine
        self.gate = gate
        self.offers = offers  # the bulk TCP port, when this node runs one
        self._streams = threading.BoundedSemaphore(engine.config.max_streams)
        limit = engine.config.max_streams * _RELAYS_PER_STREAM
        self.mailbox = Mailbox(limit, _MAILBOX_BYTES)  # inputs relayed by previous hops
        self.relay = RelaySender()  # outputs to next hops
        self._relays = threading.BoundedSemaphore(_MAX_RELAY_STREAMS)  # from previous hops
        self._imports = threading.BoundedSemaphore(MAX_IMPORTS)

    def stats(self) -> EngineStats:
        """What the node reports with its heartbeat."""
        return replace(self.engine.stats(), relayed=self.mailbox.delivered)

    def Forward(
        self, request_iterator: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardResponse]:
        if not self._streams.acquire(blocking=False):
            limit = self.engine.config.max_streams
            yield _failure(Overloaded(f"this node holds its {limit} streams"))
            return
        free = _Once(self._streams.release)
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
            yield _failure(MalformedBundle("a Forward stream must start with Open"))
            return
        opened = first.open
        try:
            sampling = self._sampling(opened)
            held = self._open(opened)
        except MeshnetError as e:
            yield _failure(e)
            return
        # However the call ends (the driver cancels it, the connection drops), the
        # session's KV and queued steps go at once, not when this handler next wakes.
        sid, epoch = opened.session_id, opened.epoch
        if not opened.keep:
            context.add_callback(lambda: self.engine.release(sid, epoch))
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
            for request in request_iterator:
                yield self._step(opened, sampling, request, context)
        finally:
            self.mailbox.drop(sid, epoch)
            if not opened.keep:
                self.engine.release(sid, epoch).result(_CONTROL_TIMEOUT_S)

    def _open(self, o: pb.Open) -> OpenedSlot:
        shard = self.engine.shard
        if not o.session_id or len(o.session_id) > _MAX_SESSION_ID:
            raise MalformedBundle(f"session_id must have 1 to {_MAX_SESSION_ID} characters")
        if shard is None:
            raise ShardMismatch("this node is empty")
        wanted = (o.fingerprint, o.layer_start, o.layer_end)
        have = (shard.fingerprint, shard.layers.start, shard.layers.end)
        if wanted != have:
            raise ShardMismatch(
                f"node serves layers {shard.layers} of {shard.fingerprint[:12]}, "
                f"not [{o.layer_start}, {o.layer_end}) of {o.fingerprint[:12]}"
            )
        rewind = (o.rewind_tokens, o.rewind_steps) if o.rewind else None
        opened = self.engine.open(o.session_id, o.epoch, o.resume, rewind)
        return opened.result(_CONTROL_TIMEOUT_S)

    def _sampling(self, o: pb.Open) -> SamplingParams | None:
        """The parameters to sample with when this hop is asked to (it must be the last)."""
        if not o.HasField("sampling"):
            return None
        shard = self.engine.shard
        if shard is None or not shard.is_last:
            raise ShardMismatch("only the last layers' node can sample")
        p = o.sampling
        if p.top_logprobs > MAX_TOP_LOGPROBS:
            raise MalformedBundle(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}")
        try:
            return SamplingParams(
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                repetition_penalty=p.repetition_penalty,
                seed=p.seed % 2**63,
            )
        except RequestError as e:
            raise MalformedBundle(f"bad sampling parameters: {e.message}") from None

    def _step(
        self,
        o: pb.Open,
        sampling: SamplingParams | None,
        request: pb.ForwardRequest,
        context: grpc.ServicerContext,
    ) -> pb.ForwardResponse:
        shard = self.engine.shard
        if request.WhichOneof("kind") != "step" or shard is None:
            return _failure(MalformedBundle("expected a Step"))
        step = request.step
        t0 = time.perf_counter()
        try:
            remaining = _remaining_s(step.timeout_ms, context)
            started = time.monotonic()
            x = self._input(o, step, shard, remaining, context)
            deadline = started + remaining if remaining is not None else None
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            history = _history(step, shard.spec.context_length, shard.spec.vocab_size)
            work = StepWork(
                o.session_id,
                o.epoch,
                x,
                deadline,
                step=step.step,
                replay=step.replay,
                keep_output=step.forward,
            )
            out = self.engine.submit(work).result(timeout=left)
        except TimeoutError:
            return _failure(DeadlineExceeded(f"step {step.step} did not finish in time"))
        except MeshnetError as e:
            return _failure(e)
        if step.forward:
            return self._forward_output(o, step, out, t0, deadline)
        if sampling is None:
            ms = (time.perf_counter() - t0) * 1000
            return pb.ForwardResponse(
                result=pb.StepResult(step=step.step, output=codec.encode(out), compute_ms=ms)
            )
        logits = out[-1]
        token = Sampler(sampling, step.draws).sample(logits, history)
        lp = token_logprobs(logits, token, o.sampling.top_logprobs)
        sampled = pb.Sampled(
            token=token,
            logprob=lp.logprob,
            top_ids=[i for i, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        ms = (time.perf_counter() - t0) * 1000
        return pb.ForwardResponse(
            result=pb.StepResult(step=step.step, sampled=sampled, compute_ms=ms)
        )

    def _input(
        self,
        o: pb.Open,
        step: pb.Step,
        shard: Shard,
        timeout_s: float | None,
        context: grpc.ServicerContext,
    ) -> np.ndarray:
        """The step's input: in the message, or relayed by the previous hop."""
        spec = shard.spec
        if not step.relayed:
            limits = (
                codec.TensorLimits("i64", 1, spec.context_length)
                if shard.is_first
                else codec.TensorLimits("f32", 2, spec.context_length, spec.d_model)
            )
            x = codec.decode(step.input, limits)
            if shard.is_first and (x.min() < 0 or x.max() >= spec.vocab_size):
                raise MalformedBundle(f"token ids must be in [0, {spec.vocab_size})")
            return x
        if shard.is_first or not 0 < step.rows <= spec.context_length:
            raise MalformedBundle("a relayed step needs a previous hop and 1 to context rows")
        key = (o.session_id, o.epoch, step.step)
        x = self.mailbox.take(key, timeout_s, context.is_active)
        if x.shape[0] != step.rows:
            raise MalformedBundle(f"the previous hop relayed {x.shape[0]} rows, not {step.rows}")
        return x

    def _forward_output(
        self, o: pb.Open, step: pb.Step, out: np.ndarray, t0: float, deadline: float | None
    ) -> pb.ForwardResponse:
        """Send the output to the next hop; answer the driver without it."""
        if not o.next_address:
            return _failure(MalformedBundle("a forward step needs the next hop's address"))
        frame = pb.RelayFrame(
            session_id=o.session_id, epoch=o.epoch, step=step.step, input=codec.encode(out)
        )
        left = _RELAY_TIMEOUT_S
        if deadline is not None:
            left = min(left, max(deadline - time.monotonic(), 0.001))
        try:
            self.relay.send(o.next_address, o.next_token, frame, left)
        except MeshnetError as e:
            return _failure(e, blame=o.next_node_id)
        ms = (time.perf_counter() - t0) * 1000
        return pb.ForwardResponse(result=pb.StepResult(step=step.step, compute_ms=ms))

    def RelayStream(
        self, request_iterator: Iterator[pb.RelayFrame], context: grpc.ServicerContext
    ) -> Iterator[pb.RelayAck]:
        if not self._relays.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many relay streams")
        try:
            for frame in request_iterator:
                yield self._file(frame)
        finally:
            self._relays.release()

    def _file(self, frame: pb.RelayFrame) -> pb.RelayAck:
        """File one relayed input in the mailbox, checked; the answer for its sender."""
        shard = self.engine.shard
        try:
            if shard is None or shard.is_first:
                raise ShardMismatch("this node takes no relayed input")
            if not frame.session_id or len(frame.session_id) > _MAX_SESSION_ID:
                raise MalformedBundle(f"session_id must have 1 to {_MAX_SESSION_ID} characters")
            spec = shard.spec
            limits = codec.TensorLimits("f32", 2, spec.context_length, spec.d_model)
            x = codec.decode(frame.input, limits)
            self.mailbox.put((frame.session_id, frame.epoch, frame.step), x)
        except MeshnetError as e:
            return pb.RelayAck(failure=_fail(e))
        return pb.RelayAck()

    def Outputs(
        self, request: pb.OutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StepOutput]:
        if not request.session_id or len(request.session_id) > _MAX_SESSION_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad session_id")
        if request.end_step < request.first_step:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "end_step before first_step")
        sent = self.engine.sent(request.session_id, request.first_step, request.end_step)
        for step, x in sent.result(_CONTROL_TIMEOUT_S):
            yield pb.StepOutput(step=step, output=codec.encode(x))

    def Configure(
        self, request: pb.ConfigureRequest, context: grpc.ServicerContext
    ) -> pb.ConfigureResponse:
        if request.WhichOneof("kind") != "load":
            return pb.ConfigureResponse(applied=False, failure=_fail(MalformedBundle("no command")))
        load = request.load
        model_path = load.model_path or self.identity.model_path
        try:
            if not model_path:
                raise MalformedBundle("no model path given and none configured at start")
            model_path = self.identity.model_dirs.resolve(model_path)
            layers = LayerRange(load.layer_start, load.layer_end)
            shard = self.engine.load(model_path, layers).result(timeout=300)
        except MeshnetError as e:
            return pb.ConfigureResponse(applied=False, failure=_fail(e))
        return pb.ConfigureResponse(
            applied=True,
            layer_start=shard.layers.start,
            layer_end=shard.layers.end,
            fingerprint=shard.fingerprint,
        )

    def Fence(self, request: pb.FenceRequest, context: grpc.ServicerContext) -> pb.FenceResponse:
        if request.session_id and len(request.session_id) <= _MAX_SESSION_ID:
            self.engine.fence(request.session_id, request.epoch).result(_CONTROL_TIMEOUT_S)
        return pb.FenceResponse()

    def Release(
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseResponse:
        if not request.session_id or len(request.session_id) > _MAX_SESSION_ID:
            return pb.ReleaseResponse(released=False)
        freed = self.engine.release(request.session_id, request.epoch).result(_CONTROL_TIMEOUT_S)
        return pb.ReleaseResponse(released=freed)

    def Park(self, request: pb.ParkRequest, context: grpc.ServicerContext) -> pb.ParkResponse:
        try:
            if not request.session_id or len(request.session_id) > _MAX_SESSION_ID:
                raise MalformedBundle(f"session_id must have 1 to {_MAX_SESSION_ID} characters")
            epoch = request.epoch or None
            tokens = self.engine.park(request.session_id, epoch).result(_CONTROL_TIMEOUT_S)
        except MeshnetError as e:
            return pb.ParkResponse(parked=False, failure=_fail(e))
        return pb.ParkResponse(parked=True, tokens=tokens)

    def StateGet(
        self, request: pb.StateGetRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KVFrame]:
        self._pull_allowed("StateGet", request, context)
        header, kv = self._export(request, context)
        yield from export_frames(header, kv.payload)

    def StateOffer(
        self, request: pb.StateGetRequest, context: grpc.ServicerContext
    ) -> pb.StateOfferResponse:
        """Copy a session's KV for one fetch over the bulk TCP port (node-to-node moves)."""
        if self.offers is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node has no bulk port")
        assert self.offers is not None
        self._pull_allowed("StateOffer", request, context)
        header, kv = self._export(request, context)
        ticket = self.offers.offer(header, kv.payload)
        return pb.StateOfferResponse(address=self.offers.address, ticket=ticket, tokens=kv.tokens)

    def _pull_allowed(
        self, method: str, request: pb.StateGetRequest, context: grpc.ServicerContext
    ) -> None:
        """The tracker may export any session; a peer only the one its token names."""
        try:
            caller = self.gate.caller(SERVICE + method, context)
            require_peer(caller, "pull", request.session_id)
        except PermissionDenied as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, e.message)
        except MeshnetError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, e.message)

    def _export(
        self, request: pb.StateGetRequest, context: grpc.ServicerContext
    ) -> tuple[pb.KVHeader, ExportedKV]:
        shard = self.engine.shard
        if shard is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node is empty")
        assert shard is not None
        try:
            kv = self.engine.export_kv(request.session_id).result(_CONTROL_TIMEOUT_S)
        except MeshnetError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        shape = kv_shape(shard)
        header = pb.KVHeader(
            fingerprint=shape.fingerprint,
            layer_start=shape.layer_start,
            layer_end=shape.layer_end,
            session_id=request.session_id,
            epoch=kv.epoch,
            tokens=kv.tokens,
            steps=kv.steps,
            token_prefix_hash=request.token_prefix_hash,
            dtype=shape.dtype,
            n_kv_heads=shape.n_kv_heads,
            head_dim=shape.head_dim,
        )
        return header, kv

    def StatePull(
        self, request: pb.StatePullRequest, context: grpc.ServicerContext
    ) -> pb.StatePutResponse:
        """Fetch a session's KV straight from another node and import it (node to node)."""
        if not request.source or len(request.source) > _MAX_ADDRESS:
            return _put_failed(KVImportFailed("no source address", "invalid"))
        if not request.source_token:
            return _put_failed(KVImportFailed("no token for the source", "invalid"))
        token = ((METADATA_KEY, request.source_token),)
        left = _remaining_s(0, context)
        limit = min(left, _TRANSFER_TIMEOUT_S) if left is not None else _TRANSFER_TIMEOUT_S
        get = pb.StateGetRequest(
            session_id=request.session_id, token_prefix_hash=request.token_prefix_hash
        )
        prefix = request.token_prefix_hash or None
        with grpc.insecure_channel(request.source, options=MESSAGE_OPTIONS) as channel:
            stub = pb_grpc.NodeStub(channel)
            try:
                offer = stub.StateOffer(get, timeout=limit, metadata=token)
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else None
                if code == grpc.StatusCode.NOT_FOUND:
                    return _put_failed(KVImportFailed(str(e.details()), "source-missing"))
                if code != grpc.StatusCode.UNIMPLEMENTED:
                    return _put_failed(KVImportFailed(f"the source failed: {e}", "source-missing"))
            else:
                return self._import(_fetcher(offer), limit, context, prefix, "tcp")
            # A source without a bulk port streams the frames over gRPC.
            frames = stub.StateGet(get, timeout=limit, metadata=token)
            try:
                return self._import(_reader(frames), limit, context, prefix, "grpc")
            finally:
                frames.cancel()

    def StatePut(
        self, request_iterator: Iterator[pb.KVFrame], context: grpc.ServicerContext
    ) -> pb.StatePutResponse:
        """Import a KV stream of the token prefix the tracker vouches for (its hash in the
        call's metadata); on any failure the session is left holding nothing."""
        prefix = dict(context.invocation_metadata() or ()).get(PREFIX_KEY)
        if not prefix or len(prefix) > _MAX_PREFIX_HASH:
            return _put_failed(KVImportFailed("no vouched token prefix hash", "invalid"))
        left = _remaining_s(0, context)
        limit = min(left, _TRANSFER_TIMEOUT_S) if left is not None else _TRANSFER_TIMEOUT_S
        return self._import(_reader(request_iterator), limit, context, str(prefix), "grpc")

    def _import(
        self,
        read: _Read,
        limit: float,
        context: grpc.ServicerContext,
        prefix_hash: str | None,
        transport: str,
    ) -> pb.StatePutResponse:
        shard = self.engine.shard
        if shard is None:
            return _put_failed(KVImportFailed("this node is empty", "wrong-layers"))
        if not self._imports.acquire(blocking=False):
            return _put_failed(KVImportFailed(f"{MAX_IMPORTS} imports are running", "busy"))
        try:
            return self._import_now(read, limit, context, prefix_hash, transport, shard)
        finally:
            self._imports.release()

    def _import_now(
        self,
        read: _Read,
        limit: float,
        context: grpc.ServicerContext,
        prefix_hash: str | None,
        transport: str,
        shard: Shard,
    ) -> pb.StatePutResponse:
        deadline = time.monotonic() + limit
        # One deadline for the whole transfer: a stalled or trickling peer is cut off.
        timer = threading.Timer(limit, context.cancel)
        timer.start()
        shape = kv_shape(shard)
        seen: list[pb.KVHeader] = []

        def check(h: pb.KVHeader) -> None:
            if not h.session_id or len(h.session_id) > _MAX_SESSION_ID:
                raise KVImportFailed("bad session id", "invalid")
            seen.append(h)
            check_header(h, shape, prefix_hash)

        try:
            header, payload = read(check, deadline)
            held = self.engine.import_kv(
                header.session_id, header.epoch, header.steps, header.tokens, payload
            ).result(_CONTROL_TIMEOUT_S)
        except MeshnetError as e:
            if seen:
                self.engine.quarantine(seen[0].session_id).result(_CONTROL_TIMEOUT_S)
            return _put_failed(e)
        finally:
            timer.cancel()
        return pb.StatePutResponse(imported=True, tokens=held.kv_tokens, transport=transport)

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


class _Once:
    """Calls ``fn`` the first time it is called, from any thread; later calls do nothing."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._fn()


def _history(step: pb.Step, context_length: int, vocab_size: int) -> list[int]:
    """The ids a repetition penalty looks at, checked: at most a context, all in the vocabulary."""
    ids = list(step.history)
    if len(ids) > context_length:
        raise MalformedBundle(f"a history of {len(ids)} ids is longer than the context")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise MalformedBundle(f"history ids must be in [0, {vocab_size})")
    return ids


def _remaining_s(timeout_ms: int, context: grpc.ServicerContext) -> float | None:
    """Seconds left for a step: its own budget or the call's deadline, whichever is sooner.

    gRPC reports a call without a deadline as an astronomically large remaining
    time; anything past ``_NO_DEADLINE_S`` counts as no deadline at all.
    """
    limits = [timeout_ms / 1000.0] if timeout_ms else []
    left = context.time_remaining()
    if left is not None and left < _NO_DEADLINE_S:
        limits.append(max(left, 0.0))
    return min(limits) if limits else None


def kv_shape(shard: Shard) -> KVShape:
    kv = shard.backend.new_kv()
    return KVShape(
        fingerprint=shard.fingerprint,
        layer_start=shard.layers.start,
        layer_end=shard.layers.end,
        n_kv_heads=kv.n_kv_heads,
        head_dim=kv.head_dim,
        dtype=kv.dtype.name,
        itemsize=kv.dtype.itemsize,
        max_tokens=shard.spec.context_length,
    )


_Check = Callable[[pb.KVHeader], None]
_Read = Callable[[_Check, float], tuple[pb.KVHeader, bytearray]]


def _reader(frames: Iterator[pb.KVFrame]) -> _Read:
    """Reads a stream of gRPC frames."""
    return lambda check, deadline: read_stream(_frames(frames), check, deadline)


def _fetcher(offer: pb.StateOfferResponse) -> _Read:
    """Fetches an offered stream from the source's bulk port."""

    def read(check: _Check, deadline: float) -> tuple[pb.KVHeader, bytearray]:
        host, _, port = offer.address.rpartition(":")
        try:
            conn = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S)
        except (OSError, ValueError) as e:
            message = f"cannot reach the source's bulk port: {e}"
            raise KVImportFailed(message, "source-missing") from None
        with conn:
            conn.sendall(offer.ticket)
            return recv_stream(conn, check, deadline)

    return read


def _frames(frames: Iterator[pb.KVFrame]) -> Iterator[pb.KVFrame]:
    """The peer's frames; a call cut off (deadline, hang-up) reads as a deadline failure."""
    try:
        yield from frames
    except grpc.RpcError as e:  # a source node's answer (StatePull)
        if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.NOT_FOUND:
            message = f"the source has no such KV: {e.details()}"
            raise KVImportFailed(message, "source-missing") from None
        raise KVImportFailed(f"the transfer was cut off: {e}", "deadline") from None
    except Exception as e:  # grpc raises its own types when the call ends under us
        raise KVImportFailed(f"the transfer was cut off: {e}", "deadline") from None


def _put_failed(e: MeshnetError) -> pb.StatePutResponse:
    log.info("KV import failed: %s", e)
    reason = e.reason if isinstance(e, KVImportFailed) else e.kind
    return pb.StatePutResponse(imported=False, failure=_fail(e), reason=reason)


def _fail(e: MeshnetError) -> pb.Failure:
    return pb.Failure(kind=e.kind, message=e.message, retryable=e.retryable)


def _failure(e: MeshnetError, blame: str = "") -> pb.ForwardResponse:
    """A failed step's answer; ``blame``: the next hop, when the failure was reaching it."""
    log.info("step failed: %s", e)
    failure = _fail(e)
    failure.node_id = blame
    return pb.ForwardResponse(failure=failure)
