"""The control plane nodes talk to: registration and heartbeats, each signed by the node.

A node speaks only for itself: the id it registers or heartbeats as must be the
one whose key signed the request, so no registration can take over another
node's id or address.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Path, Request

from meshnet.api.auth import CallingNode, require_same_node
from meshnet.api.state import tracker_serving
from meshnet.mesh_messages import MAX_ID, Heartbeat, HeartbeatReply, NodeAnnouncement
from meshnet.tracker.service import Tracker

log = logging.getLogger(__name__)

router = APIRouter()


@router.post("/mesh/nodes")
async def register(body: NodeAnnouncement, request: Request, caller: CallingNode) -> dict[str, Any]:
    require_same_node(caller, body.node_id)
    tracker = tracker_serving(request, body.fingerprint)
    tracker.register(body)
    _note_metrics_port(tracker, body.node_id, body.metrics_port)
    return {"registered": body.node_id}


@router.post("/mesh/nodes/{node_id}/heartbeat")
async def heartbeat(
    body: Heartbeat,
    request: Request,
    caller: CallingNode,
    node_id: str = Path(max_length=MAX_ID),
) -> dict[str, Any]:
    require_same_node(caller, node_id)
    tracker = tracker_serving(request, body.fingerprint)
    known = tracker.heartbeat(node_id, body)
    _note_metrics_port(tracker, node_id, body.metrics_port)
    return HeartbeatReply(known=known).model_dump()


def _note_metrics_port(tracker: Tracker, node_id: str, port: int | None) -> None:
    """Where the node serves its /metrics (on the host it registered with); a full table
    of ports costs only that node's metrics, never its registration."""
    if port is not None and not tracker.metrics.scrape_targets.set(node_id, port):
        log.warning("node %s: no room to remember its metrics port", node_id)
