"""Where a shard's bytes come from: this machine's other shards of the model, the peers
holding a part, then the hub.

Another whole shard file of the same model in the cache (the range a node served
before a T3 reconfigure, or another node's of this machine) gives its tensors from
disk: a reconfigure fetches only what the new range adds.

A peer still fetching a part itself (a single flight, ``live``) is asked again after
a wait doubling from 0.1 s to 1 s, up to ``cfg.peer_wait_s`` for one chunk; then it
counts as refusing. A peer that refuses, drops the connection or gives bytes that
fail their hash is not asked again during this fetch; the hub is tried ``cfg.attempts`` times per
part (each of its range requests retried on its own, ``ranged``). The hub's file
is located only when a part needs it, so a mesh whose peers hold every part asks
the hub for nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshnet.errors import ModelSourceError
from meshnet.layer_range import LayerRange
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.manifest import Manifest
from meshnet.model_source.peers import Peer, PeerNotYet, PeerRefused, read_from_peer
from meshnet.model_source.ranged import Sink, stream_range
from meshnet.model_source.remote import RemoteModel, hf_headers

log = logging.getLogger(__name__)

HUB: Literal["hub"] = "hub"
_FIRST_WAIT_S, _MAX_WAIT_S = 0.1, 1.0  # asking a peer again for bytes it is fetching


@dataclass(frozen=True)
class LocalShard:
    """A whole shard of the model on this machine: its file per part of the model."""

    paths: tuple[Path, ...]
    layers: LayerRange

    @property
    def path(self) -> Path:
        return self.paths[0]


Source = LocalShard | Peer | Literal["hub"]
Hub = RemoteModel | Callable[[], RemoteModel]


class Sources:
    """The sources of one fetch, and the bytes each gave (``fetched``, ``from_peers``)."""

    def __init__(
        self,
        hub: Hub,
        peers: list[Peer],
        manifest: Manifest,
        cfg: SourceConfig,
        local: list[LocalShard] | None = None,
    ) -> None:
        self._hub = hub
        self.local = local or []
        self._model: tuple[RemoteModel, dict[str, str]] | None = None
        self.peers, self.manifest, self.cfg = peers, manifest, cfg
        self.fetched = 0  # from the network
        self.from_peers = 0  # of which from peers
        self.from_disk = 0  # copied from local shards

    def order(
        self, holds: Callable[[LayerRange], bool] | None, peers: bool = True
    ) -> Iterator[Source]:
        """The sources to try for one part, in order: local shards and (unless not
        ``peers``) peers holding it (``holds`` of their layers; None: every one), then
        the hub ``cfg.attempts`` times."""
        for shard in list(self.local):
            if shard in self.local and (holds is None or holds(shard.layers)):
                yield shard
        for peer in list(self.peers) if peers else ():
            if peer in self.peers and (holds is None or holds(peer.layers)):
                yield peer
        for _ in range(self.cfg.attempts):
            yield HUB

    def drop(self, source: Source, error: Exception) -> None:
        if isinstance(source, LocalShard) and source in self.local:
            log.warning("%s gives no more tensors: %s", source.path, error)
            self.local.remove(source)
        if isinstance(source, Peer) and source in self.peers:
            log.warning("peer %s gives no more shard bytes: %s", source.node_id, error)
            self.peers.remove(source)

    def mismatch(self, source: Source, what: str) -> None:
        """``source`` gave bytes of ``what`` that fail their hash."""
        name = (
            source.node_id
            if isinstance(source, Peer)
            else str(source.path)
            if isinstance(source, LocalShard)
            else "the hub"
        )
        log.warning("%s of %s from %s failed its hash", what, self.manifest.fingerprint[:12], name)
        self.drop(source, ModelSourceError("bytes that fail their hash"))

    def read(self, source: Source, part: int, start: int, end: int) -> bytes:
        out = bytearray()
        self.stream(source, part, start, end, lambda _, data: out.extend(data))
        return bytes(out)

    def stream(self, source: Source, part: int, start: int, end: int, sink: Sink) -> None:
        """Hand ``sink`` the bytes ``[start, end)`` of the model's file ``part`` from
        ``source``; ``PeerRefused`` when a peer cannot give them."""
        if isinstance(source, LocalShard):
            try:
                with source.paths[part].open("rb") as fh:
                    fh.seek(start)
                    data = fh.read(end - start)
            except OSError as e:
                raise PeerRefused(f"{source.path}: {e}") from None
            if len(data) != end - start:
                raise PeerRefused(f"{source.path}: short")
            self.from_disk += len(data)
            sink(start, data)
            return
        if isinstance(source, Peer):
            data = self._from_peer(source, part, start, end)
            self.fetched += len(data)
            self.from_peers += len(data)
            sink(start, data)
            return
        model, headers = self._hub_model()

        def counted(offset: int, data: bytes) -> None:
            self.fetched += len(data)
            sink(offset, data)

        stream_range(model.files[part].url, start, end, headers, self.cfg, counted)

    def _from_peer(self, peer: Peer, part: int, start: int, end: int) -> bytes:
        """The bytes from ``peer``, waiting (bounded) while it fetches them itself."""
        deadline, wait = time.monotonic() + self.cfg.peer_wait_s, _FIRST_WAIT_S
        while True:
            try:
                return read_from_peer(peer, self.manifest.fingerprint, part, start, end - start)
            except PeerNotYet:
                if time.monotonic() + wait > deadline:
                    raise PeerRefused(f"{peer.node_id}: not fetched in time") from None
                time.sleep(wait)
                wait = min(wait * 2, _MAX_WAIT_S)
            except OSError as e:
                raise PeerRefused(f"{peer.node_id}: {e}") from None

    def _hub_model(self) -> tuple[RemoteModel, dict[str, str]]:
        if self._model is None:
            model = self._hub if isinstance(self._hub, RemoteModel) else self._hub()
            sizes = [f.size for f in model.files]
            if sizes != [f.size for f in self.manifest.files]:
                raise ModelSourceError(f"{model.ref}: its files' sizes are not the manifest's")
            self._model = (model, hf_headers(model, self.cfg))
        return self._model
