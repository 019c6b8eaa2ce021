"""Keeping a serving process's resident memory at its weights plus its KV.

Loading a shard reads each tensor, repacks it and drops the read copy; a forward
allocates scratch and frees it. glibc serves many of those large blocks from its
heap (it raises its mmap threshold after the first large free), and freed heap
pages stay counted in the process's resident set (it raises its trim threshold
too: a 200-token prefill left ~14 MB of freed scratch resident). ``settle`` fixes
both thresholds, so large blocks are mapped and unmapped on their own and a
step's freed scratch is returned, and hands free heap pages back. Elsewhere than
glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 20  # blocks from this size up get pages of their own
_TRIM_THRESHOLD = 1 << 20  # free space past this at the heap's top goes back at once


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    return libc


def settle() -> None:
    """Map large blocks on their own and return freed heap tops from now on; release free
    heap pages now."""
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    libc.malloc_trim(0)
