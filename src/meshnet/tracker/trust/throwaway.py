"""Steps on a throwaway session: how the tracker has a node compute something for
itself (a calibration input, a trusted node's re-run of a check) through the same
stream a generation uses, so the node cannot tell the two apart."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np

from meshnet.errors import MalformedBundle
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.hop_link import open_link
from meshnet.tracker.nodes.routes import Hop


async def run_steps(
    channels: ChannelPool,
    fingerprint: str,
    hop: Hop,
    steps: Sequence[np.ndarray],
    timeout_s: float,
) -> list[pb.StepResult]:
    """Run ``steps`` (inputs, in order) on ``hop`` as one session of a fresh id, like any
    generation's, released when its stream ends; their results. ``MeshnetError`` when
    the node was not reached or failed, ``MalformedBundle`` when it answered no result."""
    message = pb.Open(
        session_id=uuid.uuid4().hex,
        epoch=1,
        fingerprint=fingerprint,
        layer_start=hop.layers.start,
        layer_end=hop.layers.end,
    )
    stub = channels.stub(hop.address)
    link, _ = await open_link(stub, channels.keys, hop, message, timeout_s, timeout_s)
    results = []
    try:
        for i, x in enumerate(steps):
            step = pb.Step(step=i, input=codec.encode(x), timeout_ms=int(timeout_s * 1000))
            reply = await link.exchange(pb.ForwardRequest(step=step), timeout_s)
            if reply.WhichOneof("kind") != "result":
                raise MalformedBundle(f"node {hop.node_id} answered no result", hop.node_id)
            results.append(reply.result)
    finally:
        link.close()  # the node releases the session's KV as the stream ends
    return results
