"""A node's ``Forward`` streams, each serving one (session, epoch) from its open to its end.

A stream is an ``Open`` first, then steps in order. When the ``Open`` carries
sampling parameters (the route's last hop), each step answers the token sampled
from its last row, with log-probabilities, instead of the logits. A node holds
at most ``max_streams`` of them (each takes a server thread for its life); one
more is answered ``overloaded`` at once, so control calls (probes, fences,
releases) always find a thread. A failed step answers a ``Failure`` and leaves
the stream (and the session's KV) usable; the KV is released when the stream
ends, however it ends, unless the open asked to ``keep`` it (a session between
turns), in which case it stays until a ``Release``, and can be ``Park``ed on
local disk meanwhile.

``ForwardStreams`` owns the streams' gate and the stream's course; a step is
``ForwardSteps``' (node/forward_steps.py), a run of them ``AutorunStreams``'
(node/autorun_stream.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Protocol

import grpc

from meshnet.backends.shard import Shard
from meshnet.errors import MalformedBundle, MeshnetError, Overloaded
from meshnet.model.sampling import SamplingParams
from meshnet.node.autorun import Inbox
from meshnet.node.autorun_stream import AutorunStreams
from meshnet.node.configure import StreamLimit
from meshnet.node.forward_steps import ForwardSteps, failure_reply
from meshnet.node.relay import Mailbox
from meshnet.node.tally import Once
from meshnet.node.wire import CONTROL_TIMEOUT_S
from meshnet.protocol import meshnet_pb2 as pb


class Releases(Protocol):
    """Releasing an ended stream's session (node/engine_sessions.py)."""

    def release(self, session_id: str, epoch: int) -> Future[bool]: ...


class StreamEngine(Protocol):
    """What a stream's course needs of the node's engine (node/engine.py)."""

    @property
    def shard(self) -> Shard | None: ...

    @property
    def sessions(self) -> Releases: ...


class ForwardStreams:
    """Serves ``Forward`` streams: admits each under the node's stream limit, opens it,
    answers its steps one at a time or autorun, and releases its KV at its end."""

    def __init__(
        self,
        node_id: str,
        engine: StreamEngine,
        max_streams: Callable[[], int],
        mailbox: Mailbox,
        steps: ForwardSteps,
        autorun: AutorunStreams,
    ) -> None:
        self.node_id = node_id  # named in each stream's ``Opened``
        self.engine = engine
        self.max_streams = max_streams
        # Sized by the engine's config as it is at each open (tier 1 moves it), never past
        # the count the server's threads were sized for at start.
        self.limit = StreamLimit(max_streams)
        self.mailbox = mailbox  # inputs relayed by previous hops (filed by the service)
        self.steps = steps
        self.autorun = autorun

    def serve(
        self, requests: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardResponse]:
        """One ``Forward`` call's answers; ``overloaded`` when the node holds its limit."""
        if not self.limit.acquire(blocking=False):
            limit = self.max_streams()
            yield failure_reply(Overloaded(f"this node holds its {limit} streams"))
            return
        free = Once(self.limit.release)
        context.add_callback(free)  # the call ended (also cancelled while the handler waits)
        try:
            yield from self._stream(requests, context)
        finally:
            free()

    def _stream(
        self, requests: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardResponse]:
        first = next(requests, None)
        if first is None or first.WhichOneof("kind") != "open":
            yield failure_reply(MalformedBundle("a Forward stream must start with Open"))
            return
        opened = first.open
        try:
            sampling = self.steps.sampling(opened)
            held = self.steps.open(opened)
        except MeshnetError as e:
            yield failure_reply(e)
            return
        # However the call ends (the driver cancels it, the connection drops), the
        # session's KV and queued steps go at once, not when this handler next wakes.
        sid, epoch = opened.session_id, opened.epoch
        self.mailbox.opened(sid, epoch)
        if not opened.keep:

            def release() -> None:
                self.engine.sessions.release(sid, epoch)  # queued on the engine's loop, not awaited

            context.add_callback(release)
        shard = self.engine.shard
        assert shard is not None  # the open checked it
        yield pb.ForwardResponse(
            opened=pb.Opened(
                node_id=self.node_id,
                layer_start=shard.layers.start,
                layer_end=shard.layers.end,
                kv_tokens=held.kv_tokens,
                steps=held.steps,
                unparked=held.unparked,
            )
        )
        try:
            yield from self._serve_steps(opened, sampling, requests, context)
        finally:
            self.mailbox.drop(sid, epoch)
            if not opened.keep:
                self.engine.sessions.release(sid, epoch).result(CONTROL_TIMEOUT_S)

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
                resume = yield from self.autorun.run(o, sampling, step, inbox, context)
            else:
                resume = None
                yield self.steps.step(o, sampling, request, context)
