"""Where a node parks sessions when no directory is configured: a temporary one, gone
with the node (before, every such node left an empty directory in /tmp)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from meshnet.node.parking import ParkStore


def test_a_configured_directory_is_kept(tmp_path: Path) -> None:
    store = ParkStore(str(tmp_path / "parked"))
    parked = store.write("s", 1, 2, 3, memoryview(b"kv bytes"))
    del store
    gc.collect()
    assert parked.path.read_bytes() == b"kv bytes"


def test_a_temporary_directory_goes_with_its_store() -> None:
    store = ParkStore(None)
    parked = store.write("s", 1, 2, 3, memoryview(b"kv bytes"))
    assert ParkStore.read(parked) == b"kv bytes"
    directory = store.directory
    del store
    gc.collect()
    assert not directory.exists()


def test_a_temporary_directory_goes_when_the_process_exits() -> None:
    code = (
        "from meshnet.node.parking import ParkStore\n"
        "store = ParkStore(None)\n"
        "print(store.write('s', 1, 2, 3, memoryview(b'kv')).path.parent)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    directory = Path(out.stdout.strip())
    assert directory.name.startswith("meshnet-parked-")
    assert not directory.exists()
