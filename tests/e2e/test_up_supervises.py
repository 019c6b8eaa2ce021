"""`meshnet up` supervises its mesh: a node (or the tracker) killed with SIGKILL is started
again while the rest keeps serving, the mesh answers again, and SIGTERM to `up` still
stops every process it ever started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_up import _alive, _argv, _children

from meshnet.auth.credentials import CREDENTIALS_FILE, read_user_credentials
from meshnet.local_mesh import free_port


def _wait(what: str, ok: Callable[[], Any], timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := ok():
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Up:
    """A `meshnet up` process on the tiny model and what it says."""

    def __init__(self, tiny_path: Path, data_dir: Path) -> None:
        self.port = free_port()
        self.log = data_dir / "up.out"
        self.data_dir = data_dir
        argv = ["up", "--layout", "0:2,2:4", "--port", str(self.port), "--model", str(tiny_path)]
        argv += ["--data-dir", str(data_dir), "--threads", "1", "--restart-max", "2"]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "meshnet.cli.main", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def said(self, text: str) -> bool:
        return text in self.log.read_text()

    def pid_of(self, name: str) -> int | None:
        """The live child running ``name`` (a node id, or "tracker")."""
        for pid in _children(self.proc.pid):
            argv = _argv(pid) if _alive(pid) else []
            if (name == "tracker" and "tracker" in argv) or name in argv:
                return pid
        return None

    def answers(self) -> bool:
        key = read_user_credentials(self.data_dir / CREDENTIALS_FILE).api_key
        try:
            r = httpx.post(
                f"{self.url}/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "prompt": "the", "max_tokens": 3},
                timeout=30,
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def node(self, node_id: str) -> dict[str, Any]:
        admin = read_user_credentials(self.data_dir / CREDENTIALS_FILE).admin_token
        try:
            r = httpx.get(
                f"{self.url}/admin/nodes", headers={"Authorization": f"Bearer {admin}"}, timeout=5
            )
            nodes = {n["node_id"]: n for n in r.json()["nodes"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}
        return dict(nodes.get(node_id, {}))


@pytest.fixture
def up(tiny_path: Path, tmp_path: Path) -> Iterator[Up]:
    mesh = Up(tiny_path, tmp_path)
    try:
        _wait("the mesh to serve", lambda: mesh.said("meshnet API at"), 120)
        yield mesh
    finally:
        if mesh.proc.poll() is None:
            mesh.proc.kill()
            mesh.proc.wait()


def _kill_and_wait_for_restart(up: Up, name: str) -> int:
    """SIGKILL ``name``'s process; the pid of the one `up` starts in its place."""
    old = up.pid_of(name)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    return int(_wait(f"{name} to start again", lambda: (p := up.pid_of(name)) != old and p))


def test_a_killed_node_is_restarted_and_the_mesh_answers_again(up: Up) -> None:
    assert up.answers()
    everyone = set(_children(up.proc.pid))
    tracker, node_0 = up.pid_of("tracker"), up.pid_of("node-0")
    new = _kill_and_wait_for_restart(up, "node-1")
    assert up.pid_of("tracker") == tracker and up.pid_of("node-0") == node_0  # kept serving
    assert up.said("node-1 killed by SIGKILL; starting it again")
    _wait("node-1 to register again", lambda: up.node("node-1").get("pid") == new)
    _wait("an answer through the restarted node", up.answers)
    assert up.proc.poll() is None

    # The tracker too: the nodes register with the new one, and the mesh answers again.
    new_tracker = _kill_and_wait_for_restart(up, "tracker")
    assert up.said("tracker killed by SIGKILL; starting it again")
    _wait("an answer through the restarted tracker", up.answers)
    everyone |= set(_children(up.proc.pid))
    assert {new, new_tracker} <= everyone

    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=30) is not None
    _wait("every process to end", lambda: not [p for p in everyone if _alive(p)], 15)
