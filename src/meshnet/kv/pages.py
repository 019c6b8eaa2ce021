"""Pages: KV of a prompt's positions that sequences and the prefix cache share.

A page holds ``PAGE_TOKENS`` consecutive positions, from a multiple of it, of every
layer without a window (``page_layers``), written once and then only read: the prefix
cache (kv/prefix_cache.py) stores a prompt's blocks into pages, and a sequence
(kv/cache.py) that starts with a cached prefix reads its whole pages where they are
rather than holding a copy, so eight sessions on one system prompt hold its KV once.
The session that computed a prompt gives up its own copy of the pages stored from it
too (``SequenceKV.share``).

``PAGE_TOKENS`` is the native attention's tile (``TILE``): a tile's positions are then
all in one page or all in the sequence's own arrays, so the kernel reads the same keys
in the same order either way and a shared prefix changes no bit of an answer. Windowed
layers are not paged: a ring (kv/cache.py) holds only the window, a few pages' worth.

Positions of a page are written in order, a block at a time (``filled`` grows); the
positions before ``filled`` never change, so views of them stay valid, and a full page
never changes at all. A page lives as long as anything refers to it (Python's
references: a cached block, a sequence); who counts its bytes is the node's KV budget's
business (node/engine_held.py counts each held page once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.memory import huge_zeros

TILE = 64  # the native attention's tile (native.h ATTENTION_TILE)
PAGE_TOKENS = TILE  # positions per page


def page_layers(windows: Sequence[int]) -> tuple[int, ...]:
    """The layers whose positions pages hold: those without a window."""
    return tuple(layer for layer, window in enumerate(windows) if not window)


class KVPage:
    """Keys and values of ``PAGE_TOKENS`` positions of ``n_layers`` paged layers:
    ``array[i, 0]`` the keys and ``array[i, 1]`` the values of paged layer ``i``, each
    ``[n_kv_heads, PAGE_TOKENS, head_dim]``."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: np.dtype) -> None:
        # On 2 MB pages where it holds one: a decode step deep in a shared prefix reads
        # page after page, and on 4 KB pages each 4 KB cost a TLB miss (a 16k-position
        # layer of Llama 3.2 1B's shape, 2 threads: 1.3-1.4x the time of one array, ~1.0x
        # on 2 MB pages). Smaller pages stay on 4 KB ones: Gemma 3 270M's (384 KB) read
        # a global layer at 1.02-1.10x the time of one array at 16k-32k positions.
        shape = (n_layers, 2, n_kv_heads, PAGE_TOKENS, head_dim)
        huge = huge_zeros(shape, dtype)
        self.array = huge if huge is not None else np.zeros(shape, dtype)
        self.filled = 0  # positions written, from the page's first
        self.blocks = 0  # cached blocks whose positions are here (kv/prefix_cache.py)
        # The prefix cache's chain key of the prefix a full page ends (its last block's),
        # set when the cache fills it: what a parked session finds its pages again by.
        self.key: bytes | None = None

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def fill(
        self, at: int, n: int, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]
    ) -> None:
        """Write positions ``at .. at + n`` of each paged layer (``keys[i]``, ``values[i]``
        of shape ``[n_kv_heads, n, head_dim]``) where the page is written up to ``at``."""
        if at != self.filled or at + n > PAGE_TOKENS:
            raise ValueError(f"positions {at}..{at + n} of a page written up to {self.filled}")
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.array[i, 0, :, at : at + n] = k
            self.array[i, 1, :, at : at + n] = v
        self.filled = at + n

    def copy_from(self, page: KVPage, n: int) -> None:
        """Start this empty page with the first ``n`` positions of ``page``."""
        if self.filled or n > page.filled:
            raise ValueError(f"cannot start a page with {n} positions of {page.filled}")
        self.array[:, :, :, :n] = page.array[:, :, :, :n]
        self.filled = n


def address_table(pages: Sequence[KVPage], row: int) -> np.ndarray:
    """Where paged layer ``row``'s keys, then its values, are in each page: int64
    ``[2, len(pages)]`` addresses for the native attention (native.h ``seq_t.pages``).
    The pages must outlive every use of the table."""
    table = np.empty((2, len(pages)), np.int64)
    for i, page in enumerate(pages):
        table[0, i] = page.array[row, 0].ctypes.data
        table[1, i] = page.array[row, 1].ctypes.data
    return table
