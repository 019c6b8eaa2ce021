"""Register with the tracker, then heartbeat with the node's load until stopped.

Registration is retried with backoff until the tracker answers (it may start
after the node); a heartbeat answered with ``known: false`` (the tracker
restarted and lost us) triggers a new registration.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import httpx

from meshnet.auth.node_http import NodeAuth
from meshnet.mesh_reports import (
    AnnouncementReport,
    HeartbeatReport,
    HoldingsReport,
    LoadReport,
    heartbeat_known,
    no_holdings,
)
from meshnet.node.engine_types import EngineStats
from meshnet.node.memory_offer import offered_memory

log = logging.getLogger(__name__)


class Announcer:
    """Keeps the tracker informed about one node, from a background thread."""

    def __init__(
        self,
        tracker_url: str,
        node_id: str,
        node_key: str,
        address: str,
        backend: str,
        kv_budget_bytes: int,
        stats: Callable[[], EngineStats],
        interval_s: float = 1.0,
        metrics_port: int | None = None,
        holdings: Callable[[], HoldingsReport] = no_holdings,
        memory_cap_bytes: int = 0,
    ) -> None:
        self.tracker_url = tracker_url.rstrip("/")
        self.node_id = node_id
        self._auth = NodeAuth(node_id, node_key)
        self.metrics_port = metrics_port  # told each beat: a restarted tracker learns it again
        self.address = address
        self.backend = backend
        self.kv_budget_bytes = kv_budget_bytes
        self.stats = stats
        self.holdings = holdings  # the shards on disk peers may fetch, told each beat
        self.interval_s = interval_s
        self.memory_cap_bytes = memory_cap_bytes  # --memory-mb: what it offers at most
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announcer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with tracker_client(self.tracker_url, self._auth) as http:
            registered = False
            backoff = 0.1
            while not self._stop.is_set():
                try:
                    registered = self._register(http) if not registered else self._beat(http)
                    backoff = 0.1
                except httpx.HTTPStatusError as e:
                    status = e.response.status_code
                    if status in (401, 403):
                        log.error(
                            "the tracker at %s refused node %s's credential (%d): is its key "
                            "from this mesh's secret?",
                            self.tracker_url,
                            self.node_id,
                            status,
                        )
                    else:
                        log.warning("the tracker at %s answered %d", self.tracker_url, status)
                    registered = False
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                except (httpx.HTTPError, ValueError) as e:
                    log.warning("tracker unreachable at %s: %s", self.tracker_url, e)
                    registered = False
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                self._stop.wait(self.interval_s if registered else backoff)

    def _register(self, http: httpx.Client) -> bool:
        body: AnnouncementReport = {
            "node_id": self.node_id,
            "address": self.address,
            "backend": self.backend,
            "kv_budget_bytes": self.kv_budget_bytes,
            "pid": os.getpid(),
            **self._heartbeat(),
        }
        r = http.post(f"{self.tracker_url}/mesh/nodes", json=body)
        r.raise_for_status()
        log.info("registered with %s as %s", self.tracker_url, self.node_id)
        return True

    def _beat(self, http: httpx.Client) -> bool:
        body = self._heartbeat()
        r = http.post(f"{self.tracker_url}/mesh/nodes/{self.node_id}/heartbeat", json=body)
        r.raise_for_status()
        return heartbeat_known(r.json())

    def _heartbeat(self) -> HeartbeatReport:
        return _heartbeat(
            self.stats(), self.metrics_port, self.holdings(), offered_memory(self.memory_cap_bytes)
        )


def tracker_client(tracker_url: str, auth: httpx.Auth) -> httpx.Client:
    """The client a node keeps for its tracker. Over plain http it loads no certificate
    authorities: never used there (the client follows no redirect to https), the CA
    bundle alone kept ~1.6 MB resident in every node for its life."""
    return httpx.Client(timeout=5.0, auth=auth, verify=tracker_url.startswith("https://"))


def _heartbeat(
    s: EngineStats, metrics_port: int | None, holdings: HoldingsReport, free_memory: int = 0
) -> HeartbeatReport:
    """What the node says about itself every beat (and, with more, when registering)."""
    return {
        "load": _load(s, free_memory),
        "fingerprint": s.fingerprint,
        "layer_start": s.layers.start if s.layers else 0,
        "layer_end": s.layers.end if s.layers else 0,
        "metrics_port": metrics_port,
        "holdings": holdings,
    }


def _load(s: EngineStats, free_memory: int = 0) -> LoadReport:
    return {
        "sessions": s.sessions,
        "kv_bytes": s.kv_bytes,
        "queue_depth": s.queue_depth,
        "steps": s.steps,
        "kv_peak_bytes": s.kv_peak_bytes,
        "last_batch": s.last_batch,
        "max_batch": s.max_batch,
        "tokens_per_s": round(s.tokens_per_s, 2),
        "max_streams": s.max_streams,
        "relayed": s.relayed,
        "context": s.context,
        "free_memory_bytes": free_memory,
    }
