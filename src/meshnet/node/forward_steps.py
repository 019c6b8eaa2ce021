"""One step of a node's ``Forward`` stream: the open checked, the step's input read
(in the message or relayed), its work handed to the engine and its answer made
(hidden states, forwarded to the next hop, or a sampled token with its
commitments).

``ForwardSteps`` serves single steps for the stream (node/forward_stream.py);
the autorun (node/autorun_stream.py) prepares and answers its steps with it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from meshnet.backends.shard import Shard
from meshnet.errors import (
    DeadlineExceeded,
    MalformedBundle,
    MeshnetError,
    RequestError,
    ShardMismatch,
)
from meshnet.model.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from meshnet.model.sampling import Sampler, SamplingParams
from meshnet.node.engine_types import OpenedSlot
from meshnet.node.grammar import GrammarTokenizers
from meshnet.node.prefixes import PrefixAsk
from meshnet.node.relay import Mailbox, RelaySender
from meshnet.node.scheduler import StepWork
from meshnet.node.step_input import logit_bias, rows_checked, step_history, tensor_input
from meshnet.node.wire import CONTROL_TIMEOUT_S, MAX_SESSION_ID, fail, remaining_s
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb

log = logging.getLogger(__name__)

_RELAY_TIMEOUT_S = 10.0  # the next hop only files the input: more means it is stuck


@dataclass(frozen=True)
class Prepared:
    """A step ready for the engine, and what its answer needs."""

    work: StepWork
    t0: float  # perf_counter when the step came
    deadline: float | None  # monotonic
    history: list[int]  # what a repetition penalty looks at


class Opens(Protocol):
    """Opening a stream's session (node/engine_sessions.py)."""

    def open(
        self,
        session_id: str,
        epoch: int,
        resume: bool = False,
        rewind: tuple[int, int] | None = None,
        prefix: PrefixAsk | None = None,
    ) -> Future[OpenedSlot]: ...


class StepEngine(Protocol):
    """What single steps need of the node's engine (node/engine.py)."""

    @property
    def shard(self) -> Shard | None: ...

    @property
    def sessions(self) -> Opens: ...

    def submit(self, work: StepWork) -> Future[np.ndarray]: ...


class ForwardSteps:
    """Checks a stream's open and serves its steps one at a time on the engine."""

    def __init__(self, engine: StepEngine, mailbox: Mailbox, relay: RelaySender) -> None:
        self.engine = engine
        self.mailbox = mailbox  # inputs relayed by previous hops (filed by the service)
        self.relay = relay  # outputs to next hops
        self.grammars = GrammarTokenizers()  # for a constrained sampling hop

    def open(self, o: pb.Open) -> OpenedSlot:
        """Check an ``Open`` against the shard this node serves and open its session
        on the engine; raises the typed refusal."""
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
            ids = np.asarray(o.prefix_ids)
            prefix = PrefixAsk.checked(ids, o.prefix_reuse, limit, o.prefix_scope)
        elif o.prefix_scope:
            raise MalformedBundle("a prefix scope without a prompt's prefix")
        opened = self.engine.sessions.open(o.session_id, o.epoch, o.resume, rewind, prefix)
        return opened.result(CONTROL_TIMEOUT_S)

    def sampling(self, o: pb.Open) -> SamplingParams | None:
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

    def step(
        self,
        o: pb.Open,
        sampling: SamplingParams | None,
        request: pb.ForwardRequest,
        context: grpc.ServicerContext,
    ) -> pb.ForwardResponse:
        """Run one step on the engine and answer it; a failure is answered, not raised."""
        shard = self.engine.shard
        if request.WhichOneof("kind") != "step" or shard is None:
            return failure_reply(MalformedBundle("expected a Step"))
        step = request.step
        try:
            ready = self.prepare(o, step, shard, context)
            left = None if ready.deadline is None else max(ready.deadline - time.monotonic(), 0.001)
            out = self.engine.submit(ready.work).result(timeout=left)
        except TimeoutError:
            return failure_reply(DeadlineExceeded(f"step {step.step} did not finish in time"))
        except MeshnetError as e:
            return failure_reply(e)
        return self.answer(o, sampling, step, ready, out)

    def prepare(
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

    def answer(
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
        commitments = step_chunks(ready.work)
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
            return failure_reply(MalformedBundle("a forward step needs the next hop's address"))
        frame = pb.RelayFrame(
            session_id=o.session_id, epoch=o.epoch, step=step.step, input=codec.encode(out)
        )
        left = _RELAY_TIMEOUT_S
        if deadline is not None:
            left = min(left, max(deadline - time.monotonic(), 0.001))
        try:
            self.relay.send(o.next_address, o.next_token, frame, left)
        except MeshnetError as e:
            return failure_reply(e, blame=o.next_node_id)
        ms = (time.perf_counter() - t0) * 1000
        result = pb.StepResult(step=step.step, compute_ms=ms)
        result.commitments.extend(commitments)
        return pb.ForwardResponse(result=result)


def step_chunks(work: StepWork) -> list[pb.ChunkDigest]:
    """The commitments of the chunks a step completed (protocol/commitments.py)."""
    return [
        pb.ChunkDigest(token_start=start, digest=d, input_digest=work.inputs.get(start, b""))
        for start, d in work.chunks
    ]


def committed_reply(work: StepWork) -> pb.ForwardResponse:
    """A ring's forwarding hop's answer for a step that completed chunks."""
    return pb.ForwardResponse(committed=pb.Committed(chunks=step_chunks(work)))


def failure_reply(e: MeshnetError, blame: str = "") -> pb.ForwardResponse:
    """A failed step's answer; ``blame``: the next hop, when the failure was reaching it."""
    log.info("step failed: %s", e)
    failure = fail(e)
    failure.node_id = blame
    return pb.ForwardResponse(failure=failure)
