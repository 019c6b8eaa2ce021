"""Open a GGUF file with the ``gguf`` package and turn every failure into a typed error.

The ``gguf`` reader raises bare ``ValueError``/``IndexError`` (or worse) on a
damaged file; callers of meshnet get ``ModelFileError`` naming the file and
what is wrong. Tensor extents are checked against the file size so that a
truncated file fails at open time, not halfway through loading a shard.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshnet.errors import ModelFileError

_HASH_CHUNK = 1 << 22


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata values and tensor descriptors (data memory-mapped)."""

    path: Path
    reader: gguf.GGUFReader
    _fingerprint: str | None = field(default=None, repr=False)

    @cached_property
    def tensors(self) -> dict[str, gguf.ReaderTensor]:
        return {t.name: t for t in self.reader.tensors}

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str) -> Any:
        """The metadata value under ``key``; ``ModelFileError`` when it is missing."""
        f = self.reader.fields.get(key)
        if f is None:
            raise ModelFileError(f"{self.path.name}: metadata key {key!r} is missing")
        try:
            return f.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelFileError(
                f"{self.path.name}: metadata key {key!r} is unreadable: {e}"
            ) from e

    def value_or(self, key: str, default: Any) -> Any:
        return self.value(key) if self.has(key) else default

    def read_tensor(self, t: gguf.ReaderTensor) -> np.ndarray:
        """A fresh copy of ``t``'s bytes (uint8), read from the file, not through the map.

        Reading through the memory map would leave the file's pages counted in this
        process's resident memory beside the copy a kernel layout is made from.
        """
        nbytes = _expected_bytes(t)
        out = np.empty(nbytes, np.uint8)
        with self.path.open("rb", buffering=0) as fh:
            fh.seek(int(t.data_offset))
            if fh.readinto(memoryview(out)) != nbytes:
                raise ModelFileError(f"{self.path.name}: tensor {t.name!r} is truncated")
        return out

    def fingerprint(self) -> str:
        """The sha256 of the whole file, hex: the model's identity on the mesh."""
        if self._fingerprint is None:
            self._fingerprint = sha256_file(self.path)
        return self._fingerprint


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse ``path`` as GGUF; raise ``ModelFileError`` if it is missing, corrupt or truncated."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"{p}: no such model file")
    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as e:  # the reader has no error type of its own
        raise ModelFileError(f"{p.name}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    _check_extents(p, reader)
    return GGUFFile(path=p, reader=reader)


def _check_extents(path: Path, reader: gguf.GGUFReader) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        expected = _expected_bytes(t)
        end = int(t.data_offset) + expected
        if end > size or t.data.nbytes != expected:
            raise ModelFileError(
                f"{path.name}: tensor {t.name!r} runs past the end of the file "
                f"(needs bytes up to {end}, file has {size}): truncated?"
            )


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
