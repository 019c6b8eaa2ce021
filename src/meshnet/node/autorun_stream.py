"""A node's autorun: the steps of a ``Forward`` stream run one after another by
themselves (node/autorun.py), each answer posted as it comes.

A hop of every layer feeds itself each sampled token; a hop of a ring starts
each step when its input is relayed and hands its output (the last hop: the
token) straight to the next hop. ``AutorunStreams`` prepares and answers each
step with the stream's ``ForwardSteps`` (node/forward_steps.py), and counts the
ring runs under way on this hop: a lone ring's steps start on the thread their
input comes on, and only a lone ring's last hop asks for head parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import grpc
import numpy as np

from meshnet.backends.shard import Shard
from meshnet.errors import DeadlineExceeded, MalformedBundle, MeshnetError
from meshnet.model.sampling import Sampler, SamplingParams
from meshnet.node.autorun import Inbox, Posted, Run, next_step
from meshnet.node.forward_steps import ForwardSteps, Prepared, committed_reply, failure_reply
from meshnet.node.head_assist import HeadAssist, HeadAssists
from meshnet.node.relay import Mailbox, RelaySender
from meshnet.node.scheduler import StepWork
from meshnet.node.step_input import rows_checked, step_history
from meshnet.node.tally import Tally
from meshnet.node.wire import remaining_s
from meshnet.protocol import meshnet_pb2 as pb

_POLL_S = 1.0  # an autorun's handler looks whether its call is still on at least this often
_NO_STEP_LIMIT_S = 3600.0
_NO_ROWS = np.empty(0, dtype=np.int64)  # the input of a step made before its input came
_NO_ROWS.flags.writeable = False


class AfterBatch(Protocol):
    """Being told when the batch being answered is (node/engine_forward.py)."""

    def after_batch(self, fn: Callable[[], None]) -> None: ...


class RunEngine(Protocol):
    """What an autorun needs of the node's engine (node/engine.py)."""

    @property
    def shard(self) -> Shard | None: ...

    def submit(self, work: StepWork) -> Future[np.ndarray]: ...

    def run_here(self, work: StepWork, then: Callable[[Future[np.ndarray]], None]) -> None: ...

    @property
    def forwards(self) -> AfterBatch: ...


class AutorunStreams:
    """Runs an autorun step and the steps after it on the engine."""

    def __init__(
        self,
        engine: RunEngine,
        steps: ForwardSteps,
        mailbox: Mailbox,
        relay: RelaySender,
        assists: HeadAssists | None,
    ) -> None:
        self.engine = engine
        self.steps = steps  # prepares and answers each step
        self.mailbox = mailbox  # inputs relayed by previous hops (filed by the service)
        self.relay = relay  # outputs to next hops
        self.assists = assists  # a ring's last hop shares its head with the first
        self.rings = Tally()  # ring runs under way on this hop

    def run(
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
            yield failure_reply(e)
            return None
        run = Run(step.autorun_until, self.engine.forwards.after_batch)

        def launch(step: pb.Step) -> None:
            """Start ``step`` now, or (relayed) the moment its input comes, its work made
            now: only the input is left to the thread that files it."""
            if not step.relayed:
                start(step, None)
                return
            try:
                early = _early_work(o, step, shard)
            except MeshnetError as e:
                run.post(step, failure_reply(e))
                return
            key = (o.session_id, o.epoch, step.step)
            self.mailbox.when(key, lambda x: start(step, x, early))

        def start(step: pb.Step, x: np.ndarray | None, early: Early | None = None) -> None:
            if not run.proceeds(step.step):
                return  # the stream ended while the input was on its way
            handed = _Handed()
            try:
                if early is None:
                    ready = self.steps.prepare(o, step, shard, context, x)
                else:
                    assert x is not None  # a relayed step is started with its input
                    ready = _completed(step, early, x, context)
                if not whole:  # a ring's hop passes its output on before the bookkeeping
                    ready.work.on_output = lambda out: hand_over(step, ready, handed, out)
                if not whole and sampling is not None and self.assists is not None:
                    ready.work.head_split = self._head_split(o)
                then = partial(landed, step, ready, handed)
                if early is not None and self.rings.count == 1:
                    # a lone stream's relayed step starts on this thread when the loop
                    # idles; several streams' wait for the loop, to meet in its batches
                    self.engine.run_here(ready.work, then)
                    return
                future = self.engine.submit(ready.work)
            except MeshnetError as e:
                run.post(step, failure_reply(e))
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
                    reply: pb.ForwardResponse | None = self.steps.answer(
                        o, sampling, step, ready, out, handed.token
                    )
                    assert reply is not None
                    token = reply.result.sampled.token
                    if not (whole or handed.relayed):  # the token is the first hop's input
                        relay(step, np.asarray([token], dtype=np.int64))
                else:  # a ring's forwarding hop answers only a failure, and its commitments
                    if not handed.relayed:
                        relay(step, out)
                    reply = committed_reply(ready.work) if ready.work.chunks else None
            except MeshnetError as e:
                reply = failure_reply(e)
            except Exception as e:  # the engine failed the step with a bug's error
                reply = failure_reply(MeshnetError(f"step {step.step} failed: {e}"))
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
            run.post(step, failure_reply(e, blame=o.next_node_id))

        inbox.listener = run.extend  # an Extend reaches the run at once, whatever it waits on
        leave_ring = None if whole else self.rings.enter()
        if leave_ring is not None:  # over when its call is: this handler may be closed
            context.add_callback(leave_ring)  # only by a later garbage collection
        launch(step)
        try:
            while True:
                posted = _next_post(run, step if whole else None, context)
                if posted is None:
                    yield failure_reply(DeadlineExceeded(f"autorun step {step.step} timed out"))
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
                        yield failure_reply(MalformedBundle("a running autorun takes only Extend"))
                        return None
        finally:
            if leave_ring is not None:
                leave_ring()
            inbox.listener = None
            run.stop()
            self.relay.forget(o.next_address, o.session_id, o.epoch)

    def _head_split(self, o: pb.Open) -> HeadAssist | None:
        """A lone ring's last hop asks its first for part of its head; several rings'
        steps meet in batches, whose head is multiplied here."""
        shard = self.engine.shard
        if self.assists is None or shard is None or self.rings.count != 1:
            return None
        return self.assists.for_hop(o.next_address, o.next_token, shard)


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
