"""One whole remote file fetched to a local name, checked against its sha256 as it streams.

``download_file`` reads the file by ranges (``ranged.stream_range``: retried, and
resumed from the byte where a try stopped) into a partial file beside its final name
(``NAME.partial``, or a name the caller gives), hashing each byte as it is written, so
a file of many GB is never read twice. When the source gave the file's sha256 (the
hub's LFS sha256) the bytes must hash to it before the file takes its final name
(fsync, rename, fsync of the folder): a cache that names a file by its sha256 never
holds other bytes under it. A download that stopped (``FetchFailed`` once its retries
are spent; the process killed) keeps its partial file and the next one continues it,
reading back the part it kept once, so the hash covers every byte. Bytes that do not
hash to the sha256 (``HashMismatch``, naming the file, the sha256 expected and the one
got) or a full disk (``DiskFull``) remove the partial file: nothing lands, and nothing
that was there changes. A file whose source gives no sha256 (a plain URL) is taken as
served: there is nothing to check it against.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from meshnet.errors import DiskFull, HashMismatch
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.files import check_room, disk_errors, hash_back, locked, sync_dir
from meshnet.model_source.progress import OnBytes
from meshnet.model_source.ranged import stream_range
from meshnet.model_source.remote import RemoteFile


def download_file(
    f: RemoteFile,
    dest: Path,
    headers: dict[str, str],
    cfg: SourceConfig,
    progress: OnBytes | None = None,
    lock: Path | None = None,
    partial: Path | None = None,
) -> None:
    """``f`` whole at ``dest`` (see the module), unless it is there already; one process
    at a time fetches it, holding ``lock`` (default ``NAME.lock`` beside it), into
    ``partial`` (default ``NAME.partial`` beside it: the same folder, for the rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = partial or dest.with_name(dest.name + ".partial")
    with locked(lock or dest.with_name(dest.name + ".lock")):
        if dest.is_file():  # another process fetched it meanwhile
            return
        try:
            with disk_errors(dest):
                got = _fetch(f, partial, headers, cfg, progress)
        except DiskFull:
            partial.unlink(missing_ok=True)
            raise
        if f.sha256 is not None and got != f.sha256:
            partial.unlink(missing_ok=True)
            raise HashMismatch(
                f"{f.name}: the bytes served hash to sha256 {got}, not the {f.sha256} "
                "its source gives; nothing was kept"
            )
        partial.replace(dest)
        sync_dir(dest.parent)


def _fetch(
    f: RemoteFile, partial: Path, headers: dict[str, str], cfg: SourceConfig,
    progress: OnBytes | None,
) -> str | None:  # fmt: skip
    """Fetch what ``partial`` lacks of ``f``; the sha256 of all its bytes when ``f`` has
    one to be checked against (None: nothing to check, nothing read back)."""
    have = partial.stat().st_size if partial.is_file() else 0
    if have > f.size:  # not the beginning of this file: start again
        have = 0
    check_room(partial.parent, f.size - have)
    h = hashlib.sha256() if f.sha256 is not None else None
    with partial.open("r+b" if have else "wb") as fh:
        if h is not None:
            hash_back(fh, 0, have, h)
        fh.seek(have)
        fh.truncate()

        def sink(offset: int, data: bytes) -> None:
            fh.write(data)
            if h is not None:
                h.update(data)
            if progress is not None:
                progress(len(data))

        stream_range(f.url, have, f.size, headers, cfg, sink)
        fh.flush()
        os.fsync(fh.fileno())
    return None if h is None else h.hexdigest()
