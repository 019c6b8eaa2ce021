"""Many generations at once through one 3-node route of the bundled model: each gets
exactly the tokens it gets alone, and every node's KV returns to zero afterwards."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from solo import solo_chat_ids

from meshnet.engine.local import LocalModel

pytestmark = pytest.mark.bundled

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Say hello.",
             "What colour is the sky?", "Count to five.", "What is 2 + 2?",
             "Name an animal.", "Write one word."]  # fmt: skip


def _request(i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "max_tokens": 12 + i % 5,
    }
    if i % 2:
        body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
    else:
        body.update(temperature=0)
    return body


def test_sixteen_concurrent_streams_each_get_their_solo_output(
    mesh_factory: MeshFactory, bundled: LocalModel
) -> None:
    mesh = mesh_factory("0:10,10:20,20:30")
    bodies = [_request(i) for i in range(16)]

    def run(body: dict[str, Any]) -> list[int]:
        r = httpx.post(
            f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=300
        )
        assert r.status_code == 200, r.text
        return list(r.json()["meshnet"]["ids"])

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, bodies))
    assert together == [solo_chat_ids(bundled, b) for b in bodies]
    nodes = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        nodes = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
        if all(n["load"]["kv_bytes"] == 0 and n["load"]["sessions"] == 0 for n in nodes):
            break
        time.sleep(0.2)
    assert all(n["load"]["kv_bytes"] == 0 for n in nodes)
    assert min(n["load"]["max_batch"] for n in nodes) >= 2  # the streams were batched
    assert max(n["load"]["kv_peak_bytes"] for n in nodes) > 0
