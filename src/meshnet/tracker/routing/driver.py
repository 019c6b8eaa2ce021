"""The route driver: runs one generation through a chain of nodes, and fails over.

A step normally runs as a relay: the driver sends the token ids to the first
hop and a ``relayed`` step to every other, each hop sends its output straight
to the next (``forward``), and the last hop samples the token under the
sampling contract (the request's parameters and seed, and the generator's
position, travel with each step, so a replacement samples exactly as the
failed node would have) and answers it with its log-probabilities. The driver
sees tokens, never tensors; per token the data crosses one link per hop plus
the driver's two. Every forwarding hop keeps what it sent; the driver logs the
first layer's input (the ids) itself.

When hops hold different steps (after a failover) the driver sends a step
through each hop in turn instead, carrying the hidden states and logging
them per layer boundary.

Decode steps run ahead by themselves (``autorun``, node/autorun.py): a route
of one hop (a node that holds every layer) feeds itself each token, and the
hops of a longer route pass it round a ring, the last relaying each token to
the first (tracker/routing/ring.py), so no step waits on the driver. The driver starts
the run, extends it while half of it is left and reads one token per step; a
step is committed when its token is read, as always, and what the hops ran
past the end is cut back when the session is next opened (or the epoch
failed over).

When a hop fails mid-generation the driver asks the tracker (the ``Fabric``)
for a replacement of the failed span, fetches the inputs of that span from
the surviving hop before it (what it forwarded), opens the next epoch on
every hop of the new route — survivors *resume* it, keeping their KV cut back
to the steps the driver saw them commit, which fences the old epoch — and
replays the logged inputs of the failed span into the replacement only: the
prompt as it was first sent, then every logged decode step in one message
whose rows the node computes exactly as the one-row steps they were, so the
rebuilt KV is bit-identical and the output continues exactly. When no survivor
keeps its KV that is a restart from token zero, by the same code. The
uncertain step is never resent on the old epoch. Every attempt ends in one
ledger record.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc
import numpy as np

from meshnet.engine.request import FinishReason, RequestState
from meshnet.errors import (
    CacheMiss,
    Cancelled,
    DeadlineExceeded,
    MalformedBundle,
    MeshnetError,
    NodeFailure,
    NoRoute,
    ShardMismatch,
    VerificationFailed,
)
from meshnet.model.constraint import check_pick
from meshnet.model.logprobs import TokenLogprobs
from meshnet.model.sampling import SamplingParams
from meshnet.model.spec import ModelSpec
from meshnet.model.tokenizer import TextTokenizer
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.hop_link import HopLink, RelayBroken
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.routing.epochs import EpochOpener, hop_key
from meshnet.tracker.routing.generation import Generation, PendingRecovery, Recovery
from meshnet.tracker.routing.prefix_open import open_on_prefix
from meshnet.tracker.routing.ring import Ring
from meshnet.tracker.routing.span_claims import claim_rest, ready_claims
from meshnet.tracker.trust.verifier import SpanClaim

log = logging.getLogger(__name__)

_FORWARD_GRACE = 1.5
_NO_RELAY_S = 300.0  # how long a pair that could not talk is left to the driver
# Steps a route's first hop may run past the one the driver reads; it is moved on when
# half is left. Each move is an Extend the first hop's handler wakes for, about when
# the ring's token reaches that hop: every 4 tokens (a run of 8) it held that hop's
# next step up ~1 ms on a 2-core host. A run never passes the generation's last step.
_AUTORUN_AHEAD = 32
# How long a generation's end waits for the hops' commitments still to come
# (span_claims.py): sent before the last token came, they are read now; one that has
# not come by then was withheld (a failed check of its node).
_COMMITMENTS_GRACE_S = 2.0


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # text made final by this token (may be empty)
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class DoneEvent:
    ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    route: Route = ()
    epoch: int = 1
    recoveries: tuple[Recovery, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per id, when they were asked for
    cached_tokens: int = 0  # prompt positions reused from the hops' prefix caches


@dataclass(frozen=True)
class DriverLimits:
    step_timeout_s: float = 30.0  # one step through one shard
    row_timeout_s: float = 0.05  # and this much more for each row of the step (a long prefill)
    open_timeout_s: float = 10.0
    generation_timeout_s: float = 600.0  # whole generation, also the streams' gRPC deadline
    max_recoveries: int = 8  # failovers one generation may take
    # A failed span nothing serves now (its only node restarting, a heal loading) is
    # waited for this long, looked for again every route_poll_s, before the generation
    # fails: a mesh under churn answers late rather than not at all.
    route_wait_s: float = 15.0
    route_poll_s: float = 0.25
    fence_timeout_s: float = 60.0  # how long a failed node is sent its fence
    relay: bool = True  # hops send activations to each other; False: all through the driver
    autorun: bool = True  # a route's hops run their decode steps ahead by themselves
    prefix_cache: bool = True  # a fresh generation starts on its hops' cached prompt prefix


@dataclass(frozen=True)
class Reroute:
    route: Route  # the new route; hops of the old one it keeps resume their KV
    healed: str | None = None  # an empty node that was told to load the failed span


class Fabric(Protocol):
    """What the driver needs of the tracker to fail over and to account."""

    async def reroute(self, route: Route, failed: Hop | None, error: MeshnetError) -> Reroute: ...

    def record(self, records: Iterable[LedgerRecord]) -> None: ...


def recoverable(e: MeshnetError) -> bool:
    """Failures another node (or a fresh epoch on the same node) can make good."""
    if isinstance(e, NodeFailure | CacheMiss):
        return bool(e.node_id)
    return isinstance(e, MalformedBundle | ShardMismatch) and bool(e.node_id)


def _run_end(gen: Generation, step: int, until: int) -> int:
    """A first hop's run end moved ``_AUTORUN_AHEAD`` steps on from ``until`` (a new
    run's: from its first step, ``step``), never past the generation's last step."""
    return max(step + 1, min(until + _AUTORUN_AHEAD, _generation_end(gen)))


def _extends(gen: Generation, link: HopLink, step: int) -> bool:
    """Whether a running run is to be moved on at ``step``: half of it or less is left,
    and it stops short of the generation's last step."""
    left = link.autorun_until - step
    return left <= _AUTORUN_AHEAD // 2 and link.autorun_until < _generation_end(gen)


def _generation_end(gen: Generation) -> int:
    """The step after the generation's last: its first step samples the first token."""
    return gen.first_step + gen.params.max_tokens


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
        self._background: set[asyncio.Task[Any]] = set()  # background work still running
        self.epochs = EpochOpener(
            channels, fingerprint, spec, limits.open_timeout_s, limits.fence_timeout_s
        )
        self._no_relay: dict[tuple[str, str], float] = {}  # pairs that cannot talk, until
        # Where each chunk the hops commit goes once its tokens are committed (the
        # tracker's verifier); None: commitments are only kept with the ledger records.
        self.claims: Callable[[SpanClaim], None] | None = None
        # Where a chunk goes that a hop ran and never committed by the generation's end
        # (a claim with no digest: span_claims.withheld), with ``claims``.
        self.withheld: Callable[[SpanClaim], None] | None = None

    def new_generation(
        self, generation_id: str, route: Route, params: SamplingParams, top_logprobs: int = -1
    ) -> Generation:
        """A generation of ``params`` (its seed fixed now: a failover must not change it)."""
        deadline = time.monotonic() + self.limits.generation_timeout_s
        params = params.seeded()
        if params.constraint is not None:  # a matcher of its own: choices never share one
            params = replace(params, constraint=params.constraint.at(params.constraint.start))
        return Generation(generation_id, route, deadline, params, top_logprobs)

    async def open(self, gen: Generation, prompt_ids: Sequence[int] = ()) -> None:
        """Open the generation's first epoch on every hop; raise the first hop's failure.
        Given its prompt (a stateless request's, or a session's first turn's), each hop
        starts with the same cached prefix of it, if any, as step 0
        (tracker/routing/prefix_open.py), and keeps its blocks once computed."""
        if prompt_ids and self.limits.prefix_cache and gen.first_step == 0:
            await open_on_prefix(self.epochs, gen, prompt_ids)
            return
        gen.links, _ = await self.epochs.open(gen, gen.route, {})

    async def resume(self, gen: Generation, held: tuple[int, int]) -> bool:
        """Open a session's turn, every hop resuming the KV of ``held`` (positions, steps).

        True when every hop holds exactly that (more is cut back: an unfinished
        turn). Otherwise every hop is opened afresh on the next epoch and the
        history, logged at the first layer, is replayed into all of them.
        """
        gen.links, _ = await self.epochs.open(gen, gen.route, {}, held)
        if all((link.positions, link.steps) == held for link in gen.links):
            gen.billed_from = held[0]
            return True
        for link in gen.links:
            link.close()
        gen.epoch += 1
        gen.links, _ = await self.epochs.open(gen, gen.route, {})
        return False

    async def run(
        self,
        gen: Generation,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        fabric: Fabric,
        history: Sequence[int] = (),
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        """Generate through an opened generation; closes its streams however it ends.

        ``history`` is what a session fed before (its steps already logged):
        the sampler sees it as part of the prompt. ``params`` decide when to stop;
        the last hop samples with the generation's own (seeded) copy of them.
        """
        state = RequestState([*history, *prompt_ids], params, self.tokenizer)
        # A prefix the hops started with (``open``) is step 0, logged there already.
        rest = prompt_ids[gen.reused :]
        gen.record_input(0, gen.first_step, np.asarray(rest, dtype=np.int64))
        gen.first_sampled = len(state.prompt_ids)
        recorded = False
        logprobs: list[TokenLogprobs] = []
        try:
            step = gen.first_step
            while True:
                if gen.verdict is not None:  # cancelled while no step was waiting
                    raise gen.verdict
                if gen.params.sees_history:
                    gen.history = state.history
                try:
                    sampled = await self._advance(gen, step)
                    if gen.params.constraint is not None:  # never an id outside the grammar
                        check_pick(
                            gen.params.constraint,
                            state.history,
                            sampled.token,
                            gen.links[-1].node_id,
                        )
                except MeshnetError as e:
                    self._claim(gen, state.history, final=True)  # these links are going
                    await self._fail_over(gen, e, fabric)
                    continue
                if gen.pending is not None:
                    gen.recoveries.append(gen.pending.done())
                    gen.pending = None
                if not gen.params.greedy:
                    gen.draws += 1  # the sampler drew one uniform for this token
                if self.claims is not None:  # the verifier checks only the node's own picks
                    gen.sampled_by[len(state.history)] = gen.links[-1].node_id
                text = state.push(sampled.token)
                self._claim(gen, state.history)
                if gen.top_logprobs >= 0:
                    logprobs.append(sampled)
                    yield TokenEvent(sampled.token, text, sampled)
                else:
                    yield TokenEvent(sampled.token, text)
                if state.done:
                    break
                step += 1
                gen.record_input(0, step, np.asarray([state.ids[-1]], dtype=np.int64))
            if self.claims is not None:
                grace = _COMMITMENTS_GRACE_S
                for claim in await claim_rest(gen, state.history, self.claims, grace):
                    if self.withheld is not None:
                        self.withheld(claim)
            fabric.record(gen.attempts(gen.links, AttemptStatus.COMPLETED))
            recorded = True
            if gen.keep and any(link.autorun_until > link.steps for link in gen.links):
                await self._settle(gen)
            finish = state.finish or "length"
            yield DoneEvent(
                state.ids,
                state.text,
                finish,
                len(prompt_ids),
                gen.route,
                gen.epoch,
                tuple(gen.recoveries),
                tuple(logprobs),
                gen.reused,
            )
        except MeshnetError as e:
            if not recorded:
                recorded = True
                self._record_end(gen, e, fabric)
            raise
        finally:
            if not recorded:  # the client went away, or the task was cancelled
                fabric.record(gen.attempts(gen.links, AttemptStatus.CANCELLED, Cancelled.kind))
            self._claim(gen, state.history, final=True)
            for link in gen.links:
                link.close()

    def _claim(self, gen: Generation, fed: Sequence[int], final: bool = False) -> None:
        """Hand each chunk the hops committed that is ready to be checked to ``claims``
        (span_claims.py); ``final``: every chunk whose positions are committed, before
        the links go. ``fed``: every id fed so far, then the one just sampled."""
        if self.claims is not None:
            for claim in ready_claims(gen, fed, final)[0]:
                self.claims(claim)

    async def _settle(self, gen: Generation) -> None:
        """End a session's turn with every hop's KV exactly what the driver saw committed:
        hops that ran ahead are cut back by resuming the next epoch, which also fences
        any step still running on the old one. Where that fails the next turn's open
        cuts back what it finds (its epoch is newer than either)."""
        survivors = {hop_key(link.hop): link for link in gen.links}
        gen.epoch += 1
        try:
            links, _ = await self.epochs.open(gen, gen.route, survivors)
        except MeshnetError as e:
            log.warning("%s: the hops that ran ahead were not cut back: %s", gen.id, e)
            return
        for link in gen.links:
            link.close()
        gen.links = links  # nothing ran on them: they add no ledger record

    @staticmethod
    def _record_end(gen: Generation, e: MeshnetError, fabric: Fabric) -> None:
        culprit = [link for link in gen.links if e.node_id and link.node_id == e.node_id]
        others = [link for link in gen.links if link not in culprit]
        fabric.record(gen.attempts(culprit, AttemptStatus.FAILED, e.kind))
        fabric.record(gen.attempts(others, AttemptStatus.CANCELLED, e.kind))

    # --- steps --------------------------------------------------------------------

    async def _advance(self, gen: Generation, step: int) -> TokenLogprobs:
        """Run ``step``, first replaying earlier steps into hops that lack them."""
        first = min(link.steps for link in gen.links)
        if first < step:
            await self._replay(gen, first, step)
            if gen.pending is not None:
                gen.pending.replayed_steps += step - first
            first = min(link.steps for link in gen.links)
        if gen.ready_at is None:
            gen.ready_at = time.monotonic()
        if self._rings(gen, step):
            return await self._ring_step(gen, step)
        if self.limits.relay and len(gen.links) > 1 and all(k.steps == step for k in gen.links):
            return await self._relay_step(gen, step)
        if self._autoruns(gen, step):
            return await self._autorun_step(gen, gen.links[0], step)
        sampled = await self._run_step(gen, step)
        assert isinstance(sampled, TokenLogprobs)  # no hop holds a step not yet sampled
        return sampled

    def _autoruns(self, gen: Generation, step: int) -> bool:
        """Whether ``step`` runs ahead on a node that holds every layer: a decode step of a
        one-hop route that holds the steps before it."""
        if not self.limits.autorun or len(gen.links) != 1:
            return False
        link = gen.links[0]
        return link.samples and link.steps == step and gen.step_rows(step) == 1

    async def _autorun_step(self, gen: Generation, link: HopLink, step: int) -> TokenLogprobs:
        """``step``'s token from a node that runs the decode steps by itself: the run is
        started, or moved ``_AUTORUN_AHEAD`` steps on while half of it is left, and the
        step's result read. The driver sees a step committed when its token comes, as
        in any step; what the node ran past the end is cut back at the next open."""
        budget = self._budget(gen, 1, 1)
        if link.autorun_until <= step:
            x = gen.recorded_input(0, step)
            if x is None:
                raise CacheMiss(f"no logged input for layer 0 at step {step}")
            link.autorun_until = _run_end(gen, step, step)
            request = self._step_request(
                gen, link, step, budget, input=codec.encode(x), autorun_until=link.autorun_until
            )
            await link.send(request, budget)
        elif _extends(gen, link, step):
            link.autorun_until = _run_end(gen, step, link.autorun_until)
            extend = pb.ForwardRequest(extend=pb.Extend(until=link.autorun_until))
            await link.send(extend, budget)
        reply = await self._read_result(gen, link, step, budget)
        link.steps = step + 1
        link.positions += 1
        return self._sampled(reply.result, gen.top_logprobs, link.node_id)

    def _rings(self, gen: Generation, step: int) -> bool:
        """Whether ``step`` runs round a ring: a decode step of a route of several hops
        that all hold the steps before it and can each reach the next (the last, the
        first)."""
        links = gen.links
        if not (self.limits.relay and self.limits.autorun and len(links) > 1):
            return False
        if gen.ring is not None and gen.ring.links is links:
            return True  # running: every step after the first is a ring's
        if not links[-1].samples or gen.step_rows(step) != 1:
            return False
        if any(link.steps != step for link in links):
            return False
        now = time.monotonic()
        pairs = [*itertools.pairwise(links), (links[-1], links[0])]
        return all(self._no_relay.get((a.node_id, b.node_id), 0.0) <= now for a, b in pairs)

    async def _ring_step(self, gen: Generation, step: int) -> TokenLogprobs:
        """``step``'s token from hops that pass it round a ring: the ring is started
        with this step on every hop, or its first hop's run moved ``_AUTORUN_AHEAD``
        steps on while half of it is left; then the step's token is read. Every hop
        counts the step committed when its token comes."""
        links, first = gen.links, gen.links[0]
        budget = self._budget(gen, 1, len(links))
        ring = gen.ring
        if ring is None or ring.links is not links:
            ring = gen.ring = await self._start_ring(gen, step, budget)
        elif _extends(gen, first, step):
            first.autorun_until = _run_end(gen, step, first.autorun_until)
            await first.send(pb.ForwardRequest(extend=pb.Extend(until=first.autorun_until)), budget)
        try:
            reply = await ring.next(step, budget)
        except DeadlineExceeded:
            if gen.deadline <= time.monotonic():  # the generation's own deadline, not a node's
                raise DeadlineExceeded("the generation ran past its deadline") from None
            raise
        except RelayBroken as e:  # the next epoch runs without a ring, the driver between them
            self._cannot_talk(e)
            raise
        for link in links:
            link.steps = step + 1
            link.positions += 1
        return self._sampled(reply.result, gen.top_logprobs, links[-1].node_id)

    async def _start_ring(self, gen: Generation, step: int, budget: float) -> Ring:
        """Send ``step`` to every hop as the start of its run: the first is given the
        token and keeps to a run's end, every other follows what is relayed to it."""
        x = gen.recorded_input(0, step)
        if x is None:
            raise CacheMiss(f"no logged input for layer 0 at step {step}")
        links = gen.links
        for link in links:
            await self._read_unread(link)  # answers on a stream come in order
        links[0].autorun_until = _run_end(gen, step, step)
        without_end = step + gen.params.max_tokens + 1  # the first hop's run bounds theirs
        for link in reversed(links):  # the first last: the others wait for their inputs
            fields: dict[str, Any] = {"forward": not link.samples}
            if link is links[0]:
                fields.update(input=codec.encode(x), autorun_until=links[0].autorun_until)
            else:
                fields.update(relayed=True, rows=1, autorun_until=without_end)
            await link.send(self._step_request(gen, link, step, budget, **fields), budget)
        return Ring(links, gen.deadline)

    async def _relay_step(self, gen: Generation, step: int) -> TokenLogprobs:
        """Run ``step`` with activations going hop to hop; the token.

        Hops that can reach the next one form a segment run at once; between
        segments (a pair that could not talk) the driver carries the activations.
        """
        x = gen.recorded_input(0, step)
        if x is None:
            raise CacheMiss(f"no logged input for layer 0 at step {step}")
        segments = self._segments(gen.links)
        for i, segment in enumerate(segments):
            if i:
                gen.record_input(segment[0].hop.layers.start, step, x)
            out = await self._run_segment(gen, segment, step, x)
            if isinstance(out, TokenLogprobs):
                return out
            x = out
        raise MalformedBundle("the route's last hop answered no token")

    async def _run_segment(
        self, gen: Generation, segment: list[HopLink], step: int, x: np.ndarray
    ) -> np.ndarray | TokenLogprobs:
        """``step`` on hops that relay to each other: all at once, the first given ``x``;
        the last one's output, as soon as it comes. The forwarding hops' answers are
        read while the next step runs (each before that hop's next one). On the
        first failure the other answers are abandoned: the failover cuts every
        survivor back to the steps seen here."""
        rows = int(x.shape[0])
        last = len(segment) - 1
        calls = [
            asyncio.create_task(
                self._exchange(
                    gen,
                    link,
                    step,
                    rows,
                    i + 1,  # a hop waits for every hop before it
                    input=codec.encode(x) if i == 0 else None,
                    relayed=i > 0,
                    forward=i < last,
                    rows=rows,
                )
            )
            for i, link in enumerate(segment)
        ]
        waiting = set(calls)
        failed: list[asyncio.Task[pb.ForwardResponse]] = []
        while not calls[-1].done() and not failed:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in done if not t.cancelled() and t.exception()]
        failed = [t for t in calls if t.done() and not t.cancelled() and t.exception()]
        if failed:
            # The others are left to end with their streams (cancelling a read would end
            # the call, and a survivor's KV with it, before the next epoch resumes it).
            for t in calls:
                self._abandon(t)
            error = failed[0].exception()
            assert error is not None
            if isinstance(error, RelayBroken):
                self._cannot_talk(error)
            raise error
        out = self._output(gen, segment[-1], calls[-1].result(), rows)
        for link, call in zip(segment, calls, strict=True):
            link.steps = step + 1  # the token came: every hop before it committed the step
            link.positions += rows
            link.unread = call if link is not segment[-1] else None
        return out

    def _cannot_talk(self, e: RelayBroken) -> None:
        pair = (e.from_node, e.node_id)
        self._no_relay[pair] = time.monotonic() + _NO_RELAY_S
        log.warning("%s cannot reach %s: the driver carries between them", *pair)

    @staticmethod
    async def _read_unread(link: HopLink) -> None:
        """A forwarding hop's answer to its previous step: an acknowledgement, or the
        failure that step met after all (raised now, and failed over as usual)."""
        task, link.unread = link.unread, None
        if task is not None:
            await task

    def _segments(self, links: list[HopLink]) -> list[list[HopLink]]:
        """The route cut where a hop does not relay to the next."""
        now = time.monotonic()
        segments = [[links[0]]]
        for before, link in itertools.pairwise(links):
            if self._no_relay.get((before.node_id, link.node_id), 0.0) > now:
                segments.append([link])
            else:
                segments[-1].append(link)
        return segments

    async def _replay(self, gen: Generation, first: int, end: int) -> None:
        """Send logged steps ``[first, end)`` to the hops lacking them: each prompt as it
        was first sent, each run of decode steps as one message."""
        s = first
        while s < end:
            if gen.step_rows(s) != 1:
                await self._run_step(gen, s)
                s += 1
                continue
            run_end = s + 1
            while run_end < end and gen.step_rows(run_end) == 1:
                run_end += 1
            await self._replay_decodes(gen, s, run_end)
            s = run_end

    async def _replay_decodes(self, gen: Generation, first: int, end: int) -> None:
        """Send decode steps ``[first, end)`` to the hops lacking them as one message each;
        the node computes every row exactly as the step it was, so the KV is identical."""
        behind = [link for link in gen.links if link.steps < end]
        if any(link.steps != first for link in behind):
            for s in range(first, end):  # hops at different points: step by step
                await self._run_step(gen, s)
            return
        x: np.ndarray | None = None
        for link in gen.links:
            start = link.hop.layers.start
            if link.steps >= end:
                x = None
                continue
            if x is None:
                logged = [gen.recorded_input(start, s) for s in range(first, end)]
                if any(row is None for row in logged):
                    raise CacheMiss(f"no logged input for layer {start} in steps {first}-{end}")
                x = np.concatenate([row for row in logged if row is not None])
            else:
                for row, s in enumerate(range(first, end)):
                    gen.record_input(start, s, x[row : row + 1])
            rows = int(x.shape[0])
            out = await self._send(gen, link, first, x, replay=True)
            x = out if isinstance(out, np.ndarray) else None  # the last hop's token is known
            link.steps = end
            link.positions += rows

    async def _run_step(self, gen: Generation, step: int) -> TokenLogprobs | None:
        """Send ``step`` through every hop that has not run it; the last hop's token."""
        x: np.ndarray | None = None
        out: np.ndarray | TokenLogprobs | None = None
        for link in gen.links:
            start = link.hop.layers.start
            if link.steps > step:
                x = out = None  # this hop holds the step; the next one reads the log
                continue
            assert link.steps == step, "steps reach a hop in order"
            if x is None:
                x = gen.recorded_input(start, step)
                if x is None:
                    raise CacheMiss(f"no logged input for layer {start} at step {step}")
            else:
                gen.record_input(start, step, x)
            rows = int(x.shape[0])
            out = await self._send(gen, link, step, x)
            x = out if isinstance(out, np.ndarray) else None
            link.steps = step + 1
            link.positions += rows
        return out if isinstance(out, TokenLogprobs) else None

    async def _send(
        self,
        gen: Generation,
        link: HopLink,
        step: int,
        x: np.ndarray,
        replay: bool = False,
    ) -> np.ndarray | TokenLogprobs:
        """One step through one hop: its hidden states, or the last hop's sampled token."""
        rows = int(x.shape[0])
        reply = await self._exchange(gen, link, step, rows, 1, input=codec.encode(x), replay=replay)
        return self._output(gen, link, reply, rows)

    def _output(
        self, gen: Generation, link: HopLink, reply: pb.ForwardResponse, rows: int
    ) -> np.ndarray | TokenLogprobs:
        """A hop's answer, checked: the sampled token, or hidden states of every row."""
        node = link.node_id
        if link.samples:
            return self._sampled(reply.result, gen.top_logprobs, node)
        limits = codec.TensorLimits("f32", 2, self.spec.context_length, self.spec.d_model)
        try:
            out = codec.decode(reply.result.output, limits)
        except MalformedBundle as e:
            raise MalformedBundle(f"node {node} sent a bad tensor: {e.message}", node) from None
        if out.shape[0] != rows:
            raise MalformedBundle(f"node {node} returned {out.shape[0]} rows", node)
        return out

    async def _exchange(
        self, gen: Generation, link: HopLink, step: int, size: int, waits: int, **fields: Any
    ) -> pb.ForwardResponse:
        """Send ``Step(step, **fields)`` to a hop and read its result, within a budget of
        ``waits`` steps of ``size`` rows (a relayed hop waits for the hops before it)."""
        await self._read_unread(link)  # answers on a stream come in order
        budget = self._budget(gen, size, waits)
        request = self._step_request(gen, link, step, budget, **fields)
        # A forwarding hop gets to answer past its own deadline: when the next hop does
        # not take its output in time, it says so and names it.
        wait = budget * _FORWARD_GRACE if fields.get("forward") else budget
        return await self._read_result(gen, link, step, wait, request)

    def _budget(self, gen: Generation, size: int, waits: int) -> float:
        """Seconds for ``waits`` steps of ``size`` rows, within the generation's deadline."""
        budget = (self.limits.step_timeout_s + size * self.limits.row_timeout_s) * waits
        budget = min(budget, gen.deadline - time.monotonic())
        if budget <= 0:
            raise DeadlineExceeded("the generation ran past its deadline")
        return budget

    @staticmethod
    def _step_request(
        gen: Generation, link: HopLink, step: int, budget: float, **fields: Any
    ) -> pb.ForwardRequest:
        return pb.ForwardRequest(
            step=pb.Step(
                step=step,
                timeout_ms=max(1, int(budget * 1000)),
                draws=gen.draws if link.samples else 0,
                history=gen.history if link.samples else (),
                generated_from=gen.first_sampled if link.samples else 0,
                **fields,
            )
        )

    @staticmethod
    async def _read_result(
        gen: Generation,
        link: HopLink,
        step: int,
        wait: float,
        request: pb.ForwardRequest | None = None,
    ) -> pb.ForwardResponse:
        """Send ``request`` (if any) and read the hop's result of ``step``, checked."""
        node = link.node_id
        try:
            if request is not None:
                reply = await link.exchange(request, wait)
            else:
                reply = await link.receive(wait)
        except DeadlineExceeded:
            if gen.deadline <= time.monotonic():  # the generation's own deadline, not the node's
                raise DeadlineExceeded("the generation ran past its deadline") from None
            raise
        if reply.WhichOneof("kind") != "result" or reply.result.step != step:
            raise MalformedBundle(f"node {node} sent no result for step {step}", node)
        return reply

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        """Keep a task whose result no longer matters until it ends, its error unraised."""
        self._background.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an abandoned answer's failure is not news

    def _sampled(self, result: pb.StepResult, top: int, node: str) -> TokenLogprobs:
        """The last hop's token, checked: an id of the vocabulary, log-probabilities <= 0."""
        s = result.sampled
        vocab = self.spec.vocab_size
        ids, lps = list(s.top_ids), list(s.top_logprobs)
        ok = (
            result.HasField("sampled")
            and 0 <= s.token < vocab
            and len(ids) == len(lps) == min(max(top, 0), vocab)
            and all(0 <= i < vocab for i in ids)
            and all(v <= 0.0 for v in [s.logprob, *lps])  # NaN fails too
        )
        if not ok:
            raise MalformedBundle(f"node {node} sent no valid sampled token", node)
        return TokenLogprobs(int(s.token), float(s.logprob), tuple(zip(ids, lps, strict=True)))

    # --- failover -----------------------------------------------------------------

    async def _replacement(
        self,
        gen: Generation,
        route: Route,
        failed: Hop | None,
        error: MeshnetError,
        fabric: Fabric,
    ) -> Reroute:
        """The fabric's new route; while it has none, asked again every ``route_poll_s``
        for up to ``route_wait_s`` (a node coming back, a replica, a heal), then the
        failure, saying no replacement was found."""
        deadline = time.monotonic() + self.limits.route_wait_s
        while True:
            try:
                return await fabric.reroute(route, failed, error)
            except NoRoute as e:
                if gen.verdict is not None:
                    raise gen.verdict from None
                if time.monotonic() >= deadline:
                    message = f"{error.message}; no replacement: {e.message}"
                    raise type(error)(message, node_id=error.node_id) from None
            await asyncio.sleep(self.limits.route_poll_s)

    async def _fail_over(self, gen: Generation, error: MeshnetError, fabric: Fabric) -> None:
        """Move the generation to a new epoch on a route without the failed node, or raise.

        A node that fails while the new epoch is being opened is failed over in
        turn, up to ``max_recoveries`` failovers per generation.
        """
        if gen.verdict is not None:
            raise gen.verdict
        if gen.pending is None:
            gen.pending = PendingRecovery(error.node_id, error.kind, time.monotonic())
        pending = gen.pending
        route = gen.route
        failed = next((link.hop for link in gen.links if link.node_id == error.node_id), None)
        while True:
            if not recoverable(error) or gen.failovers >= self.limits.max_recoveries:
                raise error
            gen.failovers += 1
            pending.failures[error.node_id] = error.kind
            reroute = await self._replacement(gen, route, failed, error, fabric)
            survivors = {
                hop_key(link.hop): link
                for link in gen.links
                if link.node_id not in pending.failures
            }
            steps = max(link.steps for link in gen.links)
            rebuilt = [h for h in reroute.route if hop_key(h) not in survivors]
            for h in rebuilt:
                before = [s for s in survivors.values() if s.hop.layers.end == h.layers.start]
                if before and not gen.has_inputs(h.layers.start, steps):
                    await self._fetch_sent(gen, before[0], steps)
            if not all(gen.has_inputs(h.layers.start, steps) for h in rebuilt):
                survivors = {}  # a span's inputs were never logged: restart from token zero
            if error.kind == VerificationFailed.kind:
                # What the cheat sent on is in the KV of every hop after it and in the log:
                # everything is recomputed from the token ids, on honest nodes.
                survivors = {}
                gen.inputs = {0: gen.inputs.get(0, {})}
            gen.epoch += 1  # also after a failed try: its partly opened epoch stays fenced
            try:
                links, carried = await self.epochs.open(gen, reroute.route, survivors)
                break
            except MeshnetError as e:
                if gen.verdict is not None:
                    raise gen.verdict from None
                log.warning("%s: epoch %d did not open: %s", gen.id, gen.epoch, e)
                error, route = e, reroute.route
                failed = next((h for h in route if h.node_id == e.node_id), None)
        if gen.verdict is not None:  # cancelled while the new epoch was opening
            for link in links:
                link.close()
            raise gen.verdict
        self._account_failover(gen, carried, fabric)
        for link in gen.links:
            if link.node_id in pending.failures:
                self.epochs.fence_later(link.hop, gen.kv_key, gen.epoch)
            link.close()  # after the new epoch fenced it: a survivor's KV stays
        gen.links = links  # a ring of the old links (gen.ring) is over with them
        gen.route = reroute.route
        pending.epoch = gen.epoch
        pending.method = "replay" if carried else "restart"
        pending.replacement = tuple(link.node_id for link in links if link.first_position == 0)
        pending.healed = reroute.healed

    async def _fetch_sent(self, gen: Generation, link: HopLink, steps: int) -> None:
        """Log what ``link``'s node forwarded in steps [0, ``steps``) that the driver lacks
        (the inputs of the span after it). What it cannot give is left unlogged."""
        start = link.hop.layers.end
        have = gen.inputs.get(start, {})
        first = next((s for s in range(steps) if s not in have), steps)
        if first == steps:
            return
        request = pb.OutputsRequest(session_id=gen.kv_key, first_step=first, end_step=steps)
        limits = codec.TensorLimits("f32", 2, self.spec.context_length, self.spec.d_model)
        try:
            stub = self.channels.stub(link.hop.address)
            signed = self.channels.signed(link.node_id, "Outputs")
            async for out in stub.Outputs(
                request, timeout=self.limits.open_timeout_s, metadata=signed
            ):
                x = codec.decode(out.output, limits)
                if first <= out.step < steps and x.shape[0] == gen.step_rows(out.step):
                    gen.record_input(start, int(out.step), x)
        except (grpc.aio.AioRpcError, MalformedBundle) as e:
            # The driver restarts from token zero if the log stays incomplete.
            log.warning("no outputs from node %s for %s: %s", link.node_id, gen.id, e)

    @staticmethod
    def _account_failover(gen: Generation, carried: list[HopLink], fabric: Fabric) -> None:
        """Close the old epoch's attempts: kept KV completed, a failed node's work failed."""
        assert gen.pending is not None
        failures = gen.pending.failures
        lost = [link for link in gen.links if link not in carried]
        fabric.record(gen.attempts(carried, AttemptStatus.COMPLETED))
        for link in lost:
            if link.node_id in failures:
                kind = failures[link.node_id]
                fabric.record(gen.attempts([link], AttemptStatus.FAILED, kind))
            else:
                fabric.record(gen.attempts([link], AttemptStatus.CANCELLED, gen.pending.kind))
