"""Rotary position embedding (Su et al. 2021) as a model file describes it.

Two layouts of the rotated pairs exist among GGUF files: adjacent pairs
``(2i, 2i + 1)`` (llama.cpp's NORM, used by the llama family, whose converter
permutes Q/K for it) and the two halves ``(i, i + dim / 2)`` (NEOX: Qwen, Phi-3,
Gemma). Frequencies may be scaled linearly (``rope.scaling.factor``) or per
dimension by a ``rope_freqs`` tensor (Llama 3.1+'s long-context factors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

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
        """cos, sin of every position's angles: float32 [len(positions), dim / 2] each."""
        scaled = positions.astype(F32) * F32(self.scale)
        angles = scaled[:, None] * self.inv_freq()[None, :]
        return np.cos(angles), np.sin(angles)


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
