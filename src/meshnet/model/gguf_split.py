"""Split GGUFs: one model in several files, as ``llama-gguf-split`` writes them.

A split model is ``PREFIX-00001-of-0000N.gguf`` .. ``PREFIX-0000N-of-0000N.gguf``.
Each part is a GGUF of its own: the first holds every metadata value (the
tokenizer too) and its share of the tensors, the others only the split keys and
theirs. Every part says ``split.no`` (its index from 0), ``split.count`` and
``split.tensors.count`` (the model's tensors, all parts together). A model is
opened by its first part, as llama.cpp opens it; the others are found by name.

A split model's identity on the mesh (its fingerprint) is the sha256 of its parts'
sha256s, in order, hex, one a line: what a hub's per-file sha256s give without a
byte of the model read, and what a local copy computes from its files.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshnet.errors import ModelFileError

KEY_NO = "split.no"
KEY_COUNT = "split.count"
KEY_TENSORS = "split.tensors.count"
MAX_PARTS = 9999
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class SplitName:
    prefix: str  # the name less ``-0000K-of-0000N.gguf`` (a folder kept)
    no: int  # 0-based, as ``split.no``
    count: int

    def part(self, no: int) -> str:
        return split_name(self.prefix, no, self.count)


def split_name(prefix: str, no: int, count: int) -> str:
    """The file name of part ``no`` (from 0) of ``count``, as llama.cpp spells it."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def parse_split_name(name: str) -> SplitName | None:
    """``name``'s place in a split model; None when it is not a part's name."""
    folder, _, base = name.rpartition("/")
    m = _NAME.match(base)
    if m is None:
        return None
    no, count = int(m.group("no")), int(m.group("count"))
    if not 1 <= no <= count <= MAX_PARTS:
        return None
    prefix = f"{folder}/{m.group('prefix')}" if folder else m.group("prefix")
    return SplitName(prefix, no - 1, count)


def model_stem(name: str) -> str:
    """A model file's name less its folder, ``.gguf`` and split suffix: the model's name."""
    base = name.rsplit("/", 1)[-1]
    split = parse_split_name(base)
    return split.prefix if split else base.removesuffix(".gguf")


def model_parts(path: Path) -> tuple[Path, ...]:
    """The files of the model opened by ``path``: itself, or its split's parts in order.
    ``ModelFileError`` for a part other than the first (open the first) and for a part
    that is missing."""
    split = parse_split_name(path.name)
    if split is None or split.count == 1:
        return (path,)
    if split.no != 0:
        raise ModelFileError(
            f"{path.name}: part {split.no + 1} of a split GGUF; open its first part, "
            f"{split.part(0)}"
        )
    parts = tuple(path.with_name(split.part(i)) for i in range(split.count))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFileError(f"{path.name}: split GGUF parts missing: {', '.join(missing)}")
    return parts


def check_part(metadata: dict[str, object], no: int, count: int, name: str) -> int:
    """Check a part's split keys against its place; returns ``split.tensors.count``."""
    got = (metadata.get(KEY_NO), metadata.get(KEY_COUNT))
    if got != (no, count):
        raise ModelFileError(
            f"{name}: its split keys say part {got[0]} of {got[1]}, "
            f"its name part {no} of {count} (from 0)"
        )
    total = metadata.get(KEY_TENSORS)
    if not isinstance(total, int) or total < 0:
        raise ModelFileError(f"{name}: {KEY_TENSORS} is missing or not a count")
    return total


def split_fingerprint(part_sha256s: Sequence[str]) -> str:
    """A split model's fingerprint from its parts' sha256s (hex); a single file's is its own."""
    if len(part_sha256s) == 1:
        return part_sha256s[0]
    return hashlib.sha256("".join(f"{s}\n" for s in part_sha256s).encode()).hexdigest()
