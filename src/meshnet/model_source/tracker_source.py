"""What a tracker keeps of a referenced model: its header, a few small tensors, the manifest.

Of a hub model (whose files' sha256s the hub gives), ``tracker_model`` reads only the
headers and those tensors (``header_manifest``: the other tensors' hashes are learned
from the nodes that fetch them first). Of a plain URL it reads each file of the
model (one, or a split GGUF's parts) once as a stream (range requests, retried and
resumed like any fetch) and keeps only its header, the tensors every range reads
(``rope_freqs``: the spec reads its values) in a sparse copy of the file at their
own offsets, and the manifest of every tensor's BLAKE3. Both are kept in the cache,
so a restarted tracker reads nothing from the network. A local file stays where it
is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import blake3

from meshnet.errors import FetchFailed, HashMismatch, ModelSourceError
from meshnet.model.gguf_split import model_stem, split_fingerprint
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.files import atomic_write, sparse_partial, store_dir
from meshnet.model_source.header import fetch_header
from meshnet.model_source.header_manifest import PER_RANGE, headers_manifest
from meshnet.model_source.manifest import FileHash, Manifest, TensorHash, parse_manifest
from meshnet.model_source.progress import OnBytes
from meshnet.model_source.ranged import stream_range
from meshnet.model_source.reference import parse_ref
from meshnet.model_source.remote import RemoteFile, RemoteModel, hf_headers, locate


@dataclass(frozen=True)
class TrackerModel:
    ref: str  # as the user wrote it: what nodes are told to load
    path: Path  # the sparse copy (a split's first part): its headers and shared tensors real
    manifest: Manifest

    @property
    def name(self) -> str:
        return model_stem(self.path.name)


def tracker_model(text: str, cfg: SourceConfig, progress: OnBytes | None = None) -> TrackerModel:
    """The tracker's view of the model ``text`` references (see the module). When the
    source cannot be reached (``FetchFailed``: no network, ``HF_HUB_OFFLINE``), what the
    cache kept for the same reference is taken."""
    try:
        model = locate(parse_ref(text), cfg)
    except FetchFailed:
        kept = _kept(text, cfg)
        if kept is None:
            raise
        return kept
    folder = store_dir(cfg, model)
    manifest_path = folder / "manifest.json"
    paths = [folder / _base(f) for f in model.files]
    if not (manifest_path.is_file() and all(p.is_file() for p in paths)):
        manifest = _build(model, paths, cfg, progress)
        atomic_write(manifest_path, manifest.to_json().encode())
    path = paths[0]
    atomic_write(_ref_index(text, cfg), str(path.relative_to(cfg.cache_dir)).encode())
    return TrackerModel(text, path, parse_manifest(manifest_path.read_bytes()))


def _ref_index(text: str, cfg: SourceConfig) -> Path:
    """Where the cache notes which kept model a reference last resolved to."""
    return cfg.cache_dir / "refs" / hashlib.sha256(text.encode()).hexdigest()[:32]


def _kept(text: str, cfg: SourceConfig) -> TrackerModel | None:
    try:
        path = cfg.cache_dir / _ref_index(text, cfg).read_text().strip()
        manifest = parse_manifest((path.parent / "manifest.json").read_bytes())
    except (OSError, ModelSourceError):
        return None
    if not path.is_file() or path.parent.parent != cfg.cache_dir / "sources":
        return None
    return TrackerModel(text, path, manifest)


def _base(f: RemoteFile) -> str:
    return f.name.rsplit("/", 1)[-1]


def _build(
    model: RemoteModel, paths: list[Path], cfg: SourceConfig, progress: OnBytes | None
) -> Manifest:
    """The manifest: from the headers alone when the source gives each file's sha256 (the
    hub), else from every file read once as a stream (a plain URL)."""
    if model.fingerprint is not None:
        return headers_manifest(model, model.fingerprint, paths, cfg, progress)
    headers = hf_headers(model, cfg)
    files: list[FileHash] = []
    tensors: list[TensorHash] = []
    shas: list[str] = []
    for part, (f, path) in enumerate(zip(model.files, paths, strict=True)):
        file_hash, hashes, sha = _build_file(f, path, headers, cfg, progress)
        files.append(file_hash)
        tensors.extend(replace(t, part=part) for t in hashes)
        shas.append(sha)
    return Manifest(split_fingerprint(shas), tuple(files), tuple(tensors))


def _build_file(
    f: RemoteFile, path: Path, headers: dict[str, str], cfg: SourceConfig, progress: OnBytes | None
) -> tuple[FileHash, tuple[TensorHash, ...], str]:
    """One file read as a stream: its entry, its tensors' hashes, its sha256; its header
    and shared tensors kept at ``path``."""
    header = fetch_header(f, headers, cfg)
    spans = sorted(header.spans().items(), key=lambda kv: kv[1][0])
    hasher = _StreamHasher([(n, o, b) for n, (o, b) in spans])
    whole = hashlib.sha256()
    keep = [(o, o + b) for n, (o, b) in spans if not PER_RANGE.match(n)]
    with sparse_partial(path, f.size) as fh:

        def sink(offset: int, data: bytes) -> None:
            whole.update(data)
            hasher.feed(offset, data)
            for start, end in _overlaps(keep, offset, offset + len(data)):
                fh.seek(start)
                fh.write(data[start - offset : end - offset])
            if progress is not None:
                progress(len(data))

        sink(0, header.raw + header.after)  # the stream's first bytes, read already
        fh.seek(0)
        fh.write(header.raw)
        for start, end in _chunks(f.size, cfg.chunk_bytes, len(header.raw) + len(header.after)):
            stream_range(f.url, start, end, headers, cfg, sink)
        sha = whole.hexdigest()
        if f.sha256 is not None and sha != f.sha256:
            raise HashMismatch(f"{f.name}: sha256 {sha} is not the hub's {f.sha256}")
    entry = FileHash(
        _base(f), f.size, header.layout.data_start, blake3.blake3(header.raw).hexdigest()
    )
    return entry, hasher.result(), sha


def _chunks(size: int, step: int, first: int = 0) -> Iterator[tuple[int, int]]:
    for start in range(first, size, step):
        yield start, min(size, start + step)


def _overlaps(spans: list[tuple[int, int]], start: int, end: int) -> Iterator[tuple[int, int]]:
    for a, b in spans:
        if a < end and b > start:
            yield max(a, start), min(b, end)


class _StreamHasher:
    """BLAKE3 of each tensor of a file streamed in order; tensors sorted, not overlapping."""

    def __init__(self, spans: list[tuple[str, int, int]]) -> None:
        self._spans = spans
        self._hashers = [blake3.blake3() for _ in spans]
        self._first = 0  # the first tensor not yet wholly seen

    def feed(self, pos: int, data: bytes) -> None:
        end, j = pos + len(data), self._first
        while j < len(self._spans) and self._spans[j][1] < end:
            _, off, n = self._spans[j]
            lo, hi = max(off, pos), min(off + n, end)
            if hi > lo:
                self._hashers[j].update(data[lo - pos : hi - pos])
            if off + n <= end and j == self._first:
                self._first += 1
            j += 1

    def result(self) -> tuple[TensorHash, ...]:
        return tuple(
            TensorHash(name, off, n, h.hexdigest())
            for (name, off, n), h in zip(self._spans, self._hashers, strict=True)
        )
