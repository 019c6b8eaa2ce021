"""The route driver: runs one generation through a chain of nodes, and fails over.

The driver opens a generation's epoch on every hop of its route (epochs.py; on
the hops' cached prompt prefix, prefix_open.py), then runs it step by step and
yields each token as it is read: how a step runs (relayed hop to hop, round a
ring, or run ahead by a node) is relay.py's, one step through hops in turn and
the checks of their answers steps.py's, and a failed hop's replacement
failover.py's. It hands the chunks the hops committed to the verifier once
their tokens are committed (span_claims.py), and ends every attempt in one
ledger record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshnet.engine.request import FinishReason, RequestState
from meshnet.errors import Cancelled, MeshnetError
from meshnet.model.constraint import check_pick
from meshnet.model.logprobs import TokenLogprobs
from meshnet.model.sampling import SamplingParams
from meshnet.model.spec import ModelSpec
from meshnet.model.tokenizer import TextTokenizer
from meshnet.tracker.accounting.ledger import AttemptStatus
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.nodes.routes import Route
from meshnet.tracker.routing.epochs import EpochOpener, hop_key
from meshnet.tracker.routing.failover import Fabric, Failover
from meshnet.tracker.routing.generation import Generation, Recovery
from meshnet.tracker.routing.limits import DriverLimits
from meshnet.tracker.routing.prefix_open import open_on_prefix
from meshnet.tracker.routing.relay import Relay
from meshnet.tracker.routing.span_claims import claim_rest, ready_claims
from meshnet.tracker.routing.steps import HopSteps
from meshnet.tracker.trust.verifier import SpanClaim

log = logging.getLogger(__name__)

# How long a generation's end waits for the hops' commitments still to come
# (span_claims.py): sent before the last token came, they are read now; one that has
# not come by then was withheld (a failed check of its node).
_COMMITMENTS_GRACE_S = 2.0
_LIMITS = DriverLimits()  # the default limits (frozen: one is shared)


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


class RouteDriver:
    """Drives generations; one instance per tracker, one ``run`` per generation."""

    def __init__(
        self,
        channels: ChannelPool,
        fingerprint: str,
        spec: ModelSpec,
        tokenizer: TextTokenizer,
        limits: DriverLimits = _LIMITS,
    ) -> None:
        self.channels = channels
        self.fingerprint = fingerprint
        self.spec = spec
        self.tokenizer = tokenizer
        self.limits = limits
        self.epochs = EpochOpener(
            channels, fingerprint, spec, limits.open_timeout_s, limits.fence_timeout_s
        )
        self.relay = Relay(HopSteps(spec, limits), limits)
        self.failover = Failover(channels, spec, limits, self.epochs)
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
                    sampled = await self.relay.advance(gen, step)
                    if gen.params.constraint is not None:  # never an id outside the grammar
                        check_pick(
                            gen.params.constraint,
                            state.history,
                            sampled.token,
                            gen.links[-1].node_id,
                        )
                except MeshnetError as e:
                    self._claim(gen, state.history, final=True)  # these links are going
                    await self.failover.fail_over(gen, e, fabric)
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
