"""The memory a node offers the tracker for more layers: what its host has available now,
within the node's own cap (``--memory-mb``) when it has one.

Each heartbeat carries it (``NodeLoad.free_memory_bytes``); the tracker's placement
widens a node over a dead peer's layers only when the wider shard fits it
(tracker/serving/widening.py). A cap is what the whole process may take (its resident set
counts against it), so an operator can keep a node to a share of a host it shares.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshnet.node.preflight.host import available_memory


def offered_memory(cap_bytes: int = 0, statm: str = "/proc/self/statm") -> int:
    """Bytes of memory this process could take on now: the host's available memory,
    less what the cap (0: none) leaves after the process's resident set. 0 when the
    host does not say (the tracker then never asks this node for more)."""
    available = available_memory() or 0
    if cap_bytes <= 0:
        return available
    return max(0, min(available, cap_bytes - resident_bytes(statm)))


def resident_bytes(statm: str = "/proc/self/statm") -> int:
    """This process's resident set in bytes (0 where /proc does not say)."""
    try:
        pages = int(Path(statm).read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
