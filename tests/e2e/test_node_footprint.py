"""A node process holds what serves its layers, not libraries it never calls.

Where the native kernels are built, a node never runs a numba kernel, so it must not
load numba: its LLVM alone kept ~60 MB resident in every node, a third of what a node
started empty held. Nor does a node tokenize (the tracker does): the tokenizer its
start-up check builds is built in a forked child, so the tokenizer library and the
heap it used (~10 MB on a 128k-token vocabulary) never reach the serving process.
Nor does a node load pydantic (~9 MB with its schemas): it writes its reports to the
tracker as typed dicts. Real nodes on loopback (one per backend with layers, one
empty) serve a completion; then no node has numba's, llvmlite's, the tokenizer's or
pydantic's libraries mapped.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import MeshFactory

pytest.importorskip("meshnet.backends._native")  # without it the numba kernels serve

UNUSED = ("numba", "llvmlite", "tokenizers", "pydantic_core")  # in their libraries' paths


def _unused_mapped(pid: int) -> list[str]:
    """The files of the ``UNUSED`` libraries mapped into process ``pid``."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    files = {line.split()[-1] for line in maps if len(line.split()) > 5}
    return sorted(f for f in files if any(name in f for name in UNUSED))


@pytest.mark.parametrize("backend", ["fast", "q8"])
def test_a_node_never_loads_numba_the_tokenizer_or_pydantic(
    mesh_factory: MeshFactory, tiny_path: Path, backend: str
) -> None:
    mesh = mesh_factory("0:2,2:4", model=tiny_path, node_args=["--backend", backend])
    mesh.start_node("node-empty", None)
    mesh.wait_ready(expected_nodes=3, timeout_s=180)
    model = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello there", "temperature": 0, "max_tokens": 8}
    answer = httpx.post(
        f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0
    for node_id, proc in mesh.nodes.items():
        assert proc.poll() is None, node_id
        assert _unused_mapped(proc.pid) == [], node_id
