"""Telling a node to load a span, or to empty itself: a T3 ``Configure``, and what it came to.

Failover healing (tracker/healing.py), the placement controller
(tracker/serving/placement.py) and the model admin (tracker/serving/model_admin.py)
all load spans this way; none of them changes the registry here.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from meshnet.layer_range import LayerRange
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.nodes.registry import NodeRecord
from meshnet.tracker.nodes.routes import Hop


@dataclass(frozen=True)
class LoadResult:
    """What a load came to: the hop the node serves now, or why not."""

    hop: Hop | None
    failure: str = ""  # when ``hop`` is None: the node's refusal or the call's error
    emptied: bool = False  # an unload that succeeded (no hop: the node serves nothing)

    @property
    def ok(self) -> bool:
        return self.hop is not None or self.emptied


async def configure_span(
    channels: ChannelPool,
    node: NodeRecord,
    span: LayerRange,
    fingerprint: str,
    timeout_s: float,
    model_path: str = "",
) -> LoadResult:
    """Send ``node`` a T3 ``Configure`` for ``span`` of ``model_path`` (as the node sees
    it; "": its start model); the hop when it loaded the model with ``fingerprint``.
    Changes nothing in the registry."""
    load = pb.LoadShard(model_path=model_path, layer_start=span.start, layer_end=span.end)
    request = pb.ConfigureRequest(load=load)
    try:
        reply = await channels.stub(node.address).Configure(
            request, timeout=timeout_s, metadata=channels.signed(node.node_id, "Configure")
        )
    except grpc.aio.AioRpcError as e:
        return LoadResult(None, f"Configure failed: {e.code().name} {e.details() or ''}".strip())
    if not reply.applied:
        return LoadResult(None, f"refused: {reply.failure.kind}: {reply.failure.message}")
    if reply.fingerprint != fingerprint:
        return LoadResult(None, f"loaded another model ({reply.fingerprint[:12]})")
    return LoadResult(Hop(node.node_id, node.address, span))


async def unload_node(channels: ChannelPool, node: NodeRecord, timeout_s: float) -> LoadResult:
    """Send ``node`` a T3 ``Configure`` to empty itself. Changes nothing in the registry."""
    request = pb.ConfigureRequest(load=pb.LoadShard())
    try:
        reply = await channels.stub(node.address).Configure(
            request, timeout=timeout_s, metadata=channels.signed(node.node_id, "Configure")
        )
    except grpc.aio.AioRpcError as e:
        return LoadResult(None, f"Configure failed: {e.code().name} {e.details() or ''}".strip())
    if not reply.applied:
        return LoadResult(None, f"refused: {reply.failure.kind}: {reply.failure.message}")
    return LoadResult(None, emptied=True)
