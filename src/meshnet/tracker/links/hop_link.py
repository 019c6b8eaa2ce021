"""One hop of one generation's epoch: its ``Forward`` stream and what the node holds.

Every exchange runs under a deadline and ends in a result or a typed failure
naming the node: a timeout is ``deadline-exceeded``; a broken stream is
``stream-reset`` when the node still answers a probe on a fresh connection
and ``worker-death`` when it does not; an outside verdict (the tracker saw
the node's heartbeats stop, or the generation was cancelled) is set on the
link before its call is cancelled and is what the waiting step raises.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from meshnet.auth.mesh_keys import MeshKeys
from meshnet.errors import (
    Cancelled,
    DeadlineExceeded,
    MalformedBundle,
    MeshnetError,
    StreamReset,
    WorkerDeath,
    error_for_kind,
)
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.commitments import MAX_CHUNKS_PER_MESSAGE
from meshnet.tracker.links.commitments import checked_chunks, checked_inputs
from meshnet.tracker.nodes.routes import Hop

_PROBE_TIMEOUT_S = 1.0


class RelayBroken(StreamReset):
    """A node could not reach the next hop, which still answers the tracker: the two
    cannot talk (addresses only the tracker can reach, a firewall between them)."""

    def __init__(self, message: str, node_id: str, from_node: str) -> None:
        super().__init__(message, node_id)
        self.from_node = from_node


@dataclass
class HopLink:
    """A hop's stream in one epoch, and the session state the node holds for it."""

    hop: Hop
    call: grpc.aio.StreamStreamCall[pb.ForwardRequest, pb.ForwardResponse]
    epoch: int
    keys: MeshKeys  # to sign a probe of a node that broke
    steps: int = 0  # steps whose KV the node holds (the next step's number)
    positions: int = 0  # KV positions the node holds
    first_position: int = 0  # positions it held when this epoch's attempt began
    unparked: bool = False  # the node read the session's KV back from its disk to open it
    verdict: MeshnetError | None = None  # set from outside before the call is cancelled
    samples: bool = False  # opened to sample: it answers tokens, not hidden states
    next_node_id: str = ""  # the hop it forwards outputs to: it may blame a failure on it
    next_address: str = ""
    # A forwarding hop's answer to its last step, read while the next step runs.
    unread: asyncio.Task[pb.ForwardResponse] | None = None
    autorun_until: int = 0  # the step a one-hop route's node runs up to by itself
    # The node's commitments in this epoch: chunk start -> digest (protocol/commitments.py),
    # the newest for a chunk it computed again after a rewind.
    commitments: dict[int, bytes] = field(default_factory=dict)
    unclaimed: set[int] = field(default_factory=set)  # chunks not yet handed to the verifier
    inputs: dict[int, bytes] = field(default_factory=dict)  # what it says it was sent, by chunk

    @property
    def node_id(self) -> str:
        return self.hop.node_id

    def fail(self, verdict: MeshnetError) -> None:
        """End the link from outside: the step waiting on it raises ``verdict``."""
        if self.verdict is None:
            self.verdict = verdict
        self.call.cancel()

    def close(self) -> None:
        """End the stream; the node frees the session's KV of this epoch."""
        if self.verdict is None:  # a read still waiting on it ends without a probe
            self.verdict = Cancelled(f"the stream to {self.node_id} was closed")
        if self.unread is not None:  # nobody will read it now: its end is not news
            self.unread.add_done_callback(_retrieved)
        self.call.cancel()

    async def exchange(self, request: pb.ForwardRequest, timeout_s: float) -> pb.ForwardResponse:
        """Send one message and read its answer within ``timeout_s``."""
        reply = await self._io(request, timeout_s)
        assert reply is not None
        return reply

    async def receive(self, timeout_s: float) -> pb.ForwardResponse:
        """Read the next answer (an autorun's next step) within ``timeout_s``."""
        reply = await self._io(None, timeout_s)
        assert reply is not None
        return reply

    async def send(self, request: pb.ForwardRequest, timeout_s: float) -> None:
        """Send one message that has no answer of its own (an ``Extend``)."""
        await self._io(request, timeout_s, read=False)

    async def _io(
        self, request: pb.ForwardRequest | None, timeout_s: float, read: bool = True
    ) -> pb.ForwardResponse | None:
        node = self.node_id
        if self.verdict is not None:
            raise self.verdict
        try:
            async with asyncio.timeout(timeout_s):  # no extra task per read, unlike wait_for
                if request is not None:
                    await self.call.write(request)
                if not read:
                    return None
                reply = await self.call.read()
        except TimeoutError:
            raise DeadlineExceeded(
                f"node {node} did not answer in {timeout_s:.1f}s", node
            ) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task itself is being cancelled
            # The call was cancelled under us: by a verdict, or its channel was closed.
            raise self.verdict or await _broken(
                self.keys, self.hop, "the call was cancelled"
            ) from None
        except grpc.aio.AioRpcError as e:
            raise self.verdict or await _rpc_failure(self.keys, e, self.hop) from None
        except grpc.aio.UsageError as e:
            raise self.verdict or StreamReset(f"stream to {node} is unusable: {e}", node) from None
        except asyncio.InvalidStateError:  # the call ended (e.g. reset) before this write
            raise self.verdict or await _broken(self.keys, self.hop, "the call had ended") from None
        if not isinstance(reply, pb.ForwardResponse):  # grpc.aio.EOF
            raise self.verdict or await _broken(self.keys, self.hop, "closed the stream")
        kind = reply.WhichOneof("kind")
        if kind == "failure":
            f = reply.failure
            if f.node_id and f.node_id == self.next_node_id:
                raise await self._next_failed(f)
            raise error_for_kind(f.kind, f"node {node}: {f.message}", node)
        if kind == "result":
            self._note(reply.result.commitments)
        elif kind == "committed":
            self._note(reply.committed.chunks)
        return reply

    def _note(self, chunks: Sequence[pb.ChunkDigest]) -> None:
        """Keep the node's commitments, checked (a malformed one fails the link, and so do
        more chunks than a context holds: what a node sends must not grow without bound)."""
        if not chunks:  # most steps: a chunk is committed every CHUNK_TOKENS positions
            return
        try:
            new = checked_chunks(chunks)
            inputs = checked_inputs(chunks)
            added = sum(1 for start in new if start not in self.commitments)
            if len(self.commitments) + added > MAX_CHUNKS_PER_MESSAGE:
                raise MalformedBundle(f"more than {MAX_CHUNKS_PER_MESSAGE} chunks committed")
        except MalformedBundle as e:
            raise MalformedBundle(f"node {self.node_id}: {e.message}", self.node_id) from None
        self.commitments.update(new)
        self.unclaimed.update(new)
        for start in new:  # the newest word on a chunk: with its input digest or without
            self.inputs.pop(start, None)
        self.inputs.update(inputs)

    async def _next_failed(self, f: pb.Failure) -> MeshnetError:
        """The node could not hand its output to the next hop: that hop's failure, and
        when the connection broke, whether that hop is alive or gone."""
        message = f"node {self.node_id}: {f.message}"
        if f.kind != StreamReset.kind:
            return error_for_kind(f.kind, message, self.next_node_id)
        if await answers(self.keys, self.next_address, self.next_node_id):
            return RelayBroken(message, self.next_node_id, self.node_id)
        return WorkerDeath(message, self.next_node_id)


def _retrieved(task: asyncio.Task[pb.ForwardResponse]) -> None:
    if not task.cancelled():
        task.exception()


async def open_link(
    stub: pb_grpc.NodeAsyncStub,
    keys: MeshKeys,
    hop: Hop,
    open_msg: pb.Open,
    stream_timeout_s: float,
    open_timeout_s: float,
) -> tuple[HopLink, pb.Opened]:
    """Open a hop's stream for one epoch; the node's ``Opened`` says what KV it holds."""
    call = stub.Forward(timeout=stream_timeout_s, metadata=keys.call(hop.node_id, "Forward"))
    link = HopLink(
        hop,
        call,
        open_msg.epoch,
        keys,
        samples=open_msg.HasField("sampling"),
        next_node_id=open_msg.next_node_id,
        next_address=open_msg.next_address,
    )
    try:
        reply = await link.exchange(pb.ForwardRequest(open=open_msg), open_timeout_s)
    except BaseException:
        link.close()
        raise
    if reply.WhichOneof("kind") != "opened":
        link.close()
        raise MalformedBundle(f"node {hop.node_id} answered Open with {reply}", hop.node_id)
    return link, reply.opened


async def _rpc_failure(keys: MeshKeys, e: grpc.aio.AioRpcError, hop: Hop) -> MeshnetError:
    code = e.code()
    detail = f"{code.name} {e.details() or ''}".strip()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"node {hop.node_id}: {detail}", hop.node_id)
    return await _broken(keys, hop, detail)


async def _broken(keys: MeshKeys, hop: Hop, detail: str) -> MeshnetError:
    """A stream broke: the node is alive (``stream-reset``) or dead (``worker-death``)?"""
    if await answers(keys, hop.address, hop.node_id):
        return StreamReset(f"stream to node {hop.node_id} broke: {detail}", hop.node_id)
    return WorkerDeath(f"node {hop.node_id} is gone: {detail}", hop.node_id)


async def answers(
    keys: MeshKeys, address: str, node_id: str, timeout_s: float = _PROBE_TIMEOUT_S
) -> bool:
    """Whether the node answers a probe, on a fresh connection so that a dead one's
    reconnect backoff, or a busy shared channel, cannot mislead."""
    channel = grpc.aio.insecure_channel(address)
    try:
        info = await pb_grpc.NodeStub(channel).Info(
            pb.InfoRequest(), timeout=timeout_s, metadata=keys.call(node_id, "Info")
        )
        return bool(info.node_id == node_id)
    except grpc.aio.AioRpcError:
        return False
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
