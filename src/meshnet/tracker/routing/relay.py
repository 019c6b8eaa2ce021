"""How the driver runs a step: relayed hop to hop, round a ring, or run ahead by a node.

A step normally runs as a relay: the driver sends the token ids to the first
hop and a ``relayed`` step to every other, each hop sends its output straight
to the next (``forward``), and the last hop samples the token under the
sampling contract (the request's parameters and seed, and the generator's
position, travel with each step, so a replacement samples exactly as the
failed node would have) and answers it with its log-probabilities. The driver
sees tokens, never tensors; per token the data crosses one link per hop plus
the driver's two. Every forwarding hop keeps what it sent; the driver logs the
first layer's input (the ids) itself. Where two hops cannot talk, the driver
carries the activations between them (steps.py).

Decode steps run ahead by themselves (``autorun``, node/autorun.py): a route
of one hop (a node that holds every layer) feeds itself each token, and the
hops of a longer route pass it round a ring, the last relaying each token to
the first (tracker/routing/ring.py), so no step waits on the driver. The driver starts
the run, extends it while half of it is left and reads one token per step; a
step is committed when its token is read, as always, and what the hops ran
past the end is cut back when the session is next opened (or the epoch
failed over).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import numpy as np

from meshnet.errors import CacheMiss, DeadlineExceeded, MalformedBundle
from meshnet.model.logprobs import TokenLogprobs
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.hop_link import HopLink, RelayBroken
from meshnet.tracker.routing.generation import Generation
from meshnet.tracker.routing.limits import DriverLimits
from meshnet.tracker.routing.ring import Ring
from meshnet.tracker.routing.steps import HopSteps

log = logging.getLogger(__name__)

_NO_RELAY_S = 300.0  # how long a pair that could not talk is left to the driver
# Steps a route's first hop may run past the one the driver reads; it is moved on when
# half is left. Each move is an Extend the first hop's handler wakes for, about when
# the ring's token reaches that hop: every 4 tokens (a run of 8) it held that hop's
# next step up ~1 ms on a 2-core host. A run never passes the generation's last step.
_AUTORUN_AHEAD = 32


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


class Relay:
    """Chooses how each step runs and runs it; one per route driver. It remembers the
    pairs of nodes that could not talk, so their steps go through the driver."""

    def __init__(self, steps: HopSteps, limits: DriverLimits) -> None:
        self.steps = steps
        self.limits = limits
        self._no_relay: dict[tuple[str, str], float] = {}  # pairs that cannot talk, until

    async def advance(self, gen: Generation, step: int) -> TokenLogprobs:
        """Run ``step``, first replaying earlier steps into hops that lack them."""
        first = min(link.steps for link in gen.links)
        if first < step:
            await self.steps.replay(gen, first, step)
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
        sampled = await self.steps.run_step(gen, step)
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
        budget = self.steps.budget(gen, 1, 1)
        if link.autorun_until <= step:
            x = gen.recorded_input(0, step)
            if x is None:
                raise CacheMiss(f"no logged input for layer 0 at step {step}")
            link.autorun_until = _run_end(gen, step, step)
            request = self.steps.step_request(
                gen, link, step, budget, input=codec.encode(x), autorun_until=link.autorun_until
            )
            await link.send(request, budget)
        elif _extends(gen, link, step):
            link.autorun_until = _run_end(gen, step, link.autorun_until)
            extend = pb.ForwardRequest(extend=pb.Extend(until=link.autorun_until))
            await link.send(extend, budget)
        reply = await self.steps.read_result(gen, link, step, budget)
        link.steps = step + 1
        link.positions += 1
        return self.steps.sampled(reply.result, gen.top_logprobs, link.node_id)

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
        budget = self.steps.budget(gen, 1, len(links))
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
        return self.steps.sampled(reply.result, gen.top_logprobs, links[-1].node_id)

    async def _start_ring(self, gen: Generation, step: int, budget: float) -> Ring:
        """Send ``step`` to every hop as the start of its run: the first is given the
        token and keeps to a run's end, every other follows what is relayed to it."""
        x = gen.recorded_input(0, step)
        if x is None:
            raise CacheMiss(f"no logged input for layer 0 at step {step}")
        links = gen.links
        for link in links:
            await self.steps.read_unread(link)  # answers on a stream come in order
        links[0].autorun_until = _run_end(gen, step, step)
        without_end = step + gen.params.max_tokens + 1  # the first hop's run bounds theirs
        for link in reversed(links):  # the first last: the others wait for their inputs
            fields: dict[str, Any] = {"forward": not link.samples}
            if link is links[0]:
                fields.update(input=codec.encode(x), autorun_until=links[0].autorun_until)
            else:
                fields.update(relayed=True, rows=1, autorun_until=without_end)
            await link.send(self.steps.step_request(gen, link, step, budget, **fields), budget)
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
                self.steps.exchange(
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
                self.steps.abandon(t)
            error = failed[0].exception()
            assert error is not None
            if isinstance(error, RelayBroken):
                self._cannot_talk(error)
            raise error
        out = self.steps.output(gen, segment[-1], calls[-1].result(), rows)
        for link, call in zip(segment, calls, strict=True):
            link.steps = step + 1  # the token came: every hop before it committed the step
            link.positions += rows
            link.unread = call if link is not segment[-1] else None
        return out

    def _cannot_talk(self, e: RelayBroken) -> None:
        pair = (e.from_node, e.node_id)
        self._no_relay[pair] = time.monotonic() + _NO_RELAY_S
        log.warning("%s cannot reach %s: the driver carries between them", *pair)

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
