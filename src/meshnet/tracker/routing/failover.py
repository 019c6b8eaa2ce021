"""Failing a generation over: a new epoch on a route without the failed node.

When a hop fails mid-generation the driver asks the tracker (the ``Fabric``)
for a replacement of the failed span, fetches the inputs of that span from
the surviving hop before it (what it forwarded), opens the next epoch on
every hop of the new route — survivors *resume* it, keeping their KV cut back
to the steps the driver saw them commit, which fences the old epoch — and
replays the logged inputs of the failed span into the replacement only
(steps.py), so the rebuilt KV is bit-identical and the output continues
exactly. When no survivor keeps its KV that is a restart from token zero, by
the same code. The uncertain step is never resent on the old epoch. Every
attempt ends in one ledger record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc

from meshnet.errors import (
    CacheMiss,
    MalformedBundle,
    MeshnetError,
    NodeFailure,
    NoRoute,
    ShardMismatch,
    VerificationFailed,
)
from meshnet.model.spec import ModelSpec
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.hop_link import HopLink
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.routing.epochs import EpochOpener, hop_key
from meshnet.tracker.routing.generation import Generation, PendingRecovery
from meshnet.tracker.routing.limits import DriverLimits

log = logging.getLogger(__name__)


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


class Failover:
    """Moves generations to new epochs when a hop fails; one per route driver."""

    def __init__(
        self, channels: ChannelPool, spec: ModelSpec, limits: DriverLimits, epochs: EpochOpener
    ) -> None:
        self.channels = channels
        self.spec = spec
        self.limits = limits
        self.epochs = epochs

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

    async def fail_over(self, gen: Generation, error: MeshnetError, fabric: Fabric) -> None:
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
