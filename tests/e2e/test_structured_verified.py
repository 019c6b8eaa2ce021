"""Constrained decoding under verification, on a tiny random-weight model.

The verifier re-checks each of a last hop's picks from its own logits; under a
grammar it must mask them as the node did, or every constrained pick that is not
the raw likeliest id would be a false alarm. A random model's logits rarely favour
JSON, so most picks here are exactly such ids.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from conftest import MeshFactory
from faults import nodes
from verification_views import ledger, wait_state

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.info import load_model_info

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["word", "n", "ok"],
    "additionalProperties": False,
}
BODY: dict[str, Any] = {
    "model": "long",
    "prompt": "the quick brown fox jumps over the lazy dog " * 6,
    "max_tokens": 120,
    "temperature": 0.9,
    "seed": 3,
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "t", "schema": SCHEMA, "strict": True},
    },
}
LAUNCHER = str(Path(__file__).parent / "dishonest_node.py")


@pytest.fixture(scope="module")
def long_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("long.gguf", context_length=1024))


def _complete(mesh: LocalMesh, body: dict[str, Any] = BODY) -> dict[str, Any]:
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_an_honest_constrained_generation_fails_no_check(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    mesh = mesh_factory("0:2,2:4", model=long_tiny, tracker_args=["--verify-rate", "1.0"])
    first, second = _complete(mesh), _complete(mesh)
    assert first["meshnet"]["ids"] == second["meshnet"]["ids"]
    assert first["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(first["choices"][0]["text"]), SCHEMA)
    tokenizer = load_model_info(long_tiny).tokenizer
    raw = [i for i in first["meshnet"]["ids"] if i not in tokenizer.eog_ids]
    assert tokenizer.decode(raw) == first["choices"][0]["text"]
    time.sleep(2.0)  # the verifier's queue drains
    for node_id in ("node-0", "node-1"):
        assert nodes(mesh)[node_id]["state"] == "up"
        records = ledger(mesh, node_id)
        assert records and all(r["status"] != "rejected" for r in records), records


def test_a_last_hop_that_picks_outside_the_grammar_is_replaced_at_once(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    """The cheater computes honestly and picks the id after the sampler's, outside the
    grammar: the tracker takes no such id, fails over to an honest node on the spot
    (so the replacement never inherits a history the grammar cannot continue), and the
    client gets the honest answer; the cheater is not paid."""
    args = ["--verify-rate", "1.0"]
    mesh = mesh_factory("0:2", model=long_tiny, tracker_args=args, need_route=False)
    prefix = [sys.executable, LAUNCHER, "sample", "0", "--"]
    mesh.start_node("cheater", LayerRange(2, 4), prefix=prefix)
    wait_state(mesh, "cheater", "up")
    mesh.start_node("spare", None)
    mesh.wait_ready(expected_nodes=3, timeout_s=180)
    first = _complete(mesh)
    (recovery,) = first["meshnet"]["recoveries"]
    assert recovery["kind"] == "malformed-bundle" and recovery["failed_node"] == "cheater"
    jsonschema.validate(json.loads(first["choices"][0]["text"]), SCHEMA)
    assert not any(r["billable"] for r in ledger(mesh, "cheater"))
    honest = [h["node_id"] for h in first["meshnet"]["route"]]
    assert honest == ["node-0", "spare"]
    pinned = {**BODY, "meshnet": {"route": honest}}  # the honest nodes alone (admin)
    url = f"{mesh.url}/v1/completions"
    again = httpx.post(url, json=pinned, headers=mesh.admin_headers, timeout=120)
    assert again.status_code == 200, again.text
    assert again.json()["meshnet"]["ids"] == first["meshnet"]["ids"]
