"""The KV cache of one sequence on one shard.

A shard owns a ``SequenceKV`` per sequence it serves: for each of its layers,
the rotated keys and the values of every position computed so far. A forward
step first ``reserve``s room for its new positions, each layer ``write``s
into that room, and the step ends with ``advance``, which makes the new
positions part of the sequence.

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
"""

from __future__ import annotations

import numpy as np

GRANULE = 64  # positions: the least capacity, and the least room a growth leaves
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


class SequenceKV:
    """Keys and values ``[n_kv_heads, capacity, head_dim]`` per layer of a shard."""

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: type[np.floating] = np.float32
    ) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        self.length = 0  # positions committed by ``advance``
        self._capacity = 0
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    @property
    def per_position(self) -> int:
        """Bytes one position takes: keys and values of every layer and kv head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def capacity(self) -> int:
        """Positions the cache has room for (``length`` of them committed)."""
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Bytes held by this sequence's cache on this shard (capacity, not length)."""
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def growth_bytes(self, n_new: int) -> int:
        """Bytes ``reserve(n_new)`` would add to ``nbytes`` (0 when it fits already)."""
        return (self._next_capacity(n_new) - self._capacity) * self.per_position

    def _next_capacity(self, n_new: int) -> int:
        return grown_capacity(self._capacity, self.length + n_new)

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` positions after ``length``."""
        capacity = self._next_capacity(n_new)
        if capacity == self._capacity:
            return
        shape = (self.n_kv_heads, capacity, self.head_dim)
        if not self._keys:
            self._keys = [np.zeros(shape, self.dtype) for _ in range(self.n_layers)]
            self._values = [np.zeros(shape, self.dtype) for _ in range(self.n_layers)]
        for arrays in (self._keys, self._values):
            for layer, old in enumerate(arrays):  # in place: each old array goes at once
                if old.shape[1] != capacity:
                    arrays[layer] = self._grown(old, shape)
        self._capacity = capacity

    def _grown(self, old: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
        # np.zeros of a large block is fresh zero pages: only the positions copied (and
        # later written) become resident, whatever the capacity.
        new = np.zeros(shape, self.dtype)
        new[:, : self.length] = old[:, : self.length]
        return new

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k, v`` of shape ``[n_kv_heads, n_new, head_dim]`` after ``length``."""
        n = k.shape[1]
        if self.length + n > self._capacity:
            raise ValueError("write past reserved KV capacity")
        self._keys[layer][:, self.length : self.length + n] = k
        self._values[layer][:, self.length : self.length + n] = v

    def buffers(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """A layer's whole key and value arrays ``[n_kv_heads, capacity, head_dim]``, for
        kernels that write new positions after ``length`` themselves."""
        return self._keys[layer], self._values[layer]

    def view(self, layer: int, n_new: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the committed positions plus ``n_new`` just written."""
        end = self.length + n_new
        return self._keys[layer][:, :end], self._values[layer][:, :end]

    def advance(self, n_new: int) -> None:
        """Commit the ``n_new`` positions every layer has written."""
        self.length += n_new

    def payload_bytes(self, length: int) -> int:
        """Size of ``export_bytes`` for ``length`` positions."""
        return self.per_position * length

    def export_bytes(self) -> memoryview:
        """The committed positions: every layer's keys, then every layer's values, C order."""
        n = self.length
        out = np.empty((2, self.n_layers, self.n_kv_heads, n, self.head_dim), self.dtype)
        for layer in range(self.n_layers):  # one copy, straight into the result
            out[0, layer] = self._keys[layer][:, :n]
            out[1, layer] = self._values[layer][:, :n]
        return memoryview(out.reshape(-1).view(np.uint8))

    def load_bytes(self, length: int, payload: bytes | bytearray) -> None:
        """Fill this empty cache with ``length`` positions made by ``export_bytes``."""
        if self.length:
            raise ValueError("load_bytes needs an empty cache")
        if len(payload) != self.payload_bytes(length):
            raise ValueError(f"{len(payload)} bytes do not hold {length} positions")
        self.reserve(length)
        shape = (2, self.n_layers, self.n_kv_heads, length, self.head_dim)
        data = np.frombuffer(payload, self.dtype).reshape(shape)
        for layer in range(self.n_layers):
            self._keys[layer][:, :length] = data[0, layer]
            self._values[layer][:, :length] = data[1, layer]
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (e.g. to re-run a suffix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-position cache to {length}")
        self.length = length
