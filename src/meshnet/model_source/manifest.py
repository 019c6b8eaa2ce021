"""The per-tensor hashes of one GGUF model: what a node checks every fetched byte against.

A model is one file or a split GGUF's parts (``model.gguf_split``): the manifest lists
each file (its size, where its data starts, its header's BLAKE3) and each tensor with
the part it lies in and its offset there. The tracker computes a manifest once
(``tracker_source``: each file read once as a stream, its sha256 checked against the
hub's; or, for a hub file, only its headers: see below) and hands it to
each node signed with that node's key (``auth.signing.manifest_mac``), so a node
trusts no byte the network gives it, neither the hub's nor a peer's: the header's
bytes and each tensor's are checked by their BLAKE3 before they are used.

A tensor's BLAKE3 may be unknown (``None``): a tracker that read only a hub file's
headers (``tracker_source``) learns each tensor's hash from the first node that
fetches it from the hub (trust on first fetch, ``with_hashes``); every later fetch,
from the hub or a peer, is checked against it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from meshnet.errors import ModelSourceError

VERSION = 2
MAX_TENSORS = 1 << 16
MAX_FILES = 1 << 10
MAX_MANIFEST_BYTES = 32 << 20


@dataclass(frozen=True)
class TensorHash:
    name: str
    offset: int  # from the start of its file
    nbytes: int
    blake3: str | None  # hex; None: not known yet (see the module)
    part: int = 0  # the file it lies in (a split GGUF's part, from 0)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class FileHash:
    """One file of the model: a whole GGUF, or one part of a split one."""

    name: str  # its name in the repository (a split part's name says its place)
    size: int
    header_bytes: int  # where its data section starts
    header_blake3: str


@dataclass(frozen=True)
class Manifest:
    # sha256 of the file, hex (of a split GGUF: ``gguf_split.split_fingerprint``): the
    # model's identity on the mesh
    fingerprint: str
    files: tuple[FileHash, ...]  # one, or a split GGUF's parts in order
    tensors: tuple[TensorHash, ...]  # in file order, part by part

    @property
    def size(self) -> int:
        """The model's bytes, every file together."""
        return sum(f.size for f in self.files)

    def by_name(self) -> dict[str, TensorHash]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": VERSION,
                "fingerprint": self.fingerprint,
                "files": [[f.name, f.size, f.header_bytes, f.header_blake3] for f in self.files],
                "tensors": [[t.name, t.part, t.offset, t.nbytes, t.blake3] for t in self.tensors],
            },
            separators=(",", ":"),
        )

    def digest(self) -> str:
        """sha256 of the canonical JSON: what a signature covers."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def layout_digest(self) -> str:
        """sha256 of the model's layout (fingerprint, files, tensors less their hashes):
        the same while hashes are learned."""
        unhashed = replace(self, tensors=tuple(replace(t, blake3=None) for t in self.tensors))
        return unhashed.digest()

    def with_hashes(self, hashes: Mapping[str, str]) -> Manifest:
        """This manifest with the unknown hashes of ``hashes``' tensors filled in."""
        return replace(
            self,
            tensors=tuple(
                replace(t, blake3=hashes[t.name]) if t.blake3 is None and t.name in hashes else t
                for t in self.tensors
            ),
        )


def parse_manifest(text: str | bytes) -> Manifest:
    """A manifest from its JSON; ``ModelSourceError`` for anything malformed."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ModelSourceError("a manifest is larger than the limit")
    try:
        raw = json.loads(text)
        if raw["version"] != VERSION or len(raw["tensors"]) > MAX_TENSORS:
            raise ValueError("version or tensor count")
        if not 0 < len(raw["files"]) <= MAX_FILES:
            raise ValueError("file count")
        files = tuple(_file(f) for f in raw["files"])
        tensors = tuple(_tensor(t) for t in raw["tensors"])
        m = Manifest(_hex(raw["fingerprint"]), files, tensors)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelSourceError(f"a malformed manifest: {e}") from None
    for t in tensors:
        f = files[t.part] if t.part < len(files) else None
        if f is None or t.end > f.size or t.offset < f.header_bytes:
            raise ModelSourceError("a malformed manifest: a tensor outside its file's data")
    return m


def _name(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= 256:
        raise ValueError(what)
    return v


def _file(f: Any) -> FileHash:
    name, size, header_bytes, digest = f
    return FileHash(_name(name, "file name"), _count(size), _count(header_bytes), _hex(digest))


def _tensor(t: Any) -> TensorHash:
    name, part, offset, nbytes, digest = t
    known = None if digest is None else _hex(digest)
    return TensorHash(
        _name(name, "tensor name"), _count(offset), _count(nbytes), known, _count(part)
    )


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 50:
        raise ValueError(f"not a byte count: {v!r}")
    return v


def _hex(v: Any) -> str:
    if not isinstance(v, str) or len(v) != 64:
        raise ValueError("not a 32-byte hex digest")
    int(v, 16)
    return v
