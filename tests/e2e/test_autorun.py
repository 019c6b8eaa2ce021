"""A route's hops run their decode steps ahead by themselves (autorun): one node feeds
itself each token, the hops of a longer route pass it round a ring. The same tokens
as a driven route, also sampled, penalised, with log-probabilities, stopped early,
across session turns (what ran past a turn's end is cut back) and through failovers
of any hop, killed or frozen."""

from __future__ import annotations

import signal
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


@pytest.fixture(scope="module", params=["0:4", "0:1,1:3,3:4"], ids=["one-node", "ring"])
def meshes(
    request: pytest.FixtureRequest, mesh_factory: MeshFactory, long_tiny: Path
) -> tuple[LocalMesh, LocalMesh]:
    """The same mesh with and without autorun (one node, or a ring of three)."""
    return (
        mesh_factory(request.param, model=long_tiny),
        mesh_factory(request.param, model=long_tiny, tracker_args=["--no-autorun"]),
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


@pytest.mark.parametrize(
    ("nodes", "span"),
    [("0:4,0:4", (0, 4)), ("0:2,0:2,2:4,2:4", (0, 2)), ("0:2,0:2,2:4,2:4", (2, 4))],
    ids=["one-node", "ring-first-hop", "ring-last-hop"],
)
def test_a_node_killed_mid_run_fails_over_with_identical_output(
    mesh_factory: MeshFactory, long_tiny: Path, nodes: str, span: tuple[int, int]
) -> None:
    mesh = mesh_factory(nodes, model=long_tiny, heartbeat_timeout_s=8.0)
    body = {"model": "long", "prompt": PROMPT, "max_tokens": 200, "temperature": 0.7, "seed": 3}
    expected = _complete(mesh, body)["meshnet"]["ids"]
    for node_id in mesh.nodes:
        wait_until_up(mesh, node_id)
    killed: list[str] = []

    def kill(n: int, s: Streamed) -> None:
        if n == 40:
            killed.append(serving(s, span))
            mesh.kill_node(killed[0])

    result = stream_completion(mesh, body, kill)
    assert result.error is None, result.error
    assert result.ids == expected
    assert result.final is not None
    (recovery,) = result.final["recoveries"]
    assert (recovery["failed_node"], recovery["kind"]) == (killed[0], "worker-death")
    hops = len(result.final["route"])
    records = wait_ledger(mesh, result.generation_id, hops=hops)
    assert_billed_once(records, 4, len(PROMPT) + len(expected) - 1)


def test_a_frozen_first_hop_of_a_ring_is_the_one_failed(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    """A frozen hop holds up every hop after it: the ring's last hop sends nothing, but
    the hop blamed (and replaced) is the frozen one, found by a probe."""
    mesh = mesh_factory(
        "0:2,0:2,2:4",
        model=long_tiny,
        tracker_args=["--step-timeout", "1.0"],
        heartbeat_timeout_s=30.0,
    )
    body = {"model": "long", "prompt": PROMPT, "max_tokens": 120, "temperature": 0.7, "seed": 4}
    expected = _complete(mesh, body)["meshnet"]["ids"]
    frozen: list[str] = []

    def freeze(n: int, s: Streamed) -> None:
        if n == 30:
            frozen.append(serving(s, (0, 2)))
            mesh.kill_node(frozen[0], signal.SIGSTOP)

    try:
        result = stream_completion(mesh, body, freeze)
    finally:
        if frozen:
            mesh.kill_node(frozen[0], signal.SIGCONT)
    assert result.error is None, result.error
    assert result.ids == expected
    assert result.final is not None
    (recovery,) = result.final["recoveries"]
    assert (recovery["failed_node"], recovery["kind"]) == (frozen[0], "deadline-exceeded")
    assert frozen[0] not in [hop["node_id"] for hop in result.final["route"]]
