"""The manifests of the referenced models a tracker has read, by reference.

A node loading a referenced model asks its tracker for the manifest
(``GET /mesh/manifest``) while the tracker is still serving it: an admin serve
tells nodes to load before the model joins the served set, so the served set
alone cannot answer. This book holds every manifest the tracker read, the
latest ``MAX_ENTRIES``.

It also keeps the tensor hashes nodes learned (trust on first fetch,
``model_source.first_fetch``): the first hash told for a tensor whose hash the
manifest leaves unknown is kept, and every manifest given after carries it. In
memory: a restarted tracker learns them again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from meshnet.errors import RequestError
from meshnet.model.info import ModelInfo
from meshnet.model_source.manifest import Manifest, parse_manifest

MAX_ENTRIES = 64


class ManifestBook:
    """Reference -> manifest JSON. Thread-safe (loads run in worker threads)."""

    def __init__(self) -> None:
        self._by_ref: OrderedDict[str, str] = OrderedDict()
        self._learned: dict[str, dict[str, str]] = {}  # fingerprint -> tensor -> BLAKE3
        self._lock = threading.Lock()

    def note(self, info: ModelInfo) -> ModelInfo:
        """Keep ``info``'s manifest, when it is of a referenced model; returns ``info``."""
        if info.ref is not None and info.manifest_json is not None:
            with self._lock:
                self._by_ref[info.ref] = info.manifest_json
                self._by_ref.move_to_end(info.ref)
                while len(self._by_ref) > MAX_ENTRIES:
                    self._by_ref.popitem(last=False)
        return info

    def get(self, ref: str) -> str | None:
        with self._lock:
            return self._by_ref.get(ref)

    def with_learned(self, text: str) -> str:
        """The manifest ``text`` with the hashes learned for its model filled in."""
        manifest = parse_manifest(text)
        with self._lock:
            learned = dict(self._learned.get(manifest.fingerprint, {}))
        return manifest.with_hashes(learned).to_json() if learned else text

    def learn(self, manifest: Manifest, hashes: dict[str, str]) -> dict[str, str]:
        """Keep each of ``hashes`` (tensor -> BLAKE3 hex) whose tensor's hash ``manifest``
        leaves unknown and no node told before; returns the hash now held for each.
        ``RequestError`` for a tensor the model does not have."""
        unknown = {t.name for t in manifest.tensors if t.blake3 is None}
        known = {t.name: t.blake3 for t in manifest.tensors if t.blake3 is not None}
        for name in hashes:
            if name not in unknown and name not in known:
                raise RequestError(f"the model has no tensor {name[:64]!r}")
        with self._lock:
            kept = self._learned.setdefault(manifest.fingerprint, {})
            while len(self._learned) > MAX_ENTRIES:
                del self._learned[next(iter(self._learned))]
            for name, digest in hashes.items():
                if name in unknown:
                    kept.setdefault(name, digest)
            return {n: known.get(n) or kept[n] for n in hashes}
