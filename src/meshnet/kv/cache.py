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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.errors import CacheMiss

GRANULE = 64  # positions: the least capacity, and the least room a growth leaves
TILE = 64  # the native attention's tile: a ring's capacity is a multiple of it
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
    layers are rings (see the module's doc)."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: type[np.floating] = np.float32,
        windows: Sequence[int] = (),
        rings: bool = False,
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
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    def _is_ring(self, layer: int) -> bool:
        return self.rings and self.windows[layer] > 0

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
        """Bytes held by this sequence's cache on this shard (capacity, not length)."""
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def _bytes(self, capacity: int, ring: int) -> int:
        per = 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        rings = sum(self._is_ring(layer) for layer in range(self.n_layers))
        return per * ((self.n_layers - rings) * capacity + rings * ring)

    def _plan(self, n_new: int) -> tuple[int, int]:
        capacity = grown_capacity(self._capacity, self.length + n_new)
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
                shape = (self.n_kv_heads, ring if self._is_ring(layer) else capacity, self.head_dim)
                self._keys.append(np.zeros(shape, self.dtype))
                self._values.append(np.zeros(shape, self.dtype))
        elif (capacity, ring) != (self._capacity, self._ring):
            for arrays in (self._keys, self._values):
                for layer, old in enumerate(arrays):  # in place: each old array goes at once
                    want = ring if self._is_ring(layer) else capacity
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
            new[:, : self.length] = old[:, : self.length]
        return new

    def _slots(self, layer: int, start: int, stop: int) -> slice | np.ndarray:
        """Where positions ``start .. stop`` of ``layer`` are."""
        if not self._is_ring(layer) or stop <= self._ring:
            return slice(start, stop)
        return np.arange(start, stop) % self._ring

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
        """A layer's whole key and value arrays ``[n_kv_heads, capacity, head_dim]``, for
        kernels that write new positions after ``length`` themselves."""
        return self._keys[layer], self._values[layer]

    def ring(self, layer: int) -> int:
        """A ring layer's capacity (position ``p`` in slot ``p % ring``); 0 for a layer
        whose positions are its slots."""
        return self._ring if self._is_ring(layer) else 0

    def view(self, layer: int, n_new: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the committed positions plus ``n_new`` just written."""
        end = self.length + n_new
        if self._is_ring(layer) and end > self._ring:
            raise ValueError("a ring that went round has no view in position order")
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
        for arrays in (self._keys, self._values):
            for layer, array in enumerate(arrays):  # one copy, straight into the result
                kept = self.kept(layer, n)
                size = self.n_kv_heads * kept * self.head_dim
                part = out[offset : offset + size].reshape(self.n_kv_heads, kept, self.head_dim)
                part[:] = array[:, self._slots(layer, n - kept, n)]
                offset += size
        return out.view(np.uint8).data

    def _loaded_sizes(self, length: int) -> tuple[int, int]:
        """The capacity and ring of a cache loaded with ``length`` positions: exactly them,
        a ring only its window's tiles (and the rewind room)."""
        ring = min(_tiles(length), _tiles(self._window + REWIND_ROOM)) if self.rings else 0
        return grown_capacity(0, length), ring

    def load_growth_bytes(self, length: int) -> int:
        """Bytes an empty cache takes once ``start_loaded(length)``."""
        return self._bytes(*self._loaded_sizes(length))

    def start_loaded(self, length: int) -> None:
        """Make this empty cache hold ``length`` positions whose keys and values the caller
        then stores (``put_parts``): each layer's last ``kept(layer, length)`` (an import,
        a prefix)."""
        if self.length:
            raise ValueError("a load needs an empty cache")
        self._capacity, self._ring = self._loaded_sizes(length)
        self._keys, self._values = [], []
        for layer in range(self.n_layers):
            size = self._ring if self._is_ring(layer) else self._capacity
            shape = (self.n_kv_heads, size, self.head_dim)
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
        if start < self.length - self.kept(layer, self.length) or stop > self.length:
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
        at = self._slots(layer, start, stop)
        return self._keys[layer][:, at].copy(), self._values[layer][:, at].copy()

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
        self.length = length
