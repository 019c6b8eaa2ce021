"""Sessions outlive their tracker: pending turns survive a kill -9, and two trackers on one
PostgreSQL serve one session alternately (tiny model, real processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from billing import assert_billed_once_like
from conftest import MeshFactory
from session_client import (
    TURNS,
    TrackerApi,
    describe,
    new_session,
    op,
    reference_turns,
    turn,
    turn_body,
)

from meshnet.local_mesh import LocalMesh, free_port

QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]
LONG = 600  # tokens: a turn long enough to be cut by a kill (seconds on any machine)
TOKENS_BEFORE_KILL = 10  # streamed tokens that show the turn is running


@pytest.fixture(scope="module")
def chat_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("chat.gguf", context_length=1024))


def test_a_tracker_killed_with_a_pending_turn_delivers_it_once_after_restart(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    mesh = mesh_factory("0:2,2:4", model=chat_tiny, tracker_args=[*QUIET, "--turn-lease", "2"])
    ref = new_session(mesh)
    want = [turn(mesh, ref, TURNS[0])["ids"], turn(mesh, ref, TURNS[1], max_tokens=LONG)]
    sid = new_session(mesh)
    assert turn(mesh, sid, TURNS[0])["ids"] == want[0]

    cut: list[BaseException] = []
    running = threading.Event()

    def post() -> None:
        """The turn, streamed: its tokens say it is running (a node's heartbeat lags
        it, and on a fast machine the turn was over before the kill came)."""
        body = turn_body(TURNS[1], max_tokens=LONG, stream=True)
        headers = {**mesh.api_headers, "Idempotency-Key": "turn-2"}
        url = f"{mesh.url}/v1/sessions/{sid}/turns"
        seen = 0
        try:
            with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and '"type": "token"' in line:
                        seen += 1
                        if seen == TOKENS_BEFORE_KILL:
                            running.set()
        except BaseException as e:  # the tracker dies under this request
            cut.append(e)
        finally:
            running.set()

    client = threading.Thread(target=post)
    client.start()
    assert running.wait(timeout=60), "the turn never started"
    assert mesh.tracker is not None
    mesh.tracker.send_signal(signal.SIGKILL)
    mesh.tracker.wait(timeout=10)
    client.join(timeout=30)
    assert cut, "the request should have been cut off by the kill"

    mesh.start_tracker()
    mesh.wait_ready(expected_nodes=2, timeout_s=60)
    # The client retries with its key: the same turn, delivered once, after the lease lapsed.
    again = turn(mesh, sid, TURNS[1], key="turn-2", max_tokens=LONG)
    reference = want[1]
    assert again["ids"] == reference["ids"]
    # The attempt the kill cut off, and after the restart one attempt at a time until one
    # completes: usually one, more when one fails for a reason the mesh gets over (a node
    # stalled past its heartbeat timeout on a loaded machine is marked down for a moment:
    # test_turn_faults.py). Exactly one completed, billed as an uninterrupted turn.
    assert again["attempts"] >= 2
    assert_billed_once_like(mesh, again["turn_id"], reference["turn_id"])
    state = describe(mesh, sid)
    assert state["turns"] == 2
    assert state["tokens"] == describe(mesh, ref)["tokens"]  # the turn's tokens once
    assert turn(mesh, sid, TURNS[2])["ids"] == turn(mesh, ref, TURNS[2])["ids"]


def test_two_trackers_on_one_postgresql_serve_one_session_alternately(
    mesh_factory: MeshFactory, chat_tiny: Path, fresh_postgres: str
) -> None:
    mesh = mesh_factory(
        "0:2,2:4", model=chat_tiny, tracker_args=[*QUIET, "--database", fresh_postgres]
    )
    want = reference_turns(mesh)
    with _second_tracker(mesh, fresh_postgres) as other:
        sid = new_session(other)
        paths = []
        for i, content in enumerate(TURNS):
            api = mesh if i % 2 == 0 else other
            result = turn(api, sid, content)
            assert result["ids"] == want[i], f"turn {i} via {api.url}"
            paths.append(result["resume_path"])
            if i == 1:
                op(mesh, sid, "evict")  # evicted by one tracker, resumed by the other
        assert paths == ["hot", "hot", "snapshot", "hot"]
        assert describe(other, sid)["turns"] == describe(mesh, sid)["turns"] == 4


@contextlib.contextmanager
def _second_tracker(mesh: LocalMesh, database: str) -> Iterator[TrackerApi]:
    """Another tracker process on the same database and snapshot directory."""
    port = free_port()
    assert mesh.model is not None
    cmd = [sys.executable, "-m", "meshnet.cli.main", "tracker", "--port", str(port)]
    cmd += ["--data-dir", str(mesh.data_dir), "--database", database, "--model", mesh.model]
    cmd += QUIET
    log = (mesh.data_dir / "logs" / "tracker-2.log").open("ab")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).json()["route_complete"]:
                    break
            assert proc.poll() is None, "the second tracker exited"
            time.sleep(0.2)
        yield TrackerApi(url, mesh.api_headers)  # the same data dir: the same credentials
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()
