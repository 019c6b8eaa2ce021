"""The directories a node may load models from when the tracker tells it to.

``Configure`` names a file; a node loads it only when its real path (links
followed) lies under one of the directories it was started with. A path
outside them is refused with the same words whether or not it exists, so the
answer says nothing about the node's file system.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from meshnet.errors import PermissionDenied


@dataclass(frozen=True)
class ModelDirs:
    dirs: tuple[str, ...]  # real paths

    @classmethod
    def of(cls, dirs: Iterable[str | Path]) -> ModelDirs:
        return cls(tuple(os.path.realpath(d) for d in dirs))

    def resolve(self, path: str) -> str:
        """The real path of ``path`` if it lies under an allowed directory."""
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, d]) == d for d in self.dirs):
            raise PermissionDenied("this node loads models only from its model directories")
        return real
