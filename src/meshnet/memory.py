"""Keeping a serving process's resident memory at its weights plus its KV, without
paying the kernel for the same scratch again every step.

One policy for glibc's allocator, applied by ``settle`` (a node at start, before its
threads; every process as it loads a shard), that tells two kinds of freed memory apart:

- **What a step frees is kept for the next step.** A decode step's logits and hidden
  states, a prompt chunk's scratch: blocks under 8 MB come from the heap, and up to
  8 MB free at the heap's top stays there, so the next step takes the same pages
  back. Mapped on their own and unmapped at free (as blocks from 1 MB were before, for
  the resident set's sake), they cost the kernel a fault and a cleared page per 4 KB
  every step: an 8-stream decode step of the bundled model faulted its 1.5 MB of
  logits in, ~350 page faults a step against ~100 now (the KV's growth). One arena
  serves every thread: a thread's own arena holds at most 64 MB and trims itself, and
  with one heap a block the loop's thread freed serves whichever thread runs next.
- **What is held only for a while goes back.** A block from 8 MB up (a long prompt's
  scratch and KV, a KV move's buffers) is mapped on its own and unmapped when freed,
  its faults small beside the work that fills it; more than 8 MB free at the heap's
  top (a prompt's scratch freed at once) goes back at once. So a prompt leaves at
  most 8 MB free at the top, and the heap holds no block large enough to pin much.
- **What is freed for good goes back when it is.** ``trim`` hands every free heap page
  back, wherever it lies: a loaded shard's read and repacked copies (``load_shard``),
  a swapped-out shard (node/engine_tiers.py), an ended or parked session's KV (the
  node's loop, as it next waits for work: node/engine.py). So a node's resident set
  follows what it holds (tests/integration/test_shard_memory.py,
  tests/e2e/test_node_memory_after_sessions.py) while a decode step reuses its buffers.

A KV cache's ``np.zeros`` under 8 MB is a reused heap block, cleared, so resident to
its capacity (an eighth past its positions at most): what its ``nbytes`` and the KV
budget count. From 8 MB up it is fresh pages, resident as its positions are written.

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
_M_ARENA_MAX = -8
# Blocks from this size up get pages of their own, and free space past it at the heap's
# top goes back at once; below it, freed blocks wait in the heap for the next step.
KEEP_UNDER = 8 << 20
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
    """Put the allocator under this module's policy and hand the free heap pages back.

    Setting the policy again changes nothing, so every shard load calls this; a node
    calls it first at start, before it starts a thread (one arena for every thread
    holds only for threads that have not taken an arena of their own yet). Fixed
    thresholds also stop glibc from sliding its own up as large blocks are freed.
    Elsewhere than glibc: a no-op.
    """
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(_M_ARENA_MAX, 1)
    libc.mallopt(_M_MMAP_THRESHOLD, KEEP_UNDER)
    libc.mallopt(_M_TRIM_THRESHOLD, KEEP_UNDER)
    trim()


def trim() -> None:
    """Hand every free heap page back now, wherever it lies: call it where memory was
    freed for good, not after every step (the next step would fault its buffers in
    again). It costs a walk of the heap's free lists (~0.05 ms on a node's heap) and
    the kernel's unmapping of what is handed back (~8 ms after 8 sessions of the
    bundled model ended), so a node calls it when it has nothing else to do."""
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
    out = huge_zeros(a.shape, a.dtype)
    if out is None:
        return a
    out[...] = a
    return out


def huge_zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray | None:
    """A zeroed array in memory whose whole 2 MB pages Linux may back with huge pages
    (``on_huge_pages``); None where it is under one such page or the system has no
    transparent huge pages to ask for. Its bytes go back when the last view of it does."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    private = getattr(mmap, "MAP_PRIVATE", None)
    if nbytes < HUGE_PAGE or advice is None or private is None:
        return None
    try:
        area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=private | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(area, np.uint8)
        start = -whole.ctypes.data % HUGE_PAGE  # the first 2 MB boundary inside the area
        area.madvise(advice, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except (OSError, ValueError):  # no such advice here: plain pages serve as well
        return None
    return whole[start : start + nbytes].view(dtype).reshape(shape)


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
