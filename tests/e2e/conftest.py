"""Real processes on loopback: meshes are started by these fixtures and always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, parse_layout

MeshFactory = Callable[..., LocalMesh]
# Node flags for a mesh whose nodes offer no memory for more layers: placement never
# widens a survivor over a dead node's range (tracker/serving/widening.py), which stays a gap.
NO_ROOM = ["--memory-mb", "1"]


@pytest.fixture(scope="module")
def mesh_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshFactory]:
    """Start meshes for a test module; every one is stopped when the module ends."""
    started: list[LocalMesh] = []

    def start(
        layout: str, model: Path | None = None, need_route: bool | None = None, **kwargs: object
    ) -> LocalMesh:
        mesh = LocalMesh(
            data_dir=tmp_path_factory.mktemp("mesh"), model=str(model) if model else None, **kwargs
        )  # type: ignore[arg-type]
        started.append(mesh)
        ranges: list[LayerRange | None] = parse_layout(layout)
        mesh.start(ranges, need_route=need_route)
        return mesh

    yield start
    for mesh in started:
        mesh.stop()
