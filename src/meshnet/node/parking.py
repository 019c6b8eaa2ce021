"""Parked KV: a session's cache moved out of the hot budget onto the node's local disk.

A parked session costs no KV budget; resuming it reads the file back, checks
its hash and makes it the session's KV again, which is far cheaper than
recomputing it. Files are written to a temp name and renamed, so a file under
its final name is always whole; one that fails its hash is discarded and the
session is rebuilt by its driver. A write that fails (a full disk, a directory
that cannot be made or written) leaves no file behind and is ``ParkFailed``:
the session's KV stays hot.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

from meshnet.errors import CacheMiss, ParkFailed
from meshnet.kv.transfer import digest


class ParkPhase(enum.Enum):
    """How much of a park one call does (the wire's ``ParkPhase``, same numbers)."""

    NOW = 0  # write the file and free the hot KV
    PREPARE = 1  # write the file; the KV stays hot until COMMIT
    COMMIT = 2  # free the hot KV of a prepared park (refused if the session moved on)
    ABORT = 3  # forget a prepared park: its file goes


@dataclass(frozen=True)
class ParkedKV:
    epoch: int
    steps: int
    tokens: int
    path: Path
    digest: str  # BLAKE3 of the file's bytes
    nbytes: int
    # The page key (kv/pages.py) of the last cached prefix page the session read when
    # parked: its KV reads that prefix's pages again when it comes back (None: none)
    prefix_key: bytes | None = None


class ParkStore:
    """One directory of parked sessions; created on first use."""

    def __init__(self, directory: str | None) -> None:
        self._configured = Path(directory) if directory else None
        self._directory: Path | None = None

    @property
    def directory(self) -> Path:
        if self._directory is None:
            if self._configured is not None:
                self._configured.mkdir(parents=True, exist_ok=True)
                self._directory = self._configured
            else:
                # Gone with this store, or when the process exits: what is parked here is
                # found only through the node's memory of it, which ends with it.
                self._directory = Path(tempfile.mkdtemp(prefix="meshnet-parked-"))
                weakref.finalize(self, shutil.rmtree, self._directory, ignore_errors=True)
        return self._directory

    def write(
        self, session_id: str, epoch: int, steps: int, tokens: int, payload: memoryview
    ) -> ParkedKV:
        """The parked file of a session's KV; ``ParkFailed`` (nothing left on disk) when
        the directory cannot be made or the file not written whole."""
        name = hashlib.sha256(session_id.encode()).hexdigest()[:32]  # ids may hold any character
        try:
            path = self.directory / f"{name}.kv"
        except OSError as e:
            raise ParkFailed(f"park directory {self._configured} unusable: {e.strerror}") from None
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            message = f"could not write {len(payload)} bytes to {tmp}: {e.strerror}"
            raise ParkFailed(message) from None
        return ParkedKV(epoch, steps, tokens, path, digest(payload).hex(), len(payload))

    @staticmethod
    def read(parked: ParkedKV) -> bytes:
        """The parked bytes; ``CacheMiss`` when the file is gone or not what was written."""
        try:
            data = parked.path.read_bytes()
        except OSError as e:
            raise CacheMiss(f"parked KV unreadable: {e}") from None
        if len(data) != parked.nbytes or digest(data).hex() != parked.digest:
            raise CacheMiss(f"parked KV at {parked.path} is corrupt")
        return data

    @staticmethod
    def remove(parked: ParkedKV) -> None:
        parked.path.unlink(missing_ok=True)
