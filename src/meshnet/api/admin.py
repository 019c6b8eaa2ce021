"""Admin endpoints: the node registry, pinned routes, generations, the ledger, health."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from meshnet.api.auth import auth_of, require_admin
from meshnet.api.schemas import PinRouteRequest
from meshnet.api.state import models_of, tracker_of, tracker_serving
from meshnet.api.tenants import Quotas
from meshnet.errors import MeshnetError, NotFound, RequestError
from meshnet.tracker.accounting import billing
from meshnet.tracker.nodes.registry import NodeRecord, NodeState, node_json
from meshnet.tracker.nodes.routes import route_json
from meshnet.tracker.nodes.store import Store

router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/admin/nodes")
async def list_nodes(request: Request) -> dict[str, Any]:
    """Every node's record, and what verification knows of it (every served model's):
    ``trusted`` by configuration (--trusted-node), ``calibrations`` this tracker ran on it
    to an answer, ``trusted_checks``: checks of other nodes' work it took part in."""
    first = tracker_of(request)
    trackers = [m.tracker for m in models_of(request)] or [first]
    nodes = []
    for n in first.store.nodes():
        checking = [t.verification for t in trackers if t.verification is not None]
        calibrations = sum(v.trust.runs[n.node_id] for v in checking)
        checks = sum(v.capacity.checks[n.node_id] for v in checking if v.capacity is not None)
        trusted = n.node_id in first.trusted_nodes
        more = {"trusted": trusted, "calibrations": calibrations, "trusted_checks": checks}
        held = first.inventory.nodes().get(n.node_id)
        fetching = held.fetching.model_dump() if held and held.fetching else None
        nodes.append({**node_json(n), **more, "fetching": fetching})
    return {"nodes": nodes}


@router.post("/admin/nodes/{node_id}/readmit")
async def readmit_node(node_id: str, request: Request) -> dict[str, Any]:
    """Try a quarantined node again (its operator mended it, or the check that failed it
    is in doubt): with verification on for its model it calibrates afresh, on new
    inputs, before it is routed; else it is up. Work already rejected stays rejected."""
    tracker = tracker_of(request)
    node = _registered(tracker.store, node_id)
    if node.state is not NodeState.QUARANTINED:
        raise RequestError(
            f"node {node_id} is {node.state.value}: only a quarantined node is readmitted"
        )
    verification = tracker_serving(request, node.fingerprint).verification
    if verification is None or not verification.readmit(node_id):  # no calibration to run
        tracker.store.set_state(node_id, NodeState.UP, "")
    return {"node_id": node_id, "state": _registered(tracker.store, node_id).state.value}


def _registered(store: Store, node_id: str) -> NodeRecord:
    node = store.node(node_id)
    if node is None:
        raise NotFound(f"no node {node_id!r} is registered")
    return node


@router.get("/admin/routes")
async def current_route(request: Request) -> dict[str, Any]:
    tracker = tracker_of(request)
    pinned = tracker.store.pinned()
    try:
        route: list[dict[str, Any]] | None = route_json(tracker.planner.route())
        reason = None
    except MeshnetError as e:
        route, reason = None, e.message
    return {"pinned": pinned, "route": route, "reason": reason}


@router.post("/admin/routes")
async def pin_route(body: PinRouteRequest, request: Request) -> dict[str, Any]:
    route = tracker_of(request).planner.pin(body.node_ids)
    return {"pinned": body.node_ids, "route": route_json(route)}


@router.delete("/admin/routes")
async def unpin_route(request: Request) -> dict[str, Any]:
    tracker_of(request).store.unpin()
    return {"pinned": None}


@router.get("/admin/generations")
async def list_generations(request: Request) -> dict[str, Any]:
    return {
        "generations": [
            {
                "id": g.id,
                "epoch": g.epoch,
                "route": route_json(g.route),
                "recoveries": len(g.recoveries),
            }
            for g in tracker_of(request).generations()
        ]
    }


@router.post("/admin/generations/{generation_id}/cancel")
async def cancel_generation(generation_id: str, request: Request) -> dict[str, Any]:
    """Stop a running generation; every shard of its route frees its KV and queued steps."""
    if not tracker_of(request).cancel(generation_id, "cancelled by an admin"):
        raise NotFound(f"no running generation {generation_id}")
    return {"id": generation_id, "cancelled": True}


@router.get("/admin/ledger")
async def ledger(
    request: Request,
    generation_id: str | None = None,
    node_id: str | None = None,
    limit: int = Query(1000, ge=1, le=100_000),
) -> dict[str, Any]:
    """Attempts per shard, oldest first, and per-node totals (only completed work bills)."""
    store = tracker_of(request).store
    records = store.ledger(generation_id, node_id, limit)
    return {
        "records": [
            {
                **asdict(r),
                "commitments": r.commitments.hex(),
                "tokens": r.tokens,
                "billable": r.billable,
            }
            for r in records
        ],
        "totals": store.ledger_totals(generation_id),
    }


@router.get("/admin/billing")
async def billing_summary(request: Request) -> dict[str, Any]:
    """What is billable now: per tenant its usage, per node its earnings, and the work
    still waiting on the verifier (``unverified``) or refused by it (``rejected``)."""
    return await run_in_threadpool(billing.usage, tracker_of(request).store.db)  # a scan


class NewTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64)
    requests_per_min: int = Field(default=0, ge=0, le=10**9)
    tokens_per_min: int = Field(default=0, ge=0, le=10**12)
    max_streams: int = Field(default=0, ge=0, le=10**6)
    max_sessions: int = Field(default=0, ge=0, le=10**9)
    max_kv_bytes: int = Field(default=0, ge=0, le=2**62)


@router.post("/admin/tenants")
async def create_tenant(body: NewTenant, request: Request) -> dict[str, Any]:
    """Create a tenant (or set an existing one's quotas; 0 is no limit)."""
    quotas = Quotas(**body.model_dump(exclude={"id"}))
    tenant = auth_of(request).tenants.create_tenant(body.id, quotas)
    return {"id": tenant.id, "quotas": asdict(tenant.quotas)}


@router.get("/admin/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    tenants = auth_of(request).tenants.tenants()
    return {"tenants": [{"id": t.id, "quotas": asdict(t.quotas)} for t in tenants]}


@router.post("/admin/tenants/{tenant_id}/keys")
async def issue_key(tenant_id: str, request: Request) -> dict[str, Any]:
    """A new API key for the tenant; it is shown this once (only its digest is kept)."""
    key, key_id = auth_of(request).tenants.issue_key(tenant_id)
    return {"tenant": tenant_id, "key_id": key_id, "api_key": key}


@router.delete("/admin/keys/{key_id}")
async def revoke_key(key_id: str, request: Request) -> dict[str, Any]:
    auth_of(request).tenants.revoke_key(key_id)
    return {"key_id": key_id, "revoked": True}


@router.get("/admin/loops")
async def loops(request: Request) -> dict[str, Any]:
    """The tracker's background loops: passes run, failures in all and in a row, the last."""
    return {"loops": [asdict(health) for health in request.app.state.loops]}
