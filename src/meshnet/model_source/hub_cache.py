"""A whole hub file in ``huggingface_hub``'s own cache, checked against the hub's sha256 first.

``hf_hub_download`` names a file it fetches by the hub's sha256 (``blobs/SHA256``) but
never hashes the bytes it is served, so a broken or hostile hub, mirror or proxy
would have other bytes loaded, and kept under that name. So a hub file whose sha256
the hub gives (every LFS file: every GGUF on the hub) is fetched here instead, through
``huggingface_hub``'s HTTP session (``download.download_file``: hashed as it streams,
resumable), and put where ``hf_hub_download`` would put it, in the cache layout
``huggingface_hub`` documents and reads back (``HF_HUB_CACHE``; with ``HF_HUB_OFFLINE``
it is found there): the blob ``blobs/SHA256``, written as ``blobs/SHA256.incomplete``
(what ``huggingface_hub``'s cache scan lists as an unfinished download) under the lock
``huggingface_hub`` takes for it (``.locks/``); the file's name in ``snapshots/COMMIT/``
a relative link to it; ``refs/REVISION`` naming the commit. A blob already there
(ours, or ``huggingface_hub``'s) is taken as it is.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from meshnet.errors import ModelSourceError
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.download import download_file
from meshnet.model_source.files import atomic_write
from meshnet.model_source.progress import OnBytes
from meshnet.model_source.reference import HubRef
from meshnet.model_source.remote import RemoteFile, RemoteModel, hf_headers

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a commit sha, or the revision


def hub_cached_file(
    ref: HubRef, model: RemoteModel, f: RemoteFile, cfg: SourceConfig, progress: OnBytes | None
) -> Path:
    """The local path of the hub file ``f`` of ``model`` (its ``snapshots/`` name), fetched
    and checked first unless cached. ``ModelSourceError``, before anything is written, when
    the hub's listing gives no sha256, or a sha256, commit or file name that would lead
    out of the repository's folder (a hostile listing)."""
    sha, commit = f.sha256, model.commit or ref.revision
    if sha is None or not _SHA256.fullmatch(sha):
        raise ModelSourceError(f"{ref}: the hub gives no sha256 for {f.name!r}: {sha!r}")
    if not _COMMIT.fullmatch(commit) or ".." in commit:
        raise ModelSourceError(f"{ref}: the hub's commit {commit!r} is not a name")
    if f.name.startswith("/") or any(p in ("", ".", "..") for p in f.name.split("/")):
        raise ModelSourceError(f"{ref}: the hub lists {f.name!r}, not a path in a repository")
    from huggingface_hub import constants  # heavy: only when a hub file is fetched

    root = Path(cfg.hf_cache or constants.HF_HUB_CACHE)
    repo = root / ("models--" + ref.repo.replace("/", "--"))
    pointer = repo / "snapshots" / commit / f.name
    if not pointer.is_file():
        blob = repo / "blobs" / sha
        lock = root / ".locks" / repo.name / f"{sha}.lock"
        partial = blob.with_name(f"{sha}.incomplete")  # as `hf cache` tools list them
        download_file(f, blob, hf_headers(model, cfg), cfg, progress, lock, partial)
        _link(blob, pointer)
    if ref.revision != commit:
        ref_path = repo / "refs" / ref.revision
        if not ref_path.is_file() or ref_path.read_text() != commit:
            atomic_write(ref_path, commit.encode())
    return pointer


def _link(blob: Path, pointer: Path) -> None:
    """``pointer`` a relative link to ``blob``, made whole or not at all (a rename)."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f"{pointer.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.symlink(os.path.relpath(blob, pointer.parent), tmp)
    tmp.replace(pointer)
