"""A ring whose inputs go over the nodes' relay ports (raw TCP): when the connection
into a hop breaks mid-generation while every node stays up, the hop before blames
it (``stream-reset``), the tracker fails over, and the stream goes on with exactly
the tokens of an uninterrupted run."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import MeshFactory
from streams import Streamed, at, stream_completion

from meshnet.engine.generate import generate
from meshnet.engine.local import load_local_model
from meshnet.local_mesh import LocalMesh
from meshnet.model.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
BODY: dict[str, Any] = {
    "model": "long",
    "prompt": PROMPT,
    "max_tokens": 200,
    "temperature": 0.7,
    "seed": 5,
}


@pytest.fixture(scope="module")
def model(tiny_factory: Any) -> Path:
    return Path(tiny_factory("long.gguf", context_length=1024))


def _relay_port(mesh: LocalMesh, node: str) -> int:
    text = (mesh.data_dir / "logs" / f"{node}.log").read_text()
    found = re.search(r"takes relayed inputs on port (\d+)", text)
    assert found, f"{node} offers no relay port"
    return int(found.group(1))


def _cut(port: int) -> None:
    """Abort every TCP connection to or from ``port`` (both ends see it break)."""
    for side in ("dport", "sport"):
        subprocess.run(["ss", "-K", side, "=", f":{port}"], capture_output=True, check=False)


def _established(port: int) -> bool:
    out = subprocess.run(
        ["ss", "-Htn", "state", "established", "sport", "=", f":{port}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return bool(out.stdout.strip())


def test_a_broken_relay_connection_fails_over_exactly(
    mesh_factory: MeshFactory, model: Path
) -> None:
    if shutil.which("ss") is None:
        pytest.skip("no ss(8) to break a connection with")
    local = load_local_model(model)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=200)
    expected = generate(local.chain, local.tokenizer, PROMPT, params).ids
    mesh = mesh_factory("0:1,1:3,3:4", model=model)
    port = _relay_port(mesh, "node-1")
    cut: list[bool] = []

    def cut_into_node_1(_: Streamed) -> None:
        cut.append(_established(port))
        _cut(port)

    s = stream_completion(mesh, BODY, at(20, cut_into_node_1))
    assert cut == [True], "the ring did not relay into node-1 over its relay port"
    assert s.error is None, s.error
    assert s.ids == expected
    assert s.final is not None
    (recovery,) = s.final["recoveries"]
    assert (recovery["failed_node"], recovery["kind"]) == ("node-1", "stream-reset")
