"""A hub model's manifest from its headers alone: the tracker reads no tensor it does not use.

The hub gives each file's sha256 (its LFS pointer), so the model's fingerprint is known
without a byte of it read (``gguf_split.split_fingerprint``). The tracker reads each
file's header (its BLAKE3 goes into the manifest: every node checks the header it
fetches against it) and the few small tensors every range reads (``rope_freqs``: the
spec reads its values), hashed as read; every other tensor's hash is left unknown,
learned from the first node that fetches it from the hub (trust on first fetch:
``manifest``, ``tracker/serving/manifests.py``). What is kept is the sparse copy the tracker
opens: each file's header and those tensors at their own offsets.
"""

from __future__ import annotations

import re
from pathlib import Path

import blake3

from meshnet.model_source.config import SourceConfig
from meshnet.model_source.files import sparse_partial
from meshnet.model_source.header import fetch_header
from meshnet.model_source.manifest import FileHash, Manifest, TensorHash
from meshnet.model_source.progress import OnBytes
from meshnet.model_source.ranged import read_range
from meshnet.model_source.remote import RemoteModel, hf_headers

PER_RANGE = re.compile(r"^(blk\.\d+\.|token_embd\.|output_norm\.|output\.)")


def headers_manifest(
    model: RemoteModel, fingerprint: str, paths: list[Path], cfg: SourceConfig,
    progress: OnBytes | None,
) -> Manifest:  # fmt: skip
    """The manifest of ``model`` (``fingerprint`` from the hub's sha256s), its headers and
    shared tensors kept at ``paths`` (one per file)."""
    headers = hf_headers(model, cfg)
    files: list[FileHash] = []
    tensors: list[TensorHash] = []
    for part, (f, path) in enumerate(zip(model.files, paths, strict=True)):
        header = fetch_header(f, headers, cfg)
        if progress is not None:
            progress(len(header.raw) + len(header.after))
        spans = sorted(header.spans().items(), key=lambda kv: kv[1][0])
        with sparse_partial(path, f.size) as fh:
            fh.write(header.raw)
            for name, (offset, n) in spans:
                digest = None
                if not PER_RANGE.match(name):  # read here: every range reads it
                    data = read_range(f.url, offset, offset + n, headers, cfg)
                    fh.seek(offset)
                    fh.write(data)
                    digest = blake3.blake3(data).hexdigest()
                tensors.append(TensorHash(name, offset, n, digest, part))
        raw_hash = blake3.blake3(header.raw).hexdigest()
        files.append(FileHash(path.name, f.size, header.layout.data_start, raw_hash))
    return Manifest(fingerprint, tuple(files), tuple(tensors))
