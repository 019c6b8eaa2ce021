"""Where a node's shards lie in the cache: ``shards/<fingerprint>/<start>-<end>.gguf``, or
a split model's ``<start>-<end>-0000K-of-0000N.gguf`` parts (``shard_store``)."""

from __future__ import annotations

from pathlib import Path

from meshnet.errors import ModelSourceError
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_split import parse_split_name, split_name
from meshnet.model_source.config import SourceConfig


def shard_paths(
    cfg: SourceConfig, fingerprint: str, layers: LayerRange, parts: int = 1
) -> tuple[Path, ...]:
    """The files of a shard of a model of ``parts`` files: the first is what opens it."""
    folder, stem = shards_dir(cfg) / fingerprint, f"{layers.start}-{layers.end}"
    if parts == 1:
        return (folder / f"{stem}.gguf",)
    return tuple(folder / split_name(stem, i, parts) for i in range(parts))


def shard_path(cfg: SourceConfig, fingerprint: str, layers: LayerRange, parts: int = 1) -> Path:
    """The file a shard is opened by (its first part's, of a split GGUF)."""
    return shard_paths(cfg, fingerprint, layers, parts)[0]


def remove_shard(path: Path) -> None:
    """Remove the shard opened by ``path`` (every part of a split one)."""
    split = parse_split_name(path.name)
    parts = [path.with_name(split.part(i)) for i in range(split.count)] if split else [path]
    for p in parts:
        p.unlink(missing_ok=True)


def shard_part_path(cfg: SourceConfig, fingerprint: str, layers: LayerRange, part: int) -> Path:
    """The file holding part ``part`` of the shard kept here, whichever way it is split
    (what a peer asking for bytes of it names)."""
    whole = shard_path(cfg, fingerprint, layers)
    if whole.is_file():
        return whole
    pattern = f"{layers.start}-{layers.end}-{part + 1:05d}-of-*.gguf"
    found = sorted(whole.parent.glob(pattern))
    if not found:
        raise ModelSourceError(f"no part {part} of {layers} of {fingerprint[:12]} here")
    return found[0]


def shards_dir(cfg: SourceConfig) -> Path:
    return cfg.cache_dir / "shards"


def shard_layers(name: str, parts: int) -> LayerRange | None:
    """The layers of the shard whose (first) file is named ``name``, of a model of
    ``parts`` files; None for any other file."""
    split = parse_split_name(name)
    if (split is None) != (parts == 1) or (split is not None and split.no != 0):
        return None
    stem = split.prefix if split is not None else name.removesuffix(".gguf")
    if split is not None and split.count != parts:
        return None
    start, _, end = stem.partition("-")
    if start.isdigit() and end.isdigit() and int(start) < int(end):
        return LayerRange(int(start), int(end))
    return None
