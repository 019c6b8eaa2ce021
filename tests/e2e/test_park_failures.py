"""A park that a node cannot make (real processes, tiny model): its disk full, or its park
directory unusable. The API says what each node did, the session stays hot (the next turn
resumes ``hot`` with the same tokens), nothing half-written is left on any disk, no node
counts the KV as freed, and the policy tries again after a backoff until it can."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from faults import info
from session_client import TURNS, describe, new_session, reference_turns, turn

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh

QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]
POLICY = ["--park-after", "0.5", "--evict-after", "0", "--policy-interval", "0.2"]
TMPFS_BYTES = 66 << 20  # over the 64 MiB a node's preflight wants free for parking
LEFT_FREE = 8 << 10  # what the full disk keeps: less than the session's KV on the node


def _private_tmpfs(directory: Path) -> list[str]:
    """A command prefix that runs a process in its own mount namespace with a small
    tmpfs at ``directory``: a disk only it sees, which the test then fills."""
    script = f'mount -t tmpfs -o size={TMPFS_BYTES} tmpfs "$0" && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", script, str(directory)]


@pytest.fixture(scope="module")
def tmpfs_works(tmp_path_factory: pytest.TempPathFactory) -> None:
    directory = tmp_path_factory.mktemp("probe")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run([*_private_tmpfs(directory), "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no private tmpfs here: {probe.stderr.decode().strip()}")


@pytest.fixture(scope="module")
def chat_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("chat.gguf", context_length=1024))


@pytest.fixture(scope="module")
def full_mesh(
    tmpfs_works: None, mesh_factory: MeshFactory, chat_tiny: Path, tmp_path_factory: Any
) -> Iterator[tuple[LocalMesh, Path, Path]]:
    """node-0 [0,2) parks on an ordinary disk; node-1 [2,4) on its own tmpfs, filled up to
    ``LEFT_FREE`` once it started. Yields the mesh and the two park directories (node-1's
    as this process sees it, through the node's root)."""
    roomy, tight = tmp_path_factory.mktemp("park0"), tmp_path_factory.mktemp("park1")
    mesh = mesh_factory(
        "0:2",
        model=chat_tiny,
        need_route=False,
        tracker_args=QUIET,
        node_args=["--park-dir", str(roomy)],
    )
    proc = mesh.start_node(
        "node-1", LayerRange(2, 4), prefix=_private_tmpfs(tight), extra=["--park-dir", str(tight)]
    )
    mesh.wait_ready(expected_nodes=2, timeout_s=120)
    seen = Path(f"/proc/{proc.pid}/root") / str(tight).lstrip("/")
    _fill(seen / "filler", LEFT_FREE)
    yield mesh, roomy, seen


def _fill(path: Path, keep_free: int) -> None:
    """Write until the disk is full, then give back ``keep_free`` bytes."""
    with path.open("wb") as f:
        chunk = bytes(1 << 20)
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    with path.open("r+b") as f:
        f.truncate(max(0, path.stat().st_size - keep_free))


def _park(mesh: LocalMesh, sid: str) -> httpx.Response:
    return httpx.post(f"{mesh.url}/v1/sessions/{sid}/park", headers=mesh.api_headers, timeout=60)


def test_a_full_disk_fails_the_park_and_the_session_stays_hot(
    full_mesh: tuple[LocalMesh, Path, Path],
) -> None:
    mesh, roomy, tight = full_mesh
    reference = reference_turns(mesh, TURNS[:2])
    sid = new_session(mesh)
    assert turn(mesh, sid, TURNS[0])["ids"] == reference[0]
    held = {n: info(mesh, n).kv_bytes for n in ("node-0", "node-1")}

    r = _park(mesh, sid)
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"]
    error = r.json()["error"]
    assert error["code"] == "park-failed"
    hops = {h["node_id"]: h for h in error["hops"]}
    assert hops["node-1"]["parked"] is False
    assert hops["node-1"]["failure"]["kind"] == "park-failed"
    assert "No space left" in hops["node-1"]["failure"]["message"]
    # node-0 had written it: dropped again, nothing freed anywhere.
    assert hops["node-0"]["parked"] is False and "failure" not in hops["node-0"]
    assert all(h["freed_bytes"] == 0 for h in hops.values())

    assert describe(mesh, sid)["state"] == "idle"
    for node in ("node-0", "node-1"):
        now = info(mesh, node)
        assert (now.parked, now.kv_bytes) == (0, held[node]), node
    assert sorted(p.name for p in tight.iterdir()) == ["filler"]  # no .tmp left
    assert list(roomy.iterdir()) == []  # the undone park's file is gone too

    second = turn(mesh, sid, TURNS[1])
    assert (second["resume_path"], second["ids"]) == ("hot", reference[1])


def test_a_park_that_every_node_makes_reports_what_it_freed(
    full_mesh: tuple[LocalMesh, Path, Path],
) -> None:
    mesh, _, tight = full_mesh
    (tight / "filler").unlink()  # room again
    sid = new_session(mesh)
    turn(mesh, sid, TURNS[0])
    held = {n: info(mesh, n).kv_bytes for n in ("node-0", "node-1")}
    r = _park(mesh, sid)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["state"] == "parked"
    freed = {h["node_id"]: h["freed_bytes"] for h in body["park"]["hops"]}
    for node in ("node-0", "node-1"):
        assert freed[node] > 0
        assert info(mesh, node).kv_bytes == held[node] - freed[node]
    assert body["park"]["freed_bytes"] == sum(freed.values())
    assert [p.suffix for p in tight.iterdir()] == [".kv"]


def test_the_policy_retries_a_failed_park_after_a_backoff(
    mesh_factory: MeshFactory, chat_tiny: Path, tmp_path: Path
) -> None:
    """node-1's park directory is a file once it started (a disk unmounted, a wrong
    path): the policy's parks fail, each waits longer, and the first after the file is
    gone parks the session on both nodes."""
    mesh = mesh_factory("0:2", model=chat_tiny, need_route=False, tracker_args=POLICY)
    blocked = tmp_path / "park"
    mesh.start_node("node-1", LayerRange(2, 4), extra=["--park-dir", str(blocked)])
    mesh.wait_ready(expected_nodes=2, timeout_s=120)
    blocked.write_bytes(b"not a directory")
    sid = new_session(mesh)
    turn(mesh, sid, TURNS[0])

    _wait(lambda: (describe(mesh, sid)["park_retry"] or {}).get("failures", 0) >= 2)
    now = describe(mesh, sid)
    assert now["state"] == "idle" and "park-failed" in now["park_retry"]["last_failure"]
    assert info(mesh, "node-0").parked == 0  # undone each time

    os.unlink(blocked)
    _wait(lambda: describe(mesh, sid)["state"] == "parked", timeout_s=60)
    assert describe(mesh, sid)["park_retry"] is None
    assert (info(mesh, "node-0").parked, info(mesh, "node-1").parked) == (1, 1)
    assert [p.suffix for p in blocked.iterdir()] == [".kv"]


def _wait(check: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError("not reached in time")
