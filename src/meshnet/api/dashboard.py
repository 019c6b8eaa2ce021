"""The live dashboard: a static page at ``/dashboard`` and the JSON it polls.

The page (``api/static/dashboard.*``: plain HTML, CSS and JS, no build step, nothing
fetched from elsewhere) holds no data and needs no credential. Its script asks for
the admin token once (a form, or a URL fragment ``#token=...``, which browsers never
send to a server, so it is never in a log), keeps it in the tab's sessionStorage,
and polls ``GET /admin/dashboard`` with it as a Bearer header about every second.

``/admin/dashboard`` (admin token) is one snapshot of the mesh: the model and its
layer coverage, every node (layers, state, heartbeat age, load, streams reserved),
sessions by state, generations in flight, the recent failovers and nodes marked
down, and the tracker's running totals.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Path, Request, Response
from prometheus_client import Gauge
from starlette.concurrency import run_in_threadpool

from meshnet.api.auth import require_admin
from meshnet.api.state import models_of, tracker_of
from meshnet.errors import DatabaseUnavailable, MeshnetError, NotFound
from meshnet.mesh_messages import Holdings
from meshnet.tracker.nodes.registry import NodeRecord, node_json
from meshnet.tracker.nodes.routes import route_json
from meshnet.tracker.service import Tracker
from meshnet.tracker.watch.metrics import counter_total, layer_replicas, session_counts

page = APIRouter()
admin = APIRouter(dependencies=[Depends(require_admin)])

_STATIC = {  # the only files served: no path from the request reaches the filesystem
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# Only this origin's own script and style; no frames (the page is not to be embedded).
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _static(name: str) -> bytes:
    return resources.files("meshnet.api").joinpath("static", name).read_bytes()


@page.get("/dashboard")
async def dashboard_page() -> Response:
    return Response(_static("dashboard.html"), media_type="text/html", headers=_HEADERS)


@page.get("/dashboard/{name}")
async def dashboard_asset(name: str = Path(max_length=32)) -> Response:
    if name not in _STATIC:
        raise NotFound(f"no dashboard file {name!r}")
    return Response(_static(name), media_type=_STATIC[name], headers=_HEADERS)


@admin.get("/admin/dashboard")
async def dashboard_state(request: Request) -> dict[str, Any]:
    """One snapshot of the mesh for the dashboard."""
    tracker = tracker_of(request)
    live = _live(tracker)  # the event loop's own state, read on the loop
    live["generations_in_flight"] = sum(len(m.tracker.generations()) for m in models_of(request))
    trackers = [m.tracker for m in models_of(request)]  # every served model's
    stored = await run_in_threadpool(_stored, tracker, trackers)  # the database's, off it
    return {**live, **stored}


def _live(tracker: Tracker) -> dict[str, Any]:
    m = tracker.metrics
    return {
        "now": time.time(),
        "generations_in_flight": len(tracker.generations()),
        "waiting": _gauge_value(m.waiting),
        "events": [e.as_json() for e in m.events()],
        "totals": {
            "generations": counter_total(m.generations),
            "prompt_tokens": counter_total(m.prompt_tokens),
            "generated_tokens": counter_total(m.generated_tokens),
            "refusals": counter_total(m.refusals),
            "failovers": counter_total(m.failovers),
            "nodes_marked_down": counter_total(m.nodes_down),
        },
        "streams_reserved": dict(tracker.admission.streams),
    }


def _gauge_value(gauge: Gauge) -> float:
    return sum(s.value for metric in gauge.collect() for s in metric.samples)


def _stored(tracker: Tracker, trackers: list[Tracker]) -> dict[str, Any]:
    nodes = tracker.store.nodes()
    held = tracker.inventory.nodes()
    now = time.time()
    try:
        sessions: dict[str, int] | None = session_counts(tracker.store)
    except DatabaseUnavailable:
        sessions = None
    return {
        "models": [_model(t, nodes) for t in trackers],
        "nodes": [
            _node(n, now, tracker.metrics.scrape_targets.port(n.node_id), held.get(n.node_id))
            for n in nodes
        ],
        "sessions": sessions,
    }


def _model(tracker: Tracker, nodes: list[NodeRecord]) -> dict[str, Any]:
    """One served model: its layers' replicas and its route now (or why none)."""
    try:
        route: list[dict[str, Any]] | None = route_json(tracker.planner.route())
        reason = None
    except MeshnetError as e:
        route, reason = None, e.message
    model = tracker.model
    return {
        "name": model.name,
        "fingerprint": model.fingerprint,
        "n_layers": model.spec.n_layers,
        "replicas": layer_replicas(model.fingerprint, model.spec.n_layers, nodes),
        "route": route,
        "reason": reason,
    }


def _node(
    n: NodeRecord, now: float, metrics_port: int | None, held: Holdings | None
) -> dict[str, Any]:
    return {
        **node_json(n),
        "heartbeat_age_s": round(max(0.0, now - n.last_seen), 2),
        "metrics_port": metrics_port,  # its /metrics server, as it said (None: not said)
        # a range of a model by reference it is fetching (None: none)
        "fetching": held.fetching.model_dump() if held and held.fetching else None,
    }
