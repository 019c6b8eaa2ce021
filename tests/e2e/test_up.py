"""``meshnet up`` starts a whole mesh, passes the node and tracker options it was given
to its children, and leaves no process behind after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from meshnet.auth.credentials import CREDENTIALS_FILE, read_user_credentials
from meshnet.local_mesh import free_port


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), [pid]
    while frontier:
        p = frontier.pop()
        kids = {c for c, parent in parents.items() if parent == p}
        frontier.extend(kids - found)
        found |= kids
    return found


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def _after(argv: list[str], flag: str) -> str:
    """The value of the last ``flag`` in ``argv``: the one argparse keeps."""
    return argv[len(argv) - argv[::-1].index(flag)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_serves_then_stops_every_process_on_sigterm(tiny_path: Path, tmp_path: Path) -> None:
    port = free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshnet.cli.main",
            "up",
            "--layout",
            "0:2,2:4",
            "--port",
            str(port),
            "--model",
            str(tiny_path),
            "--data-dir",
            str(tmp_path),
            "--threads",
            "1",
            "--max-queued-steps",
            "100",
            "--max-in-flight",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    try:
        assert up.stdout is not None
        line = ""
        deadline = time.monotonic() + 120
        while "meshnet API at" not in line and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line or up.poll() is None, "meshnet up exited early"
        assert f"http://127.0.0.1:{port}/v1" in line
        children = _children(up.pid)
        assert len(children) == 3  # tracker + 2 nodes
        argvs = {pid: _argv(pid) for pid in children}
        nodes = [pid for pid, argv in argvs.items() if "node" in argv]
        (tracker,) = [pid for pid, argv in argvs.items() if "tracker" in argv]
        assert len(nodes) == 2
        for pid in nodes:
            assert _after(argvs[pid], "--max-queued-steps") == "100"
            assert _after(argvs[pid], "--threads") == "1"
            assert _environ(pid)["NUMBA_NUM_THREADS"] == "1"
        assert _after(argvs[tracker], "--max-in-flight") == "16"
        key = read_user_credentials(tmp_path / CREDENTIALS_FILE).api_key  # what `up` made
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
            json={"model": "tiny", "prompt": "the", "max_tokens": 3},
        )
        assert r.status_code == 200
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) is not None
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stdout is not None:
            up.stdout.close()
