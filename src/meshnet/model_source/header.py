"""A remote GGUF's header, read with range requests, and the tensors a layer range needs.

The header's length is not known before it is parsed: the first 64 KiB is read,
then twice as much until it parses (``HeaderTruncated`` says when to read on). A
split GGUF has a header per part (``ModelHeader``): the first holds the metadata,
each its own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.errors import ModelFileError
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_header import HeaderLayout, HeaderTruncated, byte_count, parse_layout
from meshnet.model.layer_bytes import range_holds
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.ranged import read_range
from meshnet.model_source.remote import RemoteFile

_FIRST_READ = 64 << 10  # then twice as much: at most twice the header is read
MAX_HEADER_BYTES = 1 << 30  # a header past this is a corrupt count, not a vocabulary


@dataclass(frozen=True)
class RemoteHeader:
    raw: bytes  # the file's bytes [0, layout.data_start)
    layout: HeaderLayout
    after: bytes = b""  # the bytes read past the header (the read was larger)

    def spans(self) -> dict[str, tuple[int, int]]:
        """Each tensor's bytes in the file: name -> (offset, byte count)."""
        start = self.layout.data_start
        return {i.name: (start + i.offset, byte_count(i)) for i in self.layout.infos}


@dataclass(frozen=True)
class ModelHeader:
    """The headers of a model's files (one, or a split GGUF's parts in order)."""

    parts: tuple[RemoteHeader, ...]

    def spans(self) -> dict[str, tuple[int, int, int]]:
        """Each tensor's bytes: name -> (part, offset in that part, byte count)."""
        return {
            name: (i, offset, n)
            for i, part in enumerate(self.parts)
            for name, (offset, n) in part.spans().items()
        }

    @property
    def n_layers(self) -> int:
        metadata = self.parts[0].layout.metadata
        arch = metadata.get("general.architecture")
        n = metadata.get(f"{arch}.block_count")
        if not isinstance(n, int) or n < 1:
            raise ModelFileError(f"the header has no {arch}.block_count")
        return n

    @property
    def tied_head(self) -> bool:
        return all(i.name != "output.weight" for p in self.parts for i in p.layout.infos)

    def holds(self, name: str, layers: LayerRange) -> bool:
        """Whether a node serving ``layers`` reads the tensor ``name``."""
        return range_holds(name, layers, self.n_layers, self.tied_head)

    def needed(self, layers: LayerRange) -> list[str]:
        """The tensors a node serving ``layers`` reads, in file order (part by part)."""
        layers.check_within(self.n_layers)
        spans, tied = self.spans(), self.tied_head
        held = [n for n in spans if range_holds(n, layers, self.n_layers, tied)]
        return sorted(held, key=lambda n: spans[n][:2])


def fetch_header(f: RemoteFile, headers: dict[str, str], cfg: SourceConfig) -> RemoteHeader:
    """Read and parse the header of ``f``; ``ModelFileError`` when it is not a GGUF."""
    n = min(_FIRST_READ, f.size)
    buf = b""
    while True:
        buf += read_range(f.url, len(buf), n, headers, cfg)
        try:
            layout = parse_layout(buf, f.name)
        except HeaderTruncated:
            if n >= min(f.size, MAX_HEADER_BYTES):
                raise
            n = min(2 * n, f.size, MAX_HEADER_BYTES)
            continue
        _check_extents(layout, f)
        return RemoteHeader(buf[: layout.data_start], layout, buf[layout.data_start :])


def _check_extents(layout: HeaderLayout, f: RemoteFile) -> None:
    for info in layout.infos:
        if layout.data_start + info.offset + byte_count(info) > f.size:
            raise ModelFileError(f"{f.name}: tensor {info.name!r} runs past the end of the file")
