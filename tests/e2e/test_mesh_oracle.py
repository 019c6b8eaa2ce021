"""Greedy generations through 1-, 2- and 3-node meshes of the bundled model give the
oracle's ids, exactly like single-process ``meshnet generate``. The oracle is an fp32
implementation's, so the nodes run ``fast`` (float32 activations); the default, q8,
is held to the in-process engine on its own backend (test_openai_client.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import MeshFactory

pytestmark = pytest.mark.bundled

CHAT_CASES = {
    "capital": "What is the capital of France?",
    "cpu": "Explain what a CPU does in one sentence.",
    "haiku": "Write a haiku about the ocean.",
}
LAYOUTS = {1: "0:30", 2: "0:15,15:30", 3: "0:10,10:20,20:30"}


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_greedy_ids_through_the_mesh_equal_the_oracle(
    nodes: int, mesh_factory: MeshFactory, oracle: dict[str, Any]
) -> None:
    mesh = mesh_factory(LAYOUTS[nodes], node_args=["--backend", "fast"])
    cases = {c["name"]: c for c in oracle["cases"]}
    model = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()["data"][0]["id"]
    for name, question in CHAT_CASES.items():
        body = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": 48,
        }
        r = httpx.post(
            f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=300
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meshnet"]["ids"] == cases[name]["hf_greedy_ids"], name
        assert len(out["meshnet"]["route"]) == nodes
        assert out["usage"]["prompt_tokens"] == len(cases[name]["prompt_ids"])
        expected_text = cases[name]["hf_greedy_text"].removesuffix("<|im_end|>")
        assert out["choices"][0]["message"]["content"] == expected_text
    raw = cases["raw_completion"]
    r = httpx.post(
        f"{mesh.url}/v1/completions",
        headers=mesh.api_headers,
        timeout=300,
        json={"model": model, "prompt": raw["prompt_text"], "temperature": 0, "max_tokens": 48},
    )
    assert r.json()["meshnet"]["ids"] == raw["hf_greedy_ids"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
