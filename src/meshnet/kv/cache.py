"""The KV cache of one sequence on one shard.

A shard owns a ``SequenceKV`` per sequence it serves: for each of its layers,
the rotated keys and the values of the positions its attention can still read.
A forward step first ``reserve``s room for its new positions, each layer
``write``s into that room, and the step ends with ``advance``, which makes the
new positions part of the sequence.

The cache holds what its tokens need, never the context's length: the first
reservation is exactly its positions (at least ``GRANULE``), and a growth
leaves a little room past what it needs, so that appending one token at a
time copies the cache only now and then. That room is an eighth of the
positions, at least ``GRANULE``: doubling (as before) let a cache hold up to
twice its tokens, and a node whose KV budget counts capacity refused a
session's next token with half of it unused. Room geometric in the length keeps
the copying amortised O(1) (a fixed cap on it, tried before, made a long
prompt's chunked prefill copy the whole cache every chunk). Growth replaces one
layer's arrays at a time, so it briefly holds one layer twice, not the whole
cache.

**Windowed layers** (Gemma 2/3, gpt-oss: a row sees only its last ``window``
positions) keep only what a row can still see. With ``rings`` (the native
kernel reads them) such a layer's arrays are a ring: position ``p`` in slot
``p % capacity``, the capacity a multiple of ``TILE`` that stops growing at
``window + n_new - 1`` (what one step's rows read and write) plus
``REWIND_ROOM``. Without rings (the numpy and numba paths) the layer is laid out
as the others. Either way an export holds, for a windowed layer, only its last
``window`` positions, so parked, snapshot and migrated KV shrink the same way
and any node can take any node's bytes. A ring cannot go back further than it
holds: ``truncate`` to a point whose window is gone raises ``CacheMiss`` (the
tracker then recomputes the positions), and so does it after an import.

**Shared pages** (kv/pages.py): with ``paging`` (the native kernel reads them), a
cache's first ``shared`` positions of every layer without a window may be pages that
the prefix cache and other sequences hold too, read in place (``start_loaded`` with
pages, ``share``); its own arrays then hold positions ``shared ..`` only, position
``p`` in slot ``p - shared``, and the room a growth leaves is an eighth of those
(growing copies only them). Pages are never written: a ``truncate`` into them lets go
of the pages from the one it cuts and copies what it keeps of that one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.errors import CacheMiss
from meshnet.kv.pages import PAGE_TOKENS, TILE, KVPage, address_table, page_layers

GRANULE = 64  # positions: the least capacity, and the least room a growth leaves
REWIND_ROOM = 64  # positions a ring keeps past its window and step, for rewinds
_ROOM_FRACTION = 8  # a growth leaves room for 1/8 of the positions needed


def grown_capacity(capacity: int, need: int) -> int:
    """The capacity, in positions, of a cache of ``capacity`` once it holds ``need``:
    unchanged when they fit, exactly the need on a first reservation (at least
    ``GRANULE``), else the need plus an eighth of it (at least ``GRANULE``). The room is
    geometric so that growing to any length copies a bounded multiple of it."""
    if need <= capacity:
        return capacity
    if capacity == 0:
        return max(GRANULE, need)
    return need + max(need // _ROOM_FRACTION, GRANULE)


def _tiles(n: int) -> int:
    return -(-n // TILE) * TILE


def ring_capacity(capacity: int, length: int, n_new: int, window: int) -> int:
    """The capacity of a windowed layer's ring of ``capacity`` holding ``length``
    positions once it takes ``n_new`` more: unchanged while they fit (every position
    in its own slot, or the ring past ``window + n_new - 1``), else grown as a dense
    cache would, never past the window, the step and ``REWIND_ROOM``; a multiple of
    ``TILE``, so a tile's positions are contiguous slots."""
    need = length + n_new
    if capacity >= min(need, window + n_new - 1):
        return capacity
    full = _tiles(window + n_new - 1 + REWIND_ROOM)
    return min(_tiles(grown_capacity(capacity, need)), full)


class SequenceKV:
    """Keys and values ``[n_kv_heads, capacity, head_dim]`` per layer of a shard.

    ``windows``: each layer's window (0: it sees every position); ``rings``: windowed
    layers are rings; ``paging``: it may read shared pages (see the module's doc)."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: type[np.floating] = np.float32,
        windows: Sequence[int] = (),
        rings: bool = False,
        paging: bool = False,
    ) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        self.windows = tuple(windows) or (0,) * n_layers
        if len(self.windows) != n_layers or min(self.windows) < 0:
            raise ValueError("windows must give each layer a window, 0 for none")
        self._window = max(self.windows)
        self.rings = rings and self._window > 0
        self.length = 0  # positions committed by ``advance``
        self._capacity = 0  # of every layer but the rings
        self._ring = 0  # of the rings
        self._kept_from = 0  # the oldest position every windowed layer still holds
        self._keys: list[np.ndarray] = []  # own arrays: a paged layer's from ``shared``
        self._values: list[np.ndarray] = []
        # reads shared pages; windowed layers are then rings (``_capacity`` is the pages')
        self.paging = paging and (self.rings or not self._window)
        self.page_layers = page_layers(self.windows)
        self._pages: tuple[KVPage, ...] = ()  # positions 0 .. shared of the paged layers
        self._tables: dict[int, np.ndarray] = {}  # per paged layer: its pages' addresses

    def _is_ring(self, layer: int) -> bool:
        return self.rings and self.windows[layer] > 0

    @property
    def shared(self) -> int:
        """Positions the paged layers read from pages rather than their own arrays."""
        return len(self._pages) * PAGE_TOKENS

    @property
    def pages(self) -> tuple[KVPage, ...]:
        """The pages holding positions ``0 .. shared`` of the paged layers."""
        return self._pages

    def _base(self, layer: int) -> int:
        """The first position ``layer``'s own arrays hold."""
        return self.shared if not self.windows[layer] else 0

    def _own(self, layer: int, capacity: int, ring: int) -> int:
        """Slots of ``layer``'s own arrays in a cache of ``capacity`` and ``ring``."""
        return ring if self._is_ring(layer) else capacity - self._base(layer)

    @property
    def per_position(self) -> int:
        """Bytes one position takes in a layer without a window, times every layer."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def capacity(self) -> int:
        """Positions the layers without rings have room for (``length`` committed)."""
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Bytes of this sequence's own arrays on this shard (capacity, not length; the
        shared pages are not counted: ``pages``)."""
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def _bytes(self, capacity: int, ring: int) -> int:
        per = 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return per * sum(self._own(layer, capacity, ring) for layer in range(self.n_layers))

    def _plan(self, n_new: int) -> tuple[int, int]:
        # room in proportion to what the own arrays hold: growing copies only them
        own = grown_capacity(self._capacity - self.shared, self.length + n_new - self.shared)
        capacity = self.shared + own
        ring = ring_capacity(self._ring, self.length, n_new, self._window) if self.rings else 0
        return capacity, ring

    def growth_bytes(self, n_new: int) -> int:
        """Bytes ``reserve(n_new)`` would add to ``nbytes`` (0 when it fits already)."""
        return self._bytes(*self._plan(n_new)) - self._bytes(self._capacity, self._ring)

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` positions after ``length`` (in a ring: the slots of the
        positions no row will read again)."""
        capacity, ring = self._plan(n_new)
        if not self._keys:
            for layer in range(self.n_layers):
                shape = (self.n_kv_heads, self._own(layer, capacity, ring), self.head_dim)
                self._keys.append(np.zeros(shape, self.dtype))
                self._values.append(np.zeros(shape, self.dtype))
        elif (capacity, ring) != (self._capacity, self._ring):
            for arrays in (self._keys, self._values):
                for layer, old in enumerate(arrays):  # in place: each old array goes at once
                    want = self._own(layer, capacity, ring)
                    if old.shape[1] != want:
                        arrays[layer] = self._grown(layer, old, want)
        self._capacity, self._ring = capacity, ring
        if self.rings:  # the step's writes take the slots of the oldest positions
            self._kept_from = max(self._kept_from, self.length + n_new - ring)

    def _grown(self, layer: int, old: np.ndarray, capacity: int) -> np.ndarray:
        # np.zeros from 8 MB up is fresh zero pages, which numpy (from 4 MB) advises Linux
        # to back with 2 MB pages: a step deep in a context reads every position once,
        # and 4 KB pages would cost a TLB miss every 4 KB (tests/unit/test_kv_huge_pages.py).
        # Only the 2 MB pages the positions copied (and later written) touch become
        # resident, so at most the room; under 8 MB, a cleared heap block (memory.py's
        # policy), resident to its capacity, an eighth past the positions at most.
        new = np.zeros((self.n_kv_heads, capacity, self.head_dim), self.dtype)
        if self._is_ring(layer):
            held = np.arange(self._kept_from, self.length)
            new[:, held % capacity] = old[:, held % old.shape[1]]
        else:
            own = self.length - self._base(layer)
            new[:, :own] = old[:, :own]
        return new

    def _slots(self, layer: int, start: int, stop: int) -> slice | np.ndarray:
        """Where positions ``start .. stop`` (none of them in pages) of ``layer`` are in
        its own arrays."""
        if not self._is_ring(layer) or stop <= self._ring:
            base = self._base(layer)
            if start < base:
                raise ValueError(f"positions from {start} of layer {layer} are in pages")
            return slice(start - base, stop - base)
        return np.arange(start, stop) % self._ring

    def _gather(self, layer: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the keys and values of positions ``start .. stop`` of ``layer``,
        from its pages and its own arrays."""
        base = self._base(layer)
        if start >= base:
            at = self._slots(layer, start, stop)
            return self._keys[layer][:, at].copy(), self._values[layer][:, at].copy()
        row = self.page_layers.index(layer)
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        for p in range(start // PAGE_TOKENS, -(-min(stop, base) // PAGE_TOKENS)):
            a = max(start, p * PAGE_TOKENS) - p * PAGE_TOKENS
            b = min(stop, (p + 1) * PAGE_TOKENS) - p * PAGE_TOKENS
            page = self._pages[p].array[row]
            parts.append((page[0, :, a:b], page[1, :, a:b]))
        if stop > base:
            own = self._slots(layer, base, stop)
            parts.append((self._keys[layer][:, own], self._values[layer][:, own]))
        keys = np.concatenate([k for k, _ in parts], axis=1)
        return keys, np.concatenate([v for _, v in parts], axis=1)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k, v`` of shape ``[n_kv_heads, n_new, head_dim]`` after ``length``."""
        n = k.shape[1]
        room = self._ring if self._is_ring(layer) else self._capacity
        if self.length + n > room and not (self._is_ring(layer) and n <= room):
            raise ValueError("write past reserved KV capacity")
        at = self._slots(layer, self.length, self.length + n)
        self._keys[layer][:, at] = k
        self._values[layer][:, at] = v

    def buffers(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """A layer's own key and value arrays ``[n_kv_heads, slots, head_dim]``, for
        kernels that write new positions after ``length`` themselves."""
        return self._keys[layer], self._values[layer]

    def entry(
        self, layer: int, n_new: int, row: int
    ) -> tuple[np.ndarray, np.ndarray, int, int, int, int, np.ndarray | None]:
        """What the native attention takes of this sequence's ``n_new`` rows from batch
        row ``row`` in ``layer`` (module.c ``read_entries``): its own arrays, where its
        positions are, and its pages' addresses (None: none)."""
        table = self._tables.get(layer) if self._pages else None
        keys, values = self._keys[layer], self._values[layer]
        return keys, values, self.length, n_new, row, self.ring(layer), table

    def ring(self, layer: int) -> int:
        """A ring layer's capacity (position ``p`` in slot ``p % ring``); 0 for a layer
        whose positions are its slots."""
        return self._ring if self._is_ring(layer) else 0

    def view(self, layer: int, n_new: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the committed positions plus ``n_new`` just written."""
        end = self.length + n_new
        if self._is_ring(layer) and end > self._ring:
            raise ValueError("a ring that went round has no view in position order")
        if self._base(layer):  # a copy: kernels that read views do not read pages
            return self._gather(layer, 0, end)
        return self._keys[layer][:, :end], self._values[layer][:, :end]

    def advance(self, n_new: int) -> None:
        """Commit the ``n_new`` positions every layer has written."""
        self.length += n_new

    def kept(self, layer: int, length: int) -> int:
        """Positions of ``length`` that ``layer`` exports: its last ``window``, or all."""
        window = self.windows[layer]
        return min(length, window) if window else length

    def payload_bytes(self, length: int) -> int:
        """Size of ``export_bytes`` for ``length`` positions."""
        per = 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return per * sum(self.kept(layer, length) for layer in range(self.n_layers))

    def export_bytes(self) -> memoryview:
        """Every layer's keys, then every layer's values, each ``[n_kv_heads, kept,
        head_dim]`` in C order: a layer's last ``kept(layer, length)`` positions."""
        n = self.length
        out = np.empty(self.payload_bytes(n) // self.dtype.itemsize, self.dtype)
        offset = 0
        for side in (0, 1):
            for layer, array in enumerate((self._keys, self._values)[side]):
                kept = self.kept(layer, n)
                size = self.n_kv_heads * kept * self.head_dim
                part = out[offset : offset + size].reshape(self.n_kv_heads, kept, self.head_dim)
                if n - kept < self._base(layer):  # partly in pages
                    part[:] = self._gather(layer, n - kept, n)[side]
                else:  # one copy, straight into the result
                    part[:] = array[:, self._slots(layer, n - kept, n)]
                offset += size
        return out.view(np.uint8).data

    def _loaded_sizes(self, length: int) -> tuple[int, int]:
        """The capacity and ring of a cache loaded with ``length`` positions: exactly them,
        a ring only its window's tiles (and the rewind room)."""
        ring = min(_tiles(length), _tiles(self._window + REWIND_ROOM)) if self.rings else 0
        return grown_capacity(0, length), ring

    def load_growth_bytes(self, length: int, shared: int = 0) -> int:
        """Bytes an empty cache's own arrays take once ``start_loaded(length)`` with
        pages of ``shared`` positions."""
        capacity, ring = self._loaded_sizes(length)
        per = 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return self._bytes(capacity, ring) - per * shared * len(self.page_layers)

    def start_loaded(self, length: int, pages: Sequence[KVPage] = ()) -> None:
        """Make this empty cache hold ``length`` positions whose keys and values the caller
        then stores (``put_parts``): each layer's last ``kept(layer, length)`` (an import,
        a prefix), but the paged layers' first ``len(pages) * PAGE_TOKENS``, read from
        ``pages`` (full pages of these very positions: ``paging`` caches only)."""
        if self.length:
            raise ValueError("a load needs an empty cache")
        if pages and (not self.paging or len(pages) * PAGE_TOKENS > length):
            raise ValueError(f"{len(pages)} pages do not start a {length}-position cache")
        self._capacity, self._ring = self._loaded_sizes(length)
        self._set_pages(tuple(pages))
        self._keys, self._values = [], []
        for layer in range(self.n_layers):
            shape = (self.n_kv_heads, self._own(layer, self._capacity, self._ring), self.head_dim)
            self._keys.append(np.zeros(shape, self.dtype))
            self._values.append(np.zeros(shape, self.dtype))
        self.length = length
        self._kept_from = max(0, length - self._window) if self._window else 0

    def put_parts(
        self, layer: int, start: int, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]
    ) -> None:
        """Store committed positions ``start ..`` of ``layer`` from consecutive parts (each
        ``[n_kv_heads, n_i, head_dim]``), within the last ``kept(layer, length)`` (after
        ``start_loaded``), in one copy: a prefix of many cached blocks is loaded with a
        call a layer rather than one per block (a 2,000-position prefix of 30 layers was
        3,750 calls, twice the time of its copy)."""
        stop = start + sum(k.shape[1] for k in keys)
        first = max(self.length - self.kept(layer, self.length), self._base(layer))
        if start < first or stop > self.length:
            raise ValueError(f"positions {start}..{stop} are not layer {layer}'s to hold")
        at = self._slots(layer, start, stop)
        for parts, arrays in ((keys, self._keys), (values, self._values)):
            if isinstance(at, slice):  # straight into place
                np.concatenate(parts, axis=1, out=arrays[layer][:, at])
            else:  # round a ring
                arrays[layer][:, at] = np.concatenate(parts, axis=1)

    def read(self, layer: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Copies of the keys and values of committed positions ``start .. stop`` of
        ``layer``; None where its ring no longer holds them all."""
        if stop > self.length or start < 0:
            raise ValueError(f"positions {start}..{stop} of {self.length}")
        if self.windows[layer] and start < self._kept_from:
            return None  # gone round a ring, or never loaded (an import keeps the window)
        return self._gather(layer, start, stop)

    def load_bytes(self, length: int, payload: bytes | bytearray) -> None:
        """Fill this empty cache with ``length`` positions made by ``export_bytes``."""
        if self.length:
            raise ValueError("load_bytes needs an empty cache")
        if len(payload) != self.payload_bytes(length):
            raise ValueError(f"{len(payload)} bytes do not hold {length} positions")
        self.start_loaded(length)
        data = np.frombuffer(payload, self.dtype)
        offset = 0
        for arrays in (self._keys, self._values):
            for layer, array in enumerate(arrays):
                kept = self.kept(layer, length)
                size = self.n_kv_heads * kept * self.head_dim
                part = data[offset : offset + size].reshape(self.n_kv_heads, kept, self.head_dim)
                array[:, self._slots(layer, length - kept, length)] = part
                offset += size

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (e.g. to re-run a suffix);
        ``CacheMiss`` where a windowed layer no longer holds the window before it."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-position cache to {length}")
        if self._window and self._kept_from > max(0, length - self._window):
            raise CacheMiss(
                f"the windowed layers hold positions from {self._kept_from}: cannot go "
                f"back to {length}"
            )
        if length < self.shared:  # keep the whole pages before it, copy the rest
            self._rebase(self._pages[: length // PAGE_TOKENS], length)
        self.length = length

    def share(self, pages: Sequence[KVPage]) -> None:
        """Read the paged layers' first ``len(pages) * PAGE_TOKENS`` positions from
        ``pages`` and let this cache's own copy of them go: full pages holding exactly
        these positions' keys and values (the prefix cache stored them from this cache,
        or from another of the same tokens: kv/prefix_cache.py), which start with the
        pages it reads already. Nothing when they hold no more than it reads."""
        pages = tuple(pages)
        if not self.paging or len(pages) <= len(self._pages):
            return
        if pages[: len(self._pages)] != self._pages or len(pages) * PAGE_TOKENS > self.length:
            raise ValueError("pages that do not start with this cache's cannot be shared")
        self._rebase(pages, self.length)

    def holds(self, pages: Sequence[KVPage]) -> bool:
        """Whether this cache's first ``len(pages) * PAGE_TOKENS`` positions of every
        paged layer are exactly ``pages``' keys and values, bit for bit (compared in
        place where it holds them in its own arrays, as a cache just loaded does)."""
        n = len(pages) * PAGE_TOKENS
        if n > self.length or any(p.filled != PAGE_TOKENS for p in pages):
            return False
        for row, layer in enumerate(self.page_layers):
            keys, values = self.view(layer, 0)
            for j, page in enumerate(pages):
                at = slice(j * PAGE_TOKENS, (j + 1) * PAGE_TOKENS)
                if not (
                    np.array_equal(keys[:, at], page.array[row, 0])
                    and np.array_equal(values[:, at], page.array[row, 1])
                ):
                    return False
        return True

    def _rebase(self, pages: tuple[KVPage, ...], length: int) -> None:
        """Read positions ``0 .. len(pages) * PAGE_TOKENS`` of the paged layers from
        ``pages`` and hold positions from there to ``length`` in new own arrays, room for
        them and no more (at least ``GRANULE``): copied from wherever they are now."""
        shared = len(pages) * PAGE_TOKENS
        capacity = shared + grown_capacity(0, length - shared)
        for layer in self.page_layers:
            kept = self._gather(layer, shared, length) if length > shared else None
            shape = (self.n_kv_heads, capacity - shared, self.head_dim)
            keys, values = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
            if kept is not None:
                keys[:, : length - shared], values[:, : length - shared] = kept
            self._keys[layer], self._values[layer] = keys, values
        self._capacity = capacity
        self._set_pages(pages)

    def _set_pages(self, pages: tuple[KVPage, ...]) -> None:
        self._pages = pages
        self._tables = {
            layer: address_table(pages, row) for row, layer in enumerate(self.page_layers)
        }
