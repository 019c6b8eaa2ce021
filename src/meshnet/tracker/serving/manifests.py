"""The manifests of the referenced models a tracker has read, by reference.

A node loading a referenced model asks its tracker for the manifest
(``GET /mesh/manifest``) while the tracker is still serving it: an admin serve
tells nodes to load before the model joins the served set, so the served set
alone cannot answer. This book holds every manifest the tracker read, the
latest ``MAX_ENTRIES``.

It also keeps the tensor hashes nodes learned (trust on first fetch,
``model_source.first_fetch``): the first hash told for a tensor whose hash the
manifest leaves unknown is kept (``learned_hashes``: on disk too, when given a
folder), and every manifest given after carries it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from meshnet.errors import RequestError
from meshnet.model.info import ModelInfo
from meshnet.model_source.manifest import Manifest, parse_manifest
from meshnet.tracker.serving.learned_hashes import LearnedHashes

MAX_ENTRIES = 64


class ManifestBook:
    """Reference -> manifest JSON. Thread-safe (loads run in worker threads)."""

    def __init__(self, learned_dir: Path | None = None) -> None:
        self._by_ref: OrderedDict[str, str] = OrderedDict()
        self._learned = LearnedHashes(learned_dir)
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
        learned = self._learned.of(manifest.fingerprint)
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
        fresh = {n: d for n, d in hashes.items() if n in unknown}
        held = self._learned.learn(manifest.fingerprint, fresh)
        return {n: known.get(n) or held[n] for n in hashes}
