"""Supported architectures through a real mesh of 2 nodes (3 for the mixtures): the
tracker reads the file's family, the first node embeds (Gemma's scale), the last applies
its head (Gemma 2's logit cap), and greedy ids equal the single-process engine's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import MeshFactory
from tinyarch import CASES, write_arch_gguf

from meshnet.engine.generate import generate
from meshnet.engine.local import load_local_model
from meshnet.model.sampling import SamplingParams

PROMPT = "the theory of the sea"
TOKENS = 10


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3"])
def test_greedy_ids_through_a_split_mesh_equal_one_process(
    name: str, mesh_factory: MeshFactory, tmp_path: Path
) -> None:
    half = CASES[name].n_layers // 2
    _assert_mesh_equals_one_process(
        name, f"0:{half},{half}:{CASES[name].n_layers}", mesh_factory, tmp_path
    )


@pytest.mark.parametrize("name", ["qwen2moe", "gpt-oss"])
def test_a_mixture_of_experts_through_a_three_node_mesh_equals_one_process(
    name: str, mesh_factory: MeshFactory, tmp_path: Path
) -> None:
    """Each node routes its own layers' rows to their experts; a completion over three
    hops gives the single process's greedy ids."""
    _assert_mesh_equals_one_process(name, "0:1,1:3,3:4", mesh_factory, tmp_path)


def _assert_mesh_equals_one_process(
    name: str, layout: str, mesh_factory: MeshFactory, tmp_path: Path
) -> None:
    path = write_arch_gguf(tmp_path / f"{name}.gguf", CASES[name])
    local = load_local_model(path)
    prompt_ids = local.tokenizer.encode(PROMPT)
    want = generate(
        local.chain, local.tokenizer, prompt_ids, SamplingParams(max_tokens=TOKENS, temperature=0)
    ).ids
    mesh = mesh_factory(layout, model=path)
    model = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS}
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["meshnet"]
    assert len(out["route"]) == layout.count(",") + 1
    assert out["ids"] == want
