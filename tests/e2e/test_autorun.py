"""A one-node route runs its decode steps ahead by itself (autorun): the same tokens as a
driven route, also sampled, penalised, with log-probabilities, stopped early, across
session turns (what it ran past a turn's end is cut back) and through a failover."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from faults import assert_billed_once, wait_ledger, wait_until_up
from session_client import new_session, turn
from streams import Streamed, serving, stream_completion

from meshnet.local_mesh import LocalMesh

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
BODIES: list[dict[str, Any]] = [
    {"max_tokens": 60, "temperature": 0},
    {"max_tokens": 60, "temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"max_tokens": 60, "temperature": 0.7, "repetition_penalty": 1.3, "seed": 8},
    {"max_tokens": 30, "temperature": 0.6, "seed": 9, "logprobs": 3},
    {"max_tokens": 5, "temperature": 0.6, "seed": 10},  # ends inside the first run ahead
]


@pytest.fixture(scope="module")
def long_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("long.gguf", context_length=1024))


@pytest.fixture(scope="module")
def meshes(mesh_factory: MeshFactory, long_tiny: Path) -> tuple[LocalMesh, LocalMesh]:
    """The same one-node mesh with and without autorun."""
    return (
        mesh_factory("0:4", model=long_tiny),
        mesh_factory("0:4", model=long_tiny, tracker_args=["--no-autorun"]),
    )


def _complete(mesh: LocalMesh, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(
        f"{mesh.url}/v1/completions",
        json={"model": "long", "prompt": PROMPT, **body},
        headers=mesh.api_headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_autorun_gives_the_tokens_a_driven_route_gives(
    meshes: tuple[LocalMesh, LocalMesh],
) -> None:
    auto, driven = meshes
    for body in BODIES:
        a, d = _complete(auto, body), _complete(driven, body)
        assert a["meshnet"]["ids"] == d["meshnet"]["ids"], body
        assert a["choices"][0]["logprobs"] == d["choices"][0]["logprobs"], body
        # Long enough to outrun the node's first horizon (8 steps), but for the short one.
        assert len(a["meshnet"]["ids"]) > 8 or body["max_tokens"] <= 8
        streamed = stream_completion(auto, {"model": "long", "prompt": PROMPT, **body})
        assert streamed.error is None and streamed.ids == d["meshnet"]["ids"], body


def test_session_turns_continue_exactly_after_a_run_ahead(
    meshes: tuple[LocalMesh, LocalMesh],
) -> None:
    """Each turn ends with the node several steps ahead of it; the next turn resumes the
    KV hot, cut back to the turn's end, and answers what the driven mesh answers."""
    answers = []
    for mesh in meshes:
        sid = new_session(mesh)
        turns = [turn(mesh, sid, content, max_tokens=20) for content in ("hi", "more", "end")]
        assert [t["resume_path"] for t in turns[1:]] == ["hot", "hot"]
        answers.append([t["ids"] for t in turns])
    assert answers[0] == answers[1]


def test_a_node_killed_mid_run_fails_over_with_identical_output(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    mesh = mesh_factory("0:4,0:4", model=long_tiny, heartbeat_timeout_s=8.0)
    body = {"model": "long", "prompt": PROMPT, "max_tokens": 200, "temperature": 0.7, "seed": 3}
    expected = _complete(mesh, body)["meshnet"]["ids"]
    for node_id in mesh.nodes:
        wait_until_up(mesh, node_id)
    killed: list[str] = []

    def kill(n: int, s: Streamed) -> None:
        if n == 40:
            killed.append(serving(s, (0, 4)))
            mesh.kill_node(killed[0])

    result = stream_completion(mesh, body, kill)
    assert result.error is None, result.error
    assert result.ids == expected
    assert result.final is not None
    (recovery,) = result.final["recoveries"]
    assert (recovery["failed_node"], recovery["kind"]) == (killed[0], "worker-death")
    records = wait_ledger(mesh, result.generation_id, hops=1)
    assert_billed_once(records, 4, len(PROMPT) + len(expected) - 1)
