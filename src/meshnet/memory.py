"""Keeping a serving process's resident memory at its weights plus its KV.

Loading a shard reads each tensor, repacks it and drops the read copy; a forward
allocates scratch and frees it. glibc serves many of those large blocks from its
heap (it raises its mmap threshold after the first large free), and freed heap
pages stay counted in the process's resident set (it raises its trim threshold
too: a 200-token prefill left ~14 MB of freed scratch resident). ``settle`` fixes
both thresholds, so large blocks are mapped and unmapped on their own and a
step's freed scratch is returned, and hands free heap pages back. Elsewhere than
glibc it is a no-op.

Weights a decode step streams once, far past the caches, go on memory Linux may
back with 2 MB pages (``on_huge_pages``): 4 KB pages cost a TLB miss every 4 KB
of each stream.

What a process only checks once, and never serves from, can be done in a forked child
(``in_child``): whatever the check loads (a 128k-token tokenizer and its library, a
shard's tensor descriptors) goes with the child, not into the parent's resident set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import multiprocessing
from collections.abc import Callable
from functools import cache
from multiprocessing.connection import Connection
from typing import TypeVar

import numpy as np

from meshnet.errors import MeshnetError

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 20  # blocks from this size up get pages of their own
_TRIM_THRESHOLD = 1 << 20  # free space past this at the heap's top goes back at once
HUGE_PAGE = 2 << 20  # bytes of one transparent huge page (x86-64 Linux)

T = TypeVar("T")


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
    trim()


def trim() -> None:
    """Release the heap's free pages now, wherever they lie.

    A returned heap top goes back by itself (``settle``), but blocks freed below live
    ones stay resident: an ended session's KV and a last hop's logits vectors are
    such blocks (under the 1 MB from which blocks are mapped on their own).
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def on_huge_pages(a: np.ndarray) -> np.ndarray:
    """``a`` copied into memory that Linux may back with 2 MB pages, or ``a`` itself where
    it is under one such page or the system has no transparent huge pages to ask for.

    A decode step streams every weight once, far past the caches; on 4 KB pages each
    stream takes a TLB miss every 4 KB, which held a one-thread Q6_K matmul out of cache
    to ~23 GB/s where 2 MB pages let it reach ~33 (AVX-512; the AVX2 tiles, slower than
    memory, gain little). Only the whole 2 MB pages inside the copy are advised, so its
    resident size stays its bytes rounded up to 4 KB, as a plain array's.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    private = getattr(mmap, "MAP_PRIVATE", None)
    if a.nbytes < HUGE_PAGE or advice is None or private is None:
        return a
    try:
        area = mmap.mmap(-1, a.nbytes + HUGE_PAGE, flags=private | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(area, np.uint8)
        start = -whole.ctypes.data % HUGE_PAGE  # the first 2 MB boundary inside the area
        area.madvise(advice, start, a.nbytes // HUGE_PAGE * HUGE_PAGE)
    except (OSError, ValueError):  # no such advice here: plain pages serve as well
        return a
    out = whole[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def in_child(run: Callable[[], T]) -> T:
    """``run()``'s result (or its exception, raised here), computed in a forked child so
    that nothing it allocates or imports stays in this process.

    The child inherits this process as it is (nothing is pickled but the result), so
    call it before any thread that holds a lock starts. ``MeshnetError`` if the child
    dies without an answer. Where processes cannot be forked, ``run()`` runs here.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        return run()
    fork = multiprocessing.get_context("fork")
    answer, sender = fork.Pipe(duplex=False)
    child = fork.Process(target=_answer, args=(run, sender), daemon=True)
    child.start()
    sender.close()  # the child holds the only sending end: EOF when it is gone
    try:
        failed, value = answer.recv()
    except EOFError:
        child.join()
        raise MeshnetError(f"the child process died (exit status {child.exitcode})") from None
    finally:
        answer.close()
    child.join()
    if failed:
        raise value
    result: T = value
    return result


def _answer(run: Callable[[], object], sender: Connection) -> None:
    """In the child: send (False, result) or (True, the exception raised)."""
    try:
        reply: tuple[bool, object] = (False, run())
    except BaseException as e:  # every failure goes back to the parent, which raises it
        reply = (True, e)
    try:
        sender.send(reply)
    except Exception as e:  # a result or exception that cannot be pickled: said in words
        sender.send((True, MeshnetError(f"the child's answer cannot be sent back: {e}")))
    sender.close()
