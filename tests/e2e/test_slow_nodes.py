"""A slow node is not a dead one: a node frozen for a moment times out a step but
answers the tracker's probe, so it stays up and the generation recovers exactly; and
a long prompt's step gets a deadline that grows with its length."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from streams import Streamed, at, stream_completion

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.model.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
BODY: dict[str, Any] = {
    "model": "slow",
    "prompt": PROMPT,
    "max_tokens": 120,
    "temperature": 0.7,
    "seed": 5,
}


@pytest.fixture(scope="module")
def model(tiny_factory: Any) -> Path:
    return Path(tiny_factory("slow.gguf", context_length=512))


def test_a_node_frozen_for_a_moment_stays_up_and_the_output_is_exact(
    mesh_factory: MeshFactory, model: Path
) -> None:
    mesh = mesh_factory(
        "0:2,2:4", model=model, tracker_args=["--step-timeout", "0.3"], heartbeat_timeout_s=30.0
    )
    local = load_local_model(model)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=120)
    expected = generate(local.chain, local.tokenizer, PROMPT, params).ids

    def pause(s: Streamed) -> None:
        mesh.kill_node("node-1", signal.SIGSTOP)
        time.sleep(0.8)  # past the step's deadline, well within the probe's 2 s
        mesh.kill_node("node-1", signal.SIGCONT)

    s = stream_completion(mesh, BODY, at(10, pause))
    assert s.error is None, s.error
    assert s.ids == expected
    assert s.final is not None
    assert [r["kind"] for r in s.final["recoveries"]] == ["deadline-exceeded"]
    nodes = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
    assert {n["node_id"]: n["state"] for n in nodes} == {"node-0": "up", "node-1": "up"}


@pytest.mark.bundled
def test_a_long_prompt_gets_a_deadline_that_grows_with_it(
    mesh_factory: MeshFactory, bundled: LocalModel
) -> None:
    # One step's deadline is 0.5 s; a 1,500-token prefill on one thread takes longer.
    mesh = mesh_factory("0:30", tracker_args=["--step-timeout", "0.5"])
    prompt = [int(i) for i in bundled.tokenizer.encode("the quick brown fox " * 300)][:1500]
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
    }
    t0 = time.monotonic()
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=300)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["meshnet"]["recoveries"] == []
    want = generate(bundled.chain, bundled.tokenizer, prompt, SamplingParams(max_tokens=3)).ids
    assert r.json()["meshnet"]["ids"] == want
    assert took > 0.5  # the prefill really ran past one step's deadline
