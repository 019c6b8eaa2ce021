"""A throwaway PostgreSQL server for tests: its own cluster in a temp dir, on a free port.

PostgreSQL refuses to run as root, so under root the cluster belongs to the
``postgres`` system user (created by the server package) and its tools run as it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from meshnet.local_mesh import free_port


def find_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def available() -> bool:
    return find_bin("initdb") is not None and find_bin("pg_ctl") is not None


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """Start a server; yields its URL; stops it and removes its files at the end."""
    initdb, pg_ctl = find_bin("initdb"), find_bin("pg_ctl")
    assert initdb and pg_ctl, "PostgreSQL is not installed (.ci/run installs it)"
    root = Path(tempfile.mkdtemp(prefix="meshnet-pg-"))
    data = root / "data"
    run_as: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run(
        [*run_as, initdb, "-D", str(data), "-U", "meshnet", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        [*run_as, pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://meshnet@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*run_as, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)
