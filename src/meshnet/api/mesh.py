"""The control plane nodes talk to: registration and heartbeats, each signed by the node.

A node speaks only for itself: the id it registers or heartbeats as must be the
one whose key signed the request, so no registration can take over another
node's id or address.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Path, Request

from meshnet.api.auth import CallingNode, require_same_node
from meshnet.api.state import tracker_of
from meshnet.mesh_messages import MAX_ID, Heartbeat, HeartbeatReply, NodeAnnouncement

router = APIRouter()


@router.post("/mesh/nodes")
async def register(body: NodeAnnouncement, request: Request, caller: CallingNode) -> dict[str, Any]:
    require_same_node(caller, body.node_id)
    tracker_of(request).store.register(body, time.time())
    return {"registered": body.node_id}


@router.post("/mesh/nodes/{node_id}/heartbeat")
async def heartbeat(
    body: Heartbeat,
    request: Request,
    caller: CallingNode,
    node_id: str = Path(max_length=MAX_ID),
) -> dict[str, Any]:
    require_same_node(caller, node_id)
    known = tracker_of(request).store.heartbeat(node_id, body, time.time())
    return HeartbeatReply(known=known).model_dump()
