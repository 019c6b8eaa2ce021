"""A node's resident memory is about the bytes of the layers it serves plus its KV.

A Q4_K_M-style file (Q4_K matrices, Q6_K values / down projections / head) is loaded
the way ``meshnet node`` loads its range, in a process of its own, and a prompt is
run through it; the growth of its resident set must stay within ~15% of the file
bytes of the tensors it serves plus the KV the prompt took.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT
from tinymodel import TinyConfig, write_tiny_gguf

from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf

pytest.importorskip("meshnet.backends._native")  # the numba fallback keeps raw copies

Q4_K_M = TinyConfig(
    n_layers=8,
    d_model=1024,
    d_ff=4096,
    n_heads=16,
    n_kv_heads=4,
    context_length=512,
    matrix_type=QT.Q4_K,
    embedding_type=QT.Q4_K,
    tied_head=False,
    role_types={"attn_v": QT.Q6_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K},
)
PROMPT = 200
SLACK = 12 << 20  # scratch of a forward, rotary tables, allocator rounding

PROBE = """
import json, sys
import numpy as np
from meshnet.backends.base import BatchEntry
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf
from meshnet.model.shard import load_shard, warm_up
from meshnet.model.spec import read_spec

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

path, layers, prompt = sys.argv[1], LayerRange.parse(sys.argv[2]), int(sys.argv[3])
f = open_gguf(path)
spec = read_spec(f)
before = rss()
shard = load_shard(f, spec, layers)
kv = shard.backend.new_kv()
if shard.is_first:
    x = np.arange(prompt) % spec.vocab_size
else:
    x = np.zeros((prompt, spec.d_model), np.float32)
shard.forward(x, [BatchEntry(kv, prompt)])
print(json.dumps({"growth": rss() - before, "kv": kv.nbytes}))
"""


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("q4km") / "q4km.gguf", Q4_K_M)


def _served_bytes(path: Path, layers: LayerRange, n_layers: int) -> int:
    """File bytes of the tensors a shard of ``layers`` reads."""
    f = open_gguf(path)
    total = 0
    for name, t in f.tensors.items():
        if name.startswith("blk."):
            serves = int(name.split(".")[1]) in range(layers.start, layers.end)
        else:
            serves = (name == "token_embd.weight" and layers.is_first()) or (
                name.startswith("output") and layers.is_last(n_layers)
            )
        total += int(t.n_bytes) if serves else 0
    return total


@pytest.mark.parametrize("layers", ["0:8", "2:6", "5:8"])
def test_resident_memory_is_the_served_bytes_plus_kv(q4_k_m: Path, layers: str) -> None:
    served = _served_bytes(q4_k_m, LayerRange.parse(layers), Q4_K_M.n_layers)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(q4_k_m), layers, str(PROMPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    bound = 1.15 * served + figures["kv"] + SLACK
    assert figures["growth"] <= bound, (figures, served)


# ~20 MB of header, as a 128k-token vocabulary and its merges take as strings
LARGE_HEADER = replace(Q4_K_M, n_layers=4, header_strings=600_000)
NODE_PROBE = """
import json, sys
from meshnet.layer_range import LayerRange
from meshnet.model.shard import load_shard_file

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

before = rss()
shard = load_shard_file(sys.argv[1], LayerRange.parse(sys.argv[2]))
print(json.dumps({"growth": rss() - before}))
"""


@pytest.fixture(scope="module")
def large_header(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("header") / "header.gguf", LARGE_HEADER)


def test_a_node_keeps_nothing_of_a_large_header(large_header: Path) -> None:
    """A node loads its range from a file whose header is ~20 MB (a 128k-token
    vocabulary and its merges are ~8 MB on disk, several times that as strings): the
    header's pages and parsed values are gone once the shard is loaded, so the growth
    from before the file was opened is the middle layers' bytes."""
    layers = "1:3"
    served = _served_bytes(large_header, LayerRange.parse(layers), LARGE_HEADER.n_layers)
    out = subprocess.run(
        [sys.executable, "-c", NODE_PROBE, str(large_header), layers],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    assert growth <= 1.15 * served + SLACK, (growth, served)
