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
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial

import grpc
import numpy as np

from meshnet.auth.grpc_auth import NodeGate
from meshnet.auth.mesh_keys import SERVICE
from meshnet.auth.signing import METADATA_KEY
from meshnet.backends.fast import FastBackend
from meshnet.errors import (
    DeadlineExceeded,
    MalformedBundle,
    MeshnetError,
    Overloaded,
    RequestError,
    ShardMismatch,
)
from meshnet.kv.pace import TransferPace
from meshnet.model.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from meshnet.model.sampling import Sampler, SamplingParams
from meshnet.model.shard import Shard
from meshnet.node.autorun import Inbox, Posted, Run, next_step
from meshnet.node.configure import Configurator, StreamLimit
from meshnet.node.engine import EngineStats, NodeEngine, OpenedSlot
from meshnet.node.grammar import GrammarTokenizers
from meshnet.node.head_assist import HeadAssist, HeadAssists
from meshnet.node.kv_offers import KVOffers
from meshnet.node.kv_service import KVService
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.model_fetch import NodeModels
from meshnet.node.parking import ParkPhase
from meshnet.node.prefixes import PrefixAsk
from meshnet.node.relay import Mailbox, RelaySender
from meshnet.node.relay_wire import Ask
from meshnet.node.scheduler import StepWork
from meshnet.node.step_input import (
    array_input,
    logit_bias,
    rows_checked,
    step_history,
    tensor_input,
)
from meshnet.node.wire import CONTROL_TIMEOUT_S, MAX_SESSION_ID, fail, remaining_s
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_POLL_S = 1.0  # an autorun's handler looks whether its call is still on at least this often
_NO_STEP_LIMIT_S = 3600.0

_RELAY_TIMEOUT_S = 10.0  # the next hop only files the input: more means it is stuck
_MAX_RELAY_STREAMS = 8  # previous hops relaying to this node at once (a thread each)
_RELAYS_PER_STREAM = 4  # relayed inputs waiting per stream the node holds
_MAILBOX_BYTES = 256 << 20
_NO_ROWS = np.empty(0, dtype=np.int64)  # the input of a step made before its input came
_NO_ROWS.flags.writeable = False


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    model_path: str | None  # the model loaded at start, if any
    model_dirs: ModelDirs  # where Configure may load models from
    models: NodeModels | None = None  # fetches models given by reference (None: refused)


@dataclass(frozen=True)
class Prepared:
    """A step ready for the engine, and what its answer needs."""

    work: StepWork
    t0: float  # perf_counter when the step came
    deadline: float | None  # monotonic
    history: list[int]  # what a repetition penalty looks at


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
        self._rings = _Tally()  # ring runs under way on this hop
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
        self.mailbox.opened(sid, epoch)
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

    def _autorun(
        self,
        o: pb.Open,
        sampling: SamplingParams | None,
        step: pb.Step,
        inbox: Inbox,
        context: grpc.ServicerContext,
    ) -> Generator[pb.ForwardResponse, None, pb.Step | None]:
        """Run ``step`` and the steps after it by themselves (node/autorun.py) until
        ``autorun_until`` (moved by ``Extend``s) or a failure; the step the run would go
        on with, or None when it cannot. A hop of every layer feeds itself each token; a
        hop of a ring starts each step when its input is relayed and hands its output
        (the last hop: the token) to the next."""
        shard = self.engine.shard
        assert shard is not None  # the stream's open checked it
        whole = sampling is not None and shard.is_first
        try:
            _check_autorun(o, sampling, shard, step, whole)
        except MeshnetError as e:
            yield _failure(e)
            return None
        run = Run(step.autorun_until, self.engine.after_batch)

        def launch(step: pb.Step) -> None:
            """Start ``step`` now, or (relayed) the moment its input comes, its work made
            now: only the input is left to the thread that files it."""
            if not step.relayed:
                start(step, None)
                return
            try:
                early = _early_work(o, step, shard)
            except MeshnetError as e:
                run.post(step, _failure(e))
                return
            key = (o.session_id, o.epoch, step.step)
            self.mailbox.when(key, lambda x: start(step, x, early))

        def start(step: pb.Step, x: np.ndarray | None, early: Early | None = None) -> None:
            if not run.proceeds(step.step):
                return  # the stream ended while the input was on its way
            handed = _Handed()
            try:
                if early is None:
                    ready = self._prepare(o, step, shard, context, x)
                else:
                    assert x is not None  # a relayed step is started with its input
                    ready = _completed(step, early, x, context)
                if not whole:  # a ring's hop passes its output on before the bookkeeping
                    ready.work.on_output = lambda out: hand_over(step, ready, handed, out)
                if not whole and sampling is not None and self.assists is not None:
                    ready.work.head_split = self._head_split(o)
                then = partial(landed, step, ready, handed)
                if early is not None and self._rings.count == 1:
                    # a lone stream's relayed step starts on this thread when the loop
                    # idles; several streams' wait for the loop, to meet in its batches
                    self.engine.run_here(ready.work, then)
                    return
                future = self.engine.submit(ready.work)
            except MeshnetError as e:
                run.post(step, _failure(e))
                return
            future.add_done_callback(then)

        def hand_over(step: pb.Step, ready: Prepared, handed: _Handed, out: np.ndarray) -> None:
            """On the loop, as the step's forward ends: relay the output (the
            last hop: sample, and relay the token) to the next hop at once."""
            if sampling is not None:
                handed.token = Sampler(sampling, step.draws).sample(
                    out[-1], ready.history, generated_from=step.generated_from
                )
                out = np.asarray([handed.token], dtype=np.int64)
            relay(step, out)
            handed.relayed = True

        def landed(
            step: pb.Step, ready: Prepared, handed: _Handed, done: Future[np.ndarray]
        ) -> None:
            """On the loop, as the step is committed: pass the output on unless
            ``hand_over`` did, answer, launch the next step."""
            token: int | None = None
            try:
                out = done.result()
                if sampling is not None:
                    reply: pb.ForwardResponse | None = self._answer(
                        o, sampling, step, ready, out, handed.token
                    )
                    assert reply is not None
                    token = reply.result.sampled.token
                    if not (whole or handed.relayed):  # the token is the first hop's input
                        relay(step, np.asarray([token], dtype=np.int64))
                else:  # a ring's forwarding hop answers only a failure, and its commitments
                    if not handed.relayed:
                        relay(step, out)
                    reply = _committed(ready.work) if ready.work.chunks else None
            except MeshnetError as e:
                reply = _failure(e)
            except Exception as e:  # the engine failed the step with a bug's error
                reply = _failure(MeshnetError(f"step {step.step} failed: {e}"))
            if reply is not None:
                run.post(step, reply)
                if reply.WhichOneof("kind") not in ("result", "committed"):
                    return
            after = next_step(step, run.until, token, sampling)
            if run.proceeds(after.step):
                launch(after)
            else:
                run.post(after, None)

        def relay(step: pb.Step, out: np.ndarray) -> None:
            """Hand a step's output to the next hop as the input of its step (the token to
            the first hop is the next step's); a refusal or a broken link is posted."""
            number = step.step + (1 if sampling is not None else 0)
            key = (o.session_id, o.epoch, number)
            self.relay.relay(o.next_address, o.next_token, key, out, lambda e: refused(step, e))

        def refused(step: pb.Step, e: MeshnetError) -> None:
            run.post(step, _failure(e, blame=o.next_node_id))

        inbox.listener = run.extend  # an Extend reaches the run at once, whatever it waits on
        leave_ring = None if whole else self._rings.enter()
        if leave_ring is not None:  # over when its call is: this handler may be closed
            context.add_callback(leave_ring)  # only by a later garbage collection
        launch(step)
        try:
            while True:
                posted = self._next_post(run, step if whole else None, context)
                if posted is None:
                    yield _failure(DeadlineExceeded(f"autorun step {step.step} timed out"))
                    return None
                step, reply = posted
                if reply is None:  # the run's end: an extension may have come meanwhile
                    step.autorun_until = run.until
                    if not run.proceeds(step.step):
                        return step
                    launch(step)
                    continue
                yield reply
                if reply.WhichOneof("kind") not in ("result", "committed"):
                    return None
                for request in inbox.waiting():  # None: no more requests; the run goes on
                    if request is not None and request.WhichOneof("kind") == "extend":
                        run.extend(request.extend.until)
                    elif request is not None:
                        yield _failure(MalformedBundle("a running autorun takes only Extend"))
                        return None
        finally:
            if leave_ring is not None:
                leave_ring()
            inbox.listener = None
            run.stop()
            self.relay.forget(o.next_address, o.session_id, o.epoch)

    @staticmethod
    def _next_post(run: Run, step: pb.Step | None, context: grpc.ServicerContext) -> Posted | None:
        """The run's next post, within ``step``'s time (any time when None: a ring hop
        waits on its input as long as the stream lasts); None when it does not come."""
        left = remaining_s(step.timeout_ms, context) if step is not None else None
        deadline = time.monotonic() + (left if left is not None else _NO_STEP_LIMIT_S)
        while context.is_active():
            wait = min(deadline - time.monotonic(), _POLL_S)
            if wait <= 0:
                return None
            posted = run.next_post(wait)
            if posted is not None:
                return posted
        return None

    def _open(self, o: pb.Open) -> OpenedSlot:
        shard = self.engine.shard
        if not o.session_id or len(o.session_id) > MAX_SESSION_ID:
            raise MalformedBundle(f"session_id must have 1 to {MAX_SESSION_ID} characters")
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
        prefix = None
        if o.prefix_ids:
            if o.resume:
                raise MalformedBundle("a prompt's prefix opens a fresh session, not a resumed one")
            limit = shard.spec.context_length
            prefix = PrefixAsk.checked(np.asarray(o.prefix_ids), o.prefix_reuse, limit)
        opened = self.engine.open(o.session_id, o.epoch, o.resume, rewind, prefix)
        return opened.result(CONTROL_TIMEOUT_S)

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
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                min_p=p.min_p,
                logit_bias=logit_bias(p.logit_bias, shard.spec.vocab_size),
                constraint=self.grammars.constraint(p, shard),
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
        try:
            ready = self._prepare(o, step, shard, context)
            left = None if ready.deadline is None else max(ready.deadline - time.monotonic(), 0.001)
            out = self.engine.submit(ready.work).result(timeout=left)
        except TimeoutError:
            return _failure(DeadlineExceeded(f"step {step.step} did not finish in time"))
        except MeshnetError as e:
            return _failure(e)
        return self._answer(o, sampling, step, ready, out)

    def _prepare(
        self,
        o: pb.Open,
        step: pb.Step,
        shard: Shard,
        context: grpc.ServicerContext,
        relayed: np.ndarray | None = None,
    ) -> Prepared:
        """A step's work for the engine, its input checked: in the message, ``relayed``
        (handed over as it came), or taken from the mailbox."""
        t0 = time.perf_counter()
        remaining = remaining_s(step.timeout_ms, context)
        started = time.monotonic()
        if relayed is None:
            x = self._input(o, step, shard, remaining, context)
        else:
            x = rows_checked(step, relayed)
        deadline = started + remaining if remaining is not None else None
        history = step_history(step, shard.spec.context_length, shard.spec.vocab_size)
        work = StepWork(
            o.session_id,
            o.epoch,
            x,
            deadline,
            step=step.step,
            replay=step.replay,
            keep_output=step.forward,
        )
        return Prepared(work, t0, deadline, history)

    def _answer(
        self,
        o: pb.Open,
        sampling: SamplingParams | None,
        step: pb.Step,
        ready: Prepared,
        out: np.ndarray,
        token: int | None = None,
    ) -> pb.ForwardResponse:
        """What a computed step answers: forwarded, its hidden states, or its token
        (``token``: sampled already, from this output)."""
        commitments = _chunks(ready.work)
        if step.forward:
            return self._forward_output(o, step, out, ready, commitments)
        if sampling is None:
            ms = (time.perf_counter() - ready.t0) * 1000
            result = pb.StepResult(step=step.step, output=codec.encode(out), compute_ms=ms)
            result.commitments.extend(commitments)
            return pb.ForwardResponse(result=result)
        logits = out[-1]
        if token is None:
            token = Sampler(sampling, step.draws).sample(
                logits, ready.history, generated_from=step.generated_from
            )
        if o.sampling.logprobs:  # a log-softmax over the vocabulary: only when asked
            lp = token_logprobs(logits, token, o.sampling.top_logprobs)
            sampled = pb.Sampled(
                token=token,
                logprob=lp.logprob,
                top_ids=[i for i, _ in lp.top],
                top_logprobs=[v for _, v in lp.top],
            )
        else:
            sampled = pb.Sampled(token=token)
        ms = (time.perf_counter() - ready.t0) * 1000
        result = pb.StepResult(step=step.step, sampled=sampled, compute_ms=ms)
        result.commitments.extend(commitments)
        return pb.ForwardResponse(result=result)

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
            return tensor_input(shard, step.input)
        if not 0 < step.rows <= spec.context_length:
            raise MalformedBundle("a relayed step needs 1 to context rows")
        key = (o.session_id, o.epoch, step.step)
        return rows_checked(step, self.mailbox.take(key, timeout_s, context.is_active))

    def _forward_output(
        self,
        o: pb.Open,
        step: pb.Step,
        out: np.ndarray,
        ready: Prepared,
        commitments: list[pb.ChunkDigest],
    ) -> pb.ForwardResponse:
        """Send the output to the next hop; answer the driver without it."""
        t0, deadline = ready.t0, ready.deadline
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
        result = pb.StepResult(step=step.step, compute_ms=ms)
        result.commitments.extend(commitments)
        return pb.ForwardResponse(result=result)

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

    def _head_split(self, o: pb.Open) -> HeadAssist | None:
        """A lone ring's last hop asks its first for part of its head; several rings'
        steps meet in batches, whose head is multiplied here."""
        shard = self.engine.shard
        if self.assists is None or shard is None or self._rings.count != 1:
            return None
        return self.assists.for_hop(o.next_address, o.next_token, shard)

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


Early = tuple[StepWork, list[int]]  # a relayed ring step's work and history, made ahead


def _early_work(o: pb.Open, step: pb.Step, shard: Shard) -> Early:
    """A relayed ring step's work, made while its input is on its way (no rows yet)."""
    history = step_history(step, shard.spec.context_length, shard.spec.vocab_size)
    work = StepWork(
        o.session_id,
        o.epoch,
        _NO_ROWS,
        None,
        step=step.step,
        replay=step.replay,
        keep_output=step.forward,
    )
    return work, history


def _completed(
    step: pb.Step, early: Early, x: np.ndarray, context: grpc.ServicerContext
) -> Prepared:
    """``_early_work`` given its input as it came; its deadline counts from now, as a
    step's does from when it comes."""
    work, history = early
    t0 = time.perf_counter()
    remaining = remaining_s(step.timeout_ms, context)
    work.x = rows_checked(step, x)
    work.deadline = None if remaining is None else time.monotonic() + remaining
    return Prepared(work, t0, work.deadline, history)


@dataclass
class _Handed:
    """What a ring hop's step did as its forward ended (``on_output``), before it was
    committed: relayed its output, and (the last hop) sampled this token."""

    token: int | None = None
    relayed: bool = False


class _Tally:
    """How many of something are under way; thread-safe."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def enter(self) -> _Once:
        """Count one more in; calling what it returns (any thread, any times) counts it
        out once."""
        with self._lock:
            self.count += 1
        return _Once(self._leave)

    def _leave(self) -> None:
        with self._lock:
            self.count -= 1


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


def _check_autorun(
    o: pb.Open, sampling: SamplingParams | None, shard: Shard, step: pb.Step, whole: bool
) -> None:
    """Refuse a run this hop cannot make: a hop of every layer samples and feeds itself;
    a hop of a ring has a next hop, forwards (or samples), and only the first may be
    sent an input (the one its run starts with)."""
    if whole:
        if step.relayed:
            raise MalformedBundle("a hop of every layer feeds itself: nothing is relayed to it")
        return
    if not o.next_address:
        raise MalformedBundle("a ring's hop needs the next hop's address")
    if sampling is None and not step.forward:
        raise MalformedBundle("a ring's hop that does not sample forwards its output")
    if not (step.relayed or shard.is_first):
        raise MalformedBundle("only a ring's first hop is sent an input: the others are relayed")


def _chunks(work: StepWork) -> list[pb.ChunkDigest]:
    """The commitments of the chunks a step completed (protocol/commitments.py)."""
    return [
        pb.ChunkDigest(token_start=start, digest=d, input_digest=work.inputs.get(start, b""))
        for start, d in work.chunks
    ]


def _committed(work: StepWork) -> pb.ForwardResponse:
    """A ring's forwarding hop's answer for a step that completed chunks."""
    return pb.ForwardResponse(committed=pb.Committed(chunks=_chunks(work)))


def _failure(e: MeshnetError, blame: str = "") -> pb.ForwardResponse:
    """A failed step's answer; ``blame``: the next hop, when the failure was reaching it."""
    log.info("step failed: %s", e)
    failure = fail(e)
    failure.node_id = blame
    return pb.ForwardResponse(failure=failure)
