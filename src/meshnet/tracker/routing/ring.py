"""The driver's side of a route whose hops run decode steps round a ring.

Once a route of several hops has run the prompt, its decode steps need no
driver: the first hop is relayed each next token by the last (node/autorun.py).
The driver starts the ring with one step on every hop, keeps the first hop's
run ahead of what it read (``Extend``), and reads the tokens the last hop
answers. The other hops answer only a failure (and, once per chunk of positions,
their commitments, which the link keeps), so each link has a reader of
its own and every answer — a token, or any hop's failure — comes through one
queue, in the order it came.

When no token comes in time the hop to blame is the first in ring order that
does not answer a probe (a frozen node holds up every hop after it); when
every hop answers, it is the last, as on a route driven step by step.
"""

from __future__ import annotations

import asyncio
import time

from meshnet.errors import DeadlineExceeded, MalformedBundle, MeshnetError, StreamReset
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.hop_link import HopLink, answers

Answer = tuple[HopLink, pb.ForwardResponse | MeshnetError]


class Ring:
    """The readers of one epoch's links while their hops run round a ring."""

    def __init__(self, links: list[HopLink], deadline: float) -> None:
        self.links = links  # the generation's links this ring runs on (one epoch's)
        self._answers: asyncio.Queue[Answer] = asyncio.Queue()
        self._readers = [
            asyncio.create_task(self._read(link, deadline, every=link is links[-1]))
            for link in links
        ]

    async def next(self, step: int, timeout_s: float) -> pb.ForwardResponse:
        """The last hop's result of ``step``, or the first failure any hop answers."""
        try:
            async with asyncio.timeout(timeout_s):
                link, answer = await self._answers.get()
        except TimeoutError:
            raise await self._stuck(step, timeout_s) from None
        if isinstance(answer, MeshnetError):
            raise answer
        node = link.node_id
        if link is not self.links[-1]:
            raise MalformedBundle(f"node {node} answered a step it forwards", node)
        if answer.WhichOneof("kind") != "result" or answer.result.step != step:
            raise MalformedBundle(f"node {node} sent no result for step {step}", node)
        return answer

    async def _read(self, link: HopLink, deadline: float, every: bool) -> None:
        """Queue the link's answers (``every``: the tokens of the last hop; else the one
        answer a forwarding hop gives, a failure; its commitments, once a chunk, are kept
        by the link as they come) until its stream ends."""
        while True:
            try:
                reply = await link.receive(max(deadline - time.monotonic(), 0.001))
            except MeshnetError as e:
                self._answers.put_nowait((link, e))
                return
            except Exception as e:  # not news to anyone but the step waiting: typed for it
                self._answers.put_nowait((link, StreamReset(f"reading {link.node_id}: {e}")))
                return
            if not every and reply.WhichOneof("kind") == "committed":
                continue  # the link kept the commitments (HopLink); no answer to a step
            self._answers.put_nowait((link, reply))
            if not every:
                return

    async def _stuck(self, step: int, timeout_s: float) -> DeadlineExceeded:
        """Who held ``step`` up: the first hop that does not answer a probe, else the last."""
        probes = [answers(link.keys, link.hop.address, link.node_id) for link in self.links[:-1]]
        alive = await asyncio.gather(*probes)
        stuck = next((k for k, up in zip(self.links, alive, strict=False) if not up), None)
        node = (stuck or self.links[-1]).node_id
        return DeadlineExceeded(f"node {node} held up step {step} past {timeout_s:.1f}s", node)
