"""What shards this machine's cache holds, whole: a node's inventory, and pruning it.

Every node of a machine sharing one cache can serve any shard in it, so each reports
them all; ``prune`` removes the shards (and unfinished fetches) nobody needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from meshnet.layer_range import LayerRange
from meshnet.mesh_reports import MAX_HELD, HeldShardReport
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.shard_store import shards_dir

_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")
# <start>-<end>.gguf, or a split model's <start>-<end>-0000K-of-0000N.gguf; then what
# an unfinished fetch adds
_SHARD = re.compile(r"^(\d+)-(\d+)(-(\d{5})-of-\d{5})?\.gguf(\.partial|\.state\.json|\.lock)?$")


@dataclass(frozen=True)
class ShardFile:
    fingerprint: str
    layers: LayerRange
    path: Path
    whole: bool  # False: an unfinished fetch's partial file, state or lock
    first: bool = True  # the file a shard opens by (not a split shard's later part)

    @property
    def disk_bytes(self) -> int:
        """What the file takes on disk (a shard is sparse: less than its length)."""
        try:
            return self.path.stat().st_blocks * 512
        except OSError:
            return 0


def shard_files(cfg: SourceConfig) -> list[ShardFile]:
    """Every shard file in the cache, whole or not, in a stable order."""
    root = shards_dir(cfg)
    out: list[ShardFile] = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not _FINGERPRINT.match(folder.name) or not folder.is_dir():
            continue
        for f in sorted(folder.iterdir()):
            m = _SHARD.match(f.name)
            if m is None or int(m.group(1)) >= int(m.group(2)):
                continue
            layers = LayerRange(int(m.group(1)), int(m.group(2)))
            first = m.group(4) is None or int(m.group(4)) == 1
            out.append(ShardFile(folder.name, layers, f, m.group(5) is None, first))
    return out


def held_shards(cfg: SourceConfig) -> list[HeldShardReport]:
    """The whole shards in the cache, as a heartbeat reports them (at most ``MAX_HELD``);
    a split shard's bytes are its parts' together."""
    files = shard_files(cfg)
    held: list[HeldShardReport] = [
        {
            "fingerprint": s.fingerprint,
            "layer_start": s.layers.start,
            "layer_end": s.layers.end,
            "bytes": sum(
                o.disk_bytes
                for o in files
                if o.whole and (o.fingerprint, o.layers) == (s.fingerprint, s.layers)
            ),
        }
        for s in files
        if s.whole and s.first
    ]
    return held[:MAX_HELD]


def prune(
    cfg: SourceConfig, keep: set[tuple[str, LayerRange]], dry_run: bool = False
) -> list[ShardFile]:
    """Remove every shard file whose (fingerprint, layers) is not in ``keep``, with the
    files of unfinished fetches; returns what was (with ``dry_run``: would be) removed."""
    gone = [s for s in shard_files(cfg) if (s.fingerprint, s.layers) not in keep]
    if not dry_run:
        for s in gone:
            s.path.unlink(missing_ok=True)
        for folder in {s.path.parent for s in gone}:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    return gone
