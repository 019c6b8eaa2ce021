"""Open a GGUF file and turn every failure into a typed error.

The header is parsed by ``gguf_header`` (the ``gguf`` package's reader takes
~30 s over a 128k-token vocabulary; this takes a fraction of a second), and a
damaged file gives callers a ``ModelFileError`` naming the file and what is
wrong. Tensor extents are checked against the file size so that a truncated
file fails at open time, not halfway through loading a shard. Tensors are
``gguf.ReaderTensor`` objects whose ``data`` views the file's memory map. A split
GGUF (``gguf_split``) is opened by its first part: its parts' tensors together, each
viewing its own part's map.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshnet.errors import ModelFileError
from meshnet.model.gguf_header import GGUFHeader, parse_header
from meshnet.model.gguf_split import check_part, model_parts, split_fingerprint

_HASH_CHUNK = 1 << 22


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata values and tensor descriptors (data memory-mapped)."""

    path: Path
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, gguf.ReaderTensor] = field(repr=False)
    _fingerprint: str | None = field(default=None, repr=False)
    # A split GGUF's files in order (one file: ``(path,)``) and the part of each tensor.
    parts: tuple[Path, ...] = field(default=(), repr=False)
    part_of: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = (self.path,)

    def tensor_path(self, name: str) -> Path:
        """The file holding tensor ``name``'s bytes (a split GGUF's part)."""
        return self.parts[self.part_of.get(name, 0)]

    def has(self, key: str) -> bool:
        return key in self.metadata

    def value(self, key: str) -> Any:
        """The metadata value under ``key`` (arrays as lists); ``ModelFileError`` when missing."""
        if key not in self.metadata:
            raise ModelFileError(f"{self.path.name}: metadata key {key!r} is missing")
        return self.metadata[key]

    def value_or(self, key: str, default: Any) -> Any:
        return self.metadata.get(key, default)

    def drop(self, keys: Iterable[str]) -> None:
        """Forget the values under ``keys`` (absent ones are skipped): what was built from
        them (a tokenizer from its per-token arrays) holds what it needs, and a process
        that keeps this file for its tensors need not keep them too."""
        for key in keys:
            self.metadata.pop(key, None)

    def read_tensor(self, t: gguf.ReaderTensor) -> np.ndarray:
        """A fresh copy of ``t``'s bytes (uint8), read from the file, not through the map.

        Reading through the memory map would leave the file's pages counted in this
        process's resident memory beside the copy a kernel layout is made from.
        """
        nbytes = _expected_bytes(t)
        out = np.empty(nbytes, np.uint8)
        path = self.tensor_path(t.name)
        with path.open("rb", buffering=0) as fh:
            fh.seek(int(t.data_offset))
            if fh.readinto(out.data) != nbytes:
                raise ModelFileError(f"{path.name}: tensor {t.name!r} is truncated")
        return out

    def known_fingerprint(self, fingerprint: str) -> None:
        """Take ``fingerprint`` as the model's sha256: the file here is not the whole
        model (``model_source`` keeps only a range's tensors, or only the header)."""
        self._fingerprint = fingerprint

    def fingerprint(self) -> str:
        """The sha256 of the whole file, hex: the model's identity on the mesh (of a split
        GGUF, the sha256 of its parts' sha256s: ``gguf_split.split_fingerprint``)."""
        if self._fingerprint is None:
            self._fingerprint = split_fingerprint([sha256_file(p) for p in self.parts])
        return self._fingerprint


def open_gguf(path: str | os.PathLike[str], fingerprint: str | None = None) -> GGUFFile:
    """Parse ``path`` as GGUF; raise ``ModelFileError`` if it is missing, corrupt or truncated.
    A split GGUF's first part opens every part (``gguf_split``). ``fingerprint``: see
    ``GGUFFile.known_fingerprint``."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"{p}: no such model file")
    parts = model_parts(p)
    headers = [_parse(part) for part in parts]
    if len(parts) == 1:
        return GGUFFile(p, headers[0].metadata, headers[0].tensors, fingerprint)
    tensors: dict[str, gguf.ReaderTensor] = {}
    part_of: dict[str, int] = {}
    total = 0
    for i, (part, header) in enumerate(zip(parts, headers, strict=True)):
        total = check_part(header.metadata, i, len(parts), part.name)
        for name, t in header.tensors.items():
            if name in tensors:
                raise ModelFileError(f"{part.name}: tensor {name!r} is in two parts")
            tensors[name], part_of[name] = t, i
    if total != len(tensors):
        raise ModelFileError(f"{p.name}: the parts hold {len(tensors)} tensors of {total}")
    return GGUFFile(p, headers[0].metadata, tensors, fingerprint, parts, part_of)


def _parse(p: Path) -> GGUFHeader:
    try:
        with p.open("rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise ModelFileError(f"{p.name}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    header = parse_header(mapped, p.name)
    _release_pages(mapped)
    # The tensors' views keep the map open for as long as they live.
    return header


def _release_pages(mapped: mmap.mmap) -> None:
    """Take the pages the header parse read out of this process's resident set.

    A large vocabulary's header is megabytes (~8 MB for Llama-3's 128k tokens and
    280k merges), parsed into Python values once; its pages would otherwise stay
    counted in a node's resident memory for as long as any tensor view keeps the map
    open. The file's pages stay in the page cache, and a later read faults them back.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is not None:
        mapped.madvise(advice)


def _expected_bytes(t: gguf.ReaderTensor) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    n = int(np.prod([int(d) for d in t.shape]))
    return n // block * type_size


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()
