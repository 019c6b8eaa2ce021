"""Faults under a running session turn lose nothing (tiny model, real processes): a node
stalled past its heartbeat timeout, the database going away (PostgreSQL terminated
and stopped), the tracker's disk full (``ulimit -f`` on the tracker: EFBIG, no root).
The turn is delivered once, with the tokens of an undisturbed run and billed as one;
what the client hears meanwhile is its answer or a typed 503 with ``Retry-After``,
never a plain 500. Every test starts and stops only its own processes."""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import postgres_server
import pytest
from billing import assert_billed_once_like, ledger
from conftest import NO_ROOM, MeshFactory
from session_client import TURNS, describe, new_session, turn, turn_body, wait_kv_growing
from test_session_durability import LONG, QUIET

from meshnet.local_mesh import LocalMesh

STALL_S = 10.0  # past the heartbeat timeout (2 s), the probes (2 s each), 3 quick attempts


@pytest.fixture(scope="module")
def chat_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("chat.gguf", context_length=1024))


@dataclass
class RetryingClient:
    """Posts a turn with an ``Idempotency-Key`` in a thread, as a careful client does:
    a 503 is retried after its ``Retry-After``; every status it got is kept."""

    mesh: LocalMesh
    sid: str
    key: str
    statuses: list[tuple[int, str]] = field(default_factory=list)
    result: dict[str, Any] | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._post, daemon=True)
        thread.start()
        return thread

    def _post(self) -> None:
        try:
            self._until_answered()
        except Exception as e:  # kept for the test to report, not lost in the thread
            self.statuses.append((0, repr(e)))

    def _until_answered(self) -> None:
        headers = {**self.mesh.api_headers, "Idempotency-Key": self.key}
        body = turn_body(TURNS[1], max_tokens=LONG)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = httpx.post(
                f"{self.mesh.url}/v1/sessions/{self.sid}/turns",
                json=body,
                headers=headers,
                timeout=120,
            )
            error = r.json().get("error", {}) if r.status_code >= 400 else {}
            self.statuses.append((r.status_code, error.get("code", "")))
            if r.status_code != 503:
                self.result = r.json() if r.status_code == 200 else None
                return
            time.sleep(float(r.headers["Retry-After"]))


def start_reference(mesh: LocalMesh) -> tuple[str, dict[str, Any], str]:
    """A session whose second turn runs undisturbed; and a session one turn behind it."""
    ref = new_session(mesh)
    turn(mesh, ref, TURNS[0])
    want = turn(mesh, ref, TURNS[1], max_tokens=LONG)
    sid = new_session(mesh)
    turn(mesh, sid, TURNS[0])
    return ref, want, sid


def check_delivered_once(
    mesh: LocalMesh, client: RetryingClient, ref: str, want: dict[str, Any], sid: str
) -> dict[str, Any]:
    assert client.result is not None, client.statuses
    assert {status for status, _ in client.statuses} <= {200, 503}, client.statuses
    assert {code for status, code in client.statuses if status == 503} <= {
        "database-unavailable"
    }, client.statuses
    got = client.result
    assert got["ids"] == want["ids"]
    assert_billed_once_like(mesh, got["turn_id"], want["turn_id"])
    # A result the client got while the database was away is written when it is back.
    want_tokens = describe(mesh, ref)["tokens"]
    deadline = time.monotonic() + 15
    while (state := describe(mesh, sid))["tokens"] != want_tokens:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert state["turns"] == 2 and state["tokens"] == want_tokens, state
    assert turn(mesh, sid, TURNS[2])["ids"] == turn(mesh, ref, TURNS[2])["ids"]
    return got


def test_a_node_stalled_past_its_heartbeat_timeout_delays_a_turn_and_fails_nothing(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    """The only node of a span stops answering mid-turn and is marked down: there is no
    route until it is back. That is a wait, not a failure: the attempt's failover waits
    for the span to be served again (``--route-wait``) and replays it, or a later attempt
    finds the route; either way the turn is delivered once (with ``--turn-attempts 3`` an
    older outbox failed it), billed once, positions of earlier turns not billed again."""
    args = [*QUIET, "--turn-attempts", "3"]  # NO_ROOM: node-0 is not widened over 2:4
    mesh = mesh_factory("0:2,2:4", model=chat_tiny, tracker_args=args, node_args=NO_ROOM)
    ref, want, sid = start_reference(mesh)
    client = RetryingClient(mesh, sid, "stalled")
    thread = client.start()
    wait_kv_growing(mesh)
    node = mesh.nodes["node-1"]
    node.send_signal(signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        node.send_signal(signal.SIGCONT)
    thread.join(timeout=120)
    got = check_delivered_once(mesh, client, ref, want, sid)
    failed = [r for r in ledger(mesh, got["turn_id"]) if r["status"] == "failed"]
    assert failed and {r["node_id"] for r in failed} == {"node-1"}, failed


# --- the database going away ---------------------------------------------------------


@dataclass
class OwnPostgres:
    """A PostgreSQL server of this test's own, to stop and start again."""

    url: str
    data: Path
    run_as: list[str]

    def terminate_backends(self) -> int:
        """End every other connection to the tracker's database, as an admin would."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        return len(rows)

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "-w", "stop")

    def start(self) -> None:
        """Start again with the options it was first started with."""
        words = shlex.split((self.data / "postmaster.opts").read_text())
        options = shlex.join(words[words.index("-D") + 2 :] if "-D" in words else words[1:])
        self._pg_ctl("-o", options, "-l", str(self.data.parent / "log"), "-w", "start")

    def _pg_ctl(self, *args: str) -> None:
        pg_ctl = postgres_server.find_bin("pg_ctl")
        assert pg_ctl is not None
        subprocess.run(
            [*self.run_as, pg_ctl, "-D", str(self.data), *args],
            check=True,
            capture_output=True,
            timeout=60,
        )


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    if not postgres_server.available():
        pytest.skip("PostgreSQL is not installed here; .ci/run installs it")
    with postgres_server.postgres() as url:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            data = Path(str(conn.execute("SHOW data_directory").fetchone()[0]))  # type: ignore[index]
        # Under root the cluster belongs to the postgres user (see postgres_server).
        run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        pg = OwnPostgres(url, data, run_as)
        try:
            yield pg
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                pg.start()  # running again, for postgres_server to stop and remove


def test_the_database_going_away_mid_turn_loses_nothing(
    mesh_factory: MeshFactory, chat_tiny: Path, own_postgres: OwnPostgres
) -> None:
    """The tracker's PostgreSQL connection is terminated under a running turn, then the
    server is stopped for a few seconds and started again. Meanwhile new requests get
    a typed 503 with ``Retry-After``; the turn is delivered once, billed once."""
    mesh = mesh_factory(
        "0:2,2:4",
        model=chat_tiny,
        tracker_args=[*QUIET, "--turn-lease", "2", "--database", own_postgres.url],
    )
    ref, want, sid = start_reference(mesh)
    client = RetryingClient(mesh, sid, "db-gone")
    thread = client.start()
    wait_kv_growing(mesh)
    assert own_postgres.terminate_backends() >= 1
    own_postgres.stop()
    try:
        refused = httpx.post(
            f"{mesh.url}/v1/sessions", json={}, headers=mesh.api_headers, timeout=30
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "database-unavailable"
        assert int(refused.headers["Retry-After"]) >= 1
        time.sleep(3)
    finally:
        own_postgres.start()
    thread.join(timeout=120)
    check_delivered_once(mesh, client, ref, want, sid)


# --- a full disk ---------------------------------------------------------------------


def limit_file_size(pid: int, nbytes: int | None) -> None:
    """``ulimit -f`` on a running process (its soft limit; None lifts it): writes past
    ``nbytes`` fail with EFBIG. Needs no privilege, unlike a small filesystem."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard if nbytes is None else nbytes, hard))


def test_a_full_disk_loses_no_accepted_turn_and_answers_503_never_500(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    """The tracker's disk fills (every write past a byte fails) under a running turn:
    writes — a new session, an eviction's snapshot, the turn's own records — get a
    typed 503 with ``Retry-After``, reads still answer, and once there is room again
    the accepted turn is delivered once and the session evicts and resumes."""
    mesh = mesh_factory("0:2,2:4", model=chat_tiny, tracker_args=[*QUIET, "--turn-lease", "2"])
    ref, want, sid = start_reference(mesh)
    client = RetryingClient(mesh, sid, "disk-full")
    thread = client.start()
    wait_kv_growing(mesh)
    assert mesh.tracker is not None
    limit_file_size(mesh.tracker.pid, 1)
    try:
        for path in ("/v1/sessions", f"/v1/sessions/{ref}/evict"):
            r = httpx.post(f"{mesh.url}{path}", json={}, headers=mesh.api_headers, timeout=60)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["code"] == "database-unavailable"
            assert int(r.headers["Retry-After"]) >= 1
        assert describe(mesh, ref)["state"] == "idle"  # reads answer; the eviction changed nothing
        time.sleep(2)
    finally:
        limit_file_size(mesh.tracker.pid, None)
    thread.join(timeout=120)
    check_delivered_once(mesh, client, ref, want, sid)
    r = httpx.post(f"{mesh.url}/v1/sessions/{ref}/evict", headers=mesh.api_headers, timeout=60)
    assert r.status_code == 200, r.text
    assert turn(mesh, ref, TURNS[3])["resume_path"] == "snapshot"
