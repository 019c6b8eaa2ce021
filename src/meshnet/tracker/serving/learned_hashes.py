"""Tensor hashes learned on first fetch (``model_source.first_fetch``), kept across restarts.

The first hash told for a tensor is kept; each is appended, as it is learned, to a
log per model (``FOLDER/<fingerprint>.jsonl``, one ``[tensor, blake3]`` a line), read
back the first time a restarted tracker needs that model's hashes. A torn last line
(a crash midway through a write) is skipped: that tensor is learned again.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

log = logging.getLogger(__name__)
MAX_MODELS = 64  # models whose hashes are held in memory; the oldest go (still on disk)
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


class LearnedHashes:
    """Fingerprint -> tensor -> BLAKE3 hex; ``folder`` None: in memory only. Thread-safe."""

    def __init__(self, folder: Path | None = None) -> None:
        self._folder = folder
        self._by_model: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def of(self, fingerprint: str) -> dict[str, str]:
        """The hashes learned for the model ``fingerprint`` (a copy)."""
        with self._lock:
            return dict(self._held(fingerprint))

    def learn(self, fingerprint: str, hashes: dict[str, str]) -> dict[str, str]:
        """Keep each of ``hashes`` not learned before; the hash held for each after."""
        with self._lock:
            held = self._held(fingerprint)
            new = {n: d for n, d in hashes.items() if n not in held}
            held.update(new)
            if new:
                self._append(fingerprint, new)
            return {n: held[n] for n in hashes}

    def _held(self, fingerprint: str) -> dict[str, str]:
        held = self._by_model.get(fingerprint)
        if held is None:
            held = self._by_model[fingerprint] = self._read(fingerprint)
            while len(self._by_model) > MAX_MODELS:
                del self._by_model[next(iter(self._by_model))]
        return held

    def _path(self, fingerprint: str) -> Path | None:
        if self._folder is None or not _FINGERPRINT.match(fingerprint):
            return None
        return self._folder / f"{fingerprint}.jsonl"

    def _read(self, fingerprint: str) -> dict[str, str]:
        path = self._path(fingerprint)
        out: dict[str, str] = {}
        try:
            lines = path.read_text().splitlines() if path is not None else []
        except OSError:
            return out
        for line in lines:
            try:
                name, digest = json.loads(line)
            except (ValueError, TypeError):
                continue  # a torn line
            if isinstance(name, str) and isinstance(digest, str):
                out.setdefault(name, digest)
        return out

    def _append(self, fingerprint: str, new: dict[str, str]) -> None:
        path = self._path(fingerprint)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as fh:
                fh.writelines(json.dumps([n, d]) + "\n" for n, d in new.items())
        except OSError as e:  # kept in memory: a restart learns them again
            log.warning("learned hashes of %s not written: %s", fingerprint[:12], e)
