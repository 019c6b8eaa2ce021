"""A node's KV export and import: the session state the tracker moves between nodes.

``StateGet`` streams a session's KV as hashed frames, ``StateOffer`` files it
for one fetch over the bulk TCP port, ``StatePull`` fetches it straight from
another node, ``StatePut`` imports a stream. The tracker may export any
session; a peer only the one its pull token names. An import takes the token
prefix the tracker vouches for, is checked header first and chunk by chunk,
runs under one deadline sized to its bytes once the header says how many
(``TransferPace``: a base plus the bytes over a minimum rate, so a trickling
peer is cut whatever the size), and on any failure leaves the session
holding nothing; at most ``MAX_IMPORTS`` run at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from meshnet.auth.grpc_auth import NodeGate
from meshnet.auth.mesh_keys import SERVICE
from meshnet.auth.signing import METADATA_KEY, PREFIX_KEY, require_peer
from meshnet.backends.shard import Shard
from meshnet.errors import KVImportFailed, MeshnetError, PermissionDenied
from meshnet.kv.bulk import recv_stream
from meshnet.kv.pace import TransferPace
from meshnet.kv.transfer import KVShape, check_header, export_frames, read_stream
from meshnet.node.engine import NodeEngine
from meshnet.node.engine_types import ExportedKV
from meshnet.node.kv_offers import KVOffers
from meshnet.node.wire import CONTROL_TIMEOUT_S, MAX_SESSION_ID, fail, remaining_s
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS
from meshnet.protocol.keepalive import CLIENT_OPTIONS

log = logging.getLogger(__name__)

_MAX_ADDRESS = 256
_MAX_PREFIX_HASH = 128
_CONNECT_TIMEOUT_S = 5.0
MAX_IMPORTS = 4  # KV imports at once; one more is refused (reason "busy") before it reads


class KVService:
    """The KV transfer calls of one node's ``NodeEngine``."""

    def __init__(
        self,
        engine: NodeEngine,
        gate: NodeGate,
        offers: KVOffers | None,
        pace: TransferPace | None = None,
    ) -> None:
        self.engine = engine
        self.gate = gate
        self.offers = offers  # the bulk TCP port, when this node runs one
        self.pace = pace or TransferPace()  # how long an import may take, by its size
        self._imports = threading.BoundedSemaphore(MAX_IMPORTS)

    def get(
        self, request: pb.StateGetRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KVFrame]:
        self._pull_allowed("StateGet", request, context)
        header, kv = self._export(request, context)
        yield from export_frames(header, kv.payload)

    def offer(
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
            kv = self.engine.sessions.export_kv(request.session_id).result(CONTROL_TIMEOUT_S)
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

    def pull(
        self, request: pb.StatePullRequest, context: grpc.ServicerContext
    ) -> pb.StatePutResponse:
        """Fetch a session's KV straight from another node and import it (node to node)."""
        if not request.source or len(request.source) > _MAX_ADDRESS:
            return _put_failed(KVImportFailed("no source address", "invalid"))
        if not request.source_token:
            return _put_failed(KVImportFailed("no token for the source", "invalid"))
        if not request.token_prefix_hash or len(request.token_prefix_hash) > _MAX_PREFIX_HASH:
            return _put_failed(KVImportFailed("no vouched token prefix hash", "invalid"))
        token = ((METADATA_KEY, request.source_token),)
        limit = _caller_limit(context)
        get = pb.StateGetRequest(
            session_id=request.session_id, token_prefix_hash=request.token_prefix_hash
        )
        prefix = request.token_prefix_hash
        options = [*MESSAGE_OPTIONS, *CLIENT_OPTIONS]
        with grpc.insecure_channel(request.source, options=options) as channel:
            stub = pb_grpc.NodeStub(channel)
            try:
                offer = stub.StateOffer(get, timeout=self.pace.base_s, metadata=token)
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

                def cancel() -> None:
                    frames.cancel()
                    context.cancel()

                return self._import(_reader(frames), limit, context, prefix, "grpc", cancel)
            finally:
                frames.cancel()

    def put(
        self, request_iterator: Iterator[pb.KVFrame], context: grpc.ServicerContext
    ) -> pb.StatePutResponse:
        """Import a KV stream of the token prefix the tracker vouches for (its hash in the
        call's metadata); on any failure the session is left holding nothing."""
        prefix = dict(context.invocation_metadata() or ()).get(PREFIX_KEY)
        if not prefix or len(prefix) > _MAX_PREFIX_HASH:
            return _put_failed(KVImportFailed("no vouched token prefix hash", "invalid"))
        read = _reader(request_iterator)
        return self._import(read, _caller_limit(context), context, str(prefix), "grpc")

    def _import(
        self,
        read: _Read,
        limit: float | None,
        context: grpc.ServicerContext,
        prefix_hash: str | None,
        transport: str,
        cancel: Callable[[], Any] | None = None,
    ) -> pb.StatePutResponse:
        shard = self.engine.shard
        if shard is None:
            return _put_failed(KVImportFailed("this node is empty", "wrong-layers"))
        if not self._imports.acquire(blocking=False):
            return _put_failed(KVImportFailed(f"{MAX_IMPORTS} imports are running", "busy"))
        try:
            cutoff = Cutoff(self.pace, limit, cancel or context.cancel)
            try:
                return self._import_now(read, cutoff, prefix_hash, transport, shard)
            finally:
                cutoff.stop()
        finally:
            self._imports.release()

    def _import_now(
        self,
        read: _Read,
        cutoff: Cutoff,
        prefix_hash: str | None,
        transport: str,
        shard: Shard,
    ) -> pb.StatePutResponse:
        # One deadline for the whole transfer, sized once the header is read: a stalled
        # or trickling peer is cut off.
        shape = kv_shape(shard)
        seen: list[pb.KVHeader] = []

        def check(h: pb.KVHeader) -> float:
            if not h.session_id or len(h.session_id) > MAX_SESSION_ID:
                raise KVImportFailed("bad session id", "invalid")
            seen.append(h)
            check_header(h, shape, prefix_hash)
            return cutoff.sized(h.total_bytes)

        try:
            header, payload = read(check, cutoff.at)
            cutoff.stop()  # all read: loading it is the engine's
            held = self.engine.sessions.import_kv(
                header.session_id, header.epoch, header.steps, header.tokens, payload
            ).result(CONTROL_TIMEOUT_S)
        except MeshnetError as e:
            if seen:
                self.engine.sessions.quarantine(seen[0].session_id).result(CONTROL_TIMEOUT_S)
            return _put_failed(e)
        return pb.StatePutResponse(imported=True, tokens=held.kv_tokens, transport=transport)


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
        windows=kv.windows,
    )


class Cutoff:
    """One transfer's deadline (monotonic): ``base_s`` until the header says its size,
    then ``pace.limit_s(size)`` from the start, never past ``cap_s`` (the caller's own
    deadline). When it passes, ``cancel`` is called: a read blocked on a silent peer
    returns at once."""

    def __init__(self, pace: TransferPace, cap_s: float | None, cancel: Callable[[], Any]) -> None:
        self.pace = pace
        self.started = time.monotonic()
        self.cap_s = cap_s
        self._cancel = cancel
        self._timer: threading.Timer | None = None
        self.at = self._arm(pace.base_s)

    def sized(self, nbytes: int) -> float:
        """The deadline for a stream of ``nbytes``, from now on."""
        self.stop()
        self.at = self._arm(self.pace.limit_s(nbytes))
        return self.at

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self, limit_s: float) -> float:
        if self.cap_s is not None:
            limit_s = min(limit_s, self.cap_s)
        at = self.started + limit_s
        self._timer = threading.Timer(max(0.0, at - time.monotonic()), self._cancel)
        self._timer.daemon = True
        self._timer.start()
        return at


def _caller_limit(context: grpc.ServicerContext) -> float | None:
    """Seconds the caller's own deadline leaves, if it set one."""
    return remaining_s(0, context)


_Check = Callable[[pb.KVHeader], float]
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
    return pb.StatePutResponse(imported=False, failure=fail(e), reason=reason)
