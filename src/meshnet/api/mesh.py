"""The control plane nodes talk to: registration, heartbeats and model manifests, each
signed by the node.

A node speaks only for itself: the id it registers or heartbeats as must be the
one whose key signed the request, so no registration can take over another
node's id or address.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from meshnet.api.auth import CallingNode, auth_of, require_same_node
from meshnet.api.inventory import inventory_of
from meshnet.api.state import models_of, tracker_of, tracker_serving
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.auth.signing import manifest_mac
from meshnet.errors import NotFound, RequestError
from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import MAX_ID, Heartbeat, HeartbeatReply, NodeAnnouncement
from meshnet.model_source.manifest import parse_manifest
from meshnet.model_source.peers import scope
from meshnet.model_source.reference import MAX_REF_CHARS
from meshnet.tracker.nodes.registry import NodeState
from meshnet.tracker.service import Tracker
from meshnet.tracker.serving.manifests import ManifestBook

log = logging.getLogger(__name__)

router = APIRouter()
MAX_PEERS = 16  # peers a fetching node is told of
MAX_REPORTED = 4096  # tensor hashes in one report
HEX = frozenset("0123456789abcdef")


@router.post("/mesh/nodes")
async def register(body: NodeAnnouncement, request: Request, caller: CallingNode) -> dict[str, Any]:
    require_same_node(caller, body.node_id)
    tracker = tracker_serving(request, body.fingerprint)
    tracker.register(body)
    inventory_of(request).note(body.node_id, body.holdings)
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
    inventory_of(request).note(node_id, body.holdings)
    _note_metrics_port(tracker, node_id, body.metrics_port)
    return HeartbeatReply(known=known).model_dump()


@router.get("/mesh/manifest")
async def manifest(
    request: Request,
    caller: CallingNode,
    ref: str = Query(min_length=1, max_length=MAX_REF_CHARS),
    fetch: str | None = Query(None, max_length=32, pattern=r"^\d{1,6}-\d{1,6}$"),
    bulk: str | None = Query(None, max_length=256),
) -> dict[str, Any]:
    """The manifest of per-tensor hashes of the served model named by ``ref`` (as the
    tracker was given it), signed for the calling node with its key: the node checks
    every tensor it fetches against it (``model_source.shard_store``). With the peers
    holding shards of it, and, when the caller says it begins fetching the layers
    ``fetch`` (peers read it at ``bulk``), those that began fetching it before
    (``tracker/nodes/inventory.py``)."""
    book: ManifestBook | None = getattr(request.app.state, "manifests", None)
    text = _manifest_text(request, ref)
    if book is not None:
        text = book.with_learned(text)  # the hashes nodes learned since (first_fetch)
    fingerprint = parse_manifest(text).fingerprint
    digest = hashlib.sha256(text.encode()).hexdigest()
    keys = auth_of(request).keys
    peers = _peers(request, caller, fingerprint)
    if fetch is not None and bulk is not None:
        start, _, end = fetch.partition("-")
        layers = LayerRange(int(start), int(end))  # LayerRangeError (400) when empty
        fetchers = inventory_of(request).fetch_begun(caller, bulk, fingerprint, layers)
        peers += [
            _peer(keys, caller, f.node_id, f.bulk_address, f.layers, fingerprint, fetching=True)
            for f in fetchers[:MAX_PEERS]
        ]
    return {
        "manifest": text,
        "mac": manifest_mac(keys.node_key(caller), caller, digest),
        "peers": peers,
    }


class HashReport(BaseModel):
    """Tensor hashes a node learned fetching them first from the hub (``first_fetch``)."""

    model_config = ConfigDict(extra="forbid")
    ref: str = Field(min_length=1, max_length=MAX_REF_CHARS)
    hashes: dict[str, str] = Field(max_length=MAX_REPORTED)


@router.post("/mesh/hashes")
async def learned_hashes(body: HashReport, request: Request, caller: CallingNode) -> dict[str, Any]:
    """Keep the first hash told for each tensor whose hash the manifest leaves unknown
    (trust on first fetch; with ``--trusted-node`` set, only those nodes are heard);
    answers the hash held for each, which the node checks its bytes against."""
    book: ManifestBook | None = getattr(request.app.state, "manifests", None)
    if book is None:
        raise NotFound("this tracker keeps no learned hashes")
    for name, digest in body.hashes.items():
        if len(name) > 256 or len(digest) != 64 or any(c not in HEX for c in digest):
            raise RequestError("a hash report names a tensor and its BLAKE3, hex")
    manifest = parse_manifest(_manifest_text(request, body.ref))
    trusted = tracker_of(request).trusted_nodes
    heard = body.hashes if not trusted or caller in trusted else {}
    held = book.learn(manifest, heard)
    return {"recorded": held}


def _manifest_text(request: Request, ref: str) -> str:
    """The manifest JSON of the served model by ``ref``, as the tracker read it."""
    book: ManifestBook | None = getattr(request.app.state, "manifests", None)
    text = book.get(ref) if book is not None else None
    for served in models_of(request) if text is None else ():
        if served.info.ref == ref:
            text = served.info.manifest_json
    if text is None:
        raise NotFound("the tracker serves no model by that reference")
    return text


def _peers(request: Request, caller: str, fingerprint: str) -> list[dict[str, Any]]:
    """The up nodes (the caller left out) holding shards of ``fingerprint``, each with a
    token that lets the caller read them over that node's bulk port."""
    tracker = tracker_of(request)
    up = {
        n.node_id for n in tracker.store.nodes() if n.state is NodeState.UP and n.node_id != caller
    }
    keys = auth_of(request).keys
    return [
        _peer(
            keys,
            caller,
            h.node_id,
            h.bulk_address,
            LayerRange(h.shard.layer_start, h.shard.layer_end),
            fingerprint,
        )
        for h in inventory_of(request).holders(fingerprint, up)[:MAX_PEERS]
    ]


def _peer(
    keys: MeshKeys,
    caller: str,
    node_id: str,
    address: str,
    layers: LayerRange,
    fingerprint: str,
    fetching: bool = False,
) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "address": address,
        "layers": [layers.start, layers.end],
        "token": keys.peer(node_id, caller, "pull", scope(fingerprint)),
        "fetching": fetching,  # still fetching it: bytes come as it checks them
    }


def _note_metrics_port(tracker: Tracker, node_id: str, port: int | None) -> None:
    """Where the node serves its /metrics (on the host it registered with); a full table
    of ports costs only that node's metrics, never its registration."""
    if port is not None and not tracker.metrics.scrape_targets.set(node_id, port):
        log.warning("node %s: no room to remember its metrics port", node_id)
