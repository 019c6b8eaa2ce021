"""Opening a generation's epoch on every hop of its route, and fencing failed nodes.

Every hop is opened at once; a survivor of the last epoch *resumes* it,
keeping its KV cut back to what the driver saw it commit, which fences the
old epoch there. A failed node is told (if it ever comes back) that the
session moved on. The links an open returns are the driver's to drive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc
import numpy as np

from meshnet.errors import MalformedBundle, StreamReset
from meshnet.model.spec import ModelSpec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.hop_link import HopLink, open_link
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.routing.generation import Generation

HopKey = tuple[str, int, int]  # (node id, layer start, layer end)
Prefix = tuple[np.ndarray, int]  # a fresh generation's prompt ids, and the most to reuse


class EpochOpener:
    """Opens epochs for the driver; one per tracker."""

    def __init__(
        self,
        channels: ChannelPool,
        fingerprint: str,
        spec: ModelSpec,
        open_timeout_s: float,
        fence_timeout_s: float,
    ) -> None:
        self.channels = channels
        self.fingerprint = fingerprint
        self.spec = spec
        self.open_timeout_s = open_timeout_s
        self.fence_timeout_s = fence_timeout_s
        self._background: set[asyncio.Task[Any]] = set()  # fences still on their way

    def fence_later(self, hop: Hop, session_id: str, epoch: int) -> None:
        """Tell a failed node (if it ever comes back) that the session moved on."""
        task = asyncio.create_task(self._fence(hop, session_id, epoch))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _fence(self, hop: Hop, session_id: str, epoch: int) -> None:
        """On a channel of its own: a pooled one to a dead node's address would be in
        reconnect backoff when another node (or its restart) comes to listen there."""
        request = pb.FenceRequest(session_id=session_id, epoch=epoch)
        channel = grpc.aio.insecure_channel(hop.address)
        # Still gone when it times out: then it holds nothing newer, and its streams are closed.
        try:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await pb_grpc.NodeStub(channel).Fence(
                    request,
                    timeout=self.fence_timeout_s,
                    metadata=self.channels.signed(hop.node_id, "Fence"),
                )
        finally:
            await channel.close()

    async def open(
        self,
        gen: Generation,
        route: Route,
        survivors: dict[HopKey, HopLink],
        held: tuple[int, int] | None = None,
        prefix: Prefix | None = None,
    ) -> tuple[list[HopLink], list[HopLink]]:
        """Open the current epoch on every hop at once; survivors resume their KV.
        ``prefix``: each hop of a fresh generation starts with what its prefix cache
        holds of the prompt (node/prefixes.py); its link says how many positions.

        Returns the new links and the old links whose KV was carried over. On
        any failure every opened link is closed and the first hop's (in route
        order) failure is raised.
        """
        # The last hop's next is the first: a ring passes it the tokens it samples.
        after: list[Hop | None] = [*route[1:], route[0] if len(route) > 1 else None]
        opens = [
            self._open_hop(gen, hop, survivors.get(hop_key(hop)), held, nxt, prefix)
            for hop, nxt in zip(route, after, strict=True)
        ]
        results = await asyncio.gather(*opens, return_exceptions=True)
        links = [r[0] for r in results if isinstance(r, tuple)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for link in links:
                link.close()
            raise failure
        carried = [r[1] for r in results if isinstance(r, tuple) and r[1] is not None]
        return links, carried

    async def _open_hop(
        self,
        gen: Generation,
        hop: Hop,
        old: HopLink | None,
        held: tuple[int, int] | None,
        after: Hop | None,
        prefix: Prefix | None = None,
    ) -> tuple[HopLink, HopLink | None]:
        """Open one hop; a survivor ``old`` whose KV the node still holds is carried over
        (cut back to what the driver saw it commit: a relayed step it finished unseen is
        run again), and so is a session's KV of ``held`` (positions, steps) left by its
        last turn. ``after``: the next hop, where it forwards its outputs."""
        rewind = held if old is None else (old.positions, old.steps)
        samples = hop.layers.end == self.spec.n_layers
        message = pb.Open(
            session_id=gen.kv_key,
            epoch=gen.epoch,
            fingerprint=self.fingerprint,
            layer_start=hop.layers.start,
            layer_end=hop.layers.end,
            resume=old is not None or rewind is not None,
            keep=gen.keep,
            rewind=rewind is not None,
            rewind_tokens=rewind[0] if rewind else 0,
            rewind_steps=rewind[1] if rewind else 0,
            sampling=_sampling(gen) if samples else None,
            next_address=after.address if after else "",
            next_node_id=after.node_id if after else "",
            next_token=self.channels.keys.peer(after.node_id, hop.node_id, "relay")
            if after
            else "",
            prefix_ids=prefix[0].tolist() if prefix else (),
            prefix_reuse=prefix[1] if prefix else 0,
            prefix_scope=gen.prefix_scope if prefix else b"",
        )
        try:
            link, opened = await self._open_stream(gen, hop, message)
        except StreamReset:
            # The connection broke under the open (the failure being failed over may have
            # broken it too): the node answered a probe, so it is dialled afresh, once.
            self.channels.retire(hop.address)
            link, opened = await self._open_stream(gen, hop, message)
        held_now = (int(opened.kv_tokens), int(opened.steps))
        link.unparked = bool(opened.unparked)
        if held_now == (0, 0):
            return link, None  # fresh (or the node lost the KV): the log is replayed into it
        if old is None and (held is not None or (prefix and held_now[1] == 1)):
            link.steps, link.positions = held_now[1], held_now[0]
            link.first_position = held_now[0]
            return link, None  # the caller checks it holds what the session committed
        if old is not None and held_now == (old.positions, old.steps):
            link.steps = old.steps
            link.positions = link.first_position = old.positions
            return link, old
        link.close()
        msg = f"node {hop.node_id} resumed {held_now[0]} positions and {held_now[1]} steps"
        raise MalformedBundle(msg, hop.node_id)

    async def _open_stream(
        self, gen: Generation, hop: Hop, message: pb.Open
    ) -> tuple[HopLink, pb.Opened]:
        return await open_link(
            self.channels.stub(hop.address),
            self.channels.keys,
            hop,
            message,
            max(gen.deadline - time.monotonic(), 0.001),
            self.open_timeout_s,
        )


def _sampling(gen: Generation) -> pb.Sampling:
    p = gen.params
    return pb.Sampling(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        repetition_penalty=p.repetition_penalty,
        seed=p.seed or 0,
        top_logprobs=max(gen.top_logprobs, 0),
        logprobs=gen.top_logprobs >= 0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_p=p.min_p,
        logit_bias=dict(p.logit_bias),
        grammar=p.constraint.grammar if p.constraint is not None else "",
        grammar_start=p.constraint.start if p.constraint is not None else 0,
    )


def hop_key(hop: Hop) -> HopKey:
    return (hop.node_id, hop.layers.start, hop.layers.end)
