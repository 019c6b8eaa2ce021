"""Every supported architecture through a real 2-node mesh: the tracker reads the file's
family, the first node embeds (Gemma's scale), the last applies its head (Gemma 2's
logit cap), and greedy ids equal the single-process engine's."""

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
    case = CASES[name]
    path = write_arch_gguf(tmp_path / f"{name}.gguf", case)
    local = load_local_model(path)
    prompt_ids = local.tokenizer.encode(PROMPT)
    want = generate(
        local.chain, local.tokenizer, prompt_ids, SamplingParams(max_tokens=TOKENS, temperature=0)
    ).ids
    half = case.n_layers // 2
    mesh = mesh_factory(f"0:{half},{half}:{case.n_layers}", model=path)
    model = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS}
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["meshnet"]
    assert len(out["route"]) == 2
    assert out["ids"] == want


@pytest.mark.parametrize("name", ["qwen2moe", "gpt-oss"])
def test_a_mixture_of_experts_through_a_three_node_mesh_equals_one_process(
    name: str, mesh_factory: MeshFactory, tmp_path: Path
) -> None:
    """Each node routes its own layers' rows to their experts; a streamed completion over
    three hops gives the single process's greedy ids."""
    case = CASES[name]
    path = write_arch_gguf(tmp_path / f"{name}.gguf", case)
    local = load_local_model(path)
    prompt_ids = local.tokenizer.encode(PROMPT)
    want = generate(
        local.chain, local.tokenizer, prompt_ids, SamplingParams(max_tokens=TOKENS, temperature=0)
    ).ids
    mesh = mesh_factory("0:1,1:3,3:4", model=path)
    model = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS}
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["meshnet"]
    assert len(out["route"]) == 3
    assert out["ids"] == want
