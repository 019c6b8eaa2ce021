"""Context limits: a node serves up to its ``--ctx`` (at most the model's trained
context, and a budget too small for it is refused at load); a prompt past the least
context of the mesh's nodes is a 400 naming the limit, and nothing changes on the mesh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory

from meshnet.errors import KVBudgetExhausted
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.node.engine import EngineConfig, NodeEngine

CTX = 64  # the tiny model was trained for 256


def _complete(mesh: LocalMesh, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=60)


def _loads(mesh: LocalMesh) -> list[dict[str, Any]]:
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=30)
    return [n["load"] for n in r.json()["nodes"]]


def test_a_prompt_past_the_nodes_context_is_a_400_naming_it(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    mesh = mesh_factory("0:2,2:4", model=tiny_path, node_args=["--ctx", str(CTX)])
    assert [load["context"] for load in _loads(mesh)] == [CTX, CTX]
    steps_before = [load["steps"] for load in _loads(mesh)]
    for prompt, max_tokens in (([5] * 60, 5), ([5] * 200, 4), ([5] * 300, 1)):
        r = _complete(mesh, prompt, max_tokens)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context-too-long"
        assert str(CTX) in error["message"]
    loads = _loads(mesh)  # nothing ran: no step, no session, no KV
    assert [load["steps"] for load in loads] == steps_before
    assert all(load["sessions"] == 0 and load["kv_bytes"] == 0 for load in loads)
    ok = _complete(mesh, [5] * 58, 6)  # exactly the context
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def test_a_context_the_kv_budget_cannot_hold_is_refused_at_load(tiny_path: Path) -> None:
    # the tiny model's 4 layers hold 1 KiB of KV per position
    engine = NodeEngine(EngineConfig(kv_budget_bytes=100 * 1024, ctx=200))
    engine.start()
    try:
        with pytest.raises(KVBudgetExhausted, match="--ctx 200"):
            engine.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
        assert not engine.stats().loaded
        fits = NodeEngine(EngineConfig(kv_budget_bytes=100 * 1024, ctx=90))
        fits.start()
        try:
            fits.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
            assert fits.stats().context == 90
        finally:
            fits.stop()
    finally:
        engine.stop()
    wide = NodeEngine(EngineConfig(ctx=10_000))  # past the trained context: that context
    wide.start()
    try:
        wide.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
        assert wide.stats().context == 256
    finally:
        wide.stop()
