"""The node's ``/metrics`` over HTTP, for the tracker only, and telling the tracker its port.

A node has no other HTTP server. This one serves ``GET /metrics`` and nothing
else, to a request the tracker signed for it: header ``x-meshnet-auth`` holding
``sign_tracker_call(node key, "GET /metrics")`` (``meshnet.auth.signing``), the
same credential the tracker's gRPC calls carry, for a method no gRPC call has.
Anything else is 401 (no or a bad credential, a peer's token) or 404, and a
credential is checked before the path. Operators read a node's metrics through
the tracker, ``GET /admin/nodes/{id}/metrics`` with the admin token
(docs/operating-metrics.md).

Bounded: ``MAX_CLIENTS`` requests at once (more are closed at once), each socket
read or write waits at most ``TIMEOUT_S``, request lines and headers are capped
by ``http.server``.

The port (any free one unless given) is told to the tracker in the node's signed
registration and every heartbeat (``node/announce.py``), so a tracker that
restarted learns it again.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from meshnet.auth.signing import METADATA_KEY, verify_call
from meshnet.errors import Unauthenticated

log = logging.getLogger(__name__)

METRICS_METHOD = "GET /metrics"  # what the tracker signs for a scrape
MAX_CLIENTS = 4
TIMEOUT_S = 5.0


class MetricsServer(ThreadingHTTPServer):
    """Serves one registry's metrics to the tracker, from daemon threads."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, host: str, port: int, key: str, registry: CollectorRegistry) -> None:
        self.key = key
        self.registry = registry
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per request while fewer than ``MAX_CLIENTS`` run; else close it."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def authorized(self, credential: str | None) -> bool:
        """Whether ``credential`` is the tracker's signature of a scrape, fresh."""
        try:
            return verify_call(self.key, METRICS_METHOD, credential).kind == "tracker"
        except Unauthenticated:
            return False


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    timeout = TIMEOUT_S
    protocol_version = "HTTP/1.0"  # one request per connection

    def do_GET(self) -> None:
        if not self.server.authorized(self.headers.get(METADATA_KEY)):
            self._send(401, b"this endpoint needs the tracker's signature\n", "text/plain")
        elif self.path.split("?", 1)[0] != "/metrics":
            self._send(404, b"only /metrics is served here\n", "text/plain")
        else:
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)

    def do_POST(self) -> None:
        self._send(405, b"only GET /metrics is served here\n", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics http: " + format, *args)
