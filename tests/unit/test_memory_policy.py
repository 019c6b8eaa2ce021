"""The allocator policy of memory.py: a step's freed buffers are reused without faulting
their pages in again, and what is freed for good leaves the resident set (at once from
KEEP_UNDER up, at ``trim`` below it). Counted in page faults and resident bytes, never
in time.

The policy is the whole process's (glibc's thresholds), so each check runs in a fresh
interpreter: set in a test worker it would change what later tests there measure, and
what earlier tests left in the worker's heap would change what these measure."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="resident bytes are read from /proc"
)

_PRELUDE = """
import resource
import numpy as np
from meshnet.memory import KEEP_UNDER, settle, trim

PAGE = 4096
LOGITS = 8 * 49152 * 4  # a decode step's logits: 8 rows of the bundled model's vocabulary

def _faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def _rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

settle()
"""


def _check(body: str) -> None:
    """Run ``body`` (asserts) after the prelude in a fresh interpreter; fail with its
    output if an assert does."""
    code = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_steps_buffers_are_reused_not_faulted_in_again() -> None:
    _check("""
        np.ones(LOGITS // 4, np.float32)  # the first step's pages are new
        before = _faults()
        for _ in range(20):  # each step allocates, writes and frees its logits
            np.ones(LOGITS // 4, np.float32)
        fresh = 20 * LOGITS // PAGE  # were each step's block mapped fresh (from 1 MB, before)
        assert _faults() - before < fresh // 10, (_faults() - before, fresh)
    """)


def test_blocks_freed_for_good_go_back_at_trim() -> None:
    _check("""
        before = _rss()
        held = [np.ones(KEEP_UNDER // 16, np.uint8) for _ in range(64)]  # 32 MB of heap blocks
        grown = _rss() - before
        assert grown >= 28 << 20, grown
        del held[1::2]  # every other block: freed below live ones, not at the heap's top
        trim()
        assert _rss() - before <= grown // 2 + (2 << 20), (_rss() - before, grown)
    """)


def test_a_block_from_keep_under_up_goes_back_when_freed() -> None:
    _check("""
        before = _rss()
        block = np.ones(2 * KEEP_UNDER, np.uint8)
        assert _rss() - before >= KEEP_UNDER
        del block
        assert _rss() - before <= 1 << 20, _rss() - before
    """)
