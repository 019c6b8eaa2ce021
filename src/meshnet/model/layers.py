"""The llama block's math in numpy, float32, one function per equation.

Shapes: ``T`` rows of new tokens, ``d`` model width, ``H`` query heads,
``Hkv`` key/value heads, ``g = H / Hkv`` query heads per kv head, ``hd`` head
width, ``L`` cached + new positions of one sequence.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019): ``x / rms(x) * weight``; x [T, d]."""
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)  # [T, 1]
    return (x * (F32(1.0) / np.sqrt(variance + F32(eps)))) * weight


def rope_inv_freq(rope_dim: int, base: float) -> np.ndarray:
    """Rotary frequencies ``base^(-2i / rope_dim)`` for i < rope_dim / 2, float32."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.int64).astype(F32) / F32(rope_dim)
    return (F32(1.0) / (F32(base) ** exponents)).astype(F32)  # [rope_dim / 2]


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotary embedding (Su et al. 2021), adjacent-pair variant, on x [T, heads, hd].

    GGUF llama weights are permuted at conversion so that rotating pairs
    ``(2i, 2i + 1)`` here equals the half-split rotation of the original
    checkpoint. Only the first ``2 * len(inv_freq)`` dims of each head rotate.
    """
    angles = positions.astype(F32)[:, None] * inv_freq[None, :]  # [T, rope_dim / 2]
    cos = np.cos(angles)[:, None, :]  # [T, 1, rope_dim / 2]
    sin = np.sin(angles)[:, None, :]
    n = 2 * inv_freq.shape[0]
    even, odd = x[..., 0:n:2], x[..., 1:n:2]  # [T, heads, rope_dim / 2]
    out = x.copy()
    out[..., 0:n:2] = even * cos - odd * sin
    out[..., 1:n:2] = even * sin + odd * cos
    return out


def causal_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int
) -> np.ndarray:
    """Scaled dot-product attention of one sequence's new queries over its cache.

    q [n, H, hd] for positions ``first_pos .. first_pos + n - 1``; keys and
    values [Hkv, L, hd] with ``L = first_pos + n``. Query head ``h`` reads kv
    head ``h // g``. Returns [n, H * hd].
    """
    n, n_heads, hd = q.shape
    n_kv, length, _ = keys.shape
    g = n_heads // n_kv
    qg = q.transpose(1, 0, 2).reshape(n_kv, g * n, hd)  # [Hkv, g*n, hd]
    scores = (qg @ keys.transpose(0, 2, 1)) * F32(1.0 / np.sqrt(hd))  # [Hkv, g*n, L]
    scores = scores.reshape(n_kv, g, n, length)
    query_pos = first_pos + np.arange(n)[:, None]  # [n, 1]
    future = np.arange(length)[None, :] > query_pos  # [n, L]
    scores = np.where(future, F32(-np.inf), scores)
    probs = softmax(scores)  # [Hkv, g, n, L]
    out = probs.reshape(n_kv, g * n, length) @ values  # [Hkv, g*n, hd]
    return out.reshape(n_heads, n, hd).transpose(1, 0, 2).reshape(n, n_heads * hd)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32, max-subtracted."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU / swish: ``x * sigmoid(x)``."""
    return x / (F32(1.0) + np.exp(-x))


def swiglu_ffn(
    x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray
) -> np.ndarray:
    """SwiGLU feed-forward (Shazeer 2020): ``(silu(x Wg) * (x Wu)) Wd``; x [T, d]."""
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T  # [T, d]
