"""One step through a generation's hops, each in turn, and the hops' answers checked.

When hops hold different steps (after a failover) the driver sends a step
through each hop in turn, carrying the hidden states between them and logging
them per layer boundary; a hop that lacks earlier steps is sent them again
from that log (``replay``): each prompt as it was first sent, each run of
decode steps as one message whose rows the node computes exactly as the
one-row steps they were, so the rebuilt KV is bit-identical. Every answer is
checked here: a result for the step asked, hidden states of the right shape, a
sampled id of the vocabulary with log-probabilities <= 0.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from meshnet.errors import CacheMiss, DeadlineExceeded, MalformedBundle
from meshnet.model.logprobs import TokenLogprobs
from meshnet.model.spec import ModelSpec
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.hop_link import HopLink
from meshnet.tracker.routing.generation import Generation
from meshnet.tracker.routing.limits import DriverLimits

_FORWARD_GRACE = 1.5


class HopSteps:
    """Sends steps to hops and reads their results; one per route driver."""

    def __init__(self, spec: ModelSpec, limits: DriverLimits) -> None:
        self.spec = spec
        self.limits = limits
        self._background: set[asyncio.Task[Any]] = set()  # abandoned answers still running

    @staticmethod
    async def read_unread(link: HopLink) -> None:
        """A forwarding hop's answer to its previous step: an acknowledgement, or the
        failure that step met after all (raised now, and failed over as usual)."""
        task, link.unread = link.unread, None
        if task is not None:
            await task

    async def replay(self, gen: Generation, first: int, end: int) -> None:
        """Send logged steps ``[first, end)`` to the hops lacking them: each prompt as it
        was first sent, each run of decode steps as one message."""
        s = first
        while s < end:
            if gen.step_rows(s) != 1:
                await self.run_step(gen, s)
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
                await self.run_step(gen, s)
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
            out = await self.send(gen, link, first, x, replay=True)
            x = out if isinstance(out, np.ndarray) else None  # the last hop's token is known
            link.steps = end
            link.positions += rows

    async def run_step(self, gen: Generation, step: int) -> TokenLogprobs | None:
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
            out = await self.send(gen, link, step, x)
            x = out if isinstance(out, np.ndarray) else None
            link.steps = step + 1
            link.positions += rows
        return out if isinstance(out, TokenLogprobs) else None

    async def send(
        self,
        gen: Generation,
        link: HopLink,
        step: int,
        x: np.ndarray,
        replay: bool = False,
    ) -> np.ndarray | TokenLogprobs:
        """One step through one hop: its hidden states, or the last hop's sampled token."""
        rows = int(x.shape[0])
        reply = await self.exchange(gen, link, step, rows, 1, input=codec.encode(x), replay=replay)
        return self.output(gen, link, reply, rows)

    def output(
        self, gen: Generation, link: HopLink, reply: pb.ForwardResponse, rows: int
    ) -> np.ndarray | TokenLogprobs:
        """A hop's answer, checked: the sampled token, or hidden states of every row."""
        node = link.node_id
        if link.samples:
            return self.sampled(reply.result, gen.top_logprobs, node)
        limits = codec.TensorLimits("f32", 2, self.spec.context_length, self.spec.d_model)
        try:
            out = codec.decode(reply.result.output, limits)
        except MalformedBundle as e:
            raise MalformedBundle(f"node {node} sent a bad tensor: {e.message}", node) from None
        if out.shape[0] != rows:
            raise MalformedBundle(f"node {node} returned {out.shape[0]} rows", node)
        return out

    async def exchange(
        self, gen: Generation, link: HopLink, step: int, size: int, waits: int, **fields: Any
    ) -> pb.ForwardResponse:
        """Send ``Step(step, **fields)`` to a hop and read its result, within a budget of
        ``waits`` steps of ``size`` rows (a relayed hop waits for the hops before it)."""
        await self.read_unread(link)  # answers on a stream come in order
        budget = self.budget(gen, size, waits)
        request = self.step_request(gen, link, step, budget, **fields)
        # A forwarding hop gets to answer past its own deadline: when the next hop does
        # not take its output in time, it says so and names it.
        wait = budget * _FORWARD_GRACE if fields.get("forward") else budget
        return await self.read_result(gen, link, step, wait, request)

    def budget(self, gen: Generation, size: int, waits: int) -> float:
        """Seconds for ``waits`` steps of ``size`` rows, within the generation's deadline."""
        budget = (self.limits.step_timeout_s + size * self.limits.row_timeout_s) * waits
        budget = min(budget, gen.deadline - time.monotonic())
        if budget <= 0:
            raise DeadlineExceeded("the generation ran past its deadline")
        return budget

    @staticmethod
    def step_request(
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
    async def read_result(
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

    def abandon(self, task: asyncio.Task[Any]) -> None:
        """Keep a task whose result no longer matters until it ends, its error unraised."""
        self._background.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an abandoned answer's failure is not news

    def sampled(self, result: pb.StepResult, top: int, node: str) -> TokenLogprobs:
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
