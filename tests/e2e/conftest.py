"""Real processes on loopback: meshes are started by these fixtures and always stopped."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from solo import solo_completion_ids
from tiny_requests import LONG_CONTEXT

from meshnet.engine.local import LocalModel, load_local_model
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, parse_layout

MeshFactory = Callable[..., LocalMesh]
# Node flags for a mesh whose nodes offer no memory for more layers: placement never
# widens a survivor over a dead node's range (tracker/serving/widening.py), which stays a gap.
NO_ROOM = ["--memory-mb", "1"]
SoloIds = Callable[[Path, dict[str, Any]], list[int]]


@pytest.fixture(scope="session")
def long_tiny(tiny_factory: Any) -> Path:
    """The tiny model with room for long generations (see tiny_requests.py), written
    once: no test writes to it, and nodes only read it."""
    return Path(tiny_factory("long.gguf", context_length=LONG_CONTEXT))


@pytest.fixture(scope="session")
def solo_ids() -> SoloIds:
    """The ids a completion body generates in-process on a model file: the oracle a
    mesh's answer is compared with. Each (model, body) runs once a session."""
    models: dict[Path, LocalModel] = {}
    answers: dict[tuple[Path, str], list[int]] = {}

    def ids(model: Path, body: dict[str, Any]) -> list[int]:
        key = (model, json.dumps(body, sort_keys=True))
        if key not in answers:
            if model not in models:
                models[model] = load_local_model(model)
            answers[key] = solo_completion_ids(models[model], body)
        return list(answers[key])

    return ids


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
