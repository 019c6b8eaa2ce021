"""Prometheus metrics over HTTP: the tracker's own, each node's through the tracker, and
the HTTP requests the tracker answers.

- ``GET /metrics`` (admin token): the tracker's registry (``tracker/watch/metrics.py``) in
  Prometheus' text format; read off the event loop (it queries the database).
- ``GET /admin/nodes/{id}/metrics`` (admin token): that node's metrics, fetched from
  the node's own metrics server with a call the tracker signs for it; the node
  serves nobody else (``node/metrics_http.py``). The host dialled is the one the
  node registered, the port the one its signed registration and heartbeats say.
- ``CountRequests``: every HTTP answer counted by method, route template (never the
  raw path, which would make a series per session id) and status.
"""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Depends, Path, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.api.auth import auth_of, require_admin
from meshnet.api.state import tracker_of
from meshnet.auth.signing import METADATA_KEY, sign_tracker_call
from meshnet.errors import NodeFailure, NotFound
from meshnet.mesh_messages import MAX_ID
from meshnet.tracker.watch.metrics import TrackerMetrics

NODE_METRICS_METHOD = "GET /metrics"  # what a node's metrics server checks the signature of
MAX_NODE_METRICS_BYTES = 8 << 20  # a node's answer past this is cut off: refused
NODE_TIMEOUT_S = 5.0

admin = APIRouter(dependencies=[Depends(require_admin)])


@admin.get("/metrics")
async def tracker_metrics(request: Request) -> Response:
    body = await run_in_threadpool(generate_latest, tracker_of(request).metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@admin.get("/admin/nodes/{node_id}/metrics")
async def node_metrics(request: Request, node_id: str = Path(max_length=MAX_ID)) -> Response:
    """The node's metrics, fetched now over a call the tracker signs."""
    tracker = tracker_of(request)
    node = tracker.store.node(node_id)
    if node is None:
        raise NotFound(f"no node {node_id!r}")
    port = tracker.metrics.scrape_targets.port(node_id)
    if port is None:
        raise NotFound(f"node {node_id} has not said where its metrics are (off, or not yet)")
    host = node.address.rsplit(":", 1)[0]
    credential = sign_tracker_call(auth_of(request).keys.node_key(node_id), NODE_METRICS_METHOD)
    body = await _fetch(f"http://{host}:{port}/metrics", {METADATA_KEY: credential}, node_id)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def _fetch(url: str, headers: dict[str, str], node_id: str) -> bytes:
    """The body of a node's 200 answer; ``NodeFailure`` (502) for anything else."""
    try:
        async with (
            httpx.AsyncClient(timeout=NODE_TIMEOUT_S) as http,
            http.stream("GET", url, headers=headers) as r,
        ):
            if r.status_code != 200:
                raise NodeFailure(f"node {node_id}'s metrics answered {r.status_code}", node_id)
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_NODE_METRICS_BYTES:
                    raise NodeFailure(f"node {node_id}'s metrics are too large", node_id)
            return bytes(body)
    except httpx.HTTPError as e:
        raise NodeFailure(f"node {node_id}'s metrics are unreachable: {e}", node_id) from None


class CountRequests:
    """ASGI middleware: counts each answer in ``metrics.http`` once its status is sent."""

    def __init__(self, app: ASGIApp, metrics: TrackerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # what a handler that raised past every error handler sends

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.http.labels(method, template, str(status[0])).inc()


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
