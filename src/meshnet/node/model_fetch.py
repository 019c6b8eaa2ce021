"""What a node does with model references: fetch its range's tensors, checked; serve
the shards it holds to peers; report them.

The manifest comes from the node's tracker (``GET /mesh/manifest``), signed with
this node's key, and is checked before use, with the peers that hold shards of
the model; the tensors come from those peers first, then from the source (the hub
or a URL), every one checked against the manifest (``model_source.shard_store``).
A shard fetched before (same model, same layers) is opened as it is, without a
byte from the network but the manifest. Peers read this node's shards over its
bulk port (``serve_peer``) with a token the tracker issued them; its heartbeats
report them (``holdings``). A node asking for the manifest to fetch a range says so
(``fetch``, with its bulk address): the tracker names it to a node fetching the same
range after it, which reads each tensor from it as soon as it is checked here
(``model_source.live``: a single flight), not from the hub. The hashes of tensors it
fetches first (the manifest leaves them unknown) go to the tracker as it checks them
(``model_source.first_fetch``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from meshnet.auth.node_http import NodeAuth
from meshnet.auth.signing import require_peer, verify_call, verify_manifest
from meshnet.errors import FetchFailed, MeshnetError, ModelSourceError, PermissionDenied
from meshnet.layer_range import LayerRange
from meshnet.mesh_reports import FetchReport, HoldingsReport
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.inventory import held_shards
from meshnet.model_source.live import LiveFetch
from meshnet.model_source.manifest import Manifest, parse_manifest
from meshnet.model_source.peers import Peer, scope, serve_request
from meshnet.model_source.progress import ProgressBar
from meshnet.model_source.reference import parse_ref
from meshnet.model_source.remote import locate
from meshnet.model_source.shard_store import (
    LocalShard,
    fetch_shard,
    remove_shard,
    shard_part_path,
    shard_paths,
)

log = logging.getLogger(__name__)
_TRACKER_TRIES = 30  # the tracker may still be starting (``meshnet up`` starts both)
_TRACKER_WAIT_S = 1.0
_HOLDINGS_TTL_S = 5.0  # how stale the reported holdings may be (a disk scan each time)
_MAX_PEERS = 16
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


class NodeModels:
    """Local shards of referenced models for one node. Thread-safe: a call per load."""

    def __init__(self, tracker_url: str, node_id: str, key: str, cfg: SourceConfig) -> None:
        self._tracker = tracker_url.rstrip("/")
        self._node_id, self._key, self.cfg = node_id, key, cfg
        self.bulk_address: str | None = None  # where peers read our shards (set once bound)
        self._held: tuple[float, HoldingsReport] | None = None
        self._fetching: tuple[str, LayerRange, ProgressBar] | None = None
        self._live: dict[tuple[str, LayerRange], LiveFetch] = {}  # fetches peers may read
        self._serving: Path | None = None  # the shard file this node loaded last
        self._lock = threading.Lock()

    def shard(self, ref: str, layers: LayerRange) -> LocalShard:
        """The local shard of ``layers`` of ``ref``, fetched now when not kept."""
        manifest, peers = self.manifest_and_peers(ref, layers)
        paths = shard_paths(self.cfg, manifest.fingerprint, layers, len(manifest.files))
        if paths[0].is_file():
            return LocalShard(paths[0], manifest.fingerprint, layers)
        bar = ProgressBar(f"{ref} {layers}", manifest.size, draw=self.cfg.progress)
        started = time.monotonic()
        live, key = LiveFetch(paths), (manifest.fingerprint, layers)
        with self._lock:
            self._fetching = (ref, layers, bar)
            self._live[key] = live
        try:
            shard = fetch_shard(
                lambda: locate(parse_ref(ref), self.cfg),
                manifest,
                layers,
                self.cfg,
                bar,
                peers,
                live,
                _TrackerLedger(self, ref),
            )
        finally:
            bar.close()
            with self._lock:
                self._fetching = None
                self._live.pop(key, None)
                self._held = None  # report the new shard at the next beat
        log.info(
            "fetched layers %s of %s: %d of its %d bytes (%d from peers) in %.1f s",
            layers, ref, shard.fetched_bytes, manifest.size, shard.from_peers,
            time.monotonic() - started,
        )  # fmt: skip
        return shard

    def serving(self, path: Path | None) -> None:
        """The node now serves ``path`` (None: a local file, or nothing): the shard file
        it served before is dropped, its range no longer served here. Every process
        copies what it loads out of the file, so one that still serves that range (a
        node of this machine sharing the cache) goes on; a peer asking for it falls
        back to the others or the hub."""
        with self._lock:
            old, self._serving = self._serving, path
            self._held = None
        if old is not None and old != path:
            remove_shard(old)
            log.info("dropped %s: this node no longer serves that range", old)

    def manifest(self, ref: str) -> Manifest:
        """The tracker's manifest of ``ref``, its signature checked with this node's key."""
        return self.manifest_and_peers(ref)[0]

    def manifest_and_peers(
        self, ref: str, fetching: LayerRange | None = None
    ) -> tuple[Manifest, list[Peer]]:
        """The manifest (checked) and the peers holding shards of it, as the tracker says;
        ``fetching``: the range this node is about to fetch, said to the tracker."""
        answer = self._ask(ref, fetching)
        try:
            text, mac = str(answer["manifest"]), str(answer["mac"])
            raw_peers = answer.get("peers") or []
            if not isinstance(raw_peers, list):
                raise TypeError("the peers are not a list")
            peers = [_peer(p) for p in raw_peers[:_MAX_PEERS]]
        except (KeyError, TypeError, ValueError, IndexError, MeshnetError):
            raise ModelSourceError("the tracker's manifest answer is malformed") from None
        verify_manifest(self._key, self._node_id, hashlib.sha256(text.encode()).hexdigest(), mac)
        return parse_manifest(text), peers

    def report_hashes(self, ref: str, hashes: dict[str, str]) -> dict[str, str]:
        """Tell the tracker the hashes of tensors fetched first here; the hashes it holds
        for them after (none when it did not answer: the fetch goes on unreported)."""
        try:
            r = httpx.post(
                f"{self._tracker}/mesh/hashes",
                json={"ref": ref, "hashes": hashes},
                auth=NodeAuth(self._node_id, self._key),
                timeout=30,
            )
            held = r.json().get("recorded") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            log.warning("the tracker did not take %d learned hashes: %s", len(hashes), e)
            return {}
        if not isinstance(held, dict):
            log.warning("the tracker refused learned hashes: %s", r.status_code)
            return {}
        return {str(k): str(v) for k, v in held.items() if isinstance(v, str)}

    def holdings(self) -> HoldingsReport:
        """What heartbeats report: the bulk port, the whole shards in the cache, and the
        fetch under way (its bytes done and to do, its rate)."""
        now = time.monotonic()
        with self._lock:
            if self._held is None or now - self._held[0] > _HOLDINGS_TTL_S:
                held = held_shards(self.cfg) if self.bulk_address else []
                self._held = (now, {"bulk_address": self.bulk_address, "shards": held})
            held_now, fetching = self._held[1], self._fetching
        if fetching is None:
            return held_now
        ref, layers, bar = fetching
        progress: FetchReport = {
            "ref": ref,
            "layer_start": layers.start,
            "layer_end": layers.end,
            "done_bytes": bar.done,
            "total_bytes": bar.total,
            "bytes_per_s": bar.rate(now),
        }
        return {**held_now, "fetching": progress}

    def serve_peer(self, conn: socket.socket) -> None:
        """Answer a peer's request for shard bytes on the bulk port (``model_source.peers``)."""
        serve_request(conn, self._authorize, self._path_of)

    def _authorize(self, token: str, fingerprint: str) -> None:
        caller = verify_call(self._key, "shard", token)
        if caller.kind != "peer":
            raise PermissionDenied("shard bytes go to peers with a token")
        require_peer(caller, "pull", scope(fingerprint))

    def _path_of(
        self, fingerprint: str, layers: LayerRange, part: int, offset: int, length: int
    ) -> Path:
        """The file of a shard kept here, else of one being fetched (``PeerNotYet`` for
        bytes it has not checked yet)."""
        if not _FINGERPRINT.match(fingerprint):
            raise ModelSourceError("not a fingerprint")
        try:
            return shard_part_path(self.cfg, fingerprint, layers, part)
        except ModelSourceError:
            with self._lock:
                live = self._live.get((fingerprint, layers))
            if live is None:
                raise
            return live.path_for(part, offset, length)

    def _ask(self, ref: str, fetching: LayerRange | None) -> dict[str, object]:
        auth = NodeAuth(self._node_id, self._key)
        params = {"ref": ref}
        if fetching is not None and self.bulk_address is not None:
            params |= {"fetch": f"{fetching.start}-{fetching.end}", "bulk": self.bulk_address}
        for attempt in range(1, _TRACKER_TRIES + 1):
            try:
                r = httpx.get(
                    f"{self._tracker}/mesh/manifest", params=params, auth=auth, timeout=30
                )
            except httpx.TransportError as e:
                if attempt == _TRACKER_TRIES:
                    raise FetchFailed(f"the tracker did not answer for {ref}: {e}") from None
                time.sleep(_TRACKER_WAIT_S)
                continue
            if r.status_code == 404:
                raise ModelSourceError(f"the tracker serves no model by {ref!r}")
            if r.status_code != 200:
                raise FetchFailed(f"the tracker answered {r.status_code} for {ref}'s manifest")
            body = r.json()
            if not isinstance(body, dict):
                raise ModelSourceError("the tracker's manifest answer is malformed")
            return body
        raise FetchFailed(f"the tracker did not answer for {ref}")


class _TrackerLedger:
    """``first_fetch.Ledger`` through this node's tracker."""

    def __init__(self, models: NodeModels, ref: str) -> None:
        self._models, self._ref = models, ref

    def recorded(self, name: str) -> str | None:
        try:
            t = self._models.manifest(self._ref).by_name().get(name)
        except MeshnetError as e:
            log.warning("no manifest from the tracker: %s", e)
            return None
        return t.blake3 if t is not None else None

    def report(self, name: str, digest: str) -> str | None:
        return self._models.report_hashes(self._ref, {name: digest}).get(name)


def _peer(raw: Any) -> Peer:
    layers = LayerRange(int(raw["layers"][0]), int(raw["layers"][1]))
    address, node_id, token = str(raw["address"]), str(raw["node_id"]), str(raw["token"])
    if not address or len(address) > 256 or len(token) > 1024:
        raise ValueError("a malformed peer")
    return Peer(node_id, address, layers, token, raw.get("fetching") is True)


def progress_wanted() -> bool:
    """Draw fetch progress bars only on a terminal (a log file gets the summary line)."""
    return sys.stderr.isatty()
