"""The route session driver: runs one generation through a chain of nodes.

For every step it sends the input through each shard in turn over that
shard's ``Forward`` stream (token ids to the first, hidden states onward),
samples from the last shard's logits under the sampling contract, and yields
each token as it is made. It keeps, per shard, the inputs that shard was sent,
so a failed span can later be rebuilt by replaying them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from meshnet.engine.request import FinishReason, RequestState
from meshnet.errors import (
    DeadlineExceeded,
    MalformedBundle,
    MeshnetError,
    StreamReset,
    WorkerDeath,
    error_for_kind,
)
from meshnet.model.sampling import SamplingParams
from meshnet.model.spec import ModelSpec
from meshnet.model.tokenizer import TextTokenizer
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.channels import ChannelPool
from meshnet.tracker.routes import Hop, Route


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # text made final by this token (may be empty)


@dataclass(frozen=True)
class DoneEvent:
    ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int


@dataclass
class _HopStream:
    hop: Hop
    call: grpc.aio.StreamStreamCall  # type: ignore[type-arg]
    inputs: list[np.ndarray] = field(default_factory=list)  # replay log for failover


@dataclass(frozen=True)
class DriverLimits:
    step_timeout_s: float = 30.0  # one step through one shard
    open_timeout_s: float = 10.0
    generation_timeout_s: float = 600.0  # whole stream, as the gRPC deadline


class RouteDriver:
    """Drives generations; one instance per tracker, one ``run`` per generation."""

    def __init__(
        self,
        channels: ChannelPool,
        fingerprint: str,
        spec: ModelSpec,
        tokenizer: TextTokenizer,
        limits: DriverLimits = DriverLimits(),
    ) -> None:
        self.channels = channels
        self.fingerprint = fingerprint
        self.spec = spec
        self.tokenizer = tokenizer
        self.limits = limits

    async def open(self, route: Route, epoch: int = 1) -> list[_HopStream]:
        """Open a Forward stream on every hop; raise the first hop's failure."""
        session_id = uuid.uuid4().hex
        streams: list[_HopStream] = []
        try:
            for hop in route:
                streams.append(await self._open_hop(hop, session_id, epoch))
        except BaseException:
            await close(streams)
            raise
        return streams

    async def run(
        self, streams: Sequence[_HopStream], prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        """Generate through opened streams; closes them when done or abandoned."""
        state = RequestState(prompt_ids, params, self.tokenizer)
        try:
            x = np.asarray(prompt_ids, dtype=np.int64)
            step = 0
            while True:
                logits = await self._step(streams, step, x)
                text = state.take(logits[0])
                yield TokenEvent(state.ids[-1], text)
                if state.done:
                    break
                x = np.asarray([state.ids[-1]], dtype=np.int64)
                step += 1
            yield DoneEvent(state.ids, state.text, state.finish or "length", len(prompt_ids))
        finally:
            await close(streams)

    async def _open_hop(self, hop: Hop, session_id: str, epoch: int) -> _HopStream:
        stub = self.channels.stub(hop.address)
        call = stub.Forward(timeout=self.limits.generation_timeout_s)
        stream = _HopStream(hop, call)
        opened = pb.Open(
            session_id=session_id,
            epoch=epoch,
            fingerprint=self.fingerprint,
            layer_start=hop.layers.start,
            layer_end=hop.layers.end,
        )
        reply = await self._exchange(
            stream, pb.ForwardRequest(open=opened), self.limits.open_timeout_s
        )
        if reply.WhichOneof("kind") != "opened":
            raise MalformedBundle(f"node {hop.node_id} answered Open with {reply}", hop.node_id)
        return stream

    async def _step(self, streams: Sequence[_HopStream], step: int, x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        last = len(streams) - 1
        for i, stream in enumerate(streams):
            node = stream.hop.node_id
            stream.inputs.append(x)
            budget = self.limits.step_timeout_s
            request = pb.ForwardRequest(
                step=pb.Step(step=step, input=codec.encode(x), timeout_ms=int(budget * 1000))
            )
            reply = await self._exchange(stream, request, budget)
            if reply.WhichOneof("kind") != "result":
                raise MalformedBundle(f"node {node} sent no result", node)
            try:
                x = codec.decode(reply.result.output, self._output_limits(i == last))
            except MalformedBundle as e:
                raise MalformedBundle(f"node {node} sent a bad tensor: {e.message}", node) from None
            if i != last and x.shape[0] != rows:
                raise MalformedBundle(f"node {node} returned {x.shape[0]} rows", node)
        return x

    def _output_limits(self, last: bool) -> codec.TensorLimits:
        """Logits of the last row from the last hop; hidden states of every row otherwise."""
        s = self.spec
        if last:
            return codec.TensorLimits("f32", 2, 1, s.vocab_size)
        return codec.TensorLimits("f32", 2, s.context_length, s.d_model)

    async def _exchange(
        self, stream: _HopStream, request: pb.ForwardRequest, timeout_s: float
    ) -> pb.ForwardResponse:
        node = stream.hop.node_id
        try:
            async with asyncio.timeout(timeout_s):  # no extra task per read, unlike wait_for
                await stream.call.write(request)
                reply = await stream.call.read()
        except TimeoutError:
            msg = f"node {node} did not answer in {timeout_s:.1f}s"
            raise DeadlineExceeded(msg, node) from None
        except grpc.aio.AioRpcError as e:
            raise _rpc_failure(e, node) from None
        except grpc.aio.UsageError as e:
            raise StreamReset(f"stream to node {node} is unusable: {e}", node) from None
        if reply is grpc.aio.EOF:
            raise StreamReset(f"node {node} closed the stream", node)
        if reply.WhichOneof("kind") == "failure":
            raise error_for_kind(reply.failure.kind, f"node {node}: {reply.failure.message}", node)
        return reply


async def close(streams: Sequence[_HopStream]) -> None:
    """End every hop's stream; the nodes free the session's KV when it ends."""
    for s in streams:
        s.call.cancel()


def _rpc_failure(e: grpc.aio.AioRpcError, node: str) -> MeshnetError:
    code = e.code()
    detail = f"node {node}: {code.name} {e.details() or ''}".strip()
    if code == grpc.StatusCode.UNAVAILABLE:
        return WorkerDeath(detail, node)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(detail, node)
    return StreamReset(detail, node)
