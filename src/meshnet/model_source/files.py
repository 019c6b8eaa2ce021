"""Where fetched models lie in the cache, and writes that never leave half a file behind."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from meshnet.errors import DiskFull
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.remote import RemoteModel

_HASH_READ = 1 << 22  # bytes a read of hash_back takes


def store_dir(cfg: SourceConfig, model: RemoteModel) -> Path:
    """The cache folder of one model's bytes (named by its sha256, else URL and ETag)."""
    key = hashlib.sha256(model.key.encode()).hexdigest()[:32]
    return cfg.cache_dir / "sources" / key


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsync, rename, fsync the dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with disk_errors(path), tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    sync_dir(path.parent)


def sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_room(folder: Path, needed: int) -> None:
    """``DiskFull`` unless ``folder``'s disk has ``needed`` bytes free."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise DiskFull(f"{folder}: {needed} bytes needed, {free} free")


@contextlib.contextmanager
def disk_errors(path: Path) -> Iterator[None]:
    """A full disk (or quota) while writing ``path`` as ``DiskFull``."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"{path}: the disk is full") from None
        raise


@contextlib.contextmanager
def sparse_partial(path: Path, size: int) -> Iterator[BinaryIO]:
    """A sparse file of ``size`` bytes written as ``path.partial`` and renamed to ``path``
    when the block ends cleanly; removed when it raises, so nothing half-written stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with disk_errors(path), partial.open("w+b") as fh:
            fh.truncate(size)
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        partial.replace(path)
        sync_dir(path.parent)
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(lock: Path) -> Iterator[None]:
    """Hold the exclusive ``flock`` of ``lock`` (created if missing) for the block: one
    fetch of one file at a time on this machine (nodes of one ``meshnet up``)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class Hasher(Protocol):
    """What a download hashes with: hashlib's sha256, blake3."""

    def update(self, data: bytes, /) -> object: ...


def hash_back(fh: BinaryIO, start: int, end: int, h: Hasher) -> None:
    """Feed ``h`` the bytes ``[start, end)`` already written to ``fh`` (the part a
    resumed fetch kept), a few MB at a time."""
    fh.flush()
    fh.seek(start)
    while start < end:
        data = fh.read(min(end - start, _HASH_READ))
        if not data:
            break
        h.update(data)
        start += len(data)
