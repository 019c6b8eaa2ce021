"""Keeping a serving process's resident memory at its weights plus its KV.

Loading a shard reads each tensor, repacks it and drops the read copy; a forward
allocates scratch and frees it. glibc serves many of those large blocks from its
heap (it raises its mmap threshold after the first large free), and freed heap
pages stay counted in the process's resident set. ``settle`` fixes the threshold,
so large blocks are mapped and unmapped on their own, and hands free heap pages
back. Elsewhere than glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_MMAP_THRESHOLD = 256 << 10  # blocks from this size up get pages of their own


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
    """Map large blocks on their own from now on, and release free heap pages."""
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    libc.malloc_trim(0)
