"""A loaded shard holds its tensors' bytes once: none of the file's pages stay mapped in.

Every tensor a shard keeps is read off the file into memory of its own (the kernels'
layout, or a float32 array for a norm). A tensor read through the file's memory map
instead would fault in its page and, the kernel mapping ~64 KB around each fault,
the cached bytes of neighbouring tensors: counted again in the node's resident set
beside their copies (~1.6 MB in a node of a mixture of experts, one fault per norm).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodel import write_tiny_gguf

from meshnet.backends.shard import load_shard_file
from meshnet.layer_range import LayerRange


def _resident_kb(path: Path) -> int:
    """KB of ``path``'s pages resident in this process's mappings of it."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("backend", ["fast", "q8", "numpy"])
def test_a_loaded_shard_keeps_no_page_of_its_file_mapped_in(tmp_path: Path, backend: str) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    path.read_bytes()  # the file's pages in the page cache, as a model just fetched or read
    shard = load_shard_file(str(path), LayerRange(1, 3), backend)
    assert shard.layers == LayerRange(1, 3)
    assert _resident_kb(path) == 0
