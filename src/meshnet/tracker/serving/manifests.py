"""The manifests of the referenced models a tracker has read, by reference.

A node loading a referenced model asks its tracker for the manifest
(``GET /mesh/manifest``) while the tracker is still serving it: an admin serve
tells nodes to load before the model joins the served set, so the served set
alone cannot answer. This book holds every manifest the tracker read, the
latest ``MAX_ENTRIES``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from meshnet.model.info import ModelInfo

MAX_ENTRIES = 64


class ManifestBook:
    """Reference -> manifest JSON. Thread-safe (loads run in worker threads)."""

    def __init__(self) -> None:
        self._by_ref: OrderedDict[str, str] = OrderedDict()
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
