"""The per-tensor hashes of one GGUF file: what a node checks every fetched byte against.

The tracker computes a manifest once (``tracker_source.build_manifest``: the whole
file read once as a stream, its sha256 checked against the hub's) and hands it to
each node signed with that node's key (``auth.signing.manifest_mac``), so a node
trusts no byte the network gives it, neither the hub's nor a peer's: the header's
bytes and each tensor's are checked by their BLAKE3 before they are used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from meshnet.errors import ModelSourceError

VERSION = 1
MAX_TENSORS = 1 << 16
MAX_MANIFEST_BYTES = 32 << 20


@dataclass(frozen=True)
class TensorHash:
    name: str
    offset: int  # from the start of the file
    nbytes: int
    blake3: str  # hex

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Manifest:
    fingerprint: str  # sha256 of the whole file, hex: the model's identity on the mesh
    size: int  # of the file
    header_bytes: int  # where the data section starts
    header_blake3: str
    tensors: tuple[TensorHash, ...]  # in file order

    def by_name(self) -> dict[str, TensorHash]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": VERSION,
                "fingerprint": self.fingerprint,
                "size": self.size,
                "header_bytes": self.header_bytes,
                "header_blake3": self.header_blake3,
                "tensors": [[t.name, t.offset, t.nbytes, t.blake3] for t in self.tensors],
            },
            separators=(",", ":"),
        )

    def digest(self) -> str:
        """sha256 of the canonical JSON: what a signature covers."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def parse_manifest(text: str | bytes) -> Manifest:
    """A manifest from its JSON; ``ModelSourceError`` for anything malformed."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ModelSourceError("a manifest is larger than the limit")
    try:
        raw = json.loads(text)
        if raw["version"] != VERSION or len(raw["tensors"]) > MAX_TENSORS:
            raise ValueError("version or tensor count")
        tensors = tuple(_tensor(t) for t in raw["tensors"])
        m = Manifest(
            _hex(raw["fingerprint"]),
            _count(raw["size"]),
            _count(raw["header_bytes"]),
            _hex(raw["header_blake3"]),
            tensors,
        )
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelSourceError(f"a malformed manifest: {e}") from None
    if any(t.end > m.size or t.offset < m.header_bytes for t in tensors):
        raise ModelSourceError("a malformed manifest: a tensor outside the file's data")
    return m


def _tensor(t: Any) -> TensorHash:
    name, offset, nbytes, digest = t
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise ValueError("tensor name")
    return TensorHash(name, _count(offset), _count(nbytes), _hex(digest))


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 50:
        raise ValueError(f"not a byte count: {v!r}")
    return v


def _hex(v: Any) -> str:
    if not isinstance(v, str) or len(v) != 64:
        raise ValueError("not a 32-byte hex digest")
    int(v, 16)
    return v
