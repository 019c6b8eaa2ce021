"""Durable sessions on the bundled model: a conversation continues with the same reply
whether its KV stayed hot, came back from a snapshot, or was recomputed from its history."""

from __future__ import annotations

import pytest
from conftest import MeshFactory
from session_client import describe, lose_snapshots, new_session, op, turn
from solo import solo_chat_ids

from meshnet.engine.local import LocalModel
from meshnet.local_mesh import LocalMesh

pytestmark = pytest.mark.bundled

QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]
TURNS = ["What is the capital of France?", "And of Italy?"]


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory) -> LocalMesh:
    return mesh_factory("0:15,15:30", tracker_args=QUIET)


def test_a_conversation_continues_identically_on_every_resume_path(
    mesh: LocalMesh, bundled: LocalModel
) -> None:
    def two_turns(between: str) -> tuple[dict[str, object], dict[str, object]]:
        sid = new_session(mesh, system=None)
        first = turn(mesh, sid, TURNS[0], max_tokens=16, temperature=0.0)
        if between:
            op(mesh, sid, "evict")
        if between == "lose the snapshot":
            lose_snapshots(mesh, sid)
        second = turn(mesh, sid, TURNS[1], max_tokens=16, temperature=0.0)
        assert describe(mesh, sid)["turns"] == 2
        return first, second

    hot = two_turns("")
    # The first turn is what the model answers alone, in-process on the nodes' backend
    # (the default, q8: like llama.cpp it does not answer "Paris" here, the fp32 oracle does).
    ask = {"messages": [{"role": "user", "content": TURNS[0]}], "max_tokens": 16}
    assert hot[0]["ids"] == solo_chat_ids(bundled, {**ask, "temperature": 0.0})
    for between, path in (("evict", "snapshot"), ("lose the snapshot", "reprefill")):
        first, second = two_turns(between)
        assert second["resume_path"] == path
        assert (first["ids"], second["ids"]) == (hot[0]["ids"], hot[1]["ids"]), between
