"""What a node does with a model reference: fetch its range's tensors, checked.

The manifest comes from the node's tracker (``GET /mesh/manifest``), signed with
this node's key, and is checked before use; the tensors come from the source
(the hub or a URL, ``model_source.shard_store``) and are checked against it. A
shard fetched before (same model, same layers) is opened as it is, without a
byte from the network but the manifest.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time

import httpx

from meshnet.auth.node_http import NodeAuth
from meshnet.auth.signing import verify_manifest
from meshnet.errors import FetchFailed, ModelSourceError
from meshnet.layer_range import LayerRange
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.manifest import Manifest, parse_manifest
from meshnet.model_source.progress import ProgressBar
from meshnet.model_source.reference import parse_ref
from meshnet.model_source.remote import locate
from meshnet.model_source.shard_store import LocalShard, fetch_shard, shard_path

log = logging.getLogger(__name__)
_TRACKER_TRIES = 30  # the tracker may still be starting (``meshnet up`` starts both)
_TRACKER_WAIT_S = 1.0


class NodeModels:
    """Local shards of referenced models for one node. Thread-safe: a call per load."""

    def __init__(self, tracker_url: str, node_id: str, key: str, cfg: SourceConfig) -> None:
        self._tracker = tracker_url.rstrip("/")
        self._node_id, self._key, self.cfg = node_id, key, cfg

    def shard(self, ref: str, layers: LayerRange) -> LocalShard:
        """The local shard of ``layers`` of ``ref``, fetched now when not kept."""
        manifest = self.manifest(ref)
        kept = shard_path(self.cfg, manifest.fingerprint, layers)
        if kept.is_file():
            return LocalShard(kept, manifest.fingerprint, layers)
        model = locate(parse_ref(ref), self.cfg)
        bar = ProgressBar(f"{ref} {layers}", manifest.size) if self.cfg.progress else None
        started = time.monotonic()
        try:
            shard = fetch_shard(model, manifest, layers, self.cfg, bar)
        finally:
            if bar is not None:
                bar.close()
        seconds = time.monotonic() - started
        log.info(
            "fetched layers %s of %s: %d of its %d bytes in %.1f s",
            layers, ref, shard.fetched_bytes, manifest.size, seconds,
        )  # fmt: skip
        return shard

    def manifest(self, ref: str) -> Manifest:
        """The tracker's manifest of ``ref``, its signature checked with this node's key."""
        answer = self._ask(ref)
        try:
            text, mac = str(answer["manifest"]), str(answer["mac"])
        except (KeyError, TypeError):
            raise ModelSourceError("the tracker's manifest answer is malformed") from None
        verify_manifest(self._key, self._node_id, hashlib.sha256(text.encode()).hexdigest(), mac)
        return parse_manifest(text)

    def _ask(self, ref: str) -> dict[str, object]:
        auth = NodeAuth(self._node_id, self._key)
        for attempt in range(1, _TRACKER_TRIES + 1):
            try:
                r = httpx.get(
                    f"{self._tracker}/mesh/manifest", params={"ref": ref}, auth=auth, timeout=30
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


def progress_wanted() -> bool:
    """Draw fetch progress bars only on a terminal (a log file gets the summary line)."""
    return sys.stderr.isatty()
