"""Many short strings in one buffer: a vocabulary's tokens or merges, compactly.

A 262k-token vocabulary (Gemma 3) held as Python ``str`` objects costs ~60
bytes a token before any table is built on it, and a dict from text to id as
much again. A ``StringTable`` keeps the UTF-8 bytes of every string end to end
in one ``bytes`` with an offset array (~13 bytes a token for Gemma's), and
decodes a string when asked; a ``StringIndex`` finds a string's position with
an open-addressing table of int32 slots and the strings' hashes (~24 bytes a
token). Both are immutable once built, so any thread may read them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

_EMPTY = -1  # a free slot of a StringIndex


class NotUtf8(ValueError):
    """A string of a table's bytes is not UTF-8; ``index`` says which."""

    def __init__(self, index: int) -> None:
        super().__init__(f"string {index} is not UTF-8")
        self.index = index


class StringTable(Sequence[str]):
    """An immutable sequence of strings stored as one UTF-8 buffer and offsets.

    String ``i`` is ``blob[offsets[i]:offsets[i + 1]]`` decoded. Compares equal to
    any sequence of the same strings (a list, as ``gguf.GGUFReader`` gives).
    """

    __slots__ = ("_blob", "_offsets", "_starts")

    def __init__(self, blob: bytes, offsets: np.ndarray) -> None:
        """``offsets``: int64 [n + 1], non-decreasing from 0 to ``len(blob)``, each at a
        character boundary (``from_parts`` checks; callers with other input must)."""
        self._blob = blob
        self._offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self._offsets.flags.writeable = False
        self._starts = self._offsets.data  # Python ints at C speed, no copy

    @staticmethod
    def of(strings: Iterable[str]) -> StringTable:
        """The table of ``strings`` (each encoded once; nothing else kept)."""
        parts = [s.encode("utf-8") for s in strings]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        return StringTable(b"".join(parts), offsets)

    @staticmethod
    def from_parts(blob: bytes, offsets: np.ndarray) -> StringTable:
        """The table over ``blob`` cut at ``offsets``; ``NotUtf8`` naming the first string
        that is not UTF-8 (a cut inside a character, or bytes no text has)."""
        table = StringTable(blob, offsets)
        if not table._utf8_ok():
            raise NotUtf8(next(i for i in range(len(table)) if not _is_utf8(table.raw(i))))
        return table

    def _utf8_ok(self) -> bool:
        """Whether every string decodes: the whole buffer does, and no string starts
        with a continuation byte (then none ends inside a character either)."""
        if not _is_utf8(self._blob):
            return False
        starts = self._offsets[:-1][self._offsets[:-1] < self._offsets[1:]]
        data = np.frombuffer(self._blob, np.uint8)
        return not np.any(data[starts] & 0xC0 == 0x80)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.raw(i).decode("utf-8")

    def raw(self, i: int) -> bytes:
        """The UTF-8 bytes of string ``i`` (negative counts from the end)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"string {i} of {n}")
        return self._blob[self._starts[i] : self._starts[i + 1]]

    def __iter__(self) -> Iterator[str]:
        blob, starts = self._blob, self._starts
        for i in range(len(self)):
            yield blob[starts[i] : starts[i + 1]].decode("utf-8")

    def lengths(self) -> np.ndarray:
        """The byte length of every string, int64 [n]."""
        return np.diff(self._offsets)

    @property
    def nbytes(self) -> int:
        """Bytes held: the buffer and the offsets."""
        return len(self._blob) + self._offsets.nbytes

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringTable):
            return self._blob == other._blob and np.array_equal(self._offsets, other._offsets)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"StringTable({len(self)} strings, {len(self._blob)} bytes)"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class StringIndex:
    """The position of each string of a table: ``find(text)`` in O(1).

    Linear probing over a power-of-two table at most half full. Each string's hash is
    Python's own ``hash(str)``, salted per process: an index is built and read in
    one process, never stored.
    """

    __slots__ = ("_hashes", "_mask", "_slots", "_table")

    def __init__(self, table: StringTable) -> None:
        """Index ``table``; ``ValueError`` naming a string that appears twice."""
        self._table = table
        hashes = np.fromiter((hash(s) for s in table), np.int64, count=len(table))
        _check_distinct(table, hashes)
        size = 1 << max(4, (2 * len(table) - 1).bit_length())
        self._mask = size - 1
        slots = _build_slots(hashes, size)
        self._hashes = hashes.data
        self._slots = slots.data

    def find(self, text: str) -> int:
        """The position of ``text`` in the table, or -1."""
        h = hash(text)
        mask, slots, hashes = self._mask, self._slots, self._hashes
        slot = h & mask
        while (i := slots[slot]) != _EMPTY:
            if hashes[i] == h:
                starts = self._table._starts
                if self._table._blob[starts[i] : starts[i + 1]] == text.encode("utf-8"):
                    return i
            slot = (slot + 1) & mask
        return -1

    @property
    def nbytes(self) -> int:
        """Bytes held by the index itself (not its table)."""
        return self._hashes.nbytes + self._slots.nbytes


def _check_distinct(table: StringTable, hashes: np.ndarray) -> None:
    """``ValueError`` where two strings are equal: equal strings hash alike, so only the
    few strings whose hash another shares are compared."""
    order = np.argsort(hashes, kind="stable")
    same = hashes[order[1:]] == hashes[order[:-1]]
    shared = np.union1d(order[1:][same], order[:-1][same])
    seen: dict[bytes, int] = {}
    for i in shared.tolist():
        first = seen.setdefault(table.raw(i), i)
        if first != i:
            raise ValueError(f"string {max(i, first)} ({table[i]!r}) equals string {min(i, first)}")


def _build_slots(hashes: np.ndarray, size: int) -> np.ndarray:
    """Slots [size] of int32 positions: each string at the first free slot from its hash,
    placed a probe step at a time for all strings at once. A slot once taken stays
    taken, so the run from a string's home slot to its own has no gap: ``find``'s
    probe meets it before any free slot."""
    slots = np.full(size, _EMPTY, np.int32)
    mask = size - 1
    pending = np.arange(len(hashes), dtype=np.int64)
    want = hashes & mask
    while pending.size:
        free = slots[want] == _EMPTY
        # Of the strings wanting one free slot, the first (lowest position) takes it.
        cand, cand_want = pending[free], want[free]
        taken, first = np.unique(cand_want, return_index=True)
        slots[taken] = cand[first]
        placed = np.zeros(pending.size, bool)
        placed[np.flatnonzero(free)[first]] = True
        pending, want = pending[~placed], (want[~placed] + 1) & mask
    return slots


def table_of(strings: Sequence[str]) -> StringTable:
    """``strings`` as a table: itself when it is one already."""
    return strings if isinstance(strings, StringTable) else StringTable.of(strings)
