"""Rotary position embedding (Su et al. 2021) as a model file describes it.

Two layouts of the rotated pairs exist among GGUF files: adjacent pairs
``(2i, 2i + 1)`` (llama.cpp's NORM, used by the llama family, whose converter
permutes Q/K for it) and the two halves ``(i, i + dim / 2)`` (NEOX: Qwen, Phi-3,
Gemma). Frequencies may be scaled linearly (``rope.scaling.factor``), per
dimension by a ``rope_freqs`` tensor (Llama 3.1+'s long-context factors), or by
YaRN (gpt-oss; ``model/yarn.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from meshnet.model.yarn import Yarn, yarn_tables

F32 = np.float32
RopeStyle = Literal["pairs", "halves"]


@dataclass(frozen=True)
class Rope:
    """How one layer rotates its queries and keys."""

    style: RopeStyle
    dim: int  # leading dims of each head that rotate (even)
    base: float  # theta_i = base^(-2i / dim)
    scale: float = 1.0  # positions are multiplied by this (linear scaling: 1 / factor)
    factors: tuple[float, ...] | None = None  # theta_i is divided by factors[i] (dim / 2)
    yarn: Yarn | None = None  # YaRN: ``scale`` is its 1 / factor, blended per pair

    @property
    def pairs(self) -> int:
        return self.dim // 2

    def inv_freq(self) -> np.ndarray:
        """Per-pair angular frequencies, float32 [dim / 2]."""
        exponents = np.arange(0, self.dim, 2, dtype=np.int64).astype(F32) / F32(self.dim)
        theta = (F32(1.0) / (F32(self.base) ** exponents)).astype(F32)
        if self.factors is not None:
            theta = (theta / np.asarray(self.factors, dtype=F32)).astype(F32)
        return theta

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of every position's angles: float32 [len(positions), dim / 2] each
        (with YaRN, both times its magnitude)."""
        if self.yarn is not None:
            return yarn_tables(positions, self.dim, self.base, self.scale, self.factors, self.yarn)
        scaled = positions.astype(F32) * F32(self.scale)
        angles = scaled[:, None] * self.inv_freq()[None, :]
        return np.cos(angles), np.sin(angles)


class RopeTables:
    """cos, sin of positions for one ``Rope``, computed a fixed chunk of positions at a
    time when first needed and kept.

    A position's values are then the same numbers whichever step asks for them, as
    if the whole context's table had been made at once, without holding tables for
    a long context (Llama 3's 131072 positions: 33 MB a rope) that no sequence reaches.
    """

    CHUNK = 1024  # positions computed together, always from the same arange

    def __init__(self, rope: Rope) -> None:
        self.rope = rope
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [len(positions), pairs] of non-negative ``positions``."""
        chunk_of = positions // self.CHUNK
        first = int(chunk_of[0]) if len(chunk_of) else 0
        if len(chunk_of) and (chunk_of == first).all():  # a step's rows, nearly always
            chunk_cos, chunk_sin = self._chunk(first)
            offsets = positions - first * self.CHUNK
            return chunk_cos[offsets], chunk_sin[offsets]
        cos = np.empty((len(positions), self.rope.pairs), F32)
        sin = np.empty_like(cos)
        for c in np.unique(chunk_of):
            here = chunk_of == c
            chunk_cos, chunk_sin = self._chunk(int(c))
            offsets = positions[here] - c * self.CHUNK
            cos[here], sin[here] = chunk_cos[offsets], chunk_sin[offsets]
        return cos, sin

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        chunk = self._chunks.get(c)
        if chunk is None:
            chunk = self.rope.tables(np.arange(c * self.CHUNK, (c + 1) * self.CHUNK))
            self._chunks[c] = chunk
        return chunk


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: RopeStyle) -> np.ndarray:
    """x [T, heads, hd] with its first ``2 * pairs`` dims of each head rotated.

    cos, sin [T, pairs]. Returns a new array.
    """
    n = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, pairs]
    if style == "pairs":
        first, second = x[..., 0 : 2 * n : 2], x[..., 1 : 2 * n : 2]
    else:
        first, second = x[..., 0:n], x[..., n : 2 * n]
    out = np.array(x, dtype=F32, copy=True)
    rotated_first = first * c - second * s
    rotated_second = first * s + second * c
    if style == "pairs":
        out[..., 0 : 2 * n : 2], out[..., 1 : 2 * n : 2] = rotated_first, rotated_second
    else:
        out[..., 0:n], out[..., n : 2 * n] = rotated_first, rotated_second
    return out
