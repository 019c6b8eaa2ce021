"""The KV cache of one sequence on one shard.

A shard owns a ``SequenceKV`` per sequence it serves: for each of its layers,
the rotated keys and the values of every position computed so far. A forward
step first ``reserve``s room for its new positions, each layer ``write``s
into that room, and the step ends with ``advance``, which makes the new
positions part of the sequence. Capacity grows geometrically, so appending
one token at a time is amortised O(1).
"""

from __future__ import annotations

import numpy as np

_MIN_CAPACITY = 64


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
    def nbytes(self) -> int:
        """Bytes held by this sequence's cache on this shard (capacity, not length)."""
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def growth_bytes(self, n_new: int) -> int:
        """Bytes ``reserve(n_new)`` would add to ``nbytes`` (0 when it fits already)."""
        capacity = self._next_capacity(n_new)
        if capacity == self._capacity:
            return 0
        per_position = 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return (capacity - self._capacity) * per_position

    def _next_capacity(self, n_new: int) -> int:
        need = self.length + n_new
        if need <= self._capacity:
            return self._capacity
        return max(_MIN_CAPACITY, self._capacity * 2, need)

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` positions after ``length``."""
        capacity = self._next_capacity(n_new)
        if capacity == self._capacity:
            return
        shape = (self.n_kv_heads, capacity, self.head_dim)
        self._keys = [self._grown(old, shape) for old in self._keys] or [
            np.zeros(shape, self.dtype) for _ in range(self.n_layers)
        ]
        self._values = [self._grown(old, shape) for old in self._values] or [
            np.zeros(shape, self.dtype) for _ in range(self.n_layers)
        ]
        self._capacity = capacity

    def _grown(self, old: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
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
        per_position = 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return per_position * length

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
