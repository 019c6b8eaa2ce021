"""The control plane nodes talk to: registration and heartbeats."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Path, Request

from meshnet.api.state import tracker_of
from meshnet.mesh_messages import MAX_ID, Heartbeat, HeartbeatReply, NodeAnnouncement

router = APIRouter()


@router.post("/mesh/nodes")
async def register(body: NodeAnnouncement, request: Request) -> dict[str, Any]:
    tracker_of(request).store.register(body, time.time())
    return {"registered": body.node_id}


@router.post("/mesh/nodes/{node_id}/heartbeat")
async def heartbeat(
    body: Heartbeat, request: Request, node_id: str = Path(max_length=MAX_ID)
) -> dict[str, Any]:
    known = tracker_of(request).store.heartbeat(node_id, body, time.time())
    return HeartbeatReply(known=known).model_dump()
