"""A long sequence's keys and values lie on 2 MB pages: a step deep in a context reads
every position once, and 4 KB pages cost a TLB miss every 4 KB of it. numpy advises
Linux so for its arrays from 4 MB; a cache that took its arrays from elsewhere (a
mapping of its own, a pool) would lose it unless it asked too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshnet.kv.pages import KVPage
from meshnet.memory import HUGE_PAGE

HEADS, HEAD_DIM = 8, 64
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised(a: np.ndarray) -> tuple[int, int]:
    """Bytes of ``a`` in mappings (/proc/self/smaps) advised for 2 MB pages (flag ``hg``:
    advice splits a mapping where it starts and ends, and a mapping merges only with one
    of the same flags), and the kB those mappings hold on 2 MB pages."""
    low, high = a.ctypes.data, a.ctypes.data + a.nbytes
    advised = huge = 0
    overlap, pages = 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: its range
            start, stop = (int(x, 16) for x in head.split("-"))
            overlap = max(0, min(stop, high) - max(start, low))
        elif overlap and head == "AnonHugePages:":
            pages = int(line.split()[1])
        elif overlap and head == "VmFlags:" and "hg" in line.split()[1:]:
            advised, huge = advised + overlap, huge + pages
    return advised, huge


# A node's cache, grown as a prompt's chunks arrive, in a process of its own: per array,
# the bytes advised, the kB on 2 MB pages, and the positions' bytes
_GROWN = """
from meshnet.benchmark.engine import prefilled_kv
from test_kv_huge_pages import HEAD_DIM, HEADS, _advised
kv = prefilled_kv(HEADS, HEAD_DIM, 16384)  # 4 MB a head
for a in kv.buffers(0):
    print(*_advised(a), HEADS * kv.length * HEAD_DIM * 4)
"""


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_a_long_cache_holds_its_positions_on_huge_pages() -> None:
    """Run apart: in a pytest worker hundreds of tests old, malloc may hand the arrays
    memory it paged in before, which the advice no longer moves to 2 MB pages (a fresh
    clone's suite once saw none)."""
    done = subprocess.run(
        [sys.executable, "-c", _GROWN],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2  # the keys and the values
    for line in lines:
        advised, huge_kb, positions = (int(x) for x in line.split())
        assert advised >= positions - 2 * HUGE_PAGE  # every 2 MB page but its ends
        assert huge_kb > 0  # and the kernel gave it some


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_a_shared_page_of_a_large_model_lies_on_huge_pages() -> None:
    """A session deep in a shared prefix reads page after page (kv/pages.py): each is a
    mapping of its own, so it asks for 2 MB pages itself."""
    page = KVPage(16, HEADS, HEAD_DIM, np.dtype(np.float32))  # Llama 3.2 1B's shape: 4 MB
    page.array[...] = 1.0  # written, as the cache fills it
    advised, huge_kb = _advised(page.array)
    assert advised == page.nbytes
    assert page.array.ctypes.data % HUGE_PAGE == 0  # every byte in a whole 2 MB page
    assert huge_kb > 0
