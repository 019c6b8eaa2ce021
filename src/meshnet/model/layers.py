"""The decoder block's math in numpy, float32, one function per equation.

Shapes: ``T`` rows of new tokens, ``d`` model width, ``H`` query heads,
``Hkv`` key/value heads, ``g = H / Hkv`` query heads per kv head, ``hd`` head
width, ``L`` cached + new positions of one sequence.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
_GELU_C = F32(np.sqrt(2.0 / np.pi))
_GELU_A = F32(0.044715)
_OAI_ALPHA = F32(1.702)
_OAI_LIMIT = F32(7.0)
ROWS = 256  # query rows per block of the reference attention


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis: ``x / rms(x) * weight``."""
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)  # [..., 1]
    return (x * (F32(1.0) / np.sqrt(variance + F32(eps)))) * weight


def causal_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    first_pos: int,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Scaled dot-product attention of one sequence's new queries over its cache.

    q [n, H, hd] for positions ``first_pos .. first_pos + n - 1``; keys and
    values [Hkv, L, hd] with ``L = first_pos + n``. Query head ``h`` reads kv
    head ``h // g``. Scores are ``q . k * scale`` (default ``1 / sqrt(hd)``),
    soft-capped as ``c * tanh(s / c)`` when ``softcap`` is ``c > 0``; with a
    ``window`` a query sees only the last ``window`` positions, itself included.
    ``sinks`` [H] (gpt-oss): head ``h``'s softmax also counts a logit ``sinks[h]``
    that has no value, so a head may attend to little of anything (llama.cpp's
    ``ggml_soft_max_add_sinks``). Returns [n, H * hd].

    Queries go ``ROWS`` at a time, each block over the keys it can see: the scores take
    ``ROWS x L`` per head, never a long prompt's whole ``n x L``.
    """
    if q.shape[0] > ROWS:
        blocks = []
        for i in range(0, q.shape[0], ROWS):
            end = first_pos + min(i + ROWS, q.shape[0])
            block = (q[i : i + ROWS], keys[:, :end], values[:, :end], first_pos + i, scale)
            blocks.append(causal_attention(*block, softcap, window, sinks))
        return np.concatenate(blocks)
    n, n_heads, hd = q.shape
    n_kv, length, _ = keys.shape
    g = n_heads // n_kv
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    qg = q.transpose(1, 0, 2).reshape(n_kv, g * n, hd)  # [Hkv, g*n, hd]
    scores = (qg @ keys.transpose(0, 2, 1)) * F32(scale)  # [Hkv, g*n, L]
    if softcap > 0:
        scores = F32(softcap) * np.tanh(scores / F32(softcap))
    scores = scores.reshape(n_kv, g, n, length)
    query_pos = first_pos + np.arange(n)[:, None]  # [n, 1]
    key_pos = np.arange(length)[None, :]  # [1, L]
    hidden = key_pos > query_pos  # [n, L]
    if window > 0:
        hidden |= query_pos - key_pos >= window
    scores = np.where(hidden, F32(-np.inf), scores)
    if sinks is None:
        probs = softmax(scores)  # [Hkv, g, n, L]
    else:
        probs = _sink_softmax(scores, np.asarray(sinks, F32).reshape(n_kv, g, 1, 1))
    out = probs.reshape(n_kv, g * n, length) @ values  # [Hkv, g*n, hd]
    return out.reshape(n_heads, n, hd).transpose(1, 0, 2).reshape(n, n_heads * hd)


def _sink_softmax(x: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with one more logit per row, ``sink`` (broadcast to
    x's rows): it takes part in the max and the total, and gets no output of its own."""
    top = np.maximum(np.max(x, axis=-1, keepdims=True), sink)
    e = np.exp(x - top)
    return e / (np.sum(e, axis=-1, keepdims=True) + np.exp(sink - top))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32, max-subtracted."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function ``1 / (1 + e^-x)``, its exponent never positive (no overflow)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, F32(1.0) / (F32(1.0) + e), e / (F32(1.0) + e))


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU / swish: ``x * sigmoid(x)``."""
    return x / (F32(1.0) + np.exp(-x))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016), as Gemma and llama.cpp use it."""
    return F32(0.5) * x * (F32(1.0) + np.tanh(_GELU_C * (x + _GELU_A * x * x * x)))


def gated(gate_up: np.ndarray, activation: str) -> np.ndarray:
    """``act(gate) * up`` for gate_up [T, 2 d_ff] = [gate | up]: the gated FFN's middle."""
    d_ff = gate_up.shape[1] // 2
    gate, up = gate_up[:, :d_ff], gate_up[:, d_ff:]
    if activation == "swiglu_oai":
        return swiglu_oai(gate, up)
    act = gelu if activation == "gelu" else silu
    return act(gate) * up  # [T, d_ff]


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: ``g sigmoid(1.702 g) (u + 1)`` with the gate clamped
    above and the up clamped both ways at 7 (OpenAI's reference, as llama.cpp runs it)."""
    g = np.minimum(gate, _OAI_LIMIT)
    u = np.clip(up, -_OAI_LIMIT, _OAI_LIMIT)
    return g / (F32(1.0) + np.exp(_OAI_ALPHA * -g)) * (u + F32(1.0))


def soft_cap(x: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(x / cap)`` (Gemma 2's logit capping); x itself when cap is 0."""
    return F32(cap) * np.tanh(x / F32(cap)) if cap > 0 else x
