"""A node's copy of the tensors it serves: fetched by range, checked, resumable.

A node serving ``[start, end)`` of a model it does not have whole keeps
``shards/<fingerprint>/<start>-<end>.gguf``: a sparse file of the model's full
length holding the original header and, at their own offsets, only the tensors
that range reads (``RemoteHeader.needed``). It is a valid GGUF for what the
loader reads of that range, so a restarted node opens it as it is; the rest of
its length is holes, which take no disk. Of a split GGUF it keeps a file per part,
``<start>-<end>-0000K-of-0000N.gguf``, each holding its part's header and the range's
tensors in it; the loader opens them by the first (``model.gguf_split``).

While it is fetched it is ``NAME.partial`` (per part) beside ``NAME.state.json`` (which
tensors are checked, how far the others got). The header and each tensor are
checked against the signed manifest's BLAKE3 before the tensor counts as
fetched; a tensor that fails is fetched again (``cfg.attempts`` times, then
``HashMismatch``). A fetch that stops (a dropped source after its retries:
``FetchFailed``; the process killed) resumes from the state; a hash that never
matches or a full disk (``DiskFull``, also checked before the first byte)
removes the partial file and its state. The final name appears only whole (a split
shard's first part last: it is whole once its first part is there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import blake3

from meshnet.errors import DiskFull, HashMismatch, ModelSourceError
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_header import parse_layout
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.files import check_room, disk_errors, hash_back, locked, sync_dir
from meshnet.model_source.first_fetch import Ledger, await_hash
from meshnet.model_source.header import ModelHeader, RemoteHeader
from meshnet.model_source.live import LiveFetch
from meshnet.model_source.manifest import Manifest, TensorHash
from meshnet.model_source.peers import Peer, PeerRefused
from meshnet.model_source.progress import ProgressBar
from meshnet.model_source.shard_names import (
    remove_shard,
    shard_layers,
    shard_part_path,
    shard_path,
    shard_paths,
    shards_dir,
)
from meshnet.model_source.sources import Hub, Source, Sources
from meshnet.model_source.sources import LocalShard as DiskShard

__all__ = [  # the shard files' names, from shard_names, as callers know them here
    "remove_shard",
    "shard_part_path",
    "shard_path",
    "shard_paths",
    "shards_dir",
]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalShard:
    path: Path  # a GGUF the loader opens for ``layers``
    fingerprint: str  # the whole model's sha256 (not this file's)
    layers: LayerRange
    fetched_bytes: int = 0  # read from the network by this call
    from_peers: int = 0  # of which from peers, not the hub
    from_disk: int = 0  # copied from the model's other shards on this machine
    learned: dict[str, str] = field(default_factory=dict)  # first-fetch hashes (first_fetch)


@dataclass
class _State:
    digest: str  # the manifest's: a state of another manifest is discarded
    headers: set[int] = field(default_factory=set)  # the parts whose header is written
    done: dict[str, int] = field(default_factory=dict)  # tensor -> bytes written
    verified: set[str] = field(default_factory=set)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        body = {
            **self.__dict__,
            "headers": sorted(self.headers),
            "verified": sorted(self.verified),
        }
        tmp.write_text(json.dumps(body))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, digest: str) -> _State:
        try:
            raw = json.loads(path.read_text())
            state = cls(
                raw["digest"],
                {int(i) for i in raw["headers"]},
                dict(raw["done"]),
                set(raw["verified"]),
            )
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
    live: LiveFetch | None = None,
    ledger: Ledger | None = None,
) -> LocalShard:
    """The local shard of ``layers``: as kept, or fetched now (see the module), from
    ``peers`` holding its parts first (each part from the first that gives bytes
    matching their hash), then from the hub (located only when a part needs it).
    ``live`` (made for ``shard_paths``) is told each part as it is checked, so peers
    may read it before the fetch ends (``live``). A tensor whose hash the manifest
    leaves unknown is fetched as ``first_fetch`` says, its hash told to ``ledger``."""
    paths = shard_paths(cfg, manifest.fingerprint, layers, len(manifest.files))
    path = paths[0]
    if path.is_file():
        return LocalShard(path, manifest.fingerprint, layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path.with_name(path.name + ".lock")):
        if path.is_file():  # another process fetched it meanwhile
            return LocalShard(path, manifest.fingerprint, layers)
        local = _local_shards(cfg, manifest, layers)
        sources = Sources(hub, list(peers), manifest, cfg, local)
        fetch = _Fetch(sources, manifest, layers, cfg, paths)
        fetch.progress, fetch.live, fetch.ledger = progress, live, ledger
        try:
            fetch.run()
        except (HashMismatch, DiskFull):
            fetch.discard()
            raise
        got = fetch.sources
        return LocalShard(
            path,
            manifest.fingerprint,
            layers,
            got.fetched,
            got.from_peers,
            got.from_disk,
            fetch.learned,
        )


def _local_shards(cfg: SourceConfig, manifest: Manifest, layers: LayerRange) -> list[DiskShard]:
    """The model's other whole shards on this machine, most overlapping first."""
    folder, n = shards_dir(cfg) / manifest.fingerprint, len(manifest.files)
    found: list[tuple[int, tuple[Path, ...], LayerRange]] = []
    for f in folder.glob("*-*.gguf") if folder.is_dir() else []:
        other = shard_layers(f.name, n)
        if other is not None and other != layers:
            overlap = min(other.end, layers.end) - max(other.start, layers.start)
            paths = shard_paths(cfg, manifest.fingerprint, other, n)
            if all(p.is_file() for p in paths):
                found.append((-overlap, paths, other))
    return [DiskShard(paths, other) for _, paths, other in sorted(found)]


class _Fetch:
    """One fetch of one shard file; ``run`` once."""

    def __init__(
        self,
        sources: Sources,
        manifest: Manifest,
        layers: LayerRange,
        cfg: SourceConfig,
        paths: tuple[Path, ...],
    ) -> None:
        self.sources = sources
        self.manifest, self.layers, self.cfg = manifest, layers, cfg
        self.paths, self.path = paths, paths[0]
        self.progress: ProgressBar | None = None
        self.live: LiveFetch | None = None
        self.ledger: Ledger | None = None
        self.learned: dict[str, str] = {}
        self.partials = [p.with_name(p.name + ".partial") for p in paths]
        self.state_path = self.path.with_name(self.path.name + ".state.json")

    def run(self) -> None:
        state = _State.load(self.state_path, self.manifest.layout_digest())
        if not all(p.is_file() for p in self.partials):
            state = _State(self.manifest.layout_digest())
        with disk_errors(self.path), contextlib.ExitStack() as stack:
            fhs = [stack.enter_context(self._open(i)) for i in range(len(self.paths))]
            header = ModelHeader(tuple(self._header(fhs, i, state) for i in range(len(fhs))))
            todo = self._tensors(header)
            left = sum(
                t.nbytes - state.done.get(t.name, 0) for t in todo if t.name not in state.verified
            )
            check_room(self.path.parent, left)
            if self.progress is not None:
                self.progress.plan(left)
            for t in todo:
                if t.name not in state.verified:
                    self._tensor(fhs[t.part], t, state, header)
                self._checked(fhs[t.part], t.part, t.offset, t.end)
            for fh in fhs:
                fh.flush()
                os.fsync(fh.fileno())
        for partial, path in reversed(list(zip(self.partials, self.paths, strict=True))):
            partial.replace(path)  # the first part last: whole once it is there
        self.state_path.unlink(missing_ok=True)
        sync_dir(self.path.parent)

    def discard(self) -> None:
        for partial in self.partials:
            partial.unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)

    def _open(self, part: int) -> BinaryIO:
        partial = self.partials[part]
        if not partial.is_file():
            with partial.open("wb") as fh:
                fh.truncate(self.manifest.files[part].size)  # sparse: holes take no disk
        return partial.open("r+b")

    def _header(self, fhs: list[BinaryIO], part: int, state: _State) -> RemoteHeader:
        entry, fh = self.manifest.files[part], fhs[part]
        raw = b""
        if part in state.headers:
            fh.seek(0)
            raw = fh.read(entry.header_bytes)
        if blake3.blake3(raw).hexdigest() != entry.header_blake3:
            raw = self._fetch_header(part)
            fh.seek(0)
            fh.write(raw)
            state.headers.add(part)
            state.save(self.state_path)
        self._checked(fh, part, 0, entry.header_bytes)
        return RemoteHeader(raw, parse_layout(raw, self.paths[part].name))

    def _checked(self, fh: BinaryIO, part: int, start: int, end: int) -> None:
        """Bytes of ``part`` checked: written out (peers read the file), and told ``live``."""
        if self.live is not None:
            fh.flush()
            self.live.checked(part, start, end)

    def _fetch_header(self, part: int) -> bytes:
        entry = self.manifest.files[part]
        for source in self.sources.order(None):
            try:
                raw = self.sources.read(source, part, 0, entry.header_bytes)
                self._counted(len(raw))
            except PeerRefused as e:
                self.sources.drop(source, e)
                continue
            if blake3.blake3(raw).hexdigest() == entry.header_blake3:
                return raw
            self.sources.mismatch(source, f"the header of {entry.name}")
        raise HashMismatch(f"{entry.name}: the header never matched the manifest")

    def _tensors(self, header: ModelHeader) -> list[TensorHash]:
        """The manifest's entries of the tensors ``layers`` reads, checked against the
        (checked) headers' own parts, offsets and sizes."""
        known, spans = self.manifest.by_name(), header.spans()
        out = []
        for name in header.needed(self.layers):
            t = known.get(name)
            if t is None or (t.part, t.offset, t.nbytes) != spans[name]:
                raise ModelSourceError(f"{self.path.name}: the manifest disagrees on {name!r}")
            out.append(t)
        return out

    def _tensor(self, fh: BinaryIO, t: TensorHash, state: _State, header: ModelHeader) -> None:
        def holds(layers: LayerRange) -> bool:
            return header.holds(t.name, layers)

        fetching = [p for p in self.sources.peers if p.fetching and holds(p.layers)]
        if t.blake3 is None and self.ledger is not None and fetching:  # its hash may come
            t = replace(t, blake3=await_hash(self.ledger, t.name, self.cfg.peer_wait_s))
            for peer in fetching if t.blake3 is None else ():  # no wait on them again
                self.sources.drop(peer, ModelSourceError("its hashes do not come"))
        if t.blake3 is None:
            self._first_fetch(fh, t, state, header)
            return
        for source in self.sources.order(holds):
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

    def _first_fetch(self, fh: BinaryIO, t: TensorHash, state: _State, header: ModelHeader) -> None:
        """``t`` of unknown hash: from this machine's shards or the hub, its hash reported
        (``first_fetch``); fetched again, checked, when the tracker holds another."""
        holds = lambda layers: header.holds(t.name, layers)  # noqa: E731
        for source in self.sources.order(holds, peers=False):
            try:
                digest = self._download(fh, t, state, source)
            except PeerRefused as e:
                self.sources.drop(source, e)
                state.done[t.name] = 0
                continue
            recorded = self.ledger.report(t.name, digest) if self.ledger is not None else None
            if recorded is not None and recorded != digest:
                log.warning("tensor %s: the tracker holds another hash; fetched again", t.name)
                state.done[t.name] = 0
                self._tensor(fh, replace(t, blake3=recorded), state, header)
                return
            self.learned[t.name] = digest
            state.verified.add(t.name)
            state.save(self.state_path)
            return
        raise HashMismatch(f"{self.path.name}: tensor {t.name!r} could not be fetched")

    def _download(self, fh: BinaryIO, t: TensorHash, state: _State, source: Source) -> str:
        """Fetch what ``t`` lacks from ``source``; the BLAKE3 of all its bytes: of the part
        written before (a resumed fetch), read back, then of the rest as it arrives."""
        h = blake3.blake3()
        pos = t.offset + state.done.get(t.name, 0)
        hash_back(fh, t.offset, pos, h)

        def sink(offset: int, data: bytes) -> None:
            fh.seek(offset)
            fh.write(data)
            h.update(data)
            self._counted(len(data))

        while pos < t.end:
            end = min(t.end, pos + self.cfg.chunk_bytes)
            self.sources.stream(source, t.part, pos, end, sink)
            pos = end
            state.done[t.name] = pos - t.offset
            state.save(self.state_path)
        return str(h.hexdigest())

    def _counted(self, n: int) -> None:
        if self.progress is not None:
            self.progress(n)
