"""A node's copy of the tensors it serves: fetched by range, checked, resumable.

A node serving ``[start, end)`` of a model it does not have whole keeps
``shards/<fingerprint>/<start>-<end>.gguf``: a sparse file of the model's full
length holding the original header and, at their own offsets, only the tensors
that range reads (``RemoteHeader.needed``). It is a valid GGUF for what the
loader reads of that range, so a restarted node opens it as it is; the rest of
its length is holes, which take no disk.

While it is fetched it is ``NAME.partial`` beside ``NAME.state.json`` (which
tensors are checked, how far the others got). The header and each tensor are
checked against the signed manifest's BLAKE3 before the tensor counts as
fetched; a tensor that fails is fetched again (``cfg.attempts`` times, then
``HashMismatch``). A fetch that stops (a dropped source after its retries:
``FetchFailed``; the process killed) resumes from the state; a hash that never
matches or a full disk (``DiskFull``, also checked before the first byte)
removes the partial file and its state. The final name appears only whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import blake3

from meshnet.errors import DiskFull, HashMismatch, ModelSourceError
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_header import parse_layout
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.files import check_room, disk_errors, sync_dir
from meshnet.model_source.header import RemoteHeader
from meshnet.model_source.manifest import Manifest, TensorHash
from meshnet.model_source.peers import Peer, PeerRefused
from meshnet.model_source.progress import ProgressBar
from meshnet.model_source.sources import Hub, Source, Sources
from meshnet.model_source.sources import LocalShard as DiskShard

log = logging.getLogger(__name__)
_HASH_READ = 1 << 22


@dataclass(frozen=True)
class LocalShard:
    path: Path  # a GGUF the loader opens for ``layers``
    fingerprint: str  # the whole model's sha256 (not this file's)
    layers: LayerRange
    fetched_bytes: int = 0  # read from the network by this call
    from_peers: int = 0  # of which from peers, not the hub
    from_disk: int = 0  # copied from the model's other shards on this machine


def shard_path(cfg: SourceConfig, fingerprint: str, layers: LayerRange) -> Path:
    return shards_dir(cfg) / fingerprint / f"{layers.start}-{layers.end}.gguf"


def shards_dir(cfg: SourceConfig) -> Path:
    return cfg.cache_dir / "shards"


@dataclass
class _State:
    digest: str  # the manifest's: a state of another manifest is discarded
    header: bool = False
    done: dict[str, int] = field(default_factory=dict)  # tensor -> bytes written
    verified: set[str] = field(default_factory=set)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        body = {**self.__dict__, "verified": sorted(self.verified)}
        tmp.write_text(json.dumps(body))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, digest: str) -> _State:
        try:
            raw = json.loads(path.read_text())
            state = cls(raw["digest"], bool(raw["header"]), dict(raw["done"]), set(raw["verified"]))
        except (OSError, ValueError, KeyError, TypeError):
            return cls(digest)
        return state if state.digest == digest else cls(digest)


def fetch_shard(
    hub: Hub,
    manifest: Manifest,
    layers: LayerRange,
    cfg: SourceConfig,
    progress: ProgressBar | None = None,
    peers: Sequence[Peer] = (),
) -> LocalShard:
    """The local shard of ``layers``: as kept, or fetched now (see the module), from
    ``peers`` holding its parts first (each part from the first that gives bytes
    matching their hash), then from the hub (located only when a part needs it)."""
    path = shard_path(cfg, manifest.fingerprint, layers)
    if path.is_file():
        return LocalShard(path, manifest.fingerprint, layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        if path.is_file():  # another process fetched it meanwhile
            return LocalShard(path, manifest.fingerprint, layers)
        local = _local_shards(cfg, manifest.fingerprint, layers)
        sources = Sources(hub, list(peers), manifest, cfg, local)
        fetch = _Fetch(sources, manifest, layers, cfg, path)
        fetch.progress = progress
        try:
            fetch.run()
        except (HashMismatch, DiskFull):
            fetch.discard()
            raise
        got = fetch.sources
        return LocalShard(
            path, manifest.fingerprint, layers, got.fetched, got.from_peers, got.from_disk
        )


def _local_shards(cfg: SourceConfig, fingerprint: str, layers: LayerRange) -> list[DiskShard]:
    """The model's other whole shard files on this machine, most overlapping first."""
    folder = shards_dir(cfg) / fingerprint
    found: list[tuple[int, Path, LayerRange]] = []
    for f in folder.glob("*-*.gguf") if folder.is_dir() else []:
        start, _, end = f.name.removesuffix(".gguf").partition("-")
        if start.isdigit() and end.isdigit() and int(start) < int(end):
            other = LayerRange(int(start), int(end))
            if other != layers:
                overlap = min(other.end, layers.end) - max(other.start, layers.start)
                found.append((-overlap, f, other))
    return [DiskShard(f, other) for _, f, other in sorted(found)]


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """One fetch of a shard at a time on this machine (nodes of one ``meshnet up``)."""
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _Fetch:
    """One fetch of one shard file; ``run`` once."""

    def __init__(
        self,
        sources: Sources,
        manifest: Manifest,
        layers: LayerRange,
        cfg: SourceConfig,
        path: Path,
    ) -> None:
        self.sources = sources
        self.manifest, self.layers, self.cfg, self.path = manifest, layers, cfg, path
        self.progress: ProgressBar | None = None
        self.partial = path.with_name(path.name + ".partial")
        self.state_path = path.with_name(path.name + ".state.json")

    def run(self) -> None:
        state = _State.load(self.state_path, self.manifest.digest())
        if not self.partial.is_file():
            state = _State(self.manifest.digest())
        with disk_errors(self.path), self._open() as fh:
            header = self._header(fh, state)
            todo = self._tensors(header)
            left = sum(
                t.nbytes - state.done.get(t.name, 0) for t in todo if t.name not in state.verified
            )
            check_room(self.path.parent, left)
            if self.progress is not None:
                self.progress.plan(left)
            for t in todo:
                if t.name not in state.verified:
                    self._tensor(fh, t, state, header)
            fh.flush()
            os.fsync(fh.fileno())
        self.partial.replace(self.path)
        self.state_path.unlink(missing_ok=True)
        sync_dir(self.path.parent)

    def discard(self) -> None:
        self.partial.unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)

    def _open(self) -> BinaryIO:
        if not self.partial.is_file():
            with self.partial.open("wb") as fh:
                fh.truncate(self.manifest.size)  # sparse: only what is written takes disk
        return self.partial.open("r+b")

    def _header(self, fh: BinaryIO, state: _State) -> RemoteHeader:
        n = self.manifest.header_bytes
        raw = b""
        if state.header:
            fh.seek(0)
            raw = fh.read(n)
        if blake3.blake3(raw).hexdigest() != self.manifest.header_blake3:
            raw = self._fetch_header(n)
            fh.seek(0)
            fh.write(raw)
            state.header = True
            state.save(self.state_path)
        return RemoteHeader(raw, parse_layout(raw, self.path.name))

    def _fetch_header(self, n: int) -> bytes:
        for source in self.sources.order(None):
            try:
                raw = self.sources.read(source, 0, n)
                self._counted(len(raw))
            except PeerRefused as e:
                self.sources.drop(source, e)
                continue
            if blake3.blake3(raw).hexdigest() == self.manifest.header_blake3:
                return raw
            self.sources.mismatch(source, "the header")
        raise HashMismatch(f"{self.path.name}: the header never matched the manifest")

    def _tensors(self, header: RemoteHeader) -> list[TensorHash]:
        """The manifest's entries of the tensors ``layers`` reads, checked against the
        (checked) header's own offsets and sizes."""
        known, spans = self.manifest.by_name(), header.spans()
        out = []
        for name in header.needed(self.layers):
            t = known.get(name)
            if t is None or (t.offset, t.nbytes) != spans[name]:
                raise ModelSourceError(f"{self.path.name}: the manifest disagrees on {name!r}")
            out.append(t)
        return out

    def _tensor(self, fh: BinaryIO, t: TensorHash, state: _State, header: RemoteHeader) -> None:
        for source in self.sources.order(lambda layers: header.holds(t.name, layers)):
            try:
                digest = self._download(fh, t, state, source)
            except PeerRefused as e:
                self.sources.drop(source, e)
                state.done[t.name] = 0
                continue
            if digest == t.blake3:
                state.verified.add(t.name)
                state.save(self.state_path)
                return
            self.sources.mismatch(source, f"tensor {t.name}")
            state.done[t.name] = 0
        raise HashMismatch(f"{self.path.name}: tensor {t.name!r} never matched its manifest hash")

    def _download(self, fh: BinaryIO, t: TensorHash, state: _State, source: Source) -> str:
        """Fetch what ``t`` lacks from ``source``; the BLAKE3 of all its bytes: of the part
        written before (a resumed fetch), read back, then of the rest as it arrives."""
        h = blake3.blake3()
        pos = t.offset + state.done.get(t.name, 0)
        _hash_back(fh, t.offset, pos, h)

        def sink(offset: int, data: bytes) -> None:
            fh.seek(offset)
            fh.write(data)
            h.update(data)
            self._counted(len(data))

        while pos < t.end:
            end = min(t.end, pos + self.cfg.chunk_bytes)
            self.sources.stream(source, pos, end, sink)
            pos = end
            state.done[t.name] = pos - t.offset
            state.save(self.state_path)
        return str(h.hexdigest())

    def _counted(self, n: int) -> None:
        if self.progress is not None:
            self.progress(n)


def _hash_back(fh: BinaryIO, start: int, end: int, h: blake3.blake3) -> None:
    """Feed ``h`` the bytes ``[start, end)`` already in ``fh``."""
    fh.flush()
    fh.seek(start)
    while start < end:
        data = fh.read(min(end - start, _HASH_READ))
        if not data:
            break
        h.update(data)
        start += len(data)
