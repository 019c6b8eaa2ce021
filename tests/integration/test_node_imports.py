"""What a node imports and loads leaves out the libraries it does not call.

A node that serves a local file never asks a model hub, and where the native kernels
are built it never runs a numba kernel: numba (~60 MB resident with its LLVM), the
hub's client (~7 MB) and the grammar engine (~2 MB, for a constrained sampling hop)
load only in a process that needs them; httpx's command line (click, rich, pygments:
~4 MB) in none (``meshnet/cli/__init__.py``). Nor does a node import pydantic or the
tracker's modules (~9 MB): it writes its reports as typed dicts (``mesh_reports``)
and the tracker parses them. In a process of its
own, everything ``meshnet node`` imports is imported and a shard of the tiny model is
loaded (and run) on each quantized backend, as a node loads its range.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("meshnet.backends._native")  # without it the numba kernels serve

PROBE = """
import json, sys
import numpy as np
import meshnet.cli.node  # everything `meshnet node` imports
from meshnet.backends.base import BatchEntry
from meshnet.backends.shard import load_shard_file
from meshnet.layer_range import LayerRange

for backend in ("fast", "q8"):
    shard = load_shard_file(sys.argv[1], LayerRange(0, 4), backend)
    kv = shard.backend.new_kv()
    shard.forward(np.arange(6), [BatchEntry(kv, 6)])
    shard.forward(np.arange(1), [BatchEntry(kv, 1)])
unused = ("numba", "llvmlite", "huggingface_hub", "httpx2", "llguidance")
unused += ("click", "rich", "pygments")  # httpx's command line
unused += ("pydantic", "pydantic_core")  # the tracker parses what a node writes
loaded = [m for m in unused if m in sys.modules]
loaded += [m for m in sys.modules if m.startswith("meshnet.tracker")]
print(json.dumps(loaded))
"""


def test_a_node_serving_a_local_file_loads_no_numba_hub_client_or_grammar_engine(
    tiny_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
