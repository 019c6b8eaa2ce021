"""Two tracker processes on one PostgreSQL share one truth (tiny model, real processes): a
session evicted through one resumes from its snapshot through the other, which has its
own data dir (the snapshot is in the database, not on a disk); only the tracker holding
the placement lease loads a gap, and when it dies the other takes the lease over once it
expires and loads the next gap."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from session_client import TURNS, describe, new_session, op, reference_turns, turn

from meshnet.auth.credentials import CREDENTIALS_FILE
from meshnet.local_mesh import LocalMesh, free_port, parse_layout

QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]
LEASE = ["--placement-lease", "3"]  # taken over about 3 s after its holder dies


@dataclass(frozen=True)
class Other:
    """The second tracker's API, called with the mesh's API key and admin token."""

    url: str
    api_headers: dict[str, str]
    admin_headers: dict[str, str]


@pytest.fixture(scope="module")
def chat_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("chat.gguf", context_length=1024))


def test_two_trackers_share_snapshots_and_one_places_at_a_time(
    chat_tiny: Path, fresh_postgres: str, tmp_path: Path
) -> None:
    flags = [*QUIET, *LEASE, "--database", fresh_postgres]
    mesh = LocalMesh(data_dir=tmp_path / "a", model=str(chat_tiny), tracker_args=flags)
    # B starts first, so it takes the lease; A, the tracker the nodes report to, follows.
    with _tracker(mesh, tmp_path / "b", flags) as (b, b_proc):
        _wait(lambda: _lease(b)["leader"], "B never took the lease")
        try:
            mesh.start(parse_layout("0:2,2:4,empty,empty"))
            _resume_through_the_other(mesh, b, tmp_path / "b")
            _only_the_leader_loads_a_gap(mesh, b)
            b_proc.send_signal(signal.SIGKILL)  # no hand-back: the lease must expire
            b_proc.wait(timeout=10)
            _the_other_takes_over_and_loads_the_next(mesh)
        finally:
            mesh.stop()


def _resume_through_the_other(mesh: LocalMesh, b: Other, b_dir: Path) -> None:
    want = reference_turns(mesh)
    sid = new_session(mesh)
    assert turn(mesh, sid, TURNS[0])["ids"] == want[0]
    evicted = op(b, sid, "evict")  # B writes the snapshot...
    assert evicted["state"] == "evicted" and len(evicted["snapshot"]["files"]) == 2
    assert not list(b_dir.rglob("*.snap"))  # ...into the database, not onto its disk
    resumed = turn(mesh, sid, TURNS[1])  # ...and A, with no such file, resumes from it
    assert (resumed["resume_path"], resumed["ids"]) == ("snapshot", want[1])
    again = turn(b, sid, TURNS[2])
    assert (again["resume_path"], again["ids"]) == ("hot", want[2])
    assert describe(b, sid)["turns"] == describe(mesh, sid)["turns"] == 3


def _only_the_leader_loads_a_gap(mesh: LocalMesh, b: Other) -> None:
    assert _lease(b)["leader"] and not _lease(mesh)["leader"]
    mesh.kill_node("node-1")  # layers 2:4 lose their only node
    _wait(lambda: _down(mesh, "node-1"), "node-1 was never marked down")
    _wait(lambda: _serving(mesh, [2, 4]) == 1, "the gap was never loaded")
    # The follower keeps running passes, and none of them loads anything.
    passes = _placement(mesh)["passes"]
    _wait(lambda: _placement(mesh)["passes"] >= passes + 3, "A's placement stopped")
    a, led = _placement(mesh), _placement(b)
    assert (a["leading"], a["loads"], a["load_failures"]) == (False, 0, 0)
    assert (led["leading"], led["loads"]) == (True, 1)
    assert _serving(mesh, [2, 4]) == 1 and _serving(mesh, None) == 1  # one spare left


def _the_other_takes_over_and_loads_the_next(mesh: LocalMesh) -> None:
    _wait(lambda: _lease(mesh)["leader"], "A never took the lease over")
    assert _lease(mesh)["terms"] == 1
    mesh.kill_node("node-0")  # layers 0:2 lose their only node
    _wait(lambda: _down(mesh, "node-0"), "node-0 was never marked down")
    _wait(lambda: _serving(mesh, [0, 2]) == 1, "the second gap was never loaded")
    assert _placement(mesh)["loads"] == 1
    _wait(lambda: httpx.get(f"{mesh.url}/healthz", timeout=5).json()["route_complete"], "route")


def _loops(api: Any) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{api.url}/admin/loops", headers=api.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return {loop["name"]: loop for loop in r.json()["loops"]}


def _lease(api: Any) -> dict[str, Any]:
    return _loops(api)["placement lease"]


def _placement(api: Any) -> dict[str, Any]:
    return _loops(api)["placement"]


def _serving(mesh: LocalMesh, layers: list[int] | None) -> int:
    """How many up nodes serve ``layers`` (None: how many up nodes are empty)."""
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=10)
    nodes = r.json()["nodes"]
    return sum(1 for n in nodes if n["state"] == "up" and n["layers"] == layers)


def _down(mesh: LocalMesh, node_id: str) -> bool:
    """Whether ``node_id`` is no longer up. Not "no up node serves its layers": the
    leader may load the gap onto the spare between two polls, and that count never
    reads 0."""
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=10)
    states = {n["node_id"]: n["state"] for n in r.json()["nodes"]}
    return states.get(node_id, "gone") != "up"


def _wait(ok: Callable[[], Any], what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@contextlib.contextmanager
def _tracker(
    mesh: LocalMesh, data_dir: Path, flags: list[str]
) -> Iterator[tuple[Other, subprocess.Popen[bytes]]]:
    """Another tracker process of the mesh with its own data dir: the mesh's secret and
    credentials (an operator's shared configuration), nothing else of its files."""
    data_dir.mkdir(parents=True)
    shutil.copy(mesh.data_dir / CREDENTIALS_FILE, data_dir / CREDENTIALS_FILE)
    port = free_port()
    assert mesh.model is not None
    cmd = [sys.executable, "-m", "meshnet.cli.main", "tracker", "--port", str(port)]
    cmd += ["--data-dir", str(data_dir), "--model", mesh.model, *flags]
    cmd += ["--mesh-secret-file", str(mesh.data_dir / "mesh.secret")]
    log = (mesh.data_dir / "logs" / "tracker-b.log").open("ab")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    other = Other(f"http://127.0.0.1:{port}", mesh.api_headers, mesh.admin_headers)
    try:
        _wait(lambda: _answers(other, proc), "the second tracker never answered", 60)
        yield other, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        log.close()


def _answers(api: Other, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, "the second tracker exited"
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{api.url}/healthz", timeout=2).status_code == 200
    return False
